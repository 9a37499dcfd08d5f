"""The CIFAR-10 speed-run loop at ImageNet scale, on one GPU or, under torchrun, on many.

    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in500            # JPEG, longer side <= 500
    python imagenet_fast.py train --store /data/in500 --recipe rn50_16ep --out rn50.json
    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in128 --format raw --size 128
    python imagenet_fast.py train --list-recipes
    python imagenet_fast.py train --store S --device cpu --recipe tiny --epochs 2       # CPU demo

`prepare` writes an ImageFolder tree (train/<class>/*, val/<class>/*) once, in worker processes, into a store that
`train` memory-maps (imagenet_store.py; docs/imagenet.md gives the format). `train` draws random-resized crops of
the whole image, decodes them on the GPU or the CPU's threads, and augments them on the device (imagenet_data.py).
Every hyperparameter is in BASE; a recipe is a dict of changes; any of them is also a flag. This file holds the
models, the ImageNet parts of the training loop (loop.py), the recipes and the command line.
"""
import argparse
import io
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import devices
import distributed as D
import loop
import scaling
from cli import (add_shared_flags, check_run, check_values, flag_error, interrupted, one_of, overrides_from,
                 recipe_values, run_in_ranks, run_record)
from core import (DataError, Frozen, Heartbeat, Parser, Table, UsageError, check_output, print_summary,
                  summarize_runs, write_json)
from imagenet_data import draw_epoch, evaluate, place, train_batches
from imagenet_store import FORMATS, Settings, kept, open_store, prepare
from loop import Run
from optim import optimizer, param_groups_no_decay_1d
from schedules import batch_for, lr_at, per_rank_batch, res_at

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

class BlurPool(nn.Module):
    """A fixed 3×3 binomial low-pass filter, put before every strided convolution so that it
    subsamples a smoothed signal (anti-aliasing, Zhang 2019; FFCV's ResNets use it)."""

    def __init__(self, channels):
        super().__init__()
        k = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("kernel", (k[:, None] * k[None, :] / 16).expand(channels, 1, 3, 3).clone())

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), self.kernel.to(x.dtype), groups=x.shape[1])


def add_blurpool(model, min_channels=16):
    """Replaces each strided conv with ≥ min_channels inputs by BlurPool then that conv."""
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
                setattr(m, child_name, nn.Sequential(BlurPool(child.in_channels), child))
    return model


def resnet_tiny(num_classes, width):
    """A 4-stage ResNet of torchvision BasicBlocks, one per stage, `width` channels in the first
    stage (torchvision's ResNets have fixed widths): for tests and CPU demonstrations."""
    from torchvision.models.resnet import BasicBlock
    layers, c_in = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)], width
    for i in range(4):
        c, stride = width * 2 ** i, 1 if i == 0 else 2
        down = None if stride == 1 else nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))
        layers.append(BasicBlock(c_in, c, stride, down))
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))


MODELS = ("resnet_tiny", "resnet18", "resnet34", "resnet50", "resnet101")


def build_model(hp, num_classes):
    if hp["model"] not in MODELS:
        raise ValueError(f"unknown model {hp['model']!r}; choose from {', '.join(MODELS)}")
    if hp["model"] == "resnet_tiny":
        model = resnet_tiny(num_classes, hp["width"])
    else:
        model = getattr(torchvision.models, hp["model"])(num_classes=num_classes, zero_init_residual=hp["zero_init"])
    return add_blurpool(model) if hp["blurpool"] else model


def make_optimizer(model, hp):
    """SGD (or the large-batch LARS / RMSprop-to-SGD of optim.py); weight decay only on conv and
    linear weights (none on batch-norm scales and biases)."""
    return optimizer(param_groups_no_decay_1d(model, hp["weight_decay"]), hp)


def saved_bytes_per_image(hp, classes, res, dtype):
    """Bytes of activations a training step saves for backward, per image at res x res in dtype: autograd's saved
    tensors (parameters left out, each storage once) counted on the meta device, which holds no memory."""
    with torch.device("meta"):
        model = build_model(hp, classes).to(dtype)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            storages[s._cdata] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(torch.empty(2, 3, res, res, device="meta", dtype=dtype)).float(),
                        torch.zeros(2, dtype=torch.long, device="meta"))
    return sum(storages.values()) / 2


