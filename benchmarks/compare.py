"""Our recipes beside the peers on one GPU, every run timed under two clocks: the comparison anyone with a GPU runs.

    python benchmarks/compare.py --sides fast94_next,e1,hiverge,airbench94 --runs 25 --data-dir cifar10.npz
    python benchmarks/compare.py --sides e1,fast94_next,hiverge --build-only --cache-dir ~/cc     # compile, then exit
    python benchmarks/compare.py --sides fast94_next,e1,hiverge --runs 25 --budget-s 500 --cache-dir ~/cc \\
        --data-dir cifar10.npz --profile traces                 # warm from ~/cc; a traced run each; ends at 500 s
    python benchmarks/compare.py --smoke      # every side tiny on the CPU, under tests/cuda_standin.py

Sides: our recipes (cifar10_fast.py --list-recipes); e1 (fulcrumresearch/cifar-10-speedrun's champion file), hiverge
(the 2-second record, hiverge/cifar10-speedrun's cifar10_speedrun.py) and airbench94, 95, 96 (the airbench package,
installed or cloned). The peers are read from the git-ignored peers/ folder, never copied (PEERS: where each is and
the command that gets it); a missing one stops the command before anything runs, in one line naming that command.

Each side runs in a process of its own, built once (untimed: compiling, autotuning, graph captures, its own warm-up)
and alone: the next side starts building only once the one before has built, so that no two compile or autotune at
once on the GPU. Then the sides' runs interleave (each run of a side after its share of the others'), each run's row
appended to --rows as it ends. --budget-s stops the command at that many seconds, a build or run in flight lost, every
finished row kept and the headline written from them. --cache-dir keeps torch's compile caches (inductor's compiled
graphs, autotuning's choices, Triton's kernels) in a folder of one's own, filled as each graph compiles: a later
command reading it builds warm, and --build-only fills it and exits.

Every run is timed under two clocks from the same run. ours_s, our protocol: from the network built to the end of the
side's own final evaluation (ours: the recipe's `time`; the record: its CUDA events; airbench: the host's clock around
its train() and evaluation, its model construction inside, timed apart as construct_s; E1, which evaluates nothing of
its own: fulcrum_s and the standard evaluation). fulcrum_s, the Fulcrum harness's contract (runners/harness.py): build
free, prepare charged, train timed, the evaluation left out (ours: the host's clock around train_run, synchronised at
both ends, less its final evaluation; E1: its cached setup() and its train(); the record: its own clock less its own
evaluation; airbench: its train()). After every run, untimed, one standard evaluation for every side: the 6-view
test-time augmentation (the image, its mirror, both shifted a pixel up-left and down-right, reflect-padded, with their
mirrors; the first two weigh twice the others) on the test set after its first 2,000 images, between two fingerprints
of every parameter and buffer, as Fulcrum's grader takes them: a run whose evaluation changed the weights is invalid,
kept in the rows and left out of the headline.

The headline (--out, results/<device>/ by default, for benchmarks/report.py): under each clock, each side's n, mean
time and 6-view accuracy with the one-sided p of "mean > its target" (94%; 95% and 96% for those recipes), and each
of our recipes' mean time over each peer's with its 95% interval (with our recipes alone, each over the first).
"""
import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from run_statistics import one_sided_p, ratio_ci, summarize  # noqa: E402

PEERS_DIR = ROOT / "peers"
STANDINS = ROOT / "tests" / "peer_standins"


@dataclass(frozen=True)
class Peer:
    path: Path          # its file in peers/ (airbench: the package's folder, where it is not installed)
    standin: Path       # its CPU stand-in, for --smoke
    get: str            # what a user runs where it is missing


PEERS = {
    "e1": Peer(PEERS_DIR / "fulcrum-speedrun" / "fable-100m" / "recipes" / "e1_1.74s_single-gpu_CHAMPION.py",
               STANDINS / "e1_standin.py",
               "git clone https://github.com/fulcrumresearch/cifar-10-speedrun peers/fulcrum-speedrun"),
    "hiverge": Peer(PEERS_DIR / "cifar10-speedrun" / "cifar10_speedrun.py", STANDINS / "hiverge_standin.py",
                    "git clone https://github.com/hiverge/cifar10-speedrun peers/cifar10-speedrun"),
    **{f"airbench{n}": Peer(PEERS_DIR / "cifar10-airbench" / "airbench", STANDINS / "airbench",
                            "pip install airbench (or git clone https://github.com/KellerJordan/cifar10-airbench "
                            "peers/cifar10-airbench)") for n in (94, 95, 96)},
}
TARGETS = {"fast95": 0.95, "fast96": 0.96, "airbench95": 0.95, "airbench96": 0.96}     # 0.94 for every other side
SMOKE = {"subset": 256, "epochs": 1.0, "width": 0.0625, "batch_size": 64}
FEEDBACK_N = 2000            # Fulcrum's grader grades the test set after its first 2,000 images
BUILD_SEED = 1234            # as Fulcrum's harness seeds every build
TIMINGS = ("ours_s", "fulcrum_s")
TERM_GRACE_S = 30.0          # a side stopped at the budget has this long to end


