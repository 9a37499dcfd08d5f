"""Everything that touches tensors: CIFAR-10 loading, the device-resident dataset, batched
augmentation, models, optimiser, the training and evaluation loops.

Hyperparameters arrive as one flat dict (a recipe from cifar10_fast.py, where every key is
named once in BASE); `grep 'hp\\["name"\\]'` finds where a hyperparameter acts.
"""
import copy
import hashlib
import io
import math
import os
import pickle
import sys
import tarfile
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import distributed as D
from core import PiecewiseLinear, Timer, write_atomic

# ---------------------------------------------------------------------------------------------
# Data on disk
# ---------------------------------------------------------------------------------------------

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = {"name": "cifar-10-python.tar.gz", "md5": "c58f30108f718f92721af3b95e74349a", "size": 170498071}
CACHE_NAME = "cifar10_uint8.npz"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
KEYS = ("train_images", "train_labels", "test_images", "test_labels")
# Per-channel statistics of the 50,000 training images (0..255 scale).
MEAN = (125.307, 122.950, 113.865)
STD = (62.993, 62.089, 66.705)


class DataError(Exception):
    """Bad or missing data: the message names the file and what is wrong."""


def _progress(done, total, what):
    out = sys.stderr
    if total:
        pct = 100 * done / total
        bar = "#" * int(pct // 4)
        out.write(f"\r{what}: [{bar:<25}] {pct:5.1f}% {done / 2**20:7.1f}/{total / 2**20:.1f} MiB")
    else:
        out.write(f"\r{what}: {done / 2**20:7.1f} MiB")
    out.flush()


def download(url, path, progress=True):
    """Download url to path (via a temporary name, renamed only when complete)."""
    def write(tmp):
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
                total, done = int(r.headers.get("Content-Length") or 0), 0
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    done += len(chunk)
                    if progress:
                        _progress(done, total, f"downloading {Path(path).name}")
            if progress:
                sys.stderr.write("\n")
        except OSError as e:
            raise DataError(f"{url}: download failed ({e}); put {Path(path).name} in {Path(path).parent} by hand") from e
    write_atomic(path, write)


def verify_archive(path, spec):
    """Size and md5 checks; spec values of None skip that check."""
    size = path.stat().st_size
    if spec.get("size") and size < spec["size"]:
        raise DataError(f"{path}: truncated archive ({size} of {spec['size']} bytes); delete it and run again")
    if spec.get("md5"):
        md5 = hashlib.md5()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                md5.update(chunk)
        if md5.hexdigest() != spec["md5"]:
            raise DataError(f"{path}: checksum mismatch (md5 {md5.hexdigest()}, expected {spec['md5']}); delete it and run again")


def _batches_to_arrays(read, where):
    """Builds the four arrays from the official pickles; read(name) returns a pickle's bytes."""
    def load(name):
        try:
            d = pickle.loads(read(name), encoding="bytes")
            x = np.asarray(d[b"data"], dtype=np.uint8)
            y = np.asarray(d[b"labels"])
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}/{name}: not a CIFAR-10 batch ({type(e).__name__}: {e})") from e
        if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
            raise DataError(f"{where}/{name}: wrong shapes (data {x.shape}, labels {y.shape}); expected (N, 3072) and (N,)")
        return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y
    train = [load(f"data_batch_{i}") for i in range(1, 6)]
    test = load("test_batch")
    return {"train_images": np.concatenate([x for x, _ in train]), "train_labels": np.concatenate([y for _, y in train]),
            "test_images": test[0], "test_labels": test[1]}


def read_archive(path):
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

            def read(name):
                if name not in members:
                    raise DataError(f"{path}: {name} missing from the archive")
                return tar.extractfile(members[name]).read()
            return _batches_to_arrays(read, path)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{path}: truncated or corrupt archive ({e})") from e


def read_batches_dir(folder):
    def read(name):
        f = folder / name
        if not f.is_file():
            raise DataError(f"{f}: missing")
        return f.read_bytes()
    return _batches_to_arrays(read, folder)


def read_npz(path):
    try:
        with np.load(path) as z:
            missing = [k for k in KEYS if k not in z.files]
            if missing:
                raise DataError(f"{path}: missing arrays {missing}; expected {list(KEYS)}")
            return {k: z[k] for k in KEYS}
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: not a readable .npz ({type(e).__name__}: {e})") from e


