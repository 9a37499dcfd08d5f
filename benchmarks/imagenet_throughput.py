"""Training throughput (images/s) of a ResNet through three input pipelines, in one run:

  ceiling      the model alone on one random batch already on the device
  store        our prepared store + loader + batched on-device augmentation (imagenet_store.py, imagenet_fast.py)
  imagefolder  torchvision ImageFolder + DataLoader (RandomResizedCrop, flip in worker processes)

on synthetic JPEGs it writes itself, at each resolution in --sizes.

    python benchmarks/imagenet_throughput.py                                   # GPU: ResNet-50, 128..224 px
    python benchmarks/imagenet_throughput.py --device cpu --images 64 --sizes 64 --steps 2 --model resnet18
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import imagenet_fast as inf  # noqa: E402
import imagenet_store as ims  # noqa: E402
import devices  # noqa: E402
from cli import environment  # noqa: E402
from core import Table, write_json  # noqa: E402


def step(model, opt, x, y, device, dtype):
    with devices.autocast(device, dtype):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(batches, model, opt, device, dtype, warmup, steps, bs):
    """Images/s over `steps` training steps after `warmup` untimed ones; batches yields (x, y)."""
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            devices.synchronize(device)
            start = time.perf_counter()
        step(model, opt, x, y, device, dtype)
        if i == warmup + steps - 1:
            break
    devices.synchronize(device)
    return steps * bs / (time.perf_counter() - start)


def forever(make_epoch):
    while True:
        yield from make_epoch()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--sizes", default="128,160,192,224", help="training resolutions, comma-separated")
    p.add_argument("--images", type=int, default=2560, help="synthetic training JPEGs to write")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each measurement")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers and prepare workers")
    p.add_argument("--data-on", default="auto", choices=["auto", "device", "host"])
    p.add_argument("--dir", default=None, help="where to write the JPEGs and store (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the table as JSON")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    device = devices.resolve(args.device)
    dtype = devices.compute_dtype(device, args.precision)
    fmt = devices.memory_format(device)
    devices.autotune(device)
    bs = min(args.batch_size, args.images)
    hp = inf.hyperparameters("rn50_16ep", model=args.model, blurpool=False)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        classes = 10
        per = max(1, args.images // classes)
        big = max(sizes)
        print(f"writing {per * classes} synthetic JPEGs of {big}..{int(big * 1.5)} px in {tmp}", file=sys.stderr)
        src = ims.synthetic_imagefolder(Path(tmp) / "src", classes, per, 1, (big, int(big * 1.5)))
        ims.prepare(src, Path(tmp) / "store", big, args.workers, log=lambda s: print(s, file=sys.stderr))
        data = inf.place(ims.open_store(Path(tmp) / "store"), device, args.data_on)
        n = len(data["train_y"])
        gen = torch.Generator().manual_seed(0)

        folder = torchvision.datasets.ImageFolder(str(src / "train"), transforms.Compose([
            transforms.RandomResizedCrop(big), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]))
        mean = torch.tensor(inf.MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(inf.STD, device=device).view(1, 3, 1, 1)

        table = Table(["res", "ceiling", "store", "store/ceil", "folder", "folder/ceil"], width=12,
                      formats={"ceiling": ".1f", "store": ".1f", "folder": ".1f", "store/ceil": ".3f",
                               "folder/ceil": ".3f"})
        print(f"{args.model} on {device} ({str(dtype)[6:]}), batch {bs}, {args.steps} timed steps after "
              f"{args.warmup}; store in {data['where']} memory; images/s")
        for res in sizes:
            model = inf.build_model(hp, classes).to(device, memory_format=fmt)
            opt = inf.make_optimizer(model, hp)
            x = torch.randn(bs, 3, res, res, device=device).to(dtype).contiguous(memory_format=fmt)
            y = torch.randint(0, classes, (bs,), device=device)
            ceiling = measure(forever(lambda: [(x, y)]), model, opt, device, dtype, args.warmup, args.steps, bs)

            def store_epoch():
                perm = torch.randperm(n, generator=gen)
                crops = inf.draw_crops(n, hp["crop_scale"], hp["crop_ratio"], gen)
                return inf.augmented_batches(data, hp, perm, crops, res, bs, gen, device, dtype, fmt)
            store = measure(forever(store_epoch), model, opt, device, dtype, args.warmup, args.steps, bs)

            folder.transform.transforms[0].size = (res, res)
            loader = torch.utils.data.DataLoader(folder, bs, shuffle=True, drop_last=True, num_workers=args.workers,
                                                 pin_memory=devices.overlaps(device), persistent_workers=False)

            def folder_epoch():
                for xb, yb in loader:
                    xb = xb.to(device, non_blocking=True).float()
                    yield ((xb - mean) / std).to(dtype).contiguous(memory_format=fmt), yb.to(device, non_blocking=True)
            imagefolder = measure(forever(folder_epoch), model, opt, device, dtype, args.warmup, args.steps, bs)
            table.append({"res": res, "ceiling": ceiling, "store": store, "store/ceil": store / ceiling,
                          "folder": imagefolder, "folder/ceil": imagefolder / ceiling})
    if args.out:
        write_json(args.out, {"argv": sys.argv[1:] if argv is None else list(argv), "model": args.model,
                              "device": str(device), "dtype": str(dtype), "batch_size": bs, "steps": args.steps,
                              "environment": environment(device), "rows": table.rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
