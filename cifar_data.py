"""CIFAR-10 data: the official archive downloaded, verified and read into one cached uint8 .npz (or an
unpacked folder, or a .npz of our own), the dataset uploaded once to the device, and each epoch's
augmentation drawn in a handful of random calls and applied to all images at once.

Bad data raises core.DataError with one line naming the file and what is wrong.
"""
import contextlib
import io
import os
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core import DataError, write_atomic

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


def download(url, path, progress=True):
    """Downloads url to path with torchvision's downloader (its tqdm bar on stderr unless progress is off),
    under a temporary name renamed only when complete, so no half file is ever left under the final name."""
    from torchvision.datasets.utils import download_url     # here: importing torchvision takes a second or two
    path = Path(path)
    if progress:
        print(f"downloading {path.name} from {url}", file=sys.stderr, flush=True)

    def write(tmp):
        os.remove(tmp)              # download_url skips a file that is already there when given no md5
        try:
            with contextlib.redirect_stderr(sys.stderr if progress else io.StringIO()):   # its bar has no off switch
                download_url(url, os.path.dirname(tmp), os.path.basename(tmp))
        except (OSError, RuntimeError) as e:      # URLError, HTTPError, "File not found", too many redirects
            raise DataError(f"{url}: download failed ({e}); put {path.name} in {path.parent} by hand") from e
    write_atomic(path, write)


def verify_archive(path, spec):
    """Size and md5 checks; spec values of None skip that check."""
    from torchvision.datasets.utils import calculate_md5
    size = path.stat().st_size
    if spec.get("size") and size < spec["size"]:
        raise DataError(f"{path}: truncated archive ({size} of {spec['size']} bytes); delete it and run again")
    if spec.get("md5") and (md5 := calculate_md5(path)) != spec["md5"]:
        raise DataError(f"{path}: checksum mismatch (md5 {md5}, expected {spec['md5']}); delete it and run again")


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
    # Straight from the tar into arrays, cached as one .npz: torchvision's CIFAR10 class would first extract the
    # pickles to disk and unpickle them again on every start.
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


def take_subset(arrays, n_train=None, n_test=None):
    """The first n_train training and n_test test images (None keeps them all)."""
    return {**arrays, "train_images": arrays["train_images"][:n_train], "train_labels": arrays["train_labels"][:n_train],
            "test_images": arrays["test_images"][:n_test], "test_labels": arrays["test_labels"][:n_test]}


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

def normalise(x, device, dtype, pad=0):
    """uint8 NHWC images uploaded, normalised and reflect-padded by pad pixels on the device, NCHW in dtype."""
    x = torch.from_numpy(x).to(device).permute(0, 3, 1, 2).float()
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    x = (x - mean) / std
    return (F.pad(x, (pad,) * 4, mode="reflect") if pad else x).to(dtype)


def to_device(d, device, dtype, pad):
    """Uploads uint8 once; normalises (and reflect-pads the training images) once, on the device."""
    prep = lambda x, p: normalise(x, device, dtype, p)
    return {"train_images": prep(d["train_images"], pad), "test_images": prep(d["test_images"], 0),
            "train_labels": torch.from_numpy(d["train_labels"]).to(device).long(),
            "test_labels": torch.from_numpy(d["test_labels"]).to(device).long()}


def draw_augmentation(n, size, pad, flip, cutout, generator, epoch=0, flip_base=None, jitter=(0.0, 0.0)):
    """Every random number for one epoch of n images, in at most six calls whatever n is.

    flip="random" flips each image with probability 1/2 every epoch; flip="alternate" (Jordan 2024)
    flips image i in epoch e iff flip_base[i] xor (e odd), so every image is seen both ways in any two
    consecutive epochs; flip_base is drawn once per run (see flip_bits). jitter = (brightness, contrast)
    (the 2-second record): each image's normalised pixels become (x + b)·c with b uniform in ±brightness
    and c in 1 ± contrast.
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
    if any(jitter):
        u = torch.rand(2, n, device=device, generator=generator) * 2 - 1
        r["brightness"], r["contrast"] = u[0] * jitter[0], 1 + u[1] * jitter[1]
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
    if "brightness" in r:
        per_image = lambda v: v.view(-1, 1, 1, 1).to(x.dtype)
        x = (x + per_image(r["brightness"])) * per_image(r["contrast"])
    if "cy" in r:
        x = x.masked_fill(cutout_mask(r["cy"], r["cx"], size, cutout), 0)
    return x


def low_resolution(x, res):
    """x resized to res × res (bilinear, antialiased: each output pixel averages the input it covers)."""
    return F.interpolate(x.float(), size=(res, res), mode="bilinear", antialias=True, align_corners=False).to(x.dtype)


def epoch_batches(data, hp, generator, memory_format, epoch=0, flip_base=None):
    """Yields (images, labels) for one shuffled, augmented epoch; the last partial batch is dropped. The first
    low_res_epochs epochs are resized to low_res pixels (when low_res is set)."""
    size = data["test_images"].shape[-1]
    x, y = data["train_images"], data["train_labels"]
    r = draw_augmentation(len(x), size, hp["crop_pad"], hp["flip"], hp["cutout"], generator, epoch, flip_base,
                          (hp["jitter_brightness"], hp["jitter_contrast"]))
    x = augment(x, r, size, hp["cutout"])[r["perm"]]
    if hp["low_res"] and epoch < hp["low_res_epochs"]:
        x = low_resolution(x, hp["low_res"])
    x = x.contiguous(memory_format=memory_format)
    y = y[r["perm"]]
    bs = hp["batch_size"]
    for i in range(len(x) // bs):
        yield x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs]
