import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT.parent / "shared" / "data" / "cifar10" / "parts"

# glibc maps each block over 32 MiB (a batch's activations) afresh and unmaps it when freed, so each CPU step
# faulted its memory in again: blocks stay in the heap, in this process and in the commands the tests start
M_TRIM_THRESHOLD, M_MMAP_MAX, HEAP_KEPT = -1, -4, 2 ** 31 - 1          # malloc.h's names
os.environ.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(HEAP_KEPT))
LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
if hasattr(LIBC, "mallopt"):                    # glibc's alone
    LIBC.mallopt(M_MMAP_MAX, 0)
    LIBC.mallopt(M_TRIM_THRESHOLD, HEAP_KEPT)

# pytest-xdist's workers share the cores (pytest.ini): each takes its share of torch's threads, and so do the
# commands its tests start (OMP_NUM_THREADS), so that no two thread pools spin against each other on one core
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


def pytest_configure(config):
    """A torchvision built for another torch stops the run with one line, before a test file imports it."""
    from versions import torchvision_mismatch
    if line := torchvision_mismatch():
        pytest.exit(f"error: {line}", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config):
    """The versions a run used, in pytest's header beside its own and Python's."""
    import torchvision
    return f"torch {torch.__version__}, torchvision {torchvision.__version__}, numpy {np.__version__}"


# git's folder, and Python's and pytest's own caches: the only folders a run may add to
NOT_CHECKED = {".git", "__pycache__", ".pytest_cache"}


def checkout_paths():
    """Every file and folder under the checkout, as paths relative to it, skipping the folders NOT_CHECKED."""
    paths = set()
    for folder, folders, files in os.walk(ROOT):
        folders[:] = [name for name in folders if name not in NOT_CHECKED]
        paths.update(os.path.relpath(os.path.join(folder, name), ROOT) for name in folders + files)
    return paths


def pytest_sessionstart(session):
    session.config.checkout_before = checkout_paths()


def pytest_sessionfinish(session):
    """A run that leaves a new file in the checkout fails, naming it: checked once, in pytest's first process, after
    every worker has ended, where a test's own check could meet another worker's file half-way."""
    if hasattr(session.config, "workerinput"):
        return
    added = sorted(checkout_paths() - session.config.checkout_before)
    if added:
        line = f"error: the tests left {', '.join(added)} in {ROOT}: a test writes into the checkout"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(f"\n{line}", red=True) if reporter else print(line, file=sys.stderr)   # after the dots
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def unmeasured_environment():
    """os.environ without coverage.py's switch for measuring a subprocess (benchmarks/coverage_map.py): a process whose
    files may not grow (RLIMIT_FSIZE) cannot write coverage's data, and would end in its traceback."""
    return {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_CONFIG"}


# Loopback ports for the tests' rendezvous: each pytest-xdist worker takes them from a block of its own below Linux's
# ephemeral range (32768-60999 by default), where bind(0) and every outgoing connection (gloo's, torchrun's) take
# theirs, so that no other process is handed one between a test choosing it and its rank 0 listening on it
PORT_BLOCK = 200
FIRST_PORT = 20000
ports_taken = set()


def port_block(worker=None):
    """This pytest-xdist worker's ports (gw0's block also serves a run without workers)."""
    worker = worker or os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    start = FIRST_PORT + PORT_BLOCK * int(worker.removeprefix("gw"))
    return range(start, start + PORT_BLOCK)


def free_ports(n=1, *, worker=None):
    """n loopback ports that nothing holds, from this worker's block, none handed out twice in one session."""
    found = []
    for port in port_block(worker):
        if len(found) == n:
            break
        if port in ports_taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue              # held by someone, or in TIME_WAIT from a finished test
        ports_taken.add(port)
        found.append(port)
    if len(found) < n:
        raise RuntimeError(f"no {n} free ports left in {port_block(worker)}")
    return found


def free_port():
    """One port, as free_ports."""
    return free_ports(1)[0]


@pytest.fixture
def one_thread():
    """Tiny networks gain nothing from a second thread, and one thread keeps their timing steady on a shared
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def compile_settings():
    """torch.compile's settings (dynamo's and Inductor's), a copy. Their modules serve settings through __getattr__,
    which pytest's monkeypatch cannot restore (since pytest 9.2 its undo deletes them): change them with
    torch._dynamo.config.patch(...) or torch._inductor.config.patch(...), which restore them."""
    import torch._dynamo.config
    import torch._inductor.config
    return {m.__name__: m.get_config_copy() for m in (torch._dynamo.config, torch._inductor.config)}


def changed_settings(before, after):
    """The names of the settings that differ between two compile_settings() copies (a missing one counts)."""
    return sorted(f"{module}.{name}" for module in before for name in set(before[module]) | set(after[module])
                  if before[module].get(name, KeyError) != after[module].get(name, KeyError))


@pytest.fixture(autouse=True)
def compile_settings_kept():
    """Every test leaves torch.compile's settings as it found them: one that does not fails, naming them."""
    before = compile_settings()
    yield
    changed = changed_settings(before, compile_settings())
    assert not changed, f"the test left torch.compile's settings changed: {', '.join(changed)}"


def ctrl_c_heard():
    """For subprocess's preexec_fn: Ctrl-C (SIGINT) back to its default in the child, where a shell's background job
    (pytest started with `&`) would pass on SIG_IGN, and Python would then never raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def unforeseen_failure():
    raise RuntimeError("a fault of this process's own")


def host_refusal():
    """Raises the host allocator's real refusal: 4 EiB is past any machine's address space."""
    torch.empty(2 ** 62, dtype=torch.uint8)


def failing_on_call(function, n, fail=unforeseen_failure):
    """function, except that its n-th call runs fail() instead, which raises (a failure after the runs before it)."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            fail()
        return function(*args, **kwargs)
    return wrapper


@pytest.fixture(scope="session")
def cifar10_npz(tmp_path_factory):
    """Path of the real CIFAR-10 as one .npz: $CIFAR10_NPZ if set, else decoded from ../shared once per session."""
    env = os.environ.get("CIFAR10_NPZ")
    if env:
        if not Path(env).is_file():
            pytest.skip(f"CIFAR10_NPZ={env} does not exist")
        return Path(env)
    decoder = PARTS / "decode_cifar10_parts.py"
    if not decoder.is_file():
        pytest.skip(f"real CIFAR-10 not available: neither $CIFAR10_NPZ nor {PARTS} exists")
    out = tmp_path_factory.mktemp("cifar10") / "cifar10.npz"
    subprocess.run([sys.executable, str(decoder), str(PARTS), str(out)], check=True, capture_output=True)
    return out


def train_once(r, data, *, device="cpu", net=None, seed=0, **options):
    """One CIFAR-10 run of recipe r on device-resident data (cifar_data.dataset_on_device) through
    cifar10_fast.train_run, on the cifar10_fast.Network net (a plain one built here by default); options as
    cifar10_fast.Options takes them (target, eval_every, progress, ...)."""
    import cifar10_fast as cf
    import distributed as D
    net = net or cf.build_network(r, torch.device(device), num_classes=data.get("num_classes", 10))
    built = cf.Built(data=data, network=net)
    return cf.train_run(r, built, cf.Options(**options), ctx=D.Context(device=str(device)), seed=seed)


def synthetic_arrays(n_train=256, n_test=128, seed=0):
    """Random CIFAR-shaped data whose class is written into the image (learnable, tiny)."""
    rng = np.random.default_rng(seed)
    def split(n):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8) // 4
        x[np.arange(n), :, :, 0] += (y * 19)[:, None, None].astype(np.uint8)
        return x, y
    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return {"train_images": xtr, "train_labels": ytr, "test_images": xte, "test_labels": yte}


