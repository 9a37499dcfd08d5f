"""How fast `imagenet_fast.py prepare` writes a store on this machine: images/s, and GB/s of source JPEGs read and of
store written, for each format, with every core encoding (prepare's default workers).

The source is --src, or synthetic photos it writes first (mixed 4:3, 3:4 and square, longer side --photo-side, JPEG
quality 90, a little noise: ImageNet-like shapes and file sizes; their writing is not timed). At 500 px a JPEG store
keeps them byte for byte (decoded once, to check them); larger ones are decoded at a reduced DCT scale, resized and
encoded again. Each format is
prepared --repeats times into a fresh folder; the table gives the median.

    python benchmarks/imagenet_prepare.py --out results/<machine>/imagenet_prepare.json
    python benchmarks/imagenet_prepare.py --photo-side 1000 --out results/<machine>/imagenet_prepare_1000.json
    python benchmarks/imagenet_prepare.py --src /data/imagenet-subset
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import imagenet_store as ims  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from imagenet_throughput import photos  # noqa: E402


def source_bytes(src):
    return sum(f.stat().st_size for f in Path(src).rglob("*") if f.suffix.lower() in ims.EXTENSIONS)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=None, help="an ImageFolder tree (default: write synthetic photos)")
    p.add_argument("--images", type=int, default=2000, help="synthetic photos to write (default 2000)")
    p.add_argument("--photo-side", type=int, default=500,
                   help="their longer side (default 500: kept as they are; larger ones are re-encoded to 500)")
    p.add_argument("--formats", default="jpeg,raw", help="formats to prepare, comma-separated (default jpeg,raw)")
    p.add_argument("--size", type=int, default=128, help="raw store's size (default 128, prepare's)")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPU count, prepare's)")
    p.add_argument("--repeats", type=int, default=3, help="preparations of each format (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    for flag, bad in (("images", args.images < 1 and not args.src), ("repeats", args.repeats < 1),
                      ("photo_side", args.photo_side < 8),
                      ("workers", args.workers is not None and args.workers < 1),
                      ("formats", not formats or set(formats) - set(ims.FORMATS))):
        if bad:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive" if flag != "formats" else
                    f"--formats {args.formats}: choose from {', '.join(ims.FORMATS)}")
    workers = args.workers or os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = Path(args.src) if args.src else photos(Path(tmp) / "src", args.images, max_side=args.photo_side)
        n_bytes = source_bytes(src)
        table = Table(["format", "images", "source GB", "store GB", "seconds", "images/s", "read GB/s",
                       "written GB/s"], width=13, formats={"source GB": ".3f", "store GB": ".3f", "seconds": ".2f",
                                                          "images/s": ".1f", "read GB/s": ".4f", "written GB/s": ".4f"})
        print(f"prepare with {workers} workers on {os.cpu_count()} cores, {args.repeats} repeats, median",
              file=sys.stderr)
        for fmt in formats:
            settings = ims.StoreSettings(format=fmt, size=args.size)
            times, index = [], None
            for r in range(args.repeats):
                dst = Path(tmp) / f"{fmt}{r}"
                start = time.perf_counter()
                index = ims.prepare(src, dst, settings, workers=workers, log=lambda s: None)
                times.append(time.perf_counter() - start)
            images = index["train"]["count"] + index["val"]["count"]
            store = sum((dst / f"{s}.store").stat().st_size for s in ("train", "val"))
            t = statistics.median(times)
            rows.append({"format": fmt, "images": images, "source GB": n_bytes / 1e9, "store GB": store / 1e9,
                         "seconds": t, "images/s": images / t, "read GB/s": n_bytes / 1e9 / t,
                         "written GB/s": store / 1e9 / t, "all_seconds": times})
            table.append(rows[-1])
    if args.out:
        import machine
        import torch
        write_json(args.out, {"piece": "imagenet_prepare", "command": "python benchmarks/imagenet_prepare.py " +
                              " ".join(sys.argv[1:] if argv is None else argv), "workers": workers,
                              "source": args.src or f"{args.images} synthetic photos, longer side {args.photo_side} px",
                              "repeats": args.repeats, "fingerprint": machine.fingerprint(torch.device("cpu"), True),
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
