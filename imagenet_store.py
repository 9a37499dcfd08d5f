"""The ImageNet store: an ImageFolder tree (train/<class>/*, val/<class>/*) written once, by worker processes,
into one indexed file per split that training memory-maps; opening such a store; and a generator of small
ImageFolder trees for tests and benchmarks. No torch: the store is plain bytes and numpy (docs/imagenet.md,
"The store", gives the format).

Two formats, one layout:
  jpeg  every image whole, its longer side at most max_side (500, as FFCV recommends), as a baseline RGB JPEG
        (re-encoded at `quality`, or the source file's own bytes when it already is one and fits): full-quality
        training, random-resized crops of the whole photo, decoded on the GPU or in the CPU's worker processes.
  raw   uint8 pixels. Training images: the whole image stretched to size x size (so a crop of any part of the photo
        is a box of the square; its true shape is kept in the index); validation images: shorter side `size`,
        rectangular. For low-resolution work (quick ablations, a 128 px phase), where decoding would cost more
        than the step.

A split's file: its records back to back, then its index (a .npy array of ROW: offset, nbytes, height, width,
label), then a 16-byte footer (MAGIC, the index's offset as a little-endian uint64).
"""
import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import socket
import sys
import warnings
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
from tqdm import tqdm

from core import DataError, UsageError
from outputs import writable_folder, write_json
from processes import die_with_parent

