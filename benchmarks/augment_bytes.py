"""The crop and flip of one CIFAR-10 epoch, as it was (a torch.where over the whole training set per offset of each
axis, then one for the flip: tests/test_augment.py keeps it as the reference) and as it is (one gather in
cifar_data.augment_images), on the CPU: the bytes each moves (counted from the shapes), the operators and allocations
torch.profiler sees in one call of each, and their times, alternating old and new in this one process.

    python benchmarks/augment_bytes.py --data cifar10.npz    # 50,000 images, pad 4, 20 repetitions
    python benchmarks/augment_bytes.py --data data.npz --pad 2 --reps 10
"""
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from core import Parser  # noqa: E402
import cifar_data as cd  # noqa: E402
from test_augment import crop_flip_by_masks  # noqa: E402
from machine import alternating  # noqa: E402


def bytes_moved(n, c, size, *, pad, itemsize):
    """Bytes read and written by each version, counted from the shapes (indices and masks of a few bytes an image
    left out): the old one's torch.where reads two inputs and writes one output per offset, 2·pad of them for the
    rows (over h × (w + 2·pad) windows) and as many for the columns (h × w); its flip copies the crops (read,
    write) and selects (2 reads, 1 write). The gather reads each output pixel once and writes it once."""
    h, w = size, size
    rows = 2 * pad * 3 * n * c * h * (w + 2 * pad)
    cols = 2 * pad * 3 * n * c * h * w
    flip = 5 * n * c * h * w
    return {"old": (rows + cols + flip) * itemsize, "new": 2 * n * c * h * w * itemsize}


def profiled(fn):
    """(aten operators called, bytes they allocated) in one call of fn, as torch.profiler records them."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(top), sum(max(e.cpu_memory_usage, 0) for e in top), prof


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/cifar10.npz", help="CIFAR-10 arrays (.npz, as --data-dir takes)")
    parser.add_argument("--pad", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    with np.load(args.data) as f:
        arrays = {k: f[k] for k in ("train_images", "train_labels", "test_images", "test_labels")}
    data = cd.dataset_on_device(arrays, torch.device("cpu"), dtype=torch.float32, pad=args.pad)
    x = data["train_images"]
    n, c, size = len(x), x.shape[1], arrays["test_images"].shape[1]
    r = cd.draw_augmentation(n, size, cd.AugmentSettings(crop_pad=args.pad, flip="random", cutout=0),
                             generator=torch.Generator().manual_seed(0))
    r["perm"] = torch.arange(n)  # the images' own order, as the masked selects keep them (a run's is shuffled)
    old = lambda: crop_flip_by_masks(x, r, size)
    new = lambda: cd.augment_images(x, r, size, cutout=0)  # no jitter, no cutout: the crop and flip alone
    print(f"{n} images {tuple(x.shape[1:])} {x.dtype}, crops of {size}, pad {args.pad}, flip random; "
          f"{torch.get_num_threads()} threads")
    print("bit-identical:", torch.equal(old(), new()))
    counted = bytes_moved(n, c, size, pad=args.pad, itemsize=x.element_size())
    for name, fn in (("old", old), ("new", new)):
        ops, allocated, prof = profiled(fn)
        print(f"{name}: counted {counted[name] / 1e9:.3f} GB read+written; profiler: {ops} aten operators, "
              f"{allocated / 1e9:.3f} GB allocated by them")
        print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=8))
    times = alternating({"old": old, "new": new}, args.reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"n={args.reps} alternating repetitions: median old {med['old']:.4f} s, new {med['new']:.4f} s, "
          f"new/old {med['new'] / med['old']:.4f} (old/new {med['old'] / med['new']:.1f}x)")
    print("min old {:.4f} s, new {:.4f} s".format(min(times["old"]), min(times["new"])))


if __name__ == "__main__":
    main()
