"""A lent GPU's headline in two calls: our recipes beside E1 and the 2-second record, n >= 25 each, under both
timings (benchmarks/fulcrum_adapter.py), inside 12 minutes of device time.

    python benchmarks/lease.py plan                 # the minute-by-minute plan, the carry lists and the commands
    python benchmarks/lease.py call1 --out $OUT     # on the GPU: data's first half kept, every side compiled
    python benchmarks/lease.py call2 --out $OUT --data-dir /root/cifar10.npz      # the timed sides, interleaved
    python benchmarks/lease.py smoke                # both calls tiny on the CPU (the peers' stand-ins, CUDA's)

Call 1 carries .gpudata/a (the test set, the training set's first half, the decoder), copies it to /root/c10/ and
spends itself on work that needs no real data: every side's worker built once on random data of CIFAR-10's shapes
and format (ours compiled max-autotune, E1's setup(), the record's own warm-up run), all at once, into one compile
cache on the machine's disk (CACHE), each side's build seconds kept beside it: cold; call 2's builds from that cache
are the warm ones, and its lease.json sets them side by side. The cache goes to $OUT as a tar.gz in parts of at most 15 MiB, so that a call meeting a fresh machine carries it back in.
Call 2, made at once, carries .gpudata/b, decodes CIFAR-10 and runs the sides in turn (fulcrum_adapter compare),
each run's row appended to $OUT/rows.jsonl as it ends, the headline written to $OUT/lease.json at the end.

The planner (plan, and the rehearsal test) charges the measured H200 times where results/nvidia-h200/ holds them
(suite.measured_elsewhere's pieces: a side's mean wall seconds a run, a command's cold and warm start) and the
ASSUMED figures, each named as such, elsewhere.
"""
import argparse
import json
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fulcrum_adapter as fa  # noqa: E402
from core import CODE_VERSION_FILE, Parser, code_version  # noqa: E402

OURS = ("fast94_next", "fast94_fastest", "fast94_curriculum")
PEERS = ("e1", "hiverge")
HEADLINE = ("fast94_next", "e1", "hiverge")
CACHE = Path("/root/lease-cache")          # on the GPU machine: one compile cache for every side
PART_BYTES = 15 << 20                      # each file back from $OUT at most 16 MiB
COLD = "lease_call1.json"                  # call 1's build seconds, kept in the cache's folder
MAX_PARTS = 5                              # 8 files back at most: the parts, the log, the result, the rows
DEVICE_BUDGET_S = 720.0                    # 12 of the lease's 15 minutes: the rest is the margin
CALL_LIMIT_S = 600.0
VERSION_PATH = ROOT / CODE_VERSION_FILE    # where the run tool's carry finds it: the repository's root
# Seconds on an H200 that nothing here has measured, each a stated assumption (docs/measuring.md, The lease):
ASSUMED = {
    "start_s": 120.0,            # a machine's start (the device README: 1 to 2 minutes)
    "transfer_s": 20.0,          # a call's working tree and carried files, both ways
    "gap_s": 10.0,               # between the calls, the machine held warm
    "copy_s": 5.0, "decode_s": 15.0, "pack_s": 15.0,
    "parallel_slowdown": 1.5,    # several sides compiling at once on 16 cores, against one alone
    "eval6_s": 0.1,              # the untimed 6-view evaluation and a worker's turn around
    # a side's compile on an empty cache, its build from a filled one, its wall seconds a run
    "cold_s": {"fast94_next": 164.0, "fast94_fastest": 200.0, "fast94_curriculum": 220.0, "e1": 150.0,
               "hiverge": 170.0},
    "warm_s": {"fast94_next": 46.0, "fast94_fastest": 55.0, "fast94_curriculum": 60.0, "e1": 60.0, "hiverge": 50.0},
    "run_s": {"fast94_next": 1.14, "fast94_fastest": 1.10, "fast94_curriculum": 1.0,
              "e1": 1.83, "hiverge": 2.3},      # E1's and the record's: their A100 figures (their harness), taken as is
}


def available_sides(sides, *, say=print):
    """The sides whose recipe or script exists here; one line for each left out."""
    import cifar10_fast as cf
    kept = []
    for s in sides:
        if s not in PEERS and s not in cf.RECIPES:
            say(f"{s}: skipped: no such recipe here yet")
        else:
            kept.append(s)
    return kept


