"""Our fast recipes against a peer, alternating runs on one device and the same data. The peer is the installed
`airbench` package (its trainNN, in this process, on our clock) or any reference script (--peer-script: each run a
fresh process, on its own clock, as its output says).

    pip install airbench          # the package peer; this script installs nothing
    python benchmarks/side_by_side.py --runs 25                     # fast94 vs airbench94, ...
    python benchmarks/side_by_side.py --recipes fast94 --runs 100 --peer-runs 25 --compile max-autotune --out sbs.json
    python benchmarks/side_by_side.py --recipes fast94_next --runs 25 --compile max-autotune \
        --peer-script airbench94_muon.py --peer-pattern airbench-table --out sbs.json
    python benchmarks/side_by_side.py --recipes fast94_next --runs 25 --peer-runs 25 --compile max-autotune \
        --peer record --out sbs.json                 # the record's own script, fetched into peers/cifar10-speedrun/

Ours, in both modes. Every run trains one network and evaluates it once, at its end, with the recipe's test-time
augmentation (eval_every=0: no per-epoch evaluation inside a timed comparison). Its time is the recipe's own `time`
(cifar10_fast.train_run: train_time + final_eval_time): CUDA events on a GPU, the host's clock after a device synchronise
elsewhere, started once the network is built (building it, here re-initialising the prepared network, and its
optimisers are outside the clock, as airbench's scripts start theirs after model construction) and covering the
whitening fit, augmentation, every step and the final evaluation. Outside it too: loading the data from disk and
uploading it, and prepare()'s untimed warm-up (cuDNN's autotuning, torch.compile; on an accelerator or with
--compile).

The airbench package (--peer airbench, the default; CUDA only). Both loaders are built before its clock (airbench's
train() would load the test set inside it, so it is handed the loaded one); the peer's clock is the host's after a
device synchronise, around its train() with its defaults (model construction, which ours leaves out, whitening fit,
training; verbose=False: no per-epoch evaluation) and its evaluation at its own default TTA level. Its own make_net
is timed apart inside that clock (construct_s, the host's), so that the suite's report gives the ratio with it left
out too. One untimed warm-up run of the peer comes first.

A reference script (--peer-script PATH: the record scripts such as airbench94_muon.py or the 2-second speedrun's,
which no package holds). Each peer run is `sys.executable PATH ARGS` (--peer-args, shell-quoted) in a fresh
process, its working directory a temporary folder holding our data as ./cifar10/train.pt and ./cifar10/test.pt
(write_airbench_layout: dicts of `images` uint8 NHWC, `labels` int64, `classes`; airbench-style scripts read
exactly these from their working directory), or --peer-cwd, a folder of one's own, used as it is. Where ours runs
on cuda:N the script sees that GPU alone, as its default one (CUDA_VISIBLE_DEVICES). Its accuracy and time are the
LAST match in its stdout of --peer-pattern, a regular expression (searched case-insensitively) with the named groups
`acc` and `time` (time in seconds). The default, PEER_PATTERN, matches a line such as "accuracy 0.9412 time 3.21 s"
or "val_acc: 94.12%, time: 3.21": the word acc or accuracy, non-word characters, a number (digits, optionally a
point and digits) that is acc, then on the same line, with no other "acc" between, the word time, non-word
characters, and a number that is time. `--peer-pattern airbench-table` reads the table airbench's scripts print
(airbench94_muon.py's final `eval` row: tta_val_acc and time_seconds). An acc above 1, or followed in the output by
"%", is a percentage (94.12 and 94.12% are 0.9412; 0.9412 is a fraction). A script that trains several runs in one
process contributes only its last: have it train one (airbench94_muon.py trains a warm-up and 200; its own warm-up
is off its own clock). Its time is what it prints, on its own clock: the same clock as ours only where the script
times as ours does (CUDA events from after model construction to the end of its final evaluation, per-epoch
evaluations left out; airbench94_muon.py nearly does, its loader's normalising and padding inside its clock), which
nothing here can check, so the table is headed "time as each reports it". A bad flag stops it before anything
runs, with one line (exit status 2); a peer run that exits non-zero, prints no match, or matches something that is
not an accuracy and a time stops the comparison with one line (exit status 1).

The 2-second record (--peer record: hiverge/cifar10-speedrun's own cifar10_speedrun.py, fetched into the git-ignored
peers/cifar10-speedrun/ or --record-dir, never committed; its run.sh, which sets the GPU's clocks, is never run). Its
process trains a warm-up and then a run count in one loop, `for run in range(200):`, the one line edited (to the runs
of its turn; the edit and the script's sha256 go with every run), in a temporary folder holding our data as
./cifar10/{train,test}.pt, where it loads it. Its runs are --peer-runs in --record-processes processes (default 1),
each in the middle of its share of ours (centred: 13 of ours, the record's 25, 12 of ours), because each process
compiles max-autotune and warms up again, off its clock. Each run's accuracy (tta_val_acc, as its summary averages)
and time (its CUDA events from its model reset and optimisers built to the end of its TTA evaluation, as ours times
from the network built) are read from the last row of that run in its printed table (epoch "eval"; the warm-up's
left out), read line by line as it prints them, each saved at once (a deadline loses only the run in flight), and
each process's own summary means and its wall time on our clock are kept beside them. Before each run
it spins the GPU for 6e9 cycles (about 3 s), outside its clock; ours does not. An absent script is one line (exit
status 1); a process that fails or prints a table without its runs 1 to N stops the comparison with one line.

--alternate (with --peer none) builds every --recipes recipe once in this process and runs them in turn (A, B, A, B,
...), each row's time ratio over the first recipe's: fast94_fastest and its ablations beside fast94_next.

Runs alternate (ours, peer, ours, peer, ...; with fewer peer runs, each follows the run of ours it is due after) so
that clock and thermal drift fall on both alike. The table gives n, mean accuracy ± std, the one-sided p-value of
"mean > target", the mean time ± std and our mean time over the peer's with its 95% confidence interval. `--out` is
rewritten after every run (a peer script's rows hold the text it matched and the raw acc and time).
"""
import argparse
import contextlib
import hashlib
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar10_fast as cf  # noqa: E402
import cifar_data as cd  # noqa: E402
import devices  # noqa: E402
import distributed as D  # noqa: E402
import training as T  # noqa: E402
from cli import environment  # noqa: E402
from settings import flat  # noqa: E402
from core import DataError, Parser, Table, UsageError, one_sided_p, ratio_ci, summarize, write_json  # noqa: E402

