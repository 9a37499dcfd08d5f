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

# The "How to train your ResNet" journey (Myrtle.ai, 2018-19), in order: each stage is the stage
# before it plus `changes`. Numbers are Myrtle's, read from their experiments.ipynb (parts 1-4) and
# bag_of_tricks.ipynb (part 8); published_v100_s is the training time they published for the step.
# Two steps were loader/kernel fixes that our always-on-device loader has built in, so they change
# nothing here ("same" below); the stage exists so that the table lines up with the published one.
JOURNEY = [
    dict(name="baseline_resnet18", published_v100_s=297,
         doc="pre-activation ResNet-18, 35 epochs, batch 128, crop+flip, lr 0.1 peak at epoch 15",
         changes=dict(model="resnet18", epochs=35, batch_size=128, lr_knots=(0, 15 / 35, 30 / 35, 1),
                      lr_values=(0.0, 0.1, 0.005, 0.0), cutout=0, output_scale=1.0)),
    dict(name="batch512", published_v100_s=256,
         doc="batch 512, lr peak 0.44",
         changes=dict(batch_size=512, lr_values=(0.0, 0.44, 0.005, 0.0))),
    dict(name="faster_bn", published_v100_s=186,
         doc="same as batch512: Myrtle's step kept batch norm out of a slow fp16 path; our batch norm always runs in float32",
         changes=dict()),
    dict(name="cutout30", published_v100_s=161,
         doc="cutout 8x8, 30 epochs, lr peak 0.4 at epoch 8",
         changes=dict(cutout=8, epochs=30, lr_knots=(0, 8 / 30, 1), lr_values=(0.0, 0.4, 0.0))),
    dict(name="cutout30_bs768", published_v100_s=154,
         doc="batch 768, lr peak 0.6",
         changes=dict(batch_size=768, lr_values=(0.0, 0.6, 0.0))),
    dict(name="resnet9_24", published_v100_s=79,
         doc="Myrtle's ResNet-9, 24 epochs, batch 512, lr peak 0.4 at epoch 5, logits x 1/8 (= myrtle24)",
         changes=dict(model="resnet9", epochs=24, batch_size=512, lr_knots=(0, 5 / 24, 1),
                      lr_values=(0.0, 0.4, 0.0), output_scale=0.125)),
    dict(name="gpu_aug", published_v100_s=70,
         doc="same as resnet9_24: Myrtle's step moved preprocessing and augmentation to the GPU; ours always runs there",
         changes=dict()),
    dict(name="maxpool_pre", published_v100_s=64,
         doc="max-pool before batch norm (4x fewer pixels to normalise), 25 epochs to win back the accuracy",
         changes=dict(pool_first=True, epochs=25, lr_knots=(0, 0.2, 1))),
    dict(name="label_smoothing", published_v100_s=59,
         doc="label smoothing 0.2, 23 epochs",
         changes=dict(label_smoothing=0.2, epochs=23)),
    dict(name="celu", published_v100_s=52,
         doc="CELU(0.075) instead of ReLU, 20 epochs",
         changes=dict(act="celu", celu_alpha=0.075, epochs=20)),
    dict(name="ghost_bn", published_v100_s=46,
         doc="ghost batch norm (groups of 32), 18 epochs, lr peak 0.6",
         changes=dict(ghost_batch=32, epochs=18, lr_values=(0.0, 0.6, 0.0))),
    dict(name="frozen_bn_scale", published_v100_s=43,
         doc="batch-norm scales frozen at 1, CELU(0.3), bias lr x64, logits x 1/16, 17 epochs",
         changes=dict(freeze_bn_scale=True, celu_alpha=0.3, bias_lr_mult=64.0, output_scale=1 / 16, epochs=17)),
    dict(name="whitening", published_v100_s=36,
         doc="frozen 3x3 patch-whitening input layer, 14 epochs, lr peak 1.0, cutout 5x5",
         changes=dict(whiten=True, epochs=14, lr_values=(0.0, 1.0, 0.0), cutout=5)),
    dict(name="ema", published_v100_s=33.5,
         doc="EMA of the weights (0.99 every 5 steps), lr floored at 0.1 for the last 2 epochs, 13 epochs",
         changes=dict(ema_momentum=0.99, ema_every=5, epochs=13, lr_knots=(0, 0.2, 11 / 13), lr_values=(0.0, 1.0, 0.1))),
    dict(name="tta10", published_v100_s=26,
         doc="flip test-time augmentation, no cutout, 10 epochs (= myrtle10)",
         changes=dict(tta="flip", cutout=0, epochs=10, lr_knots=(0, 0.2, 0.8))),
]


def journey_recipes(steps):
    """RECIPES entries for the journey: each stage's overrides are its predecessors' changes plus its own."""
    recipes, hp = {}, {}
    for i, step in enumerate(steps, 1):
        hp = {**hp, **step["changes"]}
        recipes[step["name"]] = dict(hp, doc=f"journey {i}/{len(steps)}: {step['doc']} "
                                               f"(published: {step['published_v100_s']} s on a V100)")
    return recipes


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
    # ---- the "How to train your ResNet" journey, one recipe per published step (see JOURNEY) ----
    **journey_recipes(JOURNEY),
    # ---- end of the journey ----
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


def take_subset(arrays, n_train=None, n_test=None):
    """The first n_train training and n_test test images (None keeps them all)."""
    return {**arrays, "train_images": arrays["train_images"][:n_train], "train_labels": arrays["train_labels"][:n_train],
            "test_images": arrays["test_images"][:n_test], "test_labels": arrays["test_labels"][:n_test]}


def run_recipe(hp, data, device, dtype, runs=1, seed=0, target=0.94, verbose=True):
    """Trains `runs` fresh networks (seeds seed .. seed+runs-1) on device-resident data; returns the
    per-run results (without models) and their summary. verbose prints each epoch's row and each run's result."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        tb.warmup(hp, data, device, dtype, torch.channels_last)
    columns = ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time", "total_time"]
    results = []
    for r in range(runs):
        if verbose and runs > 1:
            print(f"run {r + 1}/{runs} (seed {seed + r})", flush=True)
        table = Table(columns, width=11, formats={"lr": ".4f", "epoch_time": ".2f", "total_time": ".2f"}) if verbose else None
        result = tb.train(hp, data, device, seed + r, dtype, target, on_epoch=table and table.append)
        result.pop("model")
        results.append(result)
        ttt = result["time_to_target"]
        if verbose:
            print(f"final test accuracy {result['final_acc']:.4f}; "
                  + (f"time to {target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {target:.2%}")
                  + f"; training time {result['train_time']:.2f} s", flush=True)
    summary = {"final_acc": summarize([r["final_acc"] for r in results]),
               "train_time": summarize([r["train_time"] for r in results]),
               "time_to_target": summarize([r["time_to_target"] for r in results]),
               "fraction_reaching_target": sum(r["time_to_target"] is not None for r in results) / len(results)}
    return results, summary


def main(argv=None):
    args, overrides = parse_args(argv)
    if args.list_recipes:
        width = max(map(len, RECIPES))
        for name, r in RECIPES.items():
            print(f"{name:{width}s} {r['doc']}")
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
    arrays = take_subset(arrays, args.subset)
    data = tb.to_device(arrays, device, dtype, hp["crop_pad"])
    print(f"recipe {args.recipe} on {environment(device)['device_name']} ({device}, {str(dtype)[6:]}), "
          f"{len(arrays['train_labels'])} training and {len(arrays['test_labels'])} test images", flush=True)

    runs, summary = run_recipe(hp, data, device, dtype, args.runs, args.seed, args.target)
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
