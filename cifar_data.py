"""CIFAR-10 and CIFAR-100 data: the official archive downloaded, verified and read into one cached uint8 .npz
(or an unpacked folder, or a .npz of any image classification data), the dataset uploaded once to the device and
normalised by its own training images' statistics, and each epoch's augmentation drawn in a handful of random
calls and applied to all images at once.

Bad data raises core.DataError with one line naming the file and what is wrong.
"""
import contextlib
import errno
import hashlib
import io
import os
import pickle
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import devices
from core import DataError
from outputs import made_folder, not_a_file, writable_folder, write_atomic
from settings import knob

# ---------------------------------------------------------------------------------------------
# Data on disk
# ---------------------------------------------------------------------------------------------

# The official archives (https://www.cs.toronto.edu/~kriz/cifar.html): the pickles they hold for each split, and
# the key of the labels in them; `cache` is our .npz of the four arrays in a data folder.
DATASETS = {
    "cifar10": dict(title="CIFAR-10", url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                    archive={"name": "cifar-10-python.tar.gz", "md5": "c58f30108f718f92721af3b95e74349a",
                             "size": 170498071},
                    folder="cifar-10-batches-py", train=tuple(f"data_batch_{i}" for i in range(1, 6)),
                    test=("test_batch",), labels=b"labels", cache="cifar10_uint8.npz", classes=10),
    "cifar100": dict(title="CIFAR-100", url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                     archive={"name": "cifar-100-python.tar.gz", "md5": "eb9058c3a382ffc7106e4002c42a8d85",
                              "size": 169001437},
                     folder="cifar-100-python", train=("train",), test=("test",), labels=b"fine_labels",
                     cache="cifar100_uint8.npz", classes=100),
}
CACHE_NAME = DATASETS["cifar10"]["cache"]
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
KEYS = ("train_images", "train_labels", "test_images", "test_labels")
# Per-channel statistics of CIFAR-10's 50,000 training images (0..255 scale), as channel_stats computes them.
MEAN = (125.307, 122.950, 113.865)
STD = (62.993, 62.089, 66.705)


def data_argument(flag, value):
    """How a user gives `value` as the data: `--data-dir VALUE` on the command line (flag "--data-dir"), `data="VALUE"`
    in a library call (flag "data")."""
    return f"{flag} {value}" if flag.startswith("-") else f'{flag}="{value}"'


def download(url, path, progress=True, *, flag="--data-dir"):
    """Downloads url to path with torchvision's downloader (its tqdm bar on stderr unless progress is off),
    under a temporary name renamed only when complete, so no half file is ever left under the final name; a failure
    says how to give the data instead, by `flag` (data_argument)."""
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
            raise DataError(f"{url}: download failed ({e}); put {path.name} in {path.parent}, or give the data as one "
                            f"file: {data_argument(flag, 'FILE.npz')} holding train_images (N, 32, 32, 3) uint8, "
                            "train_labels (N,), test_images and test_labels") from e
    write_atomic(path, write)


def verify_archive(path, spec):
    """Size and md5 checks; spec values of None skip that check."""
    from torchvision.datasets.utils import calculate_md5
    size = path.stat().st_size
    if spec.get("size") and size < spec["size"]:
        raise DataError(f"{path}: truncated archive ({size} of {spec['size']} bytes); delete it and run again")
    if spec.get("md5") and (md5 := calculate_md5(path)) != spec["md5"]:
        raise DataError(f"{path}: checksum mismatch (md5 {md5}, expected {spec['md5']}); delete it and run again")


