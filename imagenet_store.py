"""The ImageNet store: an ImageFolder tree of JPEGs (train/<class>/*, val/<class>/*) decoded once, in worker
processes and in resumable shards, into uint8 arrays that training memory-maps; opening such a store; and a
generator of small ImageFolder trees for tests and benchmarks. No torch: the store is plain numpy files
(README.md, "ImageNet", gives the format).
"""
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from core import DataError, UsageError, die_with_parent, write_atomic, write_json

STORE_VERSION = 2        # 2: landscape validation images stored as such (1 stored them as portrait strips)
EXTENSIONS = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"}

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
    """Validation image (width, height): shorter side = size, longer side rounded to a multiple of `step`
    (so few distinct shapes exist and a batch of one shape needs no resizing) and capped at
    max_aspect × size."""
    long_ = min(max(w, h) * size / min(w, h), max_aspect * size)
    long_ = max(size, int(round(long_ / step)) * step)
    return (long_, size) if w >= h else (size, long_)  # (out_w, out_h): a landscape photo stays wider than tall


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


def check_prepare(size, workers=None, shard_size=1000, max_aspect=2.0, max_shards=None):
    """Raises UsageError naming the first of prepare's settings out of its range (they are its flags)."""
    for flag, value, ok, why in (("size", size, size >= 8, "must be at least 8"),
                                 ("workers", workers, workers is None or workers >= 1, "must be positive"),
                                 ("shard-size", shard_size, shard_size >= 1, "must be positive"),
                                 ("max-aspect", max_aspect, max_aspect >= 1,
                                  "must be at least 1 (the longer side over the shorter)"),
                                 ("max-shards", max_shards, max_shards is None or max_shards >= 1, "must be positive")):
        if not ok:
            raise UsageError(f"--{flag} {value:g}: {why}")


def prepare(src, dst, size, workers=None, shard_size=1000, max_aspect=2.0, max_shards=None, log=print):
    """Builds the store; returns its index dict, or None when stopped by max_shards.

    Work is cut into shards written atomically under dst/shards/; a shard whose inputs match a
    finished one is skipped, so an interrupted run resumes where it stopped. The decoding workers end with this
    process, however it ends. Bad settings raise UsageError (check_prepare) before anything is written.
    """
    check_prepare(size, workers, shard_size, max_aspect, max_shards)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DataError(f"{src}: no such folder")
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
        done = sum(len(j[2]) for j, f in zip(jobs, finished) if f)
        with tqdm(total=len(items), initial=done, desc=f"prepare {split}", unit="img", file=sys.stderr) as bar, \
                ProcessPoolExecutor(min(workers, max(1, len(todo))), initializer=die_with_parent) as pool:
            futures = {pool.submit(prepare_shard, p, k, split, part, size, max_aspect, step): part
                       for p, k, part in todo}
            unreadable = 0
            for fut in as_completed(futures):
                _, errs = fut.result()
                for f, reason in errs:
                    tqdm.write(f"skipped {f}: {reason}", file=sys.stderr)     # above the bar, which stays whole
                unreadable += len(errs)
                new_shards += 1
                bar.set_postfix(skipped=unreadable, refresh=False)
                bar.update(len(futures[fut]))
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
# The prepared store, memory-mapped
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
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
        s = Store(index=index, train_x=load("train.npy"), train_y=load("train_labels.npy"), val_x=load("val.npy"),
                  val_y=load("val_labels.npy"), val_shapes=load("val_shapes.npy"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable store file ({e})") from e
    if s.train_x.shape[0] != index["train"]["count"] or s.val_y.shape[0] != index["val"]["count"]:
        raise DataError(f"{path}: image counts disagree with index.json; prepare it again")
    return s
