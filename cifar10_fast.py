"""Train a ResNet on CIFAR-10 to 94% and report the time it took.

    python cifar10_fast.py                          # myrtle24: Myrtle's DAWNBench ResNet-9
    python cifar10_fast.py --recipe myrtle10 --runs 10 --out results.json
    python cifar10_fast.py --list-recipes
    python cifar10_fast.py --device cpu --subset 5000 --epochs 2 --width 0.25   # a CPU demonstration

Each recipe is one plain dict of named hyperparameters; any of them can be overridden by a flag
of the same name (`--batch-size 768`, `--lr-knots 0,0.2,1`).
"""
import argparse
import io
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import cifar_data as cd
import devices
import distributed as D
import loop
import torch_backend as tb
from cli import (add_shared_flags, check_run, check_values, flag, flag_error, interrupted, one_of, overrides_from,
                 recipe_values, run_in_ranks, run_record, show_choices)
from core import (DataError, Frozen, Heartbeat, Parser, Table, UsageError, print_summary, summarize_runs,
                  write_json)
from loop import Run, train_step
from optim import make_optimizers, set_lr
from schedules import PiecewiseLinear, epoch_steps, linear_scaled_lr, per_rank_batch, run_steps

# Every hyperparameter, with the value it has unless a recipe or flag says otherwise.
# lr_knots are fractions of the whole run, so --epochs stretches the schedule with it; lr_values
# and weight_decay are in the units of `param` (see optim.make_optimizers). Every switch is off here.
BASE = dict(
    model="resnet9", width=1.0, epochs=24, batch_size=512,
    # optimiser and schedule
    param="myrtle", optimizer="sgd", lr_knots=(0, 5 / 24, 1), lr_values=(0.0, 0.4, 0.0),
    momentum=0.9, nesterov=True, weight_decay=5e-4, bias_lr_mult=1.0, label_smoothing=0.0,
    # Muon for the conv filters (optimizer="muon", optim.Muon): its peak lr and momentum, Newton–Schulz steps
    # and coefficients, renormalisation of the filters every k steps with k growing from muon_renorm_every[0]
    # to [1] over the run (0: never), decoupled weight decay (per image, like weight_decay in the sum units),
    # the momentum buffer's dtype (fp32, fp16, bf16), all filter banks in one batched Newton–Schulz call
    muon_lr=0.0, muon_momentum=0.6, muon_ns_steps=5, muon_ns_coeffs=(3.4445, -4.7750, 2.0315),
    muon_renorm_every=(0, 0), muon_weight_decay=0.0, muon_momentum_dtype="fp32", muon_batched=False,
    # large-batch options (optim.py, distributed.py): LARS trust coefficient; RMSprop-to-SGD's RMSprop rate and the
    # epochs where the hand-over is half done and its length; Goyal's linear scaling of lr_values by
    # batch_size / lr_scale_base (0 = off); batch-norm statistics "running" or "last_batch" (averaged
    # over ranks before each evaluation instead of moving averages); under torchrun, the gradients' communication
    # (distributed.HOOKS: plain, compressed to fp16 or bf16, or a 2D torus)
    lars_trust=0.001, rms_lr=1e-3, rms_beta_center=2.0, rms_beta_period=2.0, lr_scale_base=0,
    bn_stats="running", comm_hook="none",
    # augmentation (brightness and contrast jitter: ± these, per image; the first low_res_epochs epochs at
    # low_res pixels when low_res is set) and test-time augmentation (all views for the tta_fraction of test
    # images the plain pass is least sure of: selective TTA)
    crop_pad=4, flip="random", cutout=8, jitter_brightness=0.0, jitter_contrast=0.0, low_res=0, low_res_epochs=0,
    tta="none", tta_fraction=1.0, tta_weights="airbench",
    # network (whiten_act: the activation after the whitening layer, "" for act; the head's initial weights at
    # unit std, and the logits ÷ the head's width as well as × output_scale)
    act="relu", celu_alpha=0.3, pool_first=False, ghost_batch=0, freeze_bn_scale=False,
    bn_momentum=0.1, bn_eps=1e-5, dirac_init=False, output_scale=0.125, head_unit_std=False, output_by_width=False,
    block_widths=(64, 256, 256), block_depth=2,
    whiten=False, whiten_size=3, whiten_pad=1, whiten_signs=1, whiten_act="", whiten_bias=False,
    whiten_bias_init="zero", whiten_bias_epochs=0, whiten_bias_lr_mult=1.0, whiten_bias_decay="none",
    whiten_eps=1e-2,
    # the whitening fit: the first whiten_images training images, the patch covariance centred or not and
    # divided by n - whiten_ddof, its eigenvectors from "eigh" or "svd"
    whiten_images=10000, whiten_centre=True, whiten_ddof=1, whiten_decomp="eigh",
    # weight averaging
    ema_momentum=0.0, ema_every=5, lookahead_momentum=0.0, lookahead_every=5,
    # with --compile: compile the forward and the loss as one function (and so their backward as one graph)
    compile_step=False,
)

