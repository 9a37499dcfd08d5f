"""Is my loader the bottleneck? Training throughput (images/s) of the ImageNet model as a recipe trains it (ResNet-50
with BlurPool for rn50_16ep), at each resolution in --sizes, in one run:

  loader    the training batches alone (imagenet_data.train_batches: read, crop, decode, augment, on the device)
  ceiling   the model's training steps on one batch already on the device: the most any loader could give
  together  the loader feeding the model, as training runs
  pil       torchvision's ImageFolder + RandomResizedCrop + flip in DataLoader workers, decoding the original files
            with PIL (the usual PyTorch pipeline), alone; as many workers as our loader has decoding processes, its
            batches finished as ours are (on the device, normalised, in the compute dtype and layout)
  decode    how the loader's images (those of loader and together) were decoded: by nvJPEG's hardware decoder and its
            software path ("<hardware>h/<software>s", imagenet_decoders.decoded_by_text; the JSON's "decoded" counts
            them), or "cpu"

and, beside them, what predicts a GPU's speed, counted per step under the CPU stand-in for a CUDA GPU
(tests/cuda_standin.py) for each store format and place: the operations launched on the GPU and the copies that
make the host wait, of the data path alone (imagenet_data.train_batches) and of the whole training step (the data,
then imagenet_fast.accumulated_step), at two batch sizes (--count-batch and twice it; neither count depends on the
resolution).

Per GPU figures are per process; per core figures divide the loader's images/s by the CPU processes (or workers)
that decode. The store is --store, or one written from --src, or one written from synthetic photos of mixed 4:3, 3:4 and
square shapes, longer side 500 px (ImageNet's typical), at least 20,000 of them by default.

    python benchmarks/imagenet_throughput.py                  # GPU: rn50_16ep, 20,000 images, 160 and 192 px
    python benchmarks/imagenet_throughput.py --store /data/in500 --src /data/imagenet --sizes 160,192,224
    python benchmarks/imagenet_throughput.py --device cpu --recipe tiny --images 2000 --sizes 64 --batch-size 64
"""
import argparse
import os
from collections import Counter
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import devices  # noqa: E402
import imagenet_data as idt  # noqa: E402
import imagenet_decoders as idec  # noqa: E402
import imagenet_fast as inf  # noqa: E402
import imagenet_store as ims  # noqa: E402
import distributed as D  # noqa: E402
from cli import environment  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from settings import one_of  # noqa: E402
from core import Parser, UsageError  # noqa: E402


def step(model, opt, x, y, *, device, dtype):
    with devices.autocast(device, dtype):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rate(batches, work, *, device, warmup, steps, batch_size):
    """Images/s over `steps` batches after `warmup` untimed ones; work(x, y) is done on each."""
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            devices.synchronize(device)
            start = time.perf_counter()
        work(x, y)
        if i == warmup + steps - 1:
            break
    devices.synchronize(device)
    return steps * batch_size / (time.perf_counter() - start)


def forever(make_epoch):
    while True:
        yield from make_epoch()