# Our recipe → (the airbench package's trainer for the same target: its function suffix, the target accuracy).
# airbench94_muon.py and the 2-second record are scripts, not in the package: the Muon recipes run beside train94.
PEERS = {"fast94": ("94", 0.94), "fast95": ("95", 0.95), "fast96": ("96", 0.96), "fast94_muon": ("94", 0.94),
         "fast94_next": ("94", 0.94)}


# What a peer script must print, by default: its final accuracy and its time, on one line such as
# "accuracy 0.9412 time 3.21 s" or "val_acc: 94.12%, time: 3.21" (the accuracy nearest before the time: no other
# "acc" between them); the last such line counts. Anything else: --peer-pattern, a regular expression with the
# named groups acc and time, or the name of one of PEER_PATTERNS.
PEER_PATTERN = r"acc(?:uracy)?\W+(?P<acc>\d+(?:\.\d+)?)(?:(?!acc).)*?time\W+(?P<time>\d+(?:\.\d+)?)"
PEER_PATTERNS = {
    "default": PEER_PATTERN,
    # the table airbench's scripts print (print_training_details): a run's last row has epoch "eval", then the
    # columns train_acc, val_acc, tta_val_acc, time_seconds
    "airbench-table": r"\|\s*eval\s*\|[^|\n]*\|[^|\n]*\|\s*(?P<acc>\d+(?:\.\d+)?)\s*\|\s*(?P<time>\d+(?:\.\d+)?)\s*\|",
}


def peer_pattern(text):
    """The compiled --peer-pattern (a name in PEER_PATTERNS, or a regular expression), case-insensitive; ValueError
    naming what is wrong."""
    try:
        pattern = re.compile(PEER_PATTERNS.get(text, text), re.I)
    except re.error as e:
        raise ValueError(f"--peer-pattern {text!r}: not a regular expression ({e})") from None
    missing = {"acc", "time"} - set(pattern.groupindex)
    if missing:
        raise ValueError(f"--peer-pattern {text!r}: needs the named groups acc and time (missing: "
                         f"{', '.join(sorted(missing))})")
    return pattern


# The 2-second record (hiverge/cifar10-speedrun): its own script, fetched into this git-ignored folder and never
# committed; each process runs it with one edit, its run count. Its run.sh sets the GPU's clocks and is never run.
RECORD_DIR = Path(__file__).resolve().parents[1] / "peers" / "cifar10-speedrun"
RECORD_SCRIPT = "cifar10_speedrun.py"
RECORD_LOOP = re.compile(r"^(?P<indent>[ \t]*)for run in range\((?P<runs>\d+)\):", re.M)
# a run's final row of its table: run, "eval", train_acc, val_acc, tta_val_acc, time_seconds (its CUDA events)
RECORD_ROW = re.compile(r"\|\s*(?P<run>\w+)\s*\|\s*eval\s*\|\s*(?P<train_acc>\d+\.\d+)\s*\|"
                        r"\s*(?P<val_acc>\d+\.\d+)\s*\|\s*(?P<acc>\d+\.\d+)\s*\|\s*(?P<time>\d+\.\d+)\s*\|")
