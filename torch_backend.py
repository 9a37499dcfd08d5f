"""Everything that touches tensors: CIFAR-10 loading, the device-resident dataset, batched
augmentation, models, optimiser, the training and evaluation loops.

Hyperparameters arrive as one flat dict (a recipe from cifar10_fast.py); every key is read in
exactly one place below, so `grep "hp\\[\"name\"\\]"` finds what a hyperparameter does.
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


def draw_augmentation(n, size, pad, flip, cutout, generator):
    """Every random number for one epoch of n images, in at most five calls whatever n is."""
    device = generator.device
    r = {"perm": torch.randperm(n, device=device, generator=generator)}
    if pad:
        r["dy"], r["dx"] = torch.randint(0, 2 * pad + 1, (2, n), device=device, generator=generator)
    if flip:
        r["flip"] = torch.rand(n, device=device, generator=generator) < 0.5
    if cutout:
        r["cy"], r["cx"] = torch.randint(0, size - cutout + 1, (2, n), device=device, generator=generator)
    return r


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


def epoch_batches(data, hp, generator, memory_format):
    """Yields (images, labels) for one shuffled, augmented epoch; the last partial batch is dropped."""
    size = data["test_images"].shape[-1]
    x, y = data["train_images"], data["train_labels"]
    r = draw_augmentation(len(x), size, hp["crop_pad"], hp["flip"], hp["cutout"], generator)
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

    def __init__(self, c, freeze_scale=False, ghost_batch=0):
        super().__init__(c)
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


def activation(hp):
    return nn.CELU(hp["celu_alpha"]) if hp["act"] == "celu" else nn.ReLU(inplace=True)


def conv_bn(c_in, c_out, hp, pool=False, kernel=3):
    """conv → batch norm → activation, with an optional 2×2 max-pool after it, or moved to
    straight after the conv (`pool_first`), which does the same maths on 4× fewer pixels."""
    conv = nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False)
    bn = BatchNorm(c_out, hp["freeze_bn_scale"], hp["ghost_batch"])
    if not pool:
        return nn.Sequential(conv, bn, activation(hp))
    if hp["pool_first"]:
        return nn.Sequential(conv, nn.MaxPool2d(2), bn, activation(hp))
    return nn.Sequential(conv, bn, activation(hp), nn.MaxPool2d(2))


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
    """A frozen 3×3 convolution whose filters whiten the input's 3×3 patches (one output per
    eigenvector of the patch covariance, scaled by 1/sqrt(eigenvalue + eps))."""

    def __init__(self, eps):
        super().__init__(3, 27, 3, padding=1, bias=False)
        self.eps = eps
        self.weight.requires_grad_(False)

    @torch.no_grad()
    def fit(self, images):
        patches = images.float().unfold(2, 3, 1).unfold(3, 3, 1)          # N,3,H',W',3,3
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 27)
        patches = patches - patches.mean(0)
        cov = patches.T @ patches / (len(patches) - 1)
        eigvals, eigvecs = torch.linalg.eigh(cov.double())                  # ascending
        eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
        filters = (eigvecs / torch.sqrt(eigvals + self.eps)).T.reshape(27, 3, 3, 3)
        self.weight.copy_(filters.to(self.weight))


def resnet9(hp, num_classes=10):
    """Myrtle's ResNet-9: prep 64, layer1 128 + residual, layer2 256, layer3 512 + residual,
    global max-pool, linear, logits × output_scale. 6,573,120 parameters at width 1."""
    w = lambda c: max(1, round(c * hp["width"]))
    if hp["whiten"]:
        prep = nn.Sequential(Whitening(hp["whiten_eps"]), conv_bn(27, w(64), hp, kernel=1))
    else:
        prep = conv_bn(3, w(64), hp)
    return nn.Sequential(
        prep,
        conv_bn(w(64), w(128), hp, pool=True),
        Residual(conv_bn(w(128), w(128), hp), conv_bn(w(128), w(128), hp)),
        conv_bn(w(128), w(256), hp, pool=True),
        conv_bn(w(256), w(512), hp, pool=True),
        Residual(conv_bn(w(512), w(512), hp), conv_bn(w(512), w(512), hp)),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(w(512), num_classes, bias=False),
        Mul(hp["output_scale"]),
    )


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016): bn-relu-conv-bn-relu-conv plus shortcut."""

    def __init__(self, c_in, c_out, stride, hp):
        super().__init__()
        self.bn1, self.bn2 = BatchNorm(c_in), BatchNorm(c_out)
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
    w = lambda c: max(1, round(c * hp["width"]))
    layers, c_in = [nn.Conv2d(3, w(64), 3, 1, 1, bias=False)], w(64)
    for c, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [PreActBlock(c_in, w(c), stride, hp), PreActBlock(w(c), w(c), 1, hp)]
        c_in = w(c)
    layers += [BatchNorm(c_in), activation(hp), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(c_in, num_classes), Mul(hp["output_scale"])]
    return nn.Sequential(*layers)


MODELS = {"resnet9": resnet9, "resnet18": resnet18}


def build_model(hp, device, memory_format=torch.contiguous_format):
    if hp["model"] not in MODELS:
        raise ValueError(f"unknown model {hp['model']!r}; choose from {sorted(MODELS)}")
    return MODELS[hp["model"]](hp).to(device, memory_format=memory_format)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Optimiser, EMA, evaluation
