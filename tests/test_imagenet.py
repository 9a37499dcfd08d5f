"""imagenet_fast.py on a small generated ImageFolder: preparation (corrupt files, empty classes,
resumption, bad input), batched augmentation statistics, models, schedules, learning, exact resume."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms

import distributed as D
import imagenet_data as idt
import imagenet_decoders as idec
import imagenet_fast as inf
import imagenet_models
import imagenet_store as ims
import imagenet_workers
import optim
import schedules
from conftest import ROOT, ctrl_c_heard, failing_on_call, host_refusal
from imagefolders import synthetic_imagefolder
from test_distributed import damage_tensors
from settings import changed

SIZE = 24
CLASSES = 4  # + one empty class folder, c004


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny networks gain nothing from a second thread, and on a shared 2-core machine a
    descheduled thread stalls every op at its barrier (runs were 10x slower); one thread also
    fixes the float reduction order, which the exact-resume test needs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_cli(*args, script="imagenet_fast.py"):
    """As a user runs it, in a subprocess (slow: imports torch)."""
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_main(capsys, *args):
    """The same command line in this process: (exit status, stdout, stderr)."""
    try:
        rc = inf.main([str(a) for a in args])
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def make_folder(root):
    """4 learnable classes, a truncated JPEG and a non-image .JPEG, and an empty class folder."""
    src = synthetic_imagefolder(root, CLASSES, train_per_class=24, val_per_class=8, sizes=(20, 40))
    good = (src / "train/c001/00000.JPEG").read_bytes()
    (src / "train/c001/truncated.JPEG").write_bytes(good[:len(good) // 2])
    (src / "val/c002/text.JPEG").write_text("not an image")
    (src / "train/c004").mkdir()
    return src


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("in") / "src")


RAW = ims.StoreSettings(format="raw", size=SIZE)


@pytest.fixture(scope="module")
def store(folder, tmp_path_factory):
    """The JPEG store (prepare's default settings)."""
    dst = tmp_path_factory.mktemp("store") / "store"
    ims.prepare(folder, dst, workers=2, shard_size=40, log=lambda s: None)
    return dst


@pytest.fixture(scope="module")
def raw_store(folder, tmp_path_factory):
    dst = tmp_path_factory.mktemp("raw") / "store"
    ims.prepare(folder, dst, RAW, workers=2, shard_size=40, log=lambda s: None)
    return dst


# --- prepare ---------------------------------------------------------------------------------

def test_store_contents(folder, store, raw_store):
    for path in (store, raw_store):
        index = json.loads((path / "index.json").read_text())
        assert index["classes"] == ["c000", "c001", "c002", "c003", "c004"]
        assert index["train"]["per_class"] == [24, 24, 24, 24, 0] and index["train"]["count"] == 96
        assert index["val"]["per_class"] == [8, 8, 8, 8, 0] and index["val"]["count"] == 32
        assert index["train"]["empty_classes"] == ["c004"] and index["val"]["empty_classes"] == ["c004"]
        assert index["train"]["skipped"] == 1 and index["val"]["skipped"] == 1
        p, reason = index["train"]["skipped_files"][0]
        assert p.endswith("train/c001/truncated.JPEG") and reason == "OSError: Truncated File Read"
        p, reason = index["val"]["skipped_files"][0]
        assert p.endswith("val/c002/text.JPEG") and "cannot identify image file" in reason
        assert sorted(f.name for f in path.iterdir()) == ["index.json", "train.store", "val.store"]  # nothing left over
    sources = sorted((folder / "train").glob("*/0*.JPEG"))
    s = ims.open_store(store)
    assert s.format == "jpeg" and np.bincount(s.train.labels, minlength=5).tolist() == [24, 24, 24, 24, 0]
    # small baseline JPEGs are kept as they are: their own bytes, their own shape
    for i in (0, 50, 95):
        assert s.train.record(i).tobytes() == sources[i].read_bytes()
        with Image.open(sources[i]) as im:
            assert (s.train.rows["width"][i], s.train.rows["height"][i]) == im.size
    r = ims.open_store(raw_store)
    assert r.format == "raw" and r.train_pixels().shape == (96, SIZE, SIZE, 3)
    # the index keeps each image's true shape at shorter side SIZE: its aspect survives the square
    for i in (0, 50, 95):
        with Image.open(sources[i]) as im:
            w, h = im.size
        rh, rw = r.train.rows["height"][i], r.train.rows["width"][i]
        assert min(rh, rw) == SIZE and abs(rw / rh - w / h) <= 1 / SIZE * max(w / h, h / w)
    # raw validation keeps the aspect ratio: shorter side SIZE, longer side within one rounding step
    src_aspects = sorted(max(im.size) / min(im.size) for im in map(Image.open, (folder / "val").glob("*/0*.JPEG")))
    shapes = np.stack([r.val.rows["height"], r.val.rows["width"]], 1)
    assert shapes.min(1).tolist() == [SIZE] * 32 and (r.val.rows["nbytes"] == shapes.prod(1) * 3).all()
    aspects = sorted(shapes.max(1) / SIZE)
    assert np.abs(np.array(aspects) - np.array(src_aspects)).max() <= (SIZE // 8) / SIZE / 2 + 1e-9
    # the pixels are the images': class colours survive (mean colour of stored vs source image)
    src0 = np.asarray(Image.open(folder / "train/c000/00000.JPEG").convert("RGB"), dtype=float)
    assert np.abs(r.train_pixels()[0].reshape(-1, 3).mean(0) - src0.reshape(-1, 3).mean(0)).max() < 12


def test_a_landscape_validation_image_is_stored_wider_than_tall_and_as_pil_resizes_it(tmp_path):
    src = synthetic_imagefolder(tmp_path / "src", 2, 1, 1)         # 2 classes: prepare refuses one
    for old in (src / "val").glob("*/*"):
        old.unlink()
    y, x = np.mgrid[0:300, 0:400]
    smooth = np.stack([x * 255 / 400, y * 255 / 300, (x + y) * 255 / 700], -1).astype(np.uint8)
    Image.fromarray(smooth).save(src / "val/c000/landscape.JPEG", quality=95)         # 400 wide, 300 tall
    ims.prepare(src, tmp_path / "store", RAW, workers=1, log=lambda s: None)
    s = ims.open_store(tmp_path / "store")
    (h, w), = zip(s.val.rows["height"], s.val.rows["width"])
    assert h == SIZE and w > h                                  # wider than tall, as the photo is
    stored = np.asarray(s.val.record(0)).reshape(h, w, 3).astype(float)
    scale = max(w / 400, h / 300)                               # the centre crop of the photo with the stored aspect
    box = ((400 - w / scale) / 2, (300 - h / scale) / 2, (400 + w / scale) / 2, (300 + h / scale) / 2)
    with Image.open(src / "val/c000/landscape.JPEG") as im:
        direct = np.asarray(im.convert("RGB").resize((w, h), Image.BILINEAR, box=box), dtype=float)
    assert np.abs(stored - direct).mean() < 3


def mixed_folder(root, side=320):
    """An ImageFolder of 4:3, 3:4 and square photos (smooth gradients with a class colour), 2 classes."""
    rng = np.random.default_rng(0)
    for split, per in (("train", 6), ("val", 3)):
        for k in range(2):
            d = root / split / f"c{k}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = ((side, side * 3 // 4), (side * 3 // 4, side), (side, side))[i % 3]
                y, x = np.mgrid[0:h, 0:w]
                im = np.stack([x * 255 / w, y * 255 / h, np.full((h, w), 120.0 * k)], -1)
                im += rng.normal(0, 6, im.shape)
                Image.fromarray(im.clip(0, 255).astype(np.uint8)).save(d / f"{i}.JPEG", quality=95)
    return root


def test_the_jpeg_store_is_smaller_than_the_raw_one_at_the_same_resolution(tmp_path):
    src = mixed_folder(tmp_path / "src")
    side = 240                          # raw at the images' shorter side: the same resolution as the JPEGs
    jpeg = ims.prepare(src, tmp_path / "jpeg", ims.StoreSettings(max_side=320), workers=1, log=lambda s: None)
    raw = ims.prepare(src, tmp_path / "raw", ims.StoreSettings(format="raw", size=side), workers=1, log=lambda s: None)
    for split in ("train", "val"):
        assert jpeg[split]["bytes"] < raw[split]["bytes"] / 2, split
        assert ((tmp_path / "jpeg" / f"{split}.store").stat().st_size
                < (tmp_path / "raw" / f"{split}.store").stat().st_size)
    # images larger than --max-side are re-encoded to fit, keeping their aspect
    small = ims.prepare(src, tmp_path / "small", ims.StoreSettings(max_side=160), workers=1, log=lambda s: None)
    s = ims.open_store(tmp_path / "small")
    assert small["train"]["count"] == 12
    assert sorted({(int(h), int(w)) for h, w in zip(s.train.rows["height"], s.train.rows["width"])}) == \
        [(120, 160), (160, 120), (160, 160)]
    with Image.open(io.BytesIO(s.train.record(0).tobytes())) as im:
        assert im.format == "JPEG" and im.size == (160, 120)


def test_prepare_cli_reports_skips_and_empty_class(folder, tmp_path):
    r = run_cli("prepare", "--src", str(folder), "--dst", str(tmp_path / "s"), "--format", "raw", "--size", "16",
                "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert f"warning: {folder}/train/c004: no images; class 4 (c004) is kept with 0 train images" in r.stderr
    assert f"skipped {folder}/train/c001/truncated.JPEG: OSError: Truncated File Read" in r.stderr
    assert f"skipped {folder}/val/c002/text.JPEG: UnidentifiedImageError" in r.stderr
    assert "train: 96 images stored (0.000 GB of raw), 1 unreadable and skipped, 1 empty classes" in r.stdout
    assert "5 classes, 96 train and 32 val images, raw at size 16, 0.0" in r.stdout
    assert r.stdout.strip().endswith("GB; 2 unreadable files skipped")


def test_prepare_again_is_a_no_op(folder, store, capsys):
    rc, out, _ = run_main(capsys, "prepare", "--src", folder, "--dst", store)
    assert rc == 0 and f"{store}: already prepared (96 train, 32 val images)" in out


def test_prepare_resumes_after_the_last_whole_shard(folder, store, tmp_path):
    dst, logs = tmp_path / "s", []
    assert ims.prepare(folder, dst, workers=1, shard_size=40, max_shards=2, log=logs.append) is None
    assert not (dst / "index.json").exists() and logs[-1].startswith("stopped after --max-shards 2 new shards")
    journal = json.loads((dst / "train.journal.json").read_text())
    assert journal["shards"] == 2 and journal["rows"] == 79 and len(journal["errors"]) == 1     # one unreadable
    with open(dst / "train.store.partial", "ab") as f:     # a shard cut short by a kill: bytes past the journal
        f.write(b"half-written")
    logs.clear()
    ims.prepare(folder, dst, workers=1, shard_size=40, log=logs.append)
    assert logs[0] == "train: 97 images in 3 shards; 2 already written, 1 to encode with 1 workers"
    a, b = ims.open_store(dst), ims.open_store(store)  # the same as the store made in one go, byte for byte
    for split in ("train", "val"):
        assert (dst / f"{split}.store").read_bytes() == (store / f"{split}.store").read_bytes(), split
    assert np.array_equal(a.train.rows, b.train.rows)
    # a partial split made with other settings is not reused
    logs.clear()
    ims.prepare(folder, tmp_path / "t", workers=1, shard_size=40, max_shards=1, log=logs.append)
    ims.prepare(folder, tmp_path / "t", ims.StoreSettings(quality=80), workers=1, shard_size=40, max_shards=1,
                log=logs.append)
    assert logs[-2].startswith("train: 97 images in 3 shards; 0 already written")


def test_bad_input_is_one_line_and_nonzero(folder, store, tmp_path, capsys):
    rc, _, err = run_main(capsys, "prepare", "--dst", tmp_path / "x")
    assert rc == 2 and "the following arguments are required: --src" in err
    cases = [(tmp_path / "nope", f"{tmp_path / 'nope'}: no such folder")]
    (tmp_path / "flat").mkdir()
    cases.append((tmp_path / "flat", f"{tmp_path / 'flat/train'}: no such folder "
                                     f"(expected {tmp_path / 'flat/train'}/<class>/<image>)"))
    (tmp_path / "noclass/train").mkdir(parents=True)
    cases.append((tmp_path / "noclass", f"{tmp_path / 'noclass/train'}: no class folders "
                                        f"(expected {tmp_path / 'noclass/train'}/<class>/<image>)"))
    (tmp_path / "empty/train/a").mkdir(parents=True)
    (tmp_path / "empty/val/a").mkdir(parents=True)
    cases.append((tmp_path / "empty", f"{tmp_path / 'empty/train'}: no images (extensions "))
    synthetic_imagefolder(tmp_path / "noval", 1, 1, 1)
    (tmp_path / "noval/val/c000/00000.JPEG").unlink()
    cases.append((tmp_path / "noval", f"{tmp_path / 'noval/val'}: no images (extensions "))
    synthetic_imagefolder(tmp_path / "extra", 1, 1, 1)
    (tmp_path / "extra/val/zzz").mkdir()
    cases.append((tmp_path / "extra", f"{tmp_path / 'extra/val'}: classes ['zzz'] are not in train/"))
    for src, message in cases:
        rc, _, err = run_main(capsys, "prepare", "--src", src, "--dst", tmp_path / "out")
        assert rc == 1, err
        assert err.strip().splitlines()[-1].startswith(f"error: {message}")
    rc, _, err = run_main(capsys, "prepare", "--src", folder, "--dst", store, "--format", "raw")
    assert rc == 1 and err.strip() == (
        f"error: {store / 'index.json'}: holds another store (--format jpeg from {folder.resolve()}); "
        f"choose another --dst")
    rc, _, err = run_main(capsys, "train", "--store", tmp_path, "--device", "cpu")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"error: {tmp_path}: not a prepared store (no index.json); run `imagenet_fast.py prepare` first")
    rc, _, err = run_main(capsys, "train", "--device", "cpu")
    assert rc == 2 and "error: --store is required" in err
    rc, _, err = run_main(capsys, "train", "--store", store, "--recipe", "nope")
    assert rc == 2 and "unknown recipe 'nope'; choose from rn50_16ep" in err
    rc, _, err = run_main(capsys, "train", "--store", store, "--model", "vgg", "--device", "cpu")
    assert rc == 2 and err.strip() == ("error: argument --model: 'vgg' is not one of resnet_tiny, resnet18, resnet34, "
                                       "resnet50, resnet101")
    rc, _, err = run_main(capsys, "train", "--store", store, "--resume")
    assert rc == 2 and err.strip() == "error: --resume needs --checkpoint"
    rc, _, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--decoder", "gpu")
    assert rc == 2
    assert err.strip().splitlines()[-1] == "error: --decoder gpu needs a CUDA device (nvJPEG); this run is on cpu"
    rc, _, err = run_main(capsys, "train", "--store", store, "--epochs", "two")
    assert rc == 2 and "--epochs: 'two' is not a whole number" in err


# --- augmentation ----------------------------------------------------------------------------

def torchvision_crops(h, w, n, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    torch.manual_seed(0)
    img = torch.zeros(1, h, w)
    return np.array([transforms.RandomResizedCrop.get_params(img, scale, ratio) for _ in range(n)])


def crop_statistics(boxes, h, w):
    top, left, bh, bw = np.asarray(boxes, dtype=float).T
    return {"area": bh * bw / (h * w), "aspect": bw / bh, "cx": (left + bw / 2) / w, "cy": (top + bh / 2) / h}


@pytest.mark.parametrize("h, w", [(375, 500), (500, 375), (400, 400)])
def test_crops_of_the_whole_image_are_distributed_as_torchvisions(h, w):
    """~20,000 random-resized crops of a 4:3, a 3:4 and a square image against torchvision's RandomResizedCrop:
    area, aspect and centre distributions alike (two-sample KS, p > 0.001 each)."""
    from scipy.stats import ks_2samp
    n = 20000
    ours = idt.crop_boxes(torch.full((n,), h), torch.full((n,), w), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                          generator=torch.Generator().manual_seed(1))
    a, b = crop_statistics(ours, h, w), crop_statistics(torchvision_crops(h, w, n), h, w)
    for k in a:
        assert ks_2samp(a[k], b[k]).pvalue > 0.001, (k, ks_2samp(a[k], b[k]))
    top, left, bh, bw = ours.T
    assert (top >= 0).all() and (left >= 0).all() and (top + bh <= h).all() and (left + bw <= w).all()
    assert a["area"].max() > 0.98          # the whole image is within reach, not only its centre square


def test_the_fallback_after_ten_misses_is_torchvisions_centre_crop():
    """A scale no draw can meet (area > the image) leaves torchvision's fallback: the largest centred crop whose
    aspect is clamped into the ratio range."""
    for h, w in ((100, 400), (400, 100), (300, 400)):
        ours = idt.crop_boxes(torch.tensor([h]), torch.tensor([w]), scale=(1.5, 2.0), ratio=(3 / 4, 4 / 3),
                              generator=torch.Generator().manual_seed(0))
        ref = transforms.RandomResizedCrop.get_params(torch.zeros(1, h, w), (1.5, 2.0), (3 / 4, 4 / 3))
        assert ours[0].tolist() == list(ref), (h, w)


def test_a_training_crop_can_come_from_the_sides_of_a_landscape_photo(tmp_path):
    """The store keeps the whole 4:3 photo: crops reach into the strips beside its centre square, and what is decoded
    for such a crop is that part of the photo."""
    src = mixed_folder(tmp_path / "src")
    ims.prepare(src, tmp_path / "store", workers=1, log=lambda s: None)
    s = ims.open_store(tmp_path / "store")
    i = next(k for k in range(len(s.train)) if s.train.rows["width"][k] > s.train.rows["height"][k])
    h, w = int(s.train.rows["height"][i]), int(s.train.rows["width"][i])          # 240 x 320
    boxes = idt.crop_boxes(torch.full((2000,), h), torch.full((2000,), w), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                           generator=torch.Generator().manual_seed(0))
    top, left, bh, bw = boxes.T
    square = ((w - h) / 2, (w + h) / 2)                                             # columns 40..280
    sides = (left < square[0]) | (left + bw > square[1])
    assert sides.float().mean() > 0.5               # most crops hold pixels a centre-square store had thrown away
    edge = (left == 0) & (bw < square[0] + 40)       # a small crop at the left edge, mostly in the side strip
    assert edge.any()
    box = boxes[edge.nonzero()[0, 0]].tolist()
    crop = idec.cpu_crop(s.train.record(i), box=box, shape=(32, 32)).astype(float)
    with Image.open(src / "train/c0/0.JPEG") as im:
        t, left, bh_, bw_ = box
        direct = np.asarray(im.convert("RGB").resize((32, 32), Image.BILINEAR, box=(left, t, left + bw_, t + bh_)),
                            float)
    assert np.abs(crop - direct).mean() < 4
    # the red channel is the column: the crop's colour says which side of the photo it came from
    assert abs(crop[..., 0].mean() - 255 * (box[1] + box[3] / 2) / w) < 10


def test_crop_resize_geometry():
    """A raw store's square holds the whole image stretched: a box in the image's pixels samples the same part."""
    x = torch.zeros(2, 3, 8, 8)
    x[:, 0, :, :4] = 255  # left half red
    x[:, 2, :, 4:] = 255  # right half blue
    x[1] += torch.arange(8.0)  # distinct columns
    def index(box):                    # a batch's index (imagenet_data.batch_index): the images were 40 wide, 30 tall
        rows = torch.zeros(9, 2, dtype=torch.int64)
        rows[idt.TOP:idt.WIDTH + 1] = torch.tensor(box)[:, None]
        rows[idt.IMAGE_H], rows[idt.IMAGE_W] = 30, 40
        return rows
    assert torch.allclose(idt.crop_resize(x, index([0, 0, 30, 40]), 8), x, atol=1e-4)
    out = idt.crop_resize(x, index([0, 0, 30, 20]), 16)                 # the left half of the image
    assert out.shape == (2, 3, 16, 16)
    # bilinear: only the last two output columns (within half an input pixel of the edge) see blue
    assert torch.allclose(out[0, 0, :, :14], torch.full((16, 14), 255.0)) and out[0, 2, :, :14].abs().max() < 1e-4
    assert out[0, 2, :, 15].min() > 0


def test_the_cpu_and_gpu_decoders_crop_alike(store):
    """The GPU path (whole image decoded, crop resized with antialiasing on the device) against the CPU path (PIL,
    DCT-scaled): the same crops, within JPEG's rounding; run here with the CPU's decode standing in for nvJPEG."""
    s = ims.open_store(store)
    rows = np.arange(8)
    h, w = s.train.rows["height"][rows], s.train.rows["width"][rows]
    boxes = idt.crop_boxes(h, w, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3), generator=torch.Generator().manual_seed(0))
    images = idec.decode_jpeg([s.train.record(r) for r in rows], "cpu")
    gpu = idt.crop_resize_images(images, boxes.T.contiguous(), 16)
    cpu = torch.stack([torch.from_numpy(idec.cpu_crop(s.train.record(r), box=b.tolist(), shape=(16, 16)).copy())
                       for r, b in zip(rows, boxes)]).permute(0, 3, 1, 2).float()
    assert (gpu - cpu).abs().mean() < 4


def crop_resize_per_image(images, boxes, res):
    """The GPU decoder's crops as they were made before the batched version: a resize an image, kept as the
    reference."""
    out = []
    for im, (top, left, h, w) in zip(images, boxes):
        out.append(F.interpolate(im[None, :, top:top + h, left:left + w].float(), size=(res, res), mode="bilinear",
                                 antialias=True, align_corners=False))
    return torch.cat(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-3), (torch.float16, 0.5)])
