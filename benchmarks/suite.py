"""Every figure the project claims, measured by one program: tiers of pieces, most important first, each
finished piece written at once as JSON under results/<device>/ (the only source of README's tables).

    python benchmarks/suite.py --data-dir cifar10.npz                          # tiers 0-4 on the GPU
    python benchmarks/suite.py --data-dir cifar10.npz --tiers 0,1 --budget-s 540 --copy-to /tmp/out
    python benchmarks/suite.py --smoke                                         # all of it, tiny, on the CPU
    python benchmarks/suite.py --device cpu --tiers 0,cpu --data-dir cifar10.npz   # the CPU demonstration

  tier 0    the machine: GPU, SMs, memory, driver, CUDA, torch, clocks, power limit (nvidia-smi), measured
            bf16 matmul rate (8192^3, mean of 10 after warm-up), device-to-device copy bandwidth, and the
            counted FLOPs of every recipe; every other result embeds this fingerprint
  tier 1    fast94_next (n=100, --compile max-autotune) beside the 2-second record's own cifar10_speedrun.py
            (n=50; cloned into peers/cifar10-speedrun/); then fast94 (n=100) beside airbench's train94 (n=25)
  tier 2    fast94_lowflop and its ablations in turn with fast94_next in one process (50 each); fast94_next
            and fast94_muon beside airbench94 (100 / 25); fast94_next_lowres, our idea, compiled as fast94_next
            is (50); fast95 beside airbench95 (25 / 10); myrtle24 (5); myrtle10 (10)
  tier 3    fast96 beside airbench96 (10 / 5); the journey stages (3 each); fast94 with each of its tricks
            switched off in turn (10 each, uncompiled)
  tier 4    ResNet-50 images/s at 128-224 px (model alone, our store, ImageFolder); the first ImageNet run's
            checks (benchmarks/imagenet_gpu_check.py: each decoder, the step, both together, train killed and
            resumed, the stream race, host waits); the torchrun --nproc_per_node=1 (NCCL) overhead for fast94 and
            an ImageNet tiny run
  tier cpu  the CPU demonstration README quotes

Each piece runs the project's own command lines (recorded in its result) in a fresh process, with --out
rewritten after every run; a piece of ours beside others is benchmarks/compare.py's comparison. An interrupted
piece keeps the runs it finished: the suite merges them into its result while it runs, and the next command goes
on from them (seeds continue). --budget-s never starts work whose estimate (the piece's earlier chunks on this
device, else what the device's other pieces of its kind measured, else counted FLOPs over the measured matmul rate)
would overrun it: a piece that does not fit whole runs a chunk of the runs that fit, and the suite stops a command
that is still running at the deadline. One line per piece.
"""
import argparse
import contextlib
import datetime
import functools
import importlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from processes import die_with_parent  # noqa: E402
from run_statistics import one_sided_p, ratio_ci, summarize  # noqa: E402
from compare import cache_environment, environment_of, peer_missing  # noqa: E402
from machine import fingerprint  # noqa: E402

TIERS = ("0", "1", "2", "3", "4", "cpu")
# For planning only, until a piece has run once on the device: the fraction of the measured matmul rate
# that these small convolutional networks reach (airbench94 on an A100: 0.36 PFLOP in 3.8 s, ~30%; we
# assume half that), and the seconds a command needs before its first run (start, data, warm-up).
ASSUMED_EFFICIENCY = 0.15
SETUP_GUESS_S = {None: 40.0, "max-autotune": 300.0}
# The CPU accuracy tier's sides and runs wanted, in the order they are run. A side is a recipe and its flags as typed
# after --recipe; the last is fast94_next_lowres's candidate to win back its shortfall (docs/perf-notes.md). The
# record recipes and the candidate go to 13: at fast94's spread, n = 5 tells only a gap of about a quarter
# point (README)
CPU_ACCURACY = {"fast94_next": 13, "fast94": 13, "fast94_muon": 13, "fast94_next_lowres": 5,
                "fast94_next_lowres --epochs 7.89": 13}
SMOKE_CIFAR = ["--subset", "256", "--epochs", "1", "--width", "0.0625", "--batch-size", "64"]
# fast94_lowflop's piece: fast94_next, then fast94_lowflop, then each ablation (fast94_lowflop with one switch left out,
# a recipe of its own), all in turn in one process. Its switch: the lower-FLOP schedule, whose ablation is fast94_next
# itself.
LOWFLOP_SIDES = ("fast94_next", "fast94_lowflop")
# The peers' sides in compare.py's names: the record's is hiverge's (cifar10_speedrun.py), kept here as "record"
COMPARE_SIDE = {"record": "hiverge"}
# fast94 with each trick switched off in turn, as settings by flag name (cf.recipe("fast94", **changes)): what the
# ablation piece runs and experiments.ipynb trains; the first is fast94 itself, the one each drop is measured from
ABLATIONS = {"fast94": {}, "no whitening": {"whiten": False}, "no whitening bias": {"whiten_bias": False},
             "no lookahead": {"lookahead_momentum": 0.0}, "random flip": {"flip": "random"},
             "no TTA": {"tta": "none"}, "no label smoothing": {"label_smoothing": 0.0},
             "no dirac init": {"dirac_init": False}}


