"""How long README's test command takes on this machine, as a whole process: wall and CPU seconds, the outcome
counts, and the load the machine carried when it started (another process on a 2-core machine doubles the time).

    python benchmarks/test_time.py --out results/<machine>/test_time.json
"""
import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402

COMMAND = ["python", "-m", "pytest"]      # README's test command, as CI runs it


def outcome_counts(tail):
    """{"passed": n, "skipped": n, ...} from pytest's last summary line."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed)", tail)}


def versions(stdout):
    """The versions pytest's header names: Python's and pytest's, and torch's, torchvision's and numpy's (conftest's
    header line), as one phrase."""
    python = re.search(r"Python (\S+), pytest-(\S+?),", stdout)
    ours = re.search(r"^torch (\S+), torchvision (\S+), numpy (\S+)$", stdout, re.M)
    if not (python and ours):
        return None
    return (f"Python {python[1]}, pytest {python[2]}, torch {ours[1]}, torchvision {ours[2]} and numpy {ours[3]}")


def workers(stdout):
    """How many pytest-xdist workers ran the tests (pytest.ini's -n), from pytest's "N workers [M items]" line; 1
    where the run had none."""
    found = re.search(r"^(\d+) workers? \[", stdout, re.M)
    return int(found[1]) if found else 1


def failed_tests(stdout):
    """The node ids of pytest's FAILED and ERROR summary lines."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, re.M)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the measurement as JSON (a results/ file for report.py)")
    p.add_argument("--fresh-environment", action="store_true",
                   help="say that this Python is a fresh virtual environment set up by README's command alone")
    args = p.parse_args(argv)
    import torch
    import machine
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *COMMAND[1:], "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    counts = outcome_counts(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")
    failed, n_workers = failed_tests(proc.stdout), workers(proc.stdout)
    print(f"{' '.join(COMMAND)}: exit status {proc.returncode}, {wall:.0f} s wall, {cpu:.0f} CPU s, "
          f"{n_workers} worker(s), {counts}, "
          f"load average {load:.2f} at the start" + "".join(f"\nfailed: {t}" for t in failed))
    if args.out:
        write_json(args.out, {"piece": "test_time", "command": " ".join(COMMAND), "exit_status": proc.returncode,
                              "wall_s": wall, "cpu_s": cpu, "workers": n_workers, "counts": counts,
                              "failed": failed, "load_average_at_start": load,
                              "versions": versions(proc.stdout), "fresh_environment": args.fresh_environment,
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