def check_arrays(d, source):
    """Raises DataError unless d holds uint8 (N,32,32,3) images and matching labels in 0..9."""
    for split in ("train", "test"):
        x, y = d[f"{split}_images"], d[f"{split}_labels"]
        if x.dtype != np.uint8:
            raise DataError(f"{source}: {split}_images has dtype {x.dtype}, expected uint8")
        if x.ndim != 4 or x.shape[1:] != (32, 32, 3) or len(x) == 0:
            raise DataError(f"{source}: {split}_images has shape {x.shape}, expected (N, 32, 32, 3) with N > 0")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{source}: {split}_labels has shape {y.shape}, expected ({len(x)},)")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{source}: {split}_labels has dtype {y.dtype}, expected integers")
        if y.min() < 0 or y.max() >= len(CLASSES):
            raise DataError(f"{source}: {split}_labels out of range ({y.min()}..{y.max()}), expected 0..{len(CLASSES) - 1}")
    return {k: (d[k].astype(np.uint8) if k.endswith("labels") else d[k]) for k in KEYS}


def write_cache(path, d):
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **d)  # uncompressed: the next start reads 184 MB straight from the page cache
    write_atomic(path, write)


def load_cifar10(path="data", download_ok=True, archive=CIFAR10_ARCHIVE, url=CIFAR10_URL, progress=True):
    """CIFAR-10 as four numpy arrays (images uint8 NHWC, labels uint8).

    `path` is a .npz file with train_images/train_labels/test_images/test_labels, an unpacked
    `cifar-10-batches-py/` folder, or a data folder. In a data folder the cache file is used if
    present; otherwise the official archive is read (downloaded first if absent), verified, and
    the arrays are cached there as one uncompressed .npz.
    """
    p = Path(path)
    if p.suffix == ".npz":
        if not p.is_file():
            raise DataError(f"{p}: no such file")
        return check_arrays(read_npz(p), p)
    if p.exists() and not p.is_dir():
        raise DataError(f"{p}: expected a .npz file or a folder")
    if (p / "data_batch_1").is_file():
        return check_arrays(read_batches_dir(p), p)
    cache = p / CACHE_NAME
    if cache.is_file():
        return check_arrays(read_npz(cache), cache)
    if (p / "cifar-10-batches-py" / "data_batch_1").is_file():
        d = check_arrays(read_batches_dir(p / "cifar-10-batches-py"), p / "cifar-10-batches-py")
    else:
        tgz = p / archive["name"]
        if not tgz.is_file():
            if not download_ok:
                raise DataError(f"{tgz}: not found and downloading is off")
            p.mkdir(parents=True, exist_ok=True)
            download(url, tgz, progress)
        verify_archive(tgz, archive)
        d = check_arrays(read_archive(tgz), tgz)
    write_cache(cache, d)
    return d


# ---------------------------------------------------------------------------------------------
# The dataset on the device, and batched augmentation
# ---------------------------------------------------------------------------------------------

def to_device(d, device, dtype, pad):
    """Uploads uint8 once; normalises (and reflect-pads the training images) once, on the device."""
    def prep(x, p):
        x = torch.from_numpy(x).to(device).permute(0, 3, 1, 2).float()
        mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        x = (x - mean) / std
        return (F.pad(x, (p,) * 4, mode="reflect") if p else x).to(dtype)
    return {"train_images": prep(d["train_images"], pad), "test_images": prep(d["test_images"], 0),
            "train_labels": torch.from_numpy(d["train_labels"]).to(device).long(),
            "test_labels": torch.from_numpy(d["test_labels"]).to(device).long()}


def draw_augmentation(n, size, pad, flip, cutout, generator, epoch=0, flip_base=None):
    """Every random number for one epoch of n images, in at most five calls whatever n is.

    flip="random" flips each image with probability 1/2 every epoch; flip="alternate" (Jordan 2024)
    flips image i in epoch e iff flip_base[i] xor (e odd), so every image is seen both ways in any two
    consecutive epochs; flip_base is drawn once per run (see flip_bits).
    """
    device = generator.device
    r = {"perm": torch.randperm(n, device=device, generator=generator)}
    if pad:
        r["dy"], r["dx"] = torch.randint(0, 2 * pad + 1, (2, n), device=device, generator=generator)
    if flip == "random":
        r["flip"] = flip_bits(n, generator)
    elif flip == "alternate":
        r["flip"] = flip_base ^ bool(epoch % 2)
    elif flip != "none":
        raise ValueError(f"flip must be none, random or alternate, not {flip!r}")
    if cutout:
        r["cy"], r["cx"] = torch.randint(0, size - cutout + 1, (2, n), device=device, generator=generator)
    return r


def flip_bits(n, generator):
    return torch.rand(n, device=generator.device, generator=generator) < 0.5


