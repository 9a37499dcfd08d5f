"""The CIFAR-10 speed-run loop at ImageNet scale on one GPU.

    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in128 --size 128
    python imagenet_fast.py train --store /data/in128 --recipe rn50_16ep --out rn50.json
    python imagenet_fast.py train --list-recipes
    python imagenet_fast.py train --store S --device cpu --model resnet_tiny --width 8 --epochs 2   # CPU demo

`prepare` decodes an ImageFolder tree (train/<class>/*.JPEG, val/<class>/*.JPEG) once, in worker
processes, into a uint8 store that `train` memory-maps (see README.md, "ImageNet", for the format).
`train` keeps the store on the GPU when it fits, else streams batches from pinned host memory;
augmentation (random-resized crop, flip, colour jitter) runs batched on the device.
Every hyperparameter is in BASE; a recipe is a dict of changes; any of them is also a flag.
"""
import argparse
import datetime
import hashlib
import io
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch import nn

import torch_backend as tb
from cifar10_fast import add_shared_flags, environment, fmt_stats, overrides_from
import distributed as D
from core import Table, Timer, summarize, write_atomic, write_json
from torch_backend import DataError

STORE_VERSION = 1
EXTENSIONS = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"}
MEAN = (123.675, 116.28, 103.53)  # the usual ImageNet statistics, 0..255 scale
STD = (58.395, 57.12, 57.375)

# ---------------------------------------------------------------------------------------------
# prepare: ImageFolder tree -> store
# ---------------------------------------------------------------------------------------------


def list_split(src, split, classes=None):
    """(classes, [(path, label)], empty class names) of src/split/<class>/<image>.

    Classes come from train/ (sorted names, as torchvision's ImageFolder numbers them); val/ may
    lack some of them but must not add new ones. An empty class folder keeps its class index
    with 0 images (the caller warns), so labels stay the same as in every other tool.
    """
    d = Path(src) / split
    if not d.is_dir():
        raise DataError(f"{d}: no such folder (expected {Path(src) / split}/<class>/<image>)")
    found = sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"{d}: no class folders (expected {d}/<class>/<image>)")
    if classes is None:
        classes = found
    elif set(found) - set(classes):
        raise DataError(f"{d}: classes {sorted(set(found) - set(classes))[:5]} are not in train/")
    items, empty = [], []
    for label, c in enumerate(classes):
        folder = d / c
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in EXTENSIONS and f.is_file()) \
            if folder.is_dir() else []
        if not files:
            empty.append(c)
        items += [(str(f), label) for f in files]
    return classes, items, empty


def val_shape(w, h, size, max_aspect, step):
    """Validation image shape: shorter side = size, longer side rounded to a multiple of `step`
    (so few distinct shapes exist and a batch of one shape needs no resizing) and capped at
    max_aspect × size."""
    long_ = min(max(w, h) * size / min(w, h), max_aspect * size)
    long_ = max(size, int(round(long_ / step)) * step)
    return (size, long_) if w >= h else (long_, size)  # (out_w, out_h)


def load_image(path, size, train, max_aspect=2.0, step=16):
    """Decodes one image to uint8 HWC.

    Train: the centre square of the shorter side, resized to size×size (keeps the whole image for
    a square photo, cuts 1/8 off each end of a 4:3 one; random-resized crops are taken from it).
    Val: the aspect ratio is kept (see val_shape); a sliver is cut off the longer side so that
    the rounded shape is reached by cropping, not stretching.
    """
    with Image.open(path) as im:
        im.draft("RGB", (size, size))  # JPEG: let libjpeg decode at a reduced scale (>= size)
        im = im.convert("RGB")          # the full decode: truncated or corrupt files raise here
        w, h = im.size
        ow, oh = (size, size) if train else val_shape(w, h, size, max_aspect, step)
        s = max(ow / w, oh / h)  # scale that covers the output, then crop the centre
        cw, ch = ow / s, oh / s
        box = (max(0.0, (w - cw) / 2), max(0.0, (h - ch) / 2), min(w, (w + cw) / 2), min(h, (h + ch) / 2))
        return np.asarray(im.resize((ow, oh), Image.BILINEAR, box=box), dtype=np.uint8)


def shard_key(items, size, max_aspect, step, split):
    """Fingerprint of a shard's inputs: a finished shard is reused only if it matches."""
    h = hashlib.sha1(json.dumps([STORE_VERSION, split, size, max_aspect, step, items]).encode())
    return h.hexdigest()


def shard_is_done(path, key):
    try:
        with np.load(path) as z:
            return str(z["key"]) == key
    except Exception:
        return False


def prepare_shard(path, key, split, items, size, max_aspect, step):
    """Decodes one shard of images and writes it atomically; returns (images kept, errors)."""
    pixels, shapes, labels, errors = [], [], [], []
    for f, label in items:
        try:
            a = load_image(f, size, split == "train", max_aspect, step)
        except Exception as e:  # any decoding failure: report, skip, count
            errors.append((f, f"{type(e).__name__}: {e}".strip()))
            continue
        pixels.append(a.reshape(-1))
        shapes.append(a.shape[:2])
        labels.append(label)

    def write(tmp):
        with open(tmp, "wb") as fh:
            np.savez(fh, key=np.array(key), labels=np.array(labels, dtype=np.int64),
                     shapes=np.array(shapes, dtype=np.int32).reshape(-1, 2),
                     pixels=np.concatenate(pixels) if pixels else np.zeros(0, np.uint8),
                     errors=np.array(json.dumps(errors)))
    write_atomic(path, write)
    return len(labels), errors


