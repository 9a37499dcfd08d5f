"""Our fast recipes against a peer, alternating runs on one device and the same data: the installed `airbench`
package (in this process), or any reference script (--peer-script, each run a fresh process).

    pip install airbench          # the peer; this script installs nothing
    python benchmarks/side_by_side.py --runs 25                     # fast94 vs airbench94, ...
    python benchmarks/side_by_side.py --recipes fast94 --runs 100 --peer-runs 25 --compile max-autotune --out sbs.json
    python benchmarks/side_by_side.py --recipes fast94_next --runs 25 --compile max-autotune \
        --peer-script airbench94_muon.py --peer-pattern 'PATTERN' --out sbs.json

A peer script (the record scripts such as airbench94_muon.py or the 2-second speedrun's, which no package holds) runs
in a folder holding our data as ./cifar10/train.pt and ./cifar10/test.pt (the layout airbench's scripts read:
`images` uint8 NHWC, `labels`, `classes`), with --peer-args, and reports its own accuracy and time: the last match
in its output of --peer-pattern, a regular expression with the named groups acc and time (the default matches a
line such as "accuracy 0.9412 time 3.21 s"; an accuracy above 1 is a percentage). Its time is its own clock; ours is
the clock README's "How time is measured" describes (from the network built, whitening fit included, CUDA events,
the final evaluation with test-time augmentation included): the same clock only where the script times as ours
does, which the table cannot check. A run that fails or prints no match stops the comparison with one line.

Both sides get the same data (our cached CIFAR-10, written once in the layout airbench reads:
`cifar10/train.pt` and `cifar10/test.pt` holding `images` uint8 NHWC, `labels`, `classes`) and the
same clock, device-synchronised: from the call that builds the model (model construction, whitening
fit, training) to the end of the final test-time-augmented evaluation. It excludes loading the data
from disk and uploading it (for the peer, both loaders are built before its clock: airbench's train()
would load the test set inside it, so it is handed the loaded one), one untimed warm-up run of each,
and per-epoch evaluations (ours are left out of the clock; the peer, with verbose=False, does none).
The peer runs with its own default hyperparameters and test-time augmentation. Runs alternate (ours,
peer, ours, peer, ...; with fewer peer runs, each follows the run of ours it is due after) so that
clock and thermal drift fall on both alike. The table gives n, mean accuracy ± std, the one-sided
p-value of "mean > target", the mean time ± std and our mean time over the peer's with its 95%
confidence interval. `--out` is rewritten after every run.
"""
import argparse
import contextlib
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
from cli import environment  # noqa: E402
from core import DataError, Table, one_sided_p, ratio_ci, summarize, write_json  # noqa: E402

# Our recipe → (the airbench package's trainer for the same target: its function suffix, the target accuracy).
# airbench94_muon.py and the 2-second record are scripts, not in the package: the Muon recipes run beside train94.
PEERS = {"fast94": ("94", 0.94), "fast95": ("95", 0.95), "fast96": ("96", 0.96), "fast94_muon": ("94", 0.94),
         "fast94_next": ("94", 0.94)}


# What a peer script must print, by default: its final accuracy and its time, on a line such as
# "accuracy 0.9412 time 3.21 s" (or "acc: 94.12%, time: 3.21"); the last such line counts. An accuracy above 1 is a
# percentage. Anything else: --peer-pattern, a regular expression with the named groups acc and time.
PEER_PATTERN = r"acc(?:uracy)?\W+(?P<acc>\d+(?:\.\d+)?)%?.*?time\W+(?P<time>\d+(?:\.\d+)?)"


def peer_pattern(text):
    """The compiled --peer-pattern; ValueError naming what is wrong."""
    try:
        pattern = re.compile(text, re.I)
    except re.error as e:
        raise ValueError(f"--peer-pattern {text!r}: not a regular expression ({e})") from None
    missing = {"acc", "time"} - set(pattern.groupindex)
    if missing:
        raise ValueError(f"--peer-pattern {text!r}: needs the named groups acc and time (missing: "
                         f"{', '.join(sorted(missing))})")
    return pattern