def batch_crop(x, dy, dx, size):
    """Crops size×size windows at per-image offsets (dy, dx) from padded images x.

    One masked select per possible offset and axis (2·(2·pad+1) whole-dataset ops), rather
    than a gather index as large as the data or a Python loop over images.
    """
    rows = x[:, :, :size]
    for off in range(1, x.shape[2] - size + 1):
        rows = torch.where((dy == off).view(-1, 1, 1, 1), x[:, :, off:off + size], rows)
    out = rows[..., :size]
    for off in range(1, x.shape[3] - size + 1):
        out = torch.where((dx == off).view(-1, 1, 1, 1), rows[..., off:off + size], out)
    return out


def cutout_mask(cy, cx, size, patch):
    """True inside each image's patch×patch square, shape (N, 1, size, size)."""
    i = torch.arange(size, device=cy.device)
    ys = (i >= cy[:, None]) & (i < cy[:, None] + patch)
    xs = (i >= cx[:, None]) & (i < cx[:, None] + patch)
    return (ys[:, :, None] & xs[:, None, :])[:, None]


def augment(images, r, size, cutout):
    """Applies one epoch's draws r to all (padded) images at once; returns them unshuffled."""
    x = batch_crop(images, r["dy"], r["dx"], size) if "dy" in r else images
    if "flip" in r:
        x = torch.where(r["flip"].view(-1, 1, 1, 1), x.flip(3), x)
    if "cy" in r:
        x = x.masked_fill(cutout_mask(r["cy"], r["cx"], size, cutout), 0)
    return x


def epoch_batches(data, hp, generator, memory_format, epoch=0, flip_base=None):
    """Yields (images, labels) for one shuffled, augmented epoch; the last partial batch is dropped."""
    size = data["test_images"].shape[-1]
    x, y = data["train_images"], data["train_labels"]
    r = draw_augmentation(len(x), size, hp["crop_pad"], hp["flip"], hp["cutout"], generator, epoch, flip_base)
    x = augment(x, r, size, hp["cutout"])[r["perm"]].contiguous(memory_format=memory_format)
    y = y[r["perm"]]
    bs = hp["batch_size"]
    for i in range(len(x) // bs):
        yield x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs]


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

class BatchNorm(nn.BatchNorm2d):
    """Batch norm with two options from Myrtle's bag of tricks.

    freeze_scale: the scale stays at 1 (only the bias learns).
    ghost_batch: in training, statistics come from groups of this many images (interleaved:
    image i belongs to group i mod n/ghost_batch, which is as random as contiguous groups for
    shuffled data and needs only a reshape); running statistics average over the groups.
    """

    def __init__(self, c, freeze_scale=False, ghost_batch=0, momentum=0.1, eps=1e-5):
        super().__init__(c, eps=eps, momentum=momentum)
        self.ghost_batch = ghost_batch
        self.weight.requires_grad_(not freeze_scale)

    def forward(self, x):
        g = self.ghost_batch
        n, c, h, w = x.shape
        if not (self.training and g and n > g and n % g == 0):
            return super().forward(x)
        s = n // g
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        y = F.batch_norm(x.reshape(g, s * c, h, w), mean, var, self.weight.repeat(s), self.bias.repeat(s),
                         True, self.momentum, self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean.view(s, c).mean(0))
            self.running_var.copy_(var.view(s, c).mean(0))
        return y.reshape(n, c, h, w)


def batch_norm(c, hp):
    return BatchNorm(c, hp["freeze_bn_scale"], hp["ghost_batch"], hp["bn_momentum"], hp["bn_eps"])


def activation(hp):
    act = hp["act"]
    if act == "celu":
        return nn.CELU(hp["celu_alpha"])
    if act == "gelu":
        return nn.GELU()
    if act == "relu":
        return nn.ReLU(inplace=True)
    raise ValueError(f"act must be relu, celu or gelu, not {act!r}")


def conv(c_in, c_out, hp, kernel=3):
    """A bias-free convolution; with hp["dirac_init"] its first c_in filters start as the identity
    (Jordan 2024), so a fresh network passes its input through and early steps train faster."""
    layer = nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False)
    if hp["dirac_init"] and kernel > 1 and c_out >= c_in:
        with torch.no_grad():
            nn.init.dirac_(layer.weight[:c_in])
    return layer