# ---------------------------------------------------------------------------------------------

def make_optimizer(model, hp):
    """Nesterov SGD in Myrtle's parametrisation: the loss is summed over the batch, so the
    step size is lr per example (lr / batch_size) and weight decay is scaled by batch_size,
    which together equal plain SGD on the mean loss with (lr, weight_decay).

    Biases (batch-norm shifts) get lr × bias_lr_mult and weight decay ÷ bias_lr_mult: with
    frozen batch-norm scales they are the only per-channel knobs, and need larger steps.
    """
    bs, mult = hp["batch_size"], hp["bias_lr_mult"]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    biases = [p for n, p in params if n.endswith("bias")]
    others = [p for n, p in params if not n.endswith("bias")]
    groups = [{"params": others, "lr_scale": 1.0, "weight_decay": hp["weight_decay"] * bs},
              {"params": biases, "lr_scale": mult, "weight_decay": hp["weight_decay"] * bs / mult}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.SGD(groups, lr=0.0, momentum=hp["momentum"], nesterov=hp["nesterov"])


def set_lr(opt, lr, batch_size):
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_scale"] / batch_size


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
        if self.steps % self.every:
            return
        src = [t for t in model.state_dict().values() if t.is_floating_point()]
        dst = [t for t in self.model.state_dict().values() if t.is_floating_point()]
        torch._foreach_lerp_(dst, src, 1 - self.rho)


def autocast(device, dtype):
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


@torch.no_grad()
def evaluate(model, images, labels, tta="none", dtype=torch.float32, batch_size=1000, memory_format=torch.contiguous_format):
    """Mean loss and accuracy; with tta="flip" the logits are averaged over the image and its mirror."""
    was_training = model.training
    model.eval()
    loss, correct = torch.zeros((), device=images.device), torch.zeros((), device=images.device)
    for i in range(0, len(images), batch_size):
        x = images[i:i + batch_size].contiguous(memory_format=memory_format)
        y = labels[i:i + batch_size]
        with autocast(images.device, dtype):
            logits = model(x).float()
            if tta == "flip":
                logits = (logits + model(x.flip(3)).float()) / 2
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


def warmup(hp, data, device, dtype, memory_format):
    """Runs a few steps and an evaluation on a throwaway model so that cuDNN's autotuning and
    kernel loading happen before the clock starts (the 'compilation warm-up' the timing protocol excludes)."""
    model = build_model(hp, device, memory_format)
    opt = make_optimizer(model, hp)
    gen = torch.Generator(device).manual_seed(0)
    for step, (x, y) in enumerate(epoch_batches(data, hp, gen, memory_format)):
        with autocast(device, dtype):
            F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 2:
            break
    evaluate(model, data["test_images"], data["test_labels"], hp["tta"], dtype, memory_format=memory_format)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(hp, data, device, seed=0, dtype=torch.float32, target=0.94, on_epoch=None):
    """Trains one fresh network on device-resident data; returns its per-epoch rows and summary.

    The clock (device-synchronised) runs over everything a run needs except the per-epoch
    evaluation passes: model construction, whitening initialisation, augmentation, steps.
    """
    torch.manual_seed(seed)
    gen = torch.Generator(device).manual_seed(seed)
    channels_last = device.type == "cuda"
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    timer = Timer(sync)

    model = build_model(hp, device, memory_format)
    if hp["whiten"]:
        size = data["test_images"].shape[-1]
        pad = (data["train_images"].shape[-1] - size) // 2
        model[0][0].fit(data["train_images"][:10000, :, pad:pad + size, pad:pad + size])
    opt = make_optimizer(model, hp)
    ema = EMA(model, hp["ema_momentum"], hp["ema_every"]) if hp["ema_momentum"] else None
    schedule = PiecewiseLinear(hp["lr_knots"], hp["lr_values"])
    bs, epochs = hp["batch_size"], hp["epochs"]
    steps_per_epoch = len(data["train_labels"]) // bs
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {bs} is larger than the {len(data['train_labels'])} training images")
    total_steps, step = epochs * steps_per_epoch, 0

    rows, time_to_target = [], None
    for epoch in range(1, epochs + 1):
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        for x, y in epoch_batches(data, hp, gen, memory_format):
            lr = schedule(step / total_steps)
            set_lr(opt, lr, bs)
            with autocast(device, dtype):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=hp["label_smoothing"], reduction="sum")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ema:
                ema.update(model)
            loss_sum += loss.detach()
            correct += (logits.detach().argmax(1) == y).sum()
            step += 1
        epoch_time = timer()
        n = steps_per_epoch * bs
        eval_model = ema.model if ema else model
        test_loss, test_acc = evaluate(eval_model, data["test_images"], data["test_labels"], hp["tta"], dtype,
                                       memory_format=memory_format)
        if time_to_target is None and test_acc >= target:
            time_to_target = timer.total
        row = {"epoch": epoch, "lr": lr, "train_loss": loss_sum.item() / n, "train_acc": correct.item() / n,
               "test_loss": test_loss, "test_acc": test_acc, "epoch_time": epoch_time, "total_time": timer.total}
        rows.append(row)
        if on_epoch:
            on_epoch(row)
        timer(include=False)
    return {"seed": seed, "rows": rows, "final_acc": rows[-1]["test_acc"], "train_time": timer.total,
            "time_to_target": time_to_target, "model": eval_model}