@dataclass
class Piece:
    """A unit of measurement: one result file. sides: name -> runs wanted; recipes: side -> our recipe
    (for FLOPs and the command); kind picks how its commands are built and read."""
    name: str
    tier: str
    title: str
    kind: str                        # fingerprint | cifar | side_by_side | beside_record | alternating (the three:
    #                                  compare.py) | torchrun_cifar | torchrun_imagenet | throughput | gpu_check
    sides: dict = field(default_factory=dict)
    recipes: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)
    compile: str = None
    needs: tuple = ()                # "gpu" (at full size), "nccl", "peer" (some sides)
    extra: list = field(default_factory=list)
    one_run_at_a_time: bool = False  # each command one run, of the first side short of its n: sides fill in order
    flags: dict = field(default_factory=dict)    # side -> its own flags, after the recipe's name (cifar pieces)


def journey_stages():
    import cifar10_fast as cf
    return [s["name"] for s in cf.JOURNEY]


def flags_of(changes):
    """The command-line flags that make `changes` (settings by flag name): {"whiten": False} -> --whiten false."""
    from settings import show
    return [arg for name, value in changes.items() for arg in (f"--{name.replace('_', '-')}", show(value))]


def pieces():
    """The whole suite, in order. Targets are the accuracy each side is tested against (one-sided t-test)."""
    fast = lambda name, recipe, n, peer, m, target, tier: Piece(
        name, tier, f"{recipe} (n={n}) alternating with {peer} (n={m}), compiled max-autotune", "side_by_side",
        {recipe: n, peer: m}, {recipe: recipe, peer: recipe}, {recipe: target, peer: target}, "max-autotune",
        ("gpu", "peer"))
    plain = lambda recipe, n, tier: Piece(recipe, tier, f"{recipe} (n={n})", "cifar", {recipe: n}, {recipe: recipe},
                                          {recipe: 0.94}, needs=("gpu",))
    stages = journey_stages()
    return [
        Piece("env", "0", "environment fingerprint and counted FLOPs", "fingerprint"),
        # the record's own script beside the recipe of its configuration: the comparison that names the project
        Piece("fast94_next_record", "1", "fast94_next (n=100) beside the 2-second record's own cifar10_speedrun.py "
              "(n=50), compiled max-autotune", "beside_record",
              {"fast94_next": 100, "record": 50},
              {"fast94_next": "fast94_next", "record": "fast94_next"}, {"fast94_next": 0.94, "record": 0.94},
              "max-autotune", ("gpu", "record")),
        fast("fast94", "fast94", 100, "airbench94", 25, 0.94, "1"),
        # our lowest-FLOP attempt and each of its switches left out, in turn with fast94_next in one process
        Piece("fast94_lowflop", "2", "fast94_lowflop and each switch's ablation in turn with fast94_next in one "
              "process (n=50 each), compiled max-autotune", "alternating", {s: 50 for s in LOWFLOP_SIDES},
              {s: s for s in LOWFLOP_SIDES}, {s: 0.94 for s in LOWFLOP_SIDES}, "max-autotune", ("gpu",)),
        fast("fast94_next", "fast94_next", 100, "airbench94", 25, 0.94, "2"),     # the record's configuration
        fast("fast94_muon", "fast94_muon", 100, "airbench94", 25, 0.94, "2"),
        Piece("fast94_next_lowres", "2", "fast94_next_lowres (n=50), compiled max-autotune, beside fast94_next's "
              "pieces", "cifar", {"fast94_next_lowres": 50}, {"fast94_next_lowres": "fast94_next_lowres"},
              {"fast94_next_lowres": 0.94}, "max-autotune", ("gpu",)),
        # the references train in float16; the recipes under bf16 autocast (weights, batch norm and SGD's momentum in
        # float32 either way; docs/cifar10.md, Precision): an ablation measured beside fast94_next's pieces
        Piece("fast94_next_fp16", "2", "fast94_next in float16 as the record trains (n=50), compiled as "
              "fast94_next's pieces are: the precision ablation", "cifar", {"fast94_next_fp16": 50},
              {"fast94_next_fp16": "fast94_next"}, {"fast94_next_fp16": 0.94}, "max-autotune", ("gpu",),
              extra=["--precision", "fp16"]),
        fast("fast95", "fast95", 25, "airbench95", 10, 0.95, "2"),
        plain("myrtle24", 5, "2"),
        plain("myrtle10", 10, "2"),
        fast("fast96", "fast96", 10, "airbench96", 5, 0.96, "3"),
        Piece("journey", "3", "the journey stages (n=3 each)", "cifar", {s: 3 for s in stages},
              {s: s for s in stages}, {s: 0.94 for s in stages}, needs=("gpu",)),
        # uncompiled, as experiments.ipynb trains it: eight commands of one recipe, each would pay its own compile
        Piece("ablation", "3", "fast94 with each trick switched off in turn (n=10 each), uncompiled", "cifar",
              {s: 10 for s in ABLATIONS}, {s: "fast94" for s in ABLATIONS}, {s: 0.94 for s in ABLATIONS},
              needs=("gpu",), flags={s: flags_of(changes) for s, changes in ABLATIONS.items()}),
        Piece("imagenet_throughput", "4", "ResNet-50 as rn50_16ep trains it: loader, ceiling and together, images/s at "
              "160-224 px", "throughput", needs=("gpu",), extra=["--sizes", "160,192,224"]),
        Piece("imagenet_gpu_check", "4", "the first ImageNet run: each decoder, the ResNet-50 and ResNet-18 steps and "
              "each with the GPU decoders at 160 and 224 px, train killed and resumed, the stream race, host waits",
              "gpu_check", needs=("gpu",)),
        Piece("torchrun_fast94", "4", "fast94 under torchrun --nproc_per_node=1 (NCCL) against a plain run",
              "torchrun_cifar", {"plain": 10, "torchrun": 10}, {"plain": "fast94", "torchrun": "fast94"},
              {"plain": 0.94, "torchrun": 0.94}, needs=("gpu", "nccl")),
        Piece("torchrun_imagenet_tiny", "4",
              "ImageNet tiny under torchrun --nproc_per_node=1 (NCCL) against a plain run",
              "torchrun_imagenet", {"plain": 3, "torchrun": 3}, {}, {"plain": 0.0, "torchrun": 0.0},
              needs=("gpu", "nccl")),
        Piece("cpu_demo", "cpu", "narrow ResNet-9 on 10,000 real images, 2 epochs, on the CPU (n=4)", "cifar",
              {"myrtle24": 4}, {"myrtle24": "myrtle24"}, {"myrtle24": 0.94},
              extra=["--subset", "10000", "--epochs", "2", "--width", "0.25"]),
        # The record recipes' accuracy in float32 on the CPU (docs/cifar10.md, Precision, says what that does and
        # does not tell of a GPU's): full size, the final evaluation alone, one run at a time and each kept as it
        # finishes, so that runs accumulate across calls and a cut-off run loses only itself; the sides in order,
        # each to its n before the next (fast94_next's 13: a 0.1-point shortfall at 80% power)
        Piece("cpu_accuracy", "cpu", "the record recipes at full size on the CPU, final evaluation only (accuracy; "
              "one run at a time, in order)", "cifar", dict(CPU_ACCURACY),
              {s: s.split()[0] for s in CPU_ACCURACY}, {s: 0.94 for s in CPU_ACCURACY},
              extra=["--eval-every", "0"], one_run_at_a_time=True, flags={s: s.split()[1:] for s in CPU_ACCURACY}),
    ]


