"""--decoder nvimgcodec on the CPU: NVIDIA's nvImageCodec cannot run here (no GPU, and it is not installed), so a fake
module with its Python API's shape (CodeStream, Region, sub-code streams, DecodeParams, Decoder.decode with a CUDA
stream) decodes with the CPU's libjpeg, under the stand-in for CUDA (tests/cuda_standin.py). What is checked: the
choice and its one-line errors, and that the batches are those of torchvision's nvJPEG path, in our order, with our
crop boxes decoded alone, in the reader thread on the drained side stream."""
import io
import sys
import threading
import warnings
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

import cuda_standin
import imagenet_data as idt
import imagenet_decoders as idec
import imagenet_fast as inf
import imagenet_store as ims
from conftest import small_jpeg_store
from cuda_standin import StandIn

PACKAGE = f"nvidia-nvimgcodec-cu{torch.version.cuda.split('.')[0] if torch.version.cuda else 12}"


class FakeNvImgCodec(ModuleType):
    """nvidia.nvimgcodec's calls as this project makes them; each decode is recorded (its sources' regions, its CUDA
    stream, its thread) and its images are put on the stand-in's GPU."""

    class ColorSpec:
        RGB = "rgb"

    class CodeStream:
        def __init__(self, data):
            self.data, self.region = np.asarray(data), None

        def get_sub_code_stream(self, region):
            sub = FakeNvImgCodec.CodeStream(self.data)
            sub.region = region
            return sub

    class Region:
        def __init__(self, start_y, start_x, end_y, end_x):
            self.start, self.end = (start_y, start_x), (end_y, end_x)

    class Decoder:
        def __init__(self, device_id):
            self.device_id = device_id

        def decode(self, sources, params, cuda_stream):
            return sys.modules["nvidia.nvimgcodec"].decoded(self.device_id, sources, params, cuda_stream)

    def __init__(self, gpu, *, fail_at=None):
        super().__init__("nvidia.nvimgcodec")
        self.gpu, self.fail_at, self.decodes = gpu, fail_at, []

    @staticmethod
    def DecodeParams(color_spec):
        return SimpleNamespace(color_spec=color_spec)

    def decoded(self, device_id, sources, params, cuda_stream):
        assert params.color_spec == "rgb"
        self.decodes.append({"stream": cuda_stream, "thread": threading.current_thread().name,
                             "regions": [(*s.region.start, *s.region.end) if s.region else None for s in sources]})
        self.gpu.log("nvimgcodec", cuda_stream)
        images = []
        for k, s in enumerate(sources):
            with warnings.catch_warnings():          # torchvision's decoders are deprecated for TorchCodec's
                warnings.simplefilter("ignore", DeprecationWarning)
                hwc = decode_jpeg(torch.from_numpy(s.data), mode=ImageReadMode.RGB).permute(1, 2, 0)
            if s.region:
                (y0, x0), (y1, x1) = s.region.start, s.region.end
                hwc = hwc[y0:y1, x0:x1]
            image = SimpleNamespace(tensor=self.gpu.tag(hwc.contiguous(), device_id))
            images.append(None if k == self.fail_at else image)
        return images


class OnGpu:
    """torch.from_dlpack's tensor of a fake image: a stand-in GPU tensor whose views stay on the GPU, though made in
    the reader thread (the stand-in watches the main thread's operations alone)."""

    def __init__(self, tensor, gpu):
        self.tensor, self.gpu = tensor, gpu

    def permute(self, *dims):
        return self.gpu.tag(self.tensor.permute(*dims), self.gpu.on[self.tensor])


@pytest.fixture
def fake(monkeypatch):
    """Installs a FakeNvImgCodec for a stand-in GPU (the StandIn is returned with it)."""
    gpu = StandIn()
    module = FakeNvImgCodec(gpu)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", module)
    monkeypatch.setattr(idec, "NVIMGCODEC", {})
    monkeypatch.setattr(torch, "from_dlpack", lambda image: OnGpu(image.tensor, gpu))
    monkeypatch.setattr(cuda_standin.Stream, "cuda_stream", property(lambda s: 1000 + s.id), raising=False)
    return gpu, module


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_jpeg_store(tmp_path_factory)


def test_nvimgcodec_is_chosen_by_name_on_a_cuda_device(fake):
    assert idec.jpeg_decoder("cuda", "nvimgcodec") == "nvimgcodec" == idec.jpeg_decoder("cuda:1", "nvimgcodec")
    assert idec.decodes_crops("nvimgcodec") and not idec.decodes_crops("gpu")
    with pytest.raises(ValueError) as e:
        idec.jpeg_decoder("cpu", "nvimgcodec")
    assert str(e.value) == "--decoder nvimgcodec needs a CUDA device (nvImageCodec); this run is on cpu"