def conv_bn(c_in, c_out, hp, pool=False, kernel=3):
    """conv → batch norm → activation, with an optional 2×2 max-pool after it, or moved to
    straight after the conv (`pool_first`), which does the same maths on 4× fewer pixels."""
    layers = [conv(c_in, c_out, hp, kernel), batch_norm(c_out, hp), activation(hp)]
    if pool:
        layers.insert(1 if hp["pool_first"] else 3, nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.body(x)


class Mul(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


class Whitening(nn.Conv2d):
    """A frozen k×k convolution whose filters whiten the input's k×k patches: one filter per
    eigenvector of the training-set patch covariance, scaled by 1/sqrt(eigenvalue + eps).
    both_signs adds each filter's negative too (so a following ReLU/GELU loses nothing);
    the optional bias is trainable (see make_optimizer's whiten_bias_epochs)."""

    def __init__(self, k, eps, both_signs=False, bias=False, padding=0):
        super().__init__(3, 3 * k * k * (2 if both_signs else 1), k, padding=padding, bias=bias)
        self.eps, self.both_signs = eps, both_signs
        self.weight.requires_grad_(False)
        if bias:
            nn.init.zeros_(self.bias)

    @torch.no_grad()
    def fit(self, images):
        k = self.kernel_size[0]
        patches = images.float().unfold(2, k, 1).unfold(3, k, 1)           # N,3,H',W',k,k
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k)
        patches = patches - patches.mean(0)
        cov = patches.T @ patches / (len(patches) - 1)
        eigvals, eigvecs = torch.linalg.eigh(cov.double())                  # ascending
        eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
        filters = (eigvecs / torch.sqrt(eigvals + self.eps)).T.reshape(-1, 3, k, k)
        if self.both_signs:
            filters = torch.cat([filters, -filters])
        self.weight.copy_(filters.to(self.weight))


def first_layer(hp, c_out):
    """The input layer: patch whitening when hp["whiten"], else an ordinary trainable convolution."""
    k = hp["whiten_size"]
    if not hp["whiten"]:
        return nn.Conv2d(3, c_out, k, padding=hp["whiten_pad"], bias=hp["whiten_bias"])
    return Whitening(k, hp["whiten_eps"], hp["whiten_signs"] == 2, hp["whiten_bias"], hp["whiten_pad"])


def widths(hp, base):
    return [max(1, round(c * hp["width"])) for c in base]


def resnet9(hp, num_classes=10):
    """Myrtle's ResNet-9: prep 64, layer1 128 + residual, layer2 256, layer3 512 + residual,
    global max-pool, linear, logits × output_scale. 6,573,120 parameters at width 1.
    With whitening, the prep conv becomes a frozen 3×3 whitening layer and a 1×1 conv (Myrtle)."""
    c0, c1, c2, c3 = widths(hp, (64, 128, 256, 512))
    if hp["whiten"]:
        white = first_layer(hp, 0)
        prep = nn.Sequential(white, conv_bn(white.out_channels, c0, hp, kernel=1))
    else:
        prep = conv_bn(3, c0, hp)
    return nn.Sequential(
        prep,
        conv_bn(c0, c1, hp, pool=True),
        Residual(conv_bn(c1, c1, hp), conv_bn(c1, c1, hp)),
        conv_bn(c1, c2, hp, pool=True),
        conv_bn(c2, c3, hp, pool=True),
        Residual(conv_bn(c3, c3, hp), conv_bn(c3, c3, hp)),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(c3, num_classes, bias=False),
        Mul(hp["output_scale"]),
    )


def conv_group(c_in, c_out, hp):
    """Jordan's block: conv → 2×2 max-pool → BN → act → conv → BN → act; at block_depth 3 two more
    conv-BN-act units follow as a residual branch (airbench96-style)."""
    first = [conv(c_in, c_out, hp), nn.MaxPool2d(2), batch_norm(c_out, hp), activation(hp)]
    unit = lambda: [conv(c_out, c_out, hp), batch_norm(c_out, hp), activation(hp)]
    if hp["block_depth"] == 2:
        return nn.Sequential(*first, *unit())
    if hp["block_depth"] == 3:
        return nn.Sequential(*first, Residual(*unit(), *unit()))
    raise ValueError(f"block_depth must be 2 or 3, not {hp['block_depth']}")


def fastnet(hp, num_classes=10):
    """The three-block network of Jordan (2024), "94% on CIFAR-10 in 3.29 seconds": a frozen 2×2
    patch-whitening layer (both signs, 24 channels, trainable bias) and GELU, three conv groups of
    hp["block_widths"] channels (each halves the resolution), global max-pool, linear, logits × output_scale."""
    white = first_layer(hp, 2 * 3 * hp["whiten_size"] ** 2)
    layers, c = [white, activation(hp)], white.out_channels
    for w in widths(hp, hp["block_widths"]):
        layers.append(conv_group(c, w, hp))
        c = w
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c, num_classes, bias=False), Mul(hp["output_scale"])]
    return nn.Sequential(*layers)


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016): bn-relu-conv-bn-relu-conv plus shortcut."""

    def __init__(self, c_in, c_out, stride, hp):
        super().__init__()
        self.bn1, self.bn2 = batch_norm(c_in, hp), batch_norm(c_out, hp)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.act = activation(hp)
        self.shortcut = None if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        out = self.act(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        return self.conv2(self.act(self.bn2(out))) + shortcut


def resnet18(hp, num_classes=10):
    """Pre-activation ResNet-18 for 32×32 inputs: the baseline of Myrtle's series."""
    c = widths(hp, (64, 128, 256, 512))
    layers, c_in = [nn.Conv2d(3, c[0], 3, 1, 1, bias=False)], c[0]
    for c_out, stride in zip(c, (1, 2, 2, 2)):
        layers += [PreActBlock(c_in, c_out, stride, hp), PreActBlock(c_out, c_out, 1, hp)]
        c_in = c_out
    layers += [batch_norm(c_in, hp), activation(hp), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(c_in, num_classes), Mul(hp["output_scale"])]
    return nn.Sequential(*layers)


