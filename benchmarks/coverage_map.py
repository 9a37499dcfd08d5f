"""The coverage map: the default test suite (README's test command) run under coverage.py, branches measured and the
Python processes it starts measured too (torchrun's ranks, the scripts it runs as a user would, prepare's workers),
and for each module the lines and branches no test executes. Which of devices.py's lines no CPU test reaches is
listed with the line itself: the device decisions are there, so anything left is a call that needs a real GPU.

    python benchmarks/coverage_map.py --out results/<machine>/coverage.json      # about twice the test run's time
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402

COMMAND = "python benchmarks/coverage_map.py"


def modules():
    """The product's modules: the repository root's and the benchmarks'."""
    return sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])


def run_suite(data_file, pytest_args):
    """Runs the tests under coverage (pyproject.toml's [tool.coverage.run]) and combines every process's data; the
    tests' exit status."""
    env = {**os.environ, "COVERAGE_FILE": str(data_file)}
    cov = [sys.executable, "-m", "coverage"]
    subprocess.run([*cov, "erase"], cwd=ROOT, env=env, check=True)
    rc = subprocess.run([*cov, "run", "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args], cwd=ROOT,
                        env=env).returncode
    subprocess.run([*cov, "combine", "-q"], cwd=ROOT, env=env, check=True)
    return rc


def per_module(data_file):
    """{module: {"statements", "missing lines", "branches", "missing branches"}} from coverage's JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "coverage.json"
        subprocess.run([sys.executable, "-m", "coverage", "json", "-q", "-o", str(out), "--include",
                        ",".join(modules())], cwd=ROOT, env={**os.environ, "COVERAGE_FILE": str(data_file)},
                       check=True)
        files = json.loads(out.read_text())["files"]
    return {name: {"statements": f["summary"]["num_statements"], "missing lines": f["missing_lines"],
                   "branches": f["summary"]["num_branches"], "missing branches": f["missing_branches"]}
            for name, f in sorted(files.items())}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the map as JSON (a results/ file for benchmarks/report.py)")
    args, pytest_args = p.parse_known_args(argv)      # the rest goes to pytest (default: the default test run)
    args.pytest_args = pytest_args
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / ".coverage"
        rc = run_suite(data_file, args.pytest_args)
        files = per_module(data_file)
    source = (ROOT / "devices.py").read_text().splitlines()
    unrun = [{"line": n, "code": source[n - 1].strip()} for n in files.get("devices.py", {}).get("missing lines", [])]
    for name, f in files.items():
        covered = 1 - len(f["missing lines"]) / max(1, f["statements"])
        print(f"{name:32s} {f['statements']:5d} statements, {covered:6.1%} run; {len(f['missing branches'])} of "
              f"{f['branches']} branches never taken")
    print(f"devices.py lines no test runs: {len(unrun)}" + "".join(f"\n  {u['line']}: {u['code']}" for u in unrun))
    if args.out:
        import torch
        import machine
        write_json(args.out, {"piece": "coverage", "command": COMMAND, "tests_exit_status": rc, "files": files,
                              "devices_unrun": unrun,
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return rc


if __name__ == "__main__":
    sys.exit(main())