def test_the_batched_crop_and_resize_is_the_per_image_one_within_its_tolerance(dtype, tolerance):
    """Uniform noise (the hardest case for a filter) in images of mixed shapes, random-resized crops from 8% of an
    image to all of it, shrunk and enlarged: every output pixel within `tolerance` grey levels (of 0..255) of the
    per-image resize's. float32: rounding alone; float16 (what a GPU computes it in, devices.resize_dtype): its 11
    bits of the weights and of the pass between the two products."""
    g = torch.Generator().manual_seed(0)
    shapes = [(375, 500), (500, 375), (333, 333), (40, 60), (500, 500), (120, 90)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in shapes]
    boxes = idt.crop_boxes([h for h, _ in shapes], [w for _, w in shapes], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                           generator=g)
    boxes[-1] = torch.tensor([0, 0, 120, 90])                                       # a whole image too
    for res in (32, 160, 224):
        want = crop_resize_per_image(images, boxes.tolist(), res)
        got = idt.crop_resize_images(images, boxes.T.contiguous(), res, dtype=dtype)
        assert got.dtype == torch.float32 and (got - want).abs().max() <= tolerance, (res, (got - want).abs().max())
    box = boxes[:1].T.contiguous()                      # a box filter of the same support is another filter: outside
    box_filtered = F.avg_pool2d(crop_resize_per_image(images[:1], boxes[:1].tolist(), 64), 3, 1, 1)
    assert (idt.crop_resize_images(images[:1], box, 64) - box_filtered).abs().max() > 10 * tolerance


