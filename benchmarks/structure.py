"""The shape of the code: its modules (each root .py file, and benchmarks/ as one), the imports between them (an
arrow: A imports B) and how many levels they stand on (a module stands above everything it imports), at the commits
given, read from git with nothing run.

    python benchmarks/structure.py --rev 9db92d0 --rev HEAD --out results/<machine>/structure.json
"""
import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402


def files_at(rev):
    """{path: source} of the root's .py files and benchmarks/*.py at git revision rev."""
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], check=True, capture_output=True, text=True).stdout
    paths = [p for p in git("ls-tree", "-r", "--name-only", rev).split("\n")
             if p.endswith(".py") and (p.count("/") == 0 or (p.startswith("benchmarks/") and p.count("/") == 1))]
    return {p: git("show", f"{rev}:{p}") for p in paths}


def arrows(files):
    """{module: the modules it imports}: a root file is a module of its own name, benchmarks/ one module."""
    module = lambda path: "benchmarks/" if path.startswith("benchmarks/") else path[:-3]
    modules = {module(p) for p in files}
    out = {m: set() for m in modules}
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            out[module(path)].update(n.split(".")[0] for n in names if n.split(".")[0] in modules - {module(path)})
    return out


def levels(graph):
    """{module: its level}: 1 for a module that imports none of the others, else one above the highest it imports."""
    memo = {}

    def level(m):
        if m not in memo:
            memo[m] = 1 + max((level(d) for d in graph[m]), default=0)
        return memo[m]
    return {m: level(m) for m in graph}


def shape(rev):
    graph = arrows(files_at(rev))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    return {"rev": rev, "commit": commit, "modules": len(graph), "arrows": sum(map(len, graph.values())),
            "levels": max(levels(graph).values()), "imports": {m: sorted(d) for m, d in sorted(graph.items())}}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", action="append", default=None, metavar="REV", help="a git revision (default: HEAD)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the shapes as JSON (default: none)")
    args = p.parse_args(argv)
    shapes = [shape(rev) for rev in args.rev or ["HEAD"]]
    table = Table(["rev", "modules", "arrows", "levels"])
    for s in shapes:
        table.append({k: s[k] for k in ("rev", "modules", "arrows", "levels")})
    if args.out:
        write_json(args.out, {"piece": "structure", "command": "python benchmarks/structure.py " + " ".join(
            f"--rev {r}" for r in args.rev or ["HEAD"]), "shapes": shapes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
