"""Train a ResNet on CIFAR-10 to 94% and report the time it took.

    python cifar10_fast.py                          # myrtle24: Myrtle's DAWNBench ResNet-9
    python cifar10_fast.py --recipe fast94 --runs 10 --out results.json
    python cifar10_fast.py --list-recipes
    python cifar10_fast.py --device cpu --subset 5000 --epochs 2 --width 0.25   # a CPU demonstration

A recipe is a small typed tree (Recipe below): each technique's settings in its component, present or absent. The
headline recipes (myrtle24, fast94, fast94_next) are written out whole, the others as their differences; any setting
is also a flag named after it (--batch-size 768, --whiten-eps 1e-3, --lookahead-momentum 0). train_run is one run,
every trick at the line where it acts.
"""
import argparse
import io
import math
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

import cifar_data as cd
import devices
import distributed as D
import torch_backend as tb
import training as T
from cli import add_run_flags, check_run, interrupted, join_ranks, lost_peer, phase_of, run_record
from core import (DataError, Heartbeat, Parser, Progress, Table, UsageError, close_progress, end_torchrun,
                  exit_now, print_summary, summarize_runs, write_json)
from optim import make_optimizers, set_lr
from schedules import per_rank_batch
from settings import (add_flags, as_flags, changed, changes_from, check, command_text, component, flag_error, knob,
                      numbers, one_of, part)

ACTIVATIONS = tuple(tb.ACTIVATIONS)
MAX_EPOCHS = 1000         # beyond it a typo (--epochs 1e12), not a run: its rate would round to 0 at every step

# ---------------------------------------------------------------------------------------------
# The settings: one component per technique
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Network:
    """The network (torch_backend.py): Myrtle's ResNet-9 and ResNet-18, or the three-block fastnet (Jordan 2024)."""
    PREFIX = ""
    model: str = knob("resnet9", choices=tuple(tb.MODELS))
    width: float = knob(1.0, above=0, doc="every layer's channels x this")
    block_widths: tuple = numbers((64, 256, 256), above=0, whole=True, doc="fastnet's three blocks' channels")
    block_depth: int = knob(2, choices=(2, 3), doc="fastnet's convolutions per block (3: airbench96's residual)")
    act: str = knob("relu", choices=ACTIVATIONS)
    celu_alpha: float = knob(0.3, above=0)
    pool_first: bool = knob(False, doc="max-pool before batch norm (Myrtle): the same maths on 4x fewer pixels")
    dirac_init: bool = knob(False, doc="convolutions start as the identity (Jordan 2024)")
    output_scale: float = knob(0.125, above=0, doc="the logits x this")
    head_unit_std: bool = knob(False, doc="the head's weights start at unit std, the logits / its width "
                                          "(airbench94_muon)")


@dataclass(frozen=True, kw_only=True)
class BatchNorm:
    """Batch norm, with two of Myrtle's tricks: ghost batches and frozen scales."""
    PREFIX = "bn"
    momentum: float = knob(0.1, low=0, high=1, doc="PyTorch's convention: the new batch's weight")
    eps: float = knob(1e-5, above=0)
    ghost_batch: int = knob(0, low=0, whole=True, doc="statistics over groups of this many images (0: the batch)")
    freeze_scale: bool = knob(False, doc="the scales stay 1; only the biases learn")


@dataclass(frozen=True)
class WhiteningFit:
    """How a reference fits the whitening: its first `images` training images' patches, their covariance centred or
    not and divided by n - ddof, its eigenvectors from eigh or an SVD (the same, up to sign)."""
    name: str
    images: int
    centre: bool
    ddof: int
    decomp: str


FITS = {f.name: f for f in (WhiteningFit("myrtle", 10000, True, 1, "eigh"),       # Myrtle, bag_of_tricks.ipynb
                            WhiteningFit("airbench94", 5000, False, 0, "eigh"),   # airbench94.py
                            WhiteningFit("record", 960, False, 0, "svd"))}        # the record's cifar10_speedrun.py


@dataclass(frozen=True, kw_only=True)
class WhiteningBias:
    """The whitening layer's bias: trained for its first `epochs`, then detached (airbench94_muon)."""
    PREFIX = "bias"
    epochs: float = knob(3.0, low=0)
    lr_mult: float = knob(1.0, low=0, doc="its rate: the schedule's x this")
    init: str = knob("zero", choices=("zero", "default"), doc="default: the convolution's own (airbench94_muon)")
    decay: str = knob("none", choices=("none", "linear"), doc="linear: from its peak to 0 over its epochs")


@dataclass(frozen=True, kw_only=True)
class Whitening:
    """Patch whitening (Myrtle 2018): a frozen first convolution whose filters whiten the training images' size x
    size patches, fitted at the start of each run, inside its clock."""
    PREFIX = "whiten"
    size: int = knob(3, above=0, whole=True)
    pad: int = knob(1, low=0, whole=True)
    both_signs: bool = knob(False, doc="each filter and its negative (Jordan 2024)")
    eps: float = knob(1e-2, low=0, doc="added to each eigenvalue")
    act: str = knob("", choices=("",) + ACTIVATIONS, doc="the activation after it ('': the network's)")
    fit: WhiteningFit = knob(FITS["myrtle"], choices=FITS)
    bias: WhiteningBias = component(WhiteningBias)


@dataclass(frozen=True, kw_only=True)
class LR:
    """The learning rate over the run: linear between knots (fractions of the run) and values (in the units of
    SGD.lr_units); --epochs stretches it with the run."""
    PREFIX = "lr"
    knots: tuple = knob((0, 5 / 24, 1), low=0, high=1)
    values: tuple = knob((0.0, 0.4, 0.0), low=0)

    def check(self):
        if len(self.knots) != len(self.values):
            raise UsageError(f"--lr-knots and --lr-values: must have the same length (here {len(self.knots)} and "
                             f"{len(self.values)})")
        if any(b < a for a, b in zip(self.knots, self.knots[1:])):
            raise flag_error("lr_knots", self.knots, "must not decrease")

    def at(self, t):
        """The rate at t, a fraction of the run: linear between the knots, constant beyond the ends."""
        k, v = self.knots, self.values
        i = next((i for i in range(len(k)) if t <= k[i]), None)
        if i is None or i == 0 or k[i] == k[i - 1]:
            return float(v[-1] if i is None else v[i])
        return float(v[i - 1] + (t - k[i - 1]) / (k[i] - k[i - 1]) * (v[i] - v[i - 1]))


