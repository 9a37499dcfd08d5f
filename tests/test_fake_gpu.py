"""The GPU-only paths, run on a CPU-only machine: torch's FakeTensorMode lets tensors live on device `cuda` without
a GPU, runs their forward operations (shapes, dtypes and devices, no values) and raises "Expected all tensors to be
on the same device" where a GPU would. Under it run, with device cuda: the CIFAR-10 dataset's placement, its
augmentation, the networks' forward in channels_last and the evaluation with test-time augmentation; the ImageNet
store's placement on the device and in pinned host memory, both ways of gathering batches, augmentation, the
forward and the validation; and the throughput benchmark's data path.

What FakeTensorMode cannot follow stays on the CPU tests: backward (it needs a CUDA context), autocast (off there),
reading a value (.item()), CUDA's streams, events and generators (stubbed here through devices.py, the one module
that makes them), and building a module under the mode (the networks are built on the CPU, as they are before
.to(device), and moved to the fake GPU by the code under test)."""
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

import cifar10_fast as cf
import cifar_data as cd
import devices
import imagenet_data as idt
import imagenet_fast as inf
import imagenet_store as ims
import torch_backend as tb
from conftest import synthetic_arrays

CUDA = torch.device("cuda")          # as --device cuda names it: no index, while tensors on it say cuda:0


def on_gpu(*tensors):
    return all(t.device.type == "cuda" for t in tensors)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CPU-only machine that looks like one with a GPU to the code under test."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)     # (saying cuda is available starts CUDA)
    copies = []

    class Stream:
        pass
    monkeypatch.setattr(devices, "side_stream", lambda device: Stream())
    monkeypatch.setattr(devices, "on_stream", lambda stream: nullcontext())
    monkeypatch.setattr(devices, "record", lambda stream=None, device=None: copies.append(stream))
    monkeypatch.setattr(devices, "wait", lambda event, device: None)
    monkeypatch.setattr(devices, "wait_host", lambda event: None)
    monkeypatch.setattr(devices, "keep_alive", lambda tensor, device: None)
    monkeypatch.setattr(devices, "generator", lambda device, seed: torch.Generator().manual_seed(seed))
    for table, name in [(tb.MODELS, m) for m in tb.MODELS]:               # networks built on the CPU
        real = table[name]
        monkeypatch.setitem(table, name, lambda *a, real=real, **k: built_on_the_cpu(real, *a, **k))
    real_build = inf.build_model
    monkeypatch.setattr(inf, "build_model", lambda *a, **k: built_on_the_cpu(real_build, *a, **k))
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield copies