def test_jitter_changes_images_within_range():
    x = torch.rand(16, 3, 8, 8) * 255
    grey = torch.tensor([0.299, 0.587, 0.114])
    factors = 1 + 0.4 * (2 * torch.rand(3, 16, generator=torch.Generator().manual_seed(0)) - 1)
    y = idt.jitter(x, factors, grey)
    assert y.shape == x.shape and y.min() >= 0 and y.max() <= 255 and not torch.allclose(x, y)
    assert torch.allclose(idt.jitter(x, torch.ones(3, 16), grey), x.clamp(0, 255), atol=1e-3)


def test_validation_views_keep_orientation_and_crop_the_centre():
    (top, left, h, w), shape = idt.val_view(375, 500, res=224, crop=0)
    assert shape[1] > shape[0] == 224                                                                   # landscape
    assert h >= 0.95 * 375 and w >= 0.95 * 500 and (top, left) == pytest.approx(((375 - h) / 2, (500 - w) / 2))
    (top, left, h, w), shape = idt.val_view(500, 375, res=224, crop=0)
    assert shape[0] > shape[1] == 224                                                                   # portrait
    box, shape = idt.val_view(375, 500, res=224, crop=0.875)
    assert shape == (224, 224) and box == pytest.approx((375 * 0.0625, 250 - 375 * 0.4375, 328.125, 328.125))


def test_validation_batches_are_one_shape_each(store):
    data = idt.rank_data(ims.open_store(store), torch.device("cpu"))
    for crop in (0.0, 0.875):
        jobs = idt.val_jobs(data, idt.ValidationSettings(res=SIZE, crop=crop), batch_size=5)
        assert sorted(i for pos, _, _, _ in jobs for i in pos) == list(range(32))
        assert all(len(pos) <= 5 for pos, _, _, _ in jobs)
        shapes = [shape for _, _, _, shape in jobs]
        assert shapes == sorted(shapes) and (crop == 0 or set(shapes) == {(SIZE, SIZE)})


# --- models, optimiser, schedules ------------------------------------------------------------

def test_blurpool_models():
    r = inf.recipe("rn50_16ep")
    m = inf.imagenet_network(r, 10)
    blurs = [mod for mod in m.modules() if isinstance(mod, imagenet_models.BlurPool)]
    strided = [mod for mod in m.modules() if isinstance(mod, torch.nn.Conv2d) and max(mod.stride) > 1]
    assert len(strided) == 7 and len(blurs) == 6  # all but the 3-channel stem conv
    assert m(torch.randn(2, 3, 40, 32)).shape == (2, 10)
    const = torch.full((1, 4, 5, 5), 16.0)
    blurred = imagenet_models.BlurPool(4)(const)          # FFCV's: zeros beyond the edge, inside the convolution
    assert torch.equal(blurred[..., 1:-1, 1:-1], const[..., 1:-1, 1:-1])
    assert blurred[0, 0, 0, 0] == 9 and blurred[0, 0, 0, 2] == 12
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))
    seen, x = [], torch.randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    blur = imagenet_models.BlurPool(16)
    with Ops():
        out = blur(x)
    assert seen == ["aten.convolution.default"] and out.is_contiguous(memory_format=torch.channels_last)
    assert not any(isinstance(mod, imagenet_models.BlurPool)
                   for mod in inf.imagenet_network(changed(r, blurpool=False), 10).modules())
    tiny = inf.imagenet_network(inf.recipe("tiny", width=4), 5)
    assert tiny(torch.randn(2, 3, 24, 24)).shape == (2, 5)