def progress(done, total, what, skipped):
    bar = "#" * int(25 * done / max(total, 1))
    sys.stderr.write(f"\r{what}: [{bar:<25}] {done}/{total} images, {skipped} skipped")
    sys.stderr.flush()


def save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:
            np.save(f, array)
    write_atomic(path, write)


def assemble(dst, split, shard_paths, size):
    """Concatenates finished shards into one memory-mappable file per split (train: (N,S,S,3);
    val: flat bytes sorted by shape, with (N,2) shapes), plus labels."""
    labels, shapes = [], []
    for p in shard_paths:
        with np.load(p) as z:
            labels.append(z["labels"])
            shapes.append(z["shapes"])
    labels, shapes = np.concatenate(labels), np.concatenate(shapes)
    order = np.arange(len(labels)) if split == "train" else np.lexsort((shapes[:, 1], shapes[:, 0]))
    nbytes = shapes.prod(1) * 3
    src_off = np.concatenate([[0], np.cumsum(nbytes)])  # offset of image i in the shard stream
    shape = (len(labels), size, size, 3) if split == "train" else (int(nbytes.sum()),)

    def write(tmp):
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
        flat = out.reshape(-1)
        dst_off = np.concatenate([[0], np.cumsum(nbytes[order])])
        where = np.empty(len(labels), np.int64)
        where[order] = dst_off[:-1]  # destination of stream image i
        i = 0
        for p in shard_paths:
            with np.load(p) as z:
                px, k = z["pixels"], len(z["labels"])
            base = src_off[i]
            for j in range(i, i + k):  # a copy per image, once, at preparation time
                flat[where[j]:where[j] + nbytes[j]] = px[src_off[j] - base:src_off[j + 1] - base]
            i += k
        out.flush()
        del out, flat
    write_atomic(dst / f"{split}.npy", write)
    save_npy(dst / f"{split}_labels.npy", labels[order])
    if split == "val":
        save_npy(dst / "val_shapes.npy", shapes[order])
    return labels[order]