STATE_COPIES = {"sgd": 1, "lars": 1, "rmsprop_sgd": 2}      # float32 copies of the parameters an optimiser keeps


def training_bytes(hp, classes, *, world, dtype):
    """The most device memory a rank's training needs in any epoch: float32 parameters, gradients, the optimiser's
    state and an EMA's copy, and that epoch's batch of saved activations (saved_bytes_per_image) at its resolution."""
    with torch.device("meta"):
        params = sum(p.numel() * 4 for p in build_model(hp, classes).parameters())
    copies = 2 + STATE_COPIES[hp["optimizer"]] + (hp["ema_momentum"] > 0)
    per_image = {res: saved_bytes_per_image(hp, classes, res, dtype) for res in {res_at(hp, e) for e in range(hp["epochs"])}}
    return copies * params + max(batch_for(hp, e, world) * per_image[res_at(hp, e)] for e in range(hp["epochs"]))


# ---------------------------------------------------------------------------------------------
# One run: the ImageNet parts of the loop (loop.train)
# ---------------------------------------------------------------------------------------------

def warmup(hp, data, *, classes, device, dtype, world=1):
    """Two steps at every (resolution, batch) pair of the schedule on a throwaway model, so that
    cuDNN's autotuning for each new shape happens before the clock starts."""
    memory_format = devices.memory_format(device)
    model = build_model(hp, classes).to(device, memory_format=memory_format)
    opt = make_optimizer(model, hp)
    gen = torch.Generator().manual_seed(0)
    n = len(data.train_rows)
    for res, bs in sorted({(res_at(hp, e), batch_for(hp, e, world)) for e in range(hp["epochs"])}):
        bs = min(bs, n)
        draws = draw_epoch(data, hp, gen)
        draws.perm = np.arange(2 * bs) % n
        for x, y in train_batches(data, hp, draws, res=res, batch_size=bs, generator=gen, device=device, dtype=dtype,
                                  memory_format=memory_format):
            with devices.autocast(device, dtype):
                F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    devices.synchronize(device)


def start(hp, data, *, classes, device, dtype, ctx, bucket_mb=25.0, hook="none"):
    """The builder of a run that loop.train calls once torch's seed is set: start(seed) builds the network, its
    optimiser and the generator of the data pipeline's draws (on the CPU), and returns the loop.Run that trains it on
    `data` (place(); under torchrun this rank's share), each epoch at its resolution and this rank's batch, the
    learning rate per lr_scale_base images of the global batch (Goyal et al.'s linear scaling)."""
    world, memory_format, n = ctx.world_size, devices.memory_format(device), len(data.train_rows)
    batches = [min(batch_for(hp, e, world), n) for e in range(hp["epochs"])]
    steps = [n // bs for bs in batches]

    def build(seeds):
        order, augment = (torch.Generator().manual_seed(seeds[k]) for k in ("order", "augment"))
        model = build_model(hp, classes).to(device, memory_format=memory_format)
        opt = make_optimizer(model, hp)
        forward = D.register_comm_hook(D.wrap_ddp(model, ctx, bucket_mb), hook) if ctx.distributed else model

        def epoch_batches(epoch):
            return train_batches(data, hp, draw_epoch(data, hp, augment, order=order), res=res_at(hp, epoch),
                                 batch_size=batches[epoch], generator=augment, device=device, dtype=dtype,
                                 memory_format=memory_format)

        def schedule(epoch, i, step):
            clock = epoch + i / steps[epoch]
            return lr_at(hp, clock) * batches[epoch] * world / hp["lr_scale_base"], clock

        def validate(model, final):
            loss, top1, top5 = evaluate(model, data, hp, tta=hp["tta"] if final else "none", device=device,
                                        dtype=dtype, memory_format=memory_format, ctx=ctx)
            return {"val_loss": loss, "top1": top1, "top5": top5}

        def example(epoch):
            res = res_at(hp, epoch)
            return torch.zeros(2, 3, res, res, device=device, dtype=dtype).contiguous(memory_format=memory_format)
        return Run(model=model, forward=forward, optimizers=[opt], generators={"order": order, "augment": augment},
                   steps=steps, total_steps=sum(steps),
                   batches=epoch_batches, schedule=schedule, evaluate=validate, metrics=("val_loss", "top1", "top5"),
                   accuracy="top1", wrapped=ctx.distributed, mean_loss=True,
                   columns=lambda epoch: {"res": res_at(hp, epoch), "batch": batches[epoch]}, example=example)
    return build


# ---------------------------------------------------------------------------------------------
# Recipes and the command line
# ---------------------------------------------------------------------------------------------

PROGRESS_AFTER_S = 5.0    # an epoch that looks longer shows its steps on stderr

# Every hyperparameter once. lr is per lr_scale_base images: the step uses lr × batch / lr_scale_base (Goyal et al.'s
# linear scaling rule, in their unit of 256 images).
# Resolutions are in pixels of the network input; res_*_epoch are 0-based epochs.
BASE = dict(
    model="resnet50", width=16, blurpool=True, zero_init=False,
    epochs=16, batch_size=512, lr=0.10625, lr_scale_base=256, warmup_epochs=2.0, warmup_start=0.0, schedule="linear",
    step_epochs=(30.0, 60.0, 80.0),
    momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.1,
    min_res=160, max_res=192, res_start_epoch=11, res_end_epoch=13, res_step=32, batch_scale=False,
    crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), flip=True, jitter=0.0,
    val_res=256, val_crop=0.875, tta="flip", ema_momentum=0.0, ema_every=1, lookahead_momentum=0.0, lookahead_every=5,
    # large-batch options (optim.py, distributed.py, as in cifar10_fast.py)
    batch_schedule=(), optimizer="sgd", lars_trust=0.001, rms_lr=1e-3, rms_beta_center=10.0, rms_beta_period=5.0,
    bn_stats="running", comm_hook="none",
)

