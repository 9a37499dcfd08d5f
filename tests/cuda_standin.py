"""A CPU stand-in for CUDA GPUs: every tensor computes in CPU memory, but the ones the program put on the GPU say
they are on `cuda:N`, and every operation is checked as CUDA checks it. Whole commands run under it as they run
on a GPU: `devices.py` sees GPUs, its streams, events, pinned buffers and clocks, and nvJPEG, are stood in (nvJPEG by
the CPU's decode, which imagenet_decoders.nvjpeg_hardware is told is its software path), autocast runs in the same
dtype, `torch.compile` compiles, torch.profiler records the CPU's activity alone, nested tensors stay on their GPU,
and torchrun's ranks join over gloo.

What it checks, as CUDA does: no operation mixes a tensor on the GPU with one in host memory (but for a 0-dim
host tensor, a scalar), host indices into a GPU tensor are fine and GPU indices into a host tensor are not,
`out=` and a random generator on the operation's device, no numpy view of GPU memory, pinning only host memory,
`record_stream` only of GPU tensors on a stream of their device. What it counts: operations on the GPU (by name, and by
name with their tensors' dtypes and shapes: the kernels a process launches for the first time), copies to and
from it (and which of them block the host: pageable memory, host data made into a GPU tensor by torch.tensor and
its like, reading a value), host waits (and the operators known to wait inside, WAITING_INSIDE), and on request
the most memory its tensors held.

What it cannot see: kernel speed; a host wait inside a C++ operator not in WAITING_INSIDE; a C++ operator that
groups tensors by their real device (the fused optimisers': a GradScaler's scale is moved "to the CPU" there, a
blocking copy here that a GPU does not make); races between streams (each stream's work runs at once, in order:
the tests of stream order read the calls it records); memory limits beyond the free memory it is told to report;
device mixes inside a compiled graph (dynamo traces the CPU tensors; the same code runs eagerly under it
elsewhere); which calls CUDA-graph trees record (it counts each compiled call, not the tree's paths); CUDA's random
numbers (a GPU generator here draws the CPU's).

    with StandIn(gpus=2) as gpu:     # or: python tests/standin_main.py cifar10_fast.py --recipe ...
        cifar10_fast.main([...])
    gpu.counts["blocking"]
"""
import contextlib
import threading
import weakref
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

TB = torch._C.TensorBase
GETTERS = {TB.device: "device", TB.is_cuda: "is_cuda", TB.grad: "grad", TB.data: "data"}
# calls that read only metadata (no kernel), or move data on purpose: never a device mix
METADATA = {"_has_compatible_shallow_copy_type", "is_same_size", "__repr__", "data_ptr", "size", "dim",
            "stride", "numel", "storage_offset", "untyped_storage", "_typed_storage", "is_contiguous", "__len__",
            "requires_grad_", "retain_grad", "register_hook", "is_floating_point", "is_complex", "element_size",
            "_is_view", "get_device", "__hash__", "__eq__"}
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "randperm", "tensor", "as_tensor",
             "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "zeros_like", "ones_like", "empty_like",
             "full_like", "rand_like", "randn_like", "randint_like", "normal", "new_empty", "new_zeros", "new_ones",
             "new_full", "new_tensor", "tril_indices", "triu_indices"}
COPIES = {"tensor", "as_tensor", "new_tensor"}      # factories that copy host data: onto a GPU, from pageable memory
RANDOM = {"rand", "randn", "randint", "randperm", "normal", "uniform_", "normal_", "bernoulli", "bernoulli_",
          "multinomial", "random_", "exponential_", "rand_like", "randn_like", "randint_like", "dropout"}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}
SCALAR_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__"}
# operators that make the host wait inside their C++ on a GPU (their output's size, or their metadata copied from
# pageable memory): a host wait each, though no copy or read is seen from Python
WAITING_INSIDE = {"to_padded_tensor", "nonzero", "masked_select", "unique", "unique_consecutive"}