# ---------------------------------------------------------------------------------------------------
# The planner

def measured_times(folder):
    """{"cold_s", "warm_s", "run_s": {side: seconds}} from the results on a device (results/nvidia-h200/): the suite's
    (a command's first start on an empty cache, cold; its later ones, warm; a side's mean wall seconds a run), and
    where an earlier lease's lease.json is there, its builds (cold in call 1, warm in call 2) and wall seconds."""
    import suite
    found = {"cold_s": {}, "warm_s": {}, "run_s": {}}
    for path in sorted(Path(folder).glob("*.json")):
        r = suite.load(path)
        if not r or r.get("smoke") or "sides" not in r or path.name == "lease.json":     # a lease's: read below
            continue
        for name, side in r["sides"].items():
            if side.get("runs") and name in ASSUMED["run_s"]:
                found["run_s"].setdefault(name, suite.mean_wall(side["runs"]))
        starts = [c["setup_s"] for c in r.get("chunks", []) if c.get("setup_s") is not None]
        ours = next(iter(r["sides"]), None)
        if starts and ours in ASSUMED["cold_s"]:
            found["cold_s"].setdefault(ours, starts[0])
            if len(starts) > 1:
                found["warm_s"].setdefault(ours, min(starts[1:]))
    last = suite.load(Path(folder) / "lease.json")        # an earlier lease's call 2 (its $OUT, kept here)
    if last:                                               # the lease's own figures first: its sides, its way
        found["run_s"].update(last.get("wall_s", {}))
        found["cold_s"].update(last.get("build_s", {}).get("cold", {}))
        found["warm_s"].update(last.get("build_s", {}).get("warm", {}))
    return found


def times_for(sides, folder=None):
    """Each figure the plan charges: measured where `folder` has it, else ASSUMED; with where each came from."""
    measured = measured_times(folder) if folder and Path(folder).is_dir() else {"cold_s": {}, "warm_s": {},
                                                                                 "run_s": {}}
    times, source = dict(ASSUMED), {}
    for key in ("cold_s", "warm_s", "run_s"):
        times[key] = {}
        for s in sides:
            got = measured[key].get(s)
            times[key][s] = ASSUMED[key][s] if got is None else got
            source[f"{key} {s}"] = "assumed" if got is None else f"measured ({folder})"
    return times, source


def charged_steps(sides, *, n, times):
    """[(start s, end s, call, what)]: the lease's steps as charged, every side of `sides` to n runs."""
    steps, t = [], 0.0
    slowdown = times["parallel_slowdown"] if len(sides) > 1 else 1.0
    round_s = sum(times["run_s"][s] + times["eval6_s"] for s in sides)
    for call, seconds, what in (
            (1, times["start_s"], "machine start"),
            (1, times["transfer_s"], "working tree and .gpudata/a carried in"),
            (1, times["copy_s"], "first half of CIFAR-10 copied to /root/c10/"),
            (1, max(times["cold_s"][s] for s in sides) * slowdown,
             f"every side compiled at once on random data, cold ({', '.join(sides)})"),
            (1, times["pack_s"], "the cache packed into $OUT"),
            (2, times["gap_s"], "between the calls (the machine held warm)"),
            (2, times["transfer_s"], "working tree and .gpudata/b carried in"),
            (2, times["decode_s"], "CIFAR-10 decoded to /root/cifar10.npz"),
            (2, max(times["warm_s"][s] for s in sides) * slowdown, "every side's worker built from the cache, "
                                                                    "at once (warm)"),
            *((2, round_s, f"round {k + 1}: one timed run of each of {', '.join(sides)}") for k in range(n))):
        steps.append((t, t + seconds, call, what))
        t += seconds
    return steps


def plan(sides, *, n, budget_s, times):
    """(steps, the runs each side gets, whether the headline ends in budget_s and each call inside its limit): the
    sides beyond the headline (HEADLINE, n runs each) kept, from the first, only while the whole still fits."""
    kept = [s for s in sides if s in HEADLINE]
    for extra in [s for s in sides if s not in HEADLINE]:
        if ends_in_time(charged_steps(kept + [extra], n=n, times=times), budget_s):
            kept.append(extra)
    kept = [s for s in sides if s in kept]
    steps = charged_steps(kept, n=n, times=times)
    return steps, {s: n if s in kept else 0 for s in sides}, ends_in_time(steps, budget_s)