def target(side):
    return TARGETS.get(side, 0.94)


def cache_environment(folder):
    """The environment that keeps torch.compile's caches in folder for every process started in it (inductor's FX
    graph and AOT autograd caches, its autotuning's choices; Triton's kernels under it, inductor's default)."""
    return {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(Path(folder).resolve())}


@contextlib.contextmanager
def environment_of(variables):
    """os.environ with `variables` set while inside, as it was after."""
    old = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------------
# The standard evaluation and the weights' fingerprint, the same for every side

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


def weights_fingerprint(model):
    """A digest of every parameter and buffer (shape, dtype and bytes, integer buffers included), as Fulcrum's grader
    takes one before and after its evaluation."""
    import torch
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def graded(model, forward, images, labels):
    """The standard evaluation, untimed: {"tta6_acc", "eval6_s", "weights_changed"} (the fingerprints before and
    after it differ), the model's mode as it was."""
    was_training = model.training
    model.eval()
    before, t0 = weights_fingerprint(model), time.perf_counter()
    acc = six_view_accuracy(forward, images, labels)
    seconds = time.perf_counter() - t0
    changed = weights_fingerprint(model) != before
    model.train(was_training)
    return {"tta6_acc": acc, "eval6_s": seconds, "weights_changed": changed}


def synchronize():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def channels_last(forward):
    """forward of each view laid out channels-last and dense, as the peers' own evaluations feed their compiled
    networks (a shifted view's strides would otherwise compile it again)."""
    import torch
    return lambda v: forward(v.contiguous(memory_format=torch.channels_last))


# ---------------------------------------------------------------------------------------------------
# The sides: each built once, then a run at a time -> (its clocks, its network, how to run it forward)

def import_file(path, name):
    """The file (or package folder) at path imported as module `name`, its sys.argv[0] its own path while it loads
    (the record reads its own source through it, as a script run on its own does)."""
    path = Path(path)
    init = path / "__init__.py" if path.is_dir() else path
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)]
                                                  if path.is_dir() else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # a package's modules import it by name
    argv, sys.argv = sys.argv, [str(init)]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