def _batches_to_arrays(read, where, spec):
    """Builds the four arrays from the official pickles of dataset `spec`; read(name) returns a pickle's bytes."""
    def load(name):
        try:
            d = pickle.loads(read(name), encoding="bytes")
            x = np.asarray(d[b"data"])
            y = np.asarray(d[spec["labels"]])
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}/{name}: not a {spec['title']} batch ({type(e).__name__}: {e})") from e
        if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
            raise DataError(f"{where}/{name}: wrong shapes (data {x.shape}, labels {y.shape}); expected (N, 3072) "
                            "and (N,)")
        return as_pixels(x, f"{where}/{name}").reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y
    train, test = [load(name) for name in spec["train"]], [load(name) for name in spec["test"]]
    join = lambda batches, i: np.concatenate([batch[i] for batch in batches])
    return {"train_images": join(train, 0), "train_labels": join(train, 1),
            "test_images": join(test, 0), "test_labels": join(test, 1)}


def as_pixels(x, source):
    """x as uint8, or a DataError naming source where a value is not a whole number in 0..255 (which uint8 would wrap:
    256 to 0)."""
    if x.dtype == np.uint8:
        return x
    numbers = np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
    if not numbers or x.size and not (x.min() >= 0 and x.max() <= 255 and np.array_equal(x, np.round(x))):
        values = f" {x.min()}..{x.max()}" if numbers and x.size else ""
        raise DataError(f"{source}: pixel values{values} of dtype {x.dtype}; expected whole numbers 0..255")
    return x.astype(np.uint8)


def published_md5s(spec):
    """{batch file: md5} of the dataset's official unpacked folder, as torchvision publishes them."""
    from torchvision.datasets import CIFAR10, CIFAR100
    published = CIFAR10 if spec is DATASETS["cifar10"] else CIFAR100
    return dict(published.train_list + published.test_list)


def read_archive(path, spec=DATASETS["cifar10"]):
    # Straight from the tar into arrays, cached as one .npz: torchvision's CIFAR10 class would first extract the
    # pickles to disk and unpickle them again on every start.
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

            def read(name):
                if name not in members:
                    raise DataError(f"{path}: {name} missing from the archive")
                return tar.extractfile(members[name]).read()
            return _batches_to_arrays(read, path, spec)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{path}: truncated or corrupt archive ({e})") from e


def read_batches_dir(folder, spec=DATASETS["cifar10"], *, flag="--data-dir"):
    """The four arrays of an unpacked folder of the official pickles, each file's md5 checked against its published
    one before it is unpickled (as torchvision's CIFAR10 checks them): unpickling runs whatever code a file holds."""
    md5s = published_md5s(spec)

    def read(name):
        f = folder / name
        if not f.is_file():
            raise DataError(f"{f}: missing")
        blob = f.read_bytes()
        if (md5 := hashlib.md5(blob, usedforsecurity=False).hexdigest()) != md5s[name]:
            raise DataError(f"{f}: not {spec['title']}'s published {name} (md5 {md5}, expected {md5s[name]}); not "
                            "unpickled, as a pickle can run code: unpack the official archive again, or give the data "
                            f"as one file: {data_argument(flag, 'FILE.npz')}")
        return blob
    return _batches_to_arrays(read, folder, spec)


def read_npz(path):
    """The four arrays of a .npz; a DataError naming the file where it is not a .npz (numpy would read any other
    file as a pickle) or lacks one of them (naming the arrays it holds)."""
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: not a readable .npz (not a zip archive of arrays, as numpy.savez writes)")
    try:
        with np.load(path) as z:
            missing = [k for k in KEYS if k not in z.files]
            if missing:
                raise DataError(f"{path}: missing arrays {missing}; it holds {sorted(z.files)}, expected {list(KEYS)}")
            arrays = {k: z[k] for k in KEYS}
        for k, v in arrays.items():        # numpy hands a member that is not .npy data back as its bytes
            if not isinstance(v, np.ndarray):
                raise DataError(f"{path}: {k}.npy is not .npy data (numpy.save's format); write the file with "
                                "numpy.savez")
        return arrays
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: not a readable .npz ({type(e).__name__}: {e})") from e