RECORD_SUMMARY = re.compile(r"Accuracies: Mean: (?P<acc>\d+\.\d+)\s+Std: \S+\s*\n"
                            r"\s*Times \(s\):\s+Mean: (?P<time>\d+\.\d+)")


def record_source(folder):
    """The record's script in folder, as text; UsageError in one line where it is absent."""
    path = Path(folder) / RECORD_SCRIPT
    if not path.is_file():
        raise UsageError(f"the record's script is not at {path}: fetch github.com/hiverge/cifar10-speedrun's "
                         f"{RECORD_SCRIPT} into {Path(folder)} (git-ignored; its run.sh is never run)")
    return path.read_text()


def with_run_count(source, runs):
    """(the record's source with its run loop cut to `runs`, the edit in words); DataError where its loop is not
    found exactly once (the script changed: nothing is run that was not read)."""
    loops = list(RECORD_LOOP.finditer(source))
    if len(loops) != 1:
        raise DataError(f"{RECORD_SCRIPT}: {len(loops)} lines 'for run in range(N):' where its run count should be "
                        f"one: it is not the script this harness reads")
    m = loops[0]
    edited = f"{m['indent']}for run in range({runs}):"
    return source[:m.start()] + edited + source[m.end():], f"{m.group(0).strip()} -> {edited.strip()}"


def read_record_output(output, runs):
    """The runs of one record process from its printed table: each run's last row (epoch "eval"; its warm-up's left
    out) as {"run", "final_acc" (tta_val_acc, which its summary averages), "time" (its own clock), "val_acc",
    "train_acc"}, and its summary's means; DataError, in one line, where the table does not hold runs 1..runs."""
    rows = [m for m in RECORD_ROW.finditer(output) if m["run"] != "warmup"]
    if [m["run"] for m in rows] != [str(k) for k in range(1, runs + 1)]:
        raise DataError(f"{RECORD_SCRIPT}: its table holds the runs {[m['run'] for m in rows]}, not 1 to {runs}; "
                        f"its output ends {output[-200:]!r}")
    summary = RECORD_SUMMARY.search(output)
    return ([{"run": int(m["run"]), "final_acc": float(m["acc"]), "time": float(m["time"]),
              "val_acc": float(m["val_acc"]), "train_acc": float(m["train_acc"])} for m in rows],
            summary and {"mean_acc": float(summary["acc"]), "mean_time": float(summary["time"])})


def run_record(source, runs, *, cwd, env, process, on_run=None):
    """One process of the record's script, its run count edited to `runs`, in cwd (our data as ./cifar10/): its runs
    (read_record_output), each marked with the process, and the process's own line {"runs", "edit", "wall_s",
    "summary"}. Its output is read line by line: on_run(run) is called as each run's row is printed, so that a
    deadline loses only the run in flight. A process that fails, or whose table is not whole, raises DataError."""
    edited, edit = with_run_count(source, runs)
    script = Path(cwd) / RECORD_SCRIPT
    script.write_text(edited)
    t0 = time.perf_counter()
    lines = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        for line in proc.stdout:
            lines.append(line)
            for m in RECORD_ROW.finditer(line):
                if m["run"] != "warmup" and on_run is not None:
                    on_run({"run": int(m["run"]), "final_acc": float(m["acc"]), "time": float(m["time"]),
                            "val_acc": float(m["val_acc"]), "train_acc": float(m["train_acc"]), "process": process})
        returncode = proc.wait()
        err.seek(0)
        stderr = err.read()
    wall_s = time.perf_counter() - t0
    if returncode:
        how = (f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}")
        tail = " ".join(stderr.strip().splitlines()[-3:])[-200:] or "(nothing on stderr)"
        raise DataError(f"{RECORD_SCRIPT} {how}: {tail}")
    rows, summary = read_record_output("".join(lines), runs)
    return [{**r, "process": process} for r in rows], {"runs": runs, "edit": edit, "wall_s": wall_s,
                                                      "summary": summary}