def built_on_the_cpu(build, *args, **kwargs):
    with unset_fake_temporarily():
        return build(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- CIFAR-10

@pytest.fixture(scope="module")
def arrays():
    return synthetic_arrays(n_train=128, n_test=64)


@pytest.mark.parametrize("recipe", ["myrtle24", "fast94", "fast94_next_lowres"])
def test_cifar10_on_the_gpu_places_augments_trains_forward_and_evaluates_there(fake_gpu, arrays, recipe):
    hp = cf.hyperparameters(recipe, width=1 / 16, batch_size=32)
    stats = cd.channel_stats(arrays["train_images"])
    data = cd.to_device(arrays, CUDA, dtype=torch.float32, pad=hp["crop_pad"], stats=stats)
    assert on_gpu(data["train_images"], data["test_images"], data["train_labels"], data["test_labels"])
    gen = devices.generator(CUDA, 0)
    layout = devices.memory_format(CUDA)
    assert layout == torch.channels_last
    net = tb.build_model(hp, CUDA, memory_format=layout)
    assert on_gpu(*net.parameters(), *net.buffers())
    tb.fit_whitening(net, data["train_images"], data["test_images"].shape[-2:])
    for epoch in range(2):                      # the low-resolution epoch and the full one
        for x, y in cd.epoch_batches(data, hp, gen, memory_format=layout, epoch=epoch, flip_base=cd.flip_bits(128, gen, CUDA)):
            assert on_gpu(x, y) and x.is_contiguous(memory_format=layout)
            logits = net(x)
            assert on_gpu(logits) and logits.shape == (32, 10)
            break
    for tta, fraction in (("none", 1.0), ("flip_translate", 1.0), ("flip_translate", 0.25)):
        sums = tb.evaluation_sums(net, data["test_images"], data["test_labels"], tta=tta, batch_size=50,
                                  memory_format=layout, tta_fraction=fraction)
        assert on_gpu(sums) and sums.shape == (2,)


def test_a_cifar10_batch_on_the_cpu_is_a_device_mix_the_fake_gpu_catches(fake_gpu, arrays):
    hp = cf.hyperparameters("fast94", width=1 / 16)
    net = tb.build_model(hp, CUDA, memory_format=devices.memory_format(CUDA))
    with pytest.raises(RuntimeError, match="same device"):
        net(torch.zeros(2, 3, 32, 32))


# ---------------------------------------------------------------------------------------------------- ImageNet

@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    ims.synthetic_imagefolder(root / "src", 4, 8, 4, sizes=(20, 32))
    for fmt in ims.FORMATS:
        ims.prepare(root / "src", root / fmt, ims.Settings(format=fmt, size=16), workers=1, log=lambda s: None)
    return {fmt: ims.open_store(root / fmt) for fmt in ims.FORMATS}


def imagenet_hp():
    return inf.hyperparameters("tiny", width=4, batch_size=8, min_res=16, max_res=16, val_res=24, tta="flip")


def draws_on_the_host(data, hp, generator):
    """An epoch's draws, host arrays as draw_epoch makes them from torch's generator, whose draws inside FakeTensorMode
    are fake tensors with no values: a permutation, random whole-pixel boxes inside each image, random flips."""
    rng, n = np.random.default_rng(0), len(data.train_rows)
    h, w = data.shapes("train")
    bh, bw = rng.integers(1, h + 1), rng.integers(1, w + 1)
    boxes = np.stack([rng.integers(0, h - bh + 1), rng.integers(0, w - bw + 1), bh, bw], 1)
    return idt.Draws(perm=rng.permutation(n), boxes=boxes, flips=rng.random(n) < 0.5)


def host_buffers_and_nvjpeg_on_the_cpu(monkeypatch):
    """The decoding threads' host buffers and an epoch's draws are real CPU memory (numpy reads and fills them);
    nvJPEG is stood in for by the CPU's decoder, its images then moved to the (fake) GPU as nvJPEG leaves them."""
    monkeypatch.setattr(idt, "draw_epoch", draws_on_the_host)
    real_array, kept = devices.host_array, []     # kept: the fake tensor converter's memo keys on storage
    monkeypatch.setattr(devices, "host_array", lambda shape, dtype, device: kept.append(built_on_the_cpu(
        real_array, shape, dtype, "cpu")) or kept[-1])
    real_decode = devices.decode_jpeg
    monkeypatch.setattr(devices, "decode_jpeg", lambda records, device: [
        im.to(device) for im in built_on_the_cpu(real_decode, records, "cpu")])


@pytest.mark.parametrize("fmt, where, decoder", [("raw", "device", "cpu"), ("raw", "host", "cpu"),
                                                 ("jpeg", "host", "cpu"), ("jpeg", "host", "gpu")])
def test_imagenet_on_the_gpu_gathers_augments_trains_forward_and_validates(fake_gpu, stores, fmt, where, decoder,
                                                                           monkeypatch):
    """A raw store on the GPU (gathered there; on an earlier main this took the pinned-host path, because cuda:0 is
    not cuda to torch.device's ==), or in pinned host memory (gathered into pinned buffers and copied on a side
    stream); a JPEG store decoded by the CPU's threads into host buffers and copied, or by nvJPEG on the GPU and
    cropped there. Training batches and validation end on the GPU, in its layout."""
    host_buffers_and_nvjpeg_on_the_cpu(monkeypatch)
    hp = imagenet_hp()
    data = idt.place(stores[fmt], CUDA, where=where, decoder=decoder, threads=2)
    assert data.where == where and (fmt == "jpeg" or on_gpu(data.pixels) is (where == "device"))
    gen = torch.Generator().manual_seed(0)
    layout = devices.memory_format(CUDA)
    model = inf.build_model(hp, 4).to(CUDA, memory_format=layout)
    n = len(data.train_rows)
    batches = list(idt.train_batches(data, hp, idt.draw_epoch(data, hp, gen), res=16, batch_size=8, generator=gen,
                                     device=CUDA, dtype=torch.float32, memory_format=layout))
    assert len(batches) == n // 8
    for x, y in batches:
        assert on_gpu(x, y) and x.shape == (8, 3, 16, 16) and x.is_contiguous(memory_format=layout)
        assert on_gpu(model(x))
    copies = {("raw", "host", "cpu"): n // 8, ("jpeg", "host", "cpu"): n // 8}.get((fmt, where, decoder), 0)
    assert len(fake_gpu) == copies                  # a copy recorded per batch from host memory
    sums = idt.validation_sums(model, data, hp, tta=hp["tta"], device=CUDA, dtype=torch.float32, memory_format=layout)
    assert on_gpu(sums) and sums.shape == (4,)
    assert len(fake_gpu) == copies + len(idt.val_jobs(data, hp))     # validation: decoded on the CPU, copied


def test_the_throughput_benchmark_reads_the_training_batches(fake_gpu, stores, monkeypatch):
    """benchmarks/imagenet_throughput.py times idt.train_batches, the batches training reads."""
    from conftest import ROOT
    source = (ROOT / "benchmarks" / "imagenet_throughput.py").read_text()
    assert "idt.train_batches(" in source and "idt.gathered(" not in source
    host_buffers_and_nvjpeg_on_the_cpu(monkeypatch)
    data = idt.place(stores["jpeg"], CUDA, decoder="gpu")
    gen = torch.Generator().manual_seed(0)
    x, y = next(idt.train_batches(data, imagenet_hp(), idt.draw_epoch(data, imagenet_hp(), gen), res=16, batch_size=8,
                                  generator=gen, device=CUDA, dtype=torch.bfloat16, memory_format=torch.channels_last))
    assert on_gpu(x, y) and x.dtype == torch.bfloat16 and y.dtype == torch.int64
