"""How much code a reader follows to learn what a recipe computes: every function of the product's modules that a
short run of `cifar10_fast.py --recipe NAME` calls, with the recipe's own definition and the setting types it uses,
in lines (each function's whole span, once) and files, and of those lines how many are code (not blank, a comment or
a docstring); and how many calls `main` makes to reach the training step. Counted apart, as what a reader may skip:
the flags, checks, warm-up and records (the command line, settings.py, cli.py, core.py, check* and the setting types'
check methods, the FLOP count, the summary), joining torchrun's ranks (distributed.py's set-up, called for one
process too) and devices.py's decisions (a line or two each, named for what they decide). A reference script given
with --peer is counted whole, as its reader reads it.

    python benchmarks/reading_path.py --recipe fast94,fast94_next,myrtle24 --peer airbench94.py --peer \
        airbench94_muon.py --out results/<machine>/reading_path.json        # airbench's scripts, fetched
"""
import argparse
import ast
import dataclasses
import inspect
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from core import Parser, write_json  # noqa: E402

SKIPPABLE_MODULES = {"settings.py", "cli.py", "core.py"}       # flags, checks, tables, progress, records
SKIPPABLE = ("main", "parse_args", "check", "recipe_and_data", "warmup", "say_estimate", "count_flops",
             "compile_counts", "strict_compile", "take_subset", "read_npz", "load", "channel_stats", "num_classes",
             "run_record", "result_so_far", "per_rank_batch")
RANKS = ("init_from_env", "barrier", "comm_hook", "shard", "leave")


def code_lines(lines):
    """How many of a unit's source lines are code: not blank, not a comment, not in a docstring."""
    import textwrap
    tree = ast.parse(textwrap.dedent("".join(lines)))
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(lines, 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def kind(path, name):
    """What a unit of code is to a reader: "path", "skippable", "ranks" or "devices"."""
    base = name.split(".")[-1]
    if path in SKIPPABLE_MODULES or base in SKIPPABLE or base.startswith("check"):
        return "skippable"
    if path == "distributed.py" and base in RANKS:
        return "ranks"
    return "devices" if path == "devices.py" else "path"


def traced_calls(argv):
    """{(module file, qualified name): lines of its source} of every product function the command calls, nested
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
            lines = inspect.getsourcelines(code)[0]
            seen[key] = (len(lines), code_lines(lines))
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


def recipe_definition(name):
    """{(file, what): lines} of the recipe's own assignment in cifar10_recipes.py and of every setting type its value
    uses (each dataclass once, its check method apart)."""
    import cifar10_recipes
    value, out = cifar10_recipes.RECIPES[name], {}
    source = (ROOT / "cifar10_recipes.py").read_text().splitlines(keepends=True)
    tree = ast.parse("".join(source))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name.upper() for t in node.targets):
            lines = source[node.lineno - 1:node.end_lineno]
            out[("cifar10_recipes.py", name.upper())] = (len(lines), code_lines(lines))
    stack = [value]
    while stack:
        v = stack.pop()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            t = type(v)
            lines, file = inspect.getsourcelines(t)[0], Path(inspect.getsourcefile(t)).name
            check = inspect.getsourcelines(t.check)[0] if "check" in vars(t) else []
            out[(file, t.__qualname__)] = (len(lines) - len(check), code_lines(lines) - code_lines(check))
            if check:                   # its checks are what a reader may skip, as check* functions are
                out[(file, f"{t.__qualname__}.check")] = (len(check), code_lines(check))
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
    """{"path": {file: lines}, "skippable": {file: lines}, "calls_to_step": [...], "functions": [...]}"""
    with tempfile.TemporaryDirectory() as tmp:
        # small, so that a test can count again: which functions run does not depend on the sizes
        argv = ["--recipe", recipe, "--data-dir", str(tiny_npz(tmp)), "--device", "cpu", "--epochs", "2",
                "--subset", "512", "--batch-size", "128", "--width", "0.0625", "--quiet", "--eval-every", "0"]
        calls, chain = traced_calls(argv)
    types = recipe_definition(recipe)
    # a setting type's span holds its methods: each line once
    units = {**{k: n for k, n in calls.items() if (k[0], k[1].split(".")[0]) not in types}, **types}
    lines, code = defaultdict(lambda: defaultdict(int)), defaultdict(int)
    for (file, name), (n, c) in units.items():
        lines[kind(file, name)][file] += n
        code[kind(file, name)] += c
    return {"recipe": recipe, **{k: dict(v) for k, v in lines.items()}, "calls_to_step": chain,
            **{f"{k}_lines": sum(v.values()) for k, v in lines.items()}, "path_code_lines": code["path"],
            "path_files": len(lines["path"]),
            "functions": sorted(f"{file}:{name} {n} ({c} code) {kind(file, name)}"
                                for (file, name), (n, c) in units.items())}


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
    counts = []
    for name in names:
        c = count(name)
        if args.list:
            print("\n".join(c["functions"]))
        print(f"{name}: {c['path_lines']} lines ({c['path_code_lines']} of code) in {c['path_files']} files to read "
              f"({', '.join(f'{f} {n}' for f, n in sorted(c['path'].items()))}); besides, {c['devices_lines']} of "
              f"devices.py's decisions, {c.get('ranks_lines', 0)} of joining ranks and {c['skippable_lines']} of "
              f"flags, checks, warm-up and records; main reaches the step in {len(c['calls_to_step']) - 1} calls: "
              f"{' -> '.join(c['calls_to_step'])}", flush=True)
        counts.append(c)
    peers = []
    for path in args.peer:
        lines = Path(path).read_text().splitlines(keepends=True)
        peers.append({"file": Path(path).name, "lines": len(lines), "code_lines": code_lines(lines)})
        print(f"{Path(path).name}: {len(lines)} lines ({code_lines(lines)} of code) in 1 file", flush=True)
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