def split_runs(n, parts):
    """n runs in `parts` processes, as even as can be, the larger first."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def peer_environment(device, environ):
    """The peer script's environment: ours, with CUDA_VISIBLE_DEVICES narrowed to our GPU where ours runs on
    cuda:N, so that a script that takes the default GPU (.cuda(), "cuda") runs on the same one."""
    env = dict(environ)
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[device.index] if device.index < len(visible) else str(device.index)
    return env


def read_peer_output(output, pattern, *, script):
    """A peer run's result from its stdout: the last match of pattern. acc above 1, or followed by "%", is a
    percentage. DataError, in one line, when nothing matches or a match holds no accuracy and time."""
    found = list(pattern.finditer(output))
    if not found:
        raise DataError(f"{script}: no line of its output matches --peer-pattern {pattern.pattern!r}; its output "
                        f"ends {output[-200:]!r}")
    m = found[-1]
    try:
        acc, seconds = float(m["acc"]), float(m["time"])
    except (TypeError, ValueError):
        acc = seconds = None
    percent = acc is not None and (acc > 1 or output[m.end("acc"):m.end("acc") + 1] == "%")
    acc = acc / 100 if percent else acc
    if acc is None or not 0 <= acc <= 1 or not seconds >= 0:
        raise DataError(f"{script}: --peer-pattern {pattern.pattern!r} matched {m.group(0)!r}, whose acc "
                        f"{m['acc']!r} and time {m['time']!r} are not an accuracy and a time in seconds")
    return {"final_acc": acc, "time": seconds, "matched": m.group(0), "acc_raw": m["acc"], "time_raw": m["time"],
            "percent": percent}


def run_peer_script(script, *, args, cwd, pattern, env=None):
    """One run of a peer script in a fresh process (cwd holds ./cifar10/{train,test}.pt): its accuracy and time as
    its output's last match of pattern says (read_peer_output). A run that fails or prints no match raises
    DataError, in one line."""
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-200:] or "(nothing on stderr)"
        raise DataError(f"{script} {how}: {tail}")
    return read_peer_output(proc.stdout, pattern, script=script)


def import_airbench():
    try:
        import airbench
        return airbench
    except ImportError:
        return None


def write_airbench_layout(arrays, folder):
    """Writes our arrays as airbench's cache files; returns the folder holding `cifar10/`."""
    d = Path(folder) / "cifar10"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        torch.save({"images": torch.from_numpy(arrays[f"{split}_images"]),
                    "labels": torch.from_numpy(arrays[f"{split}_labels"]).long(),
                    "classes": list(cd.CLASSES)}, d / f"{split}.pt")
    return Path(folder)


def peer_loaders(airbench, suffix):
    """The training loader train{suffix} builds by default, and a test loader, both loaded before any clock."""
    lib = getattr(airbench, f"lib_airbench{suffix}")
    return (airbench.CifarLoader("cifar10", train=True, batch_size=lib.hyp["opt"]["batch_size"], aug=lib.hyp["aug"],
                                 altflip=True),
            airbench.CifarLoader("cifar10", train=False, batch_size=2000))


@contextlib.contextmanager
def loaded_test_set(airbench, test_loader):
    """airbench.utils.train builds CifarLoader('cifar10', train=False) inside itself, a read from disk and an
    upload that our clock does not include for our side: it gets the loader loaded before the clock instead."""
    load = airbench.utils.CifarLoader
    airbench.utils.CifarLoader = lambda *args, train=True, **kwargs: (load(*args, train=train, **kwargs) if train
                                                                       else test_loader)
    try:
        yield
    finally:
        airbench.utils.CifarLoader = load


def time_peer(airbench, suffix, *, loader, test_loader, sync):
    """One peer run on our clock: its train function with its defaults (model construction, whitening,
    training) plus the evaluation at its own default TTA level; construct_s is its own make_net's share of that
    time, which ours leaves out (the host's clock, unsynchronised: the few kernels it queues are not waited for),
    eval_s the evaluation's (train() returns synchronised)."""
    train, lib = getattr(airbench, f"train{suffix}"), getattr(airbench, f"lib_airbench{suffix}")
    construct_s = []

    def make_net():                 # the peer's own constructor, told apart on the clock
        t = time.perf_counter()
        net = getattr(lib, f"make_net{suffix}")()
        construct_s.append(time.perf_counter() - t)
        return net
    sync()
    t0 = time.perf_counter()
    with loaded_test_set(airbench, test_loader):
        model = train(loader, make_net=make_net, verbose=False)
    t1 = time.perf_counter()
    acc = airbench.evaluate(model, test_loader, tta_level=lib.hyp["net"]["tta_level"])
    sync()
    t2 = time.perf_counter()
    return {"final_acc": acc, "time": t2 - t0, "construct_s": sum(construct_s), "eval_s": t2 - t1}


