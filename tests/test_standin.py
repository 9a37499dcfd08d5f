"""Whole commands as a GPU runs them, on the CPU: under the stand-in for CUDA GPUs (tests/cuda_standin.py), which
computes every operation and checks devices as CUDA does, cifar10_fast.py's recipe families (eager and compiled),
imagenet_fast.py train with both store formats, both decoders and both places of a raw store (warm-up, pinned
staging, side streams, autocast, fused SGD), a ResNet-50 step, and torchrun with 2 ranks."""
import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cifar10_fast as cf
import cifar_data as cd
import devices
import distributed as D
import imagenet_data as idt
import imagenet_fast as inf
import imagenet_models
import imagenet_store as ims
import torch_backend as tb
from conftest import ROOT, synthetic_arrays, synthetic_npz, train_once
from cuda_standin import StandIn
from imagefolders import synthetic_imagefolder

TINY = ["--width", "0.0625", "--batch-size", "32", "--epochs", "3"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 128, 64)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    synthetic_imagefolder(root / "src", 4, 12, 4, sizes=(20, 40))
    for fmt in ims.FORMATS:
        ims.prepare(root / "src", root / fmt, ims.StoreSettings(format=fmt, size=24), workers=1, log=lambda s: None)
    return {fmt: root / fmt for fmt in ims.FORMATS}


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile through dynamo's guards and graphs as on a GPU, with no code generation (seconds)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda model=None, mode=None, **kw: real(model, **{**kw, "backend": "aot_eager"}))


# ---------------------------------------------------------------------------------------------------- the stand-in

def test_the_stand_in_refuses_what_cuda_refuses():
    with StandIn() as gpu:
        net = torch.nn.Linear(3, 2).to("cuda")
        assert net.weight.device == torch.device("cuda:0") and net.weight.is_cuda
        with pytest.raises(RuntimeError, match="same device"):
            net(torch.zeros(4, 3))                                        # a batch left in host memory
        x, labels = torch.arange(6.0, device="cuda"), torch.arange(6)
        assert x[torch.tensor([0, 2])].device.type == "cuda"              # host indices into a GPU tensor: fine
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            labels[torch.tensor([0, 2], device="cuda")]                   # GPU indices into a host tensor
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            x.numpy()
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randperm(6, device="cuda", generator=torch.Generator())
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.rand(3, generator=devices.generator("cuda", 0))
        with pytest.raises(RuntimeError, match="out tensor"):
            torch.add(x, x, out=torch.empty(6))
        assert (x * torch.tensor(2.0)).device.type == "cuda"              # a host scalar beside GPU tensors: fine
    assert gpu.counts["blocking"] == 4       # the layer's parameters, host indices, GPU indices made of host data


def test_the_stand_in_counts_copies_and_which_of_them_block_the_host():
    with StandIn() as gpu:
        pageable, pinned = torch.ones(4), torch.ones(4, pin_memory=True)
        assert pinned.is_pinned() and not pageable.is_pinned()
        pinned.to("cuda", non_blocking=True)
        assert gpu.counts["to_gpu"] == 1 and gpu.counts["blocking"] == 0
        pageable.to("cuda", non_blocking=True)                            # pageable memory: the host waits
        on_gpu = torch.ones(4).cuda()
        assert gpu.counts["to_gpu"] == 3 and gpu.counts["blocking"] == 2
        on_gpu.sum().item()
        on_gpu.cpu()
        assert gpu.counts["to_host"] == 2 and gpu.counts["blocking"] == 4
        torch.tensor([1.0, 2.0], device="cuda")                           # host data, copied as the host waits
        assert gpu.counts["to_gpu"] == 4 and gpu.counts["blocking"] == 5 and gpu.counts["gpu_ops"] == 1


def test_a_step_on_the_stand_in_trains_as_on_the_cpu():
    """Backward, fused SGD and autocast run; gradients say they are on the GPU; the numbers are the CPU's."""
    def step(device):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2)).to(device)
        net(torch.zeros(1, 3, 6, 6, device=device))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, **devices.sgd_options(device))
        x, y = torch.randn(4, 3, 6, 6).to(device), torch.tensor([0, 1, 0, 1]).to(device)
        F.cross_entropy(net(x), y).backward()
        assert net[0].weight.grad.device.type == torch.device(device).type
        opt.step()
        return [p.detach().cpu() for p in net.parameters()]
    with StandIn():
        on_gpu = step("cuda")
    for a, b in zip(on_gpu, step("cpu")):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------- CIFAR-10

