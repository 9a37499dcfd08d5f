"""The CPU decoder's candidates side by side: images/s per core of whole batches of random-resized crops (the training
crops: imagenet_data.crop_boxes) decoded from a JPEG store into host memory by --workers workers, at each of --sizes:

  threads_pil          PIL with libjpeg's DCT scaling (draft) on a thread pool: the loader before this benchmark
  threads_simplejpeg   imagenet_decoders.cpu_crop (simplejpeg's DCT-scaled decode, PIL's resize) on a thread pool
  processes_pil        PIL's draft decode in forked worker processes writing into shared memory
                       (imagenet_data.cpu_batches)
  processes_simplejpeg imagenet_data.cpu_batches as it is: cpu_crop in forked worker processes, into shared memory
  pil_dataloader       torchvision's ImageFolder + RandomResizedCrop + flip in DataLoader worker processes, decoding
                       the original files with PIL (the usual PyTorch pipeline), as many workers

Photos as benchmarks/imagenet_throughput.py writes them (4:3, 3:4 and square, longer side 500 px, quality 90). Each
figure is the median over --repeats of --batches timed batches after one untimed batch (which starts the workers);
the candidates take turns within each repeat. Per core divides by the workers.

    python benchmarks/cpu_loaders.py --workers 2 --out results/<machine>/cpu_loaders.json
"""
import argparse
import io
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import imagenet_data as idt  # noqa: E402
import imagenet_store as ims  # noqa: E402
import imagenet_workers  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from imagenet_throughput import photos  # noqa: E402

METHODS = ("threads_pil", "threads_simplejpeg", "processes_pil", "processes_simplejpeg", "pil_dataloader")


def pil_decode_crop(record, *, box, shape, raw_shape=None):
    """The decoder before simplejpeg: PIL's draft to the smallest DCT scale that holds the box at the output size,
    then the box resized (antialiased bilinear)."""
    top, left, bh, bw = (float(v) for v in box)
    oh, ow = shape
    im = Image.open(io.BytesIO(record))
    W, H = im.size
    im.draft("RGB", (math.ceil(W * ow / bw), math.ceil(H * oh / bh)))
    sx, sy = im.size[0] / W, im.size[1] / H
    top, left, bh, bw = top * sy, left * sx, bh * sy, bw * sx
    return np.asarray(im.convert("RGB").resize((ow, oh), Image.BILINEAR, box=(left, top, left + bw, top + bh)))


def threaded(decode, store, jobs, workers):
    """Each job's batch decoded by `decode` on a pool of threads, each thread a slice of the batch: the batches."""
    pool = ThreadPoolExecutor(workers)

    def part(out, rows, boxes):
        for k, (r, box) in enumerate(zip(rows, boxes)):
            out[k] = decode(store.train.record(r), box=box, shape=out.shape[1:3])
    for rows, boxes, (oh, ow), _ in jobs:
        out = np.empty((len(rows), oh, ow, 3), np.uint8)
        edges = np.linspace(0, len(rows), workers + 1).astype(int)
        list(pool.map(part, [out[a:z] for a, z in zip(edges[:-1], edges[1:])],
                      [rows[a:z] for a, z in zip(edges[:-1], edges[1:])],
                      [boxes[a:z] for a, z in zip(edges[:-1], edges[1:])]))
        yield out
    pool.shutdown()


def batches(method, store, src, *, res, batch_size, workers, seed):
    """An endless stream of batches of `method` at res (host memory)."""
    if method == "pil_dataloader":
        folder = torchvision.datasets.ImageFolder(str(src / "train"), transforms.Compose([
            transforms.RandomResizedCrop(res), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]))
        while True:
            yield from torch.utils.data.DataLoader(folder, batch_size, shuffle=True, drop_last=True,
                                                   num_workers=workers, persistent_workers=False)
    data = idt.rank_data(store, torch.device("cpu"), workers=workers)
    gen = torch.Generator().manual_seed(seed)
    real = imagenet_workers.cpu_crop
    if method.endswith("_pil"):
        imagenet_workers.cpu_crop = pil_decode_crop          # the forked workers inherit it
    try:
        while True:
            draws = idt.draw_epoch(data, idt_augment(), gen)
            order = [draws.perm[i:i + batch_size] for i in range(0, len(draws.perm) - batch_size + 1, batch_size)]
            jobs = [(data.train_rows[idx], draws.boxes[idx], (res, res), ()) for idx in order]
            if method.startswith("threads"):
                yield from threaded(imagenet_workers.cpu_crop, store, jobs, workers)
            else:
                yield from (x for x, _ in idt.cpu_batches(data, "train", jobs, device=torch.device("cpu")))
    finally:
        imagenet_workers.cpu_crop = real
        if data.pool is not None:
            data.pool.shutdown()


def idt_augment():
    """torchvision's crop ranges (the recipes' Augment)."""
    return idt.CropAugmentSettings()


def rate(stream, count, batch_size):
    """Images/s over `count` batches of stream after one untimed batch."""
    next(stream)
    start = time.perf_counter()
    for _ in range(count):
        next(stream)
    return count * batch_size / (time.perf_counter() - start)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1000, help="synthetic photos (default 1000)")
    p.add_argument("--sizes", default="128,160,192,224", help="output resolutions (default 128,160,192,224)")
    p.add_argument("--batch-size", type=int, default=64, help="images a batch (default 64)")
    p.add_argument("--batches", type=int, default=8, help="timed batches a measurement (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per candidate and size; the median is kept")
    p.add_argument("--workers", type=int, default=2, help="threads or processes of every candidate (default 2)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"some of {', '.join(METHODS)}")
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    for flag in ("images", "batch_size", "batches", "repeats", "workers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes}: must be whole numbers, comma-separated")
    methods = args.methods.split(",")
    if set(methods) - set(METHODS) or args.batch_size * (args.batches + 1) > args.images:
        p.error(f"--methods {args.methods}: choose from {', '.join(METHODS)}" if set(methods) - set(METHODS) else
                f"--images {args.images}: fewer than the {args.batch_size * (args.batches + 1)} a measurement reads")
    torch.set_num_threads(1)
    rows = []
    table = Table(["res", "method", "images/s", "images/s per core"], width=22,
                  formats={"images/s": ".0f", "images/s per core": ".0f"})
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {args.images} synthetic photos (longer side 500 px) in {tmp}", file=sys.stderr)
        src = photos(Path(tmp) / "src", args.images)
        ims.prepare(src, Path(tmp) / "store", workers=args.workers, log=lambda s: None)
        store = ims.open_store(Path(tmp) / "store")
        for res in sizes:
            seen = {m: [] for m in methods}
            for k in range(args.repeats):
                for m in methods:           # the candidates take turns, so that the machine's drift falls on all
                    stream = batches(m, store, src, res=res, batch_size=args.batch_size, workers=args.workers, seed=k)
                    seen[m].append(rate(stream, args.batches, args.batch_size))
                    stream.close()
            for m in methods:
                median = statistics.median(seen[m])
                rows.append({"res": res, "method": m, "images/s": median, "images/s per core": median / args.workers,
                             "n": args.batches * args.batch_size, "repeats": args.repeats, "runs": seen[m]})
                table.append(rows[-1])
    if args.out:
        import machine
        write_json(args.out, {"piece": "cpu_loaders", "command": "python benchmarks/cpu_loaders.py " + " ".join(
            a for a in (sys.argv[1:] if argv is None else argv) if a != args.out and a != "--out"),
            "workers": args.workers, "batch_size": args.batch_size, "images": args.images,
            "fingerprint": machine.fingerprint(torch.device("cpu"), True), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