def alternation(n_ours, n_peer):
    """The order of the runs: ours and the peer's in turn, each peer run after the run of ours it is due
    after when the counts differ (4 of ours per peer run for 100 and 25)."""
    order = []
    for i in range(n_ours):
        order.append("ours")
        order += ["peer"] * ((i + 1) * n_peer // n_ours - order.count("peer"))
    return order + ["peer"] * (n_peer - order.count("peer"))


def centred(n_ours, n_turns):
    """The order of ours and the peer's turns (a record process each), each turn in the middle of its share of
    ours: the k-th after run ceil(n_ours (2k + 1) / (2 n_turns)) of ours (13 of 25, the record's, then 12)."""
    after = [math.ceil(n_ours * (2 * k + 1) / (2 * n_turns)) for k in range(n_turns)]
    order = []
    for i in range(n_ours + 1):
        order += ["peer"] * after.count(i) + ["ours"] * (i < n_ours)
    return order


def stats_row(name, results, target, reference=None):
    acc = summarize([r["final_acc"] for r in results])
    t = summarize([r["time"] for r in results])
    p = one_sided_p([r["final_acc"] for r in results], target)
    ci = ratio_ci([r["time"] for r in results], [r["time"] for r in reference]) if reference else None
    ratio = t["mean"] / summarize([r["time"] for r in reference])["mean"] if reference and results else None
    blank = lambda v: "" if v is None else v
    return {"recipe": name, "n": len(results), "mean_acc": blank(acc["mean"]), "std_acc": blank(acc["std"]),
            "p_above_target": blank(p), "mean_time": blank(t["mean"]), "std_time": blank(t["std"]),
            "time_ratio": blank(ratio),
            "ratio_lo95": blank(ci and ci["low"]), "ratio_hi95": blank(ci and ci["high"])}


def peer_script_flags(args):
    """--peer-script and the flags that go with it, checked before any work: (script, compiled pattern, its
    arguments, the folder it runs in or None for a temporary one), or Nones without --peer-script; ValueError in one
    line for a bad flag."""
    given = [f"--peer-{k}" for k in ("args", "pattern", "cwd") if getattr(args, f"peer_{k}") is not None]
    if args.peer == "record" and (args.peer_script or given):
        raise ValueError(f"--peer record and {args.peer_script and '--peer-script' or given[0]}: choose one")
    if not args.peer_script:
        if given:
            raise ValueError(f"{' and '.join(given)}: only with --peer-script")
        return None, None, None, None
    if args.peer != "airbench":
        raise ValueError(f"--peer {args.peer} and --peer-script: choose one")
    script = Path(args.peer_script).resolve()
    if not script.exists():
        raise ValueError(f"--peer-script {args.peer_script}: no such file")
    if not script.is_file():
        raise ValueError(f"--peer-script {args.peer_script}: not a file")
    pattern = peer_pattern("default" if args.peer_pattern is None else args.peer_pattern)
    try:
        peer_args = shlex.split(args.peer_args or "")
    except ValueError as e:
        raise ValueError(f"--peer-args {args.peer_args!r}: not a shell-quoted string ({e})") from None
    cwd = args.peer_cwd and Path(args.peer_cwd).resolve()
    if cwd and not cwd.is_dir():
        raise ValueError(f"--peer-cwd {args.peer_cwd}: no such folder")
    return script, pattern, peer_args, cwd


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="fast94,fast95,fast96", help="comma-separated recipes of ours")
    p.add_argument("--runs", type=int, default=10, help="runs of ours per recipe")
    p.add_argument("--peer-runs", type=int, default=None, help="runs of the peer per recipe (default: --runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="data", help="as for cifar10_fast.py")
    p.add_argument("--device", default=None)
    p.add_argument("--compile", default=None, choices=["default", "max-autotune", "reduce-overhead"])
    p.add_argument("--peer", default="airbench", choices=["airbench", "record", "none"],
                   help="'record': the 2-second record's own cifar10_speedrun.py (fetched into --record-dir); 'none' "
                        "runs ours alone (e.g. to try the script on a CPU)")
    p.add_argument("--record-dir", default=None,
                   help=f"the folder holding the record's {RECORD_SCRIPT} (default: peers/cifar10-speedrun/, "
                        "git-ignored)")
    p.add_argument("--record-processes", type=int, default=None,
                   help="the record's runs in this many processes, each in the middle of its share of ours "
                        "(default 1: each process compiles and warms up again, off its clock)")
    p.add_argument("--alternate", action="store_true",
                   help="with --peer none: our recipes' runs in turn (A, B, A, B, ...) in one process, each recipe's "
                        "time over the first's")
    p.add_argument("--subset", type=int, default=None, help="first N training images (smoke tests only)")
    p.add_argument("--epochs", type=float, default=None, help="override our recipes' epochs (smoke tests only)")
    p.add_argument("--width", type=float, default=None, help="override our recipes' width (smoke tests only)")
    p.add_argument("--batch-size", type=int, default=None, help="override our recipes' batch size (smoke tests only)")
    p.add_argument("--peer-script", default=None,
                   help="a reference script (a Python file, e.g. airbench94_muon.py) to run beside ours instead of the "
                        "airbench package: `python PATH ARGS` in a fresh process each run, in a folder holding our "
                        "data as ./cifar10/{train,test}.pt")
    p.add_argument("--peer-args", default=None, help="arguments for the peer script, as one shell-quoted string")
    p.add_argument("--peer-pattern", default=None,
                   help="where the script's output says its accuracy and time: a regular expression with the named "
                        "groups acc and time (the last match counts; an acc above 1 or followed by %% is a "
                        f"percentage; time in seconds), or one of {', '.join(PEER_PATTERNS)}; the default matches "
                        "'accuracy 0.9412 time 3.21 s'")
    p.add_argument("--peer-cwd", default=None,
                   help="run the peer script in this folder, as it is, instead of a temporary one holding our data "
                        "as ./cifar10/{train,test}.pt")
    p.add_argument("--out", default=None, help="write every run and the table as JSON")
    return p.parse_args(argv)


def checked(args):
    """What the flags ask for, every one checked before any work: {"script", "pattern", "peer_args", "peer_cwd",
    "peer_runs", "airbench", "device", "names"}; a bad one is an error of one line, as (message, exit status)."""
    try:
        script, pattern, peer_args, peer_cwd = peer_script_flags(args)
    except ValueError as e:
        raise Refused(str(e), 2)
    peer_runs = args.runs if args.peer_runs is None else args.peer_runs
    if args.runs < 0 or peer_runs < 0 or args.runs + peer_runs == 0:
        raise Refused("--runs and --peer-runs must not be negative, and not both 0", 2)
    if script is not None and peer_runs < 1:
        raise Refused(f"--peer-runs {peer_runs}: a --peer-script needs at least one run", 2)
    if args.alternate and (args.peer != "none" or len(args.recipes.split(",")) < 2):
        raise Refused("--alternate: with --peer none and two recipes or more (ours against ours)", 2)
    record = record_flags(args, peer_runs)
    airbench = None
    if args.peer == "airbench" and script is None:
        airbench = import_airbench()
        if airbench is None:
            raise Refused("the peer package is not installed: run `pip install airbench` (or pass --peer none to run "
                          "our recipes alone)", 1)
    try:
        device = devices.resolve(args.device)
    except UsageError as e:
        raise Refused(str(e), 2)
    if airbench is not None and device.type != "cuda":
        raise Refused("airbench runs only on a CUDA GPU; use --peer none on this device", 1)
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in cf.RECIPES]
    if unknown:
        raise Refused(f"unknown recipes {unknown}; choose from {', '.join(cf.RECIPES)}", 2)
    return dict(script=script, pattern=pattern, peer_args=peer_args, peer_cwd=peer_cwd, peer_runs=peer_runs,
                airbench=airbench, device=device, names=names, record=record)