# The values a hyperparameter that takes one of a few may take: the flags' choices (which --help lists) and what
# validate() accepts.
CHOICES = dict(model=MODELS, schedule=("linear", "cosine", "step", "slow_start"), tta=("none", "flip"),
               optimizer=("sgd", "lars", "rmsprop_sgd"), bn_stats=("running", "last_batch"), comm_hook=D.HOOKS)
POSITIVE = ("epochs", "batch_size", "width", "min_res", "max_res", "res_step", "val_res", "ema_every", "lr_scale_base",
            "lookahead_every")
NOT_NEGATIVE = ("lr", "warmup_epochs", "weight_decay", "jitter", "lars_trust", "rms_lr", "res_start_epoch",
                "res_end_epoch")
FRACTIONS = ("momentum", "label_smoothing", "ema_momentum", "lookahead_momentum", "warmup_start", "val_crop")

# What the three cluster recipes share: torchvision's ResNet-50 (no BlurPool) for 90 epochs, at 224 px throughout,
# momentum SGD 0.9 with weight decay 1e-4 off batch norm and biases, no label smoothing unless said, validated at
# 224 px without test-time augmentation; lr per 256 images (Goyal's linear scaling).
CLUSTER = dict(model="resnet50", blurpool=False, epochs=90, min_res=224, max_res=224, res_start_epoch=0,
               res_end_epoch=0, res_step=32, momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.0,
               val_res=224, val_crop=0.875, tta="none")

