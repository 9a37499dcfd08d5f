"""A lent GPU's headline in two calls: our recipes beside E1 and the 2-second record, n >= 25 each, under both
timings (benchmarks/fulcrum_adapter.py), inside 12 minutes of device time.

    python benchmarks/lease.py prepare              # CIFAR-10's parts laid out for the two calls (.gpudata/a and b)
    python benchmarks/lease.py plan                 # the minute-by-minute plan, each call's carry (sized), its command
    python benchmarks/lease.py call1 --out $OUT     # on the GPU: every side compiled, its graphs sent back
    python benchmarks/lease.py call2 --out $OUT --data-dir /root/cifar10.npz      # the timed sides, interleaved
    python benchmarks/lease.py keep FOLDER          # here: call 1's returned graphs kept for the next lease
    python benchmarks/lease.py smoke                # both calls tiny on the CPU (the peers' stand-ins, CUDA's)

Call 1 carries .gpudata/a (the training set's first half) and the graphs earlier leases compiled on this kind of GPU
(.lease-cache/<kind>/, benchmarks/compile_carry.py), and builds every side's worker at once on random data of
CIFAR-10's shapes and format (ours compiled max-autotune, E1's setup(), the record's own warm-up run), warm where its
graphs were carried and cold elsewhere, into one compile cache on the machine's disk (CACHE). Each side's graphs go to
$OUT as its build ends; a build still going at the deadline saves what it compiled as it stops, so that a cold build
longer than a call (E1's, on an H200) goes on from there in the next lease.
Call 2, made at once on the machine still warm, carries .gpudata/b (the second half, the test set, the decoder),
decodes CIFAR-10, builds again from the disk's cache (warm), leaving out any side call 1 did not build, and runs the
sides in turn, each run's row appended to $OUT/rows.jsonl as it ends, the headline written to $OUT/lease.json.

The planner (plan, and the rehearsal test) charges the measured times where results/<kind>/ holds them
(suite.measured_elsewhere's pieces: a side's mean wall seconds a run, a command's cold and warm start; an earlier
lease's lease.json) and the ASSUMED figures, each named as such, elsewhere.
"""
import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_carry  # noqa: E402
import fulcrum_adapter as fa  # noqa: E402
from core import CODE_VERSION_FILE, Parser, code_version  # noqa: E402
from devices import size_text  # noqa: E402