def counted_flops(recipes):
    """cifar10_fast.count_flops of each recipe at full size on CIFAR-10's shapes (device-independent)."""
    import torch
    import cifar10_fast as cf
    import torch_backend as tb
    shapes = {"train_images": torch.zeros(1, 3, 1, 1).expand(50000, 3, 1, 1), "train_labels": torch.zeros(50000),
              "test_images": torch.zeros(1, 3, 32, 32).expand(10000, 3, 32, 32),
              "test_labels": torch.zeros(10000, dtype=torch.long)}
    views = lambda r: len(tb.tta_views(shapes["test_images"][:1], r.tta.views if r.tta else "none"))
    return {name: {**cf.count_flops(r, shapes), "parameters": tb.count_parameters(tb.build_model(r, "cpu")),
                   "tta_views": views(r), "tta_fraction": r.tta.fraction if r.tta else 1.0}
            for name, r in ((name, cf.recipe(name)) for name in recipes)}


# ---------------------------------------------------------------------------------------------------
# Commands of a piece

@dataclass
class Chunk:
    argv: list            # what runs: [launcher, script, args...], launcher "python" or "torchrun"
    parse: object         # its --out JSON -> {side: [runs]}
    flops: object = lambda out: {}     # its --out JSON -> {side: counted FLOPs per run}


# kinds whose sides run in one command (alternating); the others: one side a command
TOGETHER = ("side_by_side", "beside_record", "alternating")
ONE_COMMAND = ("throughput", "gpu_check")     # kinds measured by one command whose result is its rows
PAIRED = ("side_by_side", "beside_record", "torchrun_cifar", "torchrun_imagenet")     # ratio of the first to the second


def cifar_runs(out):
    return out.get("runs", [])


def imagenet_runs(out):
    return [{**r, "final_acc": r["final_top1"], "time": r["train_time"]} for r in out.get("runs", [])]


def chunk_for(piece, want, done, ctx, *, whole=False):
    """The command that adds want[side] runs to each side given done[side] runs so far (seeds go on from
    there). whole=True: the command that measures everything in one go, as a result records it."""
    out = [] if whole else ["--out", ctx["out"]]
    device = ["--device", ctx["device"]] if ctx["device"] else []
    smoke = SMOKE_CIFAR if ctx["smoke"] else []
    compile_ = ["--compile", piece.compile] if piece.compile and not ctx["smoke"] else []
    side = next(iter(want))
    seed = ["--seed", str(done.get(side, 0))] if done.get(side) else []
    if piece.kind == "cifar":
        argv = ["python", "cifar10_fast.py", "--recipe", piece.recipes[side], *piece.flags.get(side, []), "--runs",
                str(want[side]), *seed, "--data-dir", ctx["data"], *compile_, *(smoke or piece.extra), *device, *out]
        return Chunk(argv, lambda o: {side: cifar_runs(o)}, lambda o: {side: o.get("flops", {}).get("total")})
    if piece.kind in TOGETHER:          # benchmarks/compare.py: each side built alone, then their runs in turn
        sides = [s for s in piece.sides if want.get(s)]
        named = lambda counts: ",".join(f"{COMPARE_SIDE.get(s, s)}={counts.get(s, 0)}" for s in sides)
        argv = ["python", "benchmarks/compare.py", "--sides", ",".join(COMPARE_SIDE.get(s, s) for s in sides),
                "--runs", named(want), "--seed", named(done), "--data-dir", ctx["data"],
                "--compile", piece.compile or "none", *(["--smoke", "--in-process"] if ctx["smoke"] else []), *device,
                *(out and [*out, "--rows", ctx["out"] + ".rows"])]
        return Chunk(argv, lambda o: compared_runs(o, sides), lambda o: {     # ours alone count their FLOPs
            s: b["flops_per_run"] for s, b in o.get("builds", {}).items() if b.get("flops_per_run")})
    launcher = ["python"] if side == "plain" else ["torchrun", "--standalone", "--nproc_per_node=1"]
    if piece.kind == "torchrun_cifar":
        argv = [*launcher, "cifar10_fast.py", "--recipe", piece.recipes[side], "--runs", str(want[side]), *seed,
                "--data-dir", ctx["data"], *smoke, *device, *out]
        return Chunk(argv, lambda o: {side: cifar_runs(o)}, lambda o: {side: o.get("flops", {}).get("total")})
    if piece.kind == "torchrun_imagenet":
        argv = [*launcher, "imagenet_fast.py", "train", "--store", ctx.get("store") or "STORE", "--recipe", "tiny",
                "--runs", str(want[side]), *seed, *device, *out]
        return Chunk(argv, lambda o: {side: imagenet_runs(o)})
    raise ValueError(f"no commands for a {piece.kind} piece")