STORE_VERSION = 3      # 3: one indexed file per split, jpeg or raw, whole images (2 kept a centre square per image)
FORMATS = ("jpeg", "raw")
EXTENSIONS = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"}
ROW = np.dtype([("offset", "<i8"), ("nbytes", "<i8"), ("height", "<i4"), ("width", "<i4"), ("label", "<i4")])
MAGIC = b"IMSTORE3"


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    """How prepare stores each image (the flags of prepare that shape the store)."""
    format: str = "jpeg"
    size: int = 128          # raw: the shorter side (training records are size x size)
    max_side: int = 500      # jpeg: the longer side at most
    quality: int = 90        # jpeg: the encoder's quality, for images re-encoded
    max_aspect: float = 2.0  # raw validation: the longest aspect kept
    exif_transpose: bool = False    # an image with an EXIF orientation stored upright (re-encoded), not as it lies

    @property
    def step(self):
        return max(1, self.size // 8)


def check_prepare(settings, *, workers=None, shard_size=1000, max_shards=None):
    """Raises UsageError naming the first of prepare's settings out of its range (they are its flags)."""
    s = settings
    for flag, value in (("size", s.size), ("max-side", s.max_side), ("quality", s.quality), ("workers", workers),
                        ("shard-size", shard_size), ("max-shards", max_shards)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"--{flag} {value}: must be a whole number, not {type(value).__name__} {value!r}")
    if isinstance(s.max_aspect, bool) or not isinstance(s.max_aspect, (int, float)):
        raise UsageError(f"--max-aspect {s.max_aspect}: must be a number, not {type(s.max_aspect).__name__}")
    if not isinstance(s.exif_transpose, bool):
        raise UsageError(f"--exif-transpose: true or false, not {type(s.exif_transpose).__name__}")
    for flag, value, ok, why in (
            ("format", s.format, s.format in FORMATS, f"must be one of {', '.join(FORMATS)}"),
            ("size", s.size, s.size >= 8, "must be at least 8"),
            ("max-side", s.max_side, s.max_side >= 8, "must be at least 8"),
            ("quality", s.quality, 1 <= s.quality <= 100, "must be 1..100"),
            ("workers", workers, workers is None or workers >= 1, "must be positive"),
            ("shard-size", shard_size, shard_size >= 1, "must be positive"),
            ("max-aspect", s.max_aspect, s.max_aspect >= 1, "must be at least 1 (the longer side over the shorter)"),
            ("max-shards", max_shards, max_shards is None or max_shards >= 1, "must be positive")):
        if not ok:
            raise UsageError(f"--{flag} {value:g}: {why}" if isinstance(value, float) else f"--{flag} {value}: {why}")


# ---------------------------------------------------------------------------------------------
# One image
# ---------------------------------------------------------------------------------------------

def list_split(src, split, classes=None):
    """(classes, [(path, label)], empty class names, files not read) of src/split/<class>/<image>: classes are
    train/'s sorted names, as torchvision's ImageFolder numbers them, which val/ may lack but not add to; an empty
    class keeps its index. Files not read: paths (relative to src/split) beside the class folders, or in them but
    not images of EXTENSIONS. A folder that cannot be listed, or a class folder that is a link looping back, is a
    DataError naming it."""
    d = Path(src) / split
    if not d.is_dir():
        raise DataError(f"{d}: no such folder (expected {Path(src) / split}/<class>/<image>)")
    entries = [p for p in folder_entries(d) if not p.name.startswith(".")]
    for p in entries:
        check_not_a_loop(p, d)
    found = sorted(p.name for p in entries if p.is_dir())
    unread = sorted(p.name for p in entries if not p.is_dir())
    if not found:
        raise DataError(f"{d}: no class folders (expected {d}/<class>/<image>)")
    if classes is None:
        classes = found
    elif set(found) - set(classes):
        raise DataError(f"{d}: classes {sorted(set(found) - set(classes))[:5]} are not in train/")
    items, empty = [], []
    for label, c in enumerate(classes):
        inside = [f for f in folder_entries(d / c) if not f.name.startswith(".")] if (d / c).is_dir() else []
        files = sorted(f for f in inside if f.suffix.lower() in EXTENSIONS and f.is_file())
        unread += sorted(f"{c}/{f.name}" for f in set(inside) - set(files))
        if not files:
            empty.append(c)
        items += [(str(f), label) for f in files]
    return classes, items, empty, unread


def folder_entries(folder):
    """What folder holds; a DataError naming it where it cannot be listed (no permission, an I/O error)."""
    try:
        return list(folder.iterdir())
    except OSError as e:
        raise DataError(f"{folder}: cannot be listed ({e.strerror or e}); give this user read access to it") from None


def check_not_a_loop(entry, split_dir):
    """Raises DataError naming entry, a symbolic link in split_dir, where it loops: to itself (the kernel's ELOOP)
    or to a folder that holds split_dir (a class of every class folder, holding no images)."""
    if not entry.is_symlink():
        return
    try:
        os.stat(entry)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(f"{entry}: a symbolic link that loops ({os.readlink(entry)}); a class folder must hold "
                            "its images: remove the link, or make it point at one") from None
        return                                           # a link to nothing: a file not read
    target = entry.resolve()
    if target.is_dir() and split_dir.resolve().is_relative_to(target):
        raise DataError(f"{entry}: a symbolic link to {target}, which holds it (a loop); a class folder must hold its "
                        "images: remove the link, or make it point at one")


def unread_warning(folder, unread):
    """The warning line that counts and names what prepare does not read of folder (list_split's unread)."""
    beside = sum("/" not in u for u in unread)
    parts = [f"{beside} beside the class folders" if beside else "",
             f"{len(unread) - beside} in them that are not images ({' '.join(sorted(EXTENSIONS))})"
             if len(unread) > beside else ""]
    return (f"warning: {folder}: {len(unread)} not read, {' and '.join(p for p in parts if p)}: "
            f"{', '.join(unread[:3])}{', ...' * (len(unread) > 3)}; a class's images go in {folder}/<class>/")


def val_shape(w, h, size, *, max_aspect, step):
    """A rectangular view's (width, height): shorter side = size, longer side rounded to a multiple of `step` (so few
    distinct shapes exist and a batch of one shape needs no padding) and capped at max_aspect x size."""
    long_ = min(max(w, h) * size / min(w, h), max_aspect * size)
    long_ = max(size, int(round(long_ / step)) * step)
    return (long_, size) if w >= h else (size, long_)  # (out_w, out_h): a landscape photo stays wider than tall


def centre_box(w, h, ow, oh):
    """The largest centred box of the output's aspect ratio: what is cut so the output is reached by scaling alone."""
    s = max(ow / w, oh / h)
    cw, ch = ow / s, oh / s
    return (max(0.0, (w - cw) / 2), max(0.0, (h - ch) / 2), min(w, (w + cw) / 2), min(h, (h + ch) / 2))


ORIENTATION = 0x0112     # the EXIF tag of how the pixels lie: 1 upright, 2..8 mirrored or turned


def encode_image(path, split, settings):
    """One image as the store keeps it: (record bytes, height, width, whether it carries an EXIF orientation other
    than upright, open_image's note of a large image or None); decoding failures raise. With exif_transpose set,
    such an image is stored upright."""
    im, large = open_image(path)
    with im, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)     # open_image's note says it in one line
        turned = im.getexif().get(ORIENTATION, 1) != 1
        if turned and settings.exif_transpose:
            im = ImageOps.exif_transpose(im)        # a new image, decoded: no longer the source's JPEG bytes
        return (*encode_pixels(im, path, split, settings), turned, large)