def test_without_nvimgcodec_the_choice_is_one_line_naming_the_pip_package(monkeypatch, store, capsys):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)          # import fails, as where it is not installed
    with pytest.raises(ValueError) as e:
        idec.jpeg_decoder("cuda", "nvimgcodec")
    assert str(e.value) == f"--decoder nvimgcodec needs nvImageCodec: pip install {PACKAGE}"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert idec.nvimgcodec_package() == "nvidia-nvimgcodec-cu12"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with StandIn():
        rc = inf.main(["train", "--store", str(store), "--recipe", "tiny", "--decoder", "nvimgcodec"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: --decoder nvimgcodec needs nvImageCodec: pip install nvidia-nvimgcodec-cu13"


def epoch(store, decoder, *, batch_size=8):
    """One epoch's training batches (x, y) of a tiny recipe with jitter off, on the stand-in's GPU, and their draws."""
    data = idt.rank_data(ims.open_store(store), torch.device("cuda"), decoder=decoder)
    r = inf.recipe("tiny", batch_size=batch_size)
    draws = idt.draw_epoch(data, r.augment, torch.Generator().manual_seed(0))
    batches = [(x.float().clone(), y.clone()) for x, y in idt.train_batches(
        data, r.augment, draws, res=24, batch_size=batch_size, device=torch.device("cuda"), dtype=torch.float32)]
    return batches, draws, data


def test_nvimgcodec_decodes_our_crop_boxes_in_our_order_into_the_batches_nvjpeg_makes(fake, store):
    """The same epoch through torchvision's nvJPEG (whole images, cropped after) and nvImageCodec (each image's crop
    box alone): the same batches, bit for bit. nvImageCodec is called once a batch, in the reader thread, on the
    side stream (drained first), with each image's box as its region in the epoch's order."""
    gpu, module = fake
    with gpu:
        want, _, _ = epoch(store, "gpu")
        calls = len(gpu.calls)
        got, draws, data = epoch(store, "nvimgcodec")
    assert len(got) == len(want) == len(data.train_rows) // 8
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(module.decodes) == len(got)
    boxes = draws.boxes[draws.perm[:len(got) * 8]]
    regions = [(t, left, t + h, left + w) for t, left, h, w in boxes.tolist()]
    assert [r for d in module.decodes for r in d["regions"]] == regions
    assert all(d["thread"].startswith("nvjpeg") for d in module.decodes)
    side = [c[1] for c in gpu.calls[calls:] if c[0] == "enter_stream"][0]
    assert {d["stream"] for d in module.decodes} == {side.cuda_stream} and not side.default
    reader = [c for c, t in zip(gpu.calls[calls:], gpu.threads[calls:]) if t.startswith("nvjpeg")]
    assert reader[:4] == [("host_wait", side), ("enter_stream", side), ("nvimgcodec", side.cuda_stream),
                          ("exit_stream", side)]
    assert idec.NVIMGCODEC[0].held and len(idec.NVIMGCODEC[0].held) == 8      # the last batch, kept


def test_an_image_nvimgcodec_cannot_decode_is_one_line(fake):
    gpu, module = fake
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    record = np.frombuffer(buf.getvalue(), np.uint8).copy()
    module.fail_at = 2
    with gpu:
        with pytest.raises(RuntimeError) as e:
            idec.decode_jpeg([record] * 4, torch.device("cuda"), decoder="nvimgcodec")
    assert str(e.value) == "nvImageCodec could not decode 1 of the batch's 4 JPEGs (the first at position 2)"


def test_imagenet_fast_places_the_store_for_nvimgcodec_and_says_so(fake, store, monkeypatch, capsys):
    """The command line's choice reaches the placed data and the run's first line (the batches it then trains on
    are the test above's; the warm-up and the runs are left out here)."""
    gpu, module = fake
    placed = []
    monkeypatch.setattr(inf, "warmup", lambda *a, **k: None)
    monkeypatch.setattr(inf, "train_runs", lambda args, r, data, **k: placed.append(data) or 0)
    with gpu:
        assert inf.main(["train", "--store", str(store), "--recipe", "tiny", "--decoder", "nvimgcodec"]) == 0
    assert [d.decoder for d in placed] == ["nvimgcodec"]
    assert "jpeg store, decoded on the GPU (nvImageCodec)" in capsys.readouterr().out