@pytest.mark.parametrize("recipe", ["myrtle24", "myrtle10", "fast94", "fast94_muon", "fast94_next",
                                    "fast94_next_lowres"])
def test_each_recipe_family_runs_its_whole_command_on_a_gpu(npz, tmp_path, recipe, aot_eager):
    out = tmp_path / "r.json"
    with StandIn() as gpu:
        assert cf.main(["--recipe", recipe, "--data-dir", str(npz), *TINY, "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["environment"]["device"] == "cuda" and run["environment"]["device_name"] == gpu.name
    assert gpu.ops["conv2d"] > 0 and gpu.counts["host_waits"] > 0        # the network ran there, and the clock


# fast94_lowflop: fast94_next_lowres's resolutions and bias states, and the optimisers' step compiled
@pytest.mark.parametrize("recipe, flags", [("fast94", []), ("fast94", ["--compile-step", "true", "--eval-every", "2"]),
                                           ("fast94_muon", []), ("fast94_lowflop", [])])
def test_each_compiled_recipe_compiles_nothing_inside_a_timed_run_on_a_gpu(npz, tmp_path, recipe, flags, aot_eager):
    out = tmp_path / "r.json"
    torch._dynamo.reset()
    with StandIn():
        assert cf.main(["--recipe", recipe, "--data-dir", str(npz), *TINY, "--compile", "default", "--runs", "2",
                        *flags, "--out", str(out)]) == 0
    assert [(r["recompiles"], r["eager_fallbacks"]) for r in json.loads(out.read_text())["runs"]] == [(0, 0)] * 2


def test_compiled_fast94_next_at_the_full_test_set_compiles_nothing_and_falls_back_to_nothing_in_a_timed_run(
        tmp_path, aot_eager):
    """All 10,000 test images (eval batches of 1000, the selective views' 2,500 with a remainder of 500, two states
    of the whitening bias) and two steps of the record's batch: within dynamo's limit, every graph met in the
    warm-up, and a function past the limit would stop the run rather than fall back to eager."""
    npz, out = tmp_path / "full.npz", tmp_path / "r.json"
    np.savez(npz, **synthetic_arrays(n_train=3072, n_test=10000))
    torch._dynamo.reset()
    with StandIn():
        # float32: the same graphs as bf16's (autocast adds no shape), without the CPU's slow bf16 convolutions
        assert cf.main(["--recipe", "fast94_next", "--data-dir", str(npz), "--width", "0.0625", "--epochs", "2",
                        "--compile", "default", "--precision", "fp32", "--eval-every", "0", "--out", str(out)]) == 0
    assert [(r["recompiles"], r["eager_fallbacks"]) for r in json.loads(out.read_text())["runs"]] == [(0, 0)]


def test_a_compiled_run_past_dynamos_limit_of_graphs_stops_instead_of_falling_back_to_eager(npz, aot_eager):
    torch._dynamo.reset()
    # the warm-up's second graph is one too many
    with torch._dynamo.config.patch(recompile_limit=1), StandIn(), \
            pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        cf.main(["--recipe", "fast94", "--data-dir", str(npz), *TINY, "--compile", "default"])
    assert not torch._dynamo.config.fail_on_recompile_limit_hit         # only while cifar10_fast trains


def test_the_warm_up_fits_the_whitening_so_no_timed_run_loads_the_linear_algebra_library(npz):
    arrays = dict(np.load(npz))
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=32)
    with StandIn() as gpu:
        cf.build(r, arrays, cf.Options(), ctx=D.Context(device="cuda"), stats=cf.channel_stats(arrays["train_images"]))
    assert gpu.ops["linalg_svd"] >= 1      # the record's decomposition, on the GPU, before any clock


@pytest.mark.parametrize("recipe", ["fast94_next", "fast94_lowflop"])   # Muon apart, or one step with 0-d rates
def test_a_timed_run_never_waits_for_the_gpu_before_its_final_evaluation_and_reads_its_clock_and_sums_once(
        npz, monkeypatch, one_thread, recipe, aot_eager):
    """From the clock's start to the final evaluation: no host wait and no blocking copy (events mark the epochs,
    the losses and counts are summed on the GPU, set_lr fills the rates without a read). Then the evaluation's one
    read, and after the clock one wait for the last event and one copy of every epoch's sums."""
    snaps, real_timer, real_evaluate = [], devices.timer, cf.loss_and_accuracy

    def timer(device):
        snaps.append(("clock", dict(gpu.counts)))
        return real_timer(device)

    def evaluate(*args, **kwargs):
        snaps.append(("evaluation", dict(gpu.counts)))
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(devices, "timer", timer)
    monkeypatch.setattr(cf, "loss_and_accuracy", evaluate)
    r = cf.recipe(recipe, width=1 / 16, batch_size=32, epochs=3)     # Muon, whitening, selective views
    with StandIn() as gpu:
        data = cd.dataset_on_device(dict(np.load(npz)), torch.device("cuda"), dtype=torch.float32,
                                    pad=r.augment.crop_pad)
        result = train_once(r, data, device="cuda", precision="fp32", eval_every=0)
        snaps.append(("end", dict(gpu.counts)))
    assert [what for what, _ in snaps] == ["clock", "evaluation", "end"]
    (_, start), (_, final), (_, end) = snaps
    waits = lambda a, b: {k: b.get(k, 0) - a.get(k, 0) for k in ("host_waits", "blocking")}
    assert waits(start, final) == {"host_waits": 0, "blocking": 0}
    assert waits(final, end) == {"host_waits": 1, "blocking": 2}
    assert [row["epoch"] for row in result["rows"]] == [1, 2, 3] and result["rows"][-1]["test_acc"] is not None


@pytest.mark.parametrize("recipe", ["fast94_next", "fast94_curriculum"])
def test_the_first_timed_run_meets_nothing_new_and_counts_as_every_later_run(recipe, monkeypatch, one_thread,
                                                                           aot_eager):
    """Under reduce-overhead (dynamo's graphs; CUDA-graph trees record a path on its second call): three runs, each
    with the same operations, copies, blocking copies, host waits and graphs compiled (none); the first launches no
    kernel (an operation with its dtypes and shapes) that the warm-up had not, calls every compiled path the
    warm-up called 3 times or more, and holds no more memory at its peak. With the warm-up that was not a whole run,
    fast94_next's first run launched 21 kernels new to the process (the metrics' argmax and sums, Muon's
    renormalisation), the curriculum's 17, and the later runs none."""
    r = cf.recipe(recipe, width=1 / 16, batch_size=32, **({"epochs": 3} if recipe == "fast94_next" else {}))
    snaps, real_build = [], cf.build

    def snap():
        snaps.append((dict(gpu.counts), Counter(gpu.kernels), cf.compile_counts(), gpu.peak))
        gpu.peak = 0

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        snap()
        return built
    monkeypatch.setattr(cf, "build", build)
    with StandIn(peaks=True) as gpu:
        cf.train(r, synthetic_arrays(n_train=128, n_test=64), options=cf.Options(
            device="cuda", runs=3, compile="reduce-overhead", eval_every=0, on_run=lambda result: snap()))
    runs = [({k: b[0].get(k, 0) - a[0].get(k, 0) for k in b[0]}, b[1] - a[1], [y - x for x, y in zip(a[2], b[2])],
             b[3]) for a, b in zip(snaps, snaps[1:])]
    assert runs[0][0] == runs[1][0] == runs[2][0] and runs[0][1] == runs[1][1] == runs[2][1]
    assert all(graphs == [0, 0] for _, _, graphs, _ in runs)
    warm = snaps[0][1]
    assert not [key for key in runs[0][1] if key not in warm]
    assert all(warm[key] >= 3 for key in runs[0][1] if key[0].startswith("compiled"))
    assert runs[0][3] <= snaps[0][3]


def test_the_warm_up_run_leaves_the_timed_runs_numbers_as_they_were(monkeypatch, one_thread):
    """Two runs after the warm-up (a whole run from the first run's seed) train as two runs without one: the same
    per-epoch losses and accuracies, bit for bit."""
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=32, epochs=2)
    arrays = synthetic_arrays(n_train=128, n_test=64)
    rows = lambda result: [[row[k] for k in ("train_loss", "train_acc", "test_loss", "test_acc")]
                           for run in result.runs for row in run["rows"]]
    with StandIn():
        warmed = cf.train(r, arrays, options=cf.Options(device="cuda", runs=2, seed=5, precision="fp32"))
        monkeypatch.setattr(cf, "warmup", lambda *args, **kwargs: None)
        cold = cf.train(r, arrays, options=cf.Options(device="cuda", runs=2, seed=5, precision="fp32"))
    assert rows(warmed) == rows(cold) and len(rows(cold)) == 4


