"""ImageNet batches from the store (imagenet_store.py): this process's share placed (and, of a JPEG store under
torchrun, dealt anew each epoch), random-resized crops of the whole image drawn as torchvision defines them, decoded
one batch ahead in the CPU's worker processes (imagenet_workers.py) or on the GPU (imagenet_decoders.py), augmented
on the device with no wait for the host; and the validation views. The settings they read: CropAugmentSettings and
ValidationSettings.

Training crops follow torchvision's RandomResizedCrop.get_params exactly (crop_boxes): the area a fraction of the
image's uniform in `crop_scale`, the log aspect uniform in log `crop_ratio`, whole pixels, the first of 10 draws that
fits, else a centre crop. A JPEG store's crop is decoded on the CPU at the smallest DCT scale that still holds it
(imagenet_decoders.cpu_crop), or on a GPU the batch's images are decoded (imagenet_decoders.jpeg_decoder chooses the
decoder) and all its crops are resized at once with PIL's antialiased bilinear filter (crop_resize_images). A raw
store keeps each training image stretched to a square, so a box of the image is a box of the square: sampled with
one affine grid for the batch on the device.
"""
import math
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import devices
import distributed as D
from imagenet_decoders import GPU_DECODERS, check_cpu_decoder, decodes_crops, gpu_row_images
from imagenet_store import val_shape
from imagenet_workers import STAGED, decode_part, decoding_pool, default_workers, staging
from settings import check_own, flag_error, knob, numbers

MEAN = (123.675, 116.28, 103.53)  # the usual ImageNet statistics, 0..255 scale
STD = (58.395, 57.12, 57.375)


# ---------------------------------------------------------------------------------------------
# Where a crop is, and what validation sees
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CropAugmentSettings:
    """torchvision's random-resized crops of the whole image (their area and aspect ratio ranges), a random flip,
    and brightness, contrast and saturation jitter of +- jitter."""
    PREFIX = ""
    crop_scale: tuple = numbers((0.08, 1.0), above=0, high=1, doc="the random-resized crops' area, a range of "
                                "fractions of the image")
    crop_ratio: tuple = numbers((3 / 4, 4 / 3), above=0, doc="the random-resized crops' aspect ratio, a range")
    flip: bool = knob(True, doc="random horizontal flips")
    jitter: float = knob(0.0, low=0, doc="brightness, contrast and saturation jitter of +- this (0: none)")

    def __post_init__(self):
        check_own(self)

    def check(self):
        if self.crop_scale[0] > self.crop_scale[-1] or len(self.crop_scale) != 2:
            raise flag_error("crop_scale", self.crop_scale, "must be two fractions, 0 < low <= high <= 1")
        if self.crop_ratio[0] > self.crop_ratio[-1] or len(self.crop_ratio) != 2:
            raise flag_error("crop_ratio", self.crop_ratio, "must be two aspect ratios, 0 < low <= high")


@dataclass(frozen=True, kw_only=True)
class ValidationSettings:
    """What validation sees (val_view): the centre crop of side crop x the shorter side resized to res
    (crop 0: the whole image, shorter side res); tta flip adds each image's mirror."""
    PREFIX = "val"
    res: int = knob(256, above=0, whole=True, doc="validation's shorter side, in pixels")
    crop: float = knob(0.875, low=0, high=1, doc="validation's centre crop, a fraction of the shorter side (0: the "
                       "whole image)")
    tta: str = knob("flip", choices=("none", "flip"), flag="tta", doc="flip: each validation image and its mirror")

    def __post_init__(self):
        check_own(self)


