"""How much code a reader follows to learn what a recipe computes: every function of the product's modules that a
short run of `cifar10_fast.py --recipe NAME` calls, with the recipe's own definition and the setting types it uses,
in lines (each function's whole span, once) and files, and of those lines how many are code (not blank, a comment or
a docstring); and how many calls `main` makes to reach the training step. Counted apart, as what a reader may skip:
the flags, checks, warm-up and records (the command line, settings.py, cli.py, core.py and the modules of what a run
prints and writes, check* and the setting types' check methods, the FLOP count, the summary), joining torchrun's
ranks (distributed.py's set-up, called for one process too) and devices.py's decisions (a line or two each, named for
what they decide). A reference script given with --peer is counted whole, as its reader reads it. Characters are
counted over the same lines as lines are.

Where each technique is touched: a line of code (comments and docstrings left out, string literals kept) touches a
technique when one of the technique's patterns (TECHNIQUES: identifiers and setting values both our code and
airbench's scripts use) is found in it; a place is one top-level definition (a function, class or statement) of a file
holding such lines on the path, shown as file:lines and its name; a stretch is a run of places one after another in
a file, no other top-level definition between them (a technique's settings class above the class that reads them:
one stretch, read top to bottom). Our places are counted on the path alone; a reference's, over its whole file.

    python benchmarks/reading_path.py --recipe fast94,fast94_next,myrtle24 --peer airbench94.py --peer \
        airbench94_muon.py --out results/<machine>/reading_path.json        # airbench's scripts, fetched
"""
import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tempfile
import tokenize
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402

SKIPPABLE_MODULES = {"settings.py", "cli.py", "core.py", "progress.py", "outputs.py", "run_statistics.py",
                     "processes.py", "versions.py"}      # flags, checks, tables, progress, records
SKIPPABLE = ("main", "parse_args", "check", "recipe_and_data", "warmup", "say_estimate", "count_flops",
             "compile_counts", "strict_compile", "take_subset", "read_npz", "load", "channel_stats", "num_classes",
             "run_record", "result_so_far", "per_rank_batch", "pools_to_one_pixel")
RANKS = ("init_from_env", "barrier", "comm_hook", "shard", "leave")


# What marks a technique on a line of code: names that survive a move between files (settings fields and flags, the
# classes' stems, the references' own names), searched in the line's code.
TECHNIQUES = {
    "whitening": r"(?i)whiten",
    "whitening bias": r"(?i)whiten\w*[._]bias|WhiteningBias|bias_grad|bias_steps|\bw\.bias\b|bias\.(param|until_step)",
    "lookahead": r"(?i)lookahead|alpha_schedule",
    "flips (alternating)": r"(?i)flip(?!\()",                      # not a tensor's .flip(): TTA's mirror
    "crops (translate)": r"(?i)crop|translate",
    "TTA": r"(?i)(?<![a-z])tta|infer_mirror",
    "label smoothing": r"label_smoothing",
    "dirac init": r"dirac",
    "batch-norm settings": r"(?i)batch_?norm|\bbn\b|\bbn_|freeze_scale|ghost_batch",
    "rate schedule": r"\bLR\w*|\.lr\.|set_lr|get_lr|LambdaLR|scheduler|initial_lr|\bknots\b",
    "rates per 1024 images (decoupled)": r"lr_units|decoupled|kilostep",
    "biases' rate x64": r"bias_lr_mult|bias_scaler|lr_biases|\bbias_lr\b",
    "Muon": r"(?i)(?<!airbench94_)muon|zeropower|newton_?schulz|\bns_\w+",     # not the script's name
}


def docstring_lines(tree):
    """The line numbers of every docstring in a parsed module, class or function."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return docs


class Source:
    """A file's lines (numbered from 1), the code of each line that is code (its comment cut off; docstrings are
    not code) and its top-level definitions' names by line."""

    def __init__(self, path):
        text = Path(path).read_text()
        self.name, self.lines = Path(path).name, text.splitlines(keepends=True)
        tree, comments = ast.parse(text), {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.start[1]
        docs = docstring_lines(tree)
        self.code = {n: line[:comments.get(n)].rstrip() for n, line in enumerate(self.lines, 1)
                     if n not in docs and line[:comments.get(n)].strip()}
        self.top, self.index = {}, {}           # line: its top-level definition's name, and its rank in the file
        for i, node in enumerate(tree.body):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]      # x = ... or x: T = ...
            name = getattr(node, "name", None) or ", ".join(ast.unparse(t) for t in targets if t) \
                or f"line {node.lineno}"
            self.top.update({n: name for n in range(first, node.end_lineno + 1)})
            self.index.update({n: i for n in range(first, node.end_lineno + 1)})

    def counts(self, numbers):
        """(lines, lines of code, characters, characters of code) of the lines `numbers`."""
        code = [n for n in numbers if n in self.code]
        return (len(numbers), len(code), sum(len(self.lines[n - 1]) for n in numbers),
                sum(len(self.lines[n - 1]) for n in code))

    def touched(self, numbers):
        """{technique: {top-level name: [line numbers]}} of the lines `numbers` that touch it."""
        out = defaultdict(lambda: defaultdict(list))
        for n in sorted(numbers):
            for technique, pattern in TECHNIQUES.items():
                if n in self.code and re.search(pattern, self.code[n]):
                    out[technique][self.top[n]].append(n)
        return out