def prepare(src, dst, size, workers=None, shard_size=1000, max_aspect=2.0, max_shards=None, log=print):
    """Builds the store; returns its index dict, or None when stopped by max_shards.

    Work is cut into shards written atomically under dst/shards/; a shard whose inputs match a
    finished one is skipped, so an interrupted run resumes where it stopped.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DataError(f"{src}: no such folder")
    if size < 8:
        raise DataError(f"--size {size}: must be at least 8")
    step = max(1, size // 8)
    classes, train, empty_train = list_split(src, "train")
    _, val, empty_val = list_split(src, "val", classes)
    if not train:
        raise DataError(f"{src / 'train'}: no images (extensions {sorted(EXTENSIONS)})")
    if not val:
        raise DataError(f"{src / 'val'}: no images (extensions {sorted(EXTENSIONS)})")
    index_path = dst / "index.json"
    if index_path.is_file():
        old = json.loads(index_path.read_text())
        if old.get("size") == size and old.get("source") == str(src.resolve()):
            log(f"{dst}: already prepared ({old['train']['count']} train, {old['val']['count']} val images)")
            return old
        raise DataError(f"{index_path}: holds another store (size {old.get('size')} from {old.get('source')}); "
                        f"choose another --dst")
    for split, empty in (("train", empty_train), ("val", empty_val)):
        for c in empty:
            print(f"warning: {src / split / c}: no images; class {classes.index(c)} ({c}) is kept with 0 "
                  f"{split} images", file=sys.stderr)

    shard_dir = dst / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    index = {"format": "imagenet_fast store", "version": STORE_VERSION, "size": size, "source": str(src.resolve()),
             "classes": classes, "max_aspect": max_aspect, "step": step}
    new_shards = 0
    for split, items in (("train", train), ("val", val)):
        jobs = []
        for i in range(0, len(items), shard_size):
            part = items[i:i + shard_size]
            path = shard_dir / f"{split}-{i // shard_size:05d}.npz"
            jobs.append((path, shard_key(part, size, max_aspect, step, split), part))
        finished = [shard_is_done(p, k) for p, k, _ in jobs]
        todo = [j for j, f in zip(jobs, finished) if not f]
        if max_shards is not None:
            todo = todo[:max(0, max_shards - new_shards)]
        log(f"{split}: {len(items)} images in {len(jobs)} shards; {sum(finished)} already done, "
            f"{len(todo)} to decode with {workers} workers")
        done, errors = sum(len(j[2]) for j, f in zip(jobs, finished) if f), []
        progress(done, len(items), f"prepare {split}", 0)
        with ProcessPoolExecutor(min(workers, max(1, len(todo)))) as pool:
            futures = {pool.submit(prepare_shard, p, k, split, part, size, max_aspect, step): part
                       for p, k, part in todo}
            for fut in as_completed(futures):
                _, errs = fut.result()
                for f, reason in errs:
                    sys.stderr.write(f"\rskipped {f}: {reason}\033[K\n")
                errors += errs
                done += len(futures[fut])
                new_shards += 1
                progress(done, len(items), f"prepare {split}", len(errors))
        sys.stderr.write("\n")
        if max_shards is not None and new_shards >= max_shards and any(not shard_is_done(p, k) for p, k, _ in jobs):
            log(f"stopped after {new_shards} new shards (--max-shards); run again to resume")
            return None
        skipped = []
        for p, _, _ in jobs:  # the errors of every shard, reused ones included
            with np.load(p) as z:
                skipped += [tuple(e) for e in json.loads(str(z["errors"]))]
        labels = assemble(dst, split, [j[0] for j in jobs], size)
        counts = np.bincount(labels, minlength=len(classes)).tolist()
        index[split] = {"count": int(len(labels)), "per_class": counts, "skipped": len(skipped),
                        "skipped_files": [list(e) for e in skipped],
                        "empty_classes": empty_train if split == "train" else empty_val}
        log(f"{split}: {len(labels)} images stored, {len(skipped)} unreadable and skipped, "
            f"{len(index[split]['empty_classes'])} empty classes")
    write_json(index_path, index)  # written last: its presence means the store is complete
    for p in shard_dir.glob("*.npz"):
        p.unlink()
    if not any(shard_dir.iterdir()):
        shard_dir.rmdir()
    return index


def synthetic_imagefolder(root, classes=10, train_per_class=20, val_per_class=5, sizes=(24, 48), seed=0, quality=90):
    """Writes root/{train,val}/c<k>/*.JPEG of random sizes in `sizes`: class k is a colour of its
    own with stripes of its own period, plus noise, so a network can learn the classes (tests and
    the throughput benchmark)."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(30, 226, (classes, 3))
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            d = Path(root) / split / f"c{k:03d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = rng.integers(sizes[0], sizes[1] + 1, 2)
                stripes = (np.arange(w) // (2 + k % 5) % 2 * 40 - 20)[None, :, None]
                x = palette[k] + stripes + rng.normal(0, 12, (h, w, 3))
                Image.fromarray(x.clip(0, 255).astype(np.uint8)).save(d / f"{i:05d}.JPEG", quality=quality)
    return Path(root)


# ---------------------------------------------------------------------------------------------
# The store in memory and batches from it
# ---------------------------------------------------------------------------------------------

@dataclass
class Store:
    index: dict
    train_x: object  # (N, S, S, 3) uint8
    train_y: object  # (N,) int64
    val_x: object    # flat uint8, images sorted by shape
    val_y: object
    val_shapes: object  # (M, 2) int32 (h, w)


def open_store(path):
    """Memory-maps a prepared store (nothing is read until used)."""
    path = Path(path)
    if not (path / "index.json").is_file():
        raise DataError(f"{path}: not a prepared store (no index.json); run `imagenet_fast.py prepare` first")
    index = json.loads((path / "index.json").read_text())
    if index.get("version") != STORE_VERSION:
        raise DataError(f"{path / 'index.json'}: store version {index.get('version')}, expected {STORE_VERSION}")
    try:
        # mmap "c" (copy-on-write) gives writable arrays, so torch.from_numpy shares them without a copy
        load = lambda name: np.load(path / name, mmap_mode="c")
        s = Store(index, load("train.npy"), load("train_labels.npy"), load("val.npy"), load("val_labels.npy"),
                  load("val_shapes.npy"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable store file ({e})") from e
    if s.train_x.shape[0] != index["train"]["count"] or s.val_y.shape[0] != index["val"]["count"]:
        raise DataError(f"{path}: image counts disagree with index.json; prepare it again")
    return s


def place(store, device, where="auto"):
    """Torch tensors of the store: on the device when asked or when they fit in 80% of its free
    memory, else in host memory (pinned when the device is a GPU, so copies can be asynchronous)."""
    arrays = {"train_x": store.train_x, "train_y": store.train_y, "val_x": store.val_x, "val_y": store.val_y}
    nbytes = sum(a.nbytes for a in arrays.values())
    if where == "auto":
        where = "device" if device.type == "cuda" and nbytes < 0.8 * torch.cuda.mem_get_info(device)[0] else "host"
    t = {k: torch.from_numpy(a) for k, a in arrays.items()}
    if where == "device":
        t = {k: v.to(device) for k, v in t.items()}
    elif device.type == "cuda":
        t = {k: v.pin_memory() for k, v in t.items()}
    t["val_shapes"] = store.val_shapes
    t["where"] = where
    return t


def train_batches(x, y, perm, bs, device):
    """(uint8 NHWC images, labels) on the device for each full batch of perm.

    From host memory on a GPU: the next batch is gathered into one of two pinned buffers and
    copied on a side stream while the current one computes.
    """
    steps = len(perm) // bs
    if x.device == device or device.type != "cuda":
        for i in range(steps):
            idx = perm[i * bs:(i + 1) * bs].to(x.device)
            yield x[idx].to(device), y[idx].to(device)
        return
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    bufs = [torch.empty((bs,) + tuple(x.shape[1:]), dtype=x.dtype).pin_memory() for _ in range(2)]
    copied = [None, None]

    def load(i):
        b = i % 2
        if copied[b] is not None:
            copied[b].synchronize()  # the buffer's previous copy must have left it
        idx = perm[i * bs:(i + 1) * bs]
        torch.index_select(x, 0, idx, out=bufs[b])
        with torch.cuda.stream(side):
            xb, yb = bufs[b].to(device, non_blocking=True), y[idx].pin_memory().to(device, non_blocking=True)
            copied[b] = torch.cuda.Event()
            copied[b].record(side)
        return xb, yb, copied[b]

    nxt = load(0) if steps else None
    for i in range(steps):
        xb, yb, ev = nxt
        main.wait_event(ev)
        xb.record_stream(main)
        yb.record_stream(main)
        if i + 1 < steps:
            nxt = load(i + 1)
        yield xb, yb


def draw_crops(n, scale, ratio, generator, tries=10):
    """Random-resized-crop boxes for n square images as fractions of the side: width, height,
    centre x, centre y, and a flip bit. Like torchvision's RandomResizedCrop: area fraction
    uniform in `scale`, log aspect uniform in log `ratio`, the first of `tries` draws that fits,
    else the whole image; all n images in a few tensor calls."""
    area = torch.empty(n, tries).uniform_(scale[0], scale[1], generator=generator)
    logr = torch.empty(n, tries).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    w, h = (area * logr.exp()).sqrt(), (area / logr.exp()).sqrt()
    fits = (w <= 1) & (h <= 1)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    w, h = torch.where(fits.any(1), w, 1.0), torch.where(fits.any(1), h, 1.0)
    u = torch.rand(n, 3, generator=generator)
    return {"w": w, "h": h, "cx": w / 2 + (1 - w) * u[:, 0], "cy": h / 2 + (1 - h) * u[:, 1], "flip": u[:, 2] < 0.5}


def crop_resize(x, c, res):
    """Samples each image's box (draw_crops) at res×res with one affine grid_sample for the batch;
    x is float NCHW. A flip is the box mirrored (negative x scale)."""
    n = x.shape[0]
    sign = 1 - 2 * c["flip"].to(x.dtype) if "flip" in c else torch.ones(n, device=x.device, dtype=x.dtype)
    theta = torch.zeros(n, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = c["w"] * sign, 2 * c["cx"] - 1
    theta[:, 1, 1], theta[:, 1, 2] = c["h"], 2 * c["cy"] - 1
    grid = F.affine_grid(theta, (n, x.shape[1], res, res), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def jitter(x, strength, generator):
    """Brightness, contrast and saturation, each × a factor uniform in 1 ± strength, per image
    (x float NCHW on 0..255)."""
    f = 1 + strength * (2 * torch.rand(3, x.shape[0], 1, 1, 1, generator=generator) - 1)
    f = f.to(x.device)
    x = x * f[0]
    mean = x.mean((1, 2, 3), keepdim=True)
    x = (x - mean) * f[1] + mean
    gray = (x * torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)).sum(1, keepdim=True)
    return ((x - gray) * f[2] + gray).clamp(0, 255)


def normalize(x):
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def augment(xb, crops, res, hp, generator, dtype, memory_format):
    """uint8 NHWC batch -> augmented, normalised compute-dtype NCHW batch at res×res."""
    x = crop_resize(xb.permute(0, 3, 1, 2).float(), crops, res)
    if hp["jitter"]:
        x = jitter(x, hp["jitter"], generator)
    return normalize(x).to(dtype).contiguous(memory_format=memory_format)


def val_batches(shapes, batch_size):
    """(first image, count, h, w) of each validation batch: runs of one shape, cut at batch_size.
    Images are stored sorted by shape, so a batch is one contiguous slice: no per-image work."""
    out, i = [], 0
    while i < len(shapes):
        j = i
        while j < len(shapes) and j - i < batch_size and (shapes[j] == shapes[i]).all():
            j += 1
        out.append((i, j - i, int(shapes[i][0]), int(shapes[i][1])))
        i = j
    return out


@torch.no_grad()
def evaluate(model, data, size, res, tta, device, dtype, memory_format, batch_size=256):
    """Rectangular evaluation: each batch (one aspect ratio) is resized so its shorter side is
    res, no centre crop. Returns mean loss, top-1 and top-5 accuracy."""
    was_training = model.training
    model.eval()
    shapes = data["val_shapes"]
    offsets = np.concatenate([[0], np.cumsum(shapes.prod(1) * 3)])
    loss = top1 = top5 = 0.0
    for i, n, h, w in val_batches(shapes, batch_size):
        x = data["val_x"][offsets[i]:offsets[i + n]].to(device, non_blocking=True).view(n, h, w, 3)
        y = data["val_y"][i:i + n].to(device)
        x = x.permute(0, 3, 1, 2).float()
        if res != size:
            x = F.interpolate(x, size=(round(h * res / size), round(w * res / size)), mode="bilinear",
                              antialias=res < size, align_corners=False)
        x = normalize(x).to(dtype).contiguous(memory_format=memory_format)
        with tb.autocast(device, dtype):
            logits = model(x).float()
            if tta == "flip":
                logits = (logits + model(x.flip(3)).float()) / 2
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        top = logits.topk(min(5, logits.shape[1]), 1).indices
        top1 += (top[:, 0] == y).sum().item()
        top5 += (top == y[:, None]).any(1).sum().item()
    model.train(was_training)
    m = len(shapes)
    return loss / m, top1 / m, top5 / m


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

class BlurPool(nn.Module):
    """A fixed 3×3 binomial low-pass filter, put before every strided convolution so that it
    subsamples a smoothed signal (anti-aliasing, Zhang 2019; FFCV's ResNets use it)."""

    def __init__(self, channels):
        super().__init__()
        k = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("kernel", (k[:, None] * k[None, :] / 16).expand(channels, 1, 3, 3).clone())

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), self.kernel.to(x.dtype), groups=x.shape[1])


def add_blurpool(model, min_channels=16):
    """Replaces each strided conv with ≥ min_channels inputs by BlurPool then that conv."""
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
                setattr(m, child_name, nn.Sequential(BlurPool(child.in_channels), child))
    return model


def resnet_tiny(num_classes, width):
    """A 4-stage ResNet of torchvision BasicBlocks, one per stage, `width` channels in the first
    stage (torchvision's ResNets have fixed widths): for tests and CPU demonstrations."""
    from torchvision.models.resnet import BasicBlock
    layers, c_in = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)], width
    for i in range(4):
        c, stride = width * 2 ** i, 1 if i == 0 else 2
        down = None if stride == 1 else nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))
        layers.append(BasicBlock(c_in, c, stride, down))
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))


MODELS = ("resnet_tiny", "resnet18", "resnet34", "resnet50", "resnet101")


def build_model(hp, num_classes):
    if hp["model"] not in MODELS:
        raise ValueError(f"unknown model {hp['model']!r}; choose from {', '.join(MODELS)}")
    if hp["model"] == "resnet_tiny":
        model = resnet_tiny(num_classes, hp["width"])
    else:
        model = getattr(torchvision.models, hp["model"])(num_classes=num_classes, zero_init_residual=hp["zero_init"])
    return add_blurpool(model) if hp["blurpool"] else model


def make_optimizer(model, hp, steps_per_epoch=1):
    """SGD (or the large-batch LARS / RMSprop-to-SGD of distributed.py); weight decay only on conv and
    linear weights (none on batch-norm scales and biases)."""
    groups = D.param_groups_no_decay_1d(model, hp["weight_decay"])
    if hp["optimizer"] == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=hp["momentum"], nesterov=hp["nesterov"])
    if hp["optimizer"] == "lars":
        return D.LARS(groups, lr=0.0, momentum=hp["momentum"], trust_coefficient=hp["lars_trust"])
    if hp["optimizer"] == "rmsprop_sgd":
        return D.RMSpropToSGD(groups, lr=0.0, lr_rmsprop=hp["rms_lr"], momentum=hp["momentum"],
                              beta_center=hp["rms_beta_center"], beta_period=hp["rms_beta_period"],
                              steps_per_epoch=steps_per_epoch)
    raise ValueError(f"unknown optimizer {hp['optimizer']!r}; choose from sgd, lars, rmsprop_sgd")


# ---------------------------------------------------------------------------------------------
# Schedules and training
# ---------------------------------------------------------------------------------------------

def lr_at(hp, t):
    """Learning rate per 256 images at t epochs: linear warm-up from 0 to lr over warmup_epochs,
    then linear to 0 at the end, cosine to 0, ×0.1 at each of step_epochs, or slow_start (half the
    rate until epoch rms_beta_center, where RMSprop-to-SGD is half handed over, then the step decay)."""
    peak, warm, end = hp["lr"], hp["warmup_epochs"], hp["epochs"]
    if t < warm:
        return peak * t / warm
    f = min(1.0, (t - warm) / max(end - warm, 1e-9))
    if hp["schedule"] == "linear":
        return peak * (1 - f)
    if hp["schedule"] == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * f))
    if hp["schedule"] == "step":
        return peak * 0.1 ** sum(t >= s for s in hp["step_epochs"])
    if hp["schedule"] == "slow_start":      # Akiba et al.: half the rate while RMSprop hands over to SGD
        return D.slow_start_lr(t, peak, start_epochs=hp["rms_beta_center"], milestones=hp["step_epochs"])
    raise ValueError(f"unknown schedule {hp['schedule']!r}; choose from linear, cosine, step, slow_start")


def res_at(hp, epoch):
    """Training resolution of an epoch (0-based): min_res until res_start_epoch, linear to max_res
    at res_end_epoch, rounded to a multiple of res_step (FFCV's progressive resizing)."""
    r = np.interp(epoch, [hp["res_start_epoch"], hp["res_end_epoch"]], [hp["min_res"], hp["max_res"]])
    return int(round(r / hp["res_step"])) * hp["res_step"]


def batch_at(hp, res):
    """Batch size at a resolution: batch_size at max_res, and with batch_scale, larger at lower
    resolutions in proportion to the pixels saved (same activation memory), a multiple of 8."""
    if not hp["batch_scale"]:
        return hp["batch_size"]
    return max(8, int(hp["batch_size"] * (hp["max_res"] / res) ** 2) // 8 * 8)


def batch_for(hp, epoch, world=1):
    """This rank's batch in an epoch: from the batch-size schedule (Mikami et al. 2018: the global batch
    grows during training; flattened (epoch, global batch) pairs) if there is one, else batch_at."""
    pairs = hp["batch_schedule"]
    if len(pairs) % 2:
        raise ValueError(f"batch schedule {pairs} is not (epoch, batch) pairs")
    if pairs:
        return D.BatchSizeSchedule(zip(pairs[::2], pairs[1::2])).per_rank(epoch, world)
    return batch_at(hp, res_at(hp, epoch))


def checkpoint_state(model, opt, ema, gen, epoch, rows, train_time, time_to_target, hp):
    """Everything a resumed run needs; the random states of every rank (gathered to all), so that
    each rank resumes its own augmentation stream exactly."""
    rng = [gen.get_state(), torch.get_rng_state()]
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, rng)
    else:
        every = [rng]
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.model.state_dict() if ema else None,
            "ema_steps": ema.steps if ema else 0, "rng": every,
            "epoch": epoch, "rows": rows, "train_time": train_time, "time_to_target": time_to_target, "hp": hp}


def warmup(hp, data, num_classes, device, dtype, memory_format, world=1):
    """Two steps at every (resolution, batch) pair of the schedule on a throwaway model, so that
    cuDNN's autotuning for each new shape happens before the clock starts."""
    model = build_model(hp, num_classes).to(device, memory_format=memory_format)
    opt = make_optimizer(model, hp)
    gen = torch.Generator().manual_seed(0)
    for res, bs in sorted({(res_at(hp, e), batch_for(hp, e, world)) for e in range(hp["epochs"])}):
        bs = min(bs, len(data["train_y"]))
        perm = torch.arange(2 * bs) % len(data["train_y"])
        crops = draw_crops(2 * bs, hp["crop_scale"], hp["crop_ratio"], gen)
        for i, (xb, yb) in enumerate(train_batches(data["train_x"], data["train_y"], perm, bs, device)):
            c = {k: v[i * bs:(i + 1) * bs].to(device) for k, v in crops.items()}
            with tb.autocast(device, dtype):
                F.cross_entropy(model(augment(xb, c, res, hp, gen, dtype, memory_format)).float(), yb).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)


def train(hp, data, num_classes, size, device, seed=0, dtype=torch.float32, target=0.75, checkpoint=None,
          resume=False, on_epoch=None, ctx=None, bucket_mb=25.0, hook="none", interrupt_after=None):
    """Trains one network; returns its per-epoch rows and summary (as torch_backend.train does).

    The clock (device-synchronised) covers model construction, batches, augmentation and steps;
    it leaves out per-epoch evaluation and checkpoint writing. With `checkpoint`, the state after
    every epoch is written there atomically; `resume` continues from it exactly (model, optimiser,
    EMA, epoch, RNG), so an interrupted run ends with the same parameters as an uninterrupted one.
    Under torchrun (`ctx`): data holds this rank's shard, hp["batch_size"] is the per-rank batch (the
    learning rate follows the global one), the model trains inside DistributedDataParallel, and rank 0
    alone writes the checkpoint, which every rank restores (an elastic restart resumes from it).
    """
    ctx = ctx or D.Context()
    world = ctx.world_size
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 104729 * ctx.rank)  # the data pipeline's draws, on the CPU
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    timer = Timer((lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None)
    model = build_model(hp, num_classes).to(device, memory_format=memory_format)
    opt = make_optimizer(model, hp, max(1, len(data["train_y"]) // hp["batch_size"]))
    forward = D.register_comm_hook(D.wrap_ddp(model, ctx, bucket_mb), hook) if ctx.distributed else model
    if hp["bn_stats"] == "last_batch":
        D.use_last_batch_stats(model)
    ema = tb.EMA(model, hp["ema_momentum"], hp["ema_every"]) if hp["ema_momentum"] else None
    start, rows, time_to_target = 0, [], None
    if resume and checkpoint and Path(checkpoint).is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        if state["hp"] != hp:
            diff = sorted(k for k in hp if state["hp"].get(k) != hp[k])
            raise DataError(f"{checkpoint}: written with other hyperparameters ({', '.join(diff)}); cannot resume")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if ema:
            ema.model.load_state_dict(state["ema"])
            ema.steps = state["ema_steps"]
        if len(state["rng"]) != world:
            raise DataError(f"{checkpoint}: written by {len(state['rng'])} ranks, resumed by {world}; cannot resume")
        gen.set_state(state["rng"][ctx.rank][0])
        torch.set_rng_state(state["rng"][ctx.rank][1])
        start, rows, time_to_target = state["epoch"], state["rows"], state["time_to_target"]
        timer.total = state["train_time"]
        for row in rows:
            on_epoch and on_epoch(row)
    n = len(data["train_y"])
    for epoch in range(start, hp["epochs"]):
        res = res_at(hp, epoch)
        bs = min(batch_for(hp, epoch, world), n)
        steps = n // bs
        perm = torch.randperm(n, generator=gen)
        crops = draw_crops(n, hp["crop_scale"], hp["crop_ratio"], gen)
        if not hp["flip"]:
            crops.pop("flip")
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        for i, (xb, yb) in enumerate(train_batches(data["train_x"], data["train_y"], perm, bs, device)):
            c = {k: v[i * bs:(i + 1) * bs].to(device, non_blocking=True) for k, v in crops.items()}
            x = augment(xb, c, res, hp, gen, dtype, memory_format)
            lr = lr_at(hp, epoch + i / steps) * bs * world / 256       # per 256 images of the global batch
            for g in opt.param_groups:
                g["lr"] = lr
            with tb.autocast(device, dtype):
                logits = forward(x)
                loss = F.cross_entropy(logits.float(), yb, label_smoothing=hp["label_smoothing"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ema:
                ema.update(model)
            loss_sum += loss.detach() * bs
            correct += (logits.detach().argmax(1) == yb).sum()
        epoch_time = timer()
        if hp["bn_stats"] == "last_batch":
            D.sync_batch_norm_stats(model, ctx)
        eval_model = ema.model if ema else model
        val_loss, top1, top5 = evaluate(eval_model, data, size, hp["val_res"], hp["tta"], device, dtype, memory_format)
        if time_to_target is None and top1 >= target:
            time_to_target = timer.total
        row = {"epoch": epoch + 1, "res": res, "batch": bs, "lr": lr, "train_loss": loss_sum.item() / (steps * bs),
               "train_acc": correct.item() / (steps * bs), "val_loss": val_loss, "top1": top1, "top5": top5,
               "epoch_time": epoch_time, "total_time": timer.total}
        rows.append(row)
        if checkpoint:
            state = checkpoint_state(model, opt, ema, gen, epoch + 1, rows, timer.total, time_to_target, hp)
            if ctx.is_main:
                write_atomic(checkpoint, lambda tmp: torch.save(state, tmp))
            D.barrier()             # nobody reads (or restarts from) a checkpoint still being written
            if interrupt_after == epoch + 1:
                if ctx.distributed:         # leave together, so no rank sees a peer vanish mid-collective
                    D.barrier()
                    torch.distributed.destroy_process_group()
                raise SystemExit(INTERRUPTED)
        if on_epoch:
            on_epoch(row)
        timer(include=False)
    return {"seed": seed, "rows": rows, "final_top1": rows[-1]["top1"], "final_top5": rows[-1]["top5"],
            "train_time": timer.total, "time_to_target": time_to_target, "model": ema.model if ema else model}


# ---------------------------------------------------------------------------------------------
# Recipes and the command line
# ---------------------------------------------------------------------------------------------

INTERRUPTED = 75      # EX_TEMPFAIL: stopped on purpose, resumable

# Every hyperparameter once. lr is per 256 images: the step uses lr × batch / 256 (Goyal et al.).
# Resolutions are in pixels of the network input; res_*_epoch are 0-based epochs.
BASE = dict(
    model="resnet50", width=16, blurpool=True, zero_init=False,
    epochs=16, batch_size=512, lr=0.10625, warmup_epochs=2.0, schedule="linear", step_epochs=(30.0, 60.0, 80.0),
    momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.1,
    min_res=160, max_res=192, res_start_epoch=11, res_end_epoch=13, res_step=32, batch_scale=False,
    crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), flip=True, jitter=0.0,
    val_res=256, tta="flip", ema_momentum=0.0, ema_every=1,
    # large-batch options (distributed.py, as in cifar10_fast.py)
    batch_schedule=(), optimizer="sgd", lars_trust=0.001, rms_lr=1e-3, rms_beta_center=10.0, rms_beta_period=5.0, bn_stats="running",
)

# Epochs, resolution ramps, lr, weight decay, label smoothing and blurpool follow FFCV's published
# configs (libffcv/ffcv-imagenet rn50_configs/, rn18_configs/): rn50 lr 1.7 for 8 GPUs x 512
# images = 0.10625 per 256; rn18 lr 0.5 for 1 GPU x 1024 = 0.125 per 256; lr peaks at epoch 2 and
# falls linearly to 0 ("cyclic"); res 160 -> 192; validation at 256 with flip TTA.
RECIPES = {
    "rn50_16ep": dict(doc="ResNet-50, 16 epochs, res 160->192 (published by FFCV: 73.8% top-1 in 14.9 min on 8 A100s)"),
    "rn50_24ep": dict(doc="ResNet-50, 24 epochs, res 160->192 (published by FFCV: 75.6% top-1 in 21.7 min on 8 A100s)",
                      epochs=24, res_start_epoch=17, res_end_epoch=20),
    "rn50_88ep": dict(doc="ResNet-50, 88 epochs, res 160->192 (published by FFCV: 78.4% top-1 in 77.2 min on 8 A100s)",
                      epochs=88, res_start_epoch=65, res_end_epoch=76),
    "rn18_16ep": dict(doc="ResNet-18, 16 epochs, res 160->192 (published by FFCV: 66.9% top-1 in 35.0 min on 1 A100)",
                      model="resnet18", batch_size=1024, lr=0.125, weight_decay=5e-5),
    "rn18_88ep": dict(doc="ResNet-18, 88 epochs, res 160->192 (published by FFCV: 72.4% top-1 in 187.3 min on 1 A100)",
                      model="resnet18", batch_size=1024, lr=0.125, weight_decay=5e-5, epochs=88,
                      res_start_epoch=65, res_end_epoch=76),
    "tiny": dict(doc="resnet_tiny width 16 for tests and CPU demonstrations on small stores (res 32, 8 epochs)",
                 model="resnet_tiny", blurpool=False, epochs=8, batch_size=32, lr=0.2, warmup_epochs=1.0,
                 weight_decay=5e-5, min_res=32, max_res=32, res_start_epoch=0, res_end_epoch=0, res_step=8,
                 crop_scale=(0.35, 1.0), val_res=32, tta="none"),
}


def recipe(name, **overrides):
    """BASE with a recipe's changes and then the overrides; names outside BASE are errors."""
    changes = {k: v for k, v in RECIPES.get(name, {}).items() if k != "doc"}
    bad = sorted((set(changes) | set(overrides)) - set(BASE))
    if name not in RECIPES or bad:
        raise KeyError(f"unknown hyperparameters {bad}" if bad else
                       f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return {**BASE, **changes, **overrides}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="decode an ImageFolder tree into a store")
    pp.add_argument("--src", required=True, help="folder with train/<class>/* and val/<class>/*")
    pp.add_argument("--dst", required=True, help="store folder to write (resumes if partly written)")
    pp.add_argument("--size", type=int, default=128, help="shorter side of stored images (default 128)")
    pp.add_argument("--workers", type=int, default=None, help="decoding processes (default: CPU count)")
    pp.add_argument("--shard-size", type=int, default=1000, help="images per shard, the unit of resumption")
    pp.add_argument("--max-aspect", type=float, default=2.0, help="longest val aspect kept (default 2)")
    pp.add_argument("--max-shards", type=int, default=None, help="stop after decoding this many new shards")

    tp = sub.add_parser("train", help="train on a store")
    tp.add_argument("--store", help="a folder written by prepare")
    tp.add_argument("--recipe", default="rn50_16ep", help="recipe name (default rn50_16ep; see --list-recipes)")
    tp.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    tp.add_argument("--runs", type=int, default=1)
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda if available)")
    tp.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    tp.add_argument("--data-on", default="auto", choices=["auto", "device", "host"],
                    help="where the store lives (auto: on the device if it fits)")
    tp.add_argument("--target", type=float, default=0.75, help="top-1 whose first epoch stops the clock")
    tp.add_argument("--checkpoint", default=None, help="checkpoint file, written atomically after every epoch")
    tp.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    tp.add_argument("--out", default=None, help="write config, environment, rows and summary as JSON")
    tp.add_argument("--interrupt-after-epoch", type=int, default=None,
                    help=f"exit with status {INTERRUPTED} right after this epoch's checkpoint, as a preempted job "
                         "would; a restart with --resume (or torchrun --max-restarts) continues from it")
    add_shared_flags(tp, BASE)
    sub.add_parser("simulate", add_help=False,
                   help="project step time and scaling efficiency over many GPUs (see `simulate --help`)")
    args = p.parse_args(argv)
    return args, overrides_from(args, BASE)


def main_prepare(args):
    try:
        index = prepare(args.src, Path(args.dst), args.size, args.workers, args.shard_size, args.max_aspect,
                        args.max_shards)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if index is None:
        return 3
    print(f"wrote {args.dst}: {len(index['classes'])} classes, {index['train']['count']} train and "
          f"{index['val']['count']} val images at size {index['size']}; "
          f"{index['train']['skipped'] + index['val']['skipped']} unreadable files skipped")
    return 0


def main_train(args, overrides, argv):
    if args.list_recipes:
        print("\n".join(f"{name:12s} {r['doc']}" for name, r in RECIPES.items()))
        return 0
    usage = [message for bad, message in (
        (not args.store, "--store is required (a folder written by `imagenet_fast.py prepare`)"),
        (args.runs < 1, "--runs must be at least 1"),
        (args.resume and not args.checkpoint, "--resume needs --checkpoint"),
        (args.resume and args.runs > 1, "--resume works with a single run"),
        (args.interrupt_after_epoch and not args.checkpoint, "--interrupt-after-epoch needs --checkpoint")) if bad]
    try:
        hp = recipe(args.recipe, **overrides)
    except KeyError as e:
        usage.insert(0, e.args[0])
    if usage:
        print(f"error: {usage[0]}", file=sys.stderr)
        return 2
    ctx = D.init_from_env(args.device)       # torchrun: this rank's place; plain python: one process
    device, say = torch.device(ctx.device), D.print0
    if device.type == "cpu" and ctx.is_main:
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration use "
              "a small store, --model resnet_tiny and few --epochs", file=sys.stderr)
    try:
        rank_hp = {**hp, "batch_size": D.per_rank_batch(hp["batch_size"], ctx.world_size)}
        for e in range(hp["epochs"]):
            batch_for(rank_hp, e, ctx.world_size)      # a bad schedule fails here, not mid-run
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = tb.compute_dtype(device, args.precision)
    try:
        if hp["model"] not in MODELS:
            raise ValueError(f"unknown model {hp['model']!r}; choose from {', '.join(MODELS)}")
        store = open_store(args.store)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size, classes = store.index["size"], store.index["classes"]
    data = place(store, device, args.data_on)
    n_train = len(data["train_y"])
    if ctx.distributed:             # each rank keeps its own contiguous shard of the training set
        part = D.shard(n_train, ctx.rank, ctx.world_size)
        data = {**data, "train_x": data["train_x"][part.start:part.stop], "train_y": data["train_y"][part.start:part.stop]}
    say(f"recipe {args.recipe} on {environment(device)['device_name']} ({device}, {str(dtype)[6:]}), "
          f"{n_train} train and {len(data['val_y'])} val images, {len(classes)} classes, "
          f"store size {size} in {data['where']} memory"
        + (f", {ctx.world_size} ranks of {rank_hp['batch_size']} images per step" if ctx.distributed else ""))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        warmup(rank_hp, data, len(classes), device, dtype, torch.channels_last, ctx.world_size)

    columns = ["epoch", "res", "batch", "lr", "train_loss", "train_acc", "val_loss", "top1", "top5", "epoch_time",
               "total_time"]
    runs = []
    for r in range(args.runs):
        seed = args.seed + r
        if args.runs > 1:
            say(f"run {r + 1}/{args.runs} (seed {seed})")
        table = Table(columns, width=11, formats={"epoch_time": ".2f", "total_time": ".2f"},
                      file=None if ctx.is_main else io.StringIO())
        ckpt = args.checkpoint if args.runs == 1 else (args.checkpoint and f"{args.checkpoint}.seed{seed}")
        try:
            result = train(rank_hp, data, len(classes), size, device, seed, dtype, args.target, ckpt, args.resume,
                           table.append, ctx, args.bucket_mb, args.comm_hook, args.interrupt_after_epoch)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        result.pop("model")
        runs.append(result)
        ttt = result["time_to_target"]
        say(f"final top-1 {result['final_top1']:.4f}, top-5 {result['final_top5']:.4f}; "
            + (f"time to {args.target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {args.target:.2%}")
            + f"; training time {result['train_time']:.2f} s")

    keys = {"final_top1": ("final top-1", ""), "final_top5": ("final top-5", ""),
            "time_to_target": (f"time to {args.target:.2%}", " s"), "train_time": ("training time", " s")}
    summary = {k: summarize([r[k] for r in runs]) for k in keys}
    summary["fraction_reaching_target"] = sum(r["time_to_target"] is not None for r in runs) / len(runs)
    if args.runs > 1 and ctx.is_main:
        print(f"\nsummary over {args.runs} runs of {args.recipe}")
        for k, (name, unit) in keys.items():
            print(fmt_stats(name, summary[k], unit=unit))
        print(f"runs reaching {args.target:.2%}: {summary['fraction_reaching_target']:.0%}")
    if args.out and ctx.is_main:
        write_json(args.out, {
            "recipe": args.recipe, "hyperparameters": hp, "target": args.target, "store": str(args.store),
            "store_size": size, "data_on": data["where"], "argv": sys.argv[1:] if argv is None else list(argv),
            "environment": {**environment(device), "world_size": ctx.world_size, "bucket_mb": args.bucket_mb,
                            "comm_hook": args.comm_hook}, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "runs": runs, "summary": summary})
        print(f"wrote {args.out}")
    if ctx.distributed:
        D.barrier()
        torch.distributed.destroy_process_group()
    return 0


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if argv_list[:1] == ["simulate"]:
        return D.main_simulate(argv_list[1:])
    args, overrides = parse_args(argv)
    if args.command == "prepare":
        return main_prepare(args)
    return main_train(args, overrides, argv)


if __name__ == "__main__":
    sys.exit(main())