class TooLarge(ValueError):
    """An image with more pixels than PIL decodes (twice PIL.Image.MAX_IMAGE_PIXELS: its decompression bomb's)."""


def open_image(path):
    """(PIL's image at path, opened lazily, a note when it has more pixels than PIL.Image.MAX_IMAGE_PIXELS, else
    None); TooLarge beyond twice that, which PIL refuses as a decompression bomb. PIL's own check is made here, so
    that it says the image's size in one line and never prints its warning through prepare's progress bar."""
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        im = Image.open(path)
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    w, h = im.size
    size = f"{w}x{h} pixels ({w * h / 1e6:.0f} megapixels)"
    if limit and w * h > 2 * limit:
        im.close()
        raise TooLarge(f"too large: {size}, beyond the {2 * limit / 1e6:.0f} megapixels PIL decodes (its guard "
                       "against decompression bombs)")
    return im, (f"{size}, stored; PIL takes images beyond {limit / 1e6:.0f} megapixels for possible decompression "
                "bombs" if limit and w * h > limit else None)


def encode_pixels(im, path, split, settings):
    """(record bytes, height, width) of the opened image im, read from path."""
    s = settings
    w, h = im.size
    if s.format == "jpeg":
        scale = min(1.0, s.max_side / max(w, h))
        ow, oh = max(1, round(w * scale)), max(1, round(h * scale))
        keep = im.format == "JPEG" and im.mode == "RGB" and not im.info.get("progressive") and scale == 1
        im.draft("RGB", (ow, oh))       # libjpeg's DCT scaling to the nearest size >= the output
        im = im.convert("RGB")          # the full decode: truncated or corrupt files raise here
        if keep:                        # already a baseline RGB JPEG that fits: its own bytes, no second loss
            return Path(path).read_bytes(), h, w
        if im.size != (ow, oh):
            im = im.resize((ow, oh), Image.BILINEAR)
        out = io.BytesIO()
        im.save(out, "JPEG", quality=s.quality)
        return out.getvalue(), oh, ow
    if split == "train":              # raw training: the whole image, stretched to a square; its shape in the index
        scale = s.size / min(w, h)
        ow, oh, box = s.size, s.size, None
        shape = (max(s.size, round(h * scale)), max(s.size, round(w * scale)))
    else:                             # raw validation: rectangular, shorter side `size`
        ow, oh = val_shape(w, h, s.size, max_aspect=s.max_aspect, step=s.step)
        box, shape = centre_box(w, h, ow, oh), (oh, ow)
    scale = max(ow / w, oh / h)
    im.draft("RGB", (ow, oh) if box is None else (int(np.ceil(w * scale)), int(np.ceil(h * scale))))
    im = im.convert("RGB")
    if box is not None:                                   # in the drafted image's pixels
        sx, sy = im.size[0] / w, im.size[1] / h
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    pixels = np.asarray(im.resize((ow, oh), Image.BILINEAR, box=box), dtype=np.uint8)
    return pixels.tobytes(), *shape


def encode_shard(items, split, settings):
    """Encodes one shard's images: ([(bytes, height, width, label)], [(path, reason)] of those that failed, the
    number carrying an EXIF orientation, [(path, note)] of those stored that PIL takes for possible decompression
    bombs)."""
    records, errors, turned, large = [], [], 0, []
    for path, label in items:
        try:
            buf, h, w, oriented, note = encode_image(path, split, settings)
        except TooLarge as e:
            errors.append((path, str(e)))
            continue
        except Exception as e:  # any decoding failure: report, skip, count
            errors.append((path, f"{type(e).__name__}: {e}".strip()))
            continue
        records.append((buf, h, w, label))
        turned += oriented
        if note:
            large.append((path, note))
    return records, errors, turned, large


def too_large(skipped):
    """How many of a split's skipped files (path, reason) were skipped as too large (TooLarge)."""
    return sum(reason.startswith("too large: ") for _, reason in skipped)


# ---------------------------------------------------------------------------------------------
# prepare: ImageFolder tree -> store
# ---------------------------------------------------------------------------------------------