# The values a hyperparameter that takes one of a few may take: the flags' choices (which --help lists) and what
# validate() accepts.
ACTIVATIONS = ("relu", "celu", "gelu", "silu")
CHOICES = dict(
    model=tuple(tb.MODELS), param=("myrtle", "decoupled", "sum"), optimizer=("sgd", "muon", "lars", "rmsprop_sgd"),
    comm_hook=D.HOOKS,
    flip=("none", "random", "alternate"), tta=("none", "flip", "flip_translate"), act=ACTIVATIONS,
    whiten_act=("",) + ACTIVATIONS, whiten_bias_decay=("none", "linear"), whiten_decomp=("eigh", "svd"),
    muon_momentum_dtype=("fp32", "fp16", "bf16"), bn_stats=("running", "last_batch"), block_depth=(2, 3),
    whiten_bias_init=("zero", "default"), tta_weights=("airbench", "equal"),
    whiten_signs=(1, 2),
)

# Jordan (2024)'s three-block network and training, from the published airbench94 hyperparameters
# (our own implementation); fast95 and fast96 widen it, and fast96 deepens it, as airbench95/96 do.
FAST = dict(
    model="fastnet", block_widths=(64, 256, 256), act="gelu", epochs=9.9, batch_size=1024,
    param="decoupled", lr_knots=(0, 0.23, 1), lr_values=(0.2 * 11.5, 11.5, 0.07 * 11.5),
    momentum=0.85, weight_decay=0.0153, bias_lr_mult=64.0, label_smoothing=0.2,
    crop_pad=2, flip="alternate", cutout=0, tta="flip_translate",
    freeze_bn_scale=True, bn_momentum=0.4, bn_eps=1e-12, dirac_init=True, output_scale=1 / 9,
    whiten=True, whiten_size=2, whiten_pad=0, whiten_signs=2, whiten_bias=True, whiten_bias_epochs=3,
    whiten_eps=5e-4, whiten_images=5000, whiten_centre=False, whiten_ddof=0, lookahead_momentum=0.95, lookahead_every=5,
)

# airbench96 (legacy/airbench96.py; airbench/lib_airbench96.py the same but for its schedule: train96 drops its
# lr_peak=0.1 and lr_end=0, so the package trains with airbench94's 23% warm-up and end at 0.07): widths
# 128/384/512, a third conv per block with the residual added before the last activation, translate 4,
# cutout 12, 37 epochs, lr 9.0 per 1024 warming up from 0.2x over the first 10% of the steps then linear to 0,
# weight decay 0.012, batch-norm momentum 0.1 (PyTorch's default).
FAST96 = dict(block_widths=(128, 384, 512), block_depth=3, epochs=37, crop_pad=4, cutout=12,
              lr_knots=(0, 0.1, 1), lr_values=(0.2 * 9, 9.0, 0.0), weight_decay=0.012, bn_momentum=0.1)

# airbench94 with Muon (airbench94_muon.py, published: 94.01% in 2.59 s on an A100): batch 2000, 8 epochs
# (ceil(8 × 25) = 200 steps), no lookahead, every rate linear from its peak to 0 with no warm-up. Muon for the
# conv filters (lr 0.24, momentum 0.6, 3 Newton–Schulz steps, the filters renormalised before every step);
# SGD (Nesterov, momentum 0.85) on the summed loss for the head (lr 0.67) and the batch-norm and whitening
# biases (0.053), weight decay 2e-6 × batch; the whitening bias starts at the convolution's default initialisation
# (uniform in ±1/√12: their CifarNet.reset re-initialises it with nn.Conv2d's own reset_parameters), its rate falls
# to 0 over its 3 epochs, after which it is detached; the head's initial weights at unit std and the logits ÷ the
# width (256).
MUON = dict(batch_size=2000, epochs=8, lookahead_momentum=0.0, param="sum", optimizer="muon",
            lr_knots=(0, 1), lr_values=(0.67, 0.0), momentum=0.85, weight_decay=2e-6,
            bias_lr_mult=0.053 / 0.67, whiten_bias_lr_mult=0.053 / 0.67, whiten_bias_decay="linear",
            whiten_bias_init="default",
            muon_lr=0.24, muon_momentum=0.6, muon_ns_steps=3, muon_renorm_every=(1, 1),
            head_unit_std=True, output_scale=1.0, output_by_width=True)

# The 2-second record (hiverge/cifar10-speedrun, cifar10_speedrun.py; published: 94.01% in 2.015 s on an A100)
# on top of MUON: batch 1536, 7.59 epochs (243 steps), label smoothing 0.09, SGD momentum 0.825 with head lr
# 0.5415 and bias lr 0.0573, weight decay 1.0418e-6 × batch for SGD and (decoupled) for Muon; Muon lr 0.205,
# momentum 0.655, Newton–Schulz coefficients (3.4576, -4.7391, 2.0843), all filter banks in one call, fp16
# momentum, renormalisation every 2 + int(15 × progress) steps; batch-norm momentum 0.5566 in its convention
# (1 - 0.5566 in PyTorch's); SiLU in the blocks, GELU after the whitening, which is fitted by an SVD of the
# first 960 images' patches; its bias trains for 0.19 epochs (7 steps); brightness ± 0.1399 and contrast
# ± 0.1308; 6-view TTA for the quarter of test images the plain pass is least sure of; forward and loss
# compiled as one step; the 6 TTA views weighted equally (their mean). Ours differs in: bf16 autocast with float32
# weights (theirs: fp16 weights), and no rescaling of the Newton–Schulz input before its normalisation (theirs
# divides it away again).
NEXT = dict(batch_size=1536, epochs=7.59, label_smoothing=0.09, momentum=0.825, lr_values=(0.5415, 0.0),
            bias_lr_mult=0.0573 / 0.5415, whiten_bias_lr_mult=0.0573 / 0.5415, whiten_bias_epochs=0.19,
            weight_decay=1.0418e-6, muon_lr=0.205, muon_momentum=0.655, muon_ns_coeffs=(3.4576, -4.7391, 2.0843),
            muon_batched=True, muon_momentum_dtype="fp16", muon_renorm_every=(2, 17), muon_weight_decay=1.0418e-6,
            bn_momentum=1 - 0.5566, act="silu", whiten_act="gelu", whiten_images=960, whiten_decomp="svd",
            jitter_brightness=0.1399, jitter_contrast=0.1308, tta_fraction=0.25, tta_weights="equal",
            compile_step=True)