def record_flags(args, peer_runs):
    """--peer record's flags, checked: {"folder", "source", "processes", "sha256"} (of the source), or None for another
    peer; Refused in one line for a bad flag (status 2) or an absent script (status 1)."""
    if args.peer != "record":
        given = [f for f, v in (("--record-dir", args.record_dir), ("--record-processes", args.record_processes))
                 if v is not None]
        if given:
            raise Refused(f"{' and '.join(given)}: only with --peer record", 2)
        return None
    processes = 1 if args.record_processes is None else args.record_processes
    if peer_runs < 1 or not 1 <= processes <= peer_runs:
        raise Refused(f"--peer-runs {peer_runs} and --record-processes {processes}: the record needs a run, and "
                      f"every process one at least", 2)
    folder = Path(args.record_dir).resolve() if args.record_dir else RECORD_DIR
    try:
        source = record_source(folder)
        with_run_count(source, 1)
    except (UsageError, DataError) as e:
        raise Refused(str(e), 1)
    return {"folder": folder, "source": source, "processes": processes,
            "sha256": hashlib.sha256(source.encode()).hexdigest()}


class Refused(Exception):
    """A flag refused: its line and the exit status."""


def main(argv=None):
    args = parse_args(argv)
    try:
        c = checked(args)
        arrays = cd.take_subset(cd.load_cifar10(args.data_dir), args.subset)
    except (Refused, DataError) as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return e.args[1] if isinstance(e, Refused) else 1
    device, script, airbench, rec = c["device"], c["script"], c["airbench"], c["record"]
    devices.autotune(device)                 # as cifar10_fast.py does (importing airbench also does it, for both sides)
    env = environment(device)
    print(f"side by side on {env['device_name']}, torch {env['torch']}, {args.runs} runs of ours"
          + (f" and {c['peer_runs']} of the peer" if airbench or script or rec else "") + " per recipe"
          + (f" (the record's in {rec['processes']} process{'es' * (rec['processes'] > 1)}, its run count edited)"
             if rec else ""), flush=True)
    table = Table(["recipe", "n", "mean_acc", "std_acc", "p_above_target", "mean_time", "std_time", "time_ratio",
                   "ratio_lo95", "ratio_hi95"], width=15,
                  formats={"p_above_target": ".3g", "mean_time": ".3f", "std_time": ".3f", "time_ratio": ".3f",
                           "ratio_lo95": ".3f", "ratio_hi95": ".3f"})
    # the time column: one clock for ours and the airbench package; a script's is its own (module docstring)
    clocks = (f"time as each reports it: ours, the recipe's own (from the network built to the end of its final "
              f"evaluation); {script.name}, as its output says" if script is not None else
              "time as each times itself: ours, the recipe's own (from the network built to the end of its final "
              "evaluation); the record's, its CUDA events as its table prints them (from its model reset and "
              "optimisers built to the end of its TTA evaluation)" if rec is not None else
              "time: ours, the recipe's own; the airbench package's, around its train() and evaluation (its "
              "model construction inside, timed apart as construct_s)"
              if airbench is not None else "time: the recipe's own")
    out = args.out and os.path.abspath(args.out)          # the peer runs in a temporary folder (chdir below)
    everything = {"environment": env, "argv": sys.argv[1:] if argv is None else argv, "complete": False,
                  "time_protocol": clocks, "recipes": {}}
    save = lambda: out and write_json(out, everything)
    with tempfile.TemporaryDirectory() as tmp:
        home = os.getcwd()
        if airbench is not None:
            os.chdir(write_airbench_layout(arrays, tmp))      # airbench reads ./cifar10/{train,test}.pt
        elif (script is not None or rec is not None) and c["peer_cwd"] is None:
            c["peer_cwd"] = write_airbench_layout(arrays, tmp)     # so do airbench-style scripts, from their cwd
        try:
            if args.alternate:
                compare_alternating(c["names"], args, c, arrays=arrays, record=everything["recipes"], save=save)
                first = everything["recipes"][c["names"][0]]["ours"]
                for name in c["names"]:
                    table.append(stats_row(name, everything["recipes"][name]["ours"],
                                           everything["recipes"][name]["target"], first))
            for name in [] if args.alternate else c["names"]:
                if compare(name, args, c, arrays=arrays, record=everything["recipes"], save=save) is not None:
                    return 1
                ours, theirs = everything["recipes"][name]["ours"], everything["recipes"][name]["peer"]
                if not table.rows and (script is not None or rec is not None):
                    print(clocks, flush=True)
                target = everything["recipes"][name]["target"]
                table.append(stats_row(name, ours, target, theirs))
                if theirs:
                    table.append(stats_row(everything["recipes"][name]["peer_name"], theirs, target, theirs))
        finally:
            os.chdir(home)
    everything["table"], everything["complete"] = table.rows, True
    if args.out:
        save()
        print(f"wrote {args.out}")
    return 0