def compared_runs(out, sides):
    """{side: its valid runs} from a compare.py result, each with the suite's final_acc (the side's own accuracy) and
    time (our clock)."""
    rows = [r for r in out.get("rows", []) if r.get("valid", True)]
    return {s: [{**r, "final_acc": r["own_acc"], "time": r["ours_s"]} for r in rows
                if r["side"] == COMPARE_SIDE.get(s, s)] for s in sides}


def one_command_argv(piece, ctx, whole=False):
    """The command of a ONE_COMMAND piece (whole=True: as its result records it, without --out)."""
    if piece.kind == "gpu_check":
        return ["python", "benchmarks/imagenet_gpu_check.py", *(["--smoke"] if ctx["smoke"] else []),
                *([] if whole else ["--out", ctx["out"]])]
    return throughput_argv(piece, ctx, whole)


def throughput_argv(piece, ctx, whole=False):
    extra = (["--device", "cpu", "--images", "20", "--sizes", "32", "--steps", "1", "--warmup", "1",
              "--recipe", "tiny", "--batch-size", "8", "--workers", "1"] if ctx["smoke"] else piece.extra)
    return ["python", "benchmarks/imagenet_throughput.py", *extra, *([] if whole else ["--out", ctx["out"]])]


# ---------------------------------------------------------------------------------------------------
# Running a command: a fresh process, or (--in-process, for the CPU smoke run) this one

class Stopped(BaseException):
    """SIGTERM, from a scheduler or `timeout`: it ends the suite (after saving what finished), and is never taken
    for the exit status of the piece that was running (a BaseException, which launch's handlers let through)."""


def stop(*_):
    raise Stopped


COMPILE_CACHE = ".compile-cache"   # under results/<machine>/; .gitignore keeps it out of the repository


def compile_cache(results):
    """compare.cache_environment for the pieces of one machine: its folder under the results."""
    return cache_environment(Path(results) / COMPILE_CACHE)