def in_order(pool, fn, jobs, ahead):
    """fn(*job) for each job on the pool's workers, yielded in the jobs' order, at most `ahead` in flight (so the
    results waiting to be written stay few whatever order they finish in)."""
    jobs, pending = iter(jobs), deque()
    for job in jobs:
        pending.append(pool.submit(fn, *job))
        if len(pending) >= ahead:
            break
    while pending:
        result = pending.popleft().result()
        job = next(jobs, None)
        if job is not None:
            pending.append(pool.submit(fn, *job))
        yield result


@contextlib.contextmanager
def worker_pool(workers):
    """A ProcessPoolExecutor whose workers end with this process and leave Ctrl-C to it; left by an exception (Ctrl-C
    included), the queued shards are cancelled and only the shards being encoded are waited for (their results are
    dropped: what is kept is whole shards)."""
    pool = ProcessPoolExecutor(workers, initializer=die_with_parent, initargs=(os.getpid(), True))
    try:
        yield pool
    except BaseException:
        # not terminate(): a worker killed while it sends a result leaves half a message that the executor's thread
        # then waits for forever, and the process with it
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()


def kept(dst):
    """What an interrupted prepare left in dst: the splits finished and the whole shards of the one under way."""
    dst, parts = Path(dst), []
    for split in ("train", "val"):
        if (dst / f"{split}.done.json").is_file():
            parts.append(f"{split} finished")
        elif (dst / f"{split}.journal.json").is_file():
            journal = json.loads((dst / f"{split}.journal.json").read_text())
            parts.append(f"{journal['shards']} whole {split} shard{'s' * (journal['shards'] != 1)} "
                         f"({journal['rows']} images)")
    return f"{', '.join(parts) or 'no whole shard'} kept in {dst}"


def split_key(split, items, settings):
    """Fingerprint of a split's inputs: a partial or finished split is reused only if it matches."""
    return hashlib.sha1(json.dumps([STORE_VERSION, split, asdict(settings), items]).encode()).hexdigest()


def write_split(dst, split, items, settings, *, workers, shard_size, max_shards, log):
    """Writes dst/<split>.store; returns ((rows, errors, images carrying an EXIF orientation, [(path, note)] of large
    images stored) or None when stopped by max_shards, shards written now).
    Shards are encoded in parallel and appended in order, a journal recording after each how far the files are good,
    so a stopped run resumes after the last whole shard; the index and footer come last."""
    data_p, rows_p, journal_p = (dst / f"{split}.{suffix}" for suffix in ("store.partial", "rows.partial",
                                                                          "journal.json"))
    key = split_key(split, items, settings)
    journal = {"key": key, "shards": 0, "bytes": 0, "rows": 0, "errors": [], "turned": 0, "large": []}
    if journal_p.is_file():
        old = json.loads(journal_p.read_text())
        if old.get("key") == key:
            journal = old
    for p, length in ((data_p, journal["bytes"]), (rows_p, journal["rows"] * ROW.itemsize)):
        with open(p, "ab") as f:
            f.truncate(length)
    shards = [items[i:i + shard_size] for i in range(0, len(items), shard_size)]
    todo = list(range(journal["shards"], len(shards)))
    if max_shards is not None:
        todo = todo[:max_shards]
    log(f"{split}: {len(items)} images in {len(shards)} shards; {journal['shards']} already written, "
        f"{len(todo)} to encode with {workers} workers")
    done = sum(len(s) for s in shards[:journal["shards"]])
    with open(data_p, "r+b") as data, open(rows_p, "r+b") as rows, \
            tqdm(total=len(items), initial=done, desc=f"prepare {split}", unit="img", file=sys.stderr) as bar, \
            worker_pool(min(workers, max(1, len(todo)))) as pool:
        data.seek(journal["bytes"])
        rows.seek(journal["rows"] * ROW.itemsize)
        for k, (records, errors, turned, large) in zip(todo, in_order(pool, encode_shard, [(shards[k], split, settings)
                                                                            for k in todo], 2 * workers)):
            index = np.zeros(len(records), ROW)
            for r, (buf, h, w, label) in enumerate(records):
                index[r] = (journal["bytes"], len(buf), h, w, label)
                data.write(buf)
                journal["bytes"] += len(buf)
            rows.write(index.tobytes())
            for f in (data, rows):
                f.flush()
                os.fsync(f.fileno())
            for path, reason in errors:
                tqdm.write(f"skipped {path}: {reason}", file=sys.stderr)    # above the bar, which stays whole
            for path, note in large:
                tqdm.write(f"note: {path}: {note}", file=sys.stderr)
            journal.update(shards=k + 1, rows=journal["rows"] + len(records), errors=journal["errors"] + errors,
                           turned=journal.get("turned", 0) + turned, large=journal.get("large", []) + large)
            write_json(journal_p, journal)
            bar.set_postfix(skipped=len(journal["errors"]), MB=f"{journal['bytes'] / 1e6:.0f}", refresh=False)
            bar.update(len(shards[k]))
    if journal["shards"] < len(shards):
        return None, len(todo)
    index = np.fromfile(rows_p, ROW)
    with open(data_p, "r+b") as data:
        data.seek(journal["bytes"])
        np.save(data, index)
        data.write(MAGIC + np.uint64(journal["bytes"]).tobytes())
        data.flush()
        os.fsync(data.fileno())
    os.replace(data_p, dst / f"{split}.store")
    rows_p.unlink()
    journal_p.unlink()
    return (index, [tuple(e) for e in journal["errors"]], journal.get("turned", 0),
            [tuple(e) for e in journal.get("large", [])]), len(todo)