def spans(numbers):
    """Sorted line numbers as ranges: [3, 4, 5, 9] -> "3-5,9"."""
    runs = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def techniques(sources_touched):
    """{technique: {"places": ["file:lines name", ...], "stretches": n, "lines": n}} from [(Source, touched)]: a place
    is one top-level definition, a stretch a run of places with no other top-level definition between them."""
    out = {t: {"places": [], "stretches": 0, "lines": 0} for t in TECHNIQUES}
    for source, touched in sources_touched:
        for technique, where in touched.items():
            out[technique]["places"] += [f"{source.name}:{spans(lines)} {name}" for name, lines in where.items()]
            out[technique]["stretches"] += len(spans(sorted({source.index[lines[0]] for lines in where.values()}))
                                               .split(","))
            out[technique]["lines"] += sum(len(lines) for lines in where.values())
    return out


def kind(path, name):
    """What a unit of code is to a reader: "path", "skippable", "ranks" or "devices"."""
    base = name.split(".")[-1]
    if path in SKIPPABLE_MODULES or base in SKIPPABLE or base.startswith("check"):
        return "skippable"
    if path == "distributed.py" and base in RANKS:
        return "ranks"
    return "devices" if path == "devices.py" else "path"


def traced_calls(argv):
    """{(module file, qualified name): its source's line numbers} of every product function the command calls, nested
    functions and comprehensions left to the function they stand in; and the call depth of the first step."""
    import cifar10_fast as cf
    import training
    seen, depth = {}, []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if path.parent != ROOT or "<" in code.co_qualname:
            return
        key = (path.name, code.co_qualname)
        if key not in seen:
            seen[key] = span(code)
        if code is training.train_step.__code__ and not depth:
            depth.append(calls_from_main(frame))
    sys.setprofile(profile)
    try:
        rc = cf.main(argv)
    finally:
        sys.setprofile(None)
    if rc != 0:
        raise SystemExit(f"the traced run failed with exit status {rc}")
    return seen, depth[0] if depth else None


def calls_from_main(frame):
    """The calls between cifar10_fast.main and this frame: product functions only (a library's frames and
    generators' resumptions are not calls a reader follows)."""
    chain = []
    while frame is not None:
        code = frame.f_code
        if Path(code.co_filename).parent == ROOT and "<" not in code.co_qualname:
            chain.append(f"{Path(code.co_filename).stem}.{code.co_qualname}")
        if code.co_qualname == "main" and code.co_filename.endswith("cifar10_fast.py"):
            break
        frame = frame.f_back
    return list(reversed(chain))


def span(obj):
    """The line numbers of a function's, class's or code object's source."""
    lines, first = inspect.getsourcelines(obj)
    return range(first, first + len(lines))


def recipe_definition(name):
    """{(file, what): line numbers} of the recipe's own assignment (NAME = ..., in whichever product module holds
    it) and of every setting type its value uses (each dataclass once, its check method apart)."""
    import cifar10_fast as cf
    value, out = cf.RECIPES[name], {}
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name.upper() for t in node.targets):
                out[(path.name, name.upper())] = range(node.lineno, node.end_lineno + 1)
    stack = [value]
    while stack:
        v = stack.pop()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            t = type(v)
            file, check = Path(inspect.getsourcefile(t)).name, span(t.check) if "check" in vars(t) else range(0)
            out[(file, t.__qualname__)] = [n for n in span(t) if n not in check]
            if check:                   # its checks are what a reader may skip, as check* functions are
                out[(file, f"{t.__qualname__}.check")] = check
            stack += [getattr(v, f.name) for f in dataclasses.fields(v)]
    return out


def tiny_npz(folder):
    """2,048 training and 256 test images of noise in CIFAR-10's shapes: the path does not depend on the pixels."""
    rng = np.random.default_rng(0)
    path = Path(folder) / "tiny.npz"
    np.savez(path, train_images=rng.integers(0, 256, (2048, 32, 32, 3), dtype=np.uint8),
             train_labels=rng.integers(0, 10, 2048), test_images=rng.integers(0, 256, (256, 32, 32, 3), dtype=np.uint8),
             test_labels=rng.integers(0, 10, 256))
    return path