@dataclass(frozen=True, kw_only=True)
class SGD:
    """Momentum SGD on the batch-summed loss (optim.make_optimizers), in one of three units of rate and decay."""
    PREFIX = ""
    lr_units: str = knob("myrtle", choices=("myrtle", "decoupled", "sum"), doc="myrtle: per image; decoupled: per "
                         "1024 images over the Nesterov gain (Jordan 2024); sum: torch's (airbench94_muon)")
    momentum: float = knob(0.9, low=0, high=1)
    nesterov: bool = knob(True)
    weight_decay: float = knob(5e-4, low=0)
    bias_lr_mult: float = knob(1.0, low=0, doc="batch norm's biases learn at this times the rate")
    compile_optimizer: bool = knob(False, doc="SGD's and Muon's steps as one function of foreach operations, the "
                                   "rates 0-d tensors (optim.SGDAndMuon), compiled on CUDA")


@dataclass(frozen=True, kw_only=True)
class Muon:
    """Muon (Jordan et al. 2024) for the convolutions' filters: momentum orthogonalised by Newton-Schulz."""
    PREFIX = "muon"
    lr: float = knob(0.24, low=0, doc="at the schedule's peak")
    momentum: float = knob(0.6, low=0, high=1)
    ns_steps: int = knob(3, low=0, whole=True)
    ns_coeffs: tuple = numbers((3.4445, -4.7750, 2.0315), doc="Newton-Schulz's a, b, c: X <- aX + bAX + "
                            "cA²X, A = XXᵀ")
    renorm_every: tuple = numbers((1, 1), low=0, whole=True, doc="every k steps, k growing from the first to the "
                               "second over the run, the filters back to their norm (0: never)")
    weight_decay: float = knob(0.0, low=0, doc="decoupled, per image")
    momentum_dtype: str = knob("fp32", choices=("fp32", "fp16", "bf16"))
    batched: bool = knob(False, doc="every filter bank in one Newton-Schulz call (the record)")
    foreach: bool = knob(True, doc="momentum, update, renormalisation and decay as foreach operations over the "
                                    "banks: the same numbers in a few launches")


@dataclass(frozen=True, kw_only=True)
class Augment:
    """Each epoch's augmentation, drawn for all images at once (cifar_data.py), and low-resolution first epochs."""
    PREFIX = ""
    crop_pad: int = knob(4, low=0, whole=True, doc="random crops of the images padded by this")
    flip: str = knob("random", choices=("none", "random", "alternate"), doc="alternate: each image both ways in "
                     "any two epochs (Jordan 2024)")
    cutout: int = knob(8, low=0, whole=True, doc="a square of this side set to 0")
    jitter_brightness: float = knob(0.0, low=0, doc="+- this, per image (the record)")
    jitter_contrast: float = knob(0.0, low=0, doc="x 1 +- this, per image (the record)")
    low_res: int = knob(0, low=0, whole=True, doc="the first low_res_epochs at this resolution (0: none)")
    low_res_epochs: float = knob(0.0, low=0)


