"""ImageNet batches from the store (imagenet_store.py): this process's share placed, random-resized crops of the whole
image drawn as torchvision defines them, decoded on the CPU's threads or the GPU, augmented on the device; and the
validation views.

Training crops follow torchvision's RandomResizedCrop.get_params exactly (crop_boxes): the area a fraction of the
image's uniform in `crop_scale`, the log aspect uniform in log `crop_ratio`, whole pixels, the first of 10 draws that
fits, else a centre crop. A JPEG store's crop is decoded at the smallest DCT scale (1, 1/2, 1/4, 1/8) that still
holds the crop at the output resolution, then resized with PIL's antialiased bilinear filter; on a GPU
(decoder "gpu") torchvision's nvJPEG decodes the batch's images and each crop is resized on the device. A raw store
keeps each training image stretched to a square, so a box of the image is a box of the square: sampled with one
affine grid for the batch on the device.
"""
import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import devices
import distributed as D
from imagenet_store import val_shape

MEAN = (123.675, 116.28, 103.53)  # the usual ImageNet statistics, 0..255 scale
STD = (58.395, 57.12, 57.375)


# ---------------------------------------------------------------------------------------------
# Where a crop is, and what validation sees
# ---------------------------------------------------------------------------------------------

def crop_boxes(heights, widths, *, scale, ratio, generator, tries=10):
    """torchvision's RandomResizedCrop.get_params for n images at once: (n, 4) int64 boxes (top, left, height, width)
    in each image's pixels. Per image: target area = its area x U(scale), aspect = exp(U(log ratio)); width and
    height rounded to whole pixels; the first of `tries` draws with 0 < w <= W and 0 < h <= H is placed at a uniform
    whole-pixel offset; if none fits, the largest centred crop whose aspect is clamped into `ratio`."""
    H, W = torch.as_tensor(heights, dtype=torch.int64), torch.as_tensor(widths, dtype=torch.int64)
    n = len(H)
    area = (H * W).double()[:, None] * torch.empty(n, tries, dtype=torch.float64).uniform_(*scale, generator=generator)
    logr = torch.empty(n, tries, dtype=torch.float64).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                                               generator=generator)
    w, h = (area * logr.exp()).sqrt().round().long(), (area / logr.exp()).sqrt().round().long()
    fits = (w > 0) & (w <= W[:, None]) & (h > 0) & (h <= H[:, None])
    first = fits.to(torch.uint8).argmax(1, keepdim=True)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    u = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    top = (u[:, 0] * (H - h + 1)).long()
    left = (u[:, 1] * (W - w + 1)).long()
    # the fallback: clamp the image's own aspect into ratio, centred
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], (H * ratio[1]).round().long(), W)
    fh = torch.where(in_ratio < ratio[0], (W / ratio[0]).round().long(), H)
    ok = fits.any(1)
    w, h = torch.where(ok, w, fw), torch.where(ok, h, fh)
    top, left = torch.where(ok, top, (H - h) // 2), torch.where(ok, left, (W - w) // 2)
    return torch.stack([top, left, h, w], 1)


def val_view(height, width, *, res, crop, max_aspect=2.0):
    """What validation sees of an image: (box (top, left, height, width) in its pixels, output (height, width)).
    crop > 0: the centred square of side crop x the shorter side, resized to res x res (FFCV's and torchvision's
    "resize to res / crop, centre-crop res"); crop 0: the whole image, shorter side res, the longer rounded to a
    multiple of res // 8 and capped at max_aspect x res (so few shapes exist), orientation kept."""
    if crop:
        side = crop * min(height, width)
        return ((height - side) / 2, (width - side) / 2, side, side), (res, res)
    ow, oh = val_shape(width, height, res, max_aspect=max_aspect, step=max(1, res // 8))
    s = max(ow / width, oh / height)
    bw, bh = min(width, ow / s), min(height, oh / s)
    return ((height - bh) / 2, (width - bw) / 2, bh, bw), (oh, ow)


# ---------------------------------------------------------------------------------------------
# One image, on the CPU
# ---------------------------------------------------------------------------------------------

def decode_crop(record, *, box, shape, raw_shape=None):
    """The box (top, left, height, width) of one record resized to shape (height, width): uint8 HWC. A JPEG
    record is decoded at the smallest DCT scale that keeps the box at least as large as the output (libjpeg's
    draft mode: 2-8x fewer pixels for small crops); raw_shape (h, w) marks a raw record of those pixels."""
    top, left, bh, bw = (float(v) for v in box)
    oh, ow = shape
    if raw_shape is not None:
        im = Image.fromarray(np.asarray(record).reshape(*raw_shape, 3))
    else:
        im = Image.open(io.BytesIO(record))
        W, H = im.size
        im.draft("RGB", (math.ceil(W * ow / bw), math.ceil(H * oh / bh)))
        sx, sy = im.size[0] / W, im.size[1] / H
        top, left, bh, bw = top * sy, left * sx, bh * sy, bw * sx
    im = im.convert("RGB")
    return np.asarray(im.resize((ow, oh), Image.BILINEAR, box=(left, top, left + bw, top + bh)))


def decode_into(out, records, boxes, raw_shapes=None):
    """decode_crop of each record into out[k] (a numpy view of a host buffer): one thread's part of a batch."""
    for k, record in enumerate(records):
        out[k] = decode_crop(record, box=boxes[k], shape=out.shape[1:3],
                             raw_shape=None if raw_shapes is None else raw_shapes[k])


# ---------------------------------------------------------------------------------------------
# This process's share of the store
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Data:
    """What this process trains and validates on. train_rows / val_rows index the store's splits (under torchrun,
    this rank's share alone: nothing else is ever read); pixels, for a raw store, holds the training squares of
    train_rows (on the device, in pinned host memory, or the memory-mapped file itself)."""
    store: object
    train_rows: np.ndarray
    val_rows: np.ndarray
    train_y: torch.Tensor
    val_y: torch.Tensor
    pixels: torch.Tensor = None
    pixel_rows: torch.Tensor = None   # the row of pixels of each of train_rows (None: the same position)
    where: str = "host"
    decoder: str = "cpu"              # "cpu": PIL on `threads` threads; "gpu": nvJPEG through torchvision
    threads: int = 1
    pool: ThreadPoolExecutor = field(default=None, repr=False)

    def shapes(self, split="train"):
        rows = self.store.train.rows[self.train_rows] if split == "train" else self.store.val.rows[self.val_rows]
        return rows["height"].astype(np.int64), rows["width"].astype(np.int64)


def place(store, device, *, where="auto", ctx=None, seed=0, decoder="cpu", threads=None, training=0):
    """This process's Data: one process takes the whole store; under torchrun (ctx.distributed) a rank takes the
    training images of D.stratified_share (every class in proportion; seeded, fixed for the run) and its contiguous
    part of the validation set. A raw store's training squares (this process's rows) go to the device when asked or
    when they fit beside `training` bytes (devices.store_place), else stay the memory-mapped file, from which each
    batch is gathered into pinned buffers. A JPEG store stays memory-mapped: a batch reads only its own records."""
    ctx = ctx or D.Context()
    train = (D.stratified_share(store.train.labels, ctx.rank, ctx.world_size, seed) if ctx.distributed
             else np.arange(len(store.train)))
    part = D.part(len(store.val), ctx.rank, ctx.world_size)
    val = np.arange(part.start, part.stop)
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, ctx.local_world_size))
    data = Data(store=store, train_rows=np.asarray(train, np.int64), val_rows=val,
                train_y=torch.from_numpy(store.train.labels[train]), val_y=torch.from_numpy(store.val.labels[val]),
                decoder=decoder, threads=threads, pool=ThreadPoolExecutor(threads, thread_name_prefix="decode"))
    if store.format == "raw":
        squares = store.train_pixels()
        data.where = devices.store_place(len(train) * squares[:1].nbytes, device, where, training=training)
        if data.where == "device":
            data.pixels = torch.empty((len(train),) + squares.shape[1:], dtype=torch.uint8, device=device)
            copy_rows(squares, train if ctx.distributed else range(len(train)), data.pixels)
            data.train_y = data.train_y.to(device)      # beside the pixels: a batch's indices pick both there
        else:           # the memory-mapped file itself, never pinned whole (the pinned allocator rounds up to 2^k)
            data.pixels, data.pixel_rows = torch.from_numpy(squares), torch.from_numpy(data.train_rows)
    return data


def copy_rows(src, rows, out, chunk_bytes=256 << 20):
    """Copies src[rows] into the tensor out (host, pinned or device memory): src a memory-mapped array, rows a range
    or an increasing index array. A chunk at a time, so only those rows' pages are read and host memory holds no
    more than one chunk besides out."""
    per = max(1, chunk_bytes // max(1, src[:1].nbytes))
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        pick = slice(chunk.start, chunk.stop) if isinstance(chunk, range) else chunk
        out[i:i + len(chunk)].copy_(torch.from_numpy(np.ascontiguousarray(src[pick])))


# ---------------------------------------------------------------------------------------------
# Training batches
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Draws:
    """An epoch's random choices, drawn at its start from the run's generator (so a resumed run draws the same):
    the order of this process's images, each one's crop box in its own pixels, and its flip. Host arrays: the
    decoding threads read them."""
    perm: np.ndarray      # int64 (n,)
    boxes: np.ndarray     # int64 (n, 4): top, left, height, width
    flips: np.ndarray     # bool (n,)


def draw_epoch(data, augment, generator, *, order=None):
    """An epoch's Draws as augment says (imagenet_fast.Augment): its order from the generator `order` (by default the
    same), the rest from generator."""
    n = len(data.train_rows)
    perm = torch.randperm(n, generator=order or generator)
    h, w = data.shapes("train")
    boxes = crop_boxes(h, w, scale=augment.crop_scale, ratio=augment.crop_ratio, generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5 if augment.flip else torch.zeros(n, dtype=torch.bool)
    return Draws(perm=perm.numpy(), boxes=boxes.numpy(), flips=flips.numpy())


def crop_resize(x, boxes, shapes, res):
    """Samples each image's box at res x res with one affine grid_sample for the batch: x float NCHW squares that
    hold each whole image stretched, boxes (top, left, h, w) in the image's own pixels of shapes (H, W)."""
    H, W = (t.to(x.device, x.dtype) for t in shapes)
    top, left, h, w = (b.to(x.device, x.dtype) for b in boxes.unbind(1))
    theta = torch.zeros(x.shape[0], 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = w / W, 2 * (left + w / 2) / W - 1
    theta[:, 1, 1], theta[:, 1, 2] = h / H, 2 * (top + h / 2) / H - 1
    grid = F.affine_grid(theta, (x.shape[0], x.shape[1], res, res), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def crop_resize_images(images, boxes, res):
    """The GPU decoder's crops: each CHW uint8 image's box (top, left, height, width: whole pixels) resized to
    res x res with antialiasing (as PIL does on the CPU path), stacked as float NCHW."""
    out = []
    for im, (top, left, h, w) in zip(images, boxes):
        out.append(F.interpolate(im[None, :, top:top + h, left:left + w].float(), size=(res, res), mode="bilinear",
                                 antialias=True, align_corners=False))
    return torch.cat(out)


def jitter(x, strength, generator):
    """Brightness, contrast and saturation, each x a factor uniform in 1 +- strength, per image
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


def finish(x, augment, *, generator, dtype, memory_format):
    """float NCHW crops on 0..255 -> jittered (augment.jitter), normalised compute-dtype batch."""
    if augment.jitter:
        x = jitter(x, augment.jitter, generator)
    return normalize(x).to(dtype).contiguous(memory_format=memory_format)


def gathered(x, y, perm, bs, *, device, rows=None):
    """(uint8 NHWC squares, labels) on the device for each full batch of perm (positions of y; rows[position] is the
    image's row of x, the position itself when rows is None), from a raw store's pixels. From host memory on a GPU:
    the next batch is gathered into one of two pinned buffers and copied on a side stream while the current one
    computes."""
    steps = len(perm) // bs
    x_perm = perm if rows is None else rows[perm]
    if devices.same(x.device, device) or not devices.overlaps(device):
        perm, x_perm = perm.to(y.device), x_perm.to(x.device)        # once an epoch
        for i in range(steps):
            yield x[x_perm[i * bs:(i + 1) * bs]].to(device), y[perm[i * bs:(i + 1) * bs]].to(device)
        return
    side = devices.side_stream(device)
    bufs = [(devices.host_buffer((bs,) + tuple(x.shape[1:]), x.dtype, device), devices.host_buffer(bs, y.dtype, device))
            for _ in range(2)]
    copied = [None, None]

    def load(i):
        b = i % 2
        if copied[b] is not None:
            devices.wait_host(copied[b])  # the buffer's previous copy must have left it
        torch.index_select(x, 0, x_perm[i * bs:(i + 1) * bs], out=bufs[b][0])
        torch.index_select(y, 0, perm[i * bs:(i + 1) * bs], out=bufs[b][1])
        with devices.on_stream(side):
            xb, yb = (t.to(device, non_blocking=True) for t in bufs[b])
            copied[b] = devices.record(side)
        return xb, yb, copied[b]

    nxt = load(0) if steps else None
    for i in range(steps):
        xb, yb, ev = nxt
        devices.wait(ev, device)
        devices.keep_alive(xb, device)
        devices.keep_alive(yb, device)
        if i + 1 < steps:
            nxt = load(i + 1)
        yield xb, yb


def decoded(data, split, jobs, *, device):
    """uint8 NHWC batches on the device, decoded on the CPU's threads: jobs are (store rows, boxes, output shape);
    the next batch decodes while the caller works on this one. Two host buffers take turns (pinned on a
    GPU, so the copy is asynchronous); a buffer is refilled only once its last copy has left it."""
    records_of = data.store.train if split == "train" else data.store.val
    raw = data.store.format == "raw"
    buffers, copied = [None, None], [None, None]

    def start(k, job):
        rows, boxes, (oh, ow) = job
        b = k % 2
        if copied[b] is not None:
            devices.wait_host(copied[b])       # the buffer's last copy must have left it
            copied[b] = None
        if buffers[b] is None or buffers[b][1].shape != (len(rows), oh, ow, 3):
            buffers[b] = devices.host_array((len(rows), oh, ow, 3), torch.uint8, device)
        out = buffers[b][1]
        records = [records_of.record(r) for r in rows]
        raw_shapes = ([(int(records_of.rows["height"][r]), int(records_of.rows["width"][r])) for r in rows]
                      if raw else None)
        edges = np.linspace(0, len(rows), min(data.threads, len(rows)) + 1).astype(int)
        futures = [data.pool.submit(decode_into, out[a:b_], records[a:b_], boxes[a:b_],
                                    None if raw_shapes is None else raw_shapes[a:b_])
                   for a, b_ in zip(edges[:-1], edges[1:]) if b_ > a]
        return b, futures

    jobs = list(jobs)
    pending = start(0, jobs[0]) if jobs else None
    for k in range(len(jobs)):
        b, futures = pending
        for f in futures:
            f.result()
        xb = buffers[b][0].to(device, non_blocking=True)
        if not devices.is_cpu(device):
            copied[b] = devices.record(device=device)
        if k + 1 < len(jobs):
            pending = start(k + 1, jobs[k + 1])
        yield xb


def gpu_decoded(data, jobs, *, device):
    """float NCHW crops on the device, nvJPEG-decoded (devices.decode_jpeg) a batch of whole images at a time, on a
    side stream of their own. nvJPEG writes its outputs from a stream of its own that waits on nothing (torchvision
    pull request 9606), so the side stream's earlier work is waited for first (nothing queued there can still read
    the memory it is given), the training stream waits for the crops, and they are kept alive for it."""
    side = devices.side_stream(device)
    for rows, boxes, (res, _) in jobs:
        devices.drain(side)
        with devices.on_stream(side):
            images = devices.decode_jpeg([data.store.train.record(r) for r in rows], device)
            crops = crop_resize_images(images, boxes.tolist(), res)
            done = devices.record(side)
        devices.wait(done, device)
        devices.keep_alive(crops, device)
        yield crops


def train_batches(data, augment, draws, *, res, batch_size, generator, device, dtype):
    """The training batches of one epoch in the order of draws.perm, each image cropped at its box, resized to res,
    flipped, jittered and normalised on the device; the last partial batch is dropped. The throughput benchmark
    reads the same batches."""
    bs, steps, memory_format = batch_size, len(draws.perm) // batch_size, devices.memory_format(device)
    if data.store.format == "raw":
        h, w = data.shapes("train")
        for i, (xb, yb) in enumerate(gathered(data.pixels, data.train_y, torch.from_numpy(draws.perm), bs,
                                              device=device, rows=data.pixel_rows)):
            idx = draws.perm[i * bs:(i + 1) * bs]
            x = crop_resize(xb.permute(0, 3, 1, 2).float(), torch.from_numpy(draws.boxes[idx]),
                            (torch.from_numpy(h[idx]), torch.from_numpy(w[idx])), res)
            flip = torch.from_numpy(draws.flips[idx]).to(device)
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            yield finish(x, augment, generator=generator, dtype=dtype, memory_format=memory_format), yb
        return
    order = [draws.perm[i * bs:(i + 1) * bs] for i in range(steps)]
    jobs = [(data.train_rows[idx], draws.boxes[idx], (res, res)) for idx in order]
    if data.decoder == "gpu":
        crops = gpu_decoded(data, jobs, device=device)
    else:
        crops = (xb.permute(0, 3, 1, 2).float() for xb in decoded(data, "train", jobs, device=device))
    for idx, x in zip(order, crops):
        flip = torch.from_numpy(draws.flips[idx]).to(device)
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        yield (finish(x, augment, generator=generator, dtype=dtype, memory_format=memory_format),
               data.train_y[torch.from_numpy(idx)].to(device, non_blocking=True))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def val_jobs(data, val, batch_size=256):
    """(positions in val_rows, store rows, boxes, output shape) per validation batch: this process's images grouped
    by output shape (val_view), so that a batch needs no padding; cut at batch_size."""
    h, w = data.shapes("val")
    views = [val_view(int(a), int(b), res=val.res, crop=val.crop,
                      max_aspect=data.store.index["settings"]["max_aspect"]) for a, b in zip(h, w)]
    order = sorted(range(len(views)), key=lambda i: views[i][1])
    jobs = []
    for i in range(0, len(order)):
        if not jobs or views[order[i]][1] != jobs[-1][3] or len(jobs[-1][0]) == batch_size:
            jobs.append(([], [], [], views[order[i]][1]))
        jobs[-1][0].append(order[i])
        jobs[-1][1].append(data.val_rows[order[i]])
        jobs[-1][2].append(views[order[i]][0])
    return jobs


@torch.no_grad()
def validation_sums(model, data, val, *, tta, device, dtype, batch_size=256):
    """Evaluation of the validation images this process holds, each seen as val_view says. The summed loss, top-1
    and top-5 counts and the number of images, as one tensor on the device (float64 where it has it, devices.sum_dtype):
    nothing waits for it."""
    was_training, memory_format = model.training, devices.memory_format(device)
    model.eval()
    totals = torch.tensor([0.0, 0.0, 0.0, len(data.val_rows)], dtype=devices.sum_dtype(device), device=device)
    jobs = val_jobs(data, val, batch_size)
    for (pos, _, _, _), xb in zip(jobs, decoded(data, "val", [(r, b, s) for _, r, b, s in jobs], device=device)):
        y = data.val_y[pos].to(device)
        x = normalize(xb.permute(0, 3, 1, 2).float()).to(dtype).contiguous(memory_format=memory_format)
        with devices.autocast(device, dtype):
            logits = model(x).float()
            if tta == "flip":
                logits = (logits + model(x.flip(3)).float()) / 2
        top = logits.topk(min(5, logits.shape[1]), 1).indices
        totals[:3] += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (top[:, 0] == y).sum(),
                                   (top == y[:, None]).any(1).sum()]).to(totals.dtype)
    model.train(was_training)
    return totals


def evaluate(model, data, val, *, tta, device, dtype, ctx=None, batch_size=256):
    """Mean loss, top-1 and top-5 accuracy over the validation set (validation_sums, read once). Under torchrun each
    rank evaluates the part it holds (place) and the sums are added over ranks, so every rank returns the whole
    set's figures."""
    totals = validation_sums(model, data, val, tta=tta, device=device, dtype=dtype, batch_size=batch_size)
    if ctx is not None and ctx.distributed:
        torch.distributed.all_reduce(totals)
    loss, top1, top5, m = totals.tolist()
    return loss / m, top1 / m, top5 / m
