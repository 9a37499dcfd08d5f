"""devices.py, the one module that decides by device: over device strings (cpu, cuda, cuda:0, cuda:1, mps) on
machines with no GPU, one or two (torch.cuda's answers replaced), and a device type of its own (a fake torch.xpu)
that never reaches torch.cuda."""
import types
from contextlib import nullcontext

import pytest
import torch

import cli
import core
import devices
import imagenet_decoders as idec
from conftest import fake_cuda_events


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, current=0): this process sees n CUDA devices, the current one `current`."""
    def machine(n, current=0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    return machine


@pytest.mark.parametrize("n, name, expected", [
    (0, None, "cpu"), (0, "cpu", "cpu"), (1, None, "cuda"), (1, "cuda", "cuda"), (1, "cuda:0", "cuda:0"),
    (2, "cuda:1", "cuda:1"), (2, "cpu", "cpu")])
def test_resolve_names_the_device(gpus, n, name, expected):
    gpus(n)
    assert devices.resolve(name) == torch.device(expected)


@pytest.mark.parametrize("n, name, message", [
    (0, "cuda", "--device cuda: this machine has no cuda device; use --device cpu"),
    (0, "cuda:0", "--device cuda:0: this machine has no cuda device; use --device cpu"),
    (1, "cuda:1", "--device cuda:1: this machine has 1 cuda device, cuda:0"),
    (2, "cuda:2", "--device cuda:2: this machine has 2 cuda devices, cuda:0 to cuda:1"),
    (1, "mps", "--device mps: this machine has no mps device"),
    (1, "gpu", "--device gpu: not a device; use cpu, cuda, cuda:N, mps, ...")])
def test_resolve_refuses_a_device_the_machine_lacks_in_one_line(gpus, n, name, message):
    gpus(n)
    with pytest.raises(core.UsageError) as e:
        devices.resolve(name)
    assert str(e.value) == message


@pytest.mark.parametrize("name, local_rank, n, expected", [
    ("cuda", 3, 4, "cuda:3"), (None, 3, 4, "cuda:3"), (None, 3, 0, "cpu"), ("cuda:0", 3, 4, "cuda:0"),
    ("cpu", 1, 4, "cpu")])
def test_a_torchrun_rank_takes_its_own_gpu(gpus, name, local_rank, n, expected):
    gpus(n)
    assert devices.for_rank(name, local_rank) == torch.device(expected)


@pytest.mark.parametrize("a, b, current, same", [
    ("cuda", "cuda:0", 0, True), ("cuda:0", "cuda", 0, True), ("cuda", "cuda:1", 0, False),
    ("cuda", "cuda:1", 1, True), ("cuda:1", "cuda:1", 0, True), ("cuda:0", "cuda:1", 0, False),
    ("cpu", "cpu", 0, True), ("cpu", "cuda", 0, False), ("cuda", "mps", 0, False)])
def test_same_device_whatever_the_spelling(gpus, a, b, current, same):
    gpus(2, current)
    assert devices.same(a, b) is same and devices.same(torch.device(a), torch.device(b)) is same
    assert (torch.device("cuda") == torch.device("cuda:0")) is False        # why devices.same exists


@pytest.mark.parametrize("name, dtype, layout, backend, ids, overlaps", [
    ("cuda", torch.bfloat16, torch.channels_last, "nccl", [1], True),
    ("cuda:0", torch.bfloat16, torch.channels_last, "nccl", [0], True),
    ("cuda:1", torch.bfloat16, torch.channels_last, "nccl", [1], True),
    ("cpu", torch.float32, torch.contiguous_format, "gloo", None, False),
    ("mps", torch.float32, torch.contiguous_format, "gloo", None, False)])
def test_what_each_device_computes_in(gpus, name, dtype, layout, backend, ids, overlaps):
    gpus(2, current=1)
    assert devices.compute_dtype(name) == dtype and devices.memory_format(name) == layout
    assert devices.compute_dtype(name, "fp16") == torch.float16 and devices.compute_dtype(name, "fp32") == torch.float32
    assert devices.backend(name) == backend and devices.ddp_device_ids(name) == ids
    assert devices.overlaps(name) is overlaps
    assert isinstance(devices.autocast(name, torch.float32), nullcontext)
    assert devices.compute_dtype(name, "fp64") == torch.float64 and isinstance(devices.autocast(name, torch.float64),
                                                                             nullcontext)


@pytest.mark.parametrize("dtype, wide", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                         (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_sums_and_statistics_are_float32_but_in_a_float64_run(dtype, wide):
    assert devices.wide_dtype(dtype) == wide and devices.float32_or_wider(torch.ones(2, dtype=dtype)).dtype == wide
    before = torch.get_default_dtype()
    with devices.parameters_dtype(dtype):
        assert torch.nn.Linear(2, 2).weight.dtype == wide
    assert torch.get_default_dtype() == before


def test_a_small_decomposition_runs_in_float64_on_the_device_unless_it_has_none():
    """Apple's MPS has no float64: the whitening's covariance goes to the CPU."""
    assert [devices.float64_device(name) for name in ("cpu", "cuda:1", "mps")] == [torch.device(d) for d in (
        "cpu", "cuda:1", "cpu")]
    wide = devices.in_float64(torch.full((2, 2), 1 / 3, dtype=torch.bfloat16))
    assert wide.dtype == torch.float64 and wide.device.type == "cpu"
    assert torch.equal(wide, torch.full((2, 2), 1 / 3, dtype=torch.bfloat16).double())


@pytest.mark.parametrize("dtype, low, kept", [
    (torch.float32, torch.float16, torch.float16), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, None, None), (torch.float64, torch.bfloat16, torch.float64), (torch.float64, None, torch.float64)])
def test_a_lower_precision_is_kept_but_in_a_float64_run(dtype, low, kept):
    assert devices.low_dtype(dtype, low) == kept


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_scalar_multiplies_a_half_precision_tensor_as_float32(dtype):
    """0.6 unrounded to float16 or bf16 (a 0-d float32 tensor on the tensor's device); a Python number otherwise."""
    scalar = devices.scalar_for(torch.ones(2, dtype=dtype), 0.6)
    if dtype in (torch.float16, torch.bfloat16):
        assert (scalar.dtype, scalar.shape, scalar.device, scalar.item()) == (torch.float32, (), torch.device("cpu"),
                                                                              torch.tensor(0.6).item())
    else:
        assert scalar == 0.6 and isinstance(scalar, float)


@pytest.mark.parametrize("name, dtype", [("cpu", torch.float64), ("cuda:0", torch.float64), ("mps", torch.float32)])
def test_rates_and_whole_set_sums_are_float64_where_the_device_has_it(name, dtype):
    assert devices.widest_float(name) == dtype


def test_where_a_store_lives(gpus, monkeypatch):
    """On the device when it fits beside training in the usable part of the free memory (asked there when it does
    not: one line naming --data-on host), else in host memory; on the CPU the two are one."""
    gpus(1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (1000, 2000))
    assert devices.store_place(500, "cuda", training=400) == "device"
    assert devices.store_place(500, "cuda", training=401) == "host"
    assert devices.store_place(10, "cuda", "host") == "host" and devices.store_place(900, "cuda", "device") == "device"
    with pytest.raises(core.UsageError, match=r"^--data-on device: the store's 1000.0 KiB and training's 0 B do not "
                                              r"fit in the 1000 B free on cuda; use --data-on host$"):
        devices.store_place(1024000, "cuda", "device")
    assert devices.store_place(10, "cpu") == "host" and devices.store_place(10, "cpu", "device") == "host"
    with pytest.raises(core.UsageError, match=r"^training x needs about 901 B on cuda but it has 1000 B free; y$"):
        devices.check_training_fits("cuda", 901, why="training x", remedy="y")
    devices.check_training_fits("cuda", 900, why="training x", remedy="y")
    devices.check_training_fits("cpu", 10 ** 15, why="training x", remedy="y")     # the CPU cannot tell
    pinned = []
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: pinned.append(pin_memory))
    devices.host_buffer((2, 3), torch.uint8, "cuda:0"), devices.host_buffer((2, 3), torch.uint8, "cpu")
    assert pinned == [True, False]                 # page-locked for asynchronous copies to a GPU alone


