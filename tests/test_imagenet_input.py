"""ImageNet's input on a GPU as the stand-in sees it (tests/cuda_standin.py): a command that runs without simplejpeg
on the GPU decoder, no host wait in a GPU-decoded training batch, validation decoded where training decodes, the
decoding workers' start and number, the epochs' draws made ahead, and which of nvJPEG's paths decoded each image."""
import io
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import distributed as D
import imagenet_data as idt
import imagenet_decoders as idec
import imagenet_fast as inf
import imagenet_store as ims
import imagenet_workers
import training
from conftest import ROOT, small_jpeg_store
from cuda_standin import StandIn
from test_imagenet import damaged_copy

pytestmark = pytest.mark.usefixtures("one_thread")     # conftest's: tiny networks on a shared 2-core machine

TINY = ["--recipe", "tiny", "--epochs", "2", "--batch-size", "8", "--width", "8", "--min-res", "24", "--max-res", "24",
        "--val-res", "24"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_jpeg_store(tmp_path_factory)


WITHOUT_SIMPLEJPEG = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import imagenet_fast as inf
from cuda_standin import StandIn
try:
    inf.main(["--help"])
except SystemExit as e:
    print("help exit", e.code)
with StandIn():
    print("gpu exit", inf.main(["train", "--store", {store!r}, *{tiny!r}, "--epochs", "1", "--decoder", "gpu"]))
print("cpu exit", inf.main(["train", "--store", {store!r}, *{tiny!r}, "--device", "cpu"]))
print("simplejpeg" in sys.modules and sys.modules["simplejpeg"] is not None)
"""


def test_imagenet_imports_and_trains_on_the_gpu_decoder_without_simplejpeg(store, tmp_path):
    """simplejpeg made unimportable (a module of that name that raises ImportError, first on the path): --help and a
    GPU-decoded run (its validation too) under the stand-in exit 0; the CPU decoder stops in one line naming the
    install."""
    (tmp_path / "simplejpeg.py").write_text("raise ImportError(\"No module named 'simplejpeg'\")\n")
    code = WITHOUT_SIMPLEJPEG.format(root=str(ROOT), tests=str(ROOT / "tests"), store=str(store), tiny=TINY)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert "help exit 0" in lines and "gpu exit 0" in lines and "cpu exit 2" in lines and lines[-1] == "False"
    assert "decoded on the GPU (nvJPEG)" in r.stdout
    assert r.stderr.strip().splitlines()[-1] == ("error: --decoder cpu decodes JPEGs with simplejpeg, which is not "
                                                 "installed: pip install simplejpeg (or --decoder gpu on a CUDA GPU)")


def main_thread_waits(gpu, since):
    """The host waits and blocking copies of the calling thread since gpu.calls[since] (and the blocking count)."""
    me = threading.current_thread().name
    return [c for c, t in zip(gpu.calls[since:], gpu.threads[since:]) if t == me and c[0] == "host_wait"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_gpu_decoded_training_batch_makes_the_training_thread_wait_for_nothing(store):
    """Each batch of the GPU decoder, and a step on it: no host wait and no blocking copy in the training thread (the
    reader thread waits for nvJPEG, by design). The stand-in counts the wait inside a GPU nested tensor's
    to_padded_tensor (its sizes copied from pageable memory), which the decoder padded its images with before."""
    with StandIn() as gpu:
        data = idt.rank_data(ims.open_store(store), torch.device("cuda"), decoder="gpu")
        r = inf.recipe("tiny", batch_size=8, width=8, jitter=0.2)
        model = inf.imagenet_network(r, 5).to("cuda")
        opt = inf.imagenet_optimizer(model, r)
        gen = torch.Generator().manual_seed(0)
        batches = idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=24, batch_size=8,
                                    device=torch.device("cuda"), dtype=torch.bfloat16)
        seen = 0
        while True:
            since, blocking = len(gpu.calls), gpu.counts["blocking"]
            try:
                x, y = next(batches)
            except StopIteration:
                break
            inf.accumulated_step(model, opt, [(x, y)], ctx=D.Context(), label_smoothing=0.1,
                                 dtype=torch.bfloat16)
            assert main_thread_waits(gpu, since) == [] and gpu.counts["blocking"] == blocking
            seen += 1
        assert seen == len(data.train_rows) // 8 == sum(c[0] == "nvjpeg" for c in gpu.calls)
        nested = torch.nested.nested_tensor([torch.zeros(3, 4, 5, device="cuda"), torch.zeros(3, 6, 2, device="cuda")])
        since = len(gpu.calls)
        nested.to_padded_tensor(0.0)
        assert main_thread_waits(gpu, since) == [("host_wait", "to_padded_tensor")]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_padded_batch_holds_each_image_at_its_corner_and_zeros_beyond():
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in ((4, 7), (6, 3), (2, 2))]
    x = idt.padded(images, torch.float16)
    assert x.shape == (3, 3, 6, 7) and x.dtype == torch.float16
    for im, xi in zip(images, x):
        assert torch.equal(xi[:, :im.shape[1], :im.shape[2]], im.half())
        assert xi.double().sum() == im.double().sum()                     # nothing else in it
    nested = torch.nested.nested_tensor(images).to(torch.float16).to_padded_tensor(0.0)
    assert torch.equal(nested, x)


def test_validation_decodes_on_the_gpu_when_training_does_and_sees_what_the_cpu_decoder_sees(store):
    """--decoder gpu: validation's images come from nvJPEG (no worker process started), cropped and resized on the
    device, rectangular ones too; within JPEG's and the filters' rounding of the CPU decoder's (PIL's resize)."""
    s = ims.open_store(store)
    for crop in (0.875, 0.0):
        val = idt.ValidationSettings(res=24, crop=crop)
        cpu = idt.rank_data(s, torch.device("cpu"))
        want = list(idt.val_batches(cpu, val, 5, device=torch.device("cpu")))
        with StandIn() as gpu:
            data = idt.rank_data(s, torch.device("cuda"), decoder="gpu")
            got = list(idt.val_batches(data, val, 5, device=torch.device("cuda")))
            assert all(x.device.type == "cuda" for x, _ in got) and data.pool is None
        assert sum(1 for c in gpu.calls if c[0] == "nvjpeg") == len(want)
        for (x, y), (wx, wy) in zip(got, want):
            assert x.shape == wx.shape and torch.equal(y, wy)
            assert (x - wx).abs().mean() < 4, (crop, (x - wx).abs().mean())


def test_a_record_the_gpu_decoder_refuses_is_named_in_one_line(store, tmp_path):
    """A damaged validation record decoded by nvJPEG (the stand-in's: torchvision's decode on the host): nvJPEG's
    error on the batch becomes the line naming the record that PIL cannot decode either; the others decode."""
    bad = damaged_copy(store, tmp_path / "bad", "val", [6])
    s = ims.open_store(bad)
    with StandIn():
        data = idt.rank_data(s, torch.device("cuda"), decoder="gpu")
        with pytest.raises(D.DataError) as e:
            list(idt.val_batches(data, idt.ValidationSettings(res=24), 4, device=torch.device("cuda")))
    assert re.fullmatch(rf"{re.escape(str(bad / 'val.store'))}: record 6 \(a val image of class "
                        rf"{s.index['classes'][s.val.labels[6]]}\) cannot be decoded \(RuntimeError: .+\); the store "
                        r"is damaged: prepare it again", str(e.value)), str(e.value)
    assert [r for r in range(len(s.val)) if not idec.pil_decodes(s.val.record(r))] == [6]


def test_the_default_workers_leave_a_core_to_the_training_thread_and_one_to_the_reader(monkeypatch):
    for cores, processes, workers in ((16, 1, 14), (16, 8, 1), (4, 1, 2), (2, 1, 1), (1, 1, 1), (64, 4, 14)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert imagenet_workers.default_workers(processes) == workers


def decode_first_batch(data):
    rows = data.train_rows[:4]
    boxes = np.array([[0, 0, 10, 10]] * 4)
    (x, _), = idt.cpu_batches(data, "train", [(rows, boxes, (8, 8), (np.zeros(4),))], device=torch.device("cpu"))
    return x.clone()


def test_the_decoding_workers_are_forked_before_cuda_starts_and_spawned_after(store, monkeypatch):
    s = ims.open_store(store)
    forked = idt.rank_data(s, torch.device("cpu"), workers=1)
    want = decode_first_batch(forked)
    assert forked.pool._mp_context.get_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    spawned = idt.rank_data(s, torch.device("cpu"), workers=1)
    assert torch.equal(decode_first_batch(spawned), want)           # the store opened from its folder
    assert spawned.pool._mp_context.get_start_method() == "spawn"
    for data in (forked, spawned):
        data.pool.shutdown()


def test_each_epoch_is_drawn_ahead_in_a_thread_while_the_epoch_before_trains_and_draws_what_it_drew_before(
        store, monkeypatch):
    """The epochs' orders and crop boxes are those drawn in turn, at each epoch's start, from the run's seeds (as
    before they were drawn ahead); epoch e + 1's are drawn in the "draws" thread while epoch e trains (its draw
    waits for epoch e's training to start, and epoch e's training waits, at its end, for the draw to have run)."""
    r = inf.recipe("tiny", epochs=3, batch_size=8, width=4, min_res=16, max_res=16, val_res=16)
    data = idt.rank_data(ims.open_store(store), torch.device("cpu"))
    started, ended, drawn = ([threading.Event() for _ in range(3)] for _ in range(3))
    seen = []
    real_draw, real_train = inf.draw_epoch, inf.train_epoch

    def draw(data, augment, generator, *, order, epoch_seed):
        e = epoch_seed[1]
        if e > 0:
            assert started[e - 1].wait(30)
        during = e > 0 and started[e - 1].is_set() and not ended[e - 1].is_set()     # epoch e - 1 trains
        seen.append((e, threading.current_thread().name, during))
        out = real_draw(data, augment, generator, order=order, epoch_seed=epoch_seed)
        seen[-1] += (out.perm.copy(), out.boxes.copy())
        drawn[e].set()
        return out

    def train(r, run, data, p, **kwargs):
        started[p.epoch].set()
        out = real_train(r, run, data, p, **kwargs)
        if p.epoch + 1 < 3:
            assert drawn[p.epoch + 1].wait(30)      # the next epoch was drawn while this one trained
        ended[p.epoch].set()
        return out
    monkeypatch.setattr(inf, "draw_epoch", draw)
    monkeypatch.setattr(inf, "train_epoch", train)
    inf.train_run(r, data, inf.Options(eval_every=0), ctx=D.Context(), seed=3)
    assert [e for e, *_ in seen] == [0, 1, 2]
    assert all(thread.startswith("draws") for _, thread, *_ in seen)
    assert [during for _, _, during, *_ in seen] == [False, True, True]
    seeds = training.run_seeds(3)
    order, augment = (torch.Generator().manual_seed(seeds[k]) for k in ("order", "augment"))
    for p, (_, _, _, perm, boxes) in zip(inf.epoch_plans(r, 1, data.per_epoch()), seen):
        want = real_draw(data, p.augment, augment, order=order, epoch_seed=[seeds["shares"], p.epoch])
        assert np.array_equal(perm, want.perm) and np.array_equal(boxes, want.boxes)


def test_the_epoch_line_says_which_of_nvjpegs_paths_decoded_the_images(store, tmp_path, capsys):
    """Under the stand-in (the CPU's decode in nvJPEG's place: its software path), every training image of an epoch
    counted as software-decoded, in the table and the JSON; a CPU-decoded run says "cpu"."""
    out = tmp_path / "r.json"
    with StandIn():
        assert inf.main(["train", "--store", str(store), *TINY, "--decoder", "gpu", "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.split()[:2] == ["epoch", "res"])
    assert table[header].split()[-1] == "decode" and [line.split()[-1] for line in table[header + 1:header + 3]] == \
        ["0h/48s", "0h/48s"]
    assert [row["decode"] for row in __import__("json").loads(out.read_text())["runs"][0]["rows"]] == ["0h/48s"] * 2


def baseline_and_progressive(subsampling):
    im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    out = []
    for progressive in (False, True):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90, progressive=progressive, subsampling=subsampling)
        out.append(np.frombuffer(buf.getvalue(), np.uint8))
    grey = io.BytesIO()
    im.convert("L").save(grey, "JPEG", quality=90)
    return out + [np.frombuffer(grey.getvalue(), np.uint8)]


@pytest.mark.parametrize("subsampling, luma", [(0, (1, 1)), (1, (2, 1)), (2, (2, 2))])
def test_nvjpegs_paths_are_counted_from_each_jpegs_frame_header(subsampling, luma, monkeypatch):
    """Baseline JPEGs (4:4:4, 4:2:2, 4:2:0, grey) go to the hardware decoder where the device has one, progressive
    ones to the software path; where the hardware cannot be asked, the baseline ones are "unknown"."""
    baseline, progressive, grey = baseline_and_progressive(subsampling)
    assert idec.jpeg_frame(baseline) == (0xC0, 8, [luma, (1, 1), (1, 1)])
    assert idec.jpeg_frame(progressive)[0] == 0xC2 and idec.jpeg_frame(grey) == (0xC0, 8, [(1, 1)])
    assert idec.jpeg_frame(np.frombuffer(b"\xff\xd8not a jpeg", np.uint8)) is None
    records = [baseline, progressive, grey, baseline]
    for hardware, want in ((True, dict(hardware=3, software=1, unknown=0)),
                           (False, dict(hardware=0, software=4, unknown=0)),
                           (None, dict(hardware=0, software=1, unknown=3))):
        monkeypatch.setattr(idec, "nvjpeg_hardware", lambda device, h=hardware: h)
        counts = idec.nvjpeg_paths(records, "cuda")
        assert counts == want
        assert idec.decoded_by_text(counts) == {True: "3h/1s", False: "0h/4s", None: "3?/1s"}[hardware]
    assert idec.decoded_by_text({"cpu": 5}) == "cpu" and idec.decoded_by_text({"nvimgcodec": 5}) == "nvimgcodec"
    assert idec.decoded_by_text({}) == "-"


def fp16_update(scaler, *, step=None):
    """The change a step in fp16 autocast (CPU) makes to a linear layer's weights at lr 1, with or without a
    GradScaler (or by `step`, CIFAR's training.train_step), and float32's: the layer's outputs pass through a fixed
    x 1e-4, so that the mean loss of a batch of 512 sends them gradients near 1e-7 (a few of fp16's subnormal steps
    of 2^-24)."""
    torch.manual_seed(0)
    x, y = torch.randn(512, 64), torch.randint(0, 4, (512,))
    first, shrink = torch.nn.Linear(64, 4), torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    torch.nn.init.zeros_(first.weight)          # the update is then the gradient itself, not rounded into a weight
    shrink.weight.copy_(1e-4 * torch.eye(4))
    out = []
    for dtype, s in ((torch.float32, None), (torch.float16, scaler)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 4), shrink)
        model[0].load_state_dict(first.state_dict())
        opt = torch.optim.SGD(model[0].parameters(), lr=1.0)
        if step is None:
            inf.accumulated_step(model, opt, [(x, y)], ctx=D.Context(), label_smoothing=0.0, dtype=dtype, scaler=s)
        else:
            step(model, [opt], x, y, label_smoothing=0.0, dtype=dtype)
        out.append(model[0].weight.detach().clone())
    return out


def test_imagenet_steps_in_fp16_through_a_grad_scaler_that_keeps_the_mean_losss_small_gradients():
    """fp16's mean-loss gradients near 1e-7 round to a few subnormal steps of 2^-24; scaled by the GradScaler
    (imagenet_fast.loss_scaler, fp16 alone) they keep float32's update to 1% (unscaled: 18% off, as measured here)."""
    assert inf.loss_scaler("cpu", torch.bfloat16) is None and inf.loss_scaler("cpu", torch.float32) is None
    want, unscaled = fp16_update(None)
    _, scaled = fp16_update(inf.loss_scaler("cpu", torch.float16))
    top = want.abs().max()
    assert (scaled - want).abs().max() < 0.01 * top < 0.1 * top < (unscaled - want).abs().max()


def test_an_fp16_run_saves_its_loss_scale_with_the_optimiser_and_resumes_exactly(store, tmp_path):
    r = inf.recipe("tiny", epochs=2, batch_size=8, width=4, min_res=16, max_res=16, val_res=16)
    data = idt.rank_data(ims.open_store(store), torch.device("cpu"))
    o = inf.Options(eval_every=0, precision="fp16")
    inf.train_run(r, data, inf.replace(o, checkpoint=str(tmp_path / "a.pt")), ctx=D.Context(), seed=0)
    with pytest.raises(SystemExit):
        inf.train_run(r, data, inf.replace(o, checkpoint=str(tmp_path / "b.pt"), interrupt_after=1),
                      ctx=D.Context(), seed=0)
    inf.train_run(r, data, inf.replace(o, checkpoint=str(tmp_path / "b.pt"), resume=True), ctx=D.Context(), seed=0)
    a, b = (torch.load(tmp_path / f"{k}.pt", weights_only=False) for k in "ab")
    assert a["optimizers"][1]["scale"] == b["optimizers"][1]["scale"] > 1            # the GradScaler's state
    assert a["optimizers"][1]["_growth_tracker"] == b["optimizers"][1]["_growth_tracker"] > 0
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_cifars_summed_loss_keeps_those_gradients_in_fp16_without_a_scaler():
    """CIFAR-10 steps on the batch's summed loss (training.train_step), 512 times the mean's gradients: the same layer
    in fp16 without a scaler keeps float32's update to 1%, which is why CIFAR's fp16 takes none (as airbench's)."""
    want, got = fp16_update(None, step=training.train_step)
    assert (got - want).abs().max() < 0.01 * want.abs().max()


def test_the_gradient_count_gives_the_shares_below_fp16s_normal_and_subnormal_range(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp16_gradients
    g = [torch.tensor([2.0 ** -30, 2.0 ** -20, 0.0]), torch.tensor([[1.0, -2.0 ** -15]])]
    shares = fp16_gradients.below(g)
    assert shares["n"] == 4 and shares["<2^-14"] == 0.75 and shares["<2^-24"] == 0.25
    assert shares["mass <2^-24"] == pytest.approx(2.0 ** -30 / (2.0 ** -30 + 2.0 ** -20 + 1 + 2.0 ** -15))
    assert fp16_gradients.below(g, 2.0 ** -10)["<2^-24"] == 0.75        # all but the 1, now 2^-10
    for argv, message in ((["--steps", "a,1"], "error: --steps a,1: must be whole numbers, comma-separated"),
                          (["--batch-size", "0"], "error: --batch-size 0: must be positive"),
                          (["--steps", "-1"], "error: --steps -1: must be at least 0")):
        with pytest.raises(SystemExit):
            fp16_gradients.main(["--data", "x.npz", *argv])
        assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert fp16_gradients.main(["--data", str(tmp_path / "none.npz")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'none.npz'}: not a readable .npz")