def prepare(src, dst, settings=StoreSettings(), *, workers=None, shard_size=1000, max_shards=None, log=print):
    """Builds the store; returns its index dict, or None when stopped by max_shards. Bad settings or a tree that
    cannot make a classifier raise before anything is written; dst is held for this prepare alone (held_by_prepare);
    an interrupted run resumes (write_split); the workers end with this process."""
    check_prepare(settings, workers=workers, shard_size=shard_size, max_shards=max_shards)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DataError(f"{src}: no such folder")
    if dst.resolve().is_relative_to(src.resolve()):
        raise UsageError(f"--dst {dst}: inside --src {src}, where the next prepare would take it for a class; give a "
                         "--dst outside --src")
    writable_folder(dst, "the store", "give --dst a folder you can write in")
    classes, train, empty_train, unread_train = list_split(src, "train")
    _, val, empty_val, unread_val = list_split(src, "val", classes)
    if not train:
        raise DataError(f"{src / 'train'}: no images (extensions {sorted(EXTENSIONS)})")
    if not val:
        raise DataError(f"{src / 'val'}: no images (extensions {sorted(EXTENSIONS)})")
    if len(classes) - len(empty_train) < 2:     # train would refuse the store: refused before it is written
        having = [c for c in classes if c not in empty_train]
        raise DataError(f"{src / 'train'}: one class" + (f" ({classes[0]})" if len(classes) == 1 else
                        f" with images ({having[0]}; {len(empty_train)} empty)") + "; a classifier needs at least 2")
    dst.mkdir(parents=True, exist_ok=True)
    with held_by_prepare(dst):
        old = prepared_before(src, dst, settings)
        if old:
            log(f"{dst}: already prepared ({old['train']['count']} train, {old['val']['count']} val images)")
            return old
        for split, empty, unread in (("train", empty_train, unread_train), ("val", empty_val, unread_val)):
            for c in empty:
                print(f"warning: {src / split / c}: no images; class {classes.index(c)} ({c}) is kept with 0 "
                      f"{split} images", file=sys.stderr)
            if unread:     # torchvision's ImageFolder passes them over without a word
                print(unread_warning(src / split, unread), file=sys.stderr)
        index = {"format": "imagenet_fast store", "version": STORE_VERSION, "settings": asdict(settings),
                 "source": str(src.resolve()), "classes": classes}
        return write_store(dst, settings, index, {"train": (train, empty_train), "val": (val, empty_val)},
                           workers=workers or os.cpu_count() or 1, shard_size=shard_size, max_shards=max_shards,
                           log=log)


def prepared_before(src, dst, settings):
    """The index of the store dst holds when it is this one (src's, with these settings), else None where it holds
    none; a DataError of one line where it holds another."""
    index_path = dst / "index.json"
    if not index_path.is_file():
        return None
    old = read_index(index_path, "delete it, or choose another --dst")
    theirs = {**asdict(StoreSettings()), **(old.get("settings") or {})}       # a setting added since: its default
    if theirs == asdict(settings) and old.get("source") == str(src.resolve()):
        return old
    ours = asdict(settings)
    differ = [f"--{k.replace('_', '-')} {theirs.get(k)}" for k in ours if theirs.get(k) != ours[k]]
    raise DataError(f"{index_path}: holds another store ({', '.join(differ) or 'the same settings'} from "
                    f"{old.get('source')}); choose another --dst")


