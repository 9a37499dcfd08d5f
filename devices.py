"""Every decision that depends on the device, in one place: which device --device names (and, under torchrun, which
GPU a rank takes), whether two devices are the same one, where a store and its buffers live, how to wait for the
device and time it, its compute dtype, memory layout and autocast, cuDNN's autotuning and determinism, random
generators, the communication backend, and the side streams and events that overlap copies with compute.

A device type other than CUDA (mps, xpu, ...) takes the generic path through torch.<type>, and never reaches a
torch.cuda function. Streams and events exist on CUDA alone; elsewhere their helpers do nothing. On a CPU the tests
run the CUDA path under a stand-in for the GPU that answers torch.cuda's calls (tests/cuda_standin.py).
"""
import os
import platform
import re
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from core import UsageError

# ---------------------------------------------------------------------------------------------
# Which device


def accelerator(device):
    """torch's module for the device's type (torch.cuda, torch.mps, torch.xpu, ...); None for the CPU."""
    device = torch.device(device)
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def count(device_type):
    """How many devices of this type the machine has (the CPU counts as one)."""
    if device_type == "cpu":
        return 1
    module = getattr(torch, device_type, None)
    available = (getattr(module, "is_available", None)        # torch.mps has it only in recent torch versions
                 or getattr(getattr(torch.backends, device_type, None), "is_available", None))
    if available is None or not available():
        return 0
    return module.device_count() if hasattr(module, "device_count") else 1


def resolve(name=None):
    """The device --device names (by default cuda when there is a GPU, else cpu). A name that is not a device, or
    a device this machine lacks, is a UsageError of one line."""
    if not name:
        return torch.device("cuda" if count("cuda") else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device; use cpu, cuda, cuda:N, mps, ...") from None
    n = count(device.type)
    if n == 0:
        raise UsageError(f"--device {name}: this machine has no {device.type} device" +
                         ("; use --device cpu" if device.type == "cuda" else ""))
    if device.index is not None and device.index >= n:
        raise UsageError(f"--device {name}: this machine has {n} {device.type} device{'s' * (n > 1)}, "
                         f"{device.type}:0" + (f" to {device.type}:{n - 1}" if n > 1 else ""))
    return device


def for_rank(name, local_rank):
    """The device of a torchrun rank: cuda (or no --device, on a machine with GPUs) means this rank's own GPU,
    cuda:LOCAL_RANK; anything else is taken as given."""
    name = name or ("cuda" if count("cuda") else "cpu")
    return torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)


def bind(device):
    """Makes device this process's current one of its type (before a process group, so NCCL binds the rank to its
    own GPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def same(a, b):
    """Whether a and b are the same device: cuda and cuda:N are when N is the current CUDA device, cpu and cpu:0
    always (torch.device("cuda") == torch.device("cuda:0") is False)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    current = lambda d: d.index if d.index is not None else (current_index(d.type) if d.type != "cpu" else 0)
    return current(a) == current(b)


def current_index(device_type):
    module = getattr(torch, device_type, None)
    return module.current_device() if hasattr(module, "current_device") else 0


def is_cpu(device):
    return torch.device(device).type == "cpu"


def name(device):
    """The accelerator's name (torch.cuda.get_device_name and its like), or the CPU's (cpu_name)."""
    get = getattr(accelerator(device), "get_device_name", None)
    return get(device) if get else cpu_name()


def cpu_name():
    """The CPU's model as Linux names it ("AMD EPYC 7R13 Processor"); elsewhere what platform knows (its
    architecture at least)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def backend(device):
    """The torch.distributed backend for ranks on this device: nccl for CUDA GPUs, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def ddp_device_ids(device):
    """DistributedDataParallel's device_ids: the rank's GPU on CUDA, None (the module's own) elsewhere."""
    device = torch.device(device)
    return [device.index if device.index is not None else current_index("cuda")] if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------
# Waiting, memory, precision, layout


