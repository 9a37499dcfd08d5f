"""A lent GPU's 12 minutes: our recipes beside E1 and the 2-second record, n >= 25 each, under both timings
(benchmarks/fulcrum_adapter.py), and ImageNet's GPU check (benchmarks/imagenet_gpu_check.py), in the calls that
benchmarks/lease_plan.py lays out for the graphs already kept here.

    python benchmarks/lease.py prepare              # CIFAR-10's parts laid out for the two calls (.gpudata/a and b)
    python benchmarks/lease.py plan                 # the minute-by-minute plan, each call's carry (sized), its command
    python benchmarks/lease.py plan --left-s S      # mid-lease, after a call: the rest, S the device's budget_left_s
    python benchmarks/lease.py call1 --out $OUT     # on the GPU, the build call: the sides compiled, graphs sent back
    python benchmarks/lease.py call2 --out $OUT --data-dir /root/cifar10.npz      # the run call: the sides timed
    python benchmarks/lease.py keep FOLDER          # here, after each call: its graphs and its results kept
    python benchmarks/lease.py smoke                # both calls tiny on the CPU (the peers' stand-ins, CUDA's)

The build call (call1) carries the graphs earlier leases compiled on this kind of GPU (.lease-cache/<kind>/,
benchmarks/compile_carry.py), and .gpudata/a (the training set's first half) where the run call follows, and builds
its sides' workers at once on random data of CIFAR-10's shapes and format (ours compiled max-autotune, E1's setup(),
the record's own warm-up run), warm where their graphs were carried and cold elsewhere, into one compile cache on the
machine's disk (CACHE). Each side's graphs go to $OUT as its build ends; a build still going at the deadline saves
what it compiled as it stops, so that a cold build longer than a call (E1's, on an H200) goes on from there in the
next lease.
The run call (call2), made at once on the machine still warm, carries .gpudata/b (the second half, the test set, the
decoder), decodes CIFAR-10, builds again from the disk's cache (warm), leaving out any side the build call did not
build, and runs the sides in turn, each run's row appended to $OUT/rows.jsonl as it ends, the headline written to
$OUT/lease.json.
"""
import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_carry  # noqa: E402
import fulcrum_adapter as fa  # noqa: E402
import lease_plan  # noqa: E402
import suite  # noqa: E402
from core import Parser  # noqa: E402
from devices import size_text  # noqa: E402
from install_size import folder_bytes  # noqa: E402
from lease_plan import CALL1_BUDGET_S, DEVICE_BUDGET_S, GRAPHS, KIND, OURS, PEERS, available_sides  # noqa: E402

CACHE = Path("/root/lease-cache")          # on the GPU machine: one compile cache for every side
PARTS = ROOT.parent / "shared" / "data" / "cifar10" / "parts"
COLD = "lease_call1.json"                  # call 1's record: its builds and the sides it did not build
RETURN_FILES, RETURN_BYTES = 8, 64 << 20   # what comes back from $OUT (16 MiB a file: compile_carry.PART_BYTES)
OWN_FILES, OWN_BYTES = 3, 4 << 20          # call 1's own files in $OUT: its log, the workers' log, its record


# ---------------------------------------------------------------------------------------------------
# What travels: the data's halves, the graphs that come back and those kept here

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
        sizes[half] = folder_bytes(folder)
        say(f"{folder}: {', '.join(names)} ({size_text(sizes[half])})")
    exclude, line = Path(gpudata).parent / ".git" / "info" / "exclude", f"/{Path(gpudata).name}/"
    text = exclude.read_text() if exclude.is_file() else ""
    if exclude.parent.is_dir() and line not in text.split():         # the data travels only where a call carries it
        exclude.write_text(text + ("\n" if text and not text.endswith("\n") else "") + line + "\n")
    return sizes


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


# a call's files in $OUT and their names in results/<kind>/: the build call's, the run call's, ImageNet's check's
RESULT_NAMES = {COLD: COLD, "call1.log": "lease_call1.log", "lease.json": "lease.json",
                "rows.jsonl": "lease_rows.jsonl", "call2.log": "lease_call2.log",
                lease_plan.IMAGENET_RESULT: lease_plan.IMAGENET_RESULT, "imagenet.log": "lease_imagenet.log"}