def ends_in_time(steps, budget_s):
    """The last step ends inside budget_s, and each call's command (its steps after the start and the carrying in)
    inside CALL_LIMIT_S."""
    calls = {c: sum(e - s for s, e, cc, what in steps if cc == c and "carried" not in what and "start" not in what
                    and "between" not in what) for c in (1, 2)}
    return steps[-1][1] <= budget_s and all(v <= CALL_LIMIT_S for v in calls.values())


def minute_by_minute(steps):
    """The plan's lines: each step's minutes and what it does; the rounds of call 2 folded into one line."""
    lines, rounds = [], [s for s in steps if s[3].startswith("round ")]
    for start, end, call, what in steps:
        if what.startswith("round ") and (start, end, call, what) != rounds[0]:
            continue
        if what.startswith("round "):
            start, end, what = rounds[0][0], rounds[-1][1], f"{len(rounds)} rounds: " + what.split(": ", 1)[1]
        lines.append(f"{start / 60:5.1f}-{end / 60:5.1f} min  call {call}  {what}")
    return lines


def rehearsed_rows(done, times, seed=0):
    """Rows as call 2 writes them, from the charged times (a run's time, spread 1%): what the headline is made of."""
    rng = random.Random(seed)
    rows = []
    for side, count in done.items():
        for k in range(count):
            t = times["run_s"][side] * (1 + 0.01 * rng.gauss(0, 1))
            rows.append({"side": side, "k": k, "fulcrum_s": t, "ours_s": t + 0.05, "tta6_acc": 0.94,
                         "own_acc": 0.94})
    return rows


# ---------------------------------------------------------------------------------------------------
# The calls, as the GPU machine runs them (and, tiny, the CPU's smoke)

def carry_and_commands(sides, n, budget_s):
    """The two `run` calls: (carry list, command) each."""
    s = ",".join(sides)
    call1 = (f".gpudata/a peers {CODE_VERSION_FILE}".split(),
             "set -o pipefail; mkdir -p /root/c10 && cp .gpudata/a/* /root/c10/ && PYTHONUNBUFFERED=1 python3 "
             f"benchmarks/lease.py call1 --out $OUT --sides {s} --budget-s 540 2>&1 | tee $OUT/call1.log")
    call2 = (f".gpudata/b peers {CODE_VERSION_FILE}".split(),
             "set -o pipefail; cp .gpudata/b/* /root/c10/ && python3 /root/c10/decode_cifar10_parts.py /root/c10 "
             "/root/cifar10.npz && PYTHONUNBUFFERED=1 python3 benchmarks/lease.py call2 --out $OUT "
             f"--data-dir /root/cifar10.npz --sides {s} --runs {n} --budget-s {min(budget_s, 560):.0f} 2>&1 | tee "
             "$OUT/call2.log")
    return call1, call2


def cache_environment(cache):
    return {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(Path(cache) / "triton")}