def check_arrays(d, source, preset=None):
    """Raises DataError unless d holds uint8 (N, H, W, 3) images, H and W at least 8 and the same in both splits,
    and integer labels from 0 (as many classes as the largest label + 1); with a preset (a key of DATASETS), its
    32x32 images and labels below its number of classes. Labels come back as uint8 when they fit, else int64."""
    missing = [k for k in KEYS if k not in d]
    if missing:
        raise DataError(f"{source}: missing arrays {missing}; expected {list(KEYS)}")
    spec = DATASETS[preset] if preset else None
    for split in ("train", "test"):
        x, y = d[f"{split}_images"], d[f"{split}_labels"]
        if x.dtype != np.uint8:
            raise DataError(f"{source}: {split}_images has dtype {x.dtype}, expected uint8")
        if x.ndim != 4 or x.shape[3] != 3 or min(x.shape[1:3]) < 8 or len(x) == 0:
            raise DataError(f"{source}: {split}_images has shape {x.shape}, expected (N, H, W, 3) with N > 0 and "
                            "H, W at least 8")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{source}: {split}_labels has shape {y.shape}, expected ({len(x)},)")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{source}: {split}_labels has dtype {y.dtype}, expected integers")
        if y.min() < 0:
            raise DataError(f"{source}: {split}_labels out of range ({y.min()}..{y.max()}), expected integers from 0")
    if d["train_images"].shape[1:] != d["test_images"].shape[1:]:
        raise DataError(f"{source}: train_images are {'x'.join(map(str, d['train_images'].shape[1:3]))} pixels but "
                        f"test_images {'x'.join(map(str, d['test_images'].shape[1:3]))}; expected the same size")
    for split in ("train", "test") if spec else ():
        x, y = d[f"{split}_images"], d[f"{split}_labels"]
        if y.max() >= spec["classes"]:
            raise DataError(f"{source}: {split}_labels out of range ({y.min()}..{y.max()}); {spec['title']}'s labels "
                            f"are 0..{spec['classes'] - 1} (leave out --dataset to train on your own data's "
                            f"{y.max() + 1} classes)")
        if x.shape[1:3] != (32, 32):
            raise DataError(f"{source}: {split}_images are {x.shape[1]}x{x.shape[2]} pixels; {spec['title']}'s are "
                            "32x32 (leave out --dataset to train on your own data)")
    check_classes(d, source, spec)
    label_type = np.uint8 if num_classes(d) <= 256 else np.int64
    # images C-contiguous, copied only where they are not (a reversed view: torch takes no negative strides)
    return {k: (d[k].astype(label_type) if k.endswith("labels") else np.ascontiguousarray(d[k])) for k in KEYS}


def check_classes(d, source, spec=None):
    """Raises DataError (one line, the class count said) unless the labels are 0..C-1 for a plausible C: at least 2
    classes; for one's own data, at least half of the C occurring and no more classes than training images (a stray
    label of 1,000,000 would build a network of a million outputs); for a preset (spec), not exactly another
    preset's classes (CIFAR-10's data said to be CIFAR-100)."""
    classes = num_classes(d)
    seen = len(np.union1d(np.unique(d["train_labels"]), np.unique(d["test_labels"])))
    top = f"labels 0..{classes - 1}: {classes} class{'es' * (classes != 1)}"
    if classes < 2:
        raise DataError(f"{source}: every label is 0, one class; a classifier needs at least 2")
    if spec:
        other = next((o for o in DATASETS.values() if o is not spec and o["classes"] == classes), None)
        if other:
            raise DataError(f"{source}: {top}, as {other['title']}'s; {spec['title']} has {spec['classes']} (give "
                            f"the --dataset this data is, or leave it out)")
        return
    if 2 * seen < classes:
        raise DataError(f"{source}: {top}, of which only {seen} occur; labels must number the classes 0..C-1 (a "
                        f"stray label of {classes - 1}?)")
    if classes > len(d["train_labels"]):
        raise DataError(f"{source}: {top}, more than the {len(d['train_labels'])} training images; labels must "
                        "number the classes 0..C-1")


def num_classes(arrays):
    """The number of classes: the largest label of either split, plus one."""
    return int(max(arrays["train_labels"].max(), arrays["test_labels"].max())) + 1


