"""The lease's plan (`python benchmarks/lease.py plan`): what a lent GPU's 12 minutes go to, step by step, charged
from what results/<kind>/ measured and from ASSUMED figures elsewhere, each call's carry sized against the run tool's
limit and its command written out.

A lease takes one of two shapes:
  headline  every headline side (HEADLINE) can be built in time: call 1 builds every side at once, warm where its
            graphs were carried (benchmarks/compile_carry.py); call 2 runs them n times each; then ImageNet's GPU
            check, where it has not run on this kind of GPU and the time left holds it.
  compile   a headline side cannot be built in time (E1's cold build is longer than a lease): ImageNet's GPU check
            first, where it has not run on this kind, then that side compiling alone (no other build contending for
            the autotuning's benchmarks) until the device time left, its graphs kept for the next lease. The sides
            that could be built are not run: the headline lease that follows times them beside it.
"""
import json
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_carry  # noqa: E402
import fulcrum_adapter as fa  # noqa: E402
from core import CODE_VERSION_FILE, code_version  # noqa: E402
from devices import size_text  # noqa: E402
from install_size import folder_bytes  # noqa: E402

OURS = ("fast94_next", "fast94_fastest", "fast94_curriculum")
PEERS = ("e1", "hiverge")
HEADLINE = ("fast94_next", "e1", "hiverge")
KIND = "nvidia-h200"                       # the device tool's kind: results/<kind>/ and .lease-cache/<kind>/
CARRIED = ROOT / ".lease-cache"            # here (git-ignored): call 1's returned graphs, a folder for each kind
GRAPHS = "carried.json"                    # beside the kept graphs: whether each side's are whole, its seconds compiled
WHEELS = ROOT / ".whl"                     # here (git-ignored): what ImageNet's check needs that the machines lack
WHEEL_PACKAGES = ("nvidia_nvimgcodec_cu13-", "nvidia_nvjpeg-", "simplejpeg-")
IMAGENET_RESULT = "imagenet_gpu_check.json"
DEVICE_BUDGET_S = 720.0                    # 12 of the lease's 15 minutes: the rest is the margin
CALL_LIMIT_S = 600.0
CALL1_BUDGET_S = 540.0                     # the build call's builds; then TERM_GRACE_S for the unbuilt to save
MIN_BUILD_S = 60.0                         # a build call given less compiles too little to be worth its call
CARRY_LIMIT = 64 << 20                     # the run tool's working tree, carried paths included
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
    "install_s": 10.0,           # the three wheels installed from the carried folder
    "imagenet_s": 330.0,         # ImageNet's check whole: its own estimate (benchmarks/imagenet_gpu_check.py)
    "train_check_s": 120.0,      # its last check, the training killed and resumed (its own estimate): its --budget-s
                                 # is its share less this, so that the training begins only where it ends in the call
    "warm_margin_s": 60.0,       # the margin a plan made mid-lease (--left-s) keeps: a call's overrun, files' return
}


class Step(NamedTuple):
    start: float
    end: float
    call: int
    what: str
    in_command: bool             # inside the call's command (CALL_LIMIT_S), not its start, carrying or wait


@dataclass(frozen=True)
class LeasePlan:
    calls: tuple                 # each call's job, in order: "imagenet", "build", "run"
    steps: list
    runs: dict                   # side: its timed runs in this lease
    built: list                  # the sides the build call compiles
    deadline: float              # the build call's, for its builds
    ends: bool                   # the headline ends inside the budget, each call inside CALL_LIMIT_S

    @property
    def shape(self):
        """"headline" where the lease times the sides (a run call), else "compile"."""
        return "headline" if "run" in self.calls else "compile"


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
# What the plan charges

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


def imagenet_measured(folder):
    """Whether folder (results/<kind>/) holds ImageNet's GPU check run whole on that GPU: no smoke, no check skipped."""
    try:
        r = json.loads((Path(folder) / IMAGENET_RESULT).read_text())
    except (OSError, ValueError):
        return False
    return not r.get("smoke") and not any("skipped" in row for row in r.get("rows", []))


def carried_graphs(folder):
    """{side: {"complete", "compiled_s"}} of the sides whose graphs are kept in folder (complete where unrecorded)."""
    known = fa.load_json(Path(folder) / GRAPHS) or {}
    return {s: known.get(s, {"complete": True, "compiled_s": 0.0}) for s in compile_carry.carried(folder)}


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


# ---------------------------------------------------------------------------------------------------
# The two shapes, step by step

def laid(parts):
    """Steps from (call, seconds, what, in_command), each beginning where the one before ends."""
    steps, t = [], 0.0
    for call, seconds, what, in_command in parts:
        steps.append(Step(t, t + seconds, call, what, in_command))
        t += seconds
    return steps