def kept_results(returned, results, say=print):
    """A call's results and logs copied from its returned folder into results (results/<kind>/), named as
    RESULT_NAMES says (the workers' log after its call), a smoke's refused: the names written."""
    returned, results = Path(returned), Path(results)
    lease, check = (fa.load_json(returned / name) or {} for name in ("lease.json", lease_plan.IMAGENET_RESULT))
    if lease.get("device_name") == "CPU (smoke)" or check.get("smoke"):
        say(f"{returned}: a smoke's files, not results: none kept in {results}")
        return []
    call = "call1" if (returned / COLD).is_file() else "call2" if (returned / "lease.json").is_file() else None
    names = {**RESULT_NAMES, **({"workers.log": f"lease_{call}_workers.log"} if call else {})}
    written = []
    for name, kept in names.items():
        if (returned / name).is_file():
            results.mkdir(parents=True, exist_ok=True)
            shutil.copy(returned / name, results / kept)
            written.append(kept)
    if written:
        say(f"kept in {results}: {', '.join(written)}")
    return written


def keep(returned, kind, say=print):
    """The graphs in a call's returned folder kept in .lease-cache/<kind>/, each side's replacing its earlier ones;
    beside them (GRAPHS) whether each is whole (its build ended) and, where not, the seconds compiled so far."""
    found, folder = compile_carry.carried(returned), lease_plan.CARRIED / kind
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


# ---------------------------------------------------------------------------------------------------
# The calls, as the GPU machine runs them (and, tiny, the CPU's smoke)

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
    with tempfile.TemporaryDirectory() as tmp:
        out1, out2 = Path(tmp) / "out1", Path(tmp) / "out2"
        out1.mkdir()
        out2.mkdir()
        base = dict(vars(args), smoke=True, cache=Path(tmp) / "cache", budget_s=args.budget_s)
        base["cache"].mkdir()
        with suite.environment_of(suite.cache_environment(base["cache"])):
            rc1 = call1(argparse.Namespace(**{**base, "out": out1}), say=say)
            data = str(suite.synthetic_npz(Path(tmp) / "c.npz"))
            rc2 = call2(argparse.Namespace(**{**base, "out": out2, "data_dir": data}), say=say)
        say(f"smoke: call 1 returned {sorted(p.name for p in out1.iterdir())}, call 2 "
            f"{sorted(p.name for p in out2.iterdir())}")
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    return rc1 or rc2


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["prepare", "plan", "call1", "call2", "keep", "smoke"])
    p.add_argument("returned", nargs="?", default=None, help="keep: the folder a call's files came back to")
    p.add_argument("--sides", default=",".join(OURS + PEERS), help="our recipes, e1, hiverge (in this order)")
    p.add_argument("--runs", type=int, default=25, help="runs of each side (default 25)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"plan: the device seconds (default {DEVICE_BUDGET_S:.0f}); a call: its own (default "
                        f"{CALL1_BUDGET_S:.0f})")
    p.add_argument("--left-s", type=float, default=None,
                   help="plan, mid-lease: the device tool's budget_left_s, the machine held warm; plans the rest")
    p.add_argument("--kind", default=KIND, help=f"plan, keep: the device tool's kind (default {KIND})")
    p.add_argument("--results", default=None, help="plan: measured times from here; keep: the call's results to here "
                                                    "(default results/<kind>)")
    p.add_argument("--out", default=None, help="a call: the folder whose files come back ($OUT)")
    p.add_argument("--data-dir", default=None, help="call2: CIFAR-10 as one .npz")
    p.add_argument("--cache", type=Path, default=CACHE, help="the compile cache's folder")
    p.add_argument("--carried", type=Path, default=None, help="call1: the carried graphs' folder "
                   f"({lease_plan.CARRIED.name}/<kind>)")
    p.add_argument("--parts", type=Path, default=PARTS, help="prepare: CIFAR-10's parts (default ../shared's)")
    p.add_argument("--keep", default=None, help="smoke: copy its folders here")
    args = p.parse_args(argv)
    if args.runs < 2 or (args.budget_s is not None and args.budget_s <= 0):
        p.error("--runs must be at least 2 (a ratio's interval) and --budget-s positive")
    if args.left_s is not None and (args.mode != "plan" or args.budget_s is not None or args.left_s <= 0):
        p.error(f"--left-s {args.left_s:g}: plan's alone, positive, and instead of --budget-s (it sets the budget)")
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
    if args.left_s:
        args.budget_s = args.left_s - lease_plan.ASSUMED["warm_margin_s"]
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
    if args.mode == "keep":        # the graphs for the next lease, the results for README (benchmarks/report.py)
        graphs, results = keep(args.returned, args.kind), kept_results(args.returned, args.results)
        return 0 if graphs or results else 1
    if args.mode == "plan":
        return lease_plan.show(args)
    if args.mode == "smoke":
        return smoke(args)
    if args.mode == "call1":
        args.cache.mkdir(parents=True, exist_ok=True)
    with suite.environment_of(suite.cache_environment(args.cache)):
        return (call1 if args.mode == "call1" else call2)(args)


if __name__ == "__main__":
    sys.exit(main())