OURS = ("fast94_next", "fast94_fastest", "fast94_curriculum")
PEERS = ("e1", "hiverge")
HEADLINE = ("fast94_next", "e1", "hiverge")
KIND = "nvidia-h200"                       # the device tool's kind: results/<kind>/ and .lease-cache/<kind>/
CACHE = Path("/root/lease-cache")          # on the GPU machine: one compile cache for every side
CARRIED = ROOT / ".lease-cache"            # here (git-ignored): call 1's returned graphs, a folder for each kind
PARTS = ROOT.parent / "shared" / "data" / "cifar10" / "parts"
COLD = "lease_call1.json"                  # call 1's record: its builds and the sides it did not build
GRAPHS = "carried.json"                    # beside the kept graphs: whether each side's are whole, its seconds compiled
DEVICE_BUDGET_S = 720.0                    # 12 of the lease's 15 minutes: the rest is the margin
CALL_LIMIT_S = 600.0
CALL1_BUDGET_S = 540.0                     # call 1's builds; then TERM_GRACE_S for the unbuilt to save, then its record
CARRY_LIMIT = 64 << 20                     # the run tool's working tree, carried paths included
RETURN_FILES, RETURN_BYTES = 8, 64 << 20   # what comes back from $OUT (16 MiB a file: compile_carry.PART_BYTES)
OWN_FILES, OWN_BYTES = 3, 4 << 20          # call 1's own files in $OUT: its log, the workers' log, its record
VERSION_PATH = ROOT / CODE_VERSION_FILE    # where the run tool's carry finds it: the repository's root
# Seconds on an H200 that nothing here has measured, each a stated assumption (docs/measuring.md, The lease):
ASSUMED = {
    "start_s": 120.0,            # a machine's start (the device README: 1 to 2 minutes)
    "transfer_s": 20.0,          # a call's working tree and carried files, both ways
    "gap_s": 10.0,               # between the calls, the machine held warm
    "copy_s": 5.0, "decode_s": 15.0,
    # several sides compiling at once on 16 cores, against one alone: fast94_next's cold build took 164 s alone
    # (results/nvidia-h200/fast94_next.json's first start), 192 s beside two others (lease.json)
    "parallel_slowdown": 1.2,
    "eval6_s": 0.1,              # the untimed 6-view evaluation and a worker's turn around
    # a side's compile on an empty cache, its build from a filled one, its wall seconds a run. E1's cold build:
    # a lease's call 1 on an H200 stopped it unbuilt at 540 s beside two others (results/nvidia-h200/lease_call1.log)
    "cold_s": {"fast94_next": 164.0, "fast94_fastest": 200.0, "fast94_curriculum": 220.0, "e1": 720.0,
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
        if not r or r.get("smoke") or "sides" not in r or path.name.startswith("lease"):     # a lease's: below
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


def charged_builds(sides, times, carried):
    """{side: seconds its build in call 1 is charged, alone}: warm where its whole graphs are carried, the cold build
    less what earlier leases compiled where they stopped it (carried partly), cold where nothing is carried."""
    out = {}
    for s in sides:
        got = carried.get(s)
        out[s] = times["cold_s"][s] if got is None else times["warm_s"][s] if got["complete"] else \
            max(times["warm_s"][s], times["cold_s"][s] - got["compiled_s"])
    return out


def at_once(sides, times):
    """How much longer each build takes with the sides built at once than alone."""
    return times["parallel_slowdown"] if len(sides) > 1 else 1.0


def call1_deadline(sides, *, n, times, build, budget_s):
    """(call 1's deadline for its builds, the sides built by it): the device seconds left once everything else is
    charged (at most CALL1_BUDGET_S), a build the lease cannot afford compiling until then and keeping what it got."""
    slowdown = at_once(sides, times)
    built, deadline = list(sides), CALL1_BUDGET_S
    for _ in range(len(sides) + 1):                 # fewer sides built leave more time: until the set holds
        rest = (times["start_s"] + 2 * times["transfer_s"] + times["copy_s"] + times["gap_s"] + times["decode_s"]
                + max((times["warm_s"][s] for s in built), default=0.0) * slowdown
                + n * sum(times["run_s"][s] + times["eval6_s"] for s in built))
        deadline = min(CALL1_BUDGET_S, budget_s - rest - fa.TERM_GRACE_S)
        now = [s for s in sides if build[s] * slowdown <= deadline]
        if now == built:
            break
        built = now
    return deadline, built


def charged_steps(sides, *, n, times, carried=None, budget_s=DEVICE_BUDGET_S):
    """([(start s, end s, call, what)], the sides call 1 builds, its deadline): the lease's steps as charged, every
    side built at once in call 1 (charged_builds), those built by its deadline run n times each in call 2."""
    carried = carried or {}
    slowdown = at_once(sides, times)
    build = charged_builds(sides, times, carried)
    deadline, built = call1_deadline(sides, n=n, times=times, build=build, budget_s=budget_s)
    stopped = [s for s in sides if s not in built]
    warm = [s for s in built if carried.get(s, {}).get("complete")]
    how = "; ".join(part for part in (
        f"warm from carried graphs: {', '.join(warm)}" if warm else "",
        f"cold or from partial graphs: {', '.join(s for s in built if s not in warm)}" if set(built) - set(warm)
        else "",
        f"{', '.join(stopped)} compiling until {max(deadline, 0):.0f} s, then stopped, its graphs so far sent back"
        if stopped else "") if part)
    round_s = sum(times["run_s"][s] + times["eval6_s"] for s in built)
    steps, t = [], 0.0
    for call, seconds, what in (
            (1, times["start_s"], "machine start"),
            (1, times["transfer_s"], "working tree, .gpudata/a and the carried graphs carried in"),
            (1, times["copy_s"], "first half of CIFAR-10 copied to /root/c10/"),
            (1, max(deadline, 0.0) + fa.TERM_GRACE_S if stopped else max(build[s] * slowdown for s in sides),
             f"every side built at once on random data ({how})"),
            (2, times["gap_s"], "between the calls (the machine held warm)"),
            (2, times["transfer_s"], "working tree and .gpudata/b carried in"),
            (2, times["decode_s"], "CIFAR-10 decoded to /root/cifar10.npz"),
            (2, max((times["warm_s"][s] for s in built), default=0.0) * slowdown,
             "every side call 1 built, built again from the disk's cache, at once (warm)"),
            *((2, round_s, f"round {k + 1}: one timed run of each of {', '.join(built)}") for k in range(n))):
        steps.append((t, t + seconds, call, what))
        t += seconds
    return steps, built, deadline


def plan(sides, *, n, budget_s, times, carried=None):
    """(steps, the runs each side gets, whether the headline ends in budget_s and each call inside its limit, call
    1's deadline): the headline's sides (HEADLINE) n runs each where call 1 builds them, those beyond it kept, from
    the first, only while the headline still ends in time."""
    headline = [s for s in sides if s in HEADLINE]

    def ends(kept):
        steps, built, deadline = charged_steps(kept, n=n, times=times, carried=carried, budget_s=budget_s)
        return steps, built, deadline, ends_in_time(steps, budget_s) and set(headline) <= set(built)
    kept = list(headline)
    for extra in [s for s in sides if s not in HEADLINE]:
        if ends(kept + [extra])[3]:
            kept.append(extra)
    steps, built, deadline, ok = ends([s for s in sides if s in kept])
    return steps, {s: n if s in built else 0 for s in sides}, ok, deadline


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
    """Rows as call 2 writes them, from the charged times (a run's time, spread 1%; accuracy 94%, spread 0.1%): what
    the headline is made of."""
    rng = random.Random(seed)
    rows = []
    for side, count in done.items():
        for k in range(count):
            t = times["run_s"][side] * (1 + 0.01 * rng.gauss(0, 1))
            acc = 0.94 + 0.001 * rng.gauss(0, 1)
            rows.append({"side": side, "k": k, "fulcrum_s": t, "ours_s": t + 0.05, "tta6_acc": acc, "own_acc": acc})
    return rows


# ---------------------------------------------------------------------------------------------------
# What travels: the data's halves, the carried graphs, each call's size against the run tool's limit

def prepare(parts, gpudata, say=print):
    """CIFAR-10's parts laid out for the calls: a, the training set's first half (call 1, beside the carried graphs);
    b, its second half, the test set and the decoder (call 2). The folders' sizes in bytes."""
    layout = {"a": ["cifar10_train_part1of2.npz"],
              "b": ["cifar10_train_part2of2.npz", "cifar10_test.npz", "decode_cifar10_parts.py"]}
    missing = [name for names in layout.values() for name in names if not (Path(parts) / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{parts}: no {', '.join(missing)} (../shared/data/cifar10/parts/ holds them)")
    sizes = {}
    for half, names in layout.items():
        folder = Path(gpudata) / half
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name in names:
            shutil.copy(Path(parts) / name, folder / name)
        sizes[half] = sum(f.stat().st_size for f in folder.iterdir())
        say(f"{folder}: {', '.join(names)} ({size_text(sizes[half])})")
    exclude, line = Path(gpudata).parent / ".git" / "info" / "exclude", f"/{Path(gpudata).name}/"
    text = exclude.read_text() if exclude.is_file() else ""
    if exclude.parent.is_dir() and line not in text.split():         # the data travels only where a call carries it
        exclude.write_text(text + ("\n" if text and not text.endswith("\n") else "") + line + "\n")
    return sizes


def tree_bytes(root=ROOT):
    """The bytes of the working tree the run tool sends: tracked files and untracked ones git does not ignore."""
    import subprocess
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True).stdout.split("\0")
    return sum((Path(root) / n).stat().st_size for n in names if n and (Path(root) / n).is_file())


def folder_bytes(path):
    path = Path(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def returnable(out, keep_first, *, say=print):
    """Call 1's graphs in out trimmed to what comes back beside its own files (RETURN_FILES files, RETURN_BYTES in
    all), the sides in keep_first kept first; the sides whose parts are all kept."""
    files, room, kept = RETURN_FILES - OWN_FILES, RETURN_BYTES - OWN_BYTES, []
    for side in keep_first:
        parts = compile_carry.part_paths(out, side)
        size = sum(p.stat().st_size for p in parts)
        if parts and len(parts) <= files and size <= room:
            files, room = files - len(parts), room - size
            kept.append(side)
        elif parts:
            for part in parts:
                part.unlink()
            say(f"{side}: its graphs ({size_text(size)} in {len(parts)} parts) exceed what comes back: not sent")
    return kept


def keep(returned, kind, say=print):
    """The graphs in a call's returned folder kept in .lease-cache/<kind>/, each side's replacing its earlier ones;
    beside them (GRAPHS) whether each is whole (its build ended) and, where not, the seconds compiled so far."""
    found, folder = compile_carry.carried(returned), CARRIED / kind
    record = fa.load_json(Path(returned) / COLD) or {}
    known = fa.load_json(folder / GRAPHS) or {}
    for side in found:
        compile_carry.write_parts(b"".join(p.read_bytes() for p in compile_carry.part_paths(returned, side)),
                                  folder, side)
        whole = side in record.get("build_s", {})
        before = known.get(side, {}).get("compiled_s", 0.0) if side in record.get("carried", []) else 0.0
        known[side] = {"complete": whole, "compiled_s": before + (record["build_s"][side] if whole else
                                                                   record.get("budget_s", 0.0))}
        say(f"{side}: {size_text(found[side])} kept in {folder} "
            + ("(whole)" if whole else f"(partial: {known[side]['compiled_s']:.0f} s compiled)"))
    if found:
        fa.write_json(folder / GRAPHS, known)
    else:
        say(f"{returned}: no compiled parts (<side>{compile_carry.SUFFIX}NN) to keep")
    return found


def carried_graphs(folder):
    """{side: {"complete", "compiled_s"}} of the sides whose graphs are kept in folder (complete where unrecorded)."""
    known = fa.load_json(Path(folder) / GRAPHS) or {}
    return {s: known.get(s, {"complete": True, "compiled_s": 0.0}) for s in compile_carry.carried(folder)}


# ---------------------------------------------------------------------------------------------------
# The calls, as the GPU machine runs them (and, tiny, the CPU's smoke)

def carry_and_commands(sides, n, budget_s, *, kind=KIND, call1_s=CALL1_BUDGET_S):
    """The two `run` calls: (carry list, command) each; call 1 carries the kind's graphs where there are any and
    builds until call1_s."""
    s, graphs = ",".join(sides), f"{CARRIED.name}/{kind}"
    call1 = ([".gpudata/a", "peers", CODE_VERSION_FILE, *([graphs] if compile_carry.carried(CARRIED / kind) else [])],
             "set -o pipefail; mkdir -p /root/c10 && cp .gpudata/a/* /root/c10/ && PYTHONUNBUFFERED=1 python3 "
             f"benchmarks/lease.py call1 --out $OUT --sides {s} --carried {graphs} --budget-s {call1_s:.0f} "
             "2>&1 | tee $OUT/call1.log")
    call2 = ([".gpudata/b", "peers", CODE_VERSION_FILE],
             "set -o pipefail; cp .gpudata/b/* /root/c10/ && python3 /root/c10/decode_cifar10_parts.py /root/c10 "
             "/root/cifar10.npz && PYTHONUNBUFFERED=1 python3 benchmarks/lease.py call2 --out $OUT "
             f"--data-dir /root/cifar10.npz --sides {s} --runs {n} --budget-s {min(budget_s, 560):.0f} 2>&1 | tee "
             "$OUT/call2.log")
    return call1, call2


def cache_environment(cache):
    return {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(Path(cache) / "triton")}


def adapter_args(args, *, sides, runs, synthetic, rows=None, budget_s=None, cache_in=None, cache_out=None):
    argv = ["compare", "--sides", ",".join(sides), "--runs", str(runs), "--log", str(Path(args.out) / "workers.log"),
            *(["--synthetic"] if synthetic else ["--data-dir", args.data_dir]),
            *(["--rows", str(rows)] if rows else []), *(["--budget-s", str(budget_s)] if budget_s else []),
            *(["--cache-in", str(cache_in)] if cache_in else []), *(["--cache-out", str(cache_out)] if cache_out else [])]
    if args.smoke:
        return fa.parse_args(argv + ["--smoke", "--standin", "--device", "cpu"])
    return fa.parse_args(argv + ["--compile", "max-autotune"])


def call1(args, say=print):
    """Every side built on random data into the cache at once, warm where its graphs were carried; each side's graphs
    into $OUT (the unbuilt's as the deadline stops them); the record of its builds kept with the cache."""
    sides = available_sides(args.sides.split(","), say=say)
    carried = compile_carry.carried(args.carried)
    say(f"carried graphs: {', '.join(f'{s} {size_text(b)}' for s, b in carried.items()) or 'none'}")
    start = time.time()
    _, builds, lost = fa.compare(adapter_args(args, sides=sides, runs=0, synthetic=True, budget_s=args.budget_s,
                                              cache_in=args.carried if carried else None, cache_out=args.out), say=say)
    longest_first = [*lost, *sorted(builds, key=builds.get, reverse=True)]     # the dearest to build again first
    returned = returnable(args.out, longest_first, say=say)
    result = {"call": 1, "sides": sides, "carried": sorted(carried), "build_s": builds, "budget_s": args.budget_s,
              "wall_s": time.time() - start, "lost": lost, "returned": {s: b for s, b in compile_carry.carried(args.out).items() if s in returned}}
    fa.write_json(Path(args.cache) / COLD, result)
    fa.write_json(Path(args.out) / COLD, result)
    for side, size in result["returned"].items():
        say(f"{side}: its graphs, {size_text(size)}, in $OUT (keep them: benchmarks/lease.py keep FOLDER)")
    return 1 if lost else 0


def call2(args, say=print):
    """The sides call 1 built (all, on a machine without its record), built again from the disk's cache and run in
    turn, each row into $OUT/rows.jsonl as it ends; the headline into $OUT/lease.json."""
    record = fa.load_json(Path(args.cache) / COLD) or {}
    if not record:
        say(f"no record of call 1 in {args.cache} (a fresh machine): every side is built here from nothing")
    unbuilt = record.get("lost", {})
    for side, why in unbuilt.items():
        say(f"{side}: not built in call 1 ({why}): left out; its graphs so far came back in call 1's $OUT")
    sides = [s for s in available_sides(args.sides.split(","), say=say) if s not in unbuilt]
    rows_path = Path(args.out) / "rows.jsonl"
    rows, builds, lost = fa.compare(adapter_args(args, sides=sides, runs=args.runs, synthetic=False, rows=rows_path,
                                                 budget_s=args.budget_s), say=say)
    h = fa.headline(rows, [s for s in sides if s not in PEERS])
    cold = {s: b for s, b in record.get("build_s", {}).items() if s not in record.get("carried", [])}
    walls = {s: [r["wall_s"] for r in rows if r["side"] == s] for s in sides}
    import machine
    fa.write_json(Path(args.out) / "lease.json", {
        "call": 2, "command": args.command, "device_name": "CPU (smoke)" if args.smoke else
        machine.nvidia_smi("name").get("name"), "sides": sides, "lost": {**unbuilt, **lost}, "headline": h,
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
    carried = carried_graphs(CARRIED / args.kind)
    steps, done, ok, deadline = plan(sides, n=args.runs, budget_s=args.budget_s, times=times, carried=carried)
    for line in minute_by_minute(steps):
        say(line)
    say(f"runs: {done}; headline ({', '.join(s for s in sides if s in HEADLINE)}, n = {args.runs}) "
        f"{'ends' if ok else 'does NOT end'} at {steps[-1][1] / 60:.1f} min of {args.budget_s / 60:.0f}")
    unbuilt = [s for s in sides if s in HEADLINE and not done[s]]
    if unbuilt:
        say(f"this lease yields {', '.join(s for s in sides if done[s])} at n = {args.runs}, and "
            f"{', '.join(unbuilt)}'s graphs so far, for the next lease's call 1 (keep them)")
    say("charged: " + "; ".join(f"{k} {v.replace(str(ROOT) + '/', '')}" for k, v in sorted(source.items())
                                if v != "assumed")
        + " (every other figure ASSUMED, benchmarks/lease.py)")
    # the copied tree has no .git: every result it writes names the commit it ran (core.code_version)
    VERSION_PATH.write_text(json.dumps(code_version()) + "\n")
    say(f"{CODE_VERSION_FILE}: {json.loads(VERSION_PATH.read_text())}")
    tree = tree_bytes()
    compiled = [s for s in sides if done[s] or s in HEADLINE]      # a headline side unbuilt compiles for the next
    for i, (carry, command) in enumerate(carry_and_commands(compiled, args.runs, args.budget_s, kind=args.kind,
                                                            call1_s=max(deadline, 1.0)), 1):
        size = tree + sum(folder_bytes(ROOT / c) for c in carry if (ROOT / c).is_dir())
        say(f"call {i}: carry {json.dumps(carry)}: {size_text(size)} with the tree, "
            + ("inside" if size <= CARRY_LIMIT else "OVER") + f" the {CARRY_LIMIT >> 20} MiB a call carries")
        say(f"call {i}: command {command}")
        ok = ok and size <= CARRY_LIMIT
    sizes = compile_carry.carried(CARRIED / args.kind)
    state = {s: "whole" if g["complete"] else f"partial, {g['compiled_s']:.0f} s compiled" for s, g in carried.items()}
    say(f"carried graphs ({CARRIED.name}/{args.kind}): "
        + (", ".join(f"{s} {size_text(sizes[s])} ({state[s]})" for s in carried) or "none: every build cold"))
    say("after call 1: python benchmarks/lease.py keep FILES_AT (its graphs, for the next lease); call 2 at once, on "
        "the machine still warm (a fresh one builds every side cold)")
    return 0 if ok else 1


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["prepare", "plan", "call1", "call2", "keep", "smoke"])
    p.add_argument("returned", nargs="?", default=None, help="keep: the folder a call's files came back to")
    p.add_argument("--sides", default=",".join(OURS + PEERS), help="our recipes, e1, hiverge (in this order)")
    p.add_argument("--runs", type=int, default=25, help="runs of each side (default 25)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"plan: the device seconds (default {DEVICE_BUDGET_S:.0f}); a call: its own (default "
                        f"{CALL1_BUDGET_S:.0f})")
    p.add_argument("--kind", default=KIND, help=f"plan, keep: the device tool's kind (default {KIND})")
    p.add_argument("--results", default=None, help="plan: measured times from here (default results/<kind>)")
    p.add_argument("--out", default=None, help="a call: the folder whose files come back ($OUT)")
    p.add_argument("--data-dir", default=None, help="call2: CIFAR-10 as one .npz")
    p.add_argument("--cache", type=Path, default=CACHE, help="the compile cache's folder")
    p.add_argument("--carried", type=Path, default=None, help="call1: the carried graphs' folder "
                   f"({CARRIED.name}/<kind>)")
    p.add_argument("--parts", type=Path, default=PARTS, help="prepare: CIFAR-10's parts (default ../shared's)")
    p.add_argument("--keep", default=None, help="smoke: copy its folders here")
    args = p.parse_args(argv)
    if args.runs < 2 or (args.budget_s is not None and args.budget_s <= 0):
        p.error("--runs must be at least 2 (a ratio's interval) and --budget-s positive")
    if args.mode in ("call1", "call2") and not args.out:
        p.error(f"{args.mode}: --out names the folder that comes back ($OUT)")
    if args.mode == "call2" and not args.data_dir:
        p.error("call2: --data-dir: CIFAR-10 as one .npz")
    if args.mode == "keep" and not (args.returned and Path(args.returned).is_dir()):
        p.error(f"keep: {args.returned or 'FOLDER'}: not a folder; name the one a call's files came back to")
    if args.returned and args.mode != "keep":
        p.error(f"{args.mode}: takes no folder ({args.returned}); only keep does")
    if not available_sides(args.sides.split(","), say=lambda line: None):
        p.error(f"--sides {args.sides}: none of them is here; give our recipes (cifar10_fast.py --list-recipes) or "
                f"the peers ({', '.join(PEERS)})")
    args.smoke = args.mode == "smoke"          # the calls' own switch: the CPU's stand-ins, tiny
    args.budget_s = args.budget_s or (DEVICE_BUDGET_S if args.mode == "plan" else CALL1_BUDGET_S
                                      if args.mode != "smoke" else 600.0)
    args.results = args.results or str(ROOT / "results" / args.kind)
    args.command = " ".join(["python3", "benchmarks/lease.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "prepare":
        try:
            prepare(args.parts, ROOT / ".gpudata")
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.mode == "keep":
        return 0 if keep(args.returned, args.kind) else 1
    if args.mode == "plan":
        return print_plan(args)
    if args.mode == "smoke":
        return smoke(args)
    args.cache.mkdir(parents=True, exist_ok=True) if args.mode == "call1" else None
    with fa_environment(cache_environment(args.cache)):
        return (call1 if args.mode == "call1" else call2)(args)


if __name__ == "__main__":
    sys.exit(main())