def arrival(call, times, what):
    """A call's steps before its command: the machine's start (the first call, the machine not yet held) or the wait
    (a later one), then what it carries in."""
    first = (call, times["start_s"], "machine start", False) if call == 1 and not times.get("held") else \
        (call, times["gap_s"], "between the calls (the machine held warm)", False)
    return [first, (call, times["transfer_s"], what, False)]


def held(times):
    """The charges of a lease whose machine is already held (a plan made mid-lease): no start, a call's wait."""
    return {**times, "start_s": times["gap_s"], "held": True}


def imagenet_parts(call, times):
    """The ImageNet call's parts (as laid takes them): its arrival, the wheels' install, the check."""
    return [*arrival(call, times, "working tree and the wheels (.whl) carried in"),
            (call, times["install_s"], "the wheels installed into /tmp/site", True),
            (call, times["imagenet_s"], "ImageNet's GPU check (benchmarks/imagenet_gpu_check.py), its result written "
                                        "after each check", True)]


def build_deadline(sides, *, n, times, build, budget_s):
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


def headline_lease(sides, *, n, times, carried, budget_s):
    """The headline's shape (ImageNet's check not yet added): every side built at once in call 1 (charged_builds),
    those built by its deadline run n times each in call 2."""
    slowdown = at_once(sides, times)
    build = charged_builds(sides, times, carried)
    deadline, built = build_deadline(sides, n=n, times=times, build=build, budget_s=budget_s)
    stopped = [s for s in sides if s not in built]
    warm = [s for s in built if carried.get(s, {}).get("complete")]
    how = "; ".join(part for part in (
        f"warm from carried graphs: {', '.join(warm)}" if warm else "",
        f"cold or from partial graphs: {', '.join(s for s in built if s not in warm)}" if set(built) - set(warm)
        else "",
        f"{', '.join(stopped)} compiling until {max(deadline, 0):.0f} s, then stopped, its graphs so far sent back"
        if stopped else "") if part)
    round_s = sum(times["run_s"][s] + times["eval6_s"] for s in built)
    steps = laid([
        *arrival(1, times, "working tree, .gpudata/a and the carried graphs carried in"),
        (1, times["copy_s"], "first half of CIFAR-10 copied to /root/c10/", True),
        (1, max(deadline, 0.0) + fa.TERM_GRACE_S if stopped else max(build[s] * slowdown for s in sides),
         f"every side built at once on random data ({how})", True),
        *arrival(2, times, "working tree and .gpudata/b carried in"),
        (2, times["decode_s"], "CIFAR-10 decoded to /root/cifar10.npz", True),
        (2, max((times["warm_s"][s] for s in built), default=0.0) * slowdown,
         "every side call 1 built, built again from the disk's cache, at once (warm)", True),
        *((2, round_s, f"round {k + 1}: one timed run of each of {', '.join(built)}", True) for k in range(n))])
    return LeasePlan(("build", "run"), steps, {s: n if s in built else 0 for s in sides}, list(sides),
                     deadline, ends_in_time(steps, budget_s) and set(sides) & set(HEADLINE) <= set(built))


def compile_lease(sides, *, times, carried, budget_s, imagenet):
    """The compile shape: ImageNet's check first (imagenet), then `sides` built alone or together until the device
    time left (at most CALL1_BUDGET_S), their graphs so far sent back; nothing timed."""
    call = 2 if imagenet else 1
    before = [*(imagenet_parts(1, times) if imagenet else []),
              *arrival(call, times, "working tree, peers and the carried graphs carried in")]
    deadline = min(CALL1_BUDGET_S, budget_s - sum(seconds for _, seconds, _, _ in before) - fa.TERM_GRACE_S)
    build = charged_builds(sides, times, carried)
    whole = max(build[s] * at_once(sides, times) for s in sides)
    built = f"{', '.join(sides)} built {'alone' if len(sides) == 1 else 'together, the other sides not built'}"
    what = (f"{built} on random data until {max(deadline, 0):.0f} s, its graphs so far sent back" if whole > deadline
            else f"{built} on random data, its graphs sent back")
    steps = laid([*before, (call, min(whole, max(deadline, 0.0) + fa.TERM_GRACE_S), what, True)])
    return LeasePlan(("imagenet", "build") if imagenet else ("build",), steps, dict.fromkeys(sides, 0),
                     list(sides), deadline, False)