@dataclass(frozen=True, kw_only=True)
class TTA:
    """Test-time augmentation of the final evaluation: the views of every image, or (fraction < 1, the record's
    selective TTA) of the images the plain pass is least sure of."""
    PREFIX = "tta"
    OFF = ("views", "none")
    views: str = knob("flip", choices=("none", "flip", "flip_translate"), flag="tta")
    fraction: float = knob(1.0, above=0, high=1)
    weights: str = knob("airbench", choices=("airbench", "equal"), doc="airbench: the image and its mirror count "
                        "twice the shifted views; equal: their mean (the record)")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a run computes. Settings left out (None) are techniques the recipe does not use."""
    name: str = "custom"
    doc: str = ""
    epochs: float = knob(24, above=0, high=MAX_EPOCHS, doc="fractional: the last epoch cut short")
    batch_size: int = knob(512, above=0, whole=True)
    label_smoothing: float = knob(0.0, low=0, high=1)
    network: Network = part(Network())
    batch_norm: BatchNorm = part(BatchNorm())
    whitening: Whitening = component(Whitening)
    lr: LR = part(LR())
    sgd: SGD = part(SGD())
    muon: Muon = component(Muon)
    augment: Augment = part(Augment())
    tta: TTA = component(TTA)
    ema: T.EMA = component(T.EMA)
    lookahead: T.Lookahead = component(T.Lookahead)
    compile_step: bool = knob(False, doc="with --compile: the forward and the loss compiled as one function")

    def check(self):
        if self.ema and self.lookahead:
            raise UsageError("--ema-momentum and --lookahead-momentum: one weight average at a time; set the other "
                             "to 0")


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------

# "How to train your ResNet" part 4, Myrtle's DAWNBench entry (published: 94% in 79 s on a V100).
MYRTLE24 = Recipe(
    name="myrtle24", doc="Myrtle's DAWNBench ResNet-9: 24 epochs, batch 512, cutout 8x8 (published: 94% in 79 s on a "
                         "V100)",
    epochs=24, batch_size=512, label_smoothing=0.0,
    network=Network(model="resnet9", act="relu", output_scale=0.125),
    batch_norm=BatchNorm(momentum=0.1, eps=1e-5),
    lr=LR(knots=(0, 5 / 24, 1), values=(0.0, 0.4, 0.0)),
    sgd=SGD(lr_units="myrtle", momentum=0.9, nesterov=True, weight_decay=5e-4),
    augment=Augment(crop_pad=4, flip="random", cutout=8))

# Part 8, the bag of tricks' final run (published: 94.1% in 26 s on a V100).
MYRTLE10 = replace(
    MYRTLE24, name="myrtle10", doc="Myrtle's bag-of-tricks ResNet-9: 10 epochs, CELU, ghost BN, frozen BN scales, "
                                   "whitening, EMA, flip TTA (published: 94.1% in 26 s on a V100)",
    epochs=10, label_smoothing=0.2,
    network=replace(MYRTLE24.network, act="celu", celu_alpha=0.3, pool_first=True, output_scale=1 / 16),
    batch_norm=replace(MYRTLE24.batch_norm, ghost_batch=32, freeze_scale=True),
    whitening=Whitening(),
    lr=LR(knots=(0, 0.2, 0.8), values=(0.0, 1.0, 0.1)), sgd=replace(MYRTLE24.sgd, bias_lr_mult=64.0),
    augment=replace(MYRTLE24.augment, cutout=0), tta=TTA(views="flip"), ema=T.EMA(momentum=0.99, every=5))

# The journey (Myrtle.ai, 2018-19), each stage the one before plus `changes` (flag names), with Myrtle's numbers from
# their experiments.ipynb (parts 1-4) and bag_of_tricks.ipynb (part 8) and their published V100 training time. Two
# steps were loader and kernel fixes our loader has built in ("same"): kept, so the table lines up with theirs.
JOURNEY = [
    dict(name="baseline_resnet18", published_v100_s=297,
         doc="Myrtle's ResNet-18 (pre-activation, 64/128/256/256 channels, max+average pool), 35 epochs, batch 128, "
             "crop+flip, lr 0.1 peak at epoch 15",
         changes=dict(model="resnet18", epochs=35, batch_size=128, lr_knots=(0, 15 / 35, 30 / 35, 1),
                      lr_values=(0.0, 0.1, 0.005, 0.0), cutout=0, output_scale=1.0)),
    dict(name="batch512", published_v100_s=256, doc="batch 512, lr peak 0.44",
         changes=dict(batch_size=512, lr_values=(0.0, 0.44, 0.005, 0.0))),
    dict(name="faster_bn", published_v100_s=186, changes=dict(),
         doc="same as batch512: Myrtle's step kept batch norm out of a slow fp16 path; ours keeps batch "
             "norm's parameters and statistics in float32 on every device"),
    dict(name="cutout30", published_v100_s=161, doc="cutout 8x8, 30 epochs, lr peak 0.4 at epoch 8",
         changes=dict(cutout=8, epochs=30, lr_knots=(0, 8 / 30, 1), lr_values=(0.0, 0.4, 0.0))),
    dict(name="cutout30_bs768", published_v100_s=154, doc="batch 768, lr peak 0.6",
         changes=dict(batch_size=768, lr_values=(0.0, 0.6, 0.0))),
    dict(name="resnet9_24", published_v100_s=79,
         doc="Myrtle's ResNet-9, 24 epochs, batch 512, lr peak 0.4 at epoch 5, logits x 1/8 (= myrtle24)",
         changes=dict(model="resnet9", epochs=24, batch_size=512, lr_knots=(0, 5 / 24, 1),
                      lr_values=(0.0, 0.4, 0.0), output_scale=0.125)),
    dict(name="gpu_aug", published_v100_s=70, changes=dict(),
         doc="same as resnet9_24: Myrtle's step moved preprocessing and augmentation to the GPU; ours always runs there"),
    dict(name="maxpool_pre", published_v100_s=64,
         doc="max-pool before batch norm (4x fewer pixels to normalise), 25 epochs to win back the accuracy",
         changes=dict(pool_first=True, epochs=25, lr_knots=(0, 0.2, 1))),
    dict(name="label_smoothing", published_v100_s=59, doc="label smoothing 0.2, 23 epochs",
         changes=dict(label_smoothing=0.2, epochs=23)),
    dict(name="celu", published_v100_s=52, doc="CELU(0.075) instead of ReLU, 20 epochs",
         changes=dict(act="celu", celu_alpha=0.075, epochs=20)),
    dict(name="ghost_bn", published_v100_s=46, doc="ghost batch norm (groups of 32), 18 epochs, lr peak 0.6",
         changes=dict(bn_ghost_batch=32, epochs=18, lr_values=(0.0, 0.6, 0.0))),
    dict(name="frozen_bn_scale", published_v100_s=43,
         doc="batch-norm scales frozen at 1, CELU(0.3), bias lr x64, logits x 1/16, 17 epochs",
         changes=dict(bn_freeze_scale=True, celu_alpha=0.3, bias_lr_mult=64.0, output_scale=1 / 16, epochs=17)),
    dict(name="whitening", published_v100_s=36, doc="frozen 3x3 patch-whitening input layer, 14 epochs, lr peak 1.0, "
                                                    "cutout 5x5",
         changes=dict(whiten=True, epochs=14, lr_values=(0.0, 1.0, 0.0), cutout=5)),
    dict(name="ema", published_v100_s=33.5,
         doc="EMA of the weights (0.99 every 5 steps), lr floored at 0.1 for the last 2 epochs, 13 epochs",
         changes=dict(ema_momentum=0.99, ema_every=5, epochs=13, lr_knots=(0, 0.2, 11 / 13), lr_values=(0.0, 1.0, 0.1))),
    dict(name="tta10", published_v100_s=26, doc="flip test-time augmentation, no cutout, 10 epochs (= myrtle10)",
         changes=dict(tta="flip", cutout=0, epochs=10, lr_knots=(0, 0.2, 0.8))),
]


def journey_recipes(steps):
    """The journey's recipes: each stage MYRTLE24 with its predecessors' changes and its own."""
    recipes, changes = {}, {}
    for i, step in enumerate(steps, 1):
        changes = {**changes, **step["changes"]}
        recipes[step["name"]] = replace(changed(MYRTLE24, **changes), name=step["name"],
                                        doc=f"journey {i}/{len(steps)}: {step['doc']} (published: "
                                            f"{step['published_v100_s']} s on a V100)")
    return recipes


# airbench94.py (Jordan 2024, "94% on CIFAR-10 in 3.29 seconds"; our implementation of its published settings):
# the three-block network, 2x2 whitening of both signs with a bias trained 3 epochs, lookahead, alternating flips,
# translate 2, 6-view TTA; rates per 1024 images over the Nesterov gain (published: 94% in 3.83 s on an A100).
FAST94 = Recipe(
    name="fast94", doc="3-block net, 2x2 whitening, dirac init, lookahead, alternating flip, 6-view TTA: 9.9 epochs at "
                       "batch 1024 (target 94%)",
    epochs=9.9, batch_size=1024, label_smoothing=0.2,
    network=Network(model="fastnet", block_widths=(64, 256, 256), block_depth=2, act="gelu", dirac_init=True,
                    output_scale=1 / 9),
    batch_norm=BatchNorm(momentum=0.4, eps=1e-12, freeze_scale=True),
    whitening=Whitening(size=2, pad=0, both_signs=True, eps=5e-4, fit=FITS["airbench94"], bias=WhiteningBias(epochs=3)),
    lr=LR(knots=(0, 0.23, 1), values=(0.2 * 11.5, 11.5, 0.07 * 11.5)),
    sgd=SGD(lr_units="decoupled", momentum=0.85, nesterov=True, weight_decay=0.0153, bias_lr_mult=64.0),
    augment=Augment(crop_pad=2, flip="alternate", cutout=0),
    tta=TTA(views="flip_translate", weights="airbench"),
    lookahead=T.Lookahead(momentum=0.95, every=5))

# airbench95 widens fast94; airbench96 (legacy/airbench96.py) widens it to 128/384/512 with a third convolution per
# block (the residual added before the last activation), translate 4, cutout 12, 37 epochs, lr 9 per 1024 warming up
# from 0.2x over the first 10% of the steps then linear to 0, weight decay 0.012, batch-norm momentum 0.1.
FAST95 = replace(FAST94, name="fast95", doc="fast94 widened to 128/384/384 for 15 epochs (target 95%)", epochs=15,
                 network=replace(FAST94.network, block_widths=(128, 384, 384)),
                 lr=LR(knots=(0, 0.23, 1), values=(0.2 * 10, 10.0, 0.07 * 10)))
FAST96 = replace(FAST94, name="fast96", doc="airbench96 (legacy/airbench96.py): 128/384/512, 3 convs per block with a "
                                            "residual, translate 4, cutout 12, 37 epochs (target 96%)",
                 epochs=37, network=replace(FAST94.network, block_widths=(128, 384, 512), block_depth=3),
                 batch_norm=replace(FAST94.batch_norm, momentum=0.1),
                 lr=LR(knots=(0, 0.1, 1), values=(0.2 * 9, 9.0, 0.0)), sgd=replace(FAST94.sgd, weight_decay=0.012),
                 augment=replace(FAST94.augment, crop_pad=4, cutout=12))

# airbench94_muon.py (published: 94.01% in 2.59 s on an A100): batch 2000, 8 epochs (200 steps), no lookahead, every
# rate linear from its peak to 0; Muon for the filters, SGD (torch's units) for the head (0.67) and the biases
# (0.053), weight decay 2e-6 x batch; the whitening bias from the convolution's initialisation, its rate falling to
# 0 over its 3 epochs; the head at unit std and the logits / its width.
FAST94_MUON = replace(
    FAST94, name="fast94_muon", doc="airbench94 with Muon (airbench94_muon.py): batch 2000, 8 epochs, Muon for the "
                                    "filters, no lookahead (target 94%)",
    epochs=8, batch_size=2000,
    network=replace(FAST94.network, head_unit_std=True, output_scale=1.0),
    whitening=replace(FAST94.whitening, bias=WhiteningBias(epochs=3, lr_mult=0.053 / 0.67, init="default",
                                                           decay="linear")),
    lr=LR(knots=(0, 1), values=(0.67, 0.0)),
    sgd=SGD(lr_units="sum", momentum=0.85, nesterov=True, weight_decay=2e-6, bias_lr_mult=0.053 / 0.67),
    muon=Muon(lr=0.24, momentum=0.6, ns_steps=3, renorm_every=(1, 1)), lookahead=None)

# The 2-second record (hiverge/cifar10-speedrun, cifar10_speedrun.py; published: 94.01% in 2.015 s on an A100). Ours
# differs in: bf16 autocast with float32 weights and batch norm, Newton-Schulz in bf16 (theirs: all in fp16), and no
# rescaling of the Newton-Schulz input before its normalisation (theirs divides it away again).
FAST94_NEXT = Recipe(
    name="fast94_next", doc="the 2-second record's configuration: batched Newton-Schulz, SiLU, jitter, selective TTA, "
                            "7.59 epochs at batch 1536 (target 94%)",
    epochs=7.59, batch_size=1536, label_smoothing=0.09,
    network=Network(model="fastnet", block_widths=(64, 256, 256), block_depth=2, act="silu", dirac_init=True,
                    output_scale=1.0, head_unit_std=True),
    batch_norm=BatchNorm(momentum=1 - 0.5566, eps=1e-12, freeze_scale=True),      # 0.5566 in their convention
    whitening=Whitening(size=2, pad=0, both_signs=True, eps=5e-4, act="gelu", fit=FITS["record"],
                        bias=WhiteningBias(epochs=0.19, lr_mult=0.0573 / 0.5415, init="default", decay="linear")),
    lr=LR(knots=(0, 1), values=(0.5415, 0.0)),
    sgd=SGD(lr_units="sum", momentum=0.825, nesterov=True, weight_decay=1.0418e-6, bias_lr_mult=0.0573 / 0.5415),
    muon=Muon(lr=0.205, momentum=0.655, ns_steps=3, ns_coeffs=(3.4576, -4.7391, 2.0843), renorm_every=(2, 17),
              weight_decay=1.0418e-6, momentum_dtype="fp16", batched=True),
    augment=Augment(crop_pad=2, flip="alternate", cutout=0, jitter_brightness=0.1399, jitter_contrast=0.1308),
    tta=TTA(views="flip_translate", fraction=0.25, weights="equal"),
    compile_step=True)

FAST94_NEXT_LOWRES = replace(FAST94_NEXT, name="fast94_next_lowres",
                             doc="fast94_next with its first 2 epochs at 24 px: an idea of ours, measured beside "
                                 "fast94_next before it joins it (target 94%)",
                             augment=replace(FAST94_NEXT.augment, low_res=24, low_res_epochs=2))

# Our fastest 94% attempt: fast94_next_lowres with 0.3 epochs more at 32 px, which win back the low-resolution epochs'
# accuracy (94.07% +- 0.16 on the CPU, n = 13, at 0.242 PFLOP of training against fast94_next's 0.264). The switches
# that keep fast94_next's per-step losses join it as they land; each stays an ablation beside it (docs/perf-notes.md).
FAST94_FASTEST = replace(FAST94_NEXT_LOWRES, name="fast94_fastest",
                         doc="fast94_next_lowres for 7.89 epochs, the optimisers' step as one compiled function: our "
                             "lower-FLOP schedule (target 94%)", epochs=7.89,
                         sgd=replace(FAST94_NEXT_LOWRES.sgd, compile_optimizer=True))
# its ablations: each with one switch left out
FAST94_FASTEST_OPTIMIZERS_APART = replace(FAST94_FASTEST, name="fast94_fastest_optimizers_apart",
                                          doc="fast94_fastest with SGD and Muon stepping apart, as fast94_next's do",
                                          sgd=FAST94_NEXT_LOWRES.sgd)

RECIPES = {r.name: r for r in (MYRTLE24, MYRTLE10)}
RECIPES.update(journey_recipes(JOURNEY))
RECIPES.update({r.name: r for r in (FAST94, FAST95, FAST96, FAST94_MUON, FAST94_NEXT, FAST94_NEXT_LOWRES,
                                      FAST94_FASTEST_OPTIMIZERS_APART, FAST94_FASTEST)})


def recipe(name, **changes):
    """A recipe by name, with settings changed by flag name (width=0.25, whiten_eps=1e-3), checked: the one value a
    run passes down. A bad name or value is a UsageError of one line."""
    if name not in RECIPES:
        raise UsageError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    r = changed(RECIPES[name], **changes)
    check(r)
    return r


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

COLUMNS = ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time", "total_time"]


def train_run(r, built, o, *, ctx, seed, on_epoch=None):
    """One run of recipe r, Built once a process (its data on the device, the network re-initialised here), with
    Options o: {"seed", "rows", "final_acc", "train_time", "final_eval_time", "time", "time_to_target", "model",
    "recompiles", "eager_fallbacks"}."""
    data, net, forward = built.data, built.net, built.forward
    device, batch = torch.device(ctx.device), r.batch_size // ctx.world_size
    dtype = devices.compute_dtype(device, o.precision)
    steps_per_epoch, total_steps = T.run_steps(len(data["train_labels"]), batch, r.epochs)
    seeds = T.run_seeds(seed, ctx.rank)          # the network, the data's order and its augmentation: 3 streams
    torch.manual_seed(seeds["init"])
    order, augment = (devices.generator(device, seeds[k]) for k in ("order", "augment"))
    model = tb.build_model(r, device, memory_format=devices.memory_format(device),
                           num_classes=data.get("num_classes", 10))
    if net is not None:
        net.load_state_dict(model.state_dict())
        model = net
    step_with = forward if forward is not None else model
    # the whitening bias trains for its first epochs, then is detached (airbench94_muon)
    bias = tb.whitening_bias(model)
    bias_steps = T.epoch_steps(r.whitening.bias.epochs, steps_per_epoch) if bias is not None else 0
    opts = make_optimizers(model, r, steps_per_epoch, ctx.world_size, whitening_bias=bias, bias_steps=bias_steps)
    flip_base = cd.flip_bits(len(data["train_labels"]), augment, device) if r.augment.flip == "alternate" else None
    compiled_before = compile_counts()
    clock = devices.timer(device)                # starts once the network is built, as the references' does
    tb.fit_whitening(model, data.get("whiten_images", data["train_images"]), data["test_images"].shape[-2:])  # timed
    average = T.averaging(model, ema=r.ema, lookahead=r.lookahead)
    rows, pending, time_to_target, step, final_eval_time = [], [], None, 0, 0.0
    hint = f"the learning rate is the likely cause (--lr-values peaks at {max(r.lr.values):g})"
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        losses, correct, seen = torch.zeros((), device=device), torch.zeros((), device=device), 0
        bar = Progress(min(steps_per_epoch, total_steps - step), f"epoch {epoch + 1}", PROGRESS_AFTER_S) \
            if o.progress else None
        for x, y in cd.epoch_batches(data, r.augment, augment, order=order, epoch=epoch, flip_base=flip_base,
                                     batch_size=batch, memory_format=devices.memory_format(device)):
            lr = r.lr.at(step / total_steps)
            set_lr(opts, lr, step)
            if bias is not None and not ctx.distributed:        # DDP wants every gradient: its bias's rate goes to 0
                bias.requires_grad_(step < bias_steps)
            logits, loss = T.train_step(step_with, opts, x, y, label_smoothing=r.label_smoothing, dtype=dtype)
            step += 1
            if average:
                average.update(model, step, total_steps)
            losses += loss
            correct += (logits.argmax(1) == y).sum()
            seen += len(y)
            bar and bar.update()
            if step == total_steps:
                break
        bar and bar.close()
        if r.lookahead and step == total_steps:
            average.finish(model)                # lookahead: the slow weights end the run
        last = step == total_steps
        # the epoch's end as an event and its sums on the device, read where the host waits anyway
        pending.append({"epoch": epoch + 1, "lr": lr, "sums": torch.stack([losses, correct]), "seen": seen,
                        "mark": clock.mark(), "test_loss": None, "test_acc": None})
        if last or (o.eval_every and (epoch + 1) % o.eval_every == 0):
            evaluated = T.evaluated(model if ctx.distributed else step_with, average)
            with Heartbeat("final evaluation" if last else f"evaluation of epoch {epoch + 1}", on=o.progress):
                loss, acc = tb.evaluate(evaluated, data["test_images"], data["test_labels"], dtype=dtype,
                                        tta=r.tta if last else None, memory_format=devices.memory_format(device))
            pending[-1].update(test_loss=loss, test_acc=acc, eval_mark=clock.mark(include=False))
        if pending[-1]["test_acc"] is None and clock.reads_later:
            continue
        readings = clock.read()
        for row in epoch_rows(pending, readings):
            T.check_finite_loss(row["train_loss"], epoch=row["epoch"], hint=hint)
            rows.append(row)
            on_epoch and on_epoch(row)
        if "eval_mark" in pending[-1]:
            final_eval_time = readings[pending[-1]["eval_mark"]][0]
            if time_to_target is None and rows[-1]["test_acc"] >= o.target:
                time_to_target = rows[-1]["total_time"]
        pending = []
        if not last:
            clock.mark(include=False)            # the host's reading and printing, off the clock
    graphs, fallbacks = (now - before for now, before in zip(compile_counts(), compiled_before))
    return {"seed": seed, "rows": rows, "final_acc": rows[-1]["test_acc"], "train_time": clock.total,
            "final_eval_time": final_eval_time, "time": clock.total + final_eval_time, "time_to_target": time_to_target,
            "model": T.evaluated(model, average), "recompiles": graphs, "eager_fallbacks": fallbacks}


def epoch_rows(pending, readings):
    """The table's rows of the epochs `pending` holds: their sums read from the device in one copy, their times from
    the clock's readings (devices.EventTimer.read)."""
    sums = torch.stack([p["sums"] for p in pending]).tolist()
    return [{"epoch": p["epoch"], "lr": p["lr"], "train_loss": loss / p["seen"], "train_acc": correct / p["seen"],
             "test_loss": p["test_loss"], "test_acc": p["test_acc"], "epoch_time": readings[p["mark"]][0],
             "total_time": readings[p["mark"]][1]} for p, (loss, correct) in zip(pending, sums)]