def test_profile_writes_a_trace_of_the_first_timed_run_and_prints_its_top_kernels(npz, tmp_path, capsys, one_thread):
    """--profile FILE on a GPU (here the stand-in, whose profiler records the CPU's activity alone): Chrome's JSON of
    the run after the warm-up, its operators in it, the table of the top ones by time on stderr, and the run's
    record marked as profiled."""
    trace, out = tmp_path / "trace.json", tmp_path / "r.json"
    with StandIn():
        assert cf.main(["--recipe", "fast94_next", "--data-dir", str(npz), "--width", "0.0625", "--batch-size", "32",
                        "--epochs", "1", "--precision", "fp32", "--quiet", "--profile", str(trace), "--out",
                        str(out)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"aten::convolution", "aten::convolution_backward"} <= {e.get("name") for e in events}
    table = capsys.readouterr().err.split(f"wrote a trace of the run to {trace}\n")[1].splitlines()
    assert table[0].startswith("top 12 operators by their own time on the CPU (no GPU kernels), of ")
    assert table[1].split() == ["ms", "share", "calls", "name"] and len(table) >= 14
    assert all(re.fullmatch(r" *\d+\.\d{3} +\d+\.\d% +\d+  \S.*", row) for row in table[2:14])
    assert [run.get("profiled") for run in json.loads(out.read_text())["runs"]] == [True]


@pytest.mark.parametrize("where, message", [("folder", "is a folder; give a file name"),
                                            ("a_file/trace.json", "is a file, not a folder")])
def test_a_profile_that_cannot_be_written_is_one_line_before_any_training(tmp_path, capsys, where, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("")
    path = tmp_path / where
    assert cf.main(["--recipe", "fast94_next", "--data-dir", str(tmp_path / "no.npz"), "--profile", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --profile {path}: ") and err[0].endswith(message)


def test_in_float32_the_selective_views_read_no_output_a_cuda_graph_has_overwritten(npz):
    """With CUDA graphs (reduce-overhead, max-autotune) a call's outputs are overwritten by the next call's; in
    float32 `.float()` is no copy, so keeping the plain pass's outputs of every batch read overwritten ones."""
    arrays = synthetic_arrays(n_train=64, n_test=300)
    r = cf.recipe("fast94_next", width=1 / 16)
    with StandIn():
        data = cd.dataset_on_device(arrays, torch.device("cuda"), dtype=torch.float32, pad=0)
        torch.manual_seed(0)
        net = tb.build_model(r, "cuda")
        graphed = torch.compile(net, mode="reduce-overhead", backend="eager", dynamic=False)
        options = dict(tta=r.tta, batch_size=100)       # selective: a quarter
        eager = tb.loss_and_accuracy(net, data["test_images"], data["test_labels"], **options)
        assert tb.loss_and_accuracy(graphed, data["test_images"], data["test_labels"], **options) == eager


def cifar_standin_command(*args, gpus=2, memory=80 << 30):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "STANDIN_GPUS": str(gpus),
           "STANDIN_MEMORY": str(memory)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_torchrun_with_two_ranks_trains_on_two_gpus(npz, tmp_path):
    out = tmp_path / "r.json"
    r = cifar_standin_command("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "tests/standin_main.py", "cifar10_fast.py", "--recipe", "fast94", "--data-dir", str(npz),
                              *TINY, "--batch-size", "64", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on NVIDIA stand-in (CPU) (cuda:0, bfloat16)" in r.stdout and "2 ranks of 32 images per step" in r.stdout
    assert json.loads(out.read_text())["environment"]["world_size"] == 2


# ---------------------------------------------------------------------------------------------------- ImageNet

TINY_IN = ["--recipe", "tiny", "--epochs", "2", "--batch-size", "8", "--width", "8", "--min-res", "24",
           "--max-res", "24", "--val-res", "24"]


@pytest.mark.parametrize("fmt, flags", [("raw", ["--data-on", "device"]), ("raw", ["--data-on", "host"]),
                                        ("jpeg", ["--decoder", "cpu"]), ("jpeg", ["--decoder", "gpu"]),
                                        ("raw", ["--data-on", "device", "--accumulate", "2", "--bn-workers", "4"])])
def test_imagenet_trains_on_a_gpu_from_each_store_and_place(stores, tmp_path, fmt, flags):
    """The warm-up and every epoch's batches on the GPU: a raw store gathered there (its labels beside it) or from
    the memory-mapped file through pinned buffers; a JPEG store decoded by the CPU's threads or by nvJPEG; and
    micro-batches normalised in groups (ghost batch norm) in bf16."""
    out = tmp_path / "r.json"
    with StandIn() as gpu:
        assert inf.main(["train", "--store", str(stores[fmt]), *TINY_IN, *flags, "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["environment"]["device"] == "cuda" and gpu.ops["conv2d"] > 0
    if fmt == "raw":
        assert run["data_on"] == flags[1]
    assert (gpu.ops["var_mean"] > 0) == ("--bn-workers" in flags)          # the groups' statistics, on the GPU


def test_a_raw_store_on_the_host_stays_the_memory_mapped_file_and_only_two_batches_are_pinned(stores):
    store = ims.open_store(stores["raw"])
    with StandIn() as gpu:
        data = idt.rank_data(store, torch.device("cuda"), where="host")
        assert not data.pixels.is_pinned()
        assert data.pixels.numpy().base is not None and np.shares_memory(data.pixels.numpy(), store.train.data)
        r = inf.recipe("tiny", batch_size=8)
        gen = torch.Generator().manual_seed(0)
        batches = idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=24, batch_size=8,
                                    device=torch.device("cuda"), dtype=torch.bfloat16)
        for x, y in batches:
            assert x.device.type == "cuda" and y.device.type == "cuda"
            assert gpu.pinned_bytes() <= 2 * 8 * 24 * 24 * 3 + 4 * 9 * 8 * 8    # two staging buffers, two indices


def data_path_counts(store, *, batch_size, steps=3, **where):
    """(operations launched on the GPU, blocking copies) of each of the first `steps` training batches the loader
    yields (flips, jitter, normalisation, labels), under the stand-in."""
    with StandIn() as gpu:
        data = idt.rank_data(ims.open_store(store), torch.device("cuda"), **where)
        r = inf.recipe("tiny", batch_size=batch_size, jitter=0.2)
        gen = torch.Generator().manual_seed(0)
        batches = idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=24,
                                    batch_size=batch_size, device=torch.device("cuda"), dtype=torch.bfloat16)
        counts = []
        for _ in range(steps):
            ops, blocking = gpu.counts["gpu_ops"], gpu.counts["blocking"]
            x, y = next(batches)
            assert x.device.type == y.device.type == "cuda" and len(x) == len(y) == batch_size
            counts.append((gpu.counts["gpu_ops"] - ops, gpu.counts["blocking"] - blocking))
    return counts


@pytest.mark.parametrize("fmt, where", [("raw", dict(where="device")), ("raw", dict(where="host")),
                                        ("jpeg", dict(decoder="cpu")), ("jpeg", dict(decoder="gpu"))])
def test_the_data_path_launches_as_many_operations_for_any_batch_and_never_blocks_the_host(stores, fmt, where):
    """Each step's batch takes the same operations on the GPU at 4 images as at 8 (no per-image work; the GPU decoder
    but for a view and a copy an image into the padded batch, imagenet_data.padded), and no copy in it makes the host
    wait (small per-batch tensors from pinned memory, constants made without one)."""
    small, large = (data_path_counts(stores[fmt], batch_size=bs, **where) for bs in (4, 8))
    per_image = 2 if where.get("decoder") == "gpu" else 0
    assert [ops + 4 * per_image for ops, _ in small] == [ops for ops, _ in large], (small, large)
    assert [blocking for _, blocking in small + large] == [0] * 6, (small, large)


def test_a_resnet50_step_runs_on_a_gpu(stores, tmp_path):
    with StandIn():
        assert inf.main(["train", "--store", str(stores["jpeg"]), "--recipe", "rn50_16ep", "--epochs", "1",
                         "--batch-size", "4", "--min-res", "32", "--max-res", "32", "--val-res", "32",
                         "--warmup-epochs", "0", "--out", str(tmp_path / "r.json")]) == 0


def test_imagenet_under_torchrun_with_two_ranks_on_two_gpus(stores, tmp_path):
    r = cifar_standin_command("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "tests/standin_main.py", "imagenet_fast.py", "train", "--store", str(stores["jpeg"]),
                              *TINY_IN, "--batch-size", "16")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decoded on the GPU (nvJPEG)" in r.stdout and "2 ranks of 8 images per step" in r.stdout


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory):
    """A JPEG store of ImageNet's sizes: photos of longer side 340 to 500 (4:3, 3:4, square; every fourth
    progressive)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from imagenet_gpu_check import FULL, write_images
    root = tmp_path_factory.mktemp("photos")
    src, _ = write_images(root / "src", images=48, classes=4, sides=FULL["sides"], workers=1)
    ims.prepare(src, root / "store", workers=1, log=lambda s: None)
    return root / "store"


@pytest.mark.slow          # two ranks at ImageNet's sizes on the CPU: minutes each
@pytest.mark.parametrize("res", [160, 224])
@pytest.mark.parametrize("repeat", [1, 2])
def test_two_ranks_at_imagenets_sizes_with_the_gpu_decoder_for_several_epochs(photo_store, res, repeat):
    """rn50_16ep's images, crops and validation (256 px, flip TTA), bf16, nvJPEG's stand-in decoding in its reader
    thread beside the draws' thread, for three epochs on two ranks: every epoch's row, and the process ends cleanly
    (a race between the threads once corrupted memory here)."""
    r = cifar_standin_command("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=0",
                              "tests/standin_main.py", "imagenet_fast.py", "train", "--store", str(photo_store),
                              "--recipe", "rn50_16ep", "--model", "resnet_tiny", "--batch-size", "8", "--epochs", "3",
                              "--min-res", str(res), "--max-res", str(res), "--decoder", "gpu")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [row[:2] for row in rows if len(row) > 10] == [["1", str(res)], ["2", str(res)], ["3", str(res)]], r.stdout
    assert "decoded on the GPU (nvJPEG)" in r.stdout and "2 ranks of 8 images per step" in r.stdout


class Loaded(Exception):
    """The data began to load."""


@pytest.mark.parametrize("world", [1, 8])
def test_a_batch_that_cannot_fit_the_gpu_stops_in_one_line_naming_the_accumulation_that_fits(stores, monkeypatch,
                                                                                             capsys, world):
    """akiba_32k at full size on GPUs of 80 GiB, alone or as one of 8 ranks (4,096 images each): one line before the
    data loads, naming the fewest micro-batches (--accumulate) whose activations fit, and with them the data loads."""
    monkeypatch.setattr(inf, "rank_data", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    ctx = D.Context(world_size=world, distributed=world > 1, device="cuda:0")
    batch = 32768 // world

    def run(*flags):
        args, changes = inf.parse_args(["train", "--store", str(stores["jpeg"]), "--recipe", "akiba_32k", *flags])
        with StandIn(memory=80 << 30):
            return inf.train_command(args, inf.recipe("akiba_32k", **changes), ctx=ctx, argv=[])
    assert run() == 2
    err = capsys.readouterr().err.strip()
    m = re.fullmatch(rf"error: training resnet50 at {batch} images per process needs about [\d.]+ [GT]iB on cuda:0 "
                     r"\([\d.]+ MiB of weights and optimiser state, [\d.]+ [GT]iB of activations, "
                     r"[\d.]+ [GM]iB of input buffers, [\d.]+ GiB for validation\) but it has 80.0 GiB free; "
                     r"add --accumulate (\d+) \(micro-batches of (\d+) images\), or use more GPUs", err)
    assert m and int(m[1]) * int(m[2]) == batch, err
    store = ims.open_store(stores["jpeg"])
    need = lambda k: imagenet_models.training_bytes(inf.recipe("akiba_32k", accumulate=k), len(store.index["classes"]),
                                                    world=world, dtype=torch.bfloat16, gpu_decoder=True,
                                                    side=int(max(store.train.rows["width"].max(),
                                                                 store.train.rows["height"].max(),
                                                                 store.val.rows["width"].max(),
                                                                 store.val.rows["height"].max())))
    assert need(int(m[1])) <= devices.USABLE * (80 << 30) < need(int(m[1]) // 2)
    with pytest.raises(Loaded):
        run("--accumulate", m[1])


def test_a_store_goes_onto_the_gpu_only_if_training_still_fits_beside_it(stores, capsys):
    """A GPU with room for training and half the store: asked onto the GPU, the store stops the run in one line,
    before it loads; left to choose, it stays in host memory."""
    store = ims.open_store(stores["raw"])
    r = inf.recipe("tiny", epochs=2, batch_size=8, width=8, min_res=24, max_res=24, val_res=24)
    training = imagenet_models.training_bytes(r, len(store.index["classes"]), world=1, dtype=torch.bfloat16)
    memory = int((training + store.train_pixels().nbytes / 2) / devices.USABLE)
    with StandIn(memory=memory):
        assert inf.main(["train", "--store", str(stores["raw"]), *TINY_IN, "--data-on", "device"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --data-on device: the store's ") and err.endswith("; use --data-on host")
        assert idt.rank_data(store, torch.device("cuda"), training=training).where == "host"
        assert idt.rank_data(store, torch.device("cuda"), training=0).where == "device"


def test_nvjpeg_decodes_in_a_thread_of_its_own_on_a_drained_side_stream_that_the_training_stream_waits_for(stores):
    """nvJPEG writes from a stream of its own that waits on nothing: it is called, in a thread that is not the training
    loop's (the call holds its thread until the decode ends), on a side stream with nothing left queued there; the
    batch's crops are made on that side stream, the training stream waits for them, and they are kept alive for it
    (the call order, which is what the stand-in can see of streams)."""
    store = ims.open_store(stores["jpeg"])
    with StandIn() as gpu:
        data = idt.rank_data(store, torch.device("cuda"), decoder="gpu")
        r = inf.recipe("tiny", batch_size=8)
        gen = torch.Generator().manual_seed(0)
        for x, y in idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=24, batch_size=8,
                                      device=torch.device("cuda"), dtype=torch.bfloat16):
            pass
    main = threading.current_thread().name
    reader = [c for c, t in zip(gpu.calls, gpu.threads) if t != main]
    assert len(reader) == 5 * (len(data.train_rows) // 8)
    side = reader[0][1]
    assert not side.default and reader[:5] == [("host_wait", side), ("enter_stream", side), ("nvjpeg", side),
                                               ("host_wait", "nvjpeg"), ("exit_stream", side)]
    assert all(reader[i:i + 5] == reader[:5] for i in range(0, len(reader), 5))
    calls = [c for c, t in zip(gpu.calls, gpu.threads) if t == main and (c[0] != "record" or not c[1].default)]
    assert not any(c[0] == "nvjpeg" or c == ("host_wait", "nvjpeg") for c in calls)   # the training thread never waits
    crops = [i for i, c in enumerate(calls) if c[0] == "record" and c[1] == side]
    assert len(crops) == len(data.train_rows) // 8
    for i in crops:
        waited = next(k for k in range(i, len(calls)) if calls[k][0] == "wait_event" and calls[k][2] is calls[i][2])
        assert calls[waited][1].default                                  # the training stream waits for the crops
        assert any(c[0] == "record_stream" and c[1].default for c in calls[waited:waited + 3])


def test_an_event_for_a_device_is_recorded_on_that_devices_stream_not_the_current_devices():
    """--device cuda:1 in one process: the copies to cuda:1 are waited for on cuda:1's stream."""
    with StandIn(gpus=2) as gpu:
        assert torch.cuda.current_device() == 0
        event = devices.record(device=torch.device("cuda:1"))
    assert event.stream.index == 1 and event.stream == gpu.current_stream(1)


def test_without_float64_on_the_device_the_whitening_fit_and_the_validation_sums_still_run(stores, monkeypatch):
    """Apple's MPS has no float64: the whitening's decomposition goes to the CPU, and the validation sums are float32,
    through devices.py (a stand-in that refuses float64 as MPS does, and devices saying this device lacks it)."""
    store = ims.open_store(stores["raw"])
    r = inf.recipe("tiny", batch_size=8, val_res=24)
    with StandIn(float64=False):
        with pytest.raises(TypeError, match="doesn't support float64"):
            torch.zeros(2, device="cuda").double()
        monkeypatch.setattr(devices, "has_float64", lambda device: False)
        net = tb.build_model(cf.recipe("fast94_next", width=1 / 16), "cuda")
        tb.fit_whitening(net, torch.randn(64, 3, 32, 32).to("cuda"), 32)
        assert net[0].weight.device.type == "cuda" and torch.isfinite(net[0].weight).all()
        data = idt.rank_data(store, torch.device("cuda"))
        model = inf.imagenet_network(r, 4).to("cuda")
        sums = idt.validation_sums(model, data, r.validation, tta="none", device=torch.device("cuda"),
                                   dtype=torch.float32)
        assert sums.dtype == torch.float32 and sums[3].item() == len(data.val_rows)