class Generator(torch._C.Generator):
    """torch.Generator for a (stand-in) GPU: the CPU's generator, knowing its device."""

    def __new__(cls, device="cpu"):
        self = super().__new__(cls, "cpu")
        self.standin_device = torch.device(device)
        return self

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self):
        """Its device, as a CUDA generator's (its draws are the CPU's)."""
        return self.standin_device


class Stream(torch.Stream):
    """torch.cuda.Stream: records what is asked of it (waits, events), in order (a torch.Stream, so that torch's own
    functions take it)."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device=torch.device("cpu"))

    def __init__(self, gpu, device=None, priority=0, *, default=False):
        self.gpu, self.index, self.default = gpu, gpu.index(device), default
        self.id = len(gpu.streams)
        gpu.streams.append(self)

    def wait_event(self, event):
        self.gpu.log("wait_event", self, event)

    def wait_stream(self, stream):
        self.gpu.log("wait_stream", self, stream)

    def record_event(self, event=None):
        event = event or Event(self.gpu)
        event.record(self)
        return event

    def synchronize(self):
        self.gpu.host_wait(self)

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, Stream) and other.id == self.id

    def __hash__(self):
        return self.id

    def __repr__(self):
        return f"<stand-in stream {self.id} on cuda:{self.index}{' (default)' if self.default else ''}>"


class Event:
    """torch.cuda.Event: its clock reads the host's, so timing events measure the CPU's work."""

    def __init__(self, gpu, enable_timing=False, blocking=False, interprocess=False):
        import time
        self.gpu, self.time, self.stream, self.clock = gpu, None, None, time.perf_counter

    def record(self, stream=None):
        self.stream = stream or self.gpu.current_stream()
        self.time = self.clock()
        self.gpu.log("record", self.stream, self)

    def synchronize(self):
        self.gpu.host_wait("event.synchronize")

    def wait(self, stream=None):
        (stream or self.gpu.current_stream()).wait_event(self)

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.time - self.time) * 1e3


ACTIVE = []          # the stand-ins entered, innermost last


class StandIn(TorchFunctionMode):
    """The stand-in for `gpus` CUDA devices, each reporting `memory` bytes in all and whatever the tensors on it
    leave of that free, and `sms` multiprocessors; with `peaks`, keeping the most bytes its tensors held after any
    operation (`peak`, slow). A context manager: inside it, torch.cuda answers as a machine with these GPUs would."""

    def __init__(self, gpus=1, *, memory=80 << 30, name="NVIDIA stand-in (CPU)", float64=True, sms=132, peaks=False):
        super().__init__()
        self.gpus, self.memory, self.name, self.float64, self.sms = gpus, memory, name, float64, sms
        self.peaks, self.peak = peaks, 0            # with peaks: the most bytes on the GPUs after any operation
        self.on = WeakTensorKeyDictionary()         # tensor -> the index of the GPU it is on
        self.pinned = {}                            # data_ptr of pinned host memory -> a weak reference to its owner
        self.counts = Counter()
        self.ops = Counter()                        # operations on a GPU, by name
        self.kernels = Counter()                    # ... by name and their tensors' dtypes and shapes (launched())
        self.calls = []                             # (what, *details): streams, events, waits, decodes, in order
        self.threads = []                           # the name of the thread that made each call
        self.streams = []
        self.local = threading.local()
        self.recording = False
        self._patches = contextlib.ExitStack()

    # ---- bookkeeping

    def index(self, device=None):
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return device.index if device.index is not None else self.current_device()

    def current_device(self):
        return getattr(self.local, "device", 0)

    def current_stream(self, device=None):
        i = self.index(device)
        current = getattr(self.local, "stream", {})
        if i not in current:
            current[i] = self.default_stream(i)
            self.local.stream = current
        return current[i]

    def default_stream(self, device=None):
        i = self.index(device)
        found = [s for s in self.streams if s.default and s.index == i]
        return found[0] if found else Stream(self, i, default=True)

    def log(self, what, *details):
        self.calls.append((what, *details))
        self.threads.append(threading.current_thread().name)

    def host_wait(self, why):
        self.counts["host_waits"] += 1
        self.log("host_wait", why)

    def where(self, t):
        i = self.on.get(t) if isinstance(t, torch.Tensor) else None
        return torch.device("cpu") if i is None else torch.device("cuda", i)

    def tag(self, out, device):
        """Marks every tensor in out as on `device` (a cuda index, or None for the host); a device with no float64
        (float64=False, as Apple's MPS) refuses a float64 tensor, as MPS does."""
        if device is None:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if t.dtype == torch.float64 and not self.float64:
                    raise TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't "
                                    "support float64. Please use float32 instead.")
                self.on[t] = device
        return out

    def untag(self, t):
        self.on.pop(t, None)

    def is_pinned(self, t):
        owner = self.pinned.get(t.untyped_storage().data_ptr())
        return owner is not None and owner() is not None

    def pin(self, t):
        self.pinned[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    def pinned_bytes(self):
        """Bytes of pinned host memory alive now."""
        return sum(owner().untyped_storage().nbytes() for owner in self.pinned.values() if owner() is not None)

    def allocated(self, device):
        storages = {}
        for t, i in list(self.on.items()):
            if i == device:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    # ---- the checks

    def device_of(self, name, args, kwargs):
        """The device an operation runs on and whether it mixes devices as CUDA forbids (raises as CUDA does)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        gpu = {self.on[t] for t in tensors if t in self.on}
        if len(gpu) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:{min(gpu)} and cuda:{max(gpu)}!")
        if not gpu:
            return None
        device = gpu.pop()
        if name in INDEXING:
            self_, index = args[0], args[1] if len(args) > 1 else None
            if self_ not in self.on:
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
            values = args[2] if len(args) > 2 else None
            if isinstance(values, torch.Tensor) and values.dim() and values not in self.on:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:{device} and cpu!")
            for t in tree_flatten(index)[0]:        # host indices are copied to the GPU first, from pageable memory
                if isinstance(t, torch.Tensor) and t not in self.on:
                    self.counts["to_gpu"] += 1
                    self.counts["blocking"] += 1
            return device
        host = [t for t in tensors if t not in self.on and t.dim() > 0]
        if host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:{device} and cpu! ({name})")
        return device

    def check_generator(self, name, kwargs, device):
        gen = kwargs.get("generator")
        if gen is None:
            return
        theirs = getattr(gen, "standin_device", torch.device("cpu"))
        ours = "cuda" if device is not None else "cpu"
        if theirs.type != ours:
            raise RuntimeError(f"Expected a '{ours}' device type for generator but found '{theirs.type}'")

    # ---- the mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        getter = GETTERS.get(getattr(func, "__self__", None))
        if getter:
            return self.attribute(getter, func, args)
        name = getattr(func, "__name__", "")
        if name in METADATA:
            return func(*args, **kwargs)
        if name in ("to", "cuda", "cpu"):
            return self.move(name, func, args, kwargs)
        if name == "copy_":
            return self.copy(func, args, kwargs)
        if name in ("pin_memory", "is_pinned", "record_stream", "numpy", "__array__"):
            return self.host_memory(name, func, args, kwargs)
        requested = kwargs.get("device")
        if requested is not None and name in FACTORIES:
            requested = torch.device(requested)
            if requested.type == "cuda":
                kwargs["device"] = "cpu"
                index = self.index(requested)
                self.check_generator(name, kwargs, index)
                if name in COPIES:
                    self.counts["to_gpu"] += 1
                    self.counts["blocking"] += 1          # the host's data is copied as it waits
                    return self.tag(func(*args, **kwargs), index)
                return self.launched(name, self.tag(func(*args, **kwargs), index))
        pin = kwargs.pop("pin_memory", False) if name in FACTORIES else False
        out = kwargs.get("out")
        device = self.device_of(name, args, {k: v for k, v in kwargs.items() if k != "out"})
        if device is None and out is not None and name in FACTORIES:       # torch.randperm(n, out=t): t's device
            device = self.device_of(name, (), {"out": out})
        if name in RANDOM or "generator" in kwargs:
            self.check_generator(name, kwargs, device)
        if out is not None and {self.on.get(t) for t in tree_flatten(out)[0]
                                if isinstance(t, torch.Tensor)} != {device}:
            raise RuntimeError(f"Expected out tensor to have device {'cpu' if device is None else f'cuda:{device}'}, "
                               f"but got another instead ({name})")
        if device is not None and name in WAITING_INSIDE:
            self.host_wait(name)
        if device is not None and name in SCALAR_READS:
            self.counts["blocking"] += 1                  # the host waits for the value
            self.counts["to_host"] += 1
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if pin:
            self.pin(result)
        if device is not None:
            self.tag(result, device)
            self.launched(name, (args, kwargs))
        return result

    def launched(self, name, tensors):
        """Counts an operation on a GPU, by name, and by name with the dtypes and shapes of `tensors` (its inputs; a
        factory's output), which it returns: a key the process has not met is a kernel it launches for the first
        time (loaded, or autotuned, then)."""
        self.counts["gpu_ops"] += 1
        self.ops[name] += 1
        # a nested tensor (torchvision's batched decode) has no one shape: its components' count stands for it
        shapes = tuple((t.dtype, tuple(t.shape) if not t.is_nested else ('nested', t.size(0)))
                       for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor))
        self.kernels[(name, *shapes)] += 1
        if self.peaks:
            self.peak = max(self.peak, sum(self.allocated(i) for i in range(self.gpus)))
        return tensors

    def attribute(self, getter, func, args):
        t = args[0]
        if getter == "device":
            return self.where(t)
        if getter == "is_cuda":
            return t in self.on
        if getter == "grad":
            grad = func(*args)
            return self.tag(grad, self.on.get(t)) if grad is not None else None
        if func.__name__ == "__set__":              # t.data = value moves t to value's device (t's own, for t itself)
            device = self.on.get(args[1])
            func(*args)
            self.untag(t)
            self.tag(t, device)
            return None
        return self.tag(func(*args), self.on.get(t))

    def move(self, name, func, args, kwargs):
        t = args[0]
        if name == "cuda":
            target, non_blocking, rest = torch.device("cuda", self.index(args[1] if len(args) > 1 else
                                                                       kwargs.get("device"))), \
                kwargs.get("non_blocking", False), {}
        elif name == "cpu":
            target, non_blocking, rest = torch.device("cpu"), False, {}
        else:
            other = next((a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            copy = kwargs.pop("copy", False)
            if len(args) > 3 and isinstance(args[-1], bool) and isinstance(args[-2], bool):   # .to(d, nb, copy)
                args, copy = args[:-1], args[-1]
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if other is not None:
                device = self.where(other)
            target = self.where(t) if device is None else torch.device(device)
            rest = {"dtype": dtype, "memory_format": memory_format or torch.preserve_format, "copy": copy}
            rest = {k: v for k, v in rest.items() if v is not None}
        source = self.where(t)
        if target.type == "cuda":
            target = torch.device("cuda", self.index(target))
        if target == source:
            out = t.to(**rest) if rest else t
            return self.tag(out, self.on.get(t)) if out is not t else t
        out = t.to("cpu" if target.type == "cuda" else target, **{**rest, "copy": True})
        if target.type == "cuda":
            self.counts["to_gpu"] += 1
            if not (non_blocking and self.is_pinned(t)):
                self.counts["blocking"] += 1              # pageable memory: the copy waits for the host
            return self.tag(out, target.index)
        self.counts["to_host"] += 1
        self.counts["blocking"] += 1                      # into new pageable memory: the host waits
        return out

    def copy(self, func, args, kwargs):
        dst, src = args[0], args[1]
        a, b = self.where(dst), self.where(src)
        if a.type == "cuda" and b.type == "cuda" and a != b:
            self.counts["gpu_to_gpu"] += 1
        elif a.type == "cuda" and b.type == "cpu" and src.dim():
            self.counts["to_gpu"] += 1
            if not (kwargs.get("non_blocking", args[2] if len(args) > 2 else False) and self.is_pinned(src)):
                self.counts["blocking"] += 1
        elif a.type == "cpu" and b.type == "cuda":
            self.counts["to_host"] += 1
            if not (kwargs.get("non_blocking", args[2] if len(args) > 2 else False) and self.is_pinned(dst)):
                self.counts["blocking"] += 1
        elif a.type == "cuda":
            self.counts["gpu_ops"] += 1
        return func(*args, **kwargs)

    def host_memory(self, name, func, args, kwargs):
        t = args[0]
        if name == "is_pinned":
            return t not in self.on and self.is_pinned(t)
        if t in self.on:
            if name == "pin_memory":
                raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
            if name in ("numpy", "__array__"):
                raise TypeError(f"can't convert cuda:{self.on[t]} device type tensor to numpy. Use Tensor.cpu() to "
                                "copy the tensor to host memory first.")
            stream = args[1]
            if not isinstance(stream, Stream) or stream.index != self.on[t]:
                raise RuntimeError("record_stream: the stream must be a CUDA stream of the tensor's device")
            self.log("record_stream", stream, t)
            return None
        if name == "pin_memory":
            return self.pin(t.clone())
        if name == "record_stream":
            raise RuntimeError("record_stream: expected a CUDA tensor, got a host tensor")
        return func(*args, **kwargs)

    # ---- torch.cuda, torch.Generator, autocast, compile and process groups, while inside

    def __enter__(self):
        patch = lambda obj, name, value: self._patches.enter_context(_patched(obj, name, value))
        cuda = torch.cuda
        self.real_cuda = {name: getattr(cuda, name) for name in ("is_available", "device_count")}
        patch(cuda, "is_available", lambda: True)
        patch(cuda, "device_count", lambda: self.gpus)
        patch(cuda, "current_device", self.current_device)
        patch(cuda, "set_device", lambda d: setattr(self.local, "device", self.index(d)))
        patch(cuda, "get_device_name", lambda d=None: self.name)
        patch(cuda, "get_device_properties", lambda d=None: SimpleNamespace(
            name=self.name, total_memory=self.memory, multi_processor_count=self.sms))
        patch(cuda, "mem_get_info", lambda d=None: (self.memory - self.allocated(self.index(d)), self.memory))
        patch(cuda, "synchronize", lambda d=None: self.host_wait("torch.cuda.synchronize"))
        patch(cuda, "Stream", lambda device=None, priority=0, **k: Stream(self, device, priority))
        patch(cuda, "Event", lambda **k: Event(self, **k))
        patch(cuda, "current_stream", self.current_stream)
        patch(cuda, "default_stream", self.default_stream)
        patch(cuda, "stream", self.stream_context)
        patch(torch, "Generator", Generator)
        real_autocast = torch.autocast
        patch(torch, "autocast", lambda device_type, *a, **k: real_autocast(
            "cpu" if device_type == "cuda" else device_type, *a, **k))
        real_compile = torch.compile
        patch(torch, "compile", lambda model=None, **k: self.compiled(real_compile, model, **k))
        real_init = torch.distributed.init_process_group
        patch(torch.distributed, "init_process_group", lambda backend=None, *a, **k: real_init(
            "gloo" if backend == "nccl" else backend, *a, **k))
        import torchvision.io
        real_decode = torchvision.io.decode_jpeg
        patch(torchvision.io, "decode_jpeg", lambda input, *a, device="cpu", **k: self.nvjpeg(
            real_decode, input, *a, device=device, **k))
        import imagenet_decoders
        patch(imagenet_decoders, "nvjpeg_hardware", lambda device: False)   # the CPU's decode stands in: software
        # torch.profiler's CUDA activity would record CUDA events on a machine without a GPU
        real_profile, cuda = torch.profiler.profile, torch.profiler.ProfilerActivity.CUDA
        patch(torch.profiler, "profile", lambda *a, activities=None, **k: real_profile(
            *a, activities=[x for x in activities or [torch.profiler.ProfilerActivity.CPU] if x != cuda], **k))
        real_nested = torch.nested.nested_tensor        # a C function the mode does not see: tagged here
        patch(torch.nested, "nested_tensor", lambda tensors, *a, **k: self.tag(
            real_nested(tensors, *a, **k), self.device_of("nested_tensor", (tensors,), {})))
        real_param = nn.Parameter.__new__
        patch(nn.Parameter, "__new__", lambda cls, data=None, requires_grad=True: self.tag(
            real_param(cls, data, requires_grad), self.on.get(data) if data is not None else None))
        ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            ACTIVE.remove(self)
            self._patches.close()

    def nvjpeg(self, decode, images, *args, device="cpu", **kwargs):
        """torchvision.io.decode_jpeg: on a (stand-in) GPU, the CPU's decode of the same host bytes, on the GPU; the
        call is recorded with the stream it was made on, and the host waits for it, as torchvision's batched GPU
        decode waits."""
        if torch.device(device).type != "cuda":
            return decode(images, *args, device=device, **kwargs)
        index = self.index(device)
        if any(t in self.on for t in (images if isinstance(images, list) else [images])):
            raise RuntimeError("decode_jpeg: the encoded images must be in host memory")
        self.log("nvjpeg", self.current_stream(index))
        self.host_wait("nvjpeg")
        return self.tag(decode(images, *args, **kwargs), index)

    @contextlib.contextmanager
    def stream_context(self, stream):
        if stream is None:
            yield
            return
        current = getattr(self.local, "stream", {})
        before = current.get(stream.index)
        current[stream.index] = stream
        self.local.stream = current
        self.log("enter_stream", stream)
        try:
            yield
        finally:
            self.log("exit_stream", stream)
            if before is None:
                current.pop(stream.index, None)
            else:
                current[stream.index] = before

    def compiled(self, real_compile, model, **options):
        """torch.compile of model, called with this mode suspended (dynamo traces the CPU tensors, so its guards and
        graphs are the CPU's); its outputs are on the GPU its inputs were on. CUDA graphs (reduce-overhead,
        max-autotune) are stood in: a call's outputs are overwritten by the next call's, as a graph's replay
        overwrites its static outputs."""
        if model is None:
            return lambda m: self.compiled(real_compile, m, **options)
        graphs = options.get("mode") in ("reduce-overhead", "max-autotune")
        compiled = real_compile(model, **options)
        target = compiled.forward if isinstance(compiled, nn.Module) else compiled
        static = {}

        def call(*args, **kwargs):
            gpu = ACTIVE[-1] if ACTIVE else None    # a compiled function outlives the stand-in that saw it made
            if gpu is None:
                return target(*args, **kwargs)
            device = gpu.device_of("compiled", args, kwargs)
            with _pop_mode_temporarily(), contextlib.ExitStack() as cpu:    # inductor sees the CPU it compiles for
                for name, real in gpu.real_cuda.items():
                    cpu.enter_context(_patched(torch.cuda, name, real))
                out = target(*args, **kwargs)
            if graphs:
                out = tree_map(lambda t: replayed(static, t) if isinstance(t, torch.Tensor) else t, out)
            gpu.launched(f"compiled {getattr(model, '__qualname__', type(model).__name__)}", (args, kwargs))
            return gpu.tag(out, device)
        if isinstance(compiled, nn.Module):
            compiled.forward = call
            return compiled
        return call


def replayed(static, t):
    """The CUDA graph's static output of t's shape and dtype, holding t's values until the next replay."""
    key = (tuple(t.shape), t.dtype, t.requires_grad)
    if t.requires_grad:          # training outputs feed backward: a replay overwrites them only after it
        return t
    if key not in static:
        static[key] = torch.empty_like(t)
    static[key].copy_(t)
    return static[key]


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