def write_store(dst, settings, index, splits, *, workers, shard_size, max_shards, log):
    """Writes both splits ({split: (items, empty classes)}) and then index.json (`index`, the store's identity, with
    each split's counts); returns the index, or None when stopped by max_shards. A full disk (or any failed write) is a
    DataError of one line naming what is kept: the last whole shard, which the same command resumes from."""
    classes = index["classes"]
    try:
        left = max_shards
        for split, (items, empty) in splits.items():
            written = stored_split(dst, split, items, settings, workers=workers, shard_size=shard_size,
                                   max_shards=left, log=log)
            if written is None:
                log(f"stopped after --max-shards {max_shards} new shards; run again to resume")
                return None
            (rows, skipped, turned, large), shards = written
            left = None if left is None else left - shards
            index[split] = {"count": int(len(rows)),
                            "per_class": np.bincount(rows["label"], minlength=len(classes)).tolist(),
                            "bytes": int(rows["nbytes"].sum()), "skipped": len(skipped),
                            "skipped_files": [list(e) for e in skipped], "too_large": too_large(skipped),
                            "large": len(large), "empty_classes": empty, "exif_oriented": turned}
            for line in split_summary(split, index[split], settings):
                log(line)
        write_json(dst / "index.json", index)  # written last: its presence means the store is complete
    except OSError as e:
        raise DataError(f"{dst}: cannot write the store ({e.strerror or e}); {kept(dst)}; once there is room, "
                        "the same command resumes from there") from None
    for split in splits:
        (dst / f"{split}.done.json").unlink()
    return index


def stored_split(dst, split, items, settings, *, workers, shard_size, max_shards, log):
    """((rows, skipped, images carrying an EXIF orientation, large images stored), shards written now) of a split
    written by write_split, or found finished by a run that stopped later (its <split>.done.json); None when
    max_shards stopped it."""
    done_p, key = dst / f"{split}.done.json", split_key(split, items, settings)
    done = json.loads(done_p.read_text()) if done_p.is_file() else {}
    if done.get("key") == key and (dst / f"{split}.store").is_file():
        return (read_rows(dst / f"{split}.store"), [tuple(e) for e in done["skipped"]], done.get("turned", 0),
                [tuple(e) for e in done.get("large", [])]), 0
    written, shards = write_split(dst, split, items, settings, workers=workers, shard_size=shard_size,
                                  max_shards=max_shards, log=log)
    if written is None:
        return None
    _, skipped, turned, large = written
    write_json(done_p, {"key": key, "skipped": skipped, "turned": turned, "large": large})
    return written, shards


def split_summary(split, counts, settings):
    """prepare's lines of what a split holds (its index.json entry, counts) and what it left out, and of the images
    carrying an EXIF orientation where there are any."""
    unreadable = counts["skipped"] - counts["too_large"]
    line = (f"{split}: {counts['count']} images stored ({counts['bytes'] / 1e9:.3f} GB of {settings.format}), "
            f"{unreadable} unreadable and skipped, "
            + (f"{counts['too_large']} too large and skipped, " if counts["too_large"] else "")
            + (f"{counts['large']} over {Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels stored, " if counts["large"]
               else "") + f"{len(counts['empty_classes'])} empty classes")
    turned = counts["exif_oriented"]
    return [line] + ([f"{split}: an EXIF orientation in {turned} image{'s' * (turned != 1)}: "
                      + ("stored upright (re-encoded)" if settings.exif_transpose else
                         "stored as the pixels lie, turned or mirrored (--exif-transpose stores them upright)")]
                     if turned else [])


LOCK = ".prepare.lock"      # in the store's folder while a prepare writes it: flock'ed, naming its holder


@contextlib.contextmanager
def held_by_prepare(dst):
    """dst held by this prepare alone while it writes there: an exclusive flock on dst/LOCK, whose text names the
    holder; a second prepare is a DataError of one line naming it. The file goes when this one ends (that of a holder
    killed, whose lock went with it, is taken over)."""
    path = dst / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                break           # a file system without locks: prepare runs without one
            holder = os.read(fd, 200).decode(errors="replace").strip()
            os.close(fd)
            raise DataError(f"--dst {dst}: another prepare is writing it ({holder or 'just started'}); wait for it to "
                            "end, or give another --dst") from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:      # not removed by the holder that just ended
                break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# The prepared store, memory-mapped