def test_streams_and_events_are_cuda_alone(monkeypatch):
    for name in ("current_stream", "Event", "Stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: pytest.fail(f"torch.cuda.{name} called"))
    cpu = torch.device("cpu")
    assert devices.side_stream(cpu) is None and devices.record(None, cpu) is None
    with devices.on_stream(None):
        devices.wait(None, cpu)
        devices.wait_host(None)
        devices.keep_alive(torch.zeros(1), cpu)


def test_another_device_type_never_reaches_torch_cuda(monkeypatch):
    """A device type with a module of its own (here a fake torch.xpu) takes the generic path: no torch.cuda
    function is called."""
    calls = []
    fake = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                 synchronize=lambda *a: calls.append(("synchronize", a)),
                                 mem_get_info=lambda d: (123, 456), get_device_name=lambda d: "Fake XPU")
    monkeypatch.setattr(torch, "xpu", fake, raising=False)
    for name in ("synchronize", "mem_get_info", "get_device_name", "set_device", "current_stream", "Event", "Stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: pytest.fail(f"torch.cuda.{name} called"))
    device = devices.resolve("xpu:1")
    assert device == torch.device("xpu:1")
    devices.synchronize(device)
    devices.timer(device)()
    assert calls == [("synchronize", ())] * 3
    assert devices.free_memory(device) == 123 and devices.name(device) == "Fake XPU"
    assert devices.memory_format(device) == torch.contiguous_format and devices.compute_dtype(device) == torch.float32
    assert cli.environment(device)["device_name"] == "Fake XPU"
    assert devices.side_stream(device) is None and devices.record(device=device) is None
    devices.bind(device)
    benchmark = torch.backends.cudnn.benchmark
    devices.autotune(device)
    assert torch.backends.cudnn.benchmark == benchmark
    with pytest.raises(core.UsageError, match=r"^--device xpu:2: this machine has 2 xpu devices, xpu:0 to xpu:1$"):
        devices.resolve("xpu:2")
    assert devices.free_memory("cpu") is None and devices.accelerator("cpu") is None


def test_timer_excludes_what_it_is_told_to():
    calls = []
    t = devices.Timer(lambda: calls.append(1))
    a = t()
    b = t(include=False)
    assert t.total == pytest.approx(a)
    assert len(calls) == 3 and b >= 0


def test_the_clock_reads_cuda_events_on_a_gpu_and_waits_on_the_device_elsewhere(monkeypatch):
    """On a CUDA device the run's clock is the GPU's time between CUDA events (as the references time); elsewhere
    the host's clock after a device synchronise."""
    made = fake_cuda_events(monkeypatch, [0.0, 0.25, 1.75, 2.0])       # milliseconds on the GPU
    t = devices.timer("cuda:0")
    assert isinstance(t, devices.EventTimer)
    assert t() == pytest.approx(0.25e-3) and made[1].waited
    assert t(include=False) == pytest.approx(1.5e-3)
    assert t() == pytest.approx(0.25e-3) and t.total == pytest.approx(0.5e-3)
    assert isinstance(devices.timer("cpu"), devices.Timer)


@pytest.mark.parametrize("name, compiled, sgd", [
    ("cpu", False, {}), ("cuda", True, {"fused": True}), ("cuda:0", True, {"fused": True}), ("mps", False, {})])
def test_what_is_compiled_and_fused_on_each_device(name, compiled, sgd):
    """Newton–Schulz compiled and SGD fused on CUDA alone: elsewhere eager and torch's default SGD, as recorded."""
    assert devices.compiles_helpers(name) is compiled and devices.compiles_helpers(torch.device(name)) is compiled
    assert devices.sgd_options(name) == sgd == devices.sgd_options(torch.device(name))


@pytest.mark.parametrize("name, choice, decoder", [
    ("cpu", "auto", "cpu"), ("cuda", "auto", "gpu"), ("cuda:1", "auto", "gpu"), ("cuda", "cpu", "cpu"),
    ("mps", "auto", "cpu"), ("cuda:0", "gpu", "gpu")])
def test_where_jpeg_records_are_decoded(name, choice, decoder):
    assert idec.jpeg_decoder(name, choice) == decoder == idec.jpeg_decoder(torch.device(name), choice)


@pytest.mark.parametrize("name, choice, message", [
    ("cpu", "gpu", "--decoder gpu needs a CUDA device (nvJPEG); this run is on cpu"),
    ("mps", "gpu", "--decoder gpu needs a CUDA device (nvJPEG); this run is on mps"),
    ("cuda", "nvjpeg", "--decoder nvjpeg: choose from auto, cpu, gpu, nvimgcodec")])
def test_a_decoder_the_device_cannot_run_is_one_line(name, choice, message):
    with pytest.raises(ValueError) as e:
        idec.jpeg_decoder(name, choice)
    assert str(e.value) == message


@pytest.mark.parametrize("error, size", [
    # CUDA's caching allocator (c10's format_size), MPS's, the caching allocator's inside a compiler's error, the
    # CUDA runtime's, cuDNN's, cuBLAS's
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB "
                            "of which 3.00 MiB is free."), "20.0 MiB"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacity of ..."),
     "512 B"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has ..."), "1.0 GiB"),
    (RuntimeError("MPS backend out of memory (MPS allocated: 17.9 GB, other allocations: 0 bytes, max allowed: 18.1 "
                  "GB). Tried to allocate 256.00 MiB on private pool."), "256.0 MiB"),
    (RuntimeError("backend='inductor' raised:\nOutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."),
     "1.5 GiB"),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), None),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), None),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), None),
    (torch.OutOfMemoryError("out of memory"), None)])
def test_an_allocators_refusal_is_known_by_its_class_or_its_words_and_says_its_size(error, size):
    assert devices.out_of_memory(error) and devices.refused_size(error) == size


def test_the_hosts_real_refusal_is_known_and_a_lost_peer_or_a_fault_is_not():
    with pytest.raises(RuntimeError) as refusal:
        torch.empty(2 ** 62, dtype=torch.uint8)         # past any machine's address space
    assert devices.out_of_memory(refusal.value) and devices.refused_size(refusal.value) == "4.0 EiB"
    for other in (RuntimeError("Connection reset by peer"), RuntimeError("out of memory"), ValueError("no memory")):
        assert not devices.out_of_memory(other) and devices.refused_size(other) is None