def test_no_weight_decay_on_batchnorm_and_bias():
    model = inf.imagenet_network(inf.recipe("rn18_16ep", blurpool=False), 10)
    opt = inf.imagenet_optimizer(model, inf.recipe("rn18_16ep"))
    decayed, free = opt.param_groups
    assert decayed["weight_decay"] == 5e-5 and free["weight_decay"] == 0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].startswith(("conv", "layer", "fc")) and p.ndim > 1 for p in decayed["params"])
    assert {names[id(p)].split(".")[-1] for p in free["params"]} == {"weight", "bias"}
    assert "fc.bias" in {names[id(p)] for p in free["params"]}
    assert "bn1.weight" in {names[id(p)] for p in free["params"]}


def train(r, data, *, seed=0, **options):
    """One run of recipe r on data (a placed store of 5 classes at SIZE px), on the CPU; options as inf.Options takes
    them (target, checkpoint, resume, interrupt_after, ...)."""
    return inf.train_run(r, data, inf.Options(**options), ctx=D.Context(), seed=seed)


def tiny_recipe(**kw):
    return inf.recipe("tiny", **{"width": 8, "epochs": 3, "batch_size": 16, "min_res": SIZE, "max_res": SIZE,
                                 "val_res": SIZE, **kw})


def place(store):
    return idt.rank_data(ims.open_store(store), torch.device("cpu"))


def saved(path):
    return torch.load(path, weights_only=False)


def same_tensors(a, b):
    """Two state dicts (or lists of tensors) hold the same tensors, exactly."""
    pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else list(zip(a, b))
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in pairs)


def test_learns_above_chance(store):
    # Measured from the JPEG store (CPU, one thread, this configuration, seeds 0..4): final top-1 0.969, 1.0,
    # 0.906, 1.0, 1.0 on the 32 validation images. Chance is 0.25 (4 classes in val); we require 0.6 with seed 0.
    torch.manual_seed(0)
    data = place(store)
    r = train(tiny_recipe(epochs=4), data, seed=0, target=0.5)
    assert r["final_top1"] >= 0.6 and r["rows"][-1]["top5"] == 1.0
    assert r["time_to_target"] is not None and r["rows"][-1]["train_loss"] < r["rows"][0]["train_loss"]


@pytest.mark.parametrize("averaging", [dict(ema_momentum=0.9, ema_every=5),
                                       dict(lookahead_momentum=0.9, lookahead_every=5)], ids=["ema", "lookahead"])
def test_resume_after_interrupted_epoch_is_exact(store, tmp_path, monkeypatch, averaging):
    """Stopped inside the last of three epochs and resumed: the weights, their average (the EMA model, or lookahead's
    slow weights, which end the run) and every epoch's accuracy as in the run that was never stopped."""
    data = place(store)
    r = tiny_recipe(**averaging, jitter=0.2)
    full = train(r, data, seed=1, checkpoint=tmp_path / "a.pt")

    real, seen = inf.train_batches, [0]

    def interrupted(*a, **k):
        for batch in real(*a, **k):
            seen[0] += 1
            if seen[0] == 2 * 6 + 3:  # 6 steps per epoch: stop inside the third epoch
                raise KeyboardInterrupt
            yield batch
    monkeypatch.setattr(inf, "train_batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(r, data, seed=1, checkpoint=tmp_path / "b.pt")
    monkeypatch.setattr(inf, "train_batches", real)
    assert saved(tmp_path / "b.pt")["progress"]["epoch"] == 2
    resumed = train(r, data, seed=1, checkpoint=tmp_path / "b.pt", resume=True)
    a, b = saved(tmp_path / "a.pt"), saved(tmp_path / "b.pt")
    assert same_tensors(a["averaging"], b["averaging"])  # the EMA model or the slow weights, exactly
    assert same_tensors(a["model"], b["model"])
    assert [row["top1"] for row in full["rows"]] == [row["top1"] for row in resumed["rows"]]
    with pytest.raises(inf.DataError, match="written with other settings \\(lr\\); cannot resume"):
        train(changed(r, lr=0.1), data, seed=1, checkpoint=tmp_path / "b.pt", resume=True)


def test_train_cli_table_json_and_recipes(store, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, stdout, err = run_main(capsys, "train", "--store", store, "--recipe", "tiny", "--device", "cpu",
                               "--epochs", "2", "--width", "4", "--batch-size", "32", "--min-res", SIZE,
                               "--max-res", SIZE, "--val-res", "32", "--target", "0.3", "--out", out)
    assert rc == 0, err
    assert "warning: no GPU in use" in err
    lines = stdout.splitlines()
    assert lines[1:3] == ["schedule on 1 rank", "   ep   res   batch   lr start     lr end   crop  validation"]
    lr = [schedules.step_lr(inf.recipe("tiny", epochs=2), t, 32) for t in (0, 1, 1 - 1e-9, 2 - 1e-9)]
    assert lines[3:5] == [f"    1    {SIZE}      32 {lr[0]:>10.5g} {lr[2]:>10.5g}   0.35  32 px, whole image",
                          f"    2    {SIZE}      32 {lr[1]:>10.5g} {lr[3]:>10.5g}   0.35  32 px, whole image"]
    assert lines[5].split() == ["epoch", "res", "batch", "lr", "train_loss", "train_acc", "val_loss", "top1", "top5",
                                "epoch_time", "total_time", "decode"]
    rows = [ln.split() for ln in lines[6:8]]
    assert [row[:3] for row in rows] == [["1", str(SIZE), "32"], ["2", str(SIZE), "32"]]
    assert [row[-1] for row in rows] == ["cpu", "cpu"]                 # the CPU's workers decoded every image
    res = json.loads(out.read_text())
    assert res["settings"]["width"] == 4 and res["store_format"] == "jpeg" and res["decoder"] == "cpu"
    assert float(rows[1][7]) == pytest.approx(res["runs"][0]["rows"][1]["top1"], abs=1e-4)
    assert res["runs"][0]["final_top5"] >= res["runs"][0]["final_top1"]
    rc, stdout, _ = run_main(capsys, "train", "--list-recipes")
    # a doc's further lines are indented
    names = [ln.split()[0] for ln in stdout.splitlines()[1:] if not ln.startswith(" ")]
    assert names[:4] == ["rn50_16ep", "rn50_24ep", "rn50_88ep", "rn18_16ep"]


def test_out_is_written_after_every_run_so_a_later_failure_keeps_it(store, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(inf, "train_run", failing_on_call(inf.train_run, 2))
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError):
        run_main(capsys, "train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--epochs", "1", "--width",
                 "4", "--batch-size", "32", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, "--runs", "3",
                 "--out", out)
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0] and res["summary"]["final_top1"]["n"] == 1


def test_running_out_of_memory_is_one_line_that_says_what_is_kept(store, tmp_path, capsys, monkeypatch):
    def refuse_after_an_epoch(*a, on_epoch=None, **k):
        on_epoch and on_epoch({"epoch": 1})         # one epoch done, its checkpoint written, then the refusal
        host_refusal()
    monkeypatch.setattr(inf, "train_run", refuse_after_an_epoch)
    out, ckpt = tmp_path / "r.json", tmp_path / "c.pt"
    rc, _, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--out", out,
                          "--checkpoint", ckpt)
    assert (rc, err.strip().splitlines()[-1]) == (1, (
        f"error: out of memory on cpu (asked for 4.0 EiB more) in epoch 2 of run 1; the checkpoint of epoch 1 is kept "
        f"in {ckpt} (--resume continues from it); no run finished, so nothing was written to {out}; a larger "
        f"--accumulate (micro-batches), a smaller --batch-size or more GPUs need less on each, in a run started afresh "
        f"(a checkpoint resumes only its own settings and ranks)"))
    monkeypatch.setattr(inf, "rank_data", lambda *a, **k: host_refusal())           # inside place_data
    rc, _, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny")
    assert (rc, err.strip().splitlines()[-1]) == (
        1, f"error: out of memory on cpu (asked for 4.0 EiB more) while placing the store; {inf.LESS_MEMORY}")