def launch(argv, log, *, deadline, in_process, on_poll):
    """Runs argv with output to log; returns its exit status, or None when stopped at the deadline.
    on_poll() is called every few seconds while it runs (the suite merges partial results then). Stopped (SIGTERM
    to the suite) stops the command too, and goes on up."""
    if in_process and argv[0] == "python":
        module = Path(argv[1]).stem
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                rc = importlib.import_module(module).main(argv[2:])
            except SystemExit as e:
                rc = e.code
            except Exception as e:  # a crash of one piece must not end the suite
                print(f"{type(e).__name__}: {e}", file=f)
                rc = 1
        return rc or 0
    cmd = ([sys.executable, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else [sys.executable]) + argv[1:]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        # its own process group, so the deadline stops torchrun's workers too; and it dies with the suite, so
        # no orphan keeps the GPU busy under the next measurement
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0,
                                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        try:
            while True:
                try:
                    return proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    on_poll()
                    if deadline is not None and time.time() > deadline:
                        end(proc)
                        return None
        except BaseException:
            end(proc)
            raise


def end(proc):
    """Stops a command and all it started: SIGTERM to its process group, SIGKILL if it has not ended in 20 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------------------------------
# Results

def side_stats(runs, target, flops, rate_tflops):
    accs, times = [r["final_acc"] for r in runs], [r["time"] for r in runs]
    s = {"n": len(runs), "accuracy": summarize(accs), "p_mean_above_target": one_sided_p(accs, target),
         "time": summarize(times), "time_to_target": summarize([r.get("time_to_target") for r in runs]),
         "fraction_reaching_target": (sum(r.get("time_to_target") is not None for r in runs) / len(runs))
         if runs else None,
         "recompiled_runs": sum(1 for r in runs if r.get("recompiles") or r.get("eager_fallbacks"))}  # inside the clock
    if flops:
        s["flops_per_run"] = flops
        if runs:
            s["tflops_per_s"] = flops / s["time"]["mean"] / 1e12
        if rate_tflops:
            s["floor_s"] = flops / (rate_tflops * 1e12)
    return s


def finish(result, fp):
    """Statistics of every side and the ratios between them, from the runs."""
    rate = fp.get("matmul_tflops")
    for name, side in result.get("sides", {}).items():
        side["stats"] = side_stats(side["runs"], side["target"], side.get("flops_per_run"), rate)
    sides = list(result.get("sides", {}).values())
    if result["kind"] == "alternating" and sides:         # each side's time over the first's, run in turn with it
        times = lambda side: [r["time"] for r in side["runs"]]
        ratios = {s["name"]: ratio_ci(times(s), times(sides[0])) for s in sides[1:]}
        result["time_ratios"] = {n: ci and {"of": n, "to": sides[0]["name"], **ci} for n, ci in ratios.items()}
    if result["kind"] in PAIRED and len(sides) == 2:
        a, b = sides
        ci = ratio_ci([r["time"] for r in a["runs"]], [r["time"] for r in b["runs"]])
        result["time_ratio"] = ci and {"of": a["name"], "to": b["name"], **ci}
        if result["kind"] == "side_by_side":    # the peer's clock from its model built, as ours: the runs that timed it
            built = [r["time"] - r["construct_s"] for r in b["runs"] if "construct_s" in r]
            ci = ratio_ci([r["time"] for r in a["runs"]], built)
            result["time_ratio_after_construction"] = ci and {"of": a["name"], "to": b["name"], "n_to": len(built),
                                                              **ci}
    result["complete"] = all(s["n_wanted"] <= len(s["runs"]) for s in sides) and result.get("ran", True)
    return result


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def new_result(piece, fp, ctx):
    together = piece.kind in TOGETHER
    command = lambda s: shlex.join(chunk_for(piece, piece.sides if together else {s: piece.sides[s]}, {}, ctx,
                                             whole=True).argv)
    sides = {s: {"name": s, "target": piece.targets.get(s, 0.0), "n_wanted": n, "runs": [], "command": command(s)}
             for s, n in piece.sides.items()}
    return {"piece": piece.name, "tier": piece.tier, "title": piece.title, "kind": piece.kind, "fingerprint": fp,
            "sides": sides, "chunks": [], "complete": False, "smoke": ctx["smoke"]}


def merge(result, base, got, flops):
    """result's runs = the runs before this chunk (base) plus the chunk's (got), per side."""
    for side, f in flops.items():
        if f and side in result["sides"]:
            result["sides"][side]["flops_per_run"] = f
    for side, runs in got.items():
        if side in result["sides"]:
            result["sides"][side]["runs"] = base[side] + [r for r in runs if "seed" not in r or
                                                          r["seed"] not in {b.get("seed") for b in base[side]}]


# ---------------------------------------------------------------------------------------------------
# Planning

def mean_wall(runs):
    return sum(r.get("wall_s", r["time"]) for r in runs) / len(runs)


def measured_elsewhere(folder, piece, flops, *, smoke=False):
    """What the device's other pieces of the same kind measured: {"walls": {side: mean wall s a run}, "s_per_flop":
    the median of our recipes' mean wall s over their counted FLOPs, "setup_s": the slowest start of those that
    compile as this one does (None without one)}."""
    walls, per_flop, setups = {}, [], []
    compiles = {p.name: p.compile for p in pieces()}
    for path in sorted(Path(folder).glob("*.json")):
        r = load(path)
        if not r or path.stem == piece.name or r.get("kind") != piece.kind or r.get("smoke", False) != smoke:
            continue
        if compiles.get(path.stem, "?") == piece.compile:
            setups += [c["setup_s"] for c in r.get("chunks", []) if c.get("setup_s") is not None]
        for name, side in r["sides"].items():
            if side.get("runs") and "time" in side["runs"][0]:
                walls.setdefault(name, mean_wall(side["runs"]))
                if name in flops:
                    per_flop.append(walls[name] / run_flops(name, flops[name]))
    return {"walls": walls, "s_per_flop": statistics.median(per_flop) if per_flop else None,
            "setup_s": max(setups, default=None)}


def run_flops(recipe, f):
    """Counted FLOPs of one run of a recipe, an evaluation pass at the end of every epoch included."""
    import cifar10_fast as cf
    return f["train"] + math.ceil(cf.recipe(recipe).epochs) * f["final_eval"]


def per_run_s(piece, side, result, *, fp, flops, elsewhere=None):
    """Seconds one more run of a side should take: run_s's."""
    return run_s(piece, side, result, fp=fp, flops=flops, elsewhere=elsewhere)


def run_s(piece, side, result, *, fp, flops, elsewhere=None):
    """Seconds one more run of a side should take on its clock: its mean wall time so far; else the same side's in
    another piece on this device; else its counted FLOPs at the rate the device's measured recipes reached; else at
    the measured matmul rate times ASSUMED_EFFICIENCY."""
    runs = result["sides"][side]["runs"]
    if runs:
        return mean_wall(runs)
    recipe = piece.recipes.get(side)
    elsewhere = elsewhere or {"walls": {}, "s_per_flop": None}
    if side in elsewhere["walls"]:
        return elsewhere["walls"][side]
    if side == recipe and recipe in flops and elsewhere["s_per_flop"]:
        return run_flops(recipe, flops[recipe]) * elsewhere["s_per_flop"]
    for other in result["sides"].values():          # the peer: as long as ours, until it has run
        if other["runs"] and piece.recipes.get(other["name"]) == recipe:
            return mean_wall(other["runs"])
    f = flops.get(recipe) if recipe else None
    rate = fp.get("matmul_tflops")
    if not f or not rate:
        return 60.0
    return run_flops(recipe, f) / (rate * 1e12 * ASSUMED_EFFICIENCY)


def setup_s(piece, result, elsewhere=None):
    """Seconds before a command's first run: the slowest earlier chunk's, else the slowest of the device's other
    pieces that compile alike (measured_elsewhere), else a guess."""
    seen = [c["setup_s"] for c in result["chunks"] if c.get("setup_s") is not None]
    if seen:
        return max(seen)
    if elsewhere and elsewhere.get("setup_s") is not None:
        return elsewhere["setup_s"]
    return SETUP_GUESS_S.get(piece.compile, SETUP_GUESS_S[None])