def synchronize(device):
    """Waits for the work queued on the device (there is none to wait for on the CPU)."""
    module = accelerator(device)
    if hasattr(module, "synchronize"):
        if torch.device(device).type == "cuda":
            module.synchronize(device)
        else:
            module.synchronize()        # the current device of its type (torch.mps.synchronize takes no device)


class Timer:
    """Wall-clock timer that synchronises the device before every reading: timer() returns the seconds since the
    previous call and adds them to timer.total unless include=False (work that must not count, such as evaluation)."""

    def __init__(self, synchronize=None):
        self.synchronize = synchronize or (lambda: None)
        self.synchronize()
        self.last = time.perf_counter()
        self.total = 0.0

    def __call__(self, include=True):
        self.synchronize()
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        if include:
            self.total += dt
        return dt


def timer(device):
    """The run's clock: on a CUDA GPU an EventTimer (CUDA events, as airbench and the speedrun records time, read
    after the run without waiting inside it); elsewhere a HostTimer that waits for the device at every mark."""
    if torch.device(device).type == "cuda":
        return EventTimer(device)
    return HostTimer(lambda: synchronize(device))


class HostTimer(Timer):
    """Timer with EventTimer's marks: each read at once, the host waiting for the device there (nothing to
    wait for on the CPU)."""
    reads_later = False

    def __init__(self, synchronize=None):
        super().__init__(synchronize)
        self.readings, self.marks = {}, 0

    def mark(self, include=True):
        """A key for read(): the seconds since the previous mark, taken now."""
        self.readings[self.marks] = (self(include), self.total)
        self.marks += 1
        return self.marks - 1

    def read(self):
        """{key: (seconds since the mark before, the clock's total then)} of the marks since the last read."""
        readings, self.readings = self.readings, {}
        return readings


class EventTimer:
    """The GPU's time between CUDA events recorded on the device's current stream: mark() records one and returns at
    once; read() waits for the last and reads them all, so a run waits for its clock once, at its end. Calling it
    marks and reads (Timer's reading: seconds since the previous one, added to total unless include=False)."""
    reads_later = True

    def __init__(self, device):
        self.device, self.total = device, 0.0
        self.last, self.pending, self.marks = self.record(), [], 0

    def record(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, include=True):
        """A key for read(): the device's progress now, recorded as an event, not waited for."""
        self.pending.append((self.record(), include))
        self.marks += 1
        return self.marks - 1

    def read(self):
        """{key: (seconds since the mark before, the clock's total then)} of the marks since the last read: the host
        waits for the last event alone (the device reached the others before it)."""
        if not self.pending:
            return {}
        self.pending[-1][0].synchronize()
        readings, first = {}, self.marks - len(self.pending)
        for key, (event, include) in enumerate(self.pending, first):
            dt, self.last = self.last.elapsed_time(event) / 1e3, event
            self.total += dt if include else 0.0
            readings[key] = (dt, self.total)
        self.pending = []
        return readings

    def __call__(self, include=True):
        key = self.mark(include)
        return self.read()[key][0]


def free_memory(device):
    """Free bytes on the device, or None where torch cannot tell (the CPU, mps)."""
    module = accelerator(device)
    return module.mem_get_info(device)[0] if hasattr(module, "mem_get_info") else None


USABLE = 0.9      # of a device's free memory: the rest for the caching allocator's slack and cuDNN's workspaces


SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")      # the k-th is 1024 ** k bytes


def size_text(nbytes):
    """Bytes as people read them: 1.5 GiB, 300.0 MiB, 12.0 KiB, 900 B."""
    for power in range(len(SIZE_UNITS) - 1, 0, -1):
        if nbytes >= 1024 ** power:
            return f"{nbytes / 1024 ** power:.1f} {SIZE_UNITS[power]}"
    return f"{nbytes:.0f} B"


# what an allocator's refusal says where torch gives it no class of its own: the host's, MPS's, the CUDA runtime's,
# cuBLAS's and cuDNN's, the caching allocator's inside a compiler's error
REFUSAL = re.compile(r"(?:CUDA|CUDA error:|MPS backend) out of memory|can't allocate memory|_STATUS_ALLOC_FAILED")
ASKED = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)?) (bytes|[KMGTPE]iB)")


