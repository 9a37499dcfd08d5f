"""Train a ResNet on CIFAR-10 to 94% and report the time it took.

    python cifar10_fast.py                          # myrtle24: Myrtle's DAWNBench ResNet-9
    python cifar10_fast.py --recipe myrtle10 --runs 10 --out results.json
    python cifar10_fast.py --list-recipes
    python cifar10_fast.py --device cpu --subset 5000 --epochs 2 --width 0.25   # a CPU demonstration

Each recipe is one plain dict of named hyperparameters; any of them can be overridden by a flag
of the same name (`--batch-size 768`, `--lr-knots 0,0.2,1`).
"""
import argparse
import datetime
import platform
import sys

import torch

import torch_backend as tb
from core import Table, summarize, write_json

# Every hyperparameter, with the value it has unless a recipe or flag says otherwise.
# lr and weight_decay are for the batch-mean loss (see torch_backend.make_optimizer);
# lr_knots are fractions of the whole run, so --epochs stretches the schedule with it.
BASE = dict(
    model="resnet9", width=1.0, epochs=24, batch_size=512,
    lr_knots=(0, 5 / 24, 1), lr_values=(0.0, 0.4, 0.0),
    momentum=0.9, nesterov=True, weight_decay=5e-4, bias_lr_mult=1.0, label_smoothing=0.0,
    crop_pad=4, flip=True, cutout=8,
    act="relu", celu_alpha=0.3, pool_first=False, ghost_batch=0, freeze_bn_scale=False,
    whiten=False, whiten_eps=1e-2, output_scale=0.125,
    ema_momentum=0.0, ema_every=5, tta="none",
)

RECIPES = {
    # "How to train your ResNet" part 4 / DAWNBench 2018: ~94% in 79 s on a V100 (published).
    "myrtle24": dict(doc="Myrtle's DAWNBench ResNet-9: 24 epochs, batch 512, cutout 8x8 (published: 94% in 79 s on a V100)"),
    # Part 8, "bag of tricks", final run: ~94.1% in 26 s on a V100 (published).
    "myrtle10": dict(
        doc="Myrtle's bag-of-tricks ResNet-9: 10 epochs, CELU, ghost BN, frozen BN scales, whitening, EMA, flip TTA "
            "(published: 94.1% in 26 s on a V100)",
        epochs=10, lr_knots=(0, 0.2, 0.8), lr_values=(0.0, 1.0, 0.1), label_smoothing=0.2, cutout=0,
        act="celu", pool_first=True, ghost_batch=32, freeze_bn_scale=True, bias_lr_mult=64.0,
        whiten=True, output_scale=1 / 16, ema_momentum=0.99, ema_every=5, tta="flip",
    ),
}