def pack(cache, out, *, say=print):
    """The cache as cache.tgz.NN parts of PART_BYTES in out; [] (said in a line) where it needs more than MAX_PARTS."""
    tgz = Path(out) / "cache.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(cache, arcname=".")
    size = tgz.stat().st_size
    if size > MAX_PARTS * PART_BYTES:
        tgz.unlink()
        say(f"cache: {size / 2**20:.1f} MiB packed, more than {MAX_PARTS} parts of 15 MiB: not sent back")
        return []
    parts = []
    with open(tgz, "rb") as f:
        while chunk := f.read(PART_BYTES):
            parts.append(Path(out) / f"cache.tgz.{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    tgz.unlink()
    say(f"cache: {size / 2**20:.1f} MiB in {len(parts)} parts in $OUT (carry them back as .lease-cache/)")
    return parts


def unpack(parts_folder, cache, *, say=print):
    """The carried parts joined and unpacked into cache, where the cache is absent (a fresh machine)."""
    parts = sorted(Path(parts_folder).glob("cache.tgz.*"))
    if Path(cache).is_dir() or not parts:
        say(f"cache: {'on this machine already' if Path(cache).is_dir() else 'none carried: a cold start'}")
        return
    joined = Path(cache).parent / "cache.tgz"
    Path(cache).mkdir(parents=True)
    with open(joined, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    with tarfile.open(joined) as tar:
        tar.extractall(cache, filter="data")
    joined.unlink()
    say(f"cache: {len(parts)} carried parts unpacked into {cache}")


def adapter_args(args, *, sides, runs, synthetic, rows=None, budget_s=None):
    argv = ["compare", "--sides", ",".join(sides), "--runs", str(runs), "--log", str(Path(args.out) / "workers.log"),
            *(["--synthetic"] if synthetic else ["--data-dir", args.data_dir]),
            *(["--rows", str(rows)] if rows else []), *(["--budget-s", str(budget_s)] if budget_s else [])]
    if args.smoke:
        return fa.parse_args(argv + ["--smoke", "--standin", "--device", "cpu"])
    return fa.parse_args(argv + ["--compile", "max-autotune"])


def call1(args, say=print):
    """Every side built on random data into the cache, cold, at once; its build seconds kept with the cache (call 2's
    builds from it are the warm ones); the cache packed into $OUT."""
    sides = available_sides(args.sides.split(","), say=say)
    start = time.time()
    _, cold, lost = fa.compare(adapter_args(args, sides=sides, runs=0, synthetic=True, budget_s=args.budget_s),
                               say=say)
    result = {"call": 1, "sides": sides, "cold_build_s": cold, "cold_wall_s": time.time() - start, "lost": lost}
    fa.write_json(Path(args.cache) / COLD, result)
    result["parts"] = [p.name for p in pack(args.cache, args.out, say=say)]
    fa.write_json(Path(args.out) / "lease_call1.json", result)
    return 1 if lost else 0


def call2(args, say=print):
    """The cache unpacked where it is absent; the sides' runs in turn, each row into $OUT/rows.jsonl as it ends."""
    unpack(args.parts, args.cache, say=say)
    sides = available_sides(args.sides.split(","), say=say)
    rows_path = Path(args.out) / "rows.jsonl"
    rows, builds, lost = fa.compare(adapter_args(args, sides=sides, runs=args.runs, synthetic=False, rows=rows_path,
                                                 budget_s=args.budget_s), say=say)
    h = fa.headline(rows, [s for s in sides if s not in PEERS])
    cold = (fa.load_json(Path(args.cache) / COLD) or {}).get("cold_build_s", {})
    walls = {s: [r["wall_s"] for r in rows if r["side"] == s] for s in sides}
    fa.write_json(Path(args.out) / "lease.json", {"call": 2, "sides": sides, "lost": lost, "headline": h,
                                                  "runs": len(rows), "build_s": {"cold": cold, "warm": builds},
                                                  "wall_s": {s: sum(w) / len(w) for s, w in walls.items() if w}})
    for s in builds:
        say(f"{s}: built cold in {cold[s]:.1f} s (call 1), warm in {builds[s]:.1f} s" if s in cold else
            f"{s}: built in {builds[s]:.1f} s (no cold build on record)")
    for timing, part in h.items():
        for pair, ci in part["ratios"].items():
            say(f"{timing} {pair}: " + (f"{ci['ratio']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else "n < 2"))
    return 1 if lost else 0


def smoke(args, say=print):
    """Both calls, tiny, on the CPU: the peers' stand-ins under CUDA's, a cache folder and an $OUT of its own."""
    import tempfile
    import suite
    with tempfile.TemporaryDirectory() as tmp:
        out1, out2 = Path(tmp) / "out1", Path(tmp) / "out2"
        out1.mkdir()
        out2.mkdir()
        base = dict(vars(args), smoke=True, cache=Path(tmp) / "cache", budget_s=args.budget_s)
        base["cache"].mkdir()
        with fa_environment(cache_environment(base["cache"])):
            rc1 = call1(argparse.Namespace(**{**base, "out": out1}), say=say)
            shutil.rmtree(base["cache"])            # a fresh machine: the parts carried back in instead
            base["parts"] = out1
            data = str(suite.synthetic_npz(Path(tmp) / "c.npz"))
            rc2 = call2(argparse.Namespace(**{**base, "out": out2, "data_dir": data}), say=say)
        say(f"smoke: call 1 returned {sorted(p.name for p in out1.iterdir())}, call 2 "
            f"{sorted(p.name for p in out2.iterdir())}")
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    return rc1 or rc2


def fa_environment(variables):
    import suite
    return suite.environment_of(variables)


def print_plan(args, say=print):
    sides = available_sides(args.sides.split(","), say=say)
    times, source = times_for(sides, args.results)
    steps, done, ok = plan(sides, n=args.runs, budget_s=args.budget_s, times=times)
    for line in minute_by_minute(steps):
        say(line)
    say(f"runs: {done}; headline ({', '.join(HEADLINE)}, n = {args.runs}) "
        f"{'ends' if ok else 'does NOT end'} at {steps[-1][1] / 60:.1f} min of {args.budget_s / 60:.0f}")
    say("charged: " + "; ".join(f"{k} {v.replace(str(ROOT) + '/', '')}" for k, v in sorted(source.items())
                                if v != "assumed")
        + " (every other figure ASSUMED, benchmarks/lease.py)")
    # the copied tree has no .git: every result it writes names the commit it ran (core.code_version)
    VERSION_PATH.write_text(json.dumps(code_version()) + "\n")
    say(f"{CODE_VERSION_FILE}: {json.loads(VERSION_PATH.read_text())}")
    for i, (carry, command) in enumerate(carry_and_commands([s for s in sides if done[s]], args.runs,
                                                            args.budget_s), 1):
        say(f"call {i}: carry {json.dumps(carry)}")
        say(f"call {i}: command {command}")
    say("call 2 on a fresh machine (call 1's was given back): first save $OUT's cache.tgz.* parts into .lease-cache/ "
        "and add \".lease-cache\" to its carry (42.3 MB of .gpudata/b and the tree leave about 19 MiB for them)")
    return 0 if ok else 1


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["plan", "call1", "call2", "smoke"])
    p.add_argument("--sides", default=",".join(OURS + PEERS), help="our recipes, e1, hiverge (in this order)")
    p.add_argument("--runs", type=int, default=25, help="runs of each side (default 25)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"plan: the device seconds (default {DEVICE_BUDGET_S:.0f}); a call: its own (default 540)")
    p.add_argument("--results", default=str(ROOT / "results" / "nvidia-h200"), help="plan: measured times from here")
    p.add_argument("--out", default=None, help="a call: the folder whose files come back ($OUT)")
    p.add_argument("--data-dir", default=None, help="call2: CIFAR-10 as one .npz")
    p.add_argument("--cache", type=Path, default=CACHE, help="the compile cache's folder")
    p.add_argument("--parts", type=Path, default=ROOT / ".lease-cache",
                   help="call2: the cache's parts carried back in, unpacked where the machine is fresh")
    p.add_argument("--keep", default=None, help="smoke: copy its folders here")
    args = p.parse_args(argv)
    if args.runs < 2 or (args.budget_s is not None and args.budget_s <= 0):
        p.error("--runs must be at least 2 (a ratio's interval) and --budget-s positive")
    if args.mode in ("call1", "call2") and not args.out:
        p.error(f"{args.mode}: --out names the folder that comes back ($OUT)")
    if args.mode == "call2" and not args.data_dir:
        p.error("call2: --data-dir: CIFAR-10 as one .npz")
    if not available_sides(args.sides.split(","), say=lambda line: None):
        p.error(f"--sides {args.sides}: none of them is here; give our recipes (cifar10_fast.py --list-recipes) or "
                f"the peers ({', '.join(PEERS)})")
    args.smoke = args.mode == "smoke"          # the calls' own switch: the CPU's stand-ins, tiny
    args.budget_s = args.budget_s or (DEVICE_BUDGET_S if args.mode == "plan" else 540.0 if args.mode != "smoke"
                                      else 600.0)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "plan":
        return print_plan(args)
    if args.mode == "smoke":
        return smoke(args)
    args.cache.mkdir(parents=True, exist_ok=True) if args.mode == "call1" else None
    with fa_environment(cache_environment(args.cache)):
        return (call1 if args.mode == "call1" else call2)(args)


if __name__ == "__main__":
    sys.exit(main())