def plan(piece, result, *, fp, flops, left_s, elsewhere=None):
    """(runs per side for the next command, its estimated seconds, estimated seconds of all the rest).
    The runs are what fits in left_s seconds (None: no limit), the sides of one command in proportion;
    {} when not even one run fits. elsewhere: measured_elsewhere's, for sides not yet run in this piece."""
    order = [*piece.sides, *(s for s in result["sides"] if s not in piece.sides)]      # the piece's order first
    left = {s: result["sides"][s]["n_wanted"] - len(result["sides"][s]["runs"]) for s in order}
    per = {s: per_run_s(piece, s, result, fp=fp, flops=flops, elsewhere=elsewhere) for s in left if left[s] > 0}
    setup = setup_s(piece, result, elsewhere)
    commands = 1 if piece.kind in TOGETHER else sum(left.values()) if piece.one_run_at_a_time else len(per)
    rest = commands * setup + sum(left[s] * per[s] for s in per)
    if piece.one_run_at_a_time:            # one run of the first side (in the piece's order) still short of its n
        first = next(iter(per))
        want = {first: 1}
        group = [first]
    else:
        group = list(per) if piece.kind in TOGETHER else list(per)[:1]
        want = {s: left[s] for s in group}
    est = setup + sum(want[s] * per[s] for s in group)
    if left_s is not None and est > left_s:
        share = max(0.0, (left_s - setup) / (est - setup))
        want = {s: math.floor(want[s] * share) for s in group}
        want = want if sum(want.values()) else {}
        est = setup + sum(want[s] * per[s] for s in want)
    return want, est, rest


# ---------------------------------------------------------------------------------------------------
# The suite

