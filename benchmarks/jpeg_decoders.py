"""CPU JPEG decoders on one core, per image: milliseconds to turn a stored ImageNet-sized JPEG into a training crop.

Photos as benchmarks/imagenet_throughput.py writes them (4:3, 3:4 and square, longer side 500 px, quality 90); each
timed call takes one photo and one random-resized crop (imagenet_data.crop_boxes: torchvision's distribution), in
a fixed order, after a warm-up pass. Rows:

  pil_decode          PIL: the whole image decoded (no crop), for reference
  pil_crop            PIL: the whole image decoded, then the crop resized to --res (antialiased bilinear)
  pil_draft_crop      PIL with libjpeg's DCT scaling (draft) to the smallest scale that keeps the crop at --res,
                      then the crop resized (the CPU decoder before simplejpeg)
  simplejpeg_crop     simplejpeg's decode at the same DCT scale, then PIL's resize of the crop: what
                      imagenet_decoders.cpu_crop does
  torchvision_decode  torchvision.io.decode_jpeg on the CPU (libjpeg-turbo), the whole image
  simplejpeg_decode   simplejpeg.decode_jpeg, the whole image

    python benchmarks/jpeg_decoders.py --out results/<machine>/jpeg_decoders.json
"""
import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import imagenet_data as idt  # noqa: E402
import imagenet_decoders as idec  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from cpu_loaders import pil_decode_crop  # noqa: E402
from imagenet_throughput import photos  # noqa: E402


def methods(res):
    def pil_decode(data, box):
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    def pil_crop(data, box):
        top, left, h, w = box
        im = Image.open(io.BytesIO(data)).convert("RGB")
        return np.asarray(im.resize((res, res), Image.BILINEAR, box=(left, top, left + w, top + h)))

    def pil_draft_crop(data, box):
        return pil_decode_crop(data, box=box, shape=(res, res))

    def simplejpeg_crop(data, box):
        return idec.cpu_crop(data, box=box, shape=(res, res))
    out = {"pil_decode": pil_decode, "pil_crop": pil_crop, "pil_draft_crop": pil_draft_crop,
           "simplejpeg_crop": simplejpeg_crop}
    try:
        import warnings
        from torchvision.io import decode_jpeg
        warnings.simplefilter("ignore", DeprecationWarning)
        out["torchvision_decode"] = lambda data, box: decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except ImportError:
        pass
    import simplejpeg
    out["simplejpeg_decode"] = lambda data, box: simplejpeg.decode_jpeg(data)
    return out


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=30, help="photos to cycle through (default 30)")
    p.add_argument("-n", type=int, default=300, help="timed calls per method (default 300)")
    p.add_argument("--res", type=int, default=224, help="output resolution of a crop (default 224)")
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    for flag in ("images", "n", "res"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: must be positive" if flag != "n" else f"-n {args.n}: must be "
                    "positive")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        files = sorted((photos(Path(tmp), args.images, classes=1) / "train").rglob("*.JPEG"))
        data = [f.read_bytes() for f in files]
    sizes = [Image.open(io.BytesIO(d)).size for d in data]
    boxes = idt.crop_boxes([h for w, h in sizes], [w for w, h in sizes], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                           generator=torch.Generator().manual_seed(0)).tolist()
    table = Table(["method", "ms per image", "images/s per core"], width=20,
                  formats={"ms per image": ".3f", "images/s per core": ".0f"})
    print(f"{len(data)} photos of {sorted(set(sizes))}, mean {np.mean([len(d) for d in data]) / 1e3:.1f} kB; "
          f"crops to {args.res} px; one thread; median of {args.n} calls", file=sys.stderr)
    rows = []
    for name, f in methods(args.res).items():
        for i in range(len(data)):                 # warm-up: each photo once
            f(data[i], boxes[i])
        times = []
        for k in range(args.n):
            i = k % len(data)
            start = time.perf_counter()
            f(data[i], boxes[i])
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        rows.append({"method": name, "ms per image": ms, "images/s per core": 1e3 / ms, "n": args.n})
        table.append(rows[-1])
    if args.out:
        import machine
        write_json(args.out, {"piece": "jpeg_decoders", "command": "python benchmarks/jpeg_decoders.py " + " ".join(
            a for a in (sys.argv[1:] if argv is None else argv)), "res": args.res, "n": args.n,
            "mean_bytes": float(np.mean([len(d) for d in data])), "fingerprint": machine.fingerprint(
                torch.device("cpu"), True), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