def children(pid):
    """The pids of pid's child processes (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def left_alive(pids, seconds=10.0):
    """Those of pids still running once they have had `seconds` to end."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_prepare_killed_leaves_no_decoding_worker(tmp_path):
    src = synthetic_imagefolder(tmp_path / "src", 4, 40, 2, sizes=(300, 400))
    proc = subprocess.Popen([sys.executable, str(ROOT / "imagenet_fast.py"), "prepare", "--src", str(src), "--dst",
                             str(tmp_path / "store"), "--workers", "2", "--shard-size", "2"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and len(workers := children(proc.pid)) < 2:     # the pool has started
        time.sleep(0.05)
    assert proc.poll() is None, "prepare finished before its workers could be seen"
    proc.kill()                                                   # SIGKILL: the parent gets no chance to clean up
    proc.wait()
    assert left_alive(workers) == []


def test_imagenet_takes_the_learning_rates_batch_from_lr_scale_base(store, monkeypatch):
    """--lr-scale-base B: lr is per B images of the global batch (256 by default, Goyal et al.'s unit)."""
    assert inf.parse_args(["train", "--store", "S", "--lr-scale-base", "512"])[1] == {"lr_scale_base": 512}
    assert inf.recipe("tiny").schedule.lr_scale_base == 256
    rates, real_step = {256: [], 512: []}, torch.optim.SGD.step
    data = place(store)
    for base, seen in rates.items():
        monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **k: seen.append(self.param_groups[0]["lr"])
                            or real_step(self, *a, **k))
        train(tiny_recipe(epochs=1, lr_scale_base=base), data, seed=0)
    assert rates[256] and rates[256] == pytest.approx([2 * r for r in rates[512]])


@pytest.mark.slow     # a benchmark's printing: the slow tier keeps the default run under 10 minutes
def test_throughput_benchmark_prints_the_loader_per_core_beside_pil(tmp_path):
    r = run_cli("--device", "cpu", "--recipe", "tiny", "--images", "30", "--sizes", "32", "--steps", "2", "--warmup",
                "1", "--batch-size", "8", "--workers", "1", "--count-batch", "2", "--out", str(tmp_path / "t.json"),
                script="benchmarks/imagenet_throughput.py")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "t.json").read_text())
    (row,) = res["rows"]
    assert row["res"] == 32 and all(row[k] > 0 for k in ("loader", "ceiling", "together", "pil/core"))
    assert row["together/ceil"] == pytest.approx(row["together"] / row["ceiling"])
    assert row["loader/core"] == pytest.approx(row["loader"])              # one thread: per core is the whole
    assert res["images"] == 30 and res["decoder"] == "cpu" and res["model"] == "resnet_tiny"
    assert row["decode"] == "cpu" and row["decoded"]["cpu"] >= 2 * (1 + 2) * 8      # loader's and together's batches
    assert "loader/core" in r.stdout and "pil/core" in r.stdout and "jpeg store of 30 images" in r.stdout
    counts = {(c["store"], c["batch"]): c for c in res["counts"]}       # under the stand-in for a GPU, per step
    assert sorted({store for store, _ in counts}) == ["jpeg, decoder cpu", "jpeg, decoder gpu", "raw, on the device",
                                                      "raw, on the host"]
    for store in {store for store, _ in counts}:
        small, large = counts[store, 2], counts[store, 4]
        assert small["data blocking"] == small["step blocking"] == large["step blocking"] == 0, store
        per_image = 2 if store == "jpeg, decoder gpu" else 0    # a view and a copy an image into the padded batch
        assert small["data ops"] + 2 * per_image == large["data ops"], store
        assert small["step ops"] > small["data ops"] > 0, store
    bad = run_cli("--sizes", "a,b", script="benchmarks/imagenet_throughput.py")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --sizes a,b: must be whole numbers, comma-separated"