def synthetic_npz(path, n_train=512, n_test=256, seed=0):
    """CIFAR-shaped random images whose class is written into the red channel (for --smoke without data)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 256, (n, 32, 32, 3)) // 4).astype(np.uint8)
        x[..., 0] += (y * 19)[:, None, None].astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = x, y
    np.savez(path, **arrays)
    return path


def synthetic_store(folder, smoke):
    """A generated ImageFolder prepared into a store, for the ImageNet torchrun piece."""
    import imagenet_store
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from imagefolders import synthetic_imagefolder          # the tests' generated trees
    src = synthetic_imagefolder(Path(folder) / "src", 10, 16 if smoke else 128, 4 if smoke else 32, sizes=(32, 48))
    imagenet_store.prepare(src, Path(folder) / "store", log=lambda s: None)      # the JPEG store, as by default
    return str(Path(folder) / "store")


def run_piece(piece, ctx, *, fp, flops, deadline, say, note=""):
    """Runs (the rest of) a piece within the deadline, writing its result as runs finish. One line."""
    path = ctx["results"] / f"{piece.name}.json"
    old = load(path)
    result = old if old and old.get("kind") == piece.kind and old.get("smoke") == ctx["smoke"] \
        else new_result(piece, fp, ctx)
    for s, side in new_result(piece, fp, ctx)["sides"].items():     # n may differ from the last call's
        result["sides"].setdefault(s, side).update(n_wanted=side["n_wanted"], command=side["command"])
    result["fingerprint"] = fp

    def save():
        write_json(path, finish(result, fp))
        if ctx["copy_to"]:
            write_json(ctx["copy_to"] / fp["slug"] / path.name, result)
    if finish(result, fp)["complete"] and piece.kind not in ONE_COMMAND:
        say(f"{piece.name}: already complete ({describe(result)})")
        return
    elsewhere = measured_elsewhere(ctx["results"], piece, flops, smoke=ctx["smoke"])
    start, estimated = time.time(), 0.0
    while True:
        left_s = None if deadline is None else deadline - time.time()
        if piece.kind in ONE_COMMAND:
            est = max([c["seconds"] for c in result["chunks"]] or [SETUP_GUESS_S[None] + 240.0])
            want, rest = ({"rows": 1} if left_s is None or est <= left_s else {}), est
        else:
            want, est, rest = plan(piece, result, fp=fp, flops=flops, left_s=left_s, elsewhere=elsewhere)
        if not want:
            say(f"{piece.name}: {'not started' if not estimated else 'stopped'}: about {rest:.0f} s of work left, "
                f"{left_s:.0f} s of the budget left" + (f"; kept {describe(result)}" if estimated else ""))
            return
        estimated += est
        if piece.kind == "torchrun_imagenet" and not ctx.get("store"):
            ctx["store"] = synthetic_store(ctx["tmp"], ctx["smoke"])
        done = {s: len(side["runs"]) for s, side in result["sides"].items()}
        chunk = (Chunk(one_command_argv(piece, ctx), lambda o: {}) if piece.kind in ONE_COMMAND
                 else chunk_for(piece, want, done, ctx))
        base = {s: list(side["runs"]) for s, side in result["sides"].items()}
        out, log, t0 = Path(ctx["out"]), Path(ctx["tmp"]) / f"{piece.name}.log", time.time()
        out.unlink(missing_ok=True)

        def poll():
            got = load(out)
            if got:
                merge(result, base, chunk.parse(got), chunk.flops(got))
                save()
        try:
            rc = launch(chunk.argv, log, deadline=deadline, in_process=ctx["in_process"], on_poll=poll)
        except Stopped:
            poll()                      # the runs that finished before the signal are kept
            raise
        got = load(out) or {}
        merge(result, base, chunk.parse(got), chunk.flops(got))
        if piece.kind in ONE_COMMAND:
            result.update(rows=got.get("rows", []), command=shlex.join(one_command_argv(piece, ctx, whole=True)),
                          ran=rc == 0, **{k: got[k] for k in ("config",) if k in got})
        new = [r for s in base for r in result["sides"][s]["runs"][len(base[s]):]]
        result["chunks"].append({
            "argv": shlex.join(chunk.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "seconds": time.time() - t0, "estimated_s": est, "returncode": rc, "runs_added": len(new),
            "setup_s": time.time() - t0 - sum(r.get("wall_s", r["time"]) for r in new) if rc == 0 and new else None,
            "device_name": fp["device_name"], "sm_clock_after_matmul_mhz": fp.get("sm_clock_after_matmul_mhz"),
            "load_average_1min": os.getloadavg()[0]})
        save()
        if rc != 0:
            tail = log.read_text().splitlines()[-15:] if log.exists() else []
            why = "stopped at the budget" if rc is None else f"failed (exit status {rc})"
            say(f"{piece.name}: {why} after {time.time() - start:.0f} s; kept {describe(result)}"
                + ("" if rc is None else "".join("\n    " + line for line in tail)))
            return
        if result["complete"] or piece.kind in ONE_COMMAND:
            break
    say(f"{piece.name}: {'complete' if result['complete'] else 'partial'} in {time.time() - start:.0f} s"
        + (f" (estimated {estimated:.0f} s)" if deadline else "") + f": {describe(result)}{note}")


def describe(result):
    sides = [s for s in result.get("sides", {}).values() if s["n_wanted"] or s["runs"]]
    if len(sides) > 3:
        accs = [s["stats"]["accuracy"]["mean"] for s in sides if s.get("stats", {}).get("n")]
        return (f"{sum(len(s['runs']) for s in sides)}/{sum(s['n_wanted'] for s in sides)} runs of {len(sides)} recipes"
                + (f", mean accuracy {min(accs):.4f} to {max(accs):.4f}" if accs else ""))
    parts = []
    for name, side in result.get("sides", {}).items():
        st = side.get("stats") or {}
        if not side["n_wanted"] and not side["runs"]:
            continue
        acc, t = st.get("accuracy", {}).get("mean"), st.get("time", {}).get("mean")
        parts.append(f"{name} {len(side['runs'])}/{side['n_wanted']}"
                     + (f" acc {acc:.4f} time {t:.2f} s" if acc is not None else "")
                     + (f" (COMPILED INSIDE THE CLOCK in {st['recompiled_runs']} runs)" if st.get("recompiled_runs")
                        else ""))
    if result.get("rows"):
        parts.append(f"{len(result['rows'])} rows")
    return "; ".join(parts) or "nothing"


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None,
                   help="CIFAR-10 as for cifar10_fast.py (a .npz works offline); default: data/ (downloads), "
                        "or synthetic images with --smoke")
    p.add_argument("--tiers", default=None, help="comma-separated tiers to run, in order (default 0,1,2,3,4; "
                                                 "0,cpu on a CPU)")
    p.add_argument("--pieces", default=None, help="only these pieces (comma-separated names)")
    p.add_argument("--budget-s", type=float, default=None, help="start no work whose estimate overruns this")
    p.add_argument("--runs-scale", type=float, default=1.0, help="multiply every n (at least 2) for a quick pass")
    p.add_argument("--results", default=None, help="results folder (default results/; with --smoke a temporary one)")
    p.add_argument("--copy-to", default=None, help="also write each result into DIR/<device>/ (remote collection)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--smoke", action="store_true",
                   help="everything with tiny settings and n=2, in this process, into a temporary folder; on the CPU "
                        "unless --device says otherwise (the comparisons: the peers' stand-ins under CUDA's)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the commands inside this process rather than each in a new one (default: with --smoke)")
    p.add_argument("--list", action="store_true", help="print the pieces and exit")
    return p.parse_args(argv)


def main(argv=None):
    """The suite's command line: its exit status."""
    args = parse_args(argv)
    all_pieces = pieces()
    if args.list:
        for pc in all_pieces:
            print(f"tier {pc.tier:>3}  {pc.name:24s} {pc.title}")
        return 0
    say = lambda line: print(line, flush=True)
    import torch
    import devices
    from core import UsageError
    try:
        device = devices.resolve(args.device or ("cpu" if args.smoke else None))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.smoke:      # tiny networks gain nothing from a second thread, and a busy machine stalls its barrier
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"         # and so for the commands it starts (torchrun's ranks)
    tiers = (args.tiers
             or ("0,1,2,3,4,cpu" if args.smoke else "0,1,2,3,4" if device.type == "cuda" else "0,cpu")).split(",")
    bad = [t for t in tiers if t not in TIERS]
    names = args.pieces.split(",") if args.pieces else None
    unknown = [n for n in names or [] if n not in {pc.name for pc in all_pieces}]
    if bad or unknown or args.runs_scale <= 0 or (args.budget_s is not None and args.budget_s <= 0):
        print(f"error: {'unknown tiers ' + str(bad) + ' (choose from ' + ','.join(TIERS) + ')' if bad else ''}"
              f"{'unknown pieces ' + str(unknown) + ' (see --list)' if unknown else ''}"
              f"{'--runs-scale and --budget-s must be positive' if not bad and not unknown else ''}", file=sys.stderr)
        return 2
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    signal.signal(signal.SIGTERM, stop)             # a stopped suite ends its command too, keeping what finished

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or (str(synthetic_npz(Path(tmp) / "synthetic.npz")) if args.smoke else "data")
        data = os.path.abspath(data)            # the commands run in the repository's root: relative to it if inside
        data = os.path.relpath(data, ROOT) if Path(data).is_relative_to(ROOT) else data
        fp = fingerprint(device, args.smoke)
        results = Path(args.results) if args.results else (Path(tmp) / "results" if args.smoke else ROOT / "results")
        results = results / fp["slug"]
        results.mkdir(parents=True, exist_ok=True)
        copy_to = Path(args.copy_to) if args.copy_to else None
        # the peers: their stand-ins in the smoke pass; airbench only on a CUDA GPU
        missing = {side: peer_missing(side, args.smoke) for side in ("airbench94", "hiverge")}
        if device.type != "cuda" and not args.smoke:
            missing["airbench94"] = "airbench runs only on a CUDA GPU"
        ctx = {"smoke": args.smoke, "data": data, "device": "cpu" if device.type == "cpu" else None,
               "peer": missing["airbench94"], "record": missing["hiverge"], "results": results, "copy_to": copy_to,
               "tmp": tmp, "out": str(Path(tmp) / "out.json"),
               "in_process": args.smoke if args.in_process is None else args.in_process, "torch_device": device,
               "fingerprint": fp, "deadline": deadline}
        say(f"suite on {fp['device_name']} (torch {fp['torch']}): results in {results}"
            + (f", budget {args.budget_s:.0f} s" if deadline else "")
            + ("; SMOKE (tiny settings)" if args.smoke else ""))
        try:
            with environment_of(compile_cache(results)):      # pieces in this process and the commands it starts
                run_tiers(args, ctx, [pc for t in tiers for pc in all_pieces
                                      if pc.tier == t and pc.name in (names or [pc.name])], say)
        except Stopped:
            say(f"stopped by SIGTERM in {ctx.get('piece', 'the set-up')}; the finished runs are kept in {results}")
            return 143
    return 0