def compare(name, args, c, *, arrays, record, save):
    """Our recipe `name` and its peer, runs alternating (alternation), each appended to record[name] and saved as it
    ends; None, or 1 when the peer's output could not be read (said in one line)."""
    r, options, ctx, built = built_recipe(name, args, c, arrays)
    peer_name, peer, blocks = peer_runner(name, c)
    ours, theirs = [], []
    record[name] = {"settings": flat(r), "target": options.target, "ours": ours, "peer_name": peer_name,
                    "peer": theirs, "flops": built.flops}
    if c["record"] is not None:         # which script ran, and how it was edited, process by process
        record[name]["record"] = {"source": str(c["record"]["folder"] / RECORD_SCRIPT),
                                  "sha256": c["record"]["sha256"], "processes": []}
    order = alternation(args.runs, len(blocks)) if c["record"] is None else centred(args.runs, len(blocks))
    for turn, side in enumerate(order):
        if side == "ours":
            ours.append(our_run(r, built, options, ctx=ctx, seed=args.seed + len(ours)))
            print(f"  {name} run {len(ours)}/{args.runs}: ours {ours[-1]['final_acc']:.4f} in {ours[-1]['time']:.3f} s",
                  flush=True)
        else:
            k, before = blocks[turn - len(ours)], len(theirs)
            marked = lambda run: {**run, "edit": with_run_count(c["record"]["source"], k)[1],
                                  "script_sha256": c["record"]["sha256"]}
            printed = lambda run: (theirs.append(marked(run)), save())     # kept as the record prints it
            try:
                got, process = (peer(k, turn - len(ours) + 1, printed) if c["record"] is not None
                                else peer(k, turn - len(ours) + 1))
            except DataError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            if process is not None:          # each run says which script ran and its one edit (the suite keeps runs)
                record[name]["record"]["processes"].append(process)
                got = [marked(run) for run in got]
                del theirs[before:]          # the rows kept as printed, now read whole
            for run in got:
                theirs.append(run)
                construct_s = run.get("construct_s")
                print(f"  {name} peer run {len(theirs)}/{c['peer_runs']}: {peer_name} {run['final_acc']:.4f} in "
                      f"{run['time']:.3f} s" + ("" if construct_s is None else
                                                 f" (its model construction {construct_s:.3f} s)"), flush=True)
        save()
    return None