def plan(sides, *, n, budget_s, times, carried=None, imagenet=False):
    """The lease (LeasePlan): the headline's sides (HEADLINE) n runs each, those beyond it kept, from the first, only
    while the headline still ends in time, and ImageNet's check after it (imagenet) where the time left holds it;
    or, where a headline side cannot be built in time, the compile shape for the sides that cannot."""
    carried = carried or {}
    headline = [s for s in sides if s in HEADLINE]
    kept = list(headline)
    for extra in [s for s in sides if s not in HEADLINE]:
        if headline_lease(kept + [extra], n=n, times=times, carried=carried, budget_s=budget_s).ends:
            kept.append(extra)
    lease = headline_lease([s for s in sides if s in kept], n=n, times=times, carried=carried, budget_s=budget_s)
    unbuilt = [s for s in headline if not lease.runs[s]]
    if unbuilt:                      # ImageNet's check kept only while the build call still gets its minute
        for check in (True, False) if imagenet else (False,):
            lease = compile_lease(unbuilt, times=times, carried=carried, budget_s=budget_s, imagenet=check)
            if lease.deadline >= MIN_BUILD_S:
                break
        return replace(lease, runs=dict.fromkeys(sides, 0))
    lease = replace(lease, runs={s: lease.runs.get(s, 0) for s in sides})
    if imagenet and lease.ends:
        with_imagenet = laid([(s.call, s.end - s.start, s.what, s.in_command) for s in lease.steps]
                             + imagenet_parts(3, times))
        if ends_in_time(with_imagenet, budget_s):
            return replace(lease, calls=("build", "run", "imagenet"), steps=with_imagenet)
    return lease


def ends_in_time(steps, budget_s):
    """The last step ends inside budget_s, and each call's command inside CALL_LIMIT_S."""
    calls = {}
    for s in steps:
        calls[s.call] = calls.get(s.call, 0.0) + (s.end - s.start) * s.in_command
    return steps[-1].end <= budget_s and all(v <= CALL_LIMIT_S for v in calls.values())


def minute_by_minute(steps):
    """The plan's lines: each step's minutes and what it does; the rounds of call 2 folded into one line."""
    lines, rounds = [], [s for s in steps if s.what.startswith("round ")]
    for s in steps:
        if s.what.startswith("round ") and s != rounds[0]:
            continue
        start, end, what = s.start, s.end, s.what
        if what.startswith("round "):
            start, end, what = rounds[0].start, rounds[-1].end, f"{len(rounds)} rounds: " + what.split(": ", 1)[1]
        lines.append(f"{start / 60:5.1f}-{end / 60:5.1f} min  call {s.call}  {what}")
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
# What each call carries, and its command

def tree_bytes(root=ROOT):
    """The bytes of the working tree the run tool sends: tracked files and untracked ones git does not ignore."""
    import subprocess
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True).stdout.split("\0")
    return sum((Path(root) / n).stat().st_size for n in names if n and (Path(root) / n).is_file())


def missing_wheels(folder=None):
    """The packages of WHEEL_PACKAGES with no wheel in folder (WHEELS)."""
    folder = Path(folder or WHEELS)
    names = [p.name for p in folder.glob("*.whl")] if folder.is_dir() else []
    return [w.rstrip("-") for w in WHEEL_PACKAGES if not any(n.startswith(w) for n in names)]


def carry_and_commands(lease, *, n, budget_s, kind=KIND, times=ASSUMED):
    """{call's job: (its carry list, its command)} for the run tool; the build call carries the kind's graphs where
    there are any, and the first half of CIFAR-10 only where a run call follows."""
    graphs, out = f"{CARRIED.name}/{kind}", {}
    s = ",".join(lease.built)
    data = "run" in lease.calls
    out["build"] = (
        [*([".gpudata/a"] if data else []), "peers", CODE_VERSION_FILE,
         *([graphs] if compile_carry.carried(CARRIED / kind) else [])],
        "set -o pipefail; " + ("mkdir -p /root/c10 && cp .gpudata/a/* /root/c10/ && " if data else "")
        + f"PYTHONUNBUFFERED=1 python3 benchmarks/lease.py call1 --out $OUT --sides {s} --carried {graphs} "
          f"--budget-s {max(lease.deadline, 1.0):.0f} 2>&1 | tee $OUT/call1.log")
    out["run"] = (
        [".gpudata/b", "peers", CODE_VERSION_FILE],
        "set -o pipefail; cp .gpudata/b/* /root/c10/ && python3 /root/c10/decode_cifar10_parts.py /root/c10 "
        "/root/cifar10.npz && PYTHONUNBUFFERED=1 python3 benchmarks/lease.py call2 --out $OUT "
        f"--data-dir /root/cifar10.npz --sides {s} --runs {n} --budget-s {min(budget_s, 560):.0f} 2>&1 | tee "
        "$OUT/call2.log")
    checks_s = times["imagenet_s"] - times["train_check_s"]
    out["imagenet"] = (
        [WHEELS.name, CODE_VERSION_FILE],
        f"set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site {WHEELS.name}/*.whl && "
        "PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/imagenet_gpu_check.py "
        f"--out $OUT/{IMAGENET_RESULT} --budget-s {checks_s:.0f} 2>&1 | tee $OUT/imagenet.log")
    return {job: out[job] for job in lease.calls}