def run_tiers(args, ctx, chosen, say):
    """Runs the chosen pieces in order (the fingerprint's piece counts every recipe's FLOPs)."""
    fp, deadline, device = ctx["fingerprint"], ctx["deadline"], ctx["torch_device"]
    fp_path = ctx["results"] / "env.json"
    flops = {}
    for piece in chosen:
        if piece.kind == "fingerprint":
            flops = counted_flops(sorted({r for pc in pieces() for r in pc.recipes.values()}))
            env = {"piece": "env", "tier": "0", "kind": "fingerprint", "title": piece.title, "fingerprint": fp,
                   "counted_flops": flops, "complete": True, "smoke": args.smoke,
                   "command": "python benchmarks/suite.py --tiers 0"}
            write_json(fp_path, env)
            if ctx["copy_to"]:
                write_json(ctx["copy_to"] / fp["slug"] / "env.json", env)
            say(f"env: {fp['device_name']}, {fp['matmul_dtype']} matmul {fp['matmul_tflops']:.1f} TFLOP/s, "
                f"copy {fp['copy_gbps']:.0f} GB/s; FLOPs of {len(flops)} recipes counted")
            continue
        reason = skip_reason(piece, device, args.smoke)
        if reason:
            say(f"{piece.name}: skipped: {reason}")
            continue
        scaled, note = sized(piece, args, ctx)
        if not flops and deadline is not None:
            flops = (load(fp_path) or {}).get("counted_flops") or counted_flops(sorted(set(piece.recipes.values())))
        ctx["piece"] = piece.name
        run_piece(scaled, ctx, fp=fp, flops=flops, deadline=deadline, say=say, note=note)


def sized(piece, args, ctx):
    """(the piece with the runs this call wants of each side, a note for its line): scaled (scale), and with a side
    that cannot run here (ctx["peer"], ctx["record"]: why not) at 0 runs, said in the note."""
    scaled, note = scale(piece, smoke_runs(piece) if args.smoke else None, args.runs_scale), ""
    if ctx["peer"] and "peer" in piece.needs:
        note = f"; the peer's side skipped: {ctx['peer']}"
        scaled.sides = {s: (0 if s.startswith("airbench") else n) for s, n in scaled.sides.items()}
    if ctx["record"] and "record" in piece.needs:
        note += f"; the record's side skipped: {ctx['record']}"
        scaled.sides = {s: (0 if s == "record" else n) for s, n in scaled.sides.items()}
    return scaled, note


def smoke_runs(piece):
    """Runs a side in the smoke pass: 2, for the statistics of n > 1; 1 for each of the many journey stages, which
    take the code paths their first stages took."""
    return 1 if len(piece.sides) > 3 else 2


def skip_reason(piece, device, smoke):
    if "nccl" in piece.needs and device.type != "cuda" and not smoke:      # the smoke pass: torchrun over gloo
        return "needs a GPU (torchrun with NCCL)"
    if "gpu" in piece.needs and device.type != "cuda" and not smoke:
        return "needs a GPU at full size (use --smoke for a tiny CPU pass)"
    if piece.tier == "cpu" and device.type != "cpu":
        return "a CPU demonstration (run it with --device cpu)"
    return None


def scale(piece, fixed, factor):
    """The piece with every n set to `fixed` (smoke) or multiplied by factor (at least 2)."""
    n = lambda k: fixed if fixed else max(2, round(k * factor)) if factor != 1 else k
    return Piece(**{**piece.__dict__, "sides": {s: n(k) for s, k in piece.sides.items()}})


if __name__ == "__main__":
    sys.exit(main())