def run_peer_script(script, *, args, cwd, pattern):
    """One run of a peer script in a fresh process (cwd holds ./cifar10/{train,test}.pt): its accuracy and time as
    its output's last match of pattern says (an accuracy above 1 read as a percentage). A run that fails or prints
    no match raises DataError, in one line."""
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-200:]
        raise DataError(f"{script} exited with status {proc.returncode}: {tail}")
    found = list(pattern.finditer(proc.stdout))
    if not found:
        raise DataError(f"{script}: no line of its output matches --peer-pattern {pattern.pattern!r}; its output "
                        f"ends {proc.stdout[-200:]!r}")
    acc, seconds = float(found[-1]["acc"]), float(found[-1]["time"])
    return {"final_acc": acc / 100 if acc > 1 else acc, "time": seconds, "matched": found[-1].group(0)}


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
    training) plus the evaluation at its own default TTA level."""
    train = getattr(airbench, f"train{suffix}")
    tta_level = getattr(airbench, f"lib_airbench{suffix}").hyp["net"]["tta_level"]
    sync()
    t0 = time.perf_counter()
    with loaded_test_set(airbench, test_loader):
        model = train(loader, verbose=False)
    acc = airbench.evaluate(model, test_loader, tta_level=tta_level)
    sync()
    return {"final_acc": acc, "time": time.perf_counter() - t0}


def alternation(n_ours, n_peer):
    """The order of the runs: ours and the peer's in turn, each peer run after the run of ours it is due
    after when the counts differ (4 of ours per peer run for 100 and 25)."""
    order = []
    for i in range(n_ours):
        order.append("ours")
        order += ["peer"] * ((i + 1) * n_peer // n_ours - order.count("peer"))
    return order + ["peer"] * (n_peer - order.count("peer"))


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="fast94,fast95,fast96", help="comma-separated recipes of ours")
    p.add_argument("--runs", type=int, default=10, help="runs of ours per recipe")
    p.add_argument("--peer-runs", type=int, default=None, help="runs of the peer per recipe (default: --runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="data", help="as for cifar10_fast.py")
    p.add_argument("--device", default=None)
    p.add_argument("--compile", default=None, choices=["default", "max-autotune", "reduce-overhead"])
    p.add_argument("--peer", default="airbench", choices=["airbench", "none"],
                   help="'none' runs ours alone (e.g. to try the script on a CPU)")
    p.add_argument("--subset", type=int, default=None, help="first N training images (smoke tests only)")
    p.add_argument("--epochs", type=float, default=None, help="override our recipes' epochs (smoke tests only)")
    p.add_argument("--width", type=float, default=None, help="override our recipes' width (smoke tests only)")
    p.add_argument("--batch-size", type=int, default=None, help="override our recipes' batch size (smoke tests only)")
    p.add_argument("--peer-script", default=None,
                   help="a reference script to run beside ours instead of the airbench package (e.g. airbench94_muon.py)"
                        ", n times in fresh processes, in a folder holding ./cifar10/{train,test}.pt")
    p.add_argument("--peer-args", default="", help="arguments for the peer script, as one shell-quoted string")
    p.add_argument("--peer-pattern", default=PEER_PATTERN,
                   help="a regular expression with the groups acc and time, searched in the script's output (last "
                        "match; an acc above 1 is a percentage); the default matches 'accuracy 0.9412 time 3.21 s'")
    p.add_argument("--out", default=None, help="write every run and the table as JSON")
    args = p.parse_args(argv)
    script = None
    if args.peer_script:
        script = Path(args.peer_script).resolve()
        try:
            if not script.is_file():
                raise ValueError(f"--peer-script {args.peer_script}: no such file")
            pattern = peer_pattern(args.peer_pattern)
            peer_args = shlex.split(args.peer_args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    peer_runs = args.runs if args.peer_runs is None else args.peer_runs
    out = args.out and os.path.abspath(args.out)          # the peer runs in a temporary folder (chdir below)
    if args.runs < 0 or peer_runs < 0 or args.runs + peer_runs == 0:
        print("error: --runs and --peer-runs must not be negative, and not both 0", file=sys.stderr)
        return 2

    airbench = None
    if args.peer == "airbench" and script is None:
        airbench = import_airbench()
        if airbench is None:
            print("error: the peer package is not installed: run `pip install airbench` "
                  "(or pass --peer none to run our recipes alone)", file=sys.stderr)
            return 1
    device = devices.resolve(args.device)
    if airbench is not None and device.type != "cuda":
        print("error: airbench runs only on a CUDA GPU; use --peer none on this device", file=sys.stderr)
        return 1
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in cf.RECIPES]
    if unknown:
        print(f"error: unknown recipes {unknown}; choose from {', '.join(cf.RECIPES)}", file=sys.stderr)
        return 2
    dtype = devices.compute_dtype(device)
    devices.autotune(device)                 # as cifar10_fast.py does (importing airbench also does it, for both sides)
    sync = lambda: devices.synchronize(device)
    try:
        arrays = cd.take_subset(cd.load_cifar10(args.data_dir), args.subset)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    overrides = {k: v for k, v in (("epochs", args.epochs), ("width", args.width), ("batch_size", args.batch_size))
                 if v is not None}
    env = environment(device)
    print(f"side by side on {env['device_name']}, torch {env['torch']}, {args.runs} runs of ours"
          + (f" and {peer_runs} of the peer" if airbench or script else "") + " per recipe", flush=True)

    table = Table(["recipe", "n", "mean_acc", "std_acc", "p_above_target", "mean_time", "std_time", "time_ratio",
                   "ratio_lo95", "ratio_hi95"], width=15,
                  formats={"p_above_target": ".3g", "mean_time": ".3f", "std_time": ".3f", "time_ratio": ".3f",
                           "ratio_lo95": ".3f", "ratio_hi95": ".3f"})
    everything = {"environment": env, "argv": sys.argv[1:] if argv is None else argv, "complete": False,
                  "recipes": {}}
    save = lambda: out and write_json(out, everything)
    with tempfile.TemporaryDirectory() as tmp:
        home = os.getcwd()
        if airbench is not None or script is not None:
            os.chdir(write_airbench_layout(arrays, tmp))      # airbench reads ./cifar10/{train,test}.pt
        try:
            for name in names:
                hp = cf.hyperparameters(name, **overrides)
                suffix, target = PEERS.get(name, (None, 0.94))
                prepared = cf.prepare(hp, arrays, device=device, dtype=dtype, compile=args.compile)
                peer, peer_name = None, None
                if script is not None:          # a fresh process each run: it warms up inside, off its own clock
                    peer_name = script.name
                    peer = lambda: run_peer_script(script, args=peer_args, cwd=tmp, pattern=pattern)
                elif airbench is not None and suffix:
                    peer_name = f"airbench{suffix}"
                    loader, test_loader = peer_loaders(airbench, suffix)
                    peer = lambda: time_peer(airbench, suffix, loader=loader, test_loader=test_loader, sync=sync)
                    peer()                                      # the peer's untimed warm-up run
                ours, theirs = [], []
                everything["recipes"][name] = {"hyperparameters": hp, "target": target, "ours": ours,
                                               "peer_name": peer_name, "peer": theirs,
                                               "flops": prepared.flops}
                for side in alternation(args.runs, peer_runs if peer else 0):
                    if side == "ours":
                        r = prepared.run(args.seed + len(ours), target=target, eval_every=0)   # the end's alone
                        r.pop("model")
                        ours.append(r)
                        print(f"  {name} run {len(ours)}/{args.runs}: ours {r['final_acc']:.4f} in {r['time']:.3f} s",
                              flush=True)
                    else:
                        try:
                            theirs.append(peer())
                        except DataError as e:
                            print(f"error: {e}", file=sys.stderr)
                            return 1
                        print(f"  {name} peer run {len(theirs)}/{peer_runs}: {peer_name} "
                              f"{theirs[-1]['final_acc']:.4f} in {theirs[-1]['time']:.3f} s", flush=True)
                    save()
                table.append(stats_row(name, ours, target, theirs))
                if theirs:
                    table.append(stats_row(peer_name, theirs, target, theirs))
        finally:
            os.chdir(home)
    everything["table"], everything["complete"] = table.rows, True
    if args.out:
        save()
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