def show(args, say=print):
    """`lease.py plan`: the minute-by-minute plan, what it yields, each call's carry (sized) and command; the exit
    status (1 where the headline does not end or a carry is over the limit)."""
    sides = available_sides(args.sides.split(","), say=say)
    times, source = times_for(sides, args.results)
    if args.left_s:                  # mid-lease: the machine held, what the device tool says is left less a margin
        times = held(times)
        say(f"mid-lease: {args.left_s:.0f} s of device time left, {times['warm_margin_s']:.0f} s kept back, the "
            "machine held (no start charged)")
    carried = carried_graphs(CARRIED / args.kind)
    imagenet = not imagenet_measured(args.results)
    lease = plan(sides, n=args.runs, budget_s=args.budget_s, times=times, carried=carried, imagenet=imagenet)
    for line in minute_by_minute(lease.steps):
        say(line)
    say(f"runs: {lease.runs}; headline ({', '.join(s for s in sides if s in HEADLINE)}, n = {args.runs}) "
        f"{'ends' if lease.ends else 'does NOT end'} at {lease.steps[-1].end / 60:.1f} min of "
        f"{args.budget_s / 60:.0f}")
    if lease.shape == "compile" and lease.deadline < MIN_BUILD_S:
        say(f"nothing fits: the build call would get {max(lease.deadline, 0):.0f} s, under the {MIN_BUILD_S:.0f} s "
            "a build call is worth")
    elif lease.shape == "compile":
        check = "ImageNet's GPU check and " if "imagenet" in lease.calls else ""
        say(f"this lease yields {check}{', '.join(lease.built)}'s graphs (keep them), for a headline lease to "
            "follow; the sides it could build are timed beside them there")
    elif imagenet and "imagenet" not in lease.calls:
        charged = sum(seconds for _, seconds, _, _ in imagenet_parts(3, times))
        say(f"ImageNet's GPU check ({charged / 60:.1f} min charged) does not fit after the headline: a later lease's")
    say("charged: " + "; ".join(f"{k} {v.replace(str(ROOT) + '/', '')}" for k, v in sorted(source.items())
                                if v != "assumed")
        + " (every other figure ASSUMED, benchmarks/lease_plan.py)")
    # the copied tree has no .git: every result it writes names the commit it ran (core.code_version)
    VERSION_PATH.write_text(json.dumps(code_version()) + "\n")
    say(f"{CODE_VERSION_FILE}: {json.loads(VERSION_PATH.read_text())}")
    ok, tree = lease.ends, tree_bytes()
    for i, (job, (carry, command)) in enumerate(carry_and_commands(lease, n=args.runs, budget_s=args.budget_s,
                                                                   kind=args.kind, times=times).items(), 1):
        size = tree + sum(folder_bytes(ROOT / c) for c in carry if (ROOT / c).is_dir())
        command_s = sum(s.end - s.start for s in lease.steps if s.call == i and s.in_command)
        say(f"call {i} ({job}): carry {json.dumps(carry)}: {size_text(size)} with the tree, "
            + ("inside" if size <= CARRY_LIMIT else "OVER") + f" the {CARRY_LIMIT >> 20} MiB a call carries")
        say(f"call {i} ({job}): timeout_s {min(CALL_LIMIT_S, command_s + 30):.0f}; command {command}")
        ok = ok and size <= CARRY_LIMIT
        if job == "imagenet" and missing_wheels():
            say(f"call {i} ({job}): {WHEELS.name}/ lacks {', '.join(missing_wheels())}: fetch them here with the "
                "pip download line of docs/measuring.md (The first ImageNet run on a GPU)")
            ok = False
    sizes = compile_carry.carried(CARRIED / args.kind)
    state = {s: "whole" if g["complete"] else f"partial, {g['compiled_s']:.0f} s compiled" for s, g in carried.items()}
    say(f"carried graphs ({CARRIED.name}/{args.kind}): "
        + (", ".join(f"{s} {size_text(sizes[s])} ({state[s]})" for s in carried) or "none: every build cold"))
    say(f"after each call: python benchmarks/lease.py keep FILES_AT (its graphs for the next lease, its results and "
        f"logs into results/{args.kind}/), then python benchmarks/report.py; the calls back to back, on the machine "
        "still warm (a fresh one builds every side cold); where a call ends far from its charge, plan the rest with "
        "--left-s")
    return 0 if ok else 1