# ---------------------------------------------------------------------------------------------

def read_rows(path):
    return read_split(path)[0]


def read_split(path):
    """The index rows at the end of a split's file, and where its records end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        if end < 16:
            raise DataError(f"{path}: too short to be a store file")
        f.seek(end - 16)
        footer = f.read(16)
        if footer[:8] != MAGIC:
            raise DataError(f"{path}: not a store file of version {STORE_VERSION} (no footer); prepare it again")
        records_end = int(np.frombuffer(footer[8:], "<u8")[0])
        f.seek(records_end)
        rows = np.lib.format.read_array(f)
    if rows.dtype != ROW or (len(rows) and rows["offset"][-1] + rows["nbytes"][-1] != records_end):
        raise DataError(f"{path}: its index does not match its records; prepare it again")
    return rows, records_end


@dataclass(kw_only=True)
class Split:
    """One split of the store: its index rows and its records' bytes, memory-mapped (read only when used)."""
    rows: np.ndarray      # ROW per image: offset, nbytes, height, width, label
    data: np.ndarray      # uint8, the records back to back

    @property
    def labels(self):
        return self.rows["label"].astype(np.int64)

    def record(self, i):
        return self.data[self.rows["offset"][i]:self.rows["offset"][i] + self.rows["nbytes"][i]]

    def __len__(self):
        return len(self.rows)


@dataclass(kw_only=True)
class Store:
    index: dict
    format: str           # "jpeg" or "raw"
    size: int             # raw: the stored size (training records are size x size)
    train: Split
    val: Split

    def train_pixels(self):
        """raw: the training records as one (N, size, size, 3) uint8 array (a view of the memory-mapped file)."""
        n, s = len(self.train), self.size
        return self.train.data[:n * s * s * 3].reshape(n, s, s, 3)


INDEX_KEYS = {"settings": dict, "classes": list, "train": dict, "val": dict}      # what readers take from index.json


def read_index(path, remedy):
    """index.json's dict; a DataError naming the file where it is not JSON (a disk filled, a copy cut short) or,
    at this version, lacks what readers take from it."""
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not readable ({type(e).__name__}: {e}); {remedy}") from e
    if not isinstance(index, dict):
        raise DataError(f"{path}: not readable (a JSON {type(index).__name__}, not an object); {remedy}")
    missing = [k for k, kind in INDEX_KEYS.items() if not isinstance(index.get(k), kind)]
    if missing and index.get("version") == STORE_VERSION:      # another version's keys may differ: its own error
        raise DataError(f"{path}: not a whole store index (no {', '.join(missing)}); {remedy}")
    return index


def check_classes(store, path):
    """Raises DataError unless the store has at least 2 classes to train on (a single class scores 1 from the start)."""
    classes = store.index["classes"]
    if len(classes) < 2:
        raise DataError(f"{path}: one class ({classes[0]}); a classifier needs at least 2")


def open_store(path):
    """Memory-maps a prepared store (nothing is read until used)."""
    path = Path(path)
    if not (path / "index.json").is_file():
        raise DataError(f"{path}: not a prepared store (no index.json); run `imagenet_fast.py prepare` first")
    index = read_index(path / "index.json", "prepare it again")
    if index.get("version") != STORE_VERSION:
        raise DataError(f"{path / 'index.json'}: store version {index.get('version')}, expected {STORE_VERSION}; "
                        f"prepare it again")
    splits = {}
    for split in ("train", "val"):
        try:
            rows, end = read_split(path / f"{split}.store")
            # mmap "c" (copy-on-write) gives writable arrays, so torch.from_numpy shares them without a copy
            data = (np.memmap(path / f"{split}.store", np.uint8, mode="c", shape=(end,)) if end
                    else np.zeros(0, np.uint8))
        except (OSError, ValueError) as e:
            raise DataError(f"{path / f'{split}.store'}: unreadable ({e}); prepare it again") from e
        if len(rows) != index[split]["count"]:
            raise DataError(f"{path}: image counts disagree with index.json; prepare it again")
        splits[split] = Split(rows=rows, data=data)
    s = index["settings"]
    store = Store(index=index, format=s["format"], size=s["size"], **splits)
    if store.format == "raw" and len(store.train) and (store.train.rows["nbytes"] != s["size"] ** 2 * 3).any():
        raise DataError(f"{path}: raw training records of the wrong size; prepare it again")
    return store
