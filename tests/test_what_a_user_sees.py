"""What a user reads: the per-epoch tables, --list-recipes, --help and the CPU warning, each within 100 columns and
saying each thing once."""
import io
import math

import pytest

import cifar10_fast as cf
import cli
import imagenet_fast as inf
from conftest import small_jpeg_store
from core import DataError
from progress import epoch_table, fit

CIFAR_ROW = {"epoch": 1, "lr": 0.4, "train_loss": 1.7511622, "train_acc": 0.5102336, "test_loss": None,
             "test_acc": None, "epoch_time": 0.2030570, "total_time": 0.2030570}
IMAGENET_ROW = {"epoch": 1, "res": 160, "batch": 512, "lr": 3.7e-05, "train_loss": 6.9012, "train_acc": 0.0011,
                "val_loss": 6.8801, "top1": 0.0021, "top5": 0.0102, "epoch_time": 1234.5, "total_time": 1234.5,
                "decode": "160146h/0s"}
EXTREMES = {"epoch": 1000, "res": 288, "batch": 81920, "lr": 1.23456789e30, "train_loss": float("nan"),
            "train_acc": 1.0, "test_loss": 1.5e300, "val_loss": float("inf"), "test_acc": 0.0, "top1": -0.0,
            "top5": 1e-9, "epoch_time": 123456789.123, "total_time": 9.87e12, "decode": "nvimgcodec"}


def printed(columns, rows):
    out = io.StringIO()
    table = epoch_table(columns, file=out)
    for row in rows:
        table.append(row)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("columns, row", [(cf.COLUMNS, CIFAR_ROW), (inf.COLUMNS, IMAGENET_ROW)])
def test_each_scripts_table_keeps_every_column_fixed_and_within_100_characters(columns, row):
    extreme = {c: EXTREMES[c] for c in columns}
    lines = printed(columns, [row, extreme, row])
    assert len({len(line) for line in lines}) == 1 and len(lines[0]) <= 100, lines
    assert lines[1] == lines[3]                 # an extreme row between two real ones moves no column
    assert lines[0].split() == columns
    assert [float(v) for v in lines[2].split()[:-1]] == pytest.approx(
        [extreme[c] for c in columns[:-1]], rel=0.06, nan_ok=True)


def test_a_rate_too_small_or_too_large_for_fixed_point_is_scientific():
    lr = [line.split()[1] for line in printed(cf.COLUMNS, [{**CIFAR_ROW, "lr": v} for v in (4e-5, 1.23456789e30,
                                                                                         0.4, 12.5, 0.0)])][1:]
    assert lr == ["4.0e-05", "1.2e+30", "0.4000", "12.5000", "0.0000"]


@pytest.mark.parametrize("value, width, spec, text", [
    (0.00004, 6, ".4f", "4e-05"), (10.52, 6, ".4f", "10.520"), (123456.7, 7, ".4f", "123457"),
    (-1e30, 7, ".4f", "-1e+30"), (1e300, 7, ".4f", "1e+300"), (math.nan, 6, ".4f", "nan"), (0.0, 6, ".4f", "0.0000"),
    (99999.99, 10, ".2f", "99999.99"), (1.5e-7, 9, ".3g", "1.5e-07")])
def test_fit_keeps_a_number_to_its_width_with_a_significant_digit(value, width, spec, text):
    assert fit(value, width, spec) == text