MODELS = {"resnet9": resnet9, "resnet18": resnet18, "fastnet": fastnet}


def build_model(hp, device, memory_format=torch.contiguous_format):
    if hp["model"] not in MODELS:
        raise ValueError(f"unknown model {hp['model']!r}; choose from {sorted(MODELS)}")
    return MODELS[hp["model"]](hp).to(device, memory_format=memory_format)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def fit_whitening(model, train_images, size, n=10000):
    """Fits every Whitening layer to (at most n) training images, cropped back to size×size."""
    layers = [m for m in model.modules() if isinstance(m, Whitening)]
    if layers:
        pad = (train_images.shape[-1] - size) // 2
        x = train_images[:n, :, pad:pad + size, pad:pad + size]
        for m in layers:
            m.fit(x)


# ---------------------------------------------------------------------------------------------
# Optimisers, weight averaging, evaluation
# ---------------------------------------------------------------------------------------------

def newton_schulz(g, steps=5, eps=1e-7):
    """Approximately the orthogonal factor U Vᵀ of g = U S Vᵀ (all singular values pushed towards 1),
    by a quintic Newton–Schulz iteration in bf16. The coefficients (Jordan et al. 2024, Muon) trade
    exactness for speed: five steps leave singular values roughly in [0.7, 1.2]."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)                     # spectral norm ≤ Frobenius norm ≤ 1: inside the basin
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024): SGD momentum whose update for each weight matrix (a conv filter
    bank flattened to out × in·k·k) is orthogonalised by newton_schulz, so every direction of the
    update moves at the same rate. Scaled by sqrt(max(1, rows/cols)) as in the original."""

    def __init__(self, params, lr, momentum=0.9, nesterov=True, ns_steps=5):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p.grad))
                buf.mul_(group["momentum"]).add_(p.grad)
                g = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                g = g.reshape(len(g), -1)
                update = newton_schulz(g, group["ns_steps"]) * max(1.0, g.shape[0] / g.shape[1]) ** 0.5
                p.add_(update.view_as(p), alpha=-group["lr"])