def photos(root, n, *, classes=10, max_side=500, seed=0):
    """n smooth-plus-noise photos (a class colour each) of 4:3, 3:4 and square shapes, longer side max_side, as
    JPEG quality 90: ImageNet-like sizes and compressed sizes for loader timing."""
    rng, classes = np.random.default_rng(seed), min(classes, n)
    shapes = ((max_side, max_side * 3 // 4), (max_side * 3 // 4, max_side), (max_side, max_side))
    base = {s: np.mgrid[0:s[1], 0:s[0]].astype(np.float32) for s in shapes}
    for i in range(n):
        (w, h), k = shapes[i % 3], i % classes
        y, x = base[(w, h)]
        im = np.stack([x * 255 / w, y * 255 / h, np.full((h, w), 25.0 * k, np.float32)], -1)
        im += rng.normal(0, 8, (h, w, 1)).astype(np.float32)
        d = Path(root) / "train" / f"c{k:03d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(im.clip(0, 255).astype(np.uint8)).save(d / f"{i:06d}.JPEG", quality=90)
    for k in range(classes):           # prepare wants a validation split: one image a class
        (Path(root) / "val" / f"c{k:03d}").mkdir(parents=True, exist_ok=True)
        (Path(root) / "val" / f"c{k:03d}" / "0.JPEG").write_bytes(
            next((Path(root) / "train" / f"c{k:03d}").iterdir()).read_bytes())
    return Path(root)


PATHS = (("jpeg", dict(decoder="gpu")), ("jpeg", dict(decoder="cpu")), ("raw", dict(where="device")),
         ("raw", dict(where="host")))


def counted(r, tmp, *, batch_size, classes, res=32, steps=2):
    """Per step, under the CPU stand-in for one CUDA GPU, for each store format and place (PATHS) at batch_size and
    twice it: the operations on the GPU and the blocking copies of the data path and of the whole step, from the last
    of `steps` steps (the first also sets up the buffers and streams). Printed as a table; rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cuda_standin import StandIn
    src = photos(tmp / "count_src", 2 * steps * batch_size, classes=2, max_side=64)
    stores = {fmt: tmp / f"count_{fmt}" for fmt in ("jpeg", "raw")}
    for fmt, path in stores.items():
        ims.prepare(src, path, ims.StoreSettings(format=fmt, size=res), workers=1, log=lambda s: None)
    table = Table(["store", "batch", "data ops", "data blocking", "step ops", "step blocking"], width=16)
    rows = []
    for (fmt, where), bs in ((p, bs) for p in PATHS for bs in (batch_size, 2 * batch_size)):
        with StandIn() as gpu:
            device = torch.device("cuda")
            data = idt.rank_data(ims.open_store(stores[fmt]), device, workers=1, **where)
            model = inf.imagenet_network(r, classes).to(device, memory_format=devices.memory_format(device))
            opt = inf.imagenet_optimizer(model, r)
            gen = torch.Generator().manual_seed(0)
            batches = idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=res,
                                        batch_size=bs, device=device, dtype=torch.bfloat16)
            for _ in range(steps):
                before = gpu.counts.copy()
                x, y = next(batches)
                loaded = gpu.counts.copy()
                inf.accumulated_step(model, opt, [(x, y)], ctx=D.Context(device="cuda"),
                                     label_smoothing=r.sgd.label_smoothing, dtype=torch.bfloat16)
            batches.close()
        name = f"{fmt}, " + (f"decoder {where['decoder']}" if fmt == "jpeg" else f"on the {where['where']}")
        rows.append({"store": name, "batch": bs, "data ops": loaded["gpu_ops"] - before["gpu_ops"],
                     "data blocking": loaded["blocking"] - before["blocking"],
                     "step ops": gpu.counts["gpu_ops"] - before["gpu_ops"],
                     "step blocking": gpu.counts["blocking"] - before["blocking"]})
        table.append(rows[-1])
    return rows


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--recipe", default="rn50_16ep", help="the model as this recipe trains it (default rn50_16ep)")
    p.add_argument("--sizes", default="160,192", help="training resolutions, comma-separated (default rn50_16ep's)")
    p.add_argument("--store", default=None, help="a prepared store to read (default: write one)")
    p.add_argument("--src", default=None, help="an ImageFolder tree for the PIL comparison (and the store, if none)")
    p.add_argument("--images", type=int, default=20000, help="synthetic photos to write when no --src (default 20000)")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU (default 256)")
    p.add_argument("--steps", type=int, default=30, help="timed batches per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed batches before each measurement")
    p.add_argument("--workers", type=int, default=None, help="decoding processes and PIL workers (default: CPU count)")
    p.add_argument("--count-batch", type=int, default=4, help="the smaller batch of the counts (default 4)")
    p.add_argument("--count-recipe", default=None, help="the model of the counts as this recipe trains it (default: "
                                                         "--recipe's)")
    p.add_argument("--decoder", default="auto", type=one_of(idec.DECODERS),
                   help="auto: nvJPEG on a CUDA GPU, else the CPU's decoding processes")
    p.add_argument("--no-pil", action="store_true", help="skip the PIL comparison")
    p.add_argument("--dir", default=None, help="where to write photos and store (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the table as JSON")
    args = p.parse_args(argv)
    for flag in ("images", "batch_size", "steps", "workers", "count_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: must be positive")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must not be negative")
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes}: must be whole numbers, comma-separated")
    return args


def pil_rate(folder, res, *, workers, dtype, memory_format, timing):
    """Images/s a core of torchvision's ImageFolder with PIL and a DataLoader of `workers` processes, each batch
    finished as ours is (on the device, normalised, in dtype and memory_format)."""
    device = timing["device"]
    folder.transform.transforms[0].size = (res, res)
    loader = torch.utils.data.DataLoader(folder, timing["batch_size"], shuffle=True, drop_last=True,
                                         num_workers=workers, pin_memory=devices.overlaps(device))
    constants = devices.to_device(idt.CONSTANTS, device)

    def batches():
        for xb, yb in loader:
            x = xb.to(device, non_blocking=True).float()
            yield idt.normalised_batch(x, None, constants, dtype=dtype, memory_format=memory_format), yb.to(device,
                                                                                                 non_blocking=True)
    return rate(forever(batches), lambda x, y: None, **timing) / workers


def main(argv=None):
    args = parse_args(argv)
    device = devices.resolve(args.device)
    dtype, fmt = devices.compute_dtype(device, args.precision), devices.memory_format(device)
    try:
        r = inf.recipe(args.recipe)
        counted_recipe = inf.recipe(args.count_recipe) if args.count_recipe else r     # checked before any work
        decoder = idec.jpeg_decoder(device, args.decoder)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workers = args.workers or os.cpu_count() or 1
    devices.autotune(device)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if not args.src:
            print(f"writing {args.images} synthetic photos (longer side 500 px) in {tmp}", file=sys.stderr)
        src = Path(args.src) if args.src else photos(Path(tmp) / "src", args.images)
        store_path = Path(args.store) if args.store else Path(tmp) / "store"
        if not args.store:
            ims.prepare(src, store_path, workers=workers, log=lambda s: print(s, file=sys.stderr))
        store = ims.open_store(store_path)
        data = idt.rank_data(store, device, decoder=decoder, workers=workers)
        classes, n, bs = len(store.index["classes"]), len(data.train_rows), min(args.batch_size, len(data.train_rows))
        gen = torch.Generator().manual_seed(0)
        folder = torchvision.datasets.ImageFolder(str(src / "train"), transforms.Compose([
            transforms.RandomResizedCrop(args.sizes[0]), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]))
        cores = "GPU" if decoder == "gpu" else f"{workers} CPU processes"
        print(f"{r.network.model}{' + BlurPool' if r.network.blurpool else ''} ({args.recipe}) on "
              f"{devices.name(device)} ({device}, {str(dtype)[6:]}), batch {bs}; {store.format} store of {n} images "
              f"decoded on the {cores}; "
              f"{args.steps} timed batches after {args.warmup}; images/s")
        table = Table(["res", "loader", "ceiling", "together", "together/ceil", "loader/core", "pil/core", "decode"],
                      width=14,
                      formats={k: ".1f" for k in ("loader", "ceiling", "together", "loader/core", "pil/core")}
                      | {"together/ceil": ".3f"})
        timing = dict(device=device, warmup=args.warmup, steps=args.steps, batch_size=bs)
        for res in args.sizes:
            def epoch():
                return idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=res,
                                         batch_size=bs, device=device, dtype=dtype)
            model = inf.imagenet_network(r, classes).to(device, memory_format=fmt)
            opt = inf.imagenet_optimizer(model, r)

            def train(x, y):
                step(model, opt, x, y, device=device, dtype=dtype)
            before = Counter(data.decoded)
            loader = rate(forever(epoch), lambda x, y: None, **timing)
            x = torch.randn(bs, 3, res, res, device=device).to(dtype).contiguous(memory_format=fmt)
            y = torch.randint(0, classes, (bs,), device=device)
            ceiling = rate(forever(lambda: [(x, y)]), train, **timing)
            together = rate(forever(epoch), train, **timing)
            decoded = data.decoded - before         # the images of the loader's and together's batches, by path
            pil = None if args.no_pil else pil_rate(folder, res, workers=workers, dtype=dtype, memory_format=fmt,
                                                    timing=timing)
            table.append({"res": res, "loader": loader, "ceiling": ceiling, "together": together,
                          "together/ceil": together / ceiling,
                          "loader/core": None if decoder == "gpu" else loader / workers, "pil/core": pil,
                          "decode": idec.decoded_by_text(decoded), "decoded": dict(decoded)})
        print("the loader is the bottleneck where loader < ceiling; together/ceil is the share of the model's speed "
              "that training keeps")
        counts = counted(counted_recipe, Path(tmp), batch_size=args.count_batch, classes=classes)
    if args.out:
        import machine
        argv = sys.argv[1:] if argv is None else list(argv)
        write_json(args.out, {"piece": "imagenet_throughput", "command": " ".join(
            ["python benchmarks/imagenet_throughput.py", *[a for a in argv if a != args.out and a != "--out"]]),
                              "fingerprint": machine.fingerprint(device, True), "argv": argv, "recipe": args.recipe,
                              "model": r.network.model, "blurpool": r.network.blurpool, "device": str(device),
                              "dtype": str(dtype), "batch_size": bs, "steps": args.steps, "workers": workers,
                              "decoder": decoder, "images": n, "environment": environment(device), "rows": table.rows,
                              "counts": counts, "count_model": counted_recipe.network.model,
                              "count_blurpool": counted_recipe.network.blurpool})
    return 0


if __name__ == "__main__":
    sys.exit(main())