def test_list_recipes_has_a_header_and_every_doc_whole_within_100_columns(capsys):
    for main, args, recipes in ((cf.main, [], cf.RECIPES), (inf.main, ["train"], inf.RECIPES)):
        assert main([*args, "--list-recipes"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("recipe ") and max(map(len, lines)) <= 100
        text = " ".join(" ".join(lines[1:]).split())
        for name, r in recipes.items():
            assert f"{name} {' '.join(r.doc.split())}" in text          # nothing cut


def cifar_warning(capsys, tmp_path, *flags):
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")           # the run stops at loading, after the warning
    assert cf.main(["--device", "cpu", "--data-dir", str(bad), *flags]) == 1
    return capsys.readouterr().err.splitlines()[0]


def test_the_cpu_warning_names_only_the_ways_to_shrink_not_taken(capsys, tmp_path):
    slow = "warning: no GPU in use: training on the CPU in float32, which is slow"
    assert cifar_warning(capsys, tmp_path) == f"{slow}; for a demonstration, shrink the work with --subset, --epochs " \
                                              "and --width"
    assert cifar_warning(capsys, tmp_path, "--width", "0.25", "--subset", "100") == (
        f"{slow}; for a demonstration, shrink the work with --epochs")
    assert cifar_warning(capsys, tmp_path, "--subset", "500", "--epochs", "2", "--width", "0.25") == slow


def test_the_imagenet_cpu_warning_names_only_the_ways_to_shrink_not_taken(capsys, tmp_path_factory, monkeypatch):
    store = small_jpeg_store(tmp_path_factory)

    def stop(*args, **kwargs):
        raise DataError("stopped after the warning")
    monkeypatch.setattr(inf, "place_data", stop)
    slow = "warning: no GPU in use: training on the CPU in float32, which is slow"
    for flags, line in ((["--recipe", "tiny", "--epochs", "1"], slow),
                        (["--recipe", "rn18_16ep"], f"{slow}; for a demonstration, shrink the work with few --epochs "
                                                    "and --model resnet_tiny")):
        assert inf.main(["train", "--store", str(store), "--device", "cpu", *flags]) == 1
        assert [line] == [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning")]
    monkeypatch.setattr(inf, "SMALL_STORE", 10)
    inf.main(["train", "--store", str(store), "--device", "cpu", "--recipe", "tiny", "--epochs", "1"])
    assert f"{slow}; for a demonstration, shrink the work with a small store" in capsys.readouterr().err


def parsers():
    """(name, parser) of every command line a user runs: CIFAR-10's, and ImageNet's prepare and train."""
    import argparse
    sub = next(a for a in inf.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [("cifar10_fast.py", cli.cifar10_parser(cf.__doc__)), *((f"imagenet_fast.py {name}", sub.choices[name])
                                                for name in ("prepare", "train"))]


def test_every_flag_says_what_it_does_and_its_default():
    import argparse
    for name, parser in parsers():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag, text = action.option_strings[0], " ".join((action.help or "").split())
            assert text and not text.startswith(("a number", "a whole number", "numbers separated", "(")), (name, flag)
            if not text.endswith("and exit"):           # --list-recipes, --print-recipe: commands, not settings
                assert "(default: " in text or "(required" in text, (name, flag, text)


@pytest.mark.parametrize("columns", [60, 80, 100, 200])
def test_help_fits_100_columns_and_is_shorter_than_before(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))             # what argparse reads the terminal's width from
    for name, parser in [*parsers(), ("imagenet_fast.py", inf.parser())]:
        lines = parser.format_help().splitlines()
        assert max(map(len, lines)) <= 100, (name, max(lines, key=len))
        if columns == 80 and name != "imagenet_fast.py prepare":      # 268 and 227 lines at 80 columns before
            assert len(lines) < {"cifar10_fast.py": 268, "imagenet_fast.py train": 227}.get(name, 40), name


def test_readme_figure_and_caption_come_from_results_and_check_finds_them_stale(tmp_path, capsys):
    import json
    import shutil
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    results = report.load_results(ROOT / "results")
    caption = "\n".join(report.t_figure(results))
    assert f"]({report.FIGURE})" in caption and "NVIDIA H200" in caption and "(n = 100, accuracy" in caption
    root = tmp_path / "root"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "cifar10_recipes.py", root / "cifar10_recipes.py")       # report.py writes its evidence lines
    shutil.copytree(ROOT / "results", tmp_path / "results")
    assert report.figure_is_current(report.figure_rows(results), ROOT / report.FIGURE)     # the committed one
    check = ["--check", "--root", str(root), "--results", str(tmp_path / "results")]
    assert report.main(check[1:]) == 0 and report.main(check) == 0
    (root / report.FIGURE).unlink()
    assert report.main(check) == 1 and f"out of date: {report.FIGURE}" in capsys.readouterr().err
    first = tmp_path / "results" / "nvidia-h200" / "fast94.json"
    r = json.loads(first.read_text())
    r["sides"]["fast94"]["stats"]["time"]["mean"] += 0.25
    first.write_text(json.dumps(r))
    assert report.main(check[1:]) == 0                  # redrawn, README's caption rewritten
    assert report.main(check) == 0
    drawn = (root / report.FIGURE).read_bytes()
    assert "fast94 1.830 s" in (root / "README.md").read_text()
    report.draw_figure(report.figure_rows(report.load_results(tmp_path / "results")), root / report.FIGURE)
    assert (root / report.FIGURE).read_bytes() == drawn            # the same rows, the same bytes


def test_the_cpu_warning_and_the_header_name_one_precision(capsys, tmp_path):
    from conftest import synthetic_arrays
    import numpy as np
    np.savez(tmp_path / "d.npz", **synthetic_arrays(128, 64))
    assert cf.main(["--data-dir", str(tmp_path / "d.npz"), "--device", "cpu", "--precision", "fp16", "--recipe",
                    "fast94", "--epochs", "0.5", "--width", "0.0625", "--batch-size", "64", "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines()[0].startswith("warning: no GPU in use: training on the CPU in float16, which is slow")
    assert out.out.startswith("recipe fast94 on ") and "(cpu, float16)" in out.out.splitlines()[0]


def readme_recipe_names():
    """(every `name` in the first column of README's Recipes tables, whether the section names the journey)."""
    import re
    from conftest import ROOT
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Recipes"):]
    section = section[:section.index("\n## ", 1)]
    first_cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    return set(re.findall(r"`([a-z0-9_]+)`", " ".join(first_cells))), "the journey" in section


def test_readmes_recipe_table_names_every_recipe_the_scripts_list():
    names, journey = readme_recipe_names()
    stages = {s["name"] for s in cf.JOURNEY}
    assert journey and set(cf.RECIPES) - stages - names == set() and set(inf.RECIPES) - names == set()
    assert names - set(cf.RECIPES) - set(inf.RECIPES) == set()          # and no recipe that is gone


@pytest.fixture
def report_root(tmp_path):
    """(report's main, a copy of README.md and docs/, a copy of results/) in tmp_path."""
    import shutil
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    shutil.copytree(ROOT / "docs", tmp_path / "root" / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "root" / "README.md")
    shutil.copy(ROOT / "cifar10_recipes.py", tmp_path / "root" / "cifar10_recipes.py")
    shutil.copytree(ROOT / "results", tmp_path / "results")
    return report, tmp_path / "root", tmp_path / "results"


@pytest.mark.parametrize("content, why", [
    (lambda text: text[:len(text) // 2], "not JSON: "),
    (lambda text: "", "empty"),
    (lambda text: bytes(range(256)) * 4, "not UTF-8 text"),
    (lambda text: "[1, 2]", None),
])
def test_report_refuses_an_unreadable_results_file_in_one_line_and_rewrites_nothing(report_root, capsys, content,
                                                                                    why):
    report, root, results = report_root
    bad = results / "nvidia-h200" / "fast94.json"
    new = content(bad.read_text())
    bad.write_bytes(new) if isinstance(new, bytes) else bad.write_text(new)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert report.main(["--root", str(root), "--results", str(results)]) == 1
    err = capsys.readouterr().err.splitlines()
    tail = "restore it (git checkout -- FILE) or remove it; nothing rewritten"
    if why is None:
        assert err == [f"error: {bad}: a JSON list, not a results record (a JSON object); {tail}"]
    else:
        assert len(err) == 1 and err[0].startswith(f"error: {bad}: not a readable results file ({why}")
        assert err[0].endswith(f"); {tail}")
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_report_refuses_a_root_or_results_folder_that_is_not_there(report_root, capsys, tmp_path):
    report, root, results = report_root
    assert report.main(["--root", str(tmp_path / "nowhere"), "--results", str(results)]) == 2
    assert report.main(["--root", str(root), "--results", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --root {tmp_path / 'nowhere'}: no README.md there (the folder holding README.md and docs/)",
        f"error: --results {tmp_path / 'none'}: no such folder"]


def fake_torchvision(folder, requires):
    """A torchvision in folder whose metadata requires `requires` of torch and whose import fails as one built for
    another torch does; returns the environment that finds it first."""
    import os
    info = folder / "torchvision-0.26.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchvision\nVersion: 0.26.0\n"
                                   f"Requires-Dist: numpy\nRequires-Dist: torch ({requires})\n")
    (folder / "torchvision").mkdir()
    (folder / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    return {**os.environ, "PYTHONPATH": str(folder)}


def test_a_torchvision_built_for_another_torch_is_one_line_in_the_scripts_and_the_tests(tmp_path):
    import subprocess
    import sys
    import torch
    from conftest import ROOT
    env = fake_torchvision(tmp_path / "site", "==1.0.0")
    line = (f"error: torchvision 0.26.0 requires torch==1.0.0, but torch {torch.__version__.split('+')[0]} is "
            "installed: the two do not work together (importing torchvision fails); install a matching pair: pip "
            "uninstall -y torchvision && pip install -r requirements.txt")
    for command, status, said in (
            (["cifar10_fast.py", "--data-dir", str(tmp_path / "d.npz")], 1, line),
            (["imagenet_fast.py", "train", "--store", str(tmp_path)], 1, line),
            (["-m", "pytest", "-p", "no:cacheprovider", "tests/test_core.py"], 4, f"Exit: {line}")):
        r = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        said_lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
        assert (r.returncode, said_lines) == (status, [said]), r.stdout + r.stderr


@pytest.mark.parametrize("requires, torch_version, mismatched", [
    ("==2.11.0", "2.14.1", True), ("==2.11.0", "2.11.0+cu130", False), (">=2.14.0", "2.11.0", True),
    (">=2.14.0", "2.14.1", False), (">=2.4,<2.12", "2.14.1", True), ("!=2.5.0", "2.14.1", False),
    ("==2.11.*", "2.11.0", False), ("<=2.5", "2.5.0", False), (">2.5", "2.5.0", True)])
def test_the_torchvision_check_reads_which_torch_it_requires(monkeypatch, requires, torch_version, mismatched):
    from importlib import metadata
    import versions as installed
    versions = {"torch": torch_version, "torchvision": "0.26.0"}
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    monkeypatch.setattr(metadata, "requires", lambda name: ["numpy", f"torch ({requires})", "scipy ; extra == 'x'"])
    line = installed.torchvision_mismatch()
    assert (line is not None) == mismatched
    if mismatched:
        assert line.startswith(f"torchvision 0.26.0 requires torch{requires}, but torch {torch_version} is installed")