def fake_cuda_events(monkeypatch, times_ms):
    """torch.cuda.Event replaced by events whose k-th recorded one stands at times_ms[k] on the GPU; returns the list
    of events made, each with `waited` (whether the host synchronised on it)."""
    made = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.waited = None, False
            made.append(self)

        def record(self, stream=None):
            self.at = times_ms[len(made) - 1]

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, other):
            return other.at - self.at
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return made


def synthetic_npz(tmp_path_factory, n_train, n_test):
    """A .npz of synthetic_arrays in a fresh temporary folder: the CIFAR-10 scripts' --data-dir."""
    p = tmp_path_factory.mktemp("synth") / "synth.npz"
    np.savez(p, **synthetic_arrays(n_train=n_train, n_test=n_test))
    return p


def small_jpeg_store(tmp_path_factory):
    """A JPEG store of 4 classes (12 training and 4 validation images each, 20 to 40 px) in a fresh folder."""
    import imagenet_store as ims
    from imagefolders import synthetic_imagefolder
    root = tmp_path_factory.mktemp("in")
    synthetic_imagefolder(root / "src", 4, 12, 4, sizes=(20, 40))
    ims.prepare(root / "src", root / "jpeg", ims.StoreSettings(format="jpeg"), workers=1, log=lambda s: None)
    return root / "jpeg"


def pattern_arrays(n_train, n_test, classes=10, size=(32, 32), seed=0):
    """Synthetic images of any number of classes and any size: each class a random 4x4 pattern of colours scaled
    up to the image size, plus noise (learnable whatever the crop, flip or cutout)."""
    rng = np.random.default_rng(seed)
    h, w = size
    patterns = rng.integers(0, 256, (classes, 4, 4, 3)).repeat(-(-h // 4), 1).repeat(-(-w // 4), 2)[:, :h, :w]

    def split(n):
        y = rng.integers(0, classes, n)
        return (patterns[y] * 0.6 + rng.integers(0, 100, (n, h, w, 3))).astype(np.uint8), y
    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return {"train_images": xtr, "train_labels": ytr, "test_images": xte, "test_labels": yte}


def main_output(main, args, capsys):
    """(exit status, stdout, stderr lines) of a script's main(args) in this process, the CPU's warning left out."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.strip().splitlines() if not line.startswith("warning: no GPU")]