# Epochs, resolution ramps, lr, weight decay, label smoothing and blurpool follow FFCV's published
# configs (libffcv/ffcv-imagenet rn50_configs/, rn18_configs/): rn50 lr 1.7 for 8 GPUs x 512
# images = 0.10625 per 256; rn18 lr 0.5 for 1 GPU x 1024 = 0.125 per 256; lr peaks at epoch 2 and
# falls linearly to 0 ("cyclic"); res 160 -> 192; validation at 256 with flip TTA.
RECIPES = {
    "rn50_16ep": dict(doc="ResNet-50, 16 epochs, res 160->192 (published by FFCV: 73.8% top-1 in 14.9 min on 8 A100s)"),
    "rn50_24ep": dict(doc="ResNet-50, 24 epochs, res 160->192 (published by FFCV: 75.6% top-1 in 21.7 min on 8 A100s)",
                      epochs=24, res_start_epoch=17, res_end_epoch=20),
    "rn50_88ep": dict(doc="ResNet-50, 88 epochs, res 160->192 (published by FFCV: 78.4% top-1 in 77.2 min on 8 A100s)",
                      epochs=88, res_start_epoch=65, res_end_epoch=76),
    "rn18_16ep": dict(doc="ResNet-18, 16 epochs, res 160->192 (published by FFCV: 66.9% top-1 in 35.0 min on 1 A100)",
                      model="resnet18", batch_size=1024, lr=0.125, weight_decay=5e-5),
    "rn18_88ep": dict(doc="ResNet-18, 88 epochs, res 160->192 (published by FFCV: 72.4% top-1 in 187.3 min on 1 A100)",
                      model="resnet18", batch_size=1024, lr=0.125, weight_decay=5e-5, epochs=88,
                      res_start_epoch=65, res_end_epoch=76),
    # The cluster papers, ResNet-50 for 90 epochs at 224 px, at the settings they publish (docs/imagenet.md, "The
    # cluster papers' recipes", gives each setting's source, and what their texts leave open and we assumed)
    "goyal_8k": dict(doc="Goyal et al. 2017: batch 8,192, lr 0.1 per 256 (3.2) after a 5-epoch warm-up from 0.1, "
                         "x0.1 at epochs 30/60/80, zero-init residual BN (published: 76.3% top-1 in 1 hour on 256 P100s)",
                     **CLUSTER, batch_size=8192, lr=0.1, warmup_epochs=5.0, warmup_start=256 / 8192, schedule="step",
                     step_epochs=(30.0, 60.0, 80.0), zero_init=True),
    "akiba_32k": dict(doc="Akiba et al. 2017: batch 32,768, RMSprop warm-up handing over to SGD, slow-start lr, "
                          "batch norm from the last batch averaged over ranks, fp16 gradients "
                          "(published: 74.9% top-1 in 15 min on 1,024 P100s)",
                      **CLUSTER, batch_size=32768, lr=0.1, warmup_epochs=0.0, schedule="slow_start",
                      optimizer="rmsprop_sgd", rms_beta_center=10.0, rms_beta_period=5.0, bn_stats="last_batch",
                      comm_hook="fp16"),
    "mikami_68k": dict(doc="Mikami et al. 2018 (Sony): batch-size control 34,816 -> 69,632 after 5 epochs, label "
                           "smoothing, 2D-torus all-reduce in fp16 (published: 75.03% top-1 in 224 s on 2,176 V100s)",
                       **{**CLUSTER, "label_smoothing": 0.1}, batch_size=69632, batch_schedule=(0, 34816, 5, 69632),
                       lr=0.1, warmup_epochs=5.0, schedule="linear", comm_hook="torus_fp16"),
    "tiny": dict(doc="resnet_tiny width 16 for tests and CPU demonstrations on small stores (res 32, 8 epochs)",
                 model="resnet_tiny", blurpool=False, epochs=8, batch_size=32, lr=0.2, warmup_epochs=1.0,
                 weight_decay=5e-5, min_res=32, max_res=32, res_start_epoch=0, res_end_epoch=0, res_step=8,
                 crop_scale=(0.35, 1.0), val_res=32, val_crop=0.0, tta="none"),
}


def hyperparameters(name, **overrides):
    """A recipe's hyperparameters with overrides applied (any key of BASE), checked once and frozen: the one value
    that the run passes down. A bad name or value is a UsageError of one line."""
    hp = recipe_values(name, overrides, base=BASE, recipes=RECIPES)
    check(hp)
    notes = []
    recipe_epochs = RECIPES[name].get("epochs", BASE["epochs"])
    if "warmup_epochs" not in overrides and 0 < hp["epochs"] <= hp["warmup_epochs"] < recipe_epochs:
        warmup = hp["warmup_epochs"] * hp["epochs"] / recipe_epochs      # the same share of the run
        notes.append(f"note: --epochs {hp['epochs']} ends inside the recipe's {hp['warmup_epochs']:g}-epoch warm-up, "
                     f"so the warm-up is shortened in proportion to {warmup:g} epochs (--warmup-epochs sets it)")
        hp["warmup_epochs"] = warmup
    return Frozen(hp, recipe=name, notes=notes)