def out_of_memory(error):
    """Whether error is an allocator's refusal: a GPU's (torch.OutOfMemoryError) or the host's."""
    return isinstance(error, torch.OutOfMemoryError) or bool(REFUSAL.search(str(error)))


def refused_size(error):
    """The allocation an allocator's refusal (out_of_memory) says it was asked for, as size_text writes it; None if it
    does not say."""
    asked = ASKED.search(str(error))
    if asked is None:
        return None
    return size_text(float(asked[1]) * 1024 ** (0 if asked[2] == "bytes" else SIZE_UNITS.index(asked[2])))


def check_training_fits(device, training, *, why, remedy, parts=None):
    """Raises UsageError (one line: `why` needs about training bytes, of which `parts` (words), what the device has,
    `remedy`) unless training bytes fit in the usable part of the device's free memory; nothing to check where torch
    cannot tell (the CPU)."""
    free = free_memory(device)
    if free is not None and training > USABLE * free:
        raise UsageError(f"{why} needs about {size_text(training)} on {device}{f' ({parts})' if parts else ''} "
                         f"but it has {size_text(free)} free; {remedy}")


def store_place(nbytes, device, where="auto", *, training=0):
    """Where a dataset of nbytes lives beside a training run that needs `training` bytes of the device: "device"
    when both fit in its usable free memory ("auto", or asked: a UsageError of one line when they do not fit), else
    "host". On the CPU the two are the same memory: "host"."""
    if is_cpu(device) or where == "host":
        return "host"
    free = free_memory(device)
    fits = free is None or nbytes + training <= USABLE * free
    if where == "device" and not fits:
        raise UsageError(f"--data-on device: the store's {size_text(nbytes)} and training's {size_text(training)} "
                         f"do not fit in the {size_text(free)} free on {device}; use --data-on host")
    return "device" if fits and (where == "device" or free is not None) else "host"


