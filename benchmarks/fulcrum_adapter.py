"""Our recipes, E1 (fulcrumresearch/cifar-10-speedrun's champion) and the 2-second record (hiverge/cifar10-speedrun)
timed side by side under two timings from the same runs: ours, and the Fulcrum harness's contract.

    python benchmarks/fulcrum_adapter.py compare --sides fast94_next,e1,hiverge --runs 25 --data-dir c.npz \\
        --rows rows.jsonl --budget-s 300
    python benchmarks/fulcrum_adapter.py worker --side e1 --data-dir c.npz     # one side, driven over stdin

The Fulcrum contract (its runners/README.md): `build` once a process, untimed (compile, graph capture); `prepare`
each run, charged (reset, whitening, augmentation materialised); `train` timed; the final evaluation untimed, one
standard 6-view test-time augmentation for every side (the image, its mirror, and both shifted a pixel up-left and
down-right, reflect-padded, with their mirrors; the first two weigh twice the others) on the graded split, the test
set after its first 2,000 images. Its clock: the host's, a device synchronise at both ends. Here:
  fulcrum_s  E1: its cached setup() (reset, whitening, its epochs' augmented batches) + its train() (the whole-run
             graph replayed); ours: cifar10_fast.train_run's training time (whitening fit, augmentation, every
             step; the network's re-initialisation is outside, as ours always times); the record: its own clock
             less its own evaluation, timed apart in the same run (its model reset is outside its clock)
  ours_s     our protocol: from the network built to the end of the side's own final evaluation. Ours: the
             recipe's `time`; the record: its CUDA events (whitening to the end of its TTA evaluation); E1, which
             has no evaluation of its own: fulcrum_s plus the 6-view evaluation.
Each side runs in a worker process of its own that builds once and then answers `run SEED` on stdin with one
`ROW {json}` line on stdout; `compare` starts them together, then asks them in turn (round robin), reads every
worker line by line and appends each row to --rows as it arrives: a deadline loses at most the run in flight.
The peers' scripts live in the git-ignored peers/ (fetched, never committed): E1's file imported as a module with
its untimed 60 s sleep made a no-op, the record's imported (its `__main__` block, which spins the GPU before each
run, is never run) and driven by its own main(run, model).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_carry  # noqa: E402
from core import Parser, one_sided_p, ratio_ci, summarize, write_json  # noqa: E402

PEERS = ROOT / "peers"
PEER_FILES = {"e1": PEERS / "fulcrum-speedrun" / "fable-100m" / "recipes" / "e1_1.74s_single-gpu_CHAMPION.py",
              "hiverge": PEERS / "cifar10-speedrun" / "cifar10_speedrun.py"}
STANDINS = {"e1": ROOT / "tests" / "peer_standins" / "e1_standin.py",
            "hiverge": ROOT / "tests" / "peer_standins" / "hiverge_standin.py"}
FEEDBACK_N = 2000            # the harness grades the test set after its first 2,000 images
SMOKE = {"subset": 256, "epochs": 1.0, "width": 0.0625, "batch_size": 64}
TIMINGS = ("fulcrum_s", "ours_s")
TERM_GRACE_S = 30.0         # a worker stopped at the deadline has this long to save its compiled graphs
TARGET = 0.94


def is_peer(side):
    return side in PEER_FILES


def peer_file(side, smoke):
    """The peer's script (its stand-in with smoke); FileNotFoundError in one line where it is absent."""
    path = (STANDINS if smoke else PEER_FILES)[side]
    if not path.is_file():
        raise FileNotFoundError(f"{side}'s script is not at {path}: fetch it with the `fetch` tool into peers/ "
                                f"(docs/measuring.md, The lease)")
    return path


# ---------------------------------------------------------------------------------------------------
# The standard evaluation, untimed, the same for every side