def crop_boxes(heights, widths, *, scale, ratio, generator, tries=10):
    """torchvision's RandomResizedCrop.get_params for n images at once: (n, 4) int64 boxes (top, left, height, width)
    in each image's pixels, of area x U(scale) and aspect exp(U(log ratio)): the first of `tries` that fits, at a
    uniform offset, else the largest centred crop with its aspect clamped into `ratio`."""
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
    """What validation sees of an image: (box (top, left, height, width) in its pixels, output (height, width));
    crop > 0: the centred square of side crop x the shorter side at res x res (FFCV, torchvision); crop 0: the whole
    image at shorter side res, the longer rounded and capped at max_aspect x res (val_shape)."""
    if crop:
        side = crop * min(height, width)
        return ((height - side) / 2, (width - side) / 2, side, side), (res, res)
    ow, oh = val_shape(width, height, res, max_aspect=max_aspect, step=max(1, res // 8))
    s = max(ow / width, oh / height)
    bw, bh = min(width, ow / s), min(height, oh / s)
    return ((height - bh) / 2, (width - bw) / 2, bh, bw), (oh, ow)


# ---------------------------------------------------------------------------------------------
# This process's share of the store
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class RankData:
    """What this process trains and validates on: train_rows / val_rows index the store's splits (under torchrun a
    raw store's train_rows are this rank's share, a JPEG store's the whole split, dealt each epoch by shares, its
    (rank, world)); pixels: a raw store's training squares (on the device, pinned, or memory-mapped)."""
    store: object
    train_rows: np.ndarray
    val_rows: np.ndarray
    train_y: np.ndarray
    val_y: np.ndarray
    pixels: torch.Tensor = None
    pixel_rows: np.ndarray = None     # the row of pixels of each of train_rows (None: the same position)
    where: str = "host"
    decoder: str = "cpu"              # "cpu": simplejpeg in `workers` processes; "gpu": nvJPEG through torchvision;
    #                                   "nvimgcodec": nvImageCodec, decoding each crop box alone
    workers: int = 1
    shares: tuple = None              # (rank, world): each epoch deals this rank a new share of train_rows
    decoded: Counter = field(default_factory=Counter)    # images decoded so far by each path (nvjpeg_paths)
    pool: ProcessPoolExecutor = field(default=None, repr=False)
    staging: dict = field(default_factory=dict, repr=False)

    def shapes(self, split="train"):
        rows = self.store.train.rows[self.train_rows] if split == "train" else self.store.val.rows[self.val_rows]
        return rows["height"].astype(np.int64), rows["width"].astype(np.int64)

    def per_epoch(self):
        """How many images this process trains on in an epoch."""
        return len(self.train_rows) // (self.shares[1] if self.shares else 1)


def rank_data(store, device, *, where="auto", ctx=None, seed=0, decoder="cpu", workers=None, training=0):
    """This process's RankData: the whole store, or under torchrun its part of the validation set and, of a raw store,
    its fixed D.stratified_share of training images (a JPEG store's is dealt each epoch). Raw training squares go to
    the device when asked or when they fit beside `training` bytes (devices.store_place), else stay mapped."""
    ctx = ctx or D.Context()
    fixed = ctx.distributed and store.format == "raw"
    train = (D.stratified_share(store.train.labels, ctx.rank, ctx.world_size, seed) if fixed
             else np.arange(len(store.train)))
    rows = D.uneven_shard(len(store.val), ctx.rank, ctx.world_size)
    val = np.arange(rows.start, rows.stop)
    if store.format == "jpeg" and decoder == "cpu":
        check_cpu_decoder()
    workers = workers or default_workers(ctx.local_world_size)
    data = RankData(store=store, train_rows=np.asarray(train, np.int64), val_rows=val,
                    train_y=store.train.labels[train], val_y=store.val.labels[val], decoder=decoder, workers=workers,
                    shares=(ctx.rank, ctx.world_size) if ctx.distributed and not fixed else None)
    if store.format == "raw":
        squares = store.train_pixels()
        data.where = devices.store_place(len(train) * squares[:1].nbytes, device, where, training=training)
        if data.where == "device":
            data.pixels = torch.empty((len(train),) + squares.shape[1:], dtype=torch.uint8, device=device)
            copy_rows(squares, train if fixed else range(len(train)), data.pixels)
        else:           # the memory-mapped file itself, never pinned whole (the pinned allocator rounds up to 2^k)
            data.pixels, data.pixel_rows = torch.from_numpy(squares), data.train_rows
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
# An epoch's draws
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Draws:
    """An epoch's random choices, drawn at its start from the run's generators (so a resumed run draws the same): the
    order of the images this process trains on (positions in train_rows), and for each position its crop box in its
    own pixels, its flip and its jitter factors. Host arrays: the decoding workers read them."""
    perm: np.ndarray      # int64 (m,)
    boxes: np.ndarray     # int64 (n, 4): top, left, height, width
    flips: np.ndarray     # bool (n,)
    factors: np.ndarray = None    # float32 (n, 3): brightness, contrast, saturation (None: no jitter)


def draw_epoch(data, augment, generator, *, order=None, epoch_seed=0):
    """An epoch's Draws as augment says (Augment): its order from the generator `order` (by default the
    same), the rest from generator. With data.shares, this rank's share of the epoch is D.stratified_share of
    epoch_seed (the same on every rank, so that the shares are disjoint and cover the store)."""
    n = len(data.train_rows)
    share = (np.arange(n) if data.shares is None else
             D.stratified_share(data.train_y, *data.shares, seed=epoch_seed))
    perm = share[torch.randperm(len(share), generator=order or generator).numpy()]
    h, w = data.shapes("train")
    boxes, flips = np.zeros((n, 4), np.int64), np.zeros(n, bool)
    boxes[share] = crop_boxes(h[share], w[share], scale=augment.crop_scale, ratio=augment.crop_ratio,
                              generator=generator).numpy()
    if augment.flip:
        flips[share] = (torch.rand(len(share), generator=generator) < 0.5).numpy()
    draws = Draws(perm=perm, boxes=boxes, flips=flips)
    if augment.jitter:
        draws.factors = np.ones((n, 3), np.float32)
        s = augment.jitter
        draws.factors[share] = (1 + s * (2 * torch.rand(len(share), 3, generator=generator) - 1)).numpy()
    return draws


# ---------------------------------------------------------------------------------------------
# Training batches
# ---------------------------------------------------------------------------------------------

TOP, LEFT, HEIGHT, WIDTH, IMAGE_H, IMAGE_W, FLIP, LABEL, PIXEL_ROW = range(9)    # the rows of a batch's index
CONSTANTS = np.array([MEAN, STD, (0.299, 0.587, 0.114)], np.float32)          # normalisation, and grey's weights


def batch_index(data, draws, idx, shapes):
    """The small host arrays of the batch of positions idx: an int64 (9, n) index (TOP ... PIXEL_ROW: its box, its
    image's shape, flip, label, row of pixels) and, with jitter, its float32 (3, n) factors. shapes:
    data.shapes("train"), read once an epoch (a gather over every training row)."""
    h, w = shapes
    pixel = idx if data.pixel_rows is None else data.pixel_rows[idx]
    index = np.stack([*draws.boxes[idx].T, h[idx], w[idx], draws.flips[idx], data.train_y[idx], pixel])
    return (index,) if draws.factors is None else (index, np.ascontiguousarray(draws.factors[idx].T))


def crop_resize(x, index, res):
    """Samples each image's box at res x res with one affine grid_sample for the batch: x float NCHW squares that
    hold each whole image stretched; index the batch's (batch_index) on x's device."""
    H, W = (index[k].to(x.dtype) for k in (IMAGE_H, IMAGE_W))
    top, left, h, w = (index[k].to(x.dtype) for k in (TOP, LEFT, HEIGHT, WIDTH))
    theta = torch.zeros(x.shape[0], 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = w / W, 2 * (left + w / 2) / W - 1
    theta[:, 1, 1], theta[:, 1, 2] = h / H, 2 * (top + h / 2) / H - 1
    grid = F.affine_grid(theta, (x.shape[0], x.shape[1], res, res), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def filter_matrix(start, length, size, res):
    """(n, res, size) float32: row i of image k holds the weights of the input pixels start[k] ... start[k] +
    length[k] - 1 (of `size`) in output pixel i, as F.interpolate's antialiased bilinear filter (and PIL's) weighs
    them: w(j) = max(0, 1 - |j + 1/2 - c_i| / s) normalised over the pixels j that overlap the box (a fractional
    start: a validation view's), c_i = (i + 1/2) s, s = max(1, length / res)."""
    n, device = len(start), start.device
    length = length.to(torch.float32).view(n, 1, 1)
    scale = length / res
    support = scale.clamp(min=1)
    j = torch.arange(size, device=device, dtype=torch.float32).view(1, 1, size) - start.to(torch.float32).view(n, 1, 1)
    centre = scale * (torch.arange(res, device=device, dtype=torch.float32).view(1, res, 1) + 0.5)
    weights = (1 - ((j + 0.5 - centre) / support).abs()).clamp(min=0) * ((j > -1) & (j < length))
    return weights / weights.sum(2, keepdim=True)


def padded(images, dtype):
    """CHW images of different sizes as one (n, C, H, W) batch in dtype, zero beyond each image: one copy an image
    into a zeroed batch of the largest height and width. Their sizes are the host's already (a GPU tensor's shape
    is host metadata), so nothing waits for the device, where a nested tensor's to_padded_tensor copies its sizes
    to the GPU from pageable memory and waits for it."""
    sizes = [im.size() for im in images]
    height, width = max(c for _, c, _ in sizes), max(c for _, _, c in sizes)
    out = torch.zeros(len(images), sizes[0][0], height, width, dtype=dtype, device=images[0].device)
    for i, (im, (_, h, w)) in enumerate(zip(images, sizes)):
        out[i, :, :h, :w].copy_(im)
    return out


def crop_resize_images(images, boxes, res, *, dtype=torch.float32):
    """The GPU decoder's crops, all at once: each CHW uint8 image's box (a (4, n) tensor of top, left, height, width
    on the images' device, whole or fractional pixels) resized to res x res (or res = (height, width)) with
    F.interpolate's (and PIL's) antialiased bilinear filter, as float NCHW, by two batched matrix products
    (filter_matrix) in `dtype` over the images padded into one batch (padded)."""
    oh, ow = (res, res) if isinstance(res, int) else res
    x = padded(images, dtype)
    top, left, h, w = boxes.unbind(0)
    rows = filter_matrix(top, h, x.shape[2], oh).to(dtype)
    cols = filter_matrix(left, w, x.shape[3], ow).to(dtype)
    return (rows.unsqueeze(1) @ x @ cols.transpose(1, 2).unsqueeze(1)).float()


def jitter(x, factors, grey):
    """Brightness, contrast and saturation, each x a factor per image (factors (3, n); grey's weights (3,)), on
    float NCHW on 0..255."""
    f = factors.view(3, -1, 1, 1, 1)
    x = x * f[0]
    mean = x.mean((1, 2, 3), keepdim=True)
    x = (x - mean) * f[1] + mean
    gray = (x * grey.view(1, 3, 1, 1)).sum(1, keepdim=True)
    return ((x - gray) * f[2] + gray).clamp(0, 255)


def normalise(x, constants):
    """(x - mean) / std per channel: constants is CONSTANTS on x's device."""
    return (x - constants[0].view(1, 3, 1, 1)) / constants[1].view(1, 3, 1, 1)


def normalised_batch(x, factors, constants, *, dtype, memory_format):
    """float NCHW crops on 0..255 -> jittered (factors, or None), normalised compute-dtype batch."""
    if factors is not None:
        x = jitter(x, factors, constants[2])
    return normalise(x, constants).to(dtype).contiguous(memory_format=memory_format)


def on_device(arrays, device):
    """A batch's small host arrays on the device (devices.to_device: nothing waits)."""
    return tuple(devices.to_device(a, device) for a in arrays)


def handed_over(done, device, tensors):
    """The device's current stream waits for the event done of a side stream, and the tensors made there are kept
    for it (devices.keep_alive)."""
    devices.wait(done, device)
    for t in tensors:
        devices.keep_alive(t, device)


def raw_batches(data, smalls, *, device):
    """(uint8 NHWC squares, the batch's small tensors) on the device for each batch's small host arrays
    (batch_index), from a raw store's pixels: gathered there when they are on the device; from host memory to a GPU,
    into two alternating pinned buffers, copied on a side stream while the current batch computes."""
    x = data.pixels
    if devices.same(x.device, device) or not devices.overlaps(device):
        for arrays in smalls:
            small = on_device(arrays, device)
            yield x[small[0][PIXEL_ROW] if x.device == small[0].device else arrays[0][PIXEL_ROW]].to(device), small
        return
    side = devices.side_stream(device)
    bufs, copied = [None, None], [None, None]

    def load(i):
        b, rows = i % 2, torch.from_numpy(smalls[i][0][PIXEL_ROW])
        if copied[b] is not None:
            devices.wait_host(copied[b])  # the buffer's previous copy must have left it
        if bufs[b] is None or len(bufs[b]) != len(rows):
            bufs[b] = devices.host_buffer((len(rows),) + tuple(x.shape[1:]), x.dtype, device)
        torch.index_select(x, 0, rows, out=bufs[b])
        with devices.on_stream(side):
            xb, small = bufs[b].to(device, non_blocking=True), on_device(smalls[i], device)
            copied[b] = devices.record(side)
        return xb, small, copied[b]

    nxt = load(0) if smalls else None
    for i in range(len(smalls)):
        xb, small, done = nxt
        handed_over(done, device, (xb, *small))
        if i + 1 < len(smalls):
            nxt = load(i + 1)
        yield xb, small


def cpu_batches(data, split, jobs, *, device):
    """(uint8 NHWC batch, its small tensors) on the device for each job (store rows, boxes, output shape, small host
    arrays), decoded by the worker processes (decoding_pool) into STAGED shared buffers, STAGED - 1 batches ahead (and
    counted in data.decoded, as "cpu", or "raw" for a raw store's validation); on
    a GPU copied through two pinned buffers on a side stream, a buffer refilled only once its last copy has left it."""
    pool, side, jobs = decoding_pool(data), devices.side_stream(device), list(jobs)
    pinned, copied, pending = [None, None], [None, None], {}

    def submit_batch(k):
        rows, boxes, (oh, ow), _ = jobs[k]
        shape = (len(rows), oh, ow, 3)
        data.decoded["cpu" if data.store.format == "jpeg" else "raw"] += len(rows)
        path, buffer = staging(data, k % STAGED, math.prod(shape))
        edges = np.linspace(0, len(rows), min(data.workers, len(rows)) + 1).astype(int)
        pending[k] = shape, buffer, [pool.submit(decode_part, split, path, shape=shape, start=a, rows=rows[a:z],
                                                 boxes=boxes[a:z]) for a, z in zip(edges[:-1], edges[1:]) if z > a]

    try:
        for k in range(min(STAGED - 1, len(jobs))):
            submit_batch(k)
        for k in range(len(jobs)):
            if k + STAGED - 1 < len(jobs):
                submit_batch(k + STAGED - 1)   # into the buffer of batch k - 1, which the caller is done with
            (shape, buffer, futures), b = pending.pop(k), k % 2
            for f in futures:
                f.result()
            host = torch.from_numpy(buffer[:math.prod(shape)].reshape(shape))
            if devices.overlaps(device):
                devices.wait_host(copied[b])       # the pinned buffer's last copy must have left it
                if pinned[b] is None or pinned[b].numel() < host.numel():
                    pinned[b] = devices.host_buffer(host.numel(), torch.uint8, device)
                host = pinned[b][:host.numel()].view(shape).copy_(host)
            with devices.on_stream(side):
                xb, small = host.to(device, non_blocking=True), on_device(jobs[k][3], device)
                copied[b] = devices.record(side)
            handed_over(copied[b], device, (xb, *small))
            yield xb, small
    finally:            # left early: the next user of the staging buffers must not meet this one's writers
        futures = [f for _, _, fs in pending.values() for f in fs]
        for f in futures:
            f.cancel()
        wait(futures)


def gpu_batches(data, split, jobs, *, device):
    """(float NCHW crops, the batch's small tensors) on the device for each job (store rows of split, output side or
    (height, width), small host arrays: the first holds the boxes, at rows TOP ... WIDTH of a training batch's index,
    or as float32 (4, n) of a validation batch's): the images nvJPEG-decoded (decode_jpeg) in a thread while
    the training thread queues the step before, then cropped and resized (crop_resize_images) on a side stream the
    training stream waits for; with nvImageCodec (decodes_crops) each training image just its crop box.
    Which of nvJPEG's paths took each image is added to data.decoded (gpu_images)."""
    side, jobs = devices.side_stream(device), list(jobs)
    # a thread of its own: torchvision's batched decode holds its calling thread until the decode ends
    reader = ThreadPoolExecutor(1, thread_name_prefix="nvjpeg")
    cropped = split == "train" and decodes_crops(data.decoder)     # just each crop: boxes from (0, 0)
    try:
        pending = (decode_ahead(reader, data, split, jobs[0], side=side, device=device, cropped=cropped) if jobs
                   else None)
        for k, (_, res, arrays) in enumerate(jobs):
            images = pending.result()
            with devices.on_stream(side):
                small = on_device(arrays, device)
                boxes = small[0][TOP:WIDTH + 1] if split == "train" else small[0]
                if cropped:
                    boxes = torch.cat([torch.zeros_like(boxes[:2]), boxes[2:]])
                crops = crop_resize_images(images, boxes, res, dtype=devices.resize_dtype(device))
                done = devices.record(side)
            del images
            if k + 1 < len(jobs):
                pending = decode_ahead(reader, data, split, jobs[k + 1], side=side, device=device,
                                       cropped=cropped)
            handed_over(done, device, (crops, *small))
            yield crops, small
    finally:
        reader.shutdown(cancel_futures=True)


def decode_ahead(reader, data, split, job, *, side, device, cropped):
    """The future of a job's images (gpu_batches's job: store rows of split, output shape, small host arrays)
    decoded by data.decoder in the reader thread (gpu_row_images); cropped: each just its box (the training
    index's)."""
    rows, _, arrays = job
    boxes = arrays[0][TOP:WIDTH + 1].T if cropped else None
    return reader.submit(gpu_row_images, data, split, rows, side, device=device, boxes=boxes)


def batch_indices(data, draws, batch_size):
    """batch_index's small host arrays of each whole batch of draws.perm, in order."""
    bs, shapes = batch_size, data.shapes("train")
    return [batch_index(data, draws, draws.perm[i * bs:(i + 1) * bs], shapes) for i in range(len(draws.perm) // bs)]


@dataclass(kw_only=True)
class EpochWork:
    """An epoch's host work, done before it starts: its Draws (cut to its whole batches), each batch's small host
    arrays (batch_indices) and the states of the run's generators (order, augmentation) once they are drawn."""
    draws: Draws
    smalls: list
    states: list


def train_batches(data, augment, draws, *, res, batch_size, device, dtype, smalls=None):
    """The training batches of one epoch in the order of draws.perm (the last partial batch dropped), each image
    cropped at its box, resized to res, flipped, jittered and normalised on the device; the small tensors come from
    pinned memory, so nothing waits for the device (smalls: batch_indices's, when made ahead). The throughput
    benchmark reads the same batches."""
    bs, memory_format = batch_size, devices.memory_format(device)
    order = [draws.perm[i * bs:(i + 1) * bs] for i in range(len(draws.perm) // bs)]
    smalls = batch_indices(data, draws, bs) if smalls is None else smalls
    constants = devices.to_device(CONSTANTS, device)
    if data.store.format == "raw":
        wide = devices.wide_dtype(dtype)
        batches = ((crop_resize(xb.permute(0, 3, 1, 2).to(wide), small[0], res), small)
                   for xb, small in raw_batches(data, smalls, device=device))
    elif data.decoder in GPU_DECODERS:
        batches = gpu_batches(data, "train", [(data.train_rows[idx], res, s) for idx, s in zip(order, smalls)],
                              device=device)
    else:
        jobs = [(data.train_rows[idx], draws.boxes[idx], (res, res), s) for idx, s in zip(order, smalls)]
        batches = ((xb.permute(0, 3, 1, 2).to(devices.wide_dtype(dtype)), small)
                   for xb, small in cpu_batches(data, "train", jobs, device=device))
    for x, small in batches:
        x = torch.where(small[0][FLIP].bool().view(-1, 1, 1, 1), x.flip(3), x)
        yield (normalised_batch(x, small[1] if len(small) > 1 else None, constants, dtype=dtype,
                                memory_format=memory_format),
               small[0][LABEL])


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


def val_batches(data, val, batch_size, *, device):
    """(float NCHW images on 0..255, labels) on the device for each validation batch (val_jobs), decoded where
    training decodes: by nvJPEG with --decoder gpu (a JPEG store), else by the CPU's workers."""
    jobs = val_jobs(data, val, batch_size)
    if data.store.format == "jpeg" and data.decoder in GPU_DECODERS:
        gpu_jobs = [(r, s, (np.asarray(b, np.float32).T.copy(), data.val_y[pos])) for pos, r, b, s in jobs]
        return ((x, small[1]) for x, small in gpu_batches(data, "val", gpu_jobs, device=device))
    cpu_jobs = [(r, b, s, (data.val_y[pos],)) for pos, r, b, s in jobs]
    return ((xb.permute(0, 3, 1, 2).float(), y) for xb, (y,) in cpu_batches(data, "val", cpu_jobs, device=device))


@torch.no_grad()
def validation_sums(model, data, val, *, tta, device, dtype, batch_size=256):
    """Evaluation of the validation images this process holds, each seen as val_view says. The summed loss, top-1
    and top-5 counts and the number of images, as one tensor on the device (devices.widest_float): nothing waits for
    it."""
    was_training, memory_format = model.training, devices.memory_format(device)
    model.eval()
    totals = torch.zeros(4, dtype=devices.widest_float(device), device=device)
    totals[3] = len(data.val_rows)
    constants = devices.to_device(CONSTANTS, device)
    for x, y in val_batches(data, val, batch_size, device=device):
        x = normalise(x.to(devices.wide_dtype(dtype)), constants).to(dtype).contiguous(memory_format=memory_format)
        with devices.autocast(device, dtype):
            logits = devices.float32_or_wider(model(x))
            if tta == "flip":
                logits = (logits + devices.float32_or_wider(model(x.flip(3)))) / 2
        top = logits.topk(min(5, logits.shape[1]), 1).indices
        totals[:3] += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (top[:, 0] == y).sum(),
                                   (top == y[:, None]).any(1).sum()]).to(totals.dtype)
    model.train(was_training)
    return totals


def loss_top1_top5(model, data, val, *, tta, device, dtype, ctx=None, batch_size=256):
    """Mean loss, top-1 and top-5 accuracy over the validation set (validation_sums, read once). Under torchrun each
    rank evaluates the part it holds (place) and the sums are added over ranks, so every rank returns the whole
    set's figures."""
    totals = validation_sums(model, data, val, tta=tta, device=device, dtype=dtype, batch_size=batch_size)
    if ctx is not None and ctx.distributed:
        torch.distributed.all_reduce(totals)
    loss, top1, top5, m = totals.tolist()
    return loss / m, top1 / m, top5 / m