class Sleeps:
    """time.sleep made a no-op while inside, each sleep asked for counted: E1's setup() sleeps 60 s after its build and
    after each reset, off its clock (Fulcrum's own copy of the file has the sleep taken out)."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    @contextlib.contextmanager
    def skipped(self):
        real = time.sleep

        def skip(seconds):
            self.count, self.seconds = self.count + 1, self.seconds + seconds
        time.sleep = skip
        try:
            yield
        finally:
            time.sleep = real


@contextlib.contextmanager
def working_directory(folder):
    """The peers read ./cifar10/ from where they run: folder, while inside."""
    home = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(home)


class OurSide:
    """Our recipe: built once (cifar10_fast.build: the data on the device, the compiled warm-up untimed)."""

    def __init__(self, name, arrays, *, compile_mode, smoke, device):
        import cifar10_fast as cf
        import distributed as D
        import training as T
        self.r = cf.recipe(name, **({k: v for k, v in SMOKE.items() if k != "subset"} if smoke else {}))
        self.options = cf.Options(target=target(name), eval_every=0, compile=compile_mode)   # the end's alone
        self.ctx = D.Context(device=device)
        with T.strict_compile():
            self.built = cf.build(self.r, arrays, self.options, ctx=self.ctx,
                                  stats=cf.channel_stats(arrays["train_images"]))
        self.test = (self.built.data["test_images"], self.built.data["test_labels"])

    def run(self, seed):
        import torch
        import cifar10_fast as cf
        import devices
        import torch_backend as tb
        import training as T
        synchronize()
        t0 = time.perf_counter()
        before = cf.compile_counts()
        with T.strict_compile():
            run = cf.train_run(self.r, self.built, self.options, ctx=self.ctx, seed=seed)
        synchronize()
        wall = time.perf_counter() - t0
        run.update(cf.compile_counts(since=before))         # graphs compiled inside the clock: a flagged run
        device = torch.device(self.ctx.device)
        dtype = devices.compute_dtype(device, self.options.precision)
        model = run.pop("model")
        forward = lambda v: tb.tta_logits(model, v, batch_size=len(v))

        def autocast_forward(v):
            with devices.autocast(device, dtype):
                return forward(v)
        prepare = wall - run["time"]            # reset, optimisers: outside our clock, charged by Fulcrum's
        clocks = {"ours_s": run["time"], "fulcrum_s": prepare + run["train_time"], "prepare_s": prepare,
                  "train_s": run["train_time"], "own_acc": run["final_acc"]}
        return {**clocks, **{k: v for k, v in run.items() if k in ("recompiles", "eager_fallbacks")}}, model, \
            autocast_forward


class E1Side:
    """E1's file driven by its own hooks as Fulcrum's harness drives it: build = its first setup(); prepare = its cached
    setup() (reset, whitening, its epochs' augmented batches), its loader's epoch back to 0; train = its train() (the
    whole run's graph replayed), its in-loop validation a no-op. Its sleeps are skipped and counted."""

    def __init__(self, path, data_folder, sleeps):
        self.sleeps = sleeps
        os.environ["CIFAR_DATA"] = str(data_folder)
        self.mod = import_file(path, "e1_recipe")
        self.mod.DATA_PATH = str(data_folder)
        with sleeps.skipped():
            self.model, _ = self.mod.setup()
        loader = self.mod.CifarLoader(str(data_folder), train=False, batch_size=2000)
        self.test = (loader.normalize(loader.images), loader.labels)

    def run(self, seed):
        import torch
        torch.manual_seed(seed)
        synchronize()
        t0 = time.perf_counter()
        with self.sleeps.skipped():
            self.mod._CACHE["train_loader"].epoch = 0
            model, extra = self.mod.setup()
        synchronize()
        t1 = time.perf_counter()
        self.mod.train(model, extra, argparse.Namespace(validate=lambda *a, **k: None))
        synchronize()
        t2 = time.perf_counter()
        return {"fulcrum_s": t2 - t0, "prepare_s": t1 - t0, "train_s": t2 - t1}, model, \
            channels_last(model.eval_forward)


class RecordSide:
    """The 2-second record's file driven by its own main(run, model), built as its __main__ builds (the network
    compiled max-autotune, its own warm-up run on random data); its __main__ (a GPU spin before each run) never runs.
    Each run: its own clock and TTA accuracy, its evaluate() timed apart where main() calls it inside its clock."""

    def __init__(self, path, data_folder):
        import torch
        self.folder = Path(data_folder).parent
        self.mod = import_file(path, "record_recipe")
        self.evaluate, self.eval_s = self.mod.evaluate, []
        self.mod.evaluate = self.timed_evaluate
        with working_directory(self.folder):
            self.model = self.mod.CifarNet().cuda().to(memory_format=torch.channels_last)
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
        with working_directory(self.folder):
            _, own_acc, own_s = self.mod.main(seed + 1, self.model)
        return {"ours_s": own_s, "fulcrum_s": own_s - self.eval_s[0], "train_s": own_s - self.eval_s[0],
                "own_acc": own_acc}, self.model, channels_last(self.model)


class AirbenchSide:
    """The airbench package's trainNN with its defaults, on the host's clock after a device synchronise: its train()
    (model construction, timed apart as construct_s, whitening, training) and its evaluation at its own TTA level. Both
    loaders are built before the clock (its train() would load the test set inside it: it is handed the loaded one).
    Built by one untimed run."""

    def __init__(self, side, package, data_folder):
        self.folder, self.suffix = Path(data_folder).parent, side.removeprefix("airbench")
        self.airbench = import_file(package, "airbench")
        self.lib = getattr(self.airbench, f"lib_airbench{self.suffix}")
        with working_directory(self.folder):
            self.loader = self.airbench.CifarLoader("cifar10", train=True, batch_size=self.lib.hyp["opt"]["batch_size"],
                                                    aug=self.lib.hyp["aug"], altflip=True)
            self.test_loader = self.airbench.CifarLoader("cifar10", train=False, batch_size=2000)
        self.test = (self.test_loader.normalize(self.test_loader.images), self.test_loader.labels)
        self.run(BUILD_SEED)

    @contextlib.contextmanager
    def loaded_test_set(self):
        utils, load = self.airbench.utils, self.airbench.utils.CifarLoader
        utils.CifarLoader = lambda *a, train=True, **k: load(*a, train=train, **k) if train else self.test_loader
        try:
            yield
        finally:
            utils.CifarLoader = load

    def run(self, seed):
        import torch
        torch.manual_seed(seed)
        construct_s = []

        def make_net():             # its own constructor, told apart on the clock
            t = time.perf_counter()
            net = getattr(self.lib, f"make_net{self.suffix}")()
            construct_s.append(time.perf_counter() - t)
            return net
        train = getattr(self.airbench, f"train{self.suffix}")
        synchronize()
        t0 = time.perf_counter()
        with working_directory(self.folder), self.loaded_test_set():
            model = train(self.loader, make_net=make_net, verbose=False)
        t1 = time.perf_counter()
        acc = self.airbench.evaluate(model, self.test_loader, tta_level=self.lib.hyp["net"]["tta_level"])
        synchronize()
        t2 = time.perf_counter()
        return {"ours_s": t2 - t0, "fulcrum_s": t1 - t0, "train_s": t1 - t0, "own_acc": acc,
                "construct_s": sum(construct_s)}, model, channels_last(model)


def airbench_package(smoke):
    """The airbench package's folder: its stand-in with smoke, else the installed one, else the clone in peers/."""
    if smoke:
        return PEERS["airbench94"].standin
    spec = importlib.util.find_spec("airbench")
    return Path(spec.origin).parent if spec and spec.origin else PEERS["airbench94"].path


def peer_missing(side, smoke=False):
    """The one line that says how to get a missing peer, or None where it is here."""
    peer = PEERS[side]
    if smoke:
        return None if peer.standin.exists() else f"{side}: its stand-in is not at {peer.standin}"
    if side.startswith("airbench"):
        if importlib.util.find_spec("airbench") or (peer.path / "__init__.py").is_file():
            return None
        return f"{side}: the airbench package is neither installed nor in {peer.path.parent}: {peer.get}"
    return None if peer.path.is_file() else f"{side}: its script is not at {peer.path}: {peer.get}"


def build_side(side, arrays, *, folder, compile_mode, smoke, device, sleeps):
    """The side built (untimed) on `arrays`, the peers reading them from folder/cifar10/."""
    import devices
    if side not in PEERS:
        return OurSide(side, arrays, compile_mode=compile_mode, smoke=smoke, device=str(devices.resolve(device)))
    write_airbench_layout(arrays, folder)
    data = Path(folder) / "cifar10"
    if side.startswith("airbench"):
        return AirbenchSide(side, airbench_package(smoke), data)
    path = PEERS[side].standin if smoke else PEERS[side].path
    return E1Side(path, data, sleeps) if side == "e1" else RecordSide(path, data)


def write_airbench_layout(arrays, folder):
    """Our arrays as the peers' cache files, folder/cifar10/{train,test}.pt: dicts of `images` uint8 NHWC, `labels`
    int64, `classes`."""
    import torch
    import cifar_data as cd
    d = Path(folder) / "cifar10"
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        torch.save({"images": torch.from_numpy(arrays[f"{split}_images"]),
                    "labels": torch.from_numpy(arrays[f"{split}_labels"]).long(),
                    "classes": list(cd.CLASSES)}, d / f"{split}.pt")
    return Path(folder)


def synthetic_arrays(n_train=50000, n_test=10000, seed=0):
    """Random CIFAR-10 of the real format and shapes (uint8 NHWC, labels 0-9): what a build compiles on where no data
    is given (the graphs depend on the shapes alone)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    images = lambda n: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    return {"train_images": images(n_train), "train_labels": rng.integers(0, 10, n_train),
            "test_images": images(n_test), "test_labels": rng.integers(0, 10, n_test)}


def data_of(args):
    """The four arrays every side trains and is graded on: --data-dir's, else random ones of CIFAR-10's shapes (smaller
    with --smoke), the first SMOKE["subset"] training images with --smoke."""
    import cifar_data as cd
    arrays = cd.load_cifar10(args.data_dir) if args.data_dir else synthetic_arrays(*((512, 256) if args.smoke else ()))
    return cd.take_subset(arrays, SMOKE["subset"]) if args.smoke else arrays


def compile_counts():
    """{"graphs", "fx_cache_hits", "fx_cache_misses"}: the graphs torch.compile made in this process and those
    inductor found in its cache or compiled ({} before torch compiled anything)."""
    if "torch" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}


# ---------------------------------------------------------------------------------------------------
# A side's protocol: BUILT once, then a ROW for each run asked; FAILED, in one line, whatever broke

class Built:
    """A side built in this process, or why not: message() is ("BUILT", what) or ("FAILED", what)."""

    def __init__(self, side, args, folder):
        import torch
        self.side, self.sleeps, self.standin = side, Sleeps(), args.smoke       # --smoke: the CPU stands in
        started = time.time()
        try:
            torch.manual_seed(BUILD_SEED)
            self.handle = build_side(side, data_of(args), folder=folder, compile_mode=args.compile, smoke=args.smoke,
                                     device=args.device, sleeps=self.sleeps)
            self.error = None
        except Exception as e:      # one line to the driver, whatever broke
            self.handle, self.error = None, f"{type(e).__name__}: {e}"
        self.started, self.ended = started, time.time()

    def message(self):
        if self.error:
            return "FAILED", {"side": self.side, "error": self.error}
        flops = getattr(getattr(self.handle, "built", None), "flops", None)        # ours: counted per run
        return "BUILT", {"side": self.side, "build_s": self.ended - self.started, "started": self.started,
                         "ended": self.ended, "sleeps_skipped": self.sleeps.count,
                         "sleeps_skipped_s": self.sleeps.seconds, **compile_counts(),
                         **({"flops_per_run": flops["total"]} if flops else {})}

    def row(self, seed):
        """One run of the side and the standard evaluation after it: ("ROW", row) or ("FAILED", what)."""
        t0 = time.perf_counter()
        try:
            clocks, model, forward = self.handle.run(seed)
            checked = graded(model, forward, *self.handle.test)
        except Exception as e:
            return "FAILED", {"side": self.side, "error": f"{type(e).__name__}: {e}"}
        if "ours_s" not in clocks:          # E1 evaluates nothing of its own: its clock, then the standard one
            clocks = {**clocks, "ours_s": clocks["fulcrum_s"] + checked["eval6_s"], "own_acc": checked["tta6_acc"]}
        return "ROW", {"side": self.side, "seed": seed, **clocks, **checked, "valid": not checked["weights_changed"],
                       "wall_s": time.perf_counter() - t0}

    def profiled(self, path):
        """One more run of the side, untimed, under torch.profiler (the CPU's work, and the GPU's but under the
        stand-in), its trace written to path, gzip'd Chrome JSON: ("PROFILED", what) or ("FAILED", what)."""
        import gzip
        import shutil
        import torch
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                              if not self.standin else [])
        try:
            with torch.profiler.profile(activities=activities) as prof:
                self.handle.run(BUILD_SEED)
                synchronize()
            with tempfile.TemporaryDirectory() as tmp:
                prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
                with open(Path(tmp) / "trace.json", "rb") as f, gzip.open(path, "wb") as out:
                    shutil.copyfileobj(f, out)
        except Exception as e:
            return "FAILED", {"side": self.side, "error": f"{type(e).__name__}: {e}"}
        return "PROFILED", {"side": self.side, "trace": str(path), "bytes": Path(path).stat().st_size}


def worker(args):
    """--worker SIDE: the side built, then a ROW line for each `run SEED` read from stdin (a PROFILED line for each
    `profile PATH`), until `quit` or its end; the protocol alone on stdout (the peers' own prints go to stderr)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    say = lambda kind, what: print(f"{kind} {json.dumps(what)}", file=protocol, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        built = Built(args.worker, args, folder)
        say(*built.message())
        if built.error:
            return 1
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            say(*(built.profiled(words[1]) if words[0] == "profile" else built.row(int(words[1]))))
    return 0


# ---------------------------------------------------------------------------------------------------
# The driver: the sides built one after another, then asked in turn

class Process:
    """A side in a process of its own, and a thread that queues its protocol lines as they come."""

    def __init__(self, side, argv, log, env):
        self.side, self.lines = side, queue.Queue()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def message(self, deadline):
        """(kind, what) of its next protocol line; ("LOST", None) at its end, ("DEADLINE", None) at the deadline."""
        while True:
            try:
                line = self.lines.get(timeout=None if deadline is None else max(0.0, deadline - time.time()))
            except queue.Empty:
                return "DEADLINE", None
            if line is None:
                return "LOST", None
            kind, _, what = line.partition(" ")
            if kind in ("BUILT", "ROW", "PROFILED", "FAILED"):
                return kind, json.loads(what)

    def built(self, deadline):
        return self.message(deadline)

    def run(self, seed, deadline):
        return self.ask(f"run {seed}", deadline)

    def profile(self, path, deadline):
        return self.ask(f"profile {path}", deadline)

    def ask(self, line, deadline):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.message(deadline)

    def stop(self, now=False):
        """Ends it: at once (SIGTERM, then SIGKILL after TERM_GRACE_S) where `now`, else asked to quit."""
        if now and self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class InProcess:
    """A side in this process (--in-process: the CPU's smoke runs of the suite); a deadline is met between calls."""

    def __init__(self, side, args, env, folder):
        with environment_of(env):
            self.b = Built(side, args, folder)

    def built(self, deadline):
        return self.b.message()

    def run(self, seed, deadline):
        return self.b.row(seed)

    def profile(self, path, deadline):
        return self.b.profiled(path)

    def stop(self, now=False):
        pass


def worker_argv(side, args):
    """The command line of a side's worker: under the CUDA stand-in with --smoke."""
    launcher = [sys.executable, *(["tests/standin_main.py"] if args.smoke else [])]
    given = {"--data-dir": args.data_dir, "--compile": args.compile, "--device": args.device}
    return [*launcher, "benchmarks/compare.py", "--worker", side,
            *[word for flag, value in given.items() if value for word in (flag, str(value))],
            *(["--smoke"] if args.smoke else [])]


def next_side(wanted, done):
    """The side whose next run is due soonest, each side's runs spread over the comparison (its k-th at (k + 1/2) /
    its n of the way through); None when every side has its runs."""
    due = {s: (done[s] + 0.5) / n for s, n in wanted.items() if done[s] < n}
    return min(due, key=due.get) if due else None


def built_one_at_a_time(sides, start, deadline, say):
    """{side: handle} of the sides built, each started once the one before has built (no two compiling at once);
    the builds' records; the sides lost, each with why."""
    handles, builds, lost = {}, {}, {}
    for side in sides:
        if deadline is not None and time.time() >= deadline:
            lost[side] = "not built: the budget ended first"
            say(f"{side}: {lost[side]}")
            continue
        handle = start(side)
        kind, what = handle.built(deadline)
        if kind == "BUILT":
            handles[side], builds[side] = handle, what
            say(f"{side}: built in {what['build_s']:.1f} s" + (f", {what['sleeps_skipped']} sleeps of "
                f"{what['sleeps_skipped_s']:.0f} s skipped" if what.get("sleeps_skipped") else "")
                + (f"; graphs compiled {what['fx_cache_misses']}, from the cache {what['fx_cache_hits']}"
                   if what.get("graphs") else ""))
        else:
            lost[side] = (what["error"] if kind == "FAILED" else "stopped building at the budget (what it compiled "
                          "is in the cache)" if kind == "DEADLINE" else "its process ended")
            say(f"{side}: not built: {lost[side]}")
            handle.stop(now=kind == "DEADLINE")
    return handles, builds, lost


def compare(args, *, rows_path, say=print, on_row=lambda rows: None):
    """Every side built alone in turn, then runs in turn until each has its runs or the budget ends; each row appended
    to rows_path as it ends, then on_row(rows so far). (rows, builds {side: record}, lost {side: why})."""
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    env = cache_environment(args.cache_dir) if args.cache_dir else {}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(args.log, "a+") if args.log else tempfile.TemporaryFile("w+"))
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        start = (lambda s: InProcess(s, args, env, folder)) if args.in_process else \
            (lambda s: Process(s, worker_argv(s, args), log, env))
        handles, builds, lost = built_one_at_a_time(args.sides, start, deadline, say)
        rows = []
        try:
            if args.profile and not args.build_only:
                profiled(handles, args.profile, deadline=deadline, lost=lost, say=say)
            if not args.build_only:
                run_in_turn(handles, args, rows=rows, rows_path=rows_path, deadline=deadline, lost=lost, say=say,
                            on_row=lambda rows: on_row(rows, builds, lost))
        finally:
            ending = deadline is not None and time.time() >= deadline
            for h in handles.values():
                h.stop(now=ending)
        if "its process ended" in lost.values():        # why, in the last lines it wrote
            log.flush()
            log.seek(0)
            tail = " ".join(log.read().strip().splitlines()[-3:])[-300:]
            lost = {s: f"{why}: {tail}" if why == "its process ended" else why for s, why in lost.items()}
    return rows, builds, lost


def profiled(handles, folder, *, deadline, lost, say):
    """Each built side's one extra run, untimed, under torch.profiler, its trace into folder/<side>.trace.json.gz."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for side, handle in handles.items():
        kind, what = handle.profile(str(Path(folder).resolve() / f"{side}.trace.json.gz"), deadline)
        if kind == "PROFILED":
            say(f"{side}: one untimed run profiled: {what['trace']} ({what['bytes'] / 2 ** 20:.1f} MiB)")
        elif kind == "FAILED":
            say(f"{side}: not profiled: {what['error']}")      # the comparison goes on without its trace
        else:
            lost[side] = "stopped at the budget while profiled" if kind == "DEADLINE" else "its process ended"
            say(f"{side}: {lost[side]}")


def run_in_turn(handles, args, *, rows, rows_path, deadline, lost, say, on_row=lambda rows: None):
    """The built sides' runs, each when due (next_side), each row appended to rows and rows_path as it ends."""
    wanted = {s: args.runs[s] for s in handles}
    done = dict.fromkeys(handles, 0)
    while (side := next_side({s: n for s, n in wanted.items() if s not in lost}, done)) is not None:
        if deadline is not None and time.time() >= deadline:         # between runs (a side in this process)
            lost.update({s: "stopped at the budget" for s in wanted if done[s] < wanted[s] and s not in lost})
            say(f"the budget ended the runs: {', '.join(f'{s} {done[s]}' for s in wanted)} done")
            return
        kind, row = handles[side].run(args.seed[side] + done[side], deadline)
        if kind != "ROW":
            lost[side] = {"DEADLINE": "stopped at the budget, its run in flight lost", "LOST": "its process ended"}.get(
                kind) or row["error"]
            say(f"{side}: stopped at run {done[side] + 1}: {lost[side]}")
            if kind == "DEADLINE":
                return
            continue
        row["k"] = done[side]
        done[side] += 1
        rows.append(row)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        on_row(rows)
        say(f"{side} run {done[side]}/{wanted[side]}: ours {row['ours_s']:.3f} s, fulcrum {row['fulcrum_s']:.3f} s, "
            f"6-view {row['tta6_acc']:.4f}" + ("" if row["valid"] else "; INVALID: its evaluation changed the weights"))


def headline(rows, sides):
    """{timing: {"sides": {side: {n, time, accuracy_6view, p_6view_above_target, accuracy_own, target}}, "ratios":
    {"ours/peer": ratio_ci}}} over the valid rows, for both timings: each of our recipes over each peer, or over the
    first of ours where no peer ran."""
    by_side = {s: [r for r in rows if r["side"] == s and r.get("valid", True)] for s in sides}
    ours = [s for s in sides if s not in PEERS]
    others = [s for s in sides if s in PEERS] or ours[:1]
    out = {}
    for timing in TIMINGS:
        table = {s: {"n": len(rs), "time": summarize([r[timing] for r in rs]), "target": target(s),
                     "accuracy_6view": summarize([r["tta6_acc"] for r in rs]),
                     "p_6view_above_target": one_sided_p([r["tta6_acc"] for r in rs], target(s)),
                     "accuracy_own": summarize([r["own_acc"] for r in rs])} for s, rs in by_side.items() if rs}
        ratios = {f"{o}/{p}": ratio_ci([r[timing] for r in by_side[o]], [r[timing] for r in by_side[p]])
                  for o in ours for p in others if o != p and by_side[o] and by_side[p]}
        out[timing] = {"sides": table, "ratios": ratios}
    return out


# ---------------------------------------------------------------------------------------------------
# The command line

def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="fast94_next,e1,hiverge,airbench94",
                   help=f"our recipes and the peers ({', '.join(PEERS)}), comma-separated, built in this order")
    p.add_argument("--runs", default="25", help="timed runs of each side (default 25), or each its own: "
                                                "fast94=100,airbench94=25")
    p.add_argument("--seed", default="0", help="the first run's seed, a side's k-th run seed + k; or each side's "
                                               "own first seed: fast94=60,airbench94=15")
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as for cifar10_fast.py (a .npz works offline); "
                                                    "--build-only and --smoke take random images of its shapes")
    p.add_argument("--compile", default="max-autotune", choices=["none", "default", "max-autotune"],
                   help="our recipes' torch.compile mode (default max-autotune; the peers compile as they do)")
    p.add_argument("--device", default=None, help="our recipes' device (default: the GPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="end at this many seconds, every finished row kept and the headline written")
    p.add_argument("--build-only", action="store_true", help="build every side, one at a time, then exit")
    p.add_argument("--cache-dir", default=None, help="keep torch's compile caches here, and build from them")
    p.add_argument("--out", default=None, help="the headline as JSON (default results/<device>/compare_<sides>.json)")
    p.add_argument("--rows", default=None, help="each run's row, appended as it ends (default: beside --out)")
    p.add_argument("--profile", default=None, help="before the timed runs, one untimed run of each side under "
                   "torch.profiler, its trace into this folder as <side>.trace.json.gz (Chrome's format)")
    p.add_argument("--log", default=None, help="append the sides' own output here (default: shown only on failure)")
    p.add_argument("--smoke", action="store_true", help="every side tiny on the CPU under the CUDA stand-in, with the "
                   "peers' stand-ins (tests/), its files in a temporary folder unless --out names one")
    p.add_argument("--in-process", action="store_true", help="every side in this process (the suite's CPU smoke)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.compile = None if args.compile == "none" or args.smoke else args.compile
    if args.worker:
        return args
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or len(set(args.sides)) != len(args.sides):
        p.error(f"--sides {','.join(args.sides)}: name each side once")
    try:
        args.runs, args.seed = (per_side(text, args.sides, flag) for text, flag in ((args.runs, "--runs"),
                                                                                    (args.seed, "--seed")))
    except ValueError as e:
        p.error(str(e))
    if args.budget_s is not None and args.budget_s <= 0:
        p.error(f"--budget-s {args.budget_s:g}: the budget must be positive")
    import cifar10_fast as cf
    unknown = [s for s in args.sides if s not in PEERS and s not in cf.RECIPES]
    if unknown:
        p.error(f"--sides: no side {', '.join(unknown)}; the peers are {', '.join(PEERS)}, our recipes those of "
                "cifar10_fast.py --list-recipes")
    if args.data_dir and not Path(args.data_dir).exists():
        p.error(f"--data-dir {args.data_dir}: no such file or folder")
    if not (args.data_dir or args.build_only or args.smoke):
        p.error("--data-dir: CIFAR-10 for the timed runs (only --build-only and --smoke go without)")
    return args


def per_side(text, sides, flag):
    """{side: a whole number >= 0} from "25" (every side) or "fast94=100,airbench94=25" (each side named once);
    ValueError in one line."""
    try:
        if "=" not in text:
            got = dict.fromkeys(sides, int(text))
        else:
            pairs = [item.split("=") for item in text.split(",")]
            got = {side.strip(): int(n) for side, n in pairs}
            if sorted(got) != sorted(sides) or len(pairs) != len(sides):
                raise ValueError
    except ValueError:
        raise ValueError(f"{flag} {text}: a whole number, or one for each side ({','.join(f'{s}=N' for s in sides)})"
                         ) from None
    if any(n < 0 for n in got.values()):
        raise ValueError(f"{flag} {text}: may not be negative")
    return got


def command_of(argv):
    """The command as a result records it: where its files went (--out, --rows, --log, --profile) left out."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--out", "--rows", "--log", "--profile"):
            skip = True
        elif not word.startswith(("--out=", "--rows=", "--log=", "--profile=")):
            kept.append(word)
    return shlex.join(["python", "benchmarks/compare.py", *kept])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    missing = [line for line in (peer_missing(s, args.smoke) for s in args.sides if s in PEERS) if line]
    if missing:
        print(f"error: {missing[0]}", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        if args.smoke and args.in_process:      # the sides call .cuda(): the CPU stands in for the GPU
            sys.path.insert(0, str(ROOT / "tests"))
            from cuda_standin import StandIn
            stack.enter_context(StandIn())
        return compared(args, argv, stack)


def compared(args, argv, stack):
    """The comparison (or the builds alone), its result written: the exit status (1 where a side failed)."""
    import devices
    import machine
    fp = machine.fingerprint(devices.resolve("cpu" if args.smoke else args.device), args.smoke)
    name = "_".join(["compare", *args.sides, *(["build"] if args.build_only else [])])
    results = Path(stack.enter_context(tempfile.TemporaryDirectory())) if args.smoke and not args.out else \
        ROOT / "results" / fp["slug"]
    out = Path(args.out) if args.out else results / f"{name}.json"
    rows_path = Path(args.rows) if args.rows else out.with_name(out.stem + "_rows.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_path.write_text("")
    print(f"compare on {fp['device_name']}: {', '.join(args.sides)}, one at a time; "
          + ("build only" if args.build_only else f"{'/'.join(map(str, args.runs.values()))} runs, rows into "
                                                    f"{rows_path}")
          + (f"; budget {args.budget_s:.0f} s" if args.budget_s else ""), flush=True)
    t0 = time.time()

    def result_of(rows, builds, lost, complete=False):
        """The result so far (rewritten after every row; complete once the command ends)."""
        return {"piece": "compare", "command": command_of(argv), "device_name": fp["device_name"],
                "fingerprint": fp, "smoke": args.smoke, "build_only": args.build_only, "sides": args.sides,
                "runs_wanted": args.runs, "builds": builds, "lost": lost, "runs": len(rows),
                "invalid": sum(not r["valid"] for r in rows), "headline": headline(rows, args.sides),
                "rows": rows, "wall_s": time.time() - t0, "cache_dir": args.cache_dir, "complete": complete}
    rows, builds, lost = compare(args, rows_path=rows_path, say=lambda line: print(line, flush=True),
                                 on_row=lambda *done: write_json(out, result_of(*done)))
    result = result_of(rows, builds, lost, complete=True)
    write_json(out, result)
    for timing, part in result["headline"].items():
        for pair, ci in part["ratios"].items():
            print(f"{timing} {pair}: " + (f"{ci['ratio']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else "n < 2"))
    stopped = [s for s, why in lost.items() if "budget" in why]
    print(f"wrote {out}" + (f"; the budget ended it ({', '.join(stopped)}), every finished row kept" if stopped
                            else ""), flush=True)
    return 1 if len(stopped) < len(lost) else 0


if __name__ == "__main__":
    sys.exit(main())