def channel_stats(images, chunk=1 << 20):
    """Per-channel mean and standard deviation (0..255 scale) of uint8 (N, H, W, C) images, from each channel's
    histogram (no float copy of the images), rounded to 0.001."""
    pixels = images.reshape(-1, images.shape[-1])
    counts = np.zeros((pixels.shape[1], 256))
    for i in range(0, len(pixels), chunk):
        for c in range(pixels.shape[1]):
            counts[c] += np.bincount(pixels[i:i + chunk, c], minlength=256)
    values, n = np.arange(256.0), counts.sum(1)
    mean = counts @ values / n
    std = np.sqrt(np.maximum(counts @ values ** 2 / n - mean ** 2, 0))      # a constant channel: 0, never NaN
    # 0.001: the precision of CIFAR-10's MEAN and STD, which its statistics then equal exactly (bit-for-bit training)
    return tuple(np.round(mean, 3).tolist()), tuple(np.round(std, 3).tolist())


def take_subset(arrays, n_train=None, n_test=None):
    """The first n_train training and n_test test images (None keeps them all)."""
    return {**arrays, "train_images": arrays["train_images"][:n_train],
            "train_labels": arrays["train_labels"][:n_train],
            "test_images": arrays["test_images"][:n_test], "test_labels": arrays["test_labels"][:n_test]}


def write_cache(path, d):
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **d)  # uncompressed: the next start reads 184 MB straight from the page cache
    write_atomic(path, write)


def check_data_path(p):
    """Raises DataError (one line) for a --data-dir that is neither a .npz file (any case of the suffix) nor a folder:
    what is there instead (a fifo, a device, a folder named .npz, a loop of links) or that nothing is."""
    npz = p.suffix.lower() == ".npz"
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(f"{p}: is a loop of symbolic links") from None
        if npz:
            raise DataError(f"{p}: no such file") from None
        return
    kind = not_a_file(p)
    if npz and kind:
        raise DataError(f"{p}: is {kind}, not a .npz file")
    if not npz and kind not in (None, "a folder"):
        raise DataError(f"{p}: is {kind}; expected a .npz file or a folder")
    if not npz and kind is None:
        raise DataError(f"{p}: expected a .npz file or a folder")


def load(path="data", dataset=None, *, download_ok=True, archive=None, url=None, progress=True, flag="--data-dir"):
    """Four numpy arrays (images uint8 NHWC, labels uint8 or int64) from `path`: a .npz (check_arrays), a folder of
    the official pickles, or a data folder (its cache, else its official archive, downloaded if absent). `dataset`: a
    folder's (None: cifar10) or what a .npz must be (None: one's own); `flag`: how a message names the data
    (data_argument); `archive`, `url`: for tests."""
    p = Path(path)
    check_data_path(p)
    if p.suffix.lower() == ".npz":
        return check_arrays(read_npz(p), p, dataset)
    dataset = dataset or "cifar10"
    spec = DATASETS[dataset]
    archive, url = archive or spec["archive"], url or spec["url"]
    if (p / spec["train"][0]).is_file():
        return check_arrays(read_batches_dir(p, spec, flag=flag), p, dataset)
    cache = p / spec["cache"]
    if cache.is_file():
        return check_arrays(read_npz(cache), cache, dataset)
    if (p / spec["folder"] / spec["train"][0]).is_file():
        d = check_arrays(read_batches_dir(p / spec["folder"], spec, flag=flag), p / spec["folder"], dataset)
    else:
        tgz = p / archive["name"]
        if not tgz.is_file():
            if not download_ok:
                raise DataError(f"{tgz}: not found and downloading is off")
            writable_folder(p, f"{spec['title']}'s download", f"give {flag} a folder you can write in, or the data as "
                            f"one file: {data_argument(flag, 'FILE.npz')}")
            with made_folder(p):
                download(url, tgz, progress, flag=flag)
        verify_archive(tgz, archive)
        d = check_arrays(read_archive(tgz, spec), tgz, dataset)
    write_cache(cache, d)
    return d