def count(recipe):
    """{"path": {file: lines}, "skippable": {file: lines}, "calls_to_step": [...], "functions": [...], "path_chars": n,
    "techniques": {technique: {"places": ["file:lines name", ...], "lines": n}}, ...}"""
    with tempfile.TemporaryDirectory() as tmp:
        # small, so that a test can count again: which functions run does not depend on the sizes
        argv = ["--recipe", recipe, "--data-dir", str(tiny_npz(tmp)), "--device", "cpu", "--epochs", "2",
                "--subset", "512", "--batch-size", "128", "--width", "0.0625", "--quiet", "--eval-every", "0"]
        calls, chain = traced_calls(argv)
    types = recipe_definition(recipe)
    # a setting type's span holds its methods: each line once
    units = {**{k: n for k, n in calls.items() if (k[0], k[1].split(".")[0]) not in types}, **types}
    sources = {file: Source(ROOT / file) for file, _ in units}
    lines, totals, path = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: [0, 0, 0, 0]), defaultdict(set)
    for (file, name), numbers in units.items():
        counts = sources[file].counts(numbers)
        lines[kind(file, name)][file] += counts[0]
        totals[kind(file, name)] = [a + b for a, b in zip(totals[kind(file, name)], counts)]
        if kind(file, name) == "path":
            path[file].update(numbers)
    return {"recipe": recipe, **{k: dict(v) for k, v in lines.items()}, "calls_to_step": chain,
            **{f"{k}_lines": sum(v.values()) for k, v in lines.items()}, "path_code_lines": totals["path"][1],
            "path_files": len(lines["path"]), "path_chars": totals["path"][2], "path_code_chars": totals["path"][3],
            "skippable_chars": totals["skippable"][2],
            "techniques": techniques([(sources[file], sources[file].touched(numbers))
                                      for file, numbers in path.items()]),
            "functions": sorted(f"{file}:{name} {len(numbers)} ({sources[file].counts(numbers)[1]} code) "
                                f"{kind(file, name)}" for (file, name), numbers in units.items())}


def count_peer(path):
    """A reference script counted whole: {"file", "lines", "code_lines", "chars", "code_chars", "techniques"}."""
    source = Source(path)
    numbers = range(1, len(source.lines) + 1)
    lines, code, chars, code_chars = source.counts(numbers)
    return {"file": source.name, "lines": lines, "code_lines": code, "chars": chars, "code_chars": code_chars,
            "techniques": techniques([(source, source.touched(numbers))])}


def print_techniques(counted):
    """Per technique, the places (and lines) of each of `counted` (recipes' counts and peers') that touch it; then
    where."""
    names = [c.get("recipe") or c["file"] for c in counted]
    table = Table(["technique: places in stretches (lines)"] + names, width=12)
    for t in TECHNIQUES:
        table.append({"technique: places in stretches (lines)": t, **{n: place_text(c["techniques"][t])
                                                                      for n, c in zip(names, counted)}})
    for name, c in zip(names, counted):
        for t, touched in c["techniques"].items():
            if touched["places"]:
                print(f"{name}, {t}: {'; '.join(touched['places'])}")


def place_text(touched):
    """"6 in 3 (17)": a technique's places, the stretches they make and its lines."""
    return f"{len(touched['places'])} in {touched.get('stretches', '?')} ({touched['lines']})"


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fast94", help="cifar10_fast recipes, comma-separated (default fast94)")
    p.add_argument("--list", action="store_true", help="also print every function and type counted")
    p.add_argument("--peer", action="append", default=[], metavar="FILE",
                   help="a reference script whose whole file is its path (airbench94.py), counted beside ours")
    p.add_argument("--out", default=None, help="write the counts as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    import cifar10_fast as cf
    names = args.recipe.split(",")
    for name in names:
        if name not in cf.RECIPES:
            p.error(f"--recipe {name}: unknown; choose from {', '.join(cf.RECIPES)}")
    for path in args.peer:
        if not Path(path).is_file():
            p.error(f"--peer {path}: no such file (benchmarks/compare.py's PEERS: the command that clones each)")
    counts = []
    for name in names:
        c = count(name)
        if args.list:
            print("\n".join(c["functions"]))
        print(f"{name}: {c['path_lines']} lines ({c['path_code_lines']} of code), {c['path_chars']:,} characters "
              f"({c['path_code_chars']:,} of code) in {c['path_files']} files to read "
              f"({', '.join(f'{f} {n}' for f, n in sorted(c['path'].items()))}); besides, {c['devices_lines']} of "
              f"devices.py's decisions, {c.get('ranks_lines', 0)} of joining ranks and {c['skippable_lines']} of "
              f"flags, checks, warm-up and records; main reaches the step in {len(c['calls_to_step']) - 1} calls: "
              f"{' -> '.join(c['calls_to_step'])}", flush=True)
        counts.append(c)
    peers = [count_peer(path) for path in args.peer]
    for peer in peers:
        print(f"{peer['file']}: {peer['lines']} lines ({peer['code_lines']} of code), {peer['chars']:,} characters "
              f"({peer['code_chars']:,} of code) in 1 file", flush=True)
    for c in counts:
        for peer in peers:      # what the reader of a recipe reads against the reference's whole file
            print(f"{c['recipe']}: {c['path_chars'] / peer['chars']:.2f}x {peer['file']}'s characters", flush=True)
    print_techniques(counts + peers)
    if args.out:
        import machine
        import torch
        command = " ".join(["python benchmarks/reading_path.py --recipe", args.recipe,
                            *(f"--peer {Path(p).name}" for p in args.peer)])
        write_json(args.out, {"piece": "reading_path", "recipes": counts, "peers": peers, "command": command,
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