# The "How to train your ResNet" journey (Myrtle.ai, 2018-19), in order: each stage is the stage
# before it plus `changes`. Numbers are Myrtle's, read from their experiments.ipynb (parts 1-4) and
# bag_of_tricks.ipynb (part 8); published_v100_s is the training time they published for the step.
# Two steps were loader/kernel fixes that our always-on-device loader has built in, so they change
# nothing here ("same" below); the stage exists so that the table lines up with the published one.
JOURNEY = [
    dict(name="baseline_resnet18", published_v100_s=297,
         doc="Myrtle's ResNet-18 (pre-activation, 64/128/256/256 channels, max+average pool), 35 epochs, batch 128, "
             "crop+flip, lr 0.1 peak at epoch 15",
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
    # Our speed recipes. Starting points from the published airbench hyperparameters;
    # GPU accuracy and time not measured yet (README).
    "fast94": dict(FAST, doc="3-block net, 2x2 whitening, dirac init, lookahead, alternating flip, 6-view TTA: "
                             "9.9 epochs at batch 1024 (target 94%)"),
    "fast95": dict(FAST, doc="fast94 widened to 128/384/384 for 15 epochs (target 95%)",
                   block_widths=(128, 384, 384), epochs=15, lr_values=(0.2 * 10, 10.0, 0.07 * 10)),
    "fast96": dict({**FAST, **FAST96}, doc="airbench96 (legacy/airbench96.py): 128/384/512, 3 convs per block with a "
                                       "residual, translate 4, cutout 12, 37 epochs (target 96%)"),
    "fast94_muon": dict({**FAST, **MUON}, doc="airbench94 with Muon (airbench94_muon.py): batch 2000, 8 epochs, Muon for "
                                          "the filters, no lookahead (target 94%)"),
    "fast94_next": dict({**FAST, **MUON, **NEXT}, doc="the 2-second record's configuration from switches: batched "
                                                  "Newton-Schulz, SiLU, jitter, selective TTA, 7.59 epochs at batch "
                                                  "1536 (target 94%)"),
    "fast94_next_lowres": dict({**FAST, **MUON, **NEXT}, low_res=24, low_res_epochs=2,
                               doc="fast94_next with its first 2 epochs at 24 px: an idea of ours, measured "
                                   "beside fast94_next before it joins it (target 94%)"),
}


def hyperparameters(name, **overrides):
    """A recipe's hyperparameters with overrides applied (any key of BASE), checked once and frozen: the one value
    that the run passes down. A bad name or value is a UsageError of one line."""
    hp = recipe_values(name, overrides, base=BASE, recipes=RECIPES)
    check(hp)
    if hp["lr_scale_base"]:     # Goyal et al.: k times the batch, k times the learning rate
        hp["lr_values"] = tuple(linear_scaled_lr(v, hp["batch_size"], hp["lr_scale_base"]) for v in hp["lr_values"])
    return Frozen(hp, recipe=name)


POSITIVE = ("epochs", "batch_size", "width", "ema_every", "lookahead_every", "whiten_size", "whiten_images", "bn_eps")
NOT_NEGATIVE = ("weight_decay", "crop_pad", "cutout", "ghost_batch", "low_res", "low_res_epochs", "lr_scale_base",
                "whiten_pad", "whiten_bias_epochs", "whiten_eps", "muon_lr", "muon_ns_steps", "muon_weight_decay",
                "jitter_brightness", "jitter_contrast", "lars_trust", "rms_lr")
FRACTIONS = ("momentum", "label_smoothing", "bn_momentum", "ema_momentum", "lookahead_momentum", "muon_momentum")


def check(hp):
    """Raises UsageError naming the flag, what is wrong and what is allowed, for the first bad hyperparameter."""
    check_values(hp, CHOICES, positive=POSITIVE, not_negative=NOT_NEGATIVE, fractions=FRACTIONS, whole=("batch_size",))
    if not 0 < hp["tta_fraction"] <= 1:
        raise flag_error("tta_fraction", hp["tta_fraction"], "must be in (0, 1]")
    if min(hp["block_widths"]) <= 0:
        raise flag_error("block_widths", hp["block_widths"], "must all be positive")
    knots, values = hp["lr_knots"], hp["lr_values"]
    if len(knots) != len(values):
        raise UsageError(f"{flag('lr_knots', knots)} and {flag('lr_values', values)}: must have the same length "
                         f"(here {len(knots)} and {len(values)})")
    if any(b < a for a, b in zip(knots, knots[1:])):
        raise flag_error("lr_knots", knots, "must not decrease")


def check_subset(subset, n_train=None):
    """Raises UsageError unless --subset is positive (and, given the training images there are, at most that)."""
    if subset is not None and subset < 1:
        raise flag_error("subset", subset, "must be positive")
    if subset is not None and n_train is not None and subset > n_train:
        raise flag_error("subset", subset, f"larger than the {n_train} training images")


def check_data(hp, n_train, image_size):
    """Raises UsageError for a hyperparameter that the data's size rules out: the batch (n_train: the training
    images a run trains on), the crop, cutout, low resolution and network against the (height, width) of the
    images. Checked once the data is loaded, before training."""
    if hp["batch_size"] > n_train:
        raise flag_error("batch_size", hp["batch_size"], f"larger than the {n_train} training images")
    h, w = image_size
    if hp["crop_pad"] >= min(h, w):
        raise flag_error("crop_pad", hp["crop_pad"], f"must be smaller than the {h}x{w} images")
    if hp["cutout"] > min(h, w):
        raise flag_error("cutout", hp["cutout"], f"larger than the {h}x{w} images")
    if hp["low_res"] and h != w:
        raise flag_error("low_res", hp["low_res"], f"needs square images, not {h}x{w}")
    try:        # on the meta device: shapes only, no memory, no arithmetic
        tb.build_model(hp, "meta")(torch.empty(2, 3, h, w, device="meta"))
    except RuntimeError:
        raise flag_error("model", hp["model"], f"{h}x{w} images are too small for this network") from None


# ---------------------------------------------------------------------------------------------
# One run: the CIFAR-10 parts of the loop (loop.train)
# ---------------------------------------------------------------------------------------------

def network(hp, device, *, compile_mode=None, ctx=None, bucket_mb=25.0, hook="none", num_classes=10):
    """(net, forward) built once per process and re-initialised in place by every run (start): under torchrun
    forward is net in DistributedDataParallel (with bucket_mb buckets and a gradient communication hook), and with
    compile_mode it is torch.compile'd, so compilation happens once, in the warm-up; with hp["compile_step"] what is
    compiled is WithLoss(net), the forward and the loss as one function. (None, None) when neither applies: each
    run then builds a plain network of its own."""
    distributed = ctx is not None and ctx.distributed
    if not (compile_mode or distributed):
        return None, None
    net = tb.build_model(hp, device, memory_format=devices.memory_format(device), num_classes=num_classes)
    forward = net
    if distributed:
        forward = D.register_comm_hook(D.wrap_ddp(net, ctx, bucket_mb), hook)
    if compile_mode:
        if hp["compile_step"]:
            forward = WithLoss(forward, hp["label_smoothing"])
        # dynamic=False: each new shape (the low-resolution epochs, the last evaluation batch) compiles a graph of its
        # own, once, in the warm-up; dynamic shapes would recompile them inside a timed run instead
        forward = torch.compile(forward, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
    return net, forward


class WithLoss(torch.nn.Module):
    """The network, and given labels also its summed loss. Compiled (compile_step), the forward and the loss are
    one graph, and AOTAutograd compiles their backward as one graph with it: fewer kernels than the network
    compiled alone with the loss and its backward left eager. Called without labels it is the network."""
    takes_labels = True

    def __init__(self, net, label_smoothing):
        super().__init__()
        self.net, self.label_smoothing = net, label_smoothing

    def forward(self, x, y=None):
        logits = self.net(x)
        if y is None:
            return logits
        return logits, F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing, reduction="sum")


def compile_counts():
    """(graphs torch.compile has made in this process so far, frames it gave up on and left to run eagerly):
    torch._dynamo's counts."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], counters["frames"]["total"] - counters["frames"]["ok"]


def start(hp, data, *, device, dtype, ctx, net=None, forward=None):
    """The builder of a run that loop.train calls once torch's seed is set: start(seed) builds a fresh network (or
    re-initialises `net`, from network(), in place), its optimisers and what it draws once (its whitening is fitted
    by the Run's init, once the clock runs), and
    returns the loop.Run that trains it on the device-resident `data` (device_data; under torchrun this rank's
    shard), in this rank's share of the batch."""
    world, wrapped = ctx.world_size, ctx.distributed     # in DistributedDataParallel under torchrun, one rank too
    batch = hp["batch_size"] // world
    memory_format = devices.memory_format(device)
    n_train = len(data["train_labels"])
    steps_per_epoch, total_steps = run_steps(n_train, batch, hp["epochs"])
    schedule = PiecewiseLinear(hp["lr_knots"], hp["lr_values"])

    def build(seeds):
        order, augment = (devices.generator(device, seeds[k]) for k in ("order", "augment"))
        fresh = tb.build_model(hp, device, memory_format=memory_format, num_classes=data.get("num_classes", 10))
        model, step = fresh, fresh
        if net is not None:
            net.load_state_dict(fresh.state_dict())
            model, step = net, (net if forward is None else forward)
        tb.set_bias_grad(model, True)
        opts = make_optimizers(model, hp, steps_per_epoch, world)
        flip_base = cd.flip_bits(n_train, augment, device) if hp["flip"] == "alternate" else None
        # Once trained, the whitening bias is detached (no gradient to compute), as airbench94_muon does; not under
        # DDP, which expects a gradient for every parameter it holds (there its lr is 0 from then on).
        whitening, whiten_steps = ([] if wrapped else tb.whitening_biases(model),
                                   epoch_steps(hp["whiten_bias_epochs"], steps_per_epoch))

        def before_step(step_no):
            for m in whitening:
                m.bias_grad = step_no < whiten_steps

        def evaluate(model, final):
            loss, acc = tb.evaluate(model, data["test_images"], data["test_labels"],
                                    tta=hp["tta"] if final else "none", dtype=dtype, memory_format=memory_format,
                                    tta_fraction=hp["tta_fraction"] if final else 1.0, tta_weights=hp["tta_weights"])
            return {"test_loss": loss, "test_acc": acc}
        return Run(model=model, forward=step, optimizers=opts, generators={"order": order, "augment": augment},
                   steps=[steps_per_epoch] * math.ceil(total_steps / steps_per_epoch), total_steps=total_steps,
                   batches=lambda epoch: cd.epoch_batches(data, hp, augment, memory_format=memory_format, epoch=epoch,
                                                          flip_base=flip_base, batch_size=batch, order=order),
                   schedule=lambda epoch, i, step_no: (schedule(step_no / total_steps), step_no / steps_per_epoch),
                   evaluate=evaluate, metrics=("test_loss", "test_acc"), accuracy="test_acc", wrapped=wrapped,
                   before_step=before_step if whitening else None,
                   # the whitening fit is timed, as the references time it; under torchrun data["whiten_images"]
                   # holds the images one process would fit on (device_data)
                   init=lambda: tb.fit_whitening(model, data.get("whiten_images", data["train_images"]),
                                                 data["test_images"].shape[-2:]))
    return build


def warmup(hp, data, *, device, dtype, ctx, net=None, forward=None):
    """Runs, before the clock starts, everything a timed run will meet, so that cuDNN autotuning, kernel loading and
    torch.compile happen outside it (the 'compilation warm-up' the timing protocol excludes): a few steps at every
    training resolution with the whitening bias trained and detached, and every kind of evaluation (plain and with
    the recipe's test-time augmentation) in both states of the bias, on `net` (which every run re-initialises) or a
    throwaway network, with a generator of its own (the runs' random streams stay untouched) at a learning rate that
    moves nothing measurable but runs every kernel. Under torchrun the bias is never detached (start)."""
    memory_format = devices.memory_format(device)
    net = net if net is not None else tb.build_model(hp, device, memory_format=memory_format,
                                                      num_classes=data.get("num_classes", 10))
    forward = net if forward is None else forward
    # the decomposition loads the GPU's linear-algebra library (cuSOLVER), which the first timed fit must not pay for
    tb.fit_whitening(net, data.get("whiten_images", data["train_images"]), data["test_images"].shape[-2:])
    opts = make_optimizers(net, hp, 1, ctx.world_size)
    set_lr(opts, 1e-9)
    gen = devices.generator(device, 0)
    flip_base = cd.flip_bits(len(data["train_labels"]), gen, device)
    states = (True, False) if tb.whitening_biases(net) and not ctx.distributed else (True,)
    for epoch in dict.fromkeys((0, hp["low_res_epochs"] if hp["low_res"] else 0)):     # every training resolution
        for state in states:
            x, y = next(cd.epoch_batches(data, hp, gen, memory_format=memory_format, epoch=epoch, flip_base=flip_base,
                                         batch_size=hp["batch_size"] // ctx.world_size))
            tb.set_bias_grad(net, state)
            train_step(forward, opts, x, y, label_smoothing=hp["label_smoothing"], dtype=dtype)
    evaluated = net if ctx.distributed else forward      # as loop.train evaluates
    for state in states:
        tb.set_bias_grad(net, state)
        for tta, fraction in dict.fromkeys((("none", 1.0), (hp["tta"], hp["tta_fraction"]))):
            tb.evaluation_sums(evaluated, data["test_images"], data["test_labels"], tta=tta, dtype=dtype,
                               memory_format=memory_format, tta_fraction=fraction, tta_weights=hp["tta_weights"])
    tb.set_bias_grad(net, True)
    devices.synchronize(device)


def device_data(arrays, hp, ctx, device, *, dtype, stats):
    """This process's dataset on the device, normalised by stats (the whole training set's): under torchrun, its
    own contiguous shard of the training set, and the images the whitening filters are fitted on taken before
    sharding, so that every rank fits the filters one process would (they are frozen parameters, which DDP never
    synchronises)."""
    if not ctx.distributed:
        return cd.to_device(arrays, device, dtype=dtype, pad=hp["crop_pad"], stats=stats)
    part = D.shard(len(arrays["train_labels"]), ctx.rank, ctx.world_size)
    whiten = arrays["train_images"][:hp["whiten_images"]]
    shard = {**arrays, "train_images": arrays["train_images"][part.start:part.stop],
             "train_labels": arrays["train_labels"][part.start:part.stop]}
    return {**cd.to_device(shard, device, dtype=dtype, pad=hp["crop_pad"], stats=stats),
            "num_classes": cd.num_classes(arrays), "whiten_images": cd.normalise(whiten, device, dtype=dtype, stats=stats)}


def estimated_run_s(hp, step_s, *, flops, batch, n_train, n_test, eval_every):
    """Seconds a run is expected to take, from the measured seconds per training step: its steps, and its
    evaluations priced from the counted FLOPs (tb.count_flops) at the training steps' rate."""
    steps_per_epoch, total_steps = run_steps(n_train, batch, hp["epochs"])
    epochs = math.ceil(total_steps / steps_per_epoch)
    plain_evals = (epochs - 1) // eval_every if eval_every else 0
    flops_per_s = flops["per_train_image"] * batch / step_s
    evaluations = flops["final_eval"] + plain_evals * n_test * flops["per_forward_image"]
    return total_steps * step_s + evaluations / flops_per_s


# ---------------------------------------------------------------------------------------------
# The library: train() and evaluate(); the command line below is a thin layer over them
# ---------------------------------------------------------------------------------------------

COLUMNS = ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time", "total_time"]
SUMMARY = ("final_acc", "time", "train_time", "time_to_target")     # the results summarised over runs
PROGRESS_AFTER_S = 5.0          # an epoch that looks longer shows its steps on stderr


@dataclass(kw_only=True)
class Result:
    """What train() returns: the last run's trained network (the weights it was evaluated with: the EMA's or
    lookahead's when the recipe averages weights), its per-epoch rows, the summary over all runs (mean, std, min
    and max of accuracy and times, the t-test against the target, FLOPs), every run's result (seed, rows, final
    accuracy, times, graphs compiled inside the clock) and the hyperparameters."""
    model: torch.nn.Module
    rows: list
    summary: dict
    runs: list
    hyperparameters: dict
    flops: dict


@dataclass(kw_only=True)
class Prepared:
    """A recipe ready to train: its data on the device (device_data), its FLOPs counted, and the network built, and
    compiled and warmed up where that applies (network, warmup), once; run() trains one fresh network on it."""
    hp: Frozen
    data: dict
    device: torch.device
    dtype: torch.dtype
    ctx: D.Context
    net: object
    forward: object
    flops: dict
    stats: tuple

    def run(self, seed, *, target=0.94, eval_every=1, on_epoch=None, progress_after_s=None, on_first_steps=None):
        """One run (loop.train) with its wall-clock seconds, per-epoch evaluations included (wall_s: for planning,
        not a result), the graphs torch.compile made inside it (recompiles: 0 unless the warm-up missed one) and the
        frames it left to run eagerly there (eager_fallbacks)."""
        started, (graphs, fallbacks) = time.perf_counter(), compile_counts()
        result = loop.train(start(self.hp, self.data, device=self.device, dtype=self.dtype, ctx=self.ctx,
                                  net=self.net, forward=self.forward), self.hp,
                            device=self.device, seed=seed, dtype=self.dtype, ctx=self.ctx, target=target,
                            eval_every=eval_every, on_epoch=on_epoch, progress_after_s=progress_after_s,
                            on_first_steps=on_first_steps)
        result["model"].normalisation = self.stats       # for evaluate(): the statistics the network trained on
        now = compile_counts()
        return {**result, "wall_s": time.perf_counter() - started, "recompiles": now[0] - graphs,
                "eager_fallbacks": now[1] - fallbacks}


def prepare(hp, arrays, *, device, dtype, ctx=None, stats=None, compile=None, hook="none", bucket_mb=25.0,
            progress=False):
    """A Prepared recipe: arrays (four numpy arrays, checked) on the device, normalised by stats (the training images'
    own unless given), under torchrun this rank's shard; on an accelerator, or with `compile`, the untimed warm-up
    done."""
    ctx = ctx or D.Context(device=str(device))
    stats = stats or cd.channel_stats(arrays["train_images"])
    data = device_data(arrays, hp, ctx, device, dtype=dtype, stats=stats)
    flops = tb.count_flops(hp, {**data, "train_labels": torch.empty(len(arrays["train_labels"]))})
    net, forward = network(hp, device, compile_mode=compile, ctx=ctx, bucket_mb=bucket_mb, hook=hook,
                           num_classes=data.get("num_classes", 10))
    if not devices.is_cpu(device) or compile:
        devices.autotune(device)
        what = "compiling every graph the runs meet (torch.compile)" if compile else "cuDNN's autotuning"
        with Heartbeat(f"warm-up: {what}", on=progress):
            warmup(hp, data, device=device, dtype=dtype, ctx=ctx, net=net, forward=forward)
    return Prepared(hp=hp, data=data, device=device, dtype=dtype, ctx=ctx, net=net, forward=forward, flops=flops,
                    stats=stats)


def train(recipe, data=None, *, device=None, runs=1, seed=0, target=0.94, compile=None, verbose=False, progress=False,
          dataset=None, subset=None, precision="auto", eval_every=1, on_run=None, on_epoch=None, ctx=None, hook="none",
          bucket_mb=25.0, **overrides):
    """Trains `runs` fresh networks (seeds seed, seed+1, ...) of a recipe and returns a Result. recipe: a recipe's
    name, with any hyperparameter of BASE overridden by a keyword (epochs=10, batch_size=768), or hyperparameters()
    already built.

    data: a .npz file (train_images and test_images (N, H, W, 3) uint8, integer train_labels and test_labels),
    a data folder (where `dataset`, cifar10 by default or cifar100, is downloaded and cached), an unpacked archive
    folder, or a dict of those four numpy arrays; None is the folder data/. The classes are the labels' (the
    largest + 1; a .npz given with `dataset` is checked as that dataset); the images are normalised by the training
    images' per-channel mean and std. device: "cuda", "cpu", "mps", ... (default cuda when there is a GPU). On an
    accelerator, or with `compile`, an untimed warm-up comes first (prepare). eval_every: evaluate every this many
    epochs (0: only the last); the last with the recipe's test-time augmentation, the others on the plain images.
    verbose prints the per-epoch table and each run's result on stdout; progress shows on stderr what takes long
    (loading, the warm-up and its compilation, a long epoch's steps, the final evaluation) and, on a CPU, an
    estimate of the time. on_run(Result so far) is called after every run, on_epoch(row) after every
    epoch. Under torchrun the command line passes its ctx, hook and bucket_mb.
    Bad arguments raise core.UsageError, bad data core.DataError, each with a one-line message.
    """
    if isinstance(recipe, str):
        hp = hyperparameters(recipe, **overrides)
    elif isinstance(recipe, Frozen) and not overrides:
        hp = recipe
    else:
        raise UsageError("train: give a recipe's name (and its overrides), or hyperparameters(name, **overrides)")
    check_run(runs, target, eval_every=eval_every)
    check_subset(subset)
    if dataset is not None and dataset not in cd.DATASETS:
        raise flag_error("dataset", dataset, f"must be one of {show_choices(tuple(cd.DATASETS))}")
    device = torch.device(ctx.device) if ctx else devices.resolve(device)
    ctx = ctx or D.Context(device=str(device))
    dtype = devices.compute_dtype(device, precision)
    say = print if verbose else lambda *a, **k: None
    with Heartbeat(f"loading {data or 'data'}", on=progress and not isinstance(data, dict)):
        arrays = cd.check_arrays(data, "data") if isinstance(data, dict) else cd.load(data or "data", dataset)
    stats = cd.channel_stats(arrays["train_images"])        # the whole training set's, whatever the subset
    check_subset(subset, len(arrays["train_labels"]))
    arrays = cd.take_subset(arrays, subset)
    check_data(hp, len(arrays["train_labels"]), arrays["train_images"].shape[1:3])
    classes, n_train, n_test = cd.num_classes(arrays), len(arrays["train_labels"]), len(arrays["test_labels"])
    empty = [c for c, n in enumerate(np.bincount(arrays["train_labels"], minlength=classes)) if n == 0]
    if empty:
        say(f"warning: {len(empty)} of the {classes} classes have no training image (labels "
            f"{', '.join(map(str, empty[:10]))}{', ...' if len(empty) > 10 else ''})", file=sys.stderr)
    try:
        batch = per_rank_batch(hp["batch_size"], ctx.world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    say(f"recipe {hp.recipe} on {devices.name(device)} ({device}, {str(dtype)[6:]}), {n_train} training and "
        f"{n_test} test images of {'x'.join(map(str, arrays['test_images'].shape[1:3]))} "
        f"pixels, {classes} classes" + (f", {ctx.world_size} ranks of {batch} images per step"
                                        if ctx.distributed else ""), flush=True)
    with strict_compile():
        return train_prepared(prepare(hp, arrays, device=device, dtype=dtype, ctx=ctx, stats=stats, compile=compile,
                                      hook=hook, bucket_mb=bucket_mb, progress=progress), runs=runs, seed=seed,
                              target=target, eval_every=eval_every, on_run=on_run, on_epoch=on_epoch, verbose=verbose,
                              progress=progress)


def strict_compile():
    """While inside, a compiled function past dynamo's limit of graphs stops the run (it would otherwise run eagerly
    from then on, silently, inside the timed runs)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def train_prepared(prepared, *, runs, seed, target, eval_every, on_run, on_epoch, verbose, progress):
    """train()'s runs of a Prepared recipe: its Result."""
    hp, device, n_test = prepared.hp, prepared.device, len(prepared.data["test_labels"])
    batch = hp["batch_size"] // prepared.ctx.world_size
    say = print if progress else lambda *a, **k: None

    def estimate(step_s):
        total = runs * estimated_run_s(hp, step_s, flops=prepared.flops, batch=batch,
                                       n_train=len(prepared.data["train_labels"]), n_test=n_test, eval_every=eval_every)
        epochs = hp["epochs"]
        say(f"estimated time: about {f'{total / 60:.0f} min' if total >= 90 else f'{total:.0f} s'} for {runs} "
            f"run{'s' * (runs > 1)} of {epochs:g} epoch{'s' * (epochs != 1)} on this CPU (from the first steps; an "
            "estimate)", file=sys.stderr, flush=True)

    results = []
    for r in range(runs):
        if verbose and runs > 1:
            print(f"run {r + 1}/{runs} (seed {seed + r})", flush=True)
        table = Table(COLUMNS, width=11, formats={"epoch_time": ".2f", "total_time": ".2f"},
                      file=None if verbose else io.StringIO())

        def epoch_done(row):
            table.append(row)
            if on_epoch:
                on_epoch(row)
        result = prepared.run(seed + r, target=target, eval_every=eval_every, on_epoch=epoch_done,
                              progress_after_s=PROGRESS_AFTER_S if progress else None,
                              on_first_steps=estimate if progress and devices.is_cpu(device) and r == 0 else None)
        model = result.pop("model")
        results.append(result)
        summary = summarize_runs(results, target, SUMMARY, "final_acc")
        summary.update(flops_per_run=prepared.flops["total"],
                       tflops_per_s=prepared.flops["total"] / summary["time"]["mean"] / 1e12)
        last = Result(model=model, rows=result["rows"], summary=summary, runs=list(results), hyperparameters=hp,
                      flops=prepared.flops)
        if on_run:
            on_run(last)
        if verbose:
            ttt = result["time_to_target"]
            print(f"final test accuracy {result['final_acc']:.4f}; "
                  + (f"time to {target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {target:.2%}")
                  + f"; training {result['train_time']:.2f} s + final evaluation {result['final_eval_time']:.2f} s",
                  flush=True)
    return last


def evaluate(model, images, labels, *, tta="none", tta_weights="airbench", stats=None, batch_size=1000):
    """{"loss", "accuracy"} of a trained network (Result.model) on images with test-time augmentation `tta` (none,
    flip or flip_translate; its views weighted as airbench's or "equal"ly). images: uint8 (N, H, W, 3) numpy arrays, normalised as in training (by the statistics
    train() keeps on the model, or stats = (mean, std)), or a tensor already normalised on the model's device."""
    if tta not in CHOICES["tta"]:
        raise flag_error("tta", tta, f"must be one of {show_choices(CHOICES['tta'])}")
    device = next(model.parameters()).device
    if isinstance(images, np.ndarray):
        stats = stats or getattr(model, "normalisation", None)
        if stats is None:
            raise UsageError("evaluate: give stats=(mean, std), the training images' (a network train() returned "
                             "keeps them)")
        images = cd.normalise(images, device, dtype=torch.float32, stats=stats)
    labels = torch.as_tensor(labels, device=device).long()
    loss, accuracy = tb.evaluate(model, images, labels, tta=tta, tta_weights=tta_weights, batch_size=batch_size,
                                 dtype=devices.compute_dtype(device), memory_format=devices.memory_format(device))
    return {"loss": loss, "accuracy": accuracy}


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="myrtle24", help="recipe name (default myrtle24; see --list-recipes)")
    p.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    p.add_argument("--dataset", default=None, type=one_of(tuple(cd.DATASETS), str), choices=tuple(cd.DATASETS),
                   help="what a data folder holds, downloaded there if missing (default cifar10); for a .npz, that it "
                        "is that dataset, checked as such (without it, a .npz is your own data)")
    p.add_argument("--data-dir", default="data",
                   help="data folder (downloads and caches the dataset there), an unpacked archive folder, or a .npz "
                        "(train_images, train_labels, test_images, test_labels: any images (N, H, W, 3) uint8)")
    p.add_argument("--subset", type=int, default=None, help="train on the first N training images")
    p.add_argument("--target", type=float, default=0.94, help="test accuracy whose first epoch stops the clock")
    p.add_argument("--out", default=None, help="write config, environment, per-epoch rows and summary as JSON")
    p.add_argument("--compile", default=None, choices=["default", "max-autotune", "reduce-overhead"],
                   help="torch.compile the network with this mode (compiled once, in the untimed warm-up); "
                        "reduce-overhead also captures CUDA graphs")
    add_shared_flags(p, BASE, CHOICES)
    args = p.parse_args(argv)
    return args, overrides_from(args, BASE)


def main(argv=None):
    args, overrides = parse_args(argv)
    if args.list_recipes:
        width = max(map(len, RECIPES))
        for name, r in RECIPES.items():
            print(f"{name:{width}s} {r['doc']}")
        return 0
    try:            # every flag, before any data is loaded (what depends on the data: in train(), before training)
        hp = hyperparameters(args.recipe, **overrides)
        check_subset(args.subset)
        check_run(args.runs, args.target, device=args.device, out=args.out, eval_every=args.eval_every)
    except UsageError as e:
        D.print0(f"error: {e}", file=sys.stderr)
        return 2
    return run_in_ranks(args, hp, lambda ctx, hook: run(args, hp, ctx=ctx, hook=hook, argv=argv))


def run(args, hp, *, ctx, hook, argv):
    """main's work once this process has its place: train, print the summary, write --out; the exit status."""
    device, main_rank = torch.device(ctx.device), ctx.is_main
    if devices.is_cpu(device) and main_rank:
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration, "
              "shrink the work with --subset, --epochs and --width", file=sys.stderr)
    where = {"run": 1, "epoch": 1, "finished": 0}           # for the line Ctrl-C leaves

    def save(result, complete):
        """--out after every run, so that a run cut short, or a failure later, never loses the finished runs."""
        if args.out and main_rank:
            write_json(args.out, run_record({
                "recipe": args.recipe, "hyperparameters": hp, "target": args.target, "subset": args.subset,
                "dataset": args.dataset, "compile": args.compile, "flops": result.flops, "complete": complete,
                "runs": result.runs, "summary": result.summary}, args, argv=argv, device=device, ctx=ctx))

    def epoch_done(row):
        where["epoch"] = row["epoch"] + 1

    def run_done(result):
        where.update(run=len(result.runs) + 1, epoch=1, finished=len(result.runs))
        save(result, False)
    try:
        result = train(hp, args.data_dir, device=device, runs=args.runs, seed=args.seed, target=args.target,
                       compile=args.compile, verbose=main_rank, progress=main_rank and not args.quiet,
                       dataset=args.dataset, subset=args.subset,
                       precision=args.precision, eval_every=args.eval_every, on_run=run_done, on_epoch=epoch_done,
                       ctx=ctx, hook=hook, bucket_mb=args.bucket_mb)
    except (UsageError, DataError) as e:
        D.print0(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        D.print0(interrupted(where["epoch"], where["run"], where["finished"], out=args.out), file=sys.stderr)
        return 130
    if args.runs > 1 and main_rank:
        print_summary(args.recipe, result.summary, args.target, {
            "final_acc": ("final test accuracy", ""), "time": ("time (training + final evaluation)", " s"),
            "time_to_target": (f"time to {args.target:.2%}", " s")})
    save(result, True)
    if args.out and main_rank:
        print(f"wrote {args.out}")
    D.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