def check(hp):
    """Raises UsageError naming the flag, what is wrong and what is allowed, for the first bad hyperparameter."""
    check_values(hp, CHOICES, positive=POSITIVE, not_negative=NOT_NEGATIVE, fractions=FRACTIONS,
                 whole=("epochs", "batch_size"))
    low, high = hp["crop_scale"]
    if not 0 < low <= high <= 1:
        raise flag_error("crop_scale", hp["crop_scale"], "must be two fractions, 0 < low <= high <= 1")
    low, high = hp["crop_ratio"]
    if not 0 < low <= high:
        raise flag_error("crop_ratio", hp["crop_ratio"], "must be two aspect ratios, 0 < low <= high")
    if round(hp["min_res"] / hp["res_step"]) == 0:
        raise flag_error("res_step", hp["res_step"], f"rounds --min-res {hp['min_res']} to 0 pixels; use at most "
                                                      f"{hp['min_res']}")
    try:
        for e in range(hp["epochs"]):
            batch_for(hp, e)        # a bad batch schedule fails here, not mid-run
    except ValueError as e:
        raise flag_error("batch_schedule", hp["batch_schedule"], str(e)) from None


def check_train(args):
    """Raises UsageError for the first bad flag of the train command that is not a hyperparameter; before anything
    is loaded or started."""
    for flag, bad, message in (
            ("store", not args.store, "is required (a folder written by `imagenet_fast.py prepare`)"),
            ("resume", args.resume and not args.checkpoint, "needs --checkpoint"),
            ("resume", args.resume and args.runs > 1, "works with a single run"),
            ("interrupt-after-epoch", args.interrupt_after_epoch and not args.checkpoint, "needs --checkpoint"),
            ("loader-threads", args.loader_threads is not None and args.loader_threads < 1, "must be positive")):
        if bad:
            raise UsageError(f"--{flag} {message}")
    check_run(args.runs, args.target, device=args.device, out=args.out, eval_every=args.eval_every)
    check_output(args.checkpoint, "--checkpoint")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="decode an ImageFolder tree into a store")
    pp.add_argument("--src", required=True, help="folder with train/<class>/* and val/<class>/*")
    pp.add_argument("--dst", required=True, help="store folder to write (resumes if partly written)")
    pp.add_argument("--format", default="jpeg", type=one_of(FORMATS, str),
                    help="jpeg: whole images, longer side <= --max-side, for full-quality training (default); "
                         "raw: uint8 pixels at --size, for low-resolution work")
    pp.add_argument("--max-side", type=int, default=500, help="jpeg: longest side kept (default 500, as FFCV)")
    pp.add_argument("--quality", type=int, default=90, help="jpeg: quality of re-encoded images (default 90)")
    pp.add_argument("--size", type=int, default=128, help="raw: shorter side of stored images (default 128)")
    pp.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPU count)")
    pp.add_argument("--shard-size", type=int, default=1000, help="images per shard, the unit of resumption")
    pp.add_argument("--max-aspect", type=float, default=2.0, help="longest val aspect kept (default 2)")
    pp.add_argument("--max-shards", type=int, default=None, help="stop after decoding this many new shards")

    tp = sub.add_parser("train", help="train on a store")
    tp.add_argument("--store", help="a folder written by prepare")
    tp.add_argument("--recipe", default="rn50_16ep", help="recipe name (default rn50_16ep; see --list-recipes)")
    tp.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    tp.add_argument("--data-on", default="auto", choices=["auto", "device", "host"],
                    help="where the store lives (auto: on the device if it fits)")
    tp.add_argument("--decoder", default="auto", type=one_of(devices.DECODERS, str),
                    help="where a JPEG store is decoded (auto: nvJPEG on a CUDA GPU, else the CPU's threads)")
    tp.add_argument("--loader-threads", type=int, default=None,
                    help="CPU decoding threads per process (default: CPU count / processes on the node)")
    tp.add_argument("--target", type=float, default=0.75, help="top-1 whose first epoch stops the clock")
    tp.add_argument("--checkpoint", default=None, help="checkpoint file, written atomically after every epoch")
    tp.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    tp.add_argument("--out", default=None, help="write config, environment, rows and summary as JSON")
    tp.add_argument("--interrupt-after-epoch", type=int, default=None,
                    help=f"exit with status {loop.INTERRUPTED} right after this epoch's checkpoint, as a preempted job "
                         "would; a restart with --resume (or torchrun --max-restarts) continues from it")
    add_shared_flags(tp, BASE, CHOICES)
    sub.add_parser("simulate", add_help=False,
                   help="project step time and scaling efficiency over many GPUs (as python scaling.py)")
    args = p.parse_args(argv)
    return args, overrides_from(args, BASE)


