"""What the prose names exists: every `module.name` that README, docs/, the notebook, and the modules' comments and
docstrings mention resolves to something the module has (a renamed or deleted function leaves no stale name); and
the reading path on record in results/ is the code's as it stands."""
import importlib
import io
import json
import re
import sys
import tokenize

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
MODULES = sorted(p.stem for p in ROOT.glob("*.py")) + sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
ALIASES = {"cf": "cifar10_fast", "tb": "torch_backend", "cd": "cifar_data", "inf": "imagenet_fast",
           "idt": "imagenet_data", "ims": "imagenet_store", "T": "training", "D": "distributed"}
FILE_ENDINGS = {"py", "md", "json", "ipynb", "npz", "pt", "store", "txt", "toml", "ini"}


def mentions(text, names):
    """(module, dotted attribute path) for each `name.attr[.attr]` in text whose name is one of names."""
    pattern = re.compile(rf"(?<![\w.])({'|'.join(map(re.escape, names))})\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
    for m in pattern.finditer(text):
        path = m.group(2).split(".")
        if path[0] not in FILE_ENDINGS:
            yield ALIASES.get(m.group(1), m.group(1)), path


def prose():
    """(where, text) of every piece of prose: the markdown files' code spans, the notebook's cells, and the
    modules' comments and string literals."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            yield path.name, span, MODULES + list(ALIASES)
    for cell in json.loads((ROOT / "experiments.ipynb").read_text())["cells"]:
        yield "experiments.ipynb", "".join(cell["source"]), MODULES + ["cf"]
    for path in [*ROOT.glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.COMMENT or tok.type == tokenize.STRING and not tok.string.lower().startswith(
                    ("f", "rf", "fr")):               # an f-string is a message, its braces code
                yield path.name, tok.string, MODULES


def resolves(module, path):
    obj = importlib.import_module(module)
    for name in path:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def test_every_module_name_the_prose_mentions_exists():
    stale = sorted({f"{where}: {module}.{'.'.join(path)}" for where, text, names in prose()
                    for module, path in mentions(text, names) if not resolves(module, path)})
    assert stale == []


@pytest.mark.parametrize("text, found", [("see `cf.train_run` and torch_backend.evaluate", 2),
                                         ("cifar10_fast.py and results.json", 0)])
def test_the_mentions_are_found(text, found):
    assert len(list(mentions(text, MODULES + list(ALIASES)))) == found


@pytest.mark.parametrize("path", sorted((ROOT / "results").glob("*/reading_path.json")), ids=lambda p: p.parent.name)
def test_the_reading_path_on_record_is_the_codes_as_it_stands(path):
    """README's reading-path tables come from results/: counted again now, every recipe's path has the lines, files,
    calls, characters and places of each technique on record (after a change to the code: benchmarks/reading_path.py
    ... --out, then report.py)."""
    import reading_path
    for recorded in json.loads(path.read_text())["recipes"]:
        now = reading_path.count(recorded["recipe"])
        fields = [k for k in ("path_lines", "path_code_lines", "path_files", "skippable_lines", "calls_to_step",
                              "path_chars", "path_code_chars", "techniques") if k in recorded]   # older records: fewer
        assert {k: now[k] for k in fields} == {k: recorded[k] for k in fields}, recorded["recipe"]


@pytest.mark.parametrize("path", sorted((ROOT / "results").glob("*/reading_path.json")), ids=lambda p: p.parent.name)
def test_fast94_next_reads_in_at_most_one_and_a_half_times_the_records_characters(path):
    """The path of fast94_next on record (the test above holds it to the code) against the 2-second record's whole
    script, counted beside it: at most 1.5x its characters."""
    record = json.loads(path.read_text())
    ours = next(r["path_chars"] for r in record["recipes"] if r["recipe"] == "fast94_next")
    theirs = next(p["chars"] for p in record["peers"] if p["file"] == "cifar10_speedrun.py")
    assert ours <= 1.5 * theirs, f"{ours:,} characters, {ours / theirs:.3f}x the record's {theirs:,}"


def test_a_technique_is_touched_where_its_names_are_in_code_and_a_place_is_a_top_level_definition(tmp_path):
    import reading_path
    script = tmp_path / "script.py"
    script.write_text('hyp = {"lr": 1.0,\n       "label_smoothing": 0.2}\n\n\ndef train(model):\n'
                      '    """label_smoothing in a docstring is prose."""\n'
                      '    # and so is label_smoothing in a comment\n'
                      '    loss = loss_fn(label_smoothing=hyp["label_smoothing"])  # once, this line\n'
                      '    return model[0].flip(3)\n')
    peer = reading_path.count_peer(script)
    assert peer["techniques"]["label smoothing"] == {"places": ["script.py:2 hyp", "script.py:8 train"],
                                                     "stretches": 1, "lines": 2}           # one after the other
    assert peer["techniques"]["flips (alternating)"] == {"places": [], "stretches": 0, "lines": 0}  # a tensor's .flip()
    assert (peer["lines"], peer["code_lines"], peer["chars"]) == (9, 5, len(script.read_text()))
    assert reading_path.spans([3, 4, 5, 9, 11, 12]) == "3-5,9,11-12"
    script.write_text("def a():\n    return label_smoothing\n\n\ndef b():\n    return 0\n\n\n"
                      "def c():\n    return label_smoothing\n")
    apart = reading_path.count_peer(script)["techniques"]["label smoothing"]
    assert (len(apart["places"]), apart["stretches"]) == (2, 2)                  # b between them: two stretches


def test_benchmarks_readme_says_what_each_script_is_once():
    """benchmarks/README.md: every script of benchmarks/ in one of its tables, once, and no script that is gone."""
    listed = re.findall(r"^\| `([a-z_0-9]+\.py)` \|", (ROOT / "benchmarks" / "README.md").read_text(), re.M)
    assert sorted(listed) == sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def test_readme_stays_a_face_of_at_most_300_lines_the_rest_in_docs():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