def compile_counts():
    """(graphs torch.compile has made in this process so far, frames it gave up on and left to run eagerly):
    torch._dynamo's counts."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], counters["frames"]["total"] - counters["frames"]["ok"]


# ---------------------------------------------------------------------------------------------
# What a process builds once: the data on the device, the network compiled and warmed up
# ---------------------------------------------------------------------------------------------

def device_data(arrays, r, ctx, device, *, dtype, stats):
    """This process's dataset on the device, normalised by stats (the whole training set's): under torchrun its own
    contiguous shard of the training set. whiten_images are the images the whitening is fitted on, taken before
    sharding, so that every rank fits the filters one process would (frozen parameters, which DDP never syncs)."""
    part_of = D.shard(len(arrays["train_labels"]), ctx.rank, ctx.world_size)
    shard = {**arrays, "train_images": arrays["train_images"][part_of.start:part_of.stop],
             "train_labels": arrays["train_labels"][part_of.start:part_of.stop]}
    data = cd.to_device(shard, device, dtype=dtype, pad=r.augment.crop_pad, stats=stats)
    fit = r.whitening.fit.images if r.whitening else 0
    data["whiten_images"] = (cd.normalise(arrays["train_images"][:fit], device, dtype=dtype, stats=stats)
                             if ctx.distributed else data["train_images"])
    data["num_classes"] = cd.num_classes(arrays)
    return data


def network(r, device, *, compile_mode=None, ctx=None, num_classes=10):
    """(net, forward) built once a process, re-initialised by every run: forward is net in DDP under torchrun, and
    torch.compile'd with compile_mode (with r.compile_step, as WithLoss)."""
    distributed = ctx is not None and ctx.distributed
    net = tb.build_model(r, device, memory_format=devices.memory_format(device), num_classes=num_classes)
    forward = D.register_comm_hook(D.wrap_ddp(net, ctx, ctx.bucket_mb), ctx.hook) if distributed else net
    if compile_mode:
        if r.compile_step:
            forward = WithLoss(forward, r.label_smoothing)
        # dynamic=False: each shape (the low-resolution epochs) compiles a graph of its own, once, in the warm-up
        forward = torch.compile(forward, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
    return net, forward


class WithLoss(torch.nn.Module):
    """The network, and given labels also its summed loss: compiled (compile_step), the forward and the loss are one
    graph, and AOTAutograd compiles their backward as one graph with it. Called without labels it is the network."""
    takes_labels = True

    def __init__(self, net, label_smoothing):
        super().__init__()
        self.net, self.label_smoothing = net, label_smoothing

    def forward(self, x, y=None):
        logits = self.net(x)
        if y is None:
            return logits
        return logits, F.cross_entropy(devices.float32_or_wider(logits), y, label_smoothing=self.label_smoothing,
                                       reduction="sum")


def warmup(r, data, *, device, dtype, ctx, net=None, forward=None, calls=1):
    """Runs off the clock what a timed run meets (cuDNN autotuning, library loading, torch.compile, CUDA graphs): the
    whitening fit, `calls` steps at each training resolution and every evaluation (plain, TTA) `calls` times, with
    the whitening bias trained and detached (under torchrun never detached), on `net` or a throwaway network at a rate
    that moves nothing. calls: training.warmup_calls(the compile mode)."""
    memory_format = devices.memory_format(device)
    net = net if net is not None else tb.build_model(r, device, memory_format=memory_format,
                                                      num_classes=data.get("num_classes", 10))
    forward = net if forward is None else forward
    tb.fit_whitening(net, data.get("whiten_images", data["train_images"]), data["test_images"].shape[-2:])  # cuSOLVER
    bias = tb.whitening_bias(net)
    opts = make_optimizers(net, r, 1, ctx.world_size, whitening_bias=bias, bias_steps=1)
    set_lr(opts, 1e-9)
    gen = devices.generator(device, 0)  # a generator of its own: the runs' random streams stay as they were
    flip_base = cd.flip_bits(len(data["train_labels"]), gen, device)
    states = (True, False) if bias is not None and not ctx.distributed else (True,)
    for epoch in dict.fromkeys((0, r.augment.low_res_epochs if r.augment.low_res else 0)):    # each resolution
        for state in states:
            bias is None or bias.requires_grad_(state)
            for _ in range(calls):
                x, y = next(cd.epoch_batches(data, r.augment, gen, memory_format=memory_format, epoch=epoch,
                                             flip_base=flip_base, batch_size=r.batch_size // ctx.world_size))
                T.train_step(forward, opts, x, y, label_smoothing=r.label_smoothing, dtype=dtype)
    for state in states:
        bias is None or bias.requires_grad_(state)
        for tta in (None, r.tta):
            for _ in range(calls):
                tb.evaluate(net if ctx.distributed else forward, data["test_images"], data["test_labels"], tta=tta,
                            dtype=dtype, memory_format=memory_format)
    bias is None or bias.requires_grad_(True)
    devices.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The library: train() and evaluate(); the command line below is a thin layer over them
# ---------------------------------------------------------------------------------------------

SUMMARY = ("final_acc", "time", "train_time", "time_to_target")     # the results summarised over runs
PROGRESS_AFTER_S = 5.0          # an epoch that looks longer shows its steps on stderr


@dataclass(kw_only=True)
class Options(T.Options):
    """How train() runs a recipe (not what it computes): training.Options, and where, how many runs from which seed,
    compiled or not, the table and results on stdout (verbose); on_run(Result so far) follows every run,
    on_epoch(row) every epoch."""
    device: object = None
    runs: int = 1
    seed: int = 0
    compile: str = None
    verbose: bool = False
    on_run: object = None
    on_epoch: object = None


@dataclass(kw_only=True)
class Result:
    """What train() returns: the last run's trained network (the weights evaluated: the EMA's or lookahead's when
    the recipe averages), its per-epoch rows, the summary over all runs, every run's result and the recipe."""
    model: torch.nn.Module
    rows: list
    summary: dict
    runs: list
    recipe: Recipe
    flops: dict


def train(recipe_or_name, data=None, *, subset=None, dataset=None, ctx=None, **changes):
    """The Result of o.runs fresh networks of a recipe (a Recipe, or a name with settings by flag name), trained on
    data (a .npz, a data folder, an unpacked archive or a dict of the four arrays; docs/cifar10.md, Library use) with
    Options o from the keywords (runs=10, device="cpu", progress=True, on_epoch=print)."""
    o = Options(**{k: changes.pop(k) for k in list(changes) if k in Options.__dataclass_fields__})
    r, arrays, stats, ctx = loaded(recipe_or_name, data, o, subset=subset, dataset=dataset, ctx=ctx, changes=changes)
    device, results = torch.device(ctx.device), []
    with T.strict_compile(), devices.parameters_dtype(devices.compute_dtype(device, o.precision)):
        built = build(r, arrays, o, ctx=ctx, stats=stats)
        for k in range(o.runs):
            if o.verbose and o.runs > 1:
                print(f"run {k + 1}/{o.runs} (seed {o.seed + k})", flush=True)
            table = Table(COLUMNS, width=11, formats={"epoch_time": ".2f", "total_time": ".2f"},
                          file=None if o.verbose else io.StringIO())
            started = time.perf_counter()

            def epoch_done(row, first=k == 0):
                table.append(row)
                if first and row["epoch"] == 1 and o.progress and devices.is_cpu(device):
                    say_estimate(r, row["epoch_time"], runs=o.runs, n_train=len(arrays["train_labels"]))
                o.on_epoch and o.on_epoch(row)
            result = train_run(r, built, o, ctx=ctx, seed=o.seed + k, on_epoch=epoch_done)
            last = recorded(r, result, results, built=built, o=o, stats=stats, wall_s=time.perf_counter() - started)
            o.on_run and o.on_run(last)
    return last


def recorded(r, result, results, *, built, o, stats, wall_s):
    """The Result once `result` joins `results`: the summary over the runs so far, its FLOPs and network (which
    keeps the statistics it trained on, for evaluate()); with o.verbose, the run's line printed."""
    model = result.pop("model")
    model.normalisation = stats
    results.append({**result, "wall_s": wall_s})
    summary = summarize_runs(results, o.target, SUMMARY, "final_acc")
    flops = built.flops["total"]
    summary.update(flops_per_run=flops, tflops_per_s=flops / summary["time"]["mean"] / 1e12)
    if o.verbose:
        ttt = result["time_to_target"]
        print(f"final test accuracy {result['final_acc']:.4f}; "
              + (f"time to {o.target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {o.target:.2%}")
              + f"; training {result['train_time']:.2f} s + final evaluation {result['final_eval_time']:.2f} s",
              flush=True)
    return Result(model=model, rows=result["rows"], summary=summary, runs=list(results), recipe=r, flops=built.flops)


def loaded(recipe_or_name, data, o, *, subset, dataset, ctx, changes):
    """train()'s arguments checked and its data loaded: (the recipe, the four arrays of the subset, the whole training
    set's per-channel statistics, ctx)."""
    if isinstance(recipe_or_name, Recipe) and changes:
        raise UsageError("train: give a recipe's name with its changes, or a Recipe (recipe(name, **changes))")
    r = recipe_or_name if isinstance(recipe_or_name, Recipe) else recipe(recipe_or_name, **changes)
    check(r)
    check_run(o.runs, o.target, eval_every=o.eval_every)
    check_subset(subset)
    if dataset is not None and dataset not in cd.DATASETS:
        raise UsageError(f"--dataset {dataset}: must be one of {', '.join(cd.DATASETS)}")
    device = torch.device(ctx.device) if ctx else devices.resolve(o.device)
    ctx = ctx or D.Context(device=str(device))
    with Heartbeat(f"loading {data or 'data'}", on=o.progress and not isinstance(data, dict)):
        arrays = cd.check_arrays(data, "data") if isinstance(data, dict) else cd.load(data or "data", dataset)
    stats = cd.channel_stats(arrays["train_images"])        # the whole training set's, whatever the subset
    check_subset(subset, len(arrays["train_labels"]))
    arrays = cd.take_subset(arrays, subset)
    check_data(r, arrays, ctx, say=print if o.verbose else None)
    if o.verbose:
        print(f"recipe {r.name} on {devices.name(device)} ({device}, "
              f"{str(devices.compute_dtype(device, o.precision))[6:]}), {len(arrays['train_labels'])} training and "
              f"{len(arrays['test_labels'])} test images of {'x'.join(map(str, arrays['test_images'].shape[1:3]))} "
              f"pixels, {cd.num_classes(arrays)} classes"
              + (f", {ctx.world_size} ranks of {r.batch_size // ctx.world_size} images per step" if ctx.distributed
                 else ""), flush=True)
    return r, arrays, stats, ctx


@dataclass(kw_only=True)
class Built:
    """What a process builds once for a recipe: its data on the device (device_data, with the statistics it was
    normalised by), the network `net` and what a step calls (`forward`: net, or it compiled or in DDP; both None when
    each run builds a plain network of its own), and the FLOPs of a run (tb.count_flops)."""
    data: dict
    net: torch.nn.Module = None
    forward: object = None
    flops: dict = None


def build(r, arrays, o, *, ctx, stats=None):
    """Built for recipe r from the four arrays with Options o: the data on the device (normalised by stats, the
    training images' own by default), the FLOPs counted, the network compiled (o.compile) or in DDP (under
    torchrun); on an accelerator or with compile, the untimed warm-up done (inside T.strict_compile, for compile)."""
    device, stats = torch.device(ctx.device), stats or cd.channel_stats(arrays["train_images"])
    dtype = devices.compute_dtype(device, o.precision)
    data = {**device_data(arrays, r, ctx, device, dtype=dtype, stats=stats), "stats": stats}
    flops = tb.count_flops(r, {**data, "train_labels": torch.empty(len(arrays["train_labels"]))})
    net, forward = (network(r, device, compile_mode=o.compile, ctx=ctx, num_classes=data.get("num_classes", 10))
                    if o.compile or ctx.distributed else (None, None))      # otherwise each run builds its own
    if not devices.is_cpu(device) or o.compile:
        devices.autotune(device)
        what = "compiling every graph the runs meet (torch.compile)" if o.compile else "cuDNN's autotuning"
        with Heartbeat(f"warm-up: {what}", on=o.progress):
            warmup(r, data, device=device, dtype=dtype, ctx=ctx, net=net, forward=forward,
                   calls=T.warmup_calls(o.compile))
    return Built(data=data, net=net, forward=forward, flops=flops)


def say_estimate(r, epoch_s, *, runs, n_train):
    """On a CPU, after the first epoch: the time every run's training will take, from that epoch's (on stderr)."""
    steps_per_epoch, total_steps = T.run_steps(n_train, r.batch_size, r.epochs)
    total = runs * epoch_s * total_steps / steps_per_epoch
    print(f"estimated time: about {f'{total / 60:.0f} min' if total >= 90 else f'{total:.0f} s'} for {runs} run"
          f"{'s' * (runs > 1)} of {r.epochs:g} epoch{'s' * (r.epochs != 1)} on this CPU (from the first epoch, "
          "evaluations left out; an estimate)", file=sys.stderr, flush=True)


def evaluate(model, images, labels, *, tta=None, stats=None, batch_size=1000):
    """{"loss", "accuracy"} of a trained network (Result.model) on images, with test-time augmentation `tta` (a TTA,
    or None). images: uint8 (N, H, W, 3) numpy arrays, normalised as in training (by the statistics train() keeps on
    the model, or stats = (mean, std)), or a tensor already normalised on the model's device."""
    if tta is not None:
        check(tta)
    device = next(model.parameters()).device
    if isinstance(images, np.ndarray):
        stats = stats or getattr(model, "normalisation", None)
        if stats is None:
            raise UsageError("evaluate: give stats=(mean, std), the training images' (a network train() returned "
                             "keeps them)")
        images = cd.normalise(images, device, dtype=torch.float32, stats=stats)
    labels = torch.as_tensor(labels, device=device).long()
    loss, accuracy = tb.evaluate(model, images, labels, tta=tta, batch_size=batch_size,
                                 dtype=devices.compute_dtype(device), memory_format=devices.memory_format(device))
    return {"loss": loss, "accuracy": accuracy}


def check_subset(subset, n_train=None):
    """Raises UsageError unless --subset is positive (and, given the training images there are, at most that)."""
    if subset is not None and subset < 1:
        raise flag_error("subset", subset, "must be positive")
    if subset is not None and n_train is not None and subset > n_train:
        raise flag_error("subset", subset, f"larger than the {n_train} training images")


def check_data(r, arrays, ctx, say=None):
    """Raises UsageError for a setting the data rules out: the batch (for each rank), the crop, cutout, low resolution
    and network against the images' size. say: where a class with no training image is warned of."""
    n_train, (h, w) = len(arrays["train_labels"]), arrays["train_images"].shape[1:3]
    try:
        batch = per_rank_batch(r.batch_size, ctx.world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if batch * ctx.world_size > n_train:
        raise flag_error("batch_size", r.batch_size, f"larger than the {n_train} training images")
    if r.augment.crop_pad >= min(h, w):
        raise flag_error("crop_pad", r.augment.crop_pad, f"must be smaller than the {h}x{w} images")
    if r.augment.cutout > min(h, w):
        raise flag_error("cutout", r.augment.cutout, f"larger than the {h}x{w} images")
    if r.augment.low_res and h != w:
        raise flag_error("low_res", r.augment.low_res, f"needs square images, not {h}x{w}")
    if r.augment.low_res >= min(h, w):
        raise flag_error("low_res", r.augment.low_res, f"must be smaller than the {h}x{w} images")
    try:        # on the meta device: shapes only, no memory, no arithmetic
        tb.build_model(r, "meta")(torch.empty(2, 3, h, w, device="meta"))
    except RuntimeError:
        raise flag_error("model", r.network.model, f"{h}x{w} images are too small for this network") from None
    classes = cd.num_classes(arrays)
    empty = [c for c, n in enumerate(np.bincount(arrays["train_labels"], minlength=classes)) if n == 0]
    if empty and say:
        say(f"warning: {len(empty)} of the {classes} classes have no training image (labels "
            f"{', '.join(map(str, empty[:10]))}{', ...' if len(empty) > 10 else ''})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="myrtle24", help="recipe name (default myrtle24; see --list-recipes)")
    p.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    p.add_argument("--print-recipe", action="store_true",
                   help="print the recipe's every setting (with the flags given) as the command that trains it, and "
                        "exit")
    p.add_argument("--dataset", default=None, type=one_of(cd.DATASETS),
                   help="what a data folder holds, downloaded there if missing (default cifar10); for a .npz, that it "
                        f"is that dataset, checked as such (without it, a .npz is your own data) (one of "
                        f"{', '.join(cd.DATASETS)})")
    p.add_argument("--data-dir", default="data",
                   help="data folder (downloads and caches the dataset there), an unpacked archive folder, or a .npz "
                        "(train_images, train_labels, test_images, test_labels: any images (N, H, W, 3) uint8)")
    p.add_argument("--subset", type=int, default=None, help="train on the first N training images")
    p.add_argument("--target", type=float, default=0.94, help="test accuracy whose first epoch stops the clock")
    p.add_argument("--out", default=None, help="write the recipe, environment, per-epoch rows and summary as JSON")
    p.add_argument("--compile", default=None, choices=["default", "max-autotune", "reduce-overhead"],
                   help="torch.compile the network with this mode (compiled once, in the untimed warm-up); "
                        "reduce-overhead also captures CUDA graphs")
    add_run_flags(p, comm_hook=True)
    add_flags(p, Recipe, recipe=MYRTLE24)
    args = p.parse_args(argv)
    return args, changes_from(args, Recipe)


# what train() does before a run's first epoch, by function: what Ctrl-C stopped there
BEFORE_TRAINING = {"loaded": "loading the data", "build": "putting the data on the device and building the network",
                   "warmup": "warming up (cuDNN's autotuning, or torch.compile compiling)"}


def main(argv=None):
    """The command line: the recipe and every flag checked, this process's place among torchrun's ranks joined, the
    runs trained (train()), their summary printed and --out written after every run; the exit status."""
    args, changes = parse_args(argv)
    if args.list_recipes:
        width = max(map(len, RECIPES))
        print("\n".join(f"{name:{width}s} {r.doc}" for name, r in RECIPES.items()))
        return 0
    try:            # every flag, before any data is loaded (what depends on the data: in train(), before training)
        r = recipe(args.recipe, **changes)
        if args.print_recipe:
            print(f"# {r.name}: {r.doc}\n" + command_text(["python", "cifar10_fast.py", "--recipe", args.recipe],
                                                          as_flags(r)))
            return 0
        check_subset(args.subset)
        check_run(args.runs, args.target, device=args.device, out=args.out, eval_every=args.eval_every)
        ctx = join_ranks(args)
    except UsageError as e:
        D.print0(f"error: {e}", file=sys.stderr)
        end_torchrun()
        return 2
    device, where = torch.device(ctx.device), {"run": 1, "epoch": 1, "finished": 0}
    if devices.is_cpu(device) and ctx.is_main:
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration, "
              "shrink the work with --subset, --epochs and --width", file=sys.stderr)

    def save(result, complete):     # after every run: a run cut short, or a failure later, never loses the others
        if args.out and ctx.is_main:
            write_json(args.out, run_record({
                "recipe": r.name, "settings": r, "target": args.target, "subset": args.subset,
                "dataset": args.dataset, "compile": args.compile, "flops": result.flops, "complete": complete,
                "runs": result.runs, "summary": result.summary}, args, argv=argv, device=device, ctx=ctx))

    def run_done(result):
        where.update(run=len(result.runs) + 1, epoch=1, finished=len(result.runs))
        save(result, False)
    try:
        result = train(r, args.data_dir, subset=args.subset, dataset=args.dataset, ctx=ctx, on_run=run_done,
                       on_epoch=lambda row: where.update(epoch=row["epoch"] + 1), runs=args.runs,
                       seed=args.seed, target=args.target, eval_every=args.eval_every, precision=args.precision,
                       compile=args.compile, verbose=ctx.is_main, progress=ctx.is_main and not args.quiet)
        D.barrier()                 # leave together
    except (UsageError, DataError) as e:
        D.print0(f"error: {e}", file=sys.stderr)
        end_torchrun()
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt as e:
        close_progress()
        D.print0(interrupted(where["epoch"], where["run"], where["finished"], out=args.out,
                             during=phase_of(e, BEFORE_TRAINING)), file=sys.stderr)
        end_torchrun(others_wait=False)
        return 130
    except RuntimeError as e:
        return lost_peer(e, ctx)
    finally:
        D.leave(ctx)
    if args.runs > 1 and ctx.is_main:
        print_summary(r.name, result.summary, args.target, {
            "final_acc": ("final test accuracy", ""), "time": ("time (training + final evaluation)", " s"),
            "time_to_target": (f"time to {args.target:.2%}", " s")})
    save(result, True)
    if args.out and ctx.is_main:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    status = main()
    if status == 130:
        exit_now(status)        # Ctrl-C: at once, not seconds later (torch.compile's state finalised)
    sys.exit(status)