def built_recipe(name, args, c, arrays):
    """(our recipe with the smoke-test overrides, its Options, the Context, the Built network) for recipe `name`."""
    overrides = {k: v for k, v in (("epochs", args.epochs), ("width", args.width), ("batch_size", args.batch_size))
                 if v is not None}
    r = cf.recipe(name, **overrides)
    options = cf.Options(target=PEERS.get(name, (None, 0.94))[1], eval_every=0, compile=args.compile)  # the end's alone
    ctx = D.Context(device=str(c["device"]))
    with T.strict_compile():
        built = cf.build(r, arrays, options, ctx=ctx)
    return r, options, ctx, built


def our_run(r, built, options, *, ctx, seed):
    """One timed run of ours, its model dropped."""
    with T.strict_compile():
        run = cf.train_run(r, built, options, ctx=ctx, seed=seed)
    run.pop("model")
    return run


def peer_runner(name, c):
    """(the peer's name, a function of (k, its turn from 1) that runs k peer runs and returns (their results, the
    record's process line or None), the runs of each turn the peer takes); (None, None, []) with no peer."""
    device, script, airbench = c["device"], c["script"], c["airbench"]
    if c["record"] is not None:          # a process a turn: it compiles and warms up inside, off its own clock
        env, source = peer_environment(device, os.environ), c["record"]["source"]
        run = lambda k, turn, on_run=None: run_record(source, k, cwd=c["peer_cwd"], env=env, process=turn,
                                                      on_run=on_run)
        return RECORD_SCRIPT, run, split_runs(c["peer_runs"], c["record"]["processes"])
    if script is not None:          # a fresh process each run: it warms up inside, off its own clock
        env = peer_environment(device, os.environ)
        run = lambda k, turn: ([run_peer_script(script, args=c["peer_args"], cwd=c["peer_cwd"], pattern=c["pattern"],
                                                env=env)], None)
        return script.name, run, [1] * c["peer_runs"]
    suffix = PEERS.get(name, (None,))[0]
    if airbench is not None and suffix:
        loader, test_loader = peer_loaders(airbench, suffix)
        sync = lambda: devices.synchronize(device)
        run = lambda k, turn: ([time_peer(airbench, suffix, loader=loader, test_loader=test_loader, sync=sync)],
                               None)
        run(1, 0)                                    # the peer's untimed warm-up run
        return f"airbench{suffix}", run, [1] * c["peer_runs"]
    return None, None, []


def compare_alternating(names, args, c, *, arrays, record, save):
    """Our recipes `names`, built once each in this process, their runs in turn (A, B, A, B, ...), each appended to
    record[name] and saved as it ends."""
    builds = {name: built_recipe(name, args, c, arrays) for name in names}
    for name, (r, options, _, built) in builds.items():
        record[name] = {"settings": flat(r), "target": options.target, "ours": [], "peer_name": None, "peer": [],
                        "flops": built.flops}
    for k in range(args.runs):
        for name, (r, options, ctx, built) in builds.items():
            ours = record[name]["ours"]
            ours.append(our_run(r, built, options, ctx=ctx, seed=args.seed + k))
            print(f"  {name} run {len(ours)}/{args.runs}: ours {ours[-1]['final_acc']:.4f} in {ours[-1]['time']:.3f} s",
                  flush=True)
            save()


if __name__ == "__main__":
    sys.exit(main())