def recipe(name, **overrides):
    """The full hyperparameter dict of a recipe, with overrides applied."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    hp = {**BASE, **{k: v for k, v in RECIPES[name].items() if k != "doc"}, **overrides}
    unknown = set(hp) - set(BASE)
    if unknown:
        raise KeyError(f"unknown hyperparameters {sorted(unknown)}")
    return hp


def _parse(kind):
    """A converter for a flag whose default has the type of `kind`."""
    if isinstance(kind, bool):
        return lambda s: {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[s.lower()]
    if isinstance(kind, tuple):
        return lambda s: tuple(float(eval_number(v)) for v in s.split(","))
    if isinstance(kind, float):
        return lambda s: float(eval_number(s))
    return type(kind)


def eval_number(s):
    """Accepts plain numbers and simple fractions such as 1/16."""
    if "/" in s:
        a, b = s.split("/")
        return float(a) / float(b)
    return float(s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="myrtle24", help="recipe name (default myrtle24; see --list-recipes)")
    p.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    p.add_argument("--runs", type=int, default=1, help="train this many fresh networks (seeds seed..seed+runs-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default="data",
                   help="data folder (downloads and caches CIFAR-10 there), a cifar-10-batches-py/ folder, or a .npz")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda if available)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast dtype (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--subset", type=int, default=None, help="train on the first N training images")
    p.add_argument("--target", type=float, default=0.94, help="test accuracy whose first epoch stops the clock")
    p.add_argument("--out", default=None, help="write config, environment, per-epoch rows and summary as JSON")
    hp = p.add_argument_group("hyperparameters (override the recipe)")
    for key, value in BASE.items():
        hp.add_argument("--" + key.replace("_", "-"), dest=key, type=_parse(value), default=None,
                        help=f"(base {value!r})")
    args = p.parse_args(argv)
    overrides = {k: getattr(args, k) for k in BASE if getattr(args, k) is not None}
    return args, overrides


def environment(device):
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


def fmt_stats(name, s, scale=1.0, unit=""):
    if not s["n"]:
        return f"{name}: none"
    return (f"{name}: mean {s['mean'] * scale:.4f}{unit}  std {s['std'] * scale:.4f}{unit}  "
            f"min {s['min'] * scale:.4f}{unit}  max {s['max'] * scale:.4f}{unit}  (n={s['n']})")


def main(argv=None):
    args, overrides = parse_args(argv)
    if args.list_recipes:
        for name, r in RECIPES.items():
            print(f"{name:12s} {r['doc']}")
        return 0
    try:
        hp = recipe(args.recipe, **overrides)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("error: --runs must be at least 1", file=sys.stderr)
        return 2

    device = tb.resolve_device(args.device)
    if device.type == "cpu":
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration, "
              "shrink the work with --subset, --epochs and --width", file=sys.stderr)
    dtype = tb.compute_dtype(device, args.precision)

    try:
        arrays = tb.load_cifar10(args.data_dir)
    except tb.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.subset:
        arrays = {**arrays, "train_images": arrays["train_images"][:args.subset],
                  "train_labels": arrays["train_labels"][:args.subset]}
    data = tb.to_device(arrays, device, dtype, hp["crop_pad"])
    print(f"recipe {args.recipe} on {environment(device)['device_name']} ({device}, {str(dtype)[6:]}), "
          f"{len(arrays['train_labels'])} training and {len(arrays['test_labels'])} test images", flush=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        tb.warmup(hp, data, device, dtype, torch.channels_last)

    columns = ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time", "total_time"]
    runs = []
    for r in range(args.runs):
        seed = args.seed + r
        if args.runs > 1:
            print(f"run {r + 1}/{args.runs} (seed {seed})", flush=True)
        table = Table(columns, width=11, formats={"lr": ".4f", "epoch_time": ".2f", "total_time": ".2f"})
        result = tb.train(hp, data, device, seed, dtype, args.target, on_epoch=table.append)
        result.pop("model")
        runs.append(result)
        ttt = result["time_to_target"]
        print(f"final test accuracy {result['final_acc']:.4f}; "
              + (f"time to {args.target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {args.target:.2%}")
              + f"; training time {result['train_time']:.2f} s", flush=True)

    summary = {"final_acc": summarize([r["final_acc"] for r in runs]),
               "train_time": summarize([r["train_time"] for r in runs]),
               "time_to_target": summarize([r["time_to_target"] for r in runs]),
               "fraction_reaching_target": sum(r["time_to_target"] is not None for r in runs) / len(runs)}
    if args.runs > 1:
        print(f"\nsummary over {args.runs} runs of {args.recipe}")
        print(fmt_stats("final test accuracy", summary["final_acc"]))
        print(fmt_stats(f"time to {args.target:.2%}", summary["time_to_target"], unit=" s"))
        print(fmt_stats("training time", summary["train_time"], unit=" s"))
        print(f"runs reaching {args.target:.2%}: {summary['fraction_reaching_target']:.0%}")
    if args.out:
        write_json(args.out, {
            "recipe": args.recipe, "hyperparameters": hp, "target": args.target, "subset": args.subset,
            "argv": sys.argv[1:] if argv is None else list(argv), "environment": environment(device),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": runs, "summary": summary})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