def main_prepare(args):
    try:
        settings = Settings(format=args.format, size=args.size, max_side=args.max_side, quality=args.quality,
                            max_aspect=args.max_aspect)
        index = prepare(args.src, Path(args.dst), settings, workers=args.workers, shard_size=args.shard_size,
                        max_shards=args.max_shards)
    except (DataError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print(f"interrupted; {kept(args.dst)}; the same command resumes from there", file=sys.stderr)
        return 130
    if index is None:
        return 3
    shape = (f"longer side <= {args.max_side}" if args.format == "jpeg" else f"size {args.size}")
    gb = (index["train"]["bytes"] + index["val"]["bytes"]) / 1e9
    print(f"wrote {args.dst}: {len(index['classes'])} classes, {index['train']['count']} train and "
          f"{index['val']['count']} val images, {args.format} at {shape}, {gb:.3f} GB; "
          f"{index['train']['skipped'] + index['val']['skipped']} unreadable files skipped")
    return 0


def main_train(args, overrides, argv):
    if args.list_recipes:
        print("\n".join(f"{name:12s} {r['doc']}" for name, r in RECIPES.items()))
        return 0
    try:
        hp = hyperparameters(args.recipe, **overrides)
        check_train(args)
    except UsageError as e:
        D.print0(f"error: {e}", file=sys.stderr)
        return 2
    return run_in_ranks(args, hp, lambda ctx, hook: run(args, hp, ctx=ctx, hook=hook, argv=argv))


COLUMNS = ["epoch", "res", "batch", "lr", "train_loss", "train_acc", "val_loss", "top1", "top5", "epoch_time",
           "total_time"]


def run(args, hp, *, ctx, hook, argv):
    """main_train's work once this process has its place: data, runs, summary, JSON; the exit status."""
    device, say, progress = torch.device(ctx.device), D.print0, ctx.is_main and not args.quiet
    for note in hp.notes:
        say(note, file=sys.stderr)
    if devices.is_cpu(device) and ctx.is_main:
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration use "
              "a small store, --model resnet_tiny and few --epochs", file=sys.stderr)
    try:
        batch = per_rank_batch(hp["batch_size"], ctx.world_size)
        for e in range(hp["epochs"]):
            batch_for(hp, e, ctx.world_size)      # a schedule that does not divide over the ranks fails here
    except ValueError as e:
        say(f"error: {e}", file=sys.stderr)
        return 2
    dtype = devices.compute_dtype(device, args.precision)
    try:
        decoder = devices.jpeg_decoder(device, args.decoder)
    except ValueError as e:
        say(f"error: {e}", file=sys.stderr)
        return 2
    try:
        store = open_store(args.store)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)     # every rank: each may read a store of its own node's
        return 1
    classes = len(store.index["classes"])
    try:            # before anything is loaded: what training needs of the device, and whether the store fits beside
        training = 0 if devices.is_cpu(device) else training_bytes(hp, classes, world=ctx.world_size, dtype=dtype)
        devices.check_training_fits(device, training, why=f"training {hp['model']} at {batch} images per process",
                                    remedy="use a smaller --batch-size or more GPUs (the batch is split over them)")
        with Heartbeat(f"placing {args.store}", on=progress):
            data = place(store, device, where=args.data_on, ctx=ctx, seed=args.seed, decoder=decoder,
                         threads=args.loader_threads, training=training)     # under torchrun, this rank's share alone
    except UsageError as e:
        say(f"error: {e}", file=sys.stderr)
        return 2
    held = (("jpeg store, decoded on the GPU (nvJPEG)" if decoder == "gpu" else
             f"jpeg store, decoded by {data.threads} CPU threads") if store.format == "jpeg" else f"raw store of size {store.size} in {data.where} memory")
    say(f"recipe {args.recipe} on {devices.name(device)} ({device}, {str(dtype)[6:]}), "
        f"{len(store.train)} train and {len(store.val)} val images, {classes} classes, {held}"
        + (f", {ctx.world_size} ranks of {batch} images per step, each holding "
           f"{len(data.train_rows)} train images" if ctx.distributed else ""))
    if not devices.is_cpu(device):
        devices.autotune(device)
        with Heartbeat("warm-up: cuDNN's autotuning at every resolution and batch", on=progress):
            warmup(hp, data, classes=classes, device=device, dtype=dtype, world=ctx.world_size)
    labels = {"final_top1": ("final top-1", ""), "final_top5": ("final top-5", ""),
              "time_to_target": (f"time to {args.target:.2%}", " s"), "train_time": ("training time", " s")}
    runs = []

    def save(complete):
        """--out after every run, so that a run cut short, or a failure later, never loses the finished runs."""
        if args.out and ctx.is_main:
            write_json(args.out, run_record({
                "recipe": args.recipe, "hyperparameters": hp, "target": args.target, "store": str(args.store),
                "store_format": store.format, "data_on": data.where, "decoder": decoder, "complete": complete, "runs": runs,
                "summary": summarize_runs(runs, args.target, labels, "final_top1")}, args, argv=argv, device=device,
                ctx=ctx))

    for r in range(args.runs):
        seed = args.seed + r
        if args.runs > 1:
            say(f"run {r + 1}/{args.runs} (seed {seed})")
        table = Table(COLUMNS, width=11, formats={"epoch_time": ".2f", "total_time": ".2f"},
                      file=None if ctx.is_main else io.StringIO())
        ckpt = args.checkpoint if args.runs == 1 else (args.checkpoint and f"{args.checkpoint}.seed{seed}")
        epochs_done = []

        def epoch_done(row):
            table.append(row)
            epochs_done.append(row["epoch"])
        try:
            result = loop.train(start(hp, data, classes=classes, device=device, dtype=dtype, ctx=ctx,
                                      bucket_mb=args.bucket_mb, hook=hook), hp,
                                device=device, seed=seed, dtype=dtype, ctx=ctx, target=args.target,
                                eval_every=args.eval_every, on_epoch=epoch_done, checkpoint=ckpt, resume=args.resume,
                                interrupt_after=args.interrupt_after_epoch,
                                progress_after_s=PROGRESS_AFTER_S if progress else None)
        except DataError as e:
            say(f"error: {e}", file=sys.stderr)      # the checkpoint's errors: the same on every rank
            return 1
        except KeyboardInterrupt:
            say(interrupted(max(epochs_done, default=0) + 1, r + 1, len(runs), out=args.out, checkpoint=ckpt),
                file=sys.stderr)
            return 130
        result.pop("model")
        result["final_top1"], result["final_top5"] = result.pop("final_acc"), result["rows"][-1]["top5"]
        runs.append(result)
        save(complete=False)
        ttt = result["time_to_target"]
        say(f"final top-1 {result['final_top1']:.4f}, top-5 {result['final_top5']:.4f}; "
            + (f"time to {args.target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {args.target:.2%}")
            + f"; training time {result['train_time']:.2f} s")

    if args.runs > 1 and ctx.is_main:
        print_summary(args.recipe, summarize_runs(runs, args.target, labels, "final_top1"), args.target, labels)
    save(complete=True)
    if args.out and ctx.is_main:
        print(f"wrote {args.out}")
    D.barrier()       # leave together
    return 0


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if argv_list[:1] == ["simulate"]:
        return scaling.main_simulate(argv_list[1:])
    args, overrides = parse_args(argv)
    if args.command == "prepare":
        return main_prepare(args)
    return main_train(args, overrides, argv)


if __name__ == "__main__":
    sys.exit(main())