def test_cpu_loaders_benchmark_measures_every_candidate_and_the_report_shows_them(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_loaders
    import report
    out = tmp_path / "cpu" / "cpu_loaders.json"
    assert cpu_loaders.main(["--images", "12", "--sizes", "32", "--batch-size", "4", "--batches", "2", "--repeats",
                             "1", "--workers", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["method"] for row in r["rows"]] == list(cpu_loaders.METHODS)
    assert all(row["images/s"] > 0 and row["images/s per core"] == row["images/s"] and row["n"] == 8
               for row in r["rows"])
    text = "\n".join(report.t_cpu_loaders(report.load_results(tmp_path)))
    assert "| 32 | `processes_simplejpeg` | 1 |" in text and "--images 12 --sizes 32" in text
    with pytest.raises(SystemExit):
        cpu_loaders.main(["--images", "4", "--batch-size", "4"])          # fewer photos than a measurement reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_streamed_batches_equal_indexed_batches(raw_store):
    data = idt.rank_data(ims.open_store(raw_store), torch.device("cuda"), where="host")
    draws = idt.draw_epoch(data, inf.recipe("tiny").augment, torch.Generator().manual_seed(0))
    order = [draws.perm[i:i + 16] for i in range(0, len(draws.perm) - 15, 16)]
    smalls = [idt.batch_index(data, draws, idx, data.shapes("train")) for idx in order]
    for idx, (x, small) in zip(order, idt.raw_batches(data, smalls, device=torch.device("cuda"))):
        assert torch.equal(x.cpu(), data.pixels[idx]) and np.array_equal(small[0][idt.LABEL].cpu(), data.train_y[idx])


def torchrun(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "imagenet_fast.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.mark.slow     # the default tests resume killed ranks in test_imagenet_ranks and test_two_nodes
def test_two_ranks_resume_after_an_interruption_exactly(store, tmp_path):
    """2 gloo ranks (loopback): one uninterrupted run, and one that stops after epoch 1 and is launched
    again with --resume (what torchrun --max-restarts does on a failure): the same rows and parameters,
    and rank 0 alone prints and writes. (The restart itself is left to the test's second launch:
    torchrun's in-place restart of gloo workers on this machine sometimes failed to reconnect.)"""
    common = ["train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--epochs", "3", "--width", "4",
              "--batch-size", "16", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, "--comm-hook", "fp16"]
    a = torchrun(*common, "--checkpoint", tmp_path / "a.pt", "--out", tmp_path / "a.json")
    assert a.returncode == 0, a.stderr[-3000:]
    assert sum(ln.startswith("final top-1") for ln in a.stdout.splitlines()) == 1
    assert "2 ranks of 8 images per step" in a.stdout
    resumable = [*common, "--checkpoint", tmp_path / "b.pt", "--resume", "--out", tmp_path / "b.json"]
    b = torchrun(*resumable, "--interrupt-after-epoch", "1")
    assert b.returncode != 0 and not (tmp_path / "b.json").exists()
    assert saved(tmp_path / "b.pt")["progress"]["epoch"] == 1
    b = torchrun(*resumable)
    assert b.returncode == 0, b.stderr[-3000:]
    assert b.stdout.count(f"resumed from epoch 1 of {tmp_path / 'b.pt'}") == 1
    ra, rb = (json.loads((tmp_path / f"{n}.json").read_text())["runs"][0]["rows"] for n in "ab")
    assert len(ra) == len(rb) == 3
    for x, y in zip(ra, rb):
        assert (x["train_loss"], x["top1"], x["val_loss"]) == (y["train_loss"], y["top1"], y["val_loss"])
    ca, cb = (saved(tmp_path / f"{n}.pt") for n in "ab")
    assert same_tensors(ca["model"], cb["model"])
    assert len(ca["rng"]) == 2


def test_simulate_subcommand():
    r = run_cli("simulate", "--gpus", "1,8")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:1] in (["1"], ["8"])]
    assert rows and all(row[-1].endswith("%") for row in rows)
    assert any(row[0] == "1" and row[-1] == "100.0%" for row in rows)


def test_batch_size_schedule_grows_the_batch_and_the_rate(store, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, stdout, err = run_main(capsys, "train", "--store", store, "--recipe", "tiny", "--device", "cpu",
                               "--epochs", "3", "--width", "4", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE,
                               "--warmup-epochs", "0", "--schedule", "step", "--step-epochs", "100",
                               "--batch-schedule", "0,16,2,32", "--out", out)
    assert rc == 0, err
    rows = json.loads(out.read_text())["runs"][0]["rows"]
    assert [r["batch"] for r in rows] == [16, 16, 32]
    assert rows[2]["lr"] == pytest.approx(2 * rows[1]["lr"])      # lr per 256 images: twice the batch, twice the rate
    for bad, message in (("0,32,2,16", "must not shrink the batch"), ("0,16,2", "is not (epoch, batch) pairs"),
                         ("1,16", "must start at epoch 0")):
        rc, _, err = run_main(capsys, "train", "--store", store, "--recipe", "tiny", "--device", "cpu",
                              "--batch-schedule", bad)
        assert rc == 2 and message in err.strip().splitlines()[-1]


def test_rmsprop_hand_over_clock_is_the_loops_fractional_epoch(store, monkeypatch):
    """The batch doubles after 2 epochs (6 steps an epoch, then 3): the hand-over's clock is the epoch plus the share
    of its steps done, throughout."""
    seen = []
    real = imagenet_models.alpha_sgd
    monkeypatch.setattr(imagenet_models, "alpha_sgd", lambda epoch, c, p: seen.append(epoch) or real(epoch, c, p))
    data = place(store)
    train(tiny_recipe(rmsprop=True, warmup_epochs=0.0, batch_schedule=(0, 16, 2, 32), width=4), data)
    want = [e + i / 6 for e in (0, 1) for i in range(6)] + [2 + i / 3 for i in range(3)]
    assert seen[::2] == pytest.approx(want)       # two parameter groups a step


def resume_recipe():
    return tiny_recipe(epochs=2, width=4)


def test_resume_restores_random_states_whatever_the_checkpoint_loaded_them_as(store, tmp_path, monkeypatch):
    """A checkpoint loaded onto a GPU holds CUDA tensors, which set_rng_state refuses: the random states are
    restored from CPU bytes whatever form they arrive in (here int64, as another map_location could give)."""
    data = place(store)
    train(resume_recipe(), data, seed=3, checkpoint=tmp_path / "full.pt")
    with pytest.raises(SystemExit):
        train(resume_recipe(), data, seed=3, checkpoint=tmp_path / "c.pt", interrupt_after=1)
    real = D.load_newest_state

    def elsewhere(*args, **kwargs):      # once read and checked against its digest
        state, holder = real(*args, **kwargs)
        state["rng"] = [[t.to(torch.int64) for t in rank] for rank in state["rng"]]
        return state, holder
    monkeypatch.setattr(D, "load_newest_state", elsewhere)
    train(resume_recipe(), data, seed=3, checkpoint=tmp_path / "c.pt", resume=True)
    monkeypatch.undo()
    assert same_tensors(saved(tmp_path / "full.pt")["model"], saved(tmp_path / "c.pt")["model"])


def test_unreadable_checkpoint_is_one_line(store, tmp_path, capsys):
    args = ["train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--epochs", "1", "--width", "4",
            "--warmup-epochs", "0.25", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, "--resume"]
    rc, _, _ = run_main(capsys, *args, "--checkpoint", tmp_path / "good.pt")
    assert rc == 0
    whole = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    for name, why in (("cut.pt", "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
                                  "central directory."), ("junk.pt", "UnpicklingError: Weights only load failed.")):
        rc, out, err = run_main(capsys, *args, "--checkpoint", tmp_path / name)
        lines = err.strip().splitlines()
        assert rc == 1 and len(lines) == 2 and lines[0].startswith("warning: no GPU"), err
        assert lines[1] == f"error: {tmp_path / name}: not a readable checkpoint ({why})"     # whole sentences
    rc, out, _ = run_main(capsys, *args, "--checkpoint", tmp_path / "good.pt", "--epochs", "2")
    assert rc == 1     # other settings: refused, as before
    rc, out, _ = run_main(capsys, *args, "--checkpoint", tmp_path / "good.pt")
    assert rc == 0 and f"resumed from epoch 1 of {tmp_path / 'good.pt'}" in out


def test_a_checkpoint_damaged_in_its_tensors_is_refused_and_one_without_a_digest_resumes_with_a_warning(
        store, tmp_path, capsys):
    """Exponent bits flipped in the two largest tensors: torch loads the file as ever, and without its digest the
    run would resume from other weights without a word; with it, one line and exit status 1. A checkpoint written
    before digests were (the same state, no digest) resumes, and a warning says that damage cannot be found in it."""
    args = ["train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--epochs", "1", "--width", "4",
            "--warmup-epochs", "0.25", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, "--resume"]
    rc, _, _ = run_main(capsys, *args, "--checkpoint", tmp_path / "good.pt")
    assert rc == 0
    shutil.copy(tmp_path / "good.pt", tmp_path / "damaged.pt")
    assert len(damage_tensors(tmp_path / "damaged.pt")) == 2
    assert torch.load(tmp_path / "damaged.pt", weights_only=True)["progress"]["epoch"] == 1     # torch sees nothing
    rc, out, err = run_main(capsys, *args, "--checkpoint", tmp_path / "damaged.pt")
    assert (rc, err.strip().splitlines()[1:]) == (1, [
        f"error: {tmp_path / 'damaged.pt'}: damaged since it was written (its contents' sha256 is not the one "
        "written with it)"]), err
    assert "resumed from" not in out
    state = torch.load(tmp_path / "good.pt", weights_only=True)
    del state[D.DIGEST]
    torch.save(state, tmp_path / "old.pt")
    rc, out, err = run_main(capsys, *args, "--checkpoint", tmp_path / "old.pt")
    assert rc == 0 and f"resumed from epoch 1 of {tmp_path / 'old.pt'}" in out
    assert err.strip().splitlines()[1:] == [
        f"warning: {tmp_path / 'old.pt'}: written without a digest (by an older version), so damage to its contents "
        "cannot be found; used as it is"], err


def damaged_copy(store, dst, split, rows):
    """A copy of the store at dst with the records of `rows` of split overwritten past their first two bytes (a
    JPEG's start-of-image marker): what a failing disk or a bad copy leaves."""
    shutil.copytree(store, dst)
    index = ims.read_rows(dst / f"{split}.store")
    with open(dst / f"{split}.store", "r+b") as f:
        for r in rows:
            f.seek(int(index["offset"][r]) + 2)
            f.write(bytes(min(200, int(index["nbytes"][r]) - 2)))
    return dst


DAMAGED = "cannot be decoded (ValueError: tjDecompressHeader3(): Could not determine subsampling level of JPEG image)"


def test_a_damaged_record_stops_the_run_in_one_line_naming_the_store_and_the_record(store, tmp_path, capsys):
    """A damaged validation record (met once the epoch has trained), then every training record damaged: one line
    naming the store's file and the record, exit status 1, none of the decoding worker's tracebacks."""
    args = ["train", "--recipe", "tiny", "--device", "cpu", "--epochs", "1", "--width", "4", "--warmup-epochs",
            "0.25", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE]
    s = ims.open_store(store)
    bad = damaged_copy(store, tmp_path / "val", "val", [5])
    rc, _, err = run_main(capsys, *args, "--store", bad)
    assert (rc, err.strip().splitlines()[1:]) == (1, [
        f"error: {bad / 'val.store'}: record 5 (a val image of class {s.index['classes'][s.val.labels[5]]}) "
        f"{DAMAGED}; the store is damaged: prepare it again"]), err
    bad = damaged_copy(store, tmp_path / "train", "train", range(len(s.train)))
    rc, _, err = run_main(capsys, *args, "--store", bad)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 2 and "Traceback" not in err, err
    record = re.fullmatch(rf"error: {re.escape(str(bad / 'train.store'))}: record (\d+) \(a train image of class "
                          rf"(c\d+)\) {re.escape(DAMAGED)}; the store is damaged: prepare it again", lines[1])
    assert record and s.index["classes"][s.train.labels[int(record[1])]] == record[2], lines[1]


def test_a_decoding_failure_on_a_record_pil_decodes_is_raised_as_it_is_not_blamed_on_the_store(store, monkeypatch):
    """Only a record that PIL cannot decode either is called damaged: another failure (here a stand-in for a bug in
    the crop's arithmetic) reaches the caller whole, from the decoding worker."""
    def broken(record, **kwargs):
        raise ValueError("a bug, not the data")
    monkeypatch.setattr(imagenet_workers, "cpu_crop", broken)   # before the workers are forked: theirs too
    data = idt.rank_data(ims.open_store(store), torch.device("cpu"), workers=1)
    with pytest.raises(ValueError, match="^a bug, not the data$"):
        list(idt.cpu_batches(data, "train", [(data.train_rows[:2], np.array([[0, 0, 8, 8]] * 2), (8, 8),
                                             (np.zeros(2),))], device=torch.device("cpu")))
    data.pool.shutdown()


def test_a_rank_reads_only_its_share_of_a_raw_store_in_place(raw_store, monkeypatch):
    """Under torchrun, a rank's raw store in host memory stays the memory-mapped file (nothing copied, nothing
    pinned whole), and its batches gather only rows of its share."""
    monkeypatch.setattr(idt, "copy_rows", lambda *a: pytest.fail("copied at placement"))
    s = ims.open_store(raw_store)
    ctx = D.Context(rank=1, world_size=4, distributed=True, is_main=False)
    data = idt.rank_data(s, torch.device("cpu"), ctx=ctx)
    assert np.shares_memory(data.pixels.numpy(), s.train.data) and len(data.train_rows) == 24
    assert data.val_rows.tolist() == list(range(8, 16))
    draws = idt.draw_epoch(data, inf.recipe("tiny").augment, torch.Generator().manual_seed(0))
    shapes = data.shapes("train")
    smalls = [idt.batch_index(data, draws, draws.perm[i:i + 8], shapes) for i in range(0, 24, 8)]
    batches = list(idt.raw_batches(data, smalls, device=torch.device("cpu")))
    rows = data.train_rows[draws.perm]
    assert torch.equal(torch.cat([x for x, _ in batches]), torch.from_numpy(s.train_pixels()[rows]))
    assert torch.equal(torch.cat([small[0][idt.LABEL] for _, small in batches]), torch.from_numpy(s.train.labels[rows]))


def test_a_jpeg_store_deals_each_epoch_new_shares_to_the_ranks_and_a_raw_store_keeps_its_own(store, raw_store):
    """Two ranks of a JPEG store: each epoch's shares are disjoint, hold every image once (but for the remainder that
    keeps the ranks' steps equal), differ from the epoch before, and are drawn again alike from the same seed; a raw
    store's rank holds its share for the run."""
    s, augment = ims.open_store(store), inf.recipe("tiny").augment
    ranks = [idt.rank_data(s, torch.device("cpu"), ctx=D.Context(rank=r, world_size=2, distributed=True))
             for r in range(2)]
    assert [d.shares for d in ranks] == [(0, 2), (1, 2)] and all(len(d.train_rows) == len(s.train) for d in ranks)

    def shares(epoch, seed=7):
        return [set(d.train_rows[idt.draw_epoch(d, augment, torch.Generator().manual_seed(r),
                                                epoch_seed=[seed, epoch]).perm]) for r, d in enumerate(ranks)]
    first, second = shares(0), shares(1)
    for a, b in (first, second):
        assert not a & b and len(a) == len(b) == len(s.train) // 2
    assert first[0] != second[0] and first == shares(0) and first != shares(0, seed=8)
    raw = idt.rank_data(ims.open_store(raw_store), torch.device("cpu"), ctx=D.Context(rank=1, world_size=2,
                                                                                      distributed=True))
    assert raw.shares is None and raw.per_epoch() == len(raw.train_rows) == len(s.train) // 2


def test_one_epoch_learns_from_each_store_format(store, raw_store):
    """The same run from the JPEG and the raw store: both learn (train loss falls, validation above chance)."""
    for path in (store, raw_store):
        r = train(tiny_recipe(epochs=3), place(path), seed=0)
        assert r["rows"][-1]["train_loss"] < r["rows"][0]["train_loss"] and r["final_top1"] > 0.4, path


def test_prepare_benchmark_measures_both_formats_and_the_report_shows_them(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import imagenet_prepare
    import report
    out = tmp_path / "cpu" / "imagenet_prepare.json"
    assert imagenet_prepare.main(["--images", "9", "--repeats", "1", "--workers", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["format"] for row in r["rows"]] == ["jpeg", "raw"] and r["fingerprint"]["device_name"]
    for row in r["rows"]:
        assert row["images"] == 18 and row["images/s"] == pytest.approx(18 / row["seconds"])   # 9 train, 9 val
        assert row["read GB/s"] == pytest.approx(row["source GB"] / row["seconds"])
    text = "\n".join(report.t_prepare(report.load_results(tmp_path)))
    assert "| 9 synthetic photos, longer side 500 px | jpeg | 18 |" in text
    assert "python benchmarks/imagenet_prepare.py --images 9" in text


@pytest.mark.parametrize("opt", [["--lars", "true", "--lars-trust", "0.02"],
                                 ["--rmsprop", "true", "--rmsprop-beta-center", "1", "--rmsprop-beta-period", "2"]])
def test_large_batch_optimisers_learn_from_the_command_line(store, capsys, opt):
    # measured (2-core CPU, this store, seeds 0 and 1): lars, rmsprop_sgd and plain sgd each 1.000 and 1.000 final
    # top-1 after 6 epochs; chance is 0.25
    rc, out, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--epochs", "6",
                            "--batch-size", "16", "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, *opt)
    assert rc == 0, err
    final = [line for line in out.splitlines() if line.startswith("final top-1")][0]
    assert float(final.split()[2].rstrip(",")) >= 0.6


def test_a_dst_that_cannot_be_written_is_one_line_and_leaves_nothing(folder, tmp_path, capsys):
    """An existing file, a read-only folder and a folder below a file: exit 1, one line naming the path and what to
    do, and nothing made there."""
    (tmp_path / "a_file").write_text("x")
    for dst, why in ((tmp_path / "a_file", "is a file, not a folder"),
                     (Path("/sys/imagenet_store"), "cannot write the store there (Operation not permitted)"),
                     (Path("/sys"), "cannot write the store there (Permission denied)"),
                     (tmp_path / "a_file" / "store", "cannot write the store there (Not a directory)")):
        if not Path("/sys").is_dir() and str(dst).startswith("/sys"):
            continue
        rc, out, err = run_main(capsys, "prepare", "--src", folder, "--dst", dst)
        assert rc == 1 and err.strip() == f"error: {dst}: {why}; give --dst a folder you can write in", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and not Path("/sys/imagenet_store").exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_ctrl_c_in_prepare_is_one_line_keeps_the_whole_shards_and_the_same_command_resumes(folder, store, tmp_path):
    src = synthetic_imagefolder(tmp_path / "src", 4, 60, 2, sizes=(200, 300))
    cmd = [sys.executable, str(ROOT / "imagenet_fast.py"), "prepare", "--src", str(src), "--dst", str(tmp_path / "s"),
           "--workers", "2", "--shard-size", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_heard)
    journal = tmp_path / "s" / "train.journal.json"
    while proc.poll() is None and not (journal.is_file() and json.loads(journal.read_text())["shards"] >= 2):
        time.sleep(0.05)
    assert proc.poll() is None, "prepare finished before it could be interrupted"
    workers = children(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert re.fullmatch(rf"interrupted; \d+ whole train shards \(\d+ images\) kept in {tmp_path / 's'}; the same "
                        r"command resumes from there", last), last
    assert left_alive(workers) == []
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already written" in again.stdout, again.stderr[-2000:]
    whole = subprocess.run([*cmd[:6], str(tmp_path / "whole"), *cmd[7:]], cwd=ROOT, capture_output=True, timeout=300)
    assert whole.returncode == 0
    assert (tmp_path / "s" / "train.store").read_bytes() == (tmp_path / "whole" / "train.store").read_bytes()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_prepare_killed_before_its_workers_start_their_watch_leaves_no_worker(tmp_path):
    """The parent's pid is read by the parent: workers that start their watch only after prepare was killed still
    see it gone (reading their parent's pid themselves, they would find their new parent and wait forever)."""
    src = synthetic_imagefolder(tmp_path / "src", 4, 10, 2, sizes=(20, 40))
    script = tmp_path / "slow_workers.py"
    script.write_text(f"""
import concurrent.futures, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
real = concurrent.futures.ProcessPoolExecutor.__init__
def init(self, max_workers=None, mp_context=None, initializer=None, initargs=(), **kwargs):
    parent = os.getpid()
    def late(*args):                     # the worker's own set-up begins only once its parent is gone
        while os.getppid() == parent:
            time.sleep(0.01)
        initializer(*args)
    real(self, max_workers, mp_context, late, initargs, **kwargs)
concurrent.futures.ProcessPoolExecutor.__init__ = init
import imagenet_fast
imagenet_fast.main(["prepare", "--src", {str(src)!r}, "--dst", {str(tmp_path / "store")!r}, "--workers", "2"])
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300                # importing torch on a loaded machine can take a minute or more
    while proc.poll() is None and not children(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)                             # the pool starts its workers as the shards are queued
    workers = children(proc.pid)
    assert proc.poll() is None and workers
    proc.kill()
    proc.wait()
    for _ in range(100):
        if not any(alive(w) for w in workers):
            break
        time.sleep(0.1)
    leftover = [w for w in workers if alive(w)]
    for w in leftover:
        os.kill(w, signal.SIGKILL)
    assert leftover == []


def test_ctrl_c_before_any_run_finished_says_nothing_was_written(store, tmp_path, capsys, monkeypatch):
    def interrupt(*a, on_epoch=None, **k):
        on_epoch and on_epoch({"epoch": 1})         # one epoch done, its checkpoint written, then Ctrl-C
        raise KeyboardInterrupt
    monkeypatch.setattr(inf, "train_run", interrupt)
    out, ckpt = tmp_path / "r.json", tmp_path / "c.pt"
    rc, _, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--out", out)
    assert rc == 130 and err.strip().splitlines()[-1] == (
        f"interrupted in epoch 2 of run 1; no run finished, so nothing was written to {out}")
    assert not out.exists()
    monkeypatch.setattr(inf, "train_run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, _, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny",
                          "--checkpoint", ckpt)
    assert rc == 130 and err.strip().splitlines()[-1] == (
        "interrupted in epoch 1 of run 1; no epoch finished, so no checkpoint was written")


def test_epochs_that_end_inside_the_warm_up_shorten_it_in_proportion_and_say_so(store, capsys):
    rc, out, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--epochs", "1",
                            "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE)
    assert rc == 0 and err.strip().splitlines()[0] == (
        "note: --epochs 1 ends inside the recipe's 1-epoch warm-up, so the warm-up is shortened in proportion to "
        "0.125 epochs (--warmup-epochs sets it)")
    row = out.splitlines()[out.splitlines().index(next(ln for ln in out.splitlines()
                                                       if ln.split()[:1] == ["epoch"])) + 1]
    assert float(row.split()[3]) > 0                           # the epoch's learning rate is no longer 0
    assert inf.recipe("tiny", epochs=1, warmup_epochs=1.0).schedule.warmup_epochs == 1.0       # asked for: kept
    assert not inf.recipe("tiny", epochs=2).notes and not inf.recipe("tiny").notes


def test_a_per_gpu_batch_at_an_unscaled_rate_says_so_before_training(store, capsys):
    """FFCV's recipes train FFCV's batch on each GPU at FFCV's rate whatever the GPUs: a run on other GPUs than
    FFCV's is told what its step and rate are, in one line, before training."""
    rc, out, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--epochs", "2",
                            "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE, "--per-gpu-batch", "true",
                            "--lr-scaling", "none", "--lr", "0.4")
    assert rc == 0 and err.strip().splitlines()[0] == (
        "note: 32 images on each GPU, 32 a step on 1, at lr 0.4 whatever the number of GPUs, as FFCV's "
        "train_imagenet.py trains (--lr-scaling linear scales the rate with the images of a step instead)")
    rc, out, err = run_main(capsys, "train", "--store", store, "--device", "cpu", "--recipe", "tiny", "--epochs", "2",
                            "--min-res", SIZE, "--max-res", SIZE, "--val-res", SIZE)
    assert rc == 0 and "FFCV" not in err


# --- phases, micro-batches and batch norm over a paper's per-GPU groups ----------------------------------------------

def test_a_phase_table_trains_each_epoch_at_its_size_batch_rate_crops_and_validation(store, tmp_path, capsys,
                                                                                     monkeypatch):
    seen = {"crops": [], "val": []}
    real_draw, real_evaluate = inf.draw_epoch, inf.loss_top1_top5
    monkeypatch.setattr(inf, "draw_epoch", lambda data, augment, *a, **k: seen["crops"].append(augment.crop_scale)
                        or real_draw(data, augment, *a, **k))
    monkeypatch.setattr(inf, "loss_top1_top5", lambda model, data, val, **k: seen["val"].append((val.res, val.crop))
                        or real_evaluate(model, data, val, **k))
    table = (0, 1, SIZE, 16, 0.1, 0.3, 0.35, 0, 0,
             1, 2, SIZE + 8, 32, 0.05, 0.05, 0.5, SIZE, 1)
    out = tmp_path / "r.json"
    rc, stdout, err = run_main(capsys, "train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--width", "4",
                               "--val-crop", "0.875", "--lr-scaling", "none", "--phases", ",".join(map(str, table)),
                               "--out", out)
    assert rc == 0, err
    rows = json.loads(out.read_text())["runs"][0]["rows"]
    assert [(row["res"], row["batch"]) for row in rows] == [(SIZE, 16), (SIZE + 8, 32)]
    assert [row["lr"] for row in rows] == pytest.approx([0.1 + 0.2 * 5 / 6, 0.05])      # each epoch's last step
    assert seen["crops"] == [(0.35, 1.0), (0.5, 1.0)]
    assert seen["val"] == [(32, 0.875), (SIZE, 0.0)]          # the recipe's centre crop, then the whole image
    assert f"    2    {SIZE + 8}      32       0.05       0.05    0.5  {SIZE} px, whole image" in stdout.splitlines()


def test_micro_batches_step_as_one_batch_normalised_in_the_same_groups():
    """--accumulate 4: four micro-batches of 16 images, their gradients added, give the parameters of one step on the
    64 images with batch norm over the same groups of 8 (8 workers' batches), to float rounding; the same
    micro-batches normalised whole do not."""
    r = inf.recipe("tiny", width=4, batch_size=64, bn_workers=8)
    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 16, 16), torch.randint(0, 5, (64,))

    def one_step(group, k):
        torch.manual_seed(1)
        model = inf.imagenet_network(r, 5)
        inf.set_ghost_groups(model, group)
        opt = inf.imagenet_optimizer(model, r)
        optim.set_lr([opt], 0.5)
        inf.accumulated_step(model, opt, list(zip(x.chunk(k), y.chunk(k))), ctx=D.Context(), label_smoothing=0.1,
                             dtype=torch.float32)
        return [t.detach().clone() for t in model.parameters()]
    whole, micro, plain = one_step(8, 1), one_step(8, 4), one_step(0, 4)
    for a, b in zip(whole, micro):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(whole, plain)) > 1e-3


def test_a_run_in_micro_batches_resumes_exactly(store, tmp_path):
    r = tiny_recipe(epochs=2, width=4, accumulate=2, bn_workers=4)      # 16 images: 2 micro-batches, groups of 4
    data = place(store)
    full = train(r, data, seed=2, checkpoint=tmp_path / "a.pt")
    assert [row["batch"] for row in full["rows"]] == [16, 16]
    with pytest.raises(SystemExit):
        train(r, data, seed=2, checkpoint=tmp_path / "b.pt", interrupt_after=1)
    train(r, data, seed=2, checkpoint=tmp_path / "b.pt", resume=True)
    assert same_tensors(saved(tmp_path / "a.pt")["model"], saved(tmp_path / "b.pt")["model"])
    with pytest.raises(inf.DataError, match=r"written with other settings \(accumulate\); cannot resume"):
        train(changed(r, accumulate=4), data, seed=2, checkpoint=tmp_path / "b.pt", resume=True)


def test_a_batch_that_does_not_split_into_micro_batches_or_groups_is_one_line(store, capsys, monkeypatch):
    monkeypatch.setattr(inf, "rank_data", lambda *a, **k: pytest.fail("the data was loaded"))
    common = ["train", "--store", store, "--recipe", "tiny", "--device", "cpu", "--batch-size", "16"]
    for flags, message in (
            (["--accumulate", "3"], "--accumulate 3: the 16 images of a rank's batch in epoch 1 do not split into 3 "
                                    "micro-batches"),
            (["--bn-workers", "3"], "--bn-workers 3: the global batch of epoch 1, 16 images, is not a multiple of it"),
            (["--bn-workers", "2", "--accumulate", "4"], "--bn-workers 2: batch norm's groups of 8 images (the global "
                                                         "batch / 2) do not fill micro-batches of 4 images in epoch 1; "
                                                         "change --accumulate")):
        rc, _, err = run_main(capsys, *common, *flags)
        assert rc == 2 and err.strip().splitlines()[-1] == f"error: {message}"


def test_train_help_says_how_each_recipe_counts_its_batch(capsys):
    with pytest.raises(SystemExit):
        inf.parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("FFCV's recipes (rn50_*, rn18_*), which train FFCV's batch on each GPU (512; 1024 for ResNet-18) at FFCV's "
            "rate (1.7; 0.5) whatever the number of GPUs, as FFCV's train_imagenet.py does") in text
    assert "--per-gpu-batch true|false --batch-size is each GPU's batch" in text


def damage(path, how):
    """Spoils one part of a copied store the way a full disk, an interrupted copy or another version would."""
    index = json.loads((path / "index.json").read_text())
    if how == "index not json":
        (path / "index.json").write_text((path / "index.json").read_text()[:40])
    elif how == "other version":
        (path / "index.json").write_text(json.dumps({**index, "version": 1}))
    elif how == "count":
        (path / "index.json").write_text(json.dumps({**index, "val": {**index["val"], "count": 7}}))
    elif how == "index without settings":
        (path / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "settings"}))
    elif how == "index a list":
        (path / "index.json").write_text("[]")
    elif how == "store too short":
        (path / "val.store").write_bytes(b"0123")
    elif how == "no footer":
        with open(path / "train.store", "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) - 3)
    elif how == "records cut":
        data = (path / "train.store").read_bytes()
        (path / "train.store").write_bytes(data[:100] + data[-16:])      # the footer kept, the records and rows not
    elif how == "rows spoilt":
        data = bytearray((path / "val.store").read_bytes())
        end = int(np.frombuffer(bytes(data[-8:]), "<u8")[0])
        data[end:end + 6] = b"spoilt"                                     # the rows' own .npy header
        (path / "val.store").write_bytes(bytes(data))
    elif how == "store missing":
        (path / "val.store").unlink()


@pytest.mark.parametrize("how, message", [
    ("index not json", r"index.json: not readable \(JSONDecodeError: .*\); prepare it again"),
    ("other version", r"index.json: store version 1, expected \d+; prepare it again"),
    ("count", r": image counts disagree with index.json; prepare it again"),
    ("index without settings", r"index.json: not a whole store index \(no settings\); prepare it again"),
    ("index a list", r"index.json: not readable \(a JSON list, not an object\); prepare it again"),
    ("store too short", r"val.store: too short to be a store file"),
    ("no footer", r"train.store: not a store file of version \d+ \(no footer\); prepare it again"),
    ("records cut", r"train.store: unreadable \(EOF: reading magic string, expected 8 bytes got 0\); prepare it again"),
    ("rows spoilt", r"val.store: unreadable \(the magic string is not correct; expected b'\\x93NUMPY', "
                    r"got b'spoilt'\); prepare it again"),
    ("store missing", r"val.store: unreadable \(\[Errno 2\] No such file or directory: .*val.store'\); "
                      "prepare it again"),
])
def test_a_damaged_store_is_one_line_naming_what_to_do(store, tmp_path, capsys, how, message):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    damage(copy, how)
    rc, _, err = run_main(capsys, "train", "--store", copy, "--device", "cpu", "--epochs", "1")
    assert rc == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"error: {re.escape(str(copy))}/?(\S*){message}", err.strip().splitlines()[-1]), err


def test_prepare_into_a_folder_with_a_spoilt_index_is_one_line_and_touches_nothing(folder, tmp_path, capsys):
    dst = tmp_path / "store"
    dst.mkdir()
    (dst / "index.json").write_text('{"version": ')
    rc, _, err = run_main(capsys, "prepare", "--src", folder, "--dst", dst)
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"error: {dst / 'index.json'}: not readable (JSONDecodeError: Expecting value: line 1 column 13 (char 12)); "
        "delete it, or choose another --dst")
    assert sorted(p.name for p in dst.iterdir()) == ["index.json"]


def test_prepare_into_its_own_store_with_a_partial_index_is_one_line_and_touches_nothing(folder, store, tmp_path,
                                                                                         capsys):
    """The settings match, so prepare would take the store as done; its index lacks a split, so it is not."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    index = json.loads((copy / "index.json").read_text())
    del index["train"]
    (copy / "index.json").write_text(json.dumps(index))
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    rc, _, err = run_main(capsys, "prepare", "--src", folder, "--dst", copy)
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"error: {copy / 'index.json'}: not a whole store index (no train); delete it, or choose another --dst")
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