def host_buffer(shape, dtype, device):
    """An empty host tensor for copies to device: pinned (page-locked) when device is a CUDA GPU, so the copy can be
    asynchronous."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def to_device(array, device):
    """A host array (numpy) as a tensor on the device without the host waiting for the copy: staged in pinned memory
    and copied asynchronously on the current stream (CUDA; the caching host allocator reuses the staging only once
    the copy has run); the array itself elsewhere."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resize_dtype(device):
    """The dtype of the GPU decoder's batched crop-and-resize (two matrix products): float16 on CUDA, whose tensor
    cores take it and which holds pixel values 0..255 exactly and the filter's weights to 11 bits; float32 elsewhere."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def compute_dtype(device, precision="auto"):
    """The autocast dtype --precision names; auto: bf16 on a CUDA GPU, float32 on other devices (batch-norm statistics
    and the weights' float32 masters stay float32 either way, but for fp64: the whole computation in float64)."""
    if precision == "auto":
        precision = "bf16" if torch.device(device).type == "cuda" else "fp32"
    return PRECISIONS[precision]


def wide_dtype(dtype):
    """The dtype of sums, statistics and losses in a run of compute dtype `dtype`: float64 in a float64 run,
    float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def low_dtype(dtype, low):
    """low, the lower precision a technique keeps beside weights of dtype (None: theirs); float64 in a float64 run."""
    return torch.float64 if dtype == torch.float64 else low


def scalar_for(t, value):
    """value as a scalar that multiplies t: a float32 0-d tensor where t is half precision (a Python number would be
    rounded to t's dtype), else value itself."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.full((), value, dtype=torch.float32, device=t.device)
    return value


def float32_or_wider(t):
    """t upcast for sums and statistics: a half-precision tensor in float32, a float64 one as it is."""
    return t.to(wide_dtype(t.dtype))


@contextmanager
def parameters_dtype(dtype):
    """While inside, new parameters and buffers are float64 in a float64 run (built so from their first draw, not
    rounded from float32), float32 otherwise."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(wide_dtype(dtype))
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def has_float64(device):
    """Whether the device computes in float64 (Apple's MPS does not)."""
    return torch.device(device).type != "mps"


def widest_float(device):
    """float64, or float32 where the device has none: the dtype of an optimiser's 0-d rate (as torch.optim's Python
    float) and of sums over a whole validation set (float32 exact for counts below 2^24)."""
    return torch.float64 if has_float64(device) else torch.float32


def float64_device(device):
    """Where float64 work on the device's tensors runs (a small decomposition): there, or on the CPU."""
    return torch.device(device) if has_float64(device) else torch.device("cpu")


def in_float64(t):
    """t in float64 for a small decomposition, on its device where that has float64, else on the CPU."""
    return t.to(float64_device(t.device), torch.float64)


def memory_format(device):
    """channels_last on a CUDA GPU; contiguous elsewhere (the CPU's channels_last batch norm is inexact: perf-notes)."""
    return torch.channels_last if torch.device(device).type == "cuda" else torch.contiguous_format


def autocast(device, dtype):
    """Mixed precision in dtype on the device; nothing to do in float32 or float64."""
    if dtype in (torch.float32, torch.float64):
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def generator(device, seed):
    """A random generator on the device, seeded."""
    return torch.Generator(device).manual_seed(seed)


def autotune(device):
    """cuDNN times the convolution algorithms for each new shape and keeps the fastest (on a CUDA GPU, and not
    with --deterministic, whose runs must all take the same algorithms)."""
    if torch.device(device).type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        torch.backends.cudnn.benchmark = True


def compiles_helpers(device):
    """Whether the small functions run every step beside the network (Muon's Newton–Schulz) are torch.compile'd on
    this device: on CUDA, where their dozens of small kernels are bound by launches; not elsewhere, where eager keeps
    the CPU's numerics bit for bit (tests/test_loop_kept.py)."""
    return torch.device(device).type == "cuda"


def sgd_options(device):
    """torch.optim.SGD's implementation for parameters on this device: fused on CUDA (one kernel for every
    parameter instead of a loop of them); torch's default elsewhere, so that the CPU's numerics stay as recorded."""
    return {"fused": True} if torch.device(device).type == "cuda" else {}


def set_deterministic():
    """--deterministic: two runs with the same seed give the same parameters on the same machine. torch's
    deterministic kernels, no cuDNN autotuning, and cuBLAS's fixed workspace (read when CUDA initialises, so call
    this before). An operation with no deterministic version warns, naming itself, rather than stop the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


# ---------------------------------------------------------------------------------------------
# Side streams and events: copies that overlap compute (CUDA); no-ops elsewhere


def overlaps(device):
    """Whether copies to this device can run on a side stream while it computes (CUDA)."""
    return torch.device(device).type == "cuda"


def side_stream(device):
    """A stream of its own for copies to the device; None where there are no streams."""
    return torch.cuda.Stream(device) if overlaps(device) else None


def on_stream(stream):
    """Work queued inside goes to stream (nothing changes for None)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def record(stream=None, device=None):
    """An event recorded on stream (or on device's own current stream, whichever device is this process's current
    one): the point that work queued so far reaches; None where there are no streams."""
    if stream is None and (device is None or not overlaps(device)):
        return None
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream(device))
    return event


def wait(event, device):
    """The device's current stream waits for event (where there is one) before its next work."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def wait_host(event):
    """The host waits until the device has reached event (where there is one)."""
    if event is not None:
        event.synchronize()


def drain(stream):
    """The host waits until the work queued on stream has run (nothing where there are no streams)."""
    if stream is not None:
        stream.synchronize()


def keep_alive(tensor, device):
    """Tells the caching allocator that tensor, made on another stream, is used on device's current stream, so that
    its memory is not handed on before that stream's work on it has run."""
    if overlaps(device):
        tensor.record_stream(torch.cuda.current_stream(device))