def six_view_accuracy(forward, images, labels, *, batch_size=2000):
    """Accuracy on the graded split (images[FEEDBACK_N:] where there are more) of the 6-view TTA of forward's
    logits: sum over views v of w_v forward(v), w = 1/4, 1/4, 1/8 x 4 (torch_backend.tta_views, airbench weights)."""
    import torch
    import torch_backend as tb
    if len(images) > FEEDBACK_N:
        images, labels = images[FEEDBACK_N:], labels[FEEDBACK_N:]
    correct = 0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size]
            logits = sum(w * forward(v).float() for w, v in tb.tta_views(x, "flip_translate", "airbench"))
            correct += (logits.argmax(1) == labels[start:start + batch_size]).sum().item()
    return correct / len(images)


def channels_last(forward):
    """forward of each view laid out channels-last and dense, as the peers' own evaluations feed their compiled
    networks (a shifted view's strides would otherwise compile it again)."""
    import torch
    return lambda v: forward(v.contiguous(memory_format=torch.channels_last))


def synchronize():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------
# The sides: build once, then one run at a time -> a row

def import_file(path, name):
    """The file at path imported as module `name`, its sys.argv[0] its own path while it loads (the record reads
    its own source through it, as a script run on its own would)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [str(path)]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


@contextlib.contextmanager
def no_sleep():
    """time.sleep a no-op: E1's setup() sleeps 60 s off its clock after each build and reset, which the harness's
    own copy of it leaves out too, and which a lent GPU cannot spare."""
    real = time.sleep
    time.sleep = lambda seconds: None
    try:
        yield
    finally:
        time.sleep = real


class OurSide:
    """Our recipe: built once (cifar10_fast.build: the data on the device, the compiled warm-up untimed)."""

    def __init__(self, name, arrays, *, compile_mode, smoke, device):
        import side_by_side as sbs
        flags = argparse.Namespace(compile=compile_mode, **(SMOKE if smoke else dict.fromkeys(SMOKE)))
        flags.subset = None
        self.r, self.options, self.ctx, self.built = sbs.built_recipe(name, flags, {"device": device}, arrays)

    def run(self, seed):
        import torch
        import cifar10_fast as cf
        import devices
        import torch_backend as tb
        import training as T
        with T.strict_compile():
            run = cf.train_run(self.r, self.built, self.options, ctx=self.ctx, seed=seed)
        data, device = self.built.data, torch.device(self.ctx.device)
        dtype, memory_format = devices.compute_dtype(device, self.options.precision), devices.memory_format(device)
        model, was_training = run["model"], run["model"].training
        model.eval()                    # the run's own network, maybe: its mode as it was for the next run
        with devices.autocast(device, dtype):
            acc = six_view_accuracy(lambda v: tb.logits_of(model, v, memory_format), data["test_images"],
                                    data["test_labels"])
        model.train(was_training)
        return {"fulcrum_s": run["train_time"], "ours_s": run["time"], "own_acc": run["final_acc"], "tta6_acc": acc,
                "prepare_s": None, "train_s": run["train_time"]}


class E1Side:
    """E1's file driven by its own hooks as the harness drives it: build = its first setup(); prepare = its cached
    setup() (reset, whitening, the epochs' augmented batches) with its loader's epoch back to 0; train = its train()
    (the graph's buffers rebound, the whole run replayed), its in-loop validation a no-op."""

    def __init__(self, path, data_folder):
        os.environ["CIFAR_DATA"] = str(data_folder)
        self.mod = import_file(path, "e1_recipe")
        self.mod.DATA_PATH = str(data_folder)
        with no_sleep():
            self.model, _ = self.mod.setup()
        loader = self.mod.CifarLoader(str(data_folder), train=False, batch_size=2000)
        self.test = (loader.normalize(loader.images), loader.labels)

    def run(self, seed):
        import torch
        torch.manual_seed(seed)
        synchronize()
        t0 = time.perf_counter()
        with no_sleep():
            self.mod._CACHE["train_loader"].epoch = 0
            model, extra = self.mod.setup()
        synchronize()
        t1 = time.perf_counter()
        self.mod.train(model, extra, argparse.Namespace(validate=lambda *a, **k: None))
        synchronize()
        t2 = time.perf_counter()
        was_training = model.training
        model.eval()
        acc = six_view_accuracy(channels_last(model.eval_forward), *self.test)
        model.train(was_training)
        synchronize()
        t3 = time.perf_counter()
        return {"fulcrum_s": t2 - t0, "ours_s": t3 - t0, "own_acc": acc, "tta6_acc": acc, "prepare_s": t1 - t0,
                "train_s": t2 - t1}


class RecordSide:
    """The 2-second record's file driven by its own main(run, model) in its data's folder: built as its __main__
    builds (the model compiled, its own warm-up run on random data), each run its own clock and its own TTA accuracy;
    its evaluate() timed apart where main calls it inside its clock (the first call of a run, its TTA)."""

    def __init__(self, path, data_folder):
        self.mod = import_file(path, "record_recipe")
        os.chdir(Path(data_folder).parent)          # it reads ./cifar10/{train,test}.pt
        self.evaluate, self.eval_s = self.mod.evaluate, []
        self.mod.evaluate = self.timed_evaluate
        import torch
        self.model = self.mod.CifarNet().to("cuda", memory_format=torch.channels_last)     # as its __main__ builds it
        self.model.compile(mode="max-autotune")
        self.mod.main("warmup", self.model)
        loader = self.mod.CifarLoader("cifar10", train=False, batch_size=2000)
        self.test = (loader.normalize(loader.images), loader.labels)

    def timed_evaluate(self, model, loader, tta_level=0):
        synchronize()
        t0 = time.perf_counter()
        acc = self.evaluate(model, loader, tta_level)
        synchronize()
        self.eval_s.append(time.perf_counter() - t0)
        return acc

    def run(self, seed):
        import torch
        torch.manual_seed(seed)
        self.eval_s.clear()
        _, own_acc, own_s = self.mod.main(seed + 1, self.model)
        was_training = self.model.training
        self.model.eval()
        acc = six_view_accuracy(channels_last(self.model), *self.test)
        self.model.train(was_training)
        return {"fulcrum_s": own_s - self.eval_s[0], "ours_s": own_s, "own_acc": own_acc, "tta6_acc": acc,
                "prepare_s": None, "train_s": own_s - self.eval_s[0]}


def build_side(side, data, *, compile_mode, smoke, device, folder):
    """The side built (untimed) on `data` (the four arrays), peers reading it from folder/cifar10/."""
    import devices
    import side_by_side as sbs
    if not is_peer(side):
        return OurSide(side, data, compile_mode=compile_mode, smoke=smoke, device=str(devices.resolve(device)))
    sbs.write_airbench_layout(data, folder)
    path = peer_file(side, smoke)
    return (E1Side if side == "e1" else RecordSide)(path, Path(folder) / "cifar10")


def synthetic_arrays(n_train=50000, n_test=10000, seed=0):
    """Random CIFAR-10 of the real format and shapes (uint8 NHWC, labels 0-9): what the warm-up compiles on."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return {"train_images": rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
            "train_labels": rng.integers(0, 10, n_train), "test_images": rng.integers(0, 256, (n_test, 32, 32, 3),
                                                                                       dtype=np.uint8),
            "test_labels": rng.integers(0, 10, n_test)}


def worker(args):
    """One side: built, then a ROW line for each `run SEED` read from stdin, until `quit` or its end."""
    import tempfile
    import cifar_data as cd
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                   # the peers' own prints go to stderr; stdout carries the protocol alone
    say = lambda kind, what: print(f"{kind} {json.dumps(what)}", file=protocol, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        try:
            carried = compile_carry.load(args.side, args.cache_in)     # an earlier lease's graphs: a warm build
            data = synthetic_arrays(*((512, 256) if args.smoke else ())) if args.synthetic else \
                cd.take_subset(cd.load_cifar10(args.data_dir), SMOKE["subset"] if args.smoke else None)
            with compile_carry.saved_on_sigterm(args.side, args.cache_out):     # the deadline keeps what compiled
                side = build_side(args.side, data, compile_mode=args.compile, smoke=args.smoke, device=args.device,
                                  folder=folder)
        except Exception as e:      # one line to the driver, whatever broke
            say("FAILED", {"side": args.side, "error": f"{type(e).__name__}: {e}"})
            return 1
        build_s = time.perf_counter() - t0
        if args.cache_out:
            compile_carry.save(args.side, args.cache_out)
        say("BUILT", {"side": args.side, "build_s": build_s, "carried_artifacts": carried,
                      "graphs": compile_carry.graph_counts()})
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            t0 = time.perf_counter()
            row = side.run(int(words[1]))
            say("ROW", {"side": args.side, "seed": int(words[1]), **row, "wall_s": time.perf_counter() - t0})
    return 0


# ---------------------------------------------------------------------------------------------------
# The driver: workers started together, asked in turn, read line by line

class Worker:
    """A side's worker process and a thread that queues its stdout's lines as they come."""

    def __init__(self, side, argv, log):
        self.side, self.lines = side, queue.Queue()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next_message(self, deadline):
        """(kind, what) of its next protocol line; ("LOST", None) at its end, ("DEADLINE", None) at the deadline."""
        while True:
            try:
                line = self.lines.get(timeout=None if deadline is None else max(0.0, deadline - time.time()))
            except queue.Empty:
                return "DEADLINE", None
            if line is None:
                return "LOST", None
            kind, _, what = line.partition(" ")
            if kind in ("BUILT", "ROW", "FAILED"):
                return kind, json.loads(what)

    def ask(self, seed):
        self.proc.stdin.write(f"run {seed}\n")
        self.proc.stdin.flush()

    def stop(self):
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def worker_argv(side, args):
    launcher = [sys.executable, *(["tests/standin_main.py"] if args.standin and is_peer(side) else [])]
    given = {"--data-dir": args.data_dir, "--compile": args.compile, "--device": args.device,
             "--cache-in": args.cache_in, "--cache-out": args.cache_out}
    return [*launcher, "benchmarks/fulcrum_adapter.py", "worker", "--side", side,
            *[word for flag, value in given.items() if value for word in (flag, str(value))],
            *(["--smoke"] if args.smoke else []), *(["--synthetic"] if args.synthetic else [])]


def compare(args, say=print):
    """Every side's worker built at once, then runs in turn until each has --runs or the deadline; each row appended
    to --rows as it arrives. Returns (rows, builds {side: seconds}, lost sides {side: why})."""
    sides = args.sides.split(",")
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    rows, builds, lost = [], {}, {}
    log = open(args.log or os.devnull, "a")
    workers = {s: Worker(s, worker_argv(s, args), log) for s in sides}
    try:
        for s, w in workers.items():
            kind, what = w.next_message(deadline)
            if kind == "BUILT":
                builds[s] = what["build_s"]
                carried, graphs = what.get("carried_artifacts"), what.get("graphs") or {}
                say(f"{s}: built in {what['build_s']:.1f} s" + (f", {carried} carried artifacts loaded first"
                                                                  if carried is not None else "")
                    + (f"; graphs: {graphs['hit']} from the cache, {graphs['miss']} compiled" if graphs else ""))
            else:
                lost[s] = what["error"] if kind == "FAILED" else kind.lower()
                say(f"{s}: not built: {lost[s]}")
        for k in range(args.runs):
            for s, w in workers.items():
                if s in lost:
                    continue
                w.ask(args.seed + k)
                kind, row = w.next_message(deadline)
                if kind != "ROW":
                    lost[s] = kind.lower()
                    say(f"{s}: stopped at run {k + 1}: {lost[s]}")
                    if kind == "DEADLINE":
                        return rows, builds, lost
                    continue
                row["k"] = k
                rows.append(row)
                if args.rows:
                    with open(args.rows, "a") as f:
                        f.write(json.dumps(row) + "\n")
                say(f"{s} run {k + 1}: fulcrum {row['fulcrum_s']:.3f} s, ours {row['ours_s']:.3f} s, "
                    f"6-view {row['tta6_acc']:.4f}")
    finally:
        for w in workers.values():
            if w.proc.poll() is None and deadline is not None and time.time() > deadline:
                w.proc.terminate()      # a build in flight saves what it compiled (--cache-out), then ends
                try:
                    w.proc.wait(timeout=TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
            w.stop()
        log.close()
    return rows, builds, lost


def load_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def headline(rows, ours, peers=("e1", "hiverge")):
    """{timing: {"sides": {side: {n, time, accuracies, the 6-view's one-sided p of mean > TARGET}}, "ratios":
    {f"{ours}/{peer}": ratio_ci}}} for both timings."""
    by_side = {}
    for row in rows:
        by_side.setdefault(row["side"], []).append(row)
    out = {}
    for timing in TIMINGS:
        table = {s: {"n": len(rs), "time": summarize([r[timing] for r in rs]),
                     "accuracy_6view": summarize([r["tta6_acc"] for r in rs]),
                     "p_6view_above_target": one_sided_p([r["tta6_acc"] for r in rs], TARGET),
                     "accuracy_own": summarize([r["own_acc"] for r in rs])} for s, rs in by_side.items()}
        ratios = {f"{o}/{p}": ratio_ci([r[timing] for r in by_side[o]], [r[timing] for r in by_side[p]])
                  for o in ours if o in by_side for p in peers if p in by_side}
        out[timing] = {"sides": table, "ratios": ratios}
    return out


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["compare", "worker"])
    p.add_argument("--sides", default="fast94_next,e1,hiverge", help="compare: our recipes, e1, hiverge")
    p.add_argument("--side", default=None, help="worker: the one side")
    p.add_argument("--runs", type=int, default=25, help="compare: runs of each side (0: built alone, a warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as one .npz")
    p.add_argument("--compile", default=None, choices=["default", "max-autotune"], help="our recipes' compile mode")
    p.add_argument("--device", default=None)
    p.add_argument("--budget-s", type=float, default=None, help="compare: stop at this many seconds, keeping rows")
    p.add_argument("--rows", default=None, help="compare: append each run's row to this JSON-lines file")
    p.add_argument("--log", default=None, help="compare: the workers' stderr")
    p.add_argument("--out", default=None, help="compare: the headline as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny settings and the peers' stand-ins (tests/peer_standins)")
    p.add_argument("--standin", action="store_true", help="the peers' workers under tests/cuda_standin.py (their "
                   "scripts call .cuda()); ours on the --device given")
    p.add_argument("--synthetic", action="store_true", help="random data of the real shapes (a compile warm-up)")
    p.add_argument("--cache-in", default=None, help="a folder of carried compiled parts (benchmarks/compile_carry.py), "
                   "loaded before each side's build")
    p.add_argument("--cache-out", default=None, help="each side's compiled parts written here once built, or at "
                   "the deadline")
    args = p.parse_args(argv)
    if args.runs < 0 or (args.budget_s is not None and args.budget_s <= 0):
        p.error("--runs must not be negative (0: the sides built alone, a warm-up) and --budget-s must be positive")
    if args.mode == "worker" and not args.side:
        p.error("worker: --side names its side")
    if not args.synthetic and not args.data_dir:
        p.error("--data-dir: CIFAR-10 as one .npz (or --synthetic)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    ours = [s for s in args.sides.split(",") if not is_peer(s)]
    rows, builds, lost = compare(args)
    result = {"argv": sys.argv[1:] if argv is None else argv, "builds_s": builds, "lost": lost, "rows": rows,
              "headline": headline(rows, ours)}
    if args.out:
        write_json(args.out, result)
    for timing, h in result["headline"].items():
        for pair, ci in h["ratios"].items():
            if ci:
                print(f"{timing} {pair}: {ci['ratio']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