def load_cifar10(path="data", **kwargs):
    """CIFAR-10 as four numpy arrays (load with dataset="cifar10": a .npz is checked as CIFAR-10)."""
    return load(path, "cifar10", **kwargs)


# ---------------------------------------------------------------------------------------------
# The dataset on the device, and batched augmentation
# ---------------------------------------------------------------------------------------------

def upload_normalised(x, device, *, dtype, stats, pad=0):
    """uint8 NHWC images on the device as NCHW in dtype, normalised by stats, reflect-padded by pad."""
    wide = devices.wide_dtype(dtype)
    x = torch.from_numpy(x).to(device).permute(0, 3, 1, 2).to(wide)
    mean, std = (torch.tensor(v, device=device, dtype=wide).view(1, -1, 1, 1) for v in stats)
    x = (x - mean) / torch.where(std > 0, std, 1.0)  # a constant channel (std 0) normalised to 0, not NaN
    return (F.pad(x, (pad,) * 4, mode="reflect") if pad else x).to(dtype)


def dataset_on_device(d, device, *, dtype, pad, stats=None):
    """The four arrays on the device, normalised by stats (default: the training images'), and num_classes."""
    stats = stats or channel_stats(d["train_images"])
    return {"train_images": upload_normalised(d["train_images"], device, dtype=dtype, stats=stats, pad=pad),
            "test_images": upload_normalised(d["test_images"], device, dtype=dtype, stats=stats),
            **{k: torch.from_numpy(d[k]).to(device).long() for k in ("train_labels", "test_labels")},
            "num_classes": num_classes(d)}


def pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


@dataclass(frozen=True, kw_only=True)
class AugmentSettings:
    """Each epoch's augmentation and the side it trains at."""
    PREFIX = ""
    crop_pad: int = knob(4, low=0, whole=True, doc="random crops of the images padded by this")
    flip: str = knob("random", choices=("none", "random", "alternate"),
                     doc="alternate: each image both ways in any two epochs (Jordan 2024)")
    cutout: int = knob(8, low=0, whole=True, doc="a square of this side set to 0")
    jitter_brightness: float = knob(0.0, low=0, doc="+- this, per image (the record)")
    jitter_contrast: float = knob(0.0, low=0, doc="x 1 +- this, per image (the record)")
    resolution_schedule: tuple = knob((), above=0, whole=True, doc="epoch i's side in pixels (resized antialiased), "
                                      "then the images' own (24,24,28: 2 epochs at 24, 1 at 28, then 32)")

    def resolution(self, epoch, full):
        return self.resolution_schedule[epoch] if epoch < len(self.resolution_schedule) else full


def draw_augmentation(n, size, augment, *, generator, epoch=0, flip_base=None, order=None):
    """{what: tensor}: one epoch's random draws for n images. Alternate flips (Jordan 2024), jitter:
    flip_i = flip_base_i xor (epoch odd);  x <- (x + b) c,  b ~ U(±jitter_brightness), c ~ 1 + U(±jitter_contrast)"""
    device, pad = generator.device, augment.crop_pad
    draws = {"perm": torch.randperm(n, device=device, generator=order or generator)}
    if pad:
        draws["dy"], draws["dx"] = torch.randint(0, 2 * pad + 1, (2, n), device=device, generator=generator)
    if augment.flip == "random":
        draws["flip"] = flip_bits(n, generator)
    elif augment.flip == "alternate":
        draws["flip"] = ~flip_base if epoch % 2 else flip_base
    if augment.cutout:
        draws["cy"], draws["cx"] = cutout_corners(n, size, augment.cutout, generator)
    if augment.jitter_brightness or augment.jitter_contrast:
        u = torch.rand(2, n, device=device, generator=generator) * 2 - 1
        u[0].mul_(augment.jitter_brightness)
        u[1].mul_(augment.jitter_contrast).add_(1)
        draws["jitter"] = u  # one tensor: one gather puts both factors in the epoch's order
    return draws