def make_optimizers(model, hp, steps_per_epoch=1, world=1):
    """The optimisers for one run; set_lr() then sets every group's step size from the schedule.

    Two parametrisations of lr and weight decay (wd), both on the batch-summed loss:
    - "myrtle" (Myrtle 2018): step size lr/batch_size and decay wd·batch_size, which together equal
      plain SGD on the batch-mean loss with (lr, wd).
    - "decoupled" (Jordan 2024): lr and wd are per 1024 examples and divided by the Nesterov gain
      1 + 1/(1 - momentum), so the average step does not change with momentum; the decay per step is
      wd·batch_size/(1024·gain) × the schedule's factor, whatever lr and bias_lr_mult are, so lr,
      wd and momentum can be tuned one at a time.
    Batch-norm biases get lr × bias_lr_mult: with frozen scales they are the only per-channel knobs.
    With optimizer="muon", conv filter banks (4-D weights) use Muon at muon_lr × the schedule factor.
    The whitening layer's bias trains only for the first whiten_bias_epochs (its lr is then set to 0
    rather than requires_grad flipped, which would make a compiled model recompile mid-run).
    optimizer="lars" or "rmsprop_sgd" use the large-batch optimisers of distributed.py on the same groups.

    Under DDP (world ranks of batch_size images each) gradients are averaged over ranks, i.e. 1/world of
    the summed loss's gradient over the global batch. In the myrtle units 1/batch_size = world/global
    batch absorbs this; in the decoupled units the step is multiplied by world to undo it.
    """
    bs, m, wd, peak = hp["batch_size"], hp["momentum"], hp["weight_decay"], max(hp["lr_values"])
    if hp["param"] == "myrtle":
        unit, decay = 1 / bs, lambda scale: wd * bs / scale
    elif hp["param"] == "decoupled":
        gain = 1 + 1 / (1 - m)
        unit, decay = world / (1024 * gain), lambda scale: wd * bs / (peak * scale)
    else:
        raise ValueError(f"param must be myrtle or decoupled, not {hp['param']!r}")
    if hp["optimizer"] == "lars":
        unit = 1.0      # LARS divides by the gradient's norm: its step is lr × trust × |w|, whatever the loss's scale
    bn_biases = {id(mod.bias) for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)}
    whiten_biases = {id(mod.bias) for mod in model.modules() if isinstance(mod, Whitening) and mod.bias is not None}
    muon = hp["optimizer"] == "muon"
    groups = {"weights": [], "bn_biases": [], "whiten_bias": [], "filters": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        key = ("bn_biases" if id(p) in bn_biases else "whiten_bias" if id(p) in whiten_biases
               else "filters" if muon and p.ndim == 4 else "weights")
        groups[key].append(p)
    scales = {"weights": 1.0, "bn_biases": hp["bias_lr_mult"], "whiten_bias": 1.0}
    sgd = [{"params": groups[k], "lr_unit": unit * scales[k], "weight_decay": decay(scales[k]), "name": k,
            "until_epoch": hp["whiten_bias_epochs"] if k == "whiten_bias" else None}
           for k in scales if groups[k]]
    if hp["optimizer"] in ("sgd", "muon"):
        opts = [torch.optim.SGD(sgd, lr=0.0, momentum=m, nesterov=hp["nesterov"])]
    elif hp["optimizer"] == "lars":
        opts = [D.LARS(sgd, lr=0.0, momentum=m, trust_coefficient=hp["lars_trust"])]
    elif hp["optimizer"] == "rmsprop_sgd":
        opts = [D.RMSpropToSGD(sgd, lr=0.0, lr_rmsprop=hp["rms_lr"], momentum=m, beta_center=hp["rms_beta_center"],
                               beta_period=hp["rms_beta_period"], steps_per_epoch=steps_per_epoch)]
    else:
        raise ValueError(f"optimizer must be sgd, muon, lars or rmsprop_sgd, not {hp['optimizer']!r}")
    if groups["filters"]:
        opts.append(Muon([{"params": groups["filters"], "lr_unit": hp["muon_lr"] / peak, "name": "filters",
                           "until_epoch": None}], lr=0.0, momentum=hp["muon_momentum"], nesterov=hp["nesterov"]))
    return opts


def set_lr(opts, lr, epoch=0):
    """Sets each group's step size to lr (the schedule's value, in the recipe's units) × its unit."""
    for opt in opts:
        for g in opt.param_groups:
            frozen = g["until_epoch"] is not None and epoch >= g["until_epoch"]
            g["lr"] = 0.0 if frozen else lr * g["lr_unit"]


def float_state(model):
    return [t for t in model.state_dict().values() if t.is_floating_point()]


class EMA:
    """Exponential moving average of a model's parameters and batch-norm statistics, updated
    every `every` steps with decay momentum**every (so `momentum` is per step)."""

    def __init__(self, model, momentum, every):
        self.model = copy.deepcopy(model)
        self.rho, self.every = momentum ** every, every
        self.steps = 0

    @torch.no_grad()
    def update(self, model):
        self.steps += 1
        if self.steps % self.every == 0:
            torch._foreach_lerp_(float_state(self.model), float_state(model), 1 - self.rho)


class Lookahead:
    """Lookahead (Zhang et al. 2019) used as weight averaging (Jordan 2024): every few steps the slow
    weights move towards the fast ones, slow ← slow + (1 - decay)(fast - slow), and the fast weights
    restart from the slow ones. The caller ramps decay up during training; decay=1 at the end hands
    the slow weights to the model."""

    def __init__(self, model):
        self.slow = [t.detach().clone() for t in float_state(model)]

    @torch.no_grad()
    def update(self, model, decay):
        fast = float_state(model)
        torch._foreach_lerp_(self.slow, fast, 1 - decay)
        torch._foreach_copy_(fast, self.slow)


def autocast(device, dtype):
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def tta_views(x, mode):
    """(weight, view) pairs whose weighted logits make the prediction.
    flip: the image and its mirror, 1/2 each. flip_translate (Jordan 2024): those two at 1/4 each, and
    the image shifted one pixel up-left and one pixel down-right (reflect-padded), each with its
    mirror, at 1/8 each."""
    if mode == "none":
        return [(1.0, x)]
    if mode == "flip":
        return [(0.5, x), (0.5, x.flip(3))]
    if mode == "flip_translate":
        h, w = x.shape[-2:]
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        shifted = [padded[..., :h, :w], padded[..., 2:, 2:]]
        return [(0.25, x), (0.25, x.flip(3))] + [(0.125, v) for s in shifted for v in (s, s.flip(3))]
    raise ValueError(f"tta must be none, flip or flip_translate, not {mode!r}")


@torch.no_grad()
def evaluate(model, images, labels, tta="none", dtype=torch.float32, batch_size=1000, memory_format=torch.contiguous_format):
    """Mean loss and accuracy of the test-time-augmented prediction (see tta_views)."""
    was_training = model.training
    model.eval()
    loss, correct = torch.zeros((), device=images.device), torch.zeros((), device=images.device)
    for i in range(0, len(images), batch_size):
        x = images[i:i + batch_size].contiguous(memory_format=memory_format)
        y = labels[i:i + batch_size]
        with autocast(images.device, dtype):
            logits = sum(w * model(v).float() for w, v in tta_views(x, tta))
        loss += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
    model.train(was_training)
    return loss.item() / len(images), correct.item() / len(images)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def resolve_device(name=None):
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(device, precision="auto"):
    """bf16 on a GPU (batch-norm statistics and optimiser state stay float32), float32 on a CPU."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def memory_format_for(device):
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def make_forward(hp, device, compile_mode=None, ctx=None, bucket_mb=25.0, hook="none"):
    """(net, forward) built once per process and re-initialised in place by train() for every run:
    under torchrun forward is net in DistributedDataParallel (with bucket_mb buckets and a gradient
    communication hook), and with compile_mode it is torch.compile'd, so compilation happens once
    (in warmup). (None, None) when neither applies: train() then builds a plain network per run."""
    distributed = ctx is not None and ctx.distributed
    if not (compile_mode or distributed):
        return None, None
    net = build_model(hp, device, memory_format_for(device))
    forward = net
    if distributed:
        forward = D.register_comm_hook(D.wrap_ddp(net, ctx, bucket_mb), hook)
    if compile_mode:
        forward = torch.compile(forward, mode=None if compile_mode == "default" else compile_mode)
    return net, forward


def train_step(forward, opts, x, y, hp, dtype):
    with autocast(x.device, dtype):
        logits = forward(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=hp["label_smoothing"], reduction="sum")
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach()


def warmup(hp, data, device, dtype, net=None, forward=None):
    """Runs a few steps and an evaluation (on a throwaway model, or on the given net, which train()
    re-initialises anyway) so that cuDNN autotuning, kernel loading and torch.compile happen before
    the clock starts: the 'compilation warm-up' the timing protocol excludes."""
    memory_format = memory_format_for(device)
    net = net if net is not None else build_model(hp, device, memory_format)
    forward = forward or net
    opts = make_optimizers(net, hp)
    set_lr(opts, 1e-9)          # a step that moves nothing measurable, but runs every kernel
    gen = torch.Generator(device).manual_seed(0)
    flip_base = flip_bits(len(data["train_labels"]), gen)
    for step, (x, y) in enumerate(epoch_batches(data, hp, gen, memory_format, 0, flip_base)):
        train_step(forward, opts, x, y, hp, dtype)
        if step == 2:
            break
    evaluate(forward, data["test_images"], data["test_labels"], hp["tta"], dtype, memory_format=memory_format)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(hp, data, device, seed=0, dtype=torch.float32, target=0.94, on_epoch=None, net=None, forward=None,
          ctx=None):
    """Trains one fresh network on device-resident data; returns its per-epoch rows and summary.

    The clock (device-synchronised) runs over everything a run needs except the per-epoch
    evaluation passes: model construction, whitening initialisation, augmentation, steps; the final
    evaluation (with the recipe's test-time augmentation) is timed separately as final_eval_time,
    and time = train_time + final_eval_time is what a user waits for a trained, evaluated model.
    `net`/`forward` (from make_forward) reuse one compiled and/or DDP-wrapped network across runs.
    Under torchrun (`ctx`), data holds this rank's shard and hp["batch_size"] is the per-rank batch;
    every rank builds the same initial network (same seed) and draws its own augmentations.
    """
    world, rank = (ctx.world_size, ctx.rank) if ctx else (1, 0)
    torch.manual_seed(seed)
    gen = torch.Generator(device).manual_seed(seed + 104729 * rank)
    memory_format = memory_format_for(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    timer = Timer(sync)

    fresh = build_model(hp, device, memory_format)
    if net is None:
        net, forward = fresh, fresh
    else:
        net.load_state_dict(fresh.state_dict())
        forward = forward or net
    fit_whitening(net, data["train_images"], data["test_images"].shape[-1])
    if hp["bn_stats"] == "last_batch":
        D.use_last_batch_stats(net)
    ema = EMA(net, hp["ema_momentum"], hp["ema_every"]) if hp["ema_momentum"] else None
    lookahead = Lookahead(net) if hp["lookahead_momentum"] else None
    la_every = hp["lookahead_every"]
    schedule = PiecewiseLinear(hp["lr_knots"], hp["lr_values"])
    bs = hp["batch_size"]
    n_train = len(data["train_labels"])
    steps_per_epoch = n_train // bs
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {bs} is larger than the {n_train} training images")
    total_steps = max(1, round(hp["epochs"] * steps_per_epoch))     # epochs may be fractional (9.9)
    opts = make_optimizers(net, hp, steps_per_epoch, world)
    flip_base = flip_bits(n_train, gen) if hp["flip"] == "alternate" else None

    rows, time_to_target, step = [], None, 0
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        seen = 0
        for x, y in epoch_batches(data, hp, gen, memory_format, epoch, flip_base):
            lr = schedule(step / total_steps)
            set_lr(opts, lr, epoch)
            logits, loss = train_step(forward, opts, x, y, hp, dtype)
            step += 1
            if ema:
                ema.update(net)
            if lookahead and step % la_every == 0:
                decay = 1.0 if step == total_steps else hp["lookahead_momentum"] ** la_every * (step / total_steps) ** 3
                lookahead.update(net, decay)
            loss_sum += loss
            correct += (logits.argmax(1) == y).sum()
            seen += len(y)
            if step == total_steps:
                break
        if lookahead and step == total_steps and step % la_every:
            lookahead.update(net, 1.0)
        epoch_time = timer()
        if hp["bn_stats"] == "last_batch":
            D.sync_batch_norm_stats(net, ctx or D.Context())
        eval_model = ema.model if ema else (net if world > 1 else forward)
        test_loss, test_acc = evaluate(eval_model, data["test_images"], data["test_labels"], hp["tta"], dtype,
                                       memory_format=memory_format)
        final_eval_time = timer(include=False)
        if time_to_target is None and test_acc >= target:
            time_to_target = timer.total
        row = {"epoch": epoch + 1, "lr": lr, "train_loss": loss_sum.item() / seen, "train_acc": correct.item() / seen,
               "test_loss": test_loss, "test_acc": test_acc, "epoch_time": epoch_time, "total_time": timer.total}
        rows.append(row)
        if on_epoch:
            on_epoch(row)
        timer(include=False)
    return {"seed": seed, "rows": rows, "final_acc": rows[-1]["test_acc"], "train_time": timer.total,
            "final_eval_time": final_eval_time, "time": timer.total + final_eval_time,
            "time_to_target": time_to_target, "model": ema.model if ema else net}


def count_flops(hp, data, batch=8):
    """FLOPs of one run: every training step (forward and backward) and the final test-time-augmented
    evaluation, counted by torch.utils.flop_counter (convolutions and matmuls) on a small batch and
    scaled linearly; per-epoch evaluations are excluded, as they are from the time."""
    from torch.utils.flop_counter import FlopCounterMode
    device = data["test_images"].device
    model = build_model(hp, device)
    # contiguous: on one CPU thread, torch 2.14.1 crashed in the backward of the pre-activation ResNet-18
    # given this slice's channels-last strides (the training step always gets a contiguous batch)
    x, y = data["test_images"][:batch].float().contiguous(), data["test_labels"][:batch]
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    per_train_image = counter.get_total_flops() / len(x)
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for _, view in tta_views(x, hp["tta"]):
            model(view)
    per_test_image = counter.get_total_flops() / len(x)
    n_train, bs = len(data["train_labels"]), hp["batch_size"]
    steps = max(1, round(hp["epochs"] * (n_train // bs)))
    train, test = steps * bs * per_train_image, len(data["test_labels"]) * per_test_image
    return {"train": train, "final_eval": test, "total": train + test,
            "per_train_image": per_train_image, "per_test_image": per_test_image}