def cutout_corners(n, size, cutout, generator):
    """(rows, columns) of n cutout squares' top-left corners in images of `size`."""
    h, w = pair(size)
    draw = lambda high, shape: torch.randint(0, high, shape, device=generator.device, generator=generator)
    if h == w:      # both corners in one call, as square images always drew them (a seed trains as it did)
        return draw(h - cutout + 1, (2, n))
    return draw(h - cutout + 1, (n,)), draw(w - cutout + 1, (n,))


def flip_bits(n, generator):
    return torch.rand(n, device=generator.device, generator=generator) < 0.5


def cutout_mask(cy, cx, size, patch):
    """True inside each image's patch×patch square, shape (N, 1, height, width) of `size`."""
    h, w = pair(size)

    def inside(corner, length):
        i = torch.arange(length, device=cy.device)
        return (i >= corner[:, None]) & (i < corner[:, None] + patch)
    return (inside(cy, h)[:, :, None] & inside(cx, w)[:, None, :])[:, None]


def augment_images(x, draws, size, cutout, *, memory_format=torch.contiguous_format):
    """The padded images with one epoch's draws applied, in their order (perm): crops and flips in one gather."""
    order, (h, w) = draws["perm"], pair(size)
    rows = torch.arange(h, device=x.device)
    cols = rows if w == h else torch.arange(w, device=x.device)
    if "flip" in draws:
        cols = torch.where(draws["flip"][:, None], w - 1 - cols, cols)
    if "dy" in draws:
        rows, cols = draws["dy"][:, None] + rows, draws["dx"][:, None] + cols
    rows, cols = (t[order] if t.dim() == 2 else t for t in (rows, cols))      # each image's, in the epoch's order
    # channels sliced, not indexed, come last: the (N, h, w, C) gathered is NCHW's layout
    if memory_format == torch.channels_last:
        x = x[order.view(-1, 1, 1), :, rows.view(-1, h, 1), cols.view(-1, 1, w)].permute(0, 3, 1, 2)
    else:
        channel = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
        x = x[order.view(-1, 1, 1, 1), channel, rows.view(-1, 1, h, 1), cols.view(-1, 1, 1, w)]
    if "jitter" in draws:
        brightness, contrast = (f.view(-1, 1, 1, 1) for f in draws["jitter"][:, order].to(x.dtype))
        x.add_(brightness).mul_(contrast)
    if "cy" in draws:
        x.masked_fill_(cutout_mask(draws["cy"][order], draws["cx"][order], size, cutout), 0)
    return x


def low_resolution(x, size, *, memory_format=torch.preserve_format):
    """x resized to `size`, a side or (height, width) (bilinear, antialiased: each output pixel averages the input
    it covers), in memory_format."""
    return F.interpolate(devices.float32_or_wider(x), size=pair(size), mode="bilinear", antialias=True,
                         align_corners=False).to(x.dtype, memory_format=memory_format)


def epoch_batches(data, augment, generator, *, batch_size, epoch=0, flip_base=None, order=None):
    """Yields one shuffled epoch's full batches (images, labels), augmented, at its side."""
    size, x = tuple(data["test_images"].shape[-2:]), data["train_images"]
    draws = draw_augmentation(len(x), size, augment, generator=generator, epoch=epoch, flip_base=flip_base, order=order)
    side = pair(augment.resolution(epoch, size))
    if side == size:
        x = augment_images(x, draws, size, augment.cutout, memory_format=devices.memory_format(x.device))
    else:
        x = resized_images(x, draws, size, side, cutout=augment.cutout)
    y = data["train_labels"][draws["perm"]]
    for i in range(0, len(x) - batch_size + 1, batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]


def resized_images(x, draws, size, side, *, cutout):
    """The padded images x with one epoch's draws applied (augment_images), resized to `side`."""
    # resized from NCHW, and laid out as the device's by the resize's cast
    x = augment_images(x, draws, size, cutout)
    return low_resolution(x, side, memory_format=devices.memory_format(x.device))
