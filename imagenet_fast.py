"""The CIFAR-10 speed-run loop at ImageNet scale, on one GPU or, under torchrun, on many.

    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in500            # JPEG, longer side <= 500
    python imagenet_fast.py train --store /data/in500 --recipe rn50_16ep --out rn50.json
    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in128 --format raw --size 128
    python imagenet_fast.py train --list-recipes
    python imagenet_fast.py train --store S --device cpu --recipe tiny --epochs 2       # CPU demo

`prepare` writes an ImageFolder tree (train/<class>/*, val/<class>/*) once, in worker processes, into a store that
`train` memory-maps (imagenet_store.py; docs/imagenet.md gives the format). `train` draws random-resized crops of
the whole image, decodes them on the GPU or in the CPU's worker processes, and augments them on the device
(imagenet_data.py). A recipe is a small typed tree (Recipe below); any setting is also a flag. This file holds the
models, the recipes, the training loop (train_run) and the command line.
"""
import argparse
import contextlib
import hashlib
import io
import json
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import devices
import distributed as D
import scaling
import training as T
from cli import add_run_flags, check_run, interrupted, join_ranks, lost_peer, phase_of, run_record
from core import (DataError, Heartbeat, Parser, Progress, Table, UsageError, check_output, close_progress,
                  end_torchrun, exit_now, print_summary, summarize_runs, write_json)
from imagenet_data import EpochWork, batch_indices, decode_text, draw_epoch, loss_top1_top5, place, train_batches
from imagenet_store import FORMATS, Settings, kept, open_store, prepare
from optim import LARS, RMSpropToSGD, param_groups_no_decay_1d, set_lr
from schedules import batch_for, phases, plan, res_at, step_lr
from settings import (add_flags, always_present, as_flags, changed, changes_from, check, command_text, component,
                      flag_error, flat, knob, numbers, one_of)

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class BlurPool(nn.Module):
    """A fixed 3x3 binomial low-pass filter, put before every strided convolution so that it subsamples a smoothed
    signal (anti-aliasing, Zhang 2019), as FFCV's ResNets build it: one depthwise convolution that pads with zeros,
    so a channels_last input stays channels_last (CUDA's reflection pad returns NCHW, forward and backward)."""

    def __init__(self, channels):
        super().__init__()
        k = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("kernel", (k[:, None] * k[None, :] / 16).expand(channels, 1, 3, 3).clone())

    def forward(self, x):
        return F.conv2d(x, self.kernel.to(x.dtype), padding=1, groups=x.shape[1])


def add_blurpool(model, min_channels=16):
    """Replaces each strided conv with >= min_channels inputs by BlurPool then that conv."""
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
                setattr(m, child_name, nn.Sequential(BlurPool(child.in_channels), child))
    return model


def resnet_tiny(num_classes, width, norm=nn.BatchNorm2d):
    """A 4-stage ResNet of torchvision BasicBlocks, one per stage, `width` channels in the first stage
    (torchvision's ResNets have fixed widths), batch norm of class `norm`: for tests and CPU demonstrations."""
    from torchvision.models.resnet import BasicBlock
    layers, c_in = [nn.Conv2d(3, width, 3, 1, 1, bias=False), norm(width), nn.ReLU(inplace=True)], width
    for i in range(4):
        c, stride = width * 2 ** i, 1 if i == 0 else 2
        down = None if stride == 1 else nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), norm(c))
        layers.append(BasicBlock(c_in, c, stride, down, norm_layer=norm))
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))


# Ours, not torch_backend.BatchNorm (CIFAR's): its groups interleave, which micro-batches cannot reproduce
class GhostBatchNorm(nn.BatchNorm2d):
    """Batch norm with training statistics from consecutive groups of `group` images (ghost batch norm, Hoffer et al.
    2017), so a micro-batch of whole groups is normalised as in the many-GPU batch it is part of; the running
    statistics move towards the groups' average. group 0, or the whole batch: plain batch norm."""
    group = 0

    def forward(self, x):
        n, g, c = len(x), self.group, x.shape[1]
        if not (self.training and 0 < g < n):
            return super().forward(x)
        xs = x.unflatten(0, (n // g, g))                            # a view in any memory format
        # the statistics in float32 (float64 in a float64 run): var_mean is not on autocast's float32 list, and in
        # bf16 it rounds each group's variance to 8 bits
        var, mean = torch.var_mean(devices.float32_or_wider(xs), (1, 3, 4), correction=0, keepdim=True)
        scale = self.weight.view(1, 1, c, 1, 1) * torch.rsqrt(var + self.eps)
        shift = self.bias.view(1, 1, c, 1, 1) - mean * scale
        with torch.no_grad():
            count = g * x.shape[2] * x.shape[3]
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean.mean(0).flatten(), self.momentum)
            self.running_var.lerp_(var.mean(0).flatten() * count / (count - 1), self.momentum)
        return torch.addcmul(shift.to(x.dtype), xs, scale.to(x.dtype)).flatten(0, 1)


def set_ghost_groups(model, group):
    """Every GhostBatchNorm of model normalises groups of `group` images from now on."""
    for m in model.modules():
        if isinstance(m, GhostBatchNorm):
            m.group = group


MAX_EPOCHS = 1000         # beyond it a typo, not a run (every epoch is planned before the first)
MODELS = ("resnet_tiny", "resnet18", "resnet34", "resnet50", "resnet101")


def build_model(r, num_classes):
    """The network of recipe r (its .network): torchvision's ResNet or resnet_tiny, with BlurPool if asked, and
    ghost batch norm (GhostBatchNorm) where the recipe reproduces a paper's per-GPU groups (bn_workers)."""
    net, norm = r.network, GhostBatchNorm if r.bn_workers else nn.BatchNorm2d
    if net.model == "resnet_tiny":
        model = resnet_tiny(num_classes, net.width, norm)
    else:
        model = getattr(torchvision.models, net.model)(num_classes=num_classes, zero_init_residual=net.zero_init,
                                                       norm_layer=norm)
    return add_blurpool(model) if net.blurpool else model


def make_optimizer(model, r):
    """Momentum SGD, LARS or RMSprop-to-SGD (optim.py) as the recipe says, at lr 0 until the schedule sets it;
    weight decay only on conv and linear weights (none on batch-norm scales and biases)."""
    groups, s = param_groups_no_decay_1d(model, r.sgd.weight_decay), r.sgd
    if r.lars:
        return LARS(groups, lr=0.0, momentum=s.momentum, trust_coefficient=r.lars.trust)
    if r.rmsprop:
        return RMSpropToSGD(groups, lr=0.0, lr_rmsprop=r.rmsprop.lr, momentum=s.momentum,
                            beta_center=r.rmsprop.beta_center, beta_period=r.rmsprop.beta_period)
    device = next(model.parameters()).device
    return torch.optim.SGD(groups, lr=0.0, momentum=s.momentum, nesterov=s.nesterov, **devices.sgd_options(device))


def saved_bytes_per_image(r, classes, res, dtype):
    """Bytes of activations a training step saves for backward, per image at res x res in dtype: autograd's saved
    tensors (parameters left out, each storage once) counted on the meta device, which holds no memory."""
    with torch.device("meta"):
        model = build_model(r, classes).to(dtype)
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


def memory_parts(r, classes, dtype):
    """(bytes a rank holds whatever its batch: float32 parameters, gradients, the optimiser's state and an EMA's copy;
    {resolution: saved_bytes_per_image} at each of the run's resolutions)."""
    with torch.device("meta"):
        params = sum(p.numel() * 4 for p in build_model(r, classes).parameters())
    copies = 2 + (2 if r.rmsprop else 1) + (r.ema is not None)
    return copies * params, {res: saved_bytes_per_image(r, classes, res, dtype) for res in
                             {res_at(r, e) for e in range(r.epochs)}}


def training_bytes(r, classes, *, world, dtype, parts=None):
    """The most device memory a rank's training needs in any epoch: memory_parts's fixed bytes, and that epoch's
    micro-batch of saved activations at its resolution (parts: memory_parts's, when known)."""
    fixed, per_image = parts or memory_parts(r, classes, dtype)
    return fixed + max(p.micro * per_image[p.res] for p in epoch_plans(r, world))


def check_memory(r, classes, *, device, world, dtype):
    """training_bytes of a rank, once it fits the device; a UsageError of one line otherwise, naming the smallest
    --accumulate that would fit (schedules permitting), or more GPUs."""
    parts = memory_parts(r, classes, dtype)
    training, free = training_bytes(r, classes, world=world, dtype=dtype, parts=parts), devices.free_memory(device)
    if free is None or training <= devices.USABLE * free:
        return training
    first = epoch_plans(r, world)[0]
    remedy = "use more GPUs (the batch is split over them)"
    for k in (k for k in range(r.accumulate + 1, first.batch + 1) if first.batch % k == 0):
        try:
            need = training_bytes(replace(r, accumulate=k), classes, world=world, dtype=dtype, parts=parts)
        except ValueError:              # k does not split every epoch's batch into whole groups
            continue
        if need <= devices.USABLE * free:
            remedy = f"add --accumulate {k} (micro-batches of {first.batch // k} images), or use more GPUs"
            break
    what = f"{first.batch} images per process" + (f" in micro-batches of {first.micro}" if r.accumulate > 1 else "")
    devices.check_training_fits(device, training, why=f"training {r.network.model} at {what}", remedy=remedy)


# ---------------------------------------------------------------------------------------------
# The settings
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Network:
    """torchvision's ResNets (resnet_tiny: ours, for tests and CPU demonstrations)."""
    PREFIX = ""
    model: str = knob("resnet50", choices=MODELS)
    width: int = knob(16, above=0, whole=True, doc="resnet_tiny's first stage's channels")
    blurpool: bool = knob(True, doc="a blur before each strided convolution (Zhang 2019; FFCV)")
    zero_init: bool = knob(False, doc="each residual block's last batch-norm scale starts at 0 (Goyal et al.)")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate per lr_scale_base images of the batch (Goyal et al.'s linear scaling) or as written: a linear
    warm-up from warmup_start of it, then linear to 0, cosine, x0.1 at each of step_epochs, or Akiba et al.'s slow
    start; or a phase table (schedules.Phase), which sets each phase's resolution, batch, rate, crops and validation."""
    PREFIX = ""
    lr: float = knob(0.10625, low=0)
    lr_scale_base: int = knob(256, above=0, whole=True)
    warmup_epochs: float = knob(2.0, low=0)
    warmup_start: float = knob(0.0, low=0, high=1)
    schedule: str = knob("linear", choices=("linear", "cosine", "step", "slow_start"))
    step_epochs: tuple = knob((30.0, 60.0, 80.0), low=0)
    lr_scaling: str = knob("linear", choices=("linear", "none"), doc="linear: lr is per --lr-scale-base images of the "
                           "global batch (Goyal et al.); none: lr is the optimiser's rate, whatever the batch and the "
                           "number of GPUs (FFCV's script, fast.ai's tables)")
    phases: tuple = knob((), low=0, doc="a phase table instead of the warm-up, decay, resolution and batch settings: "
                         "rows of start epoch, end epoch, res, global batch, lr at start, lr at end (linear between), "
                         "smallest crop scale, validation res (0: --val-res), rectangular validation (0 or 1), commas "
                         "between all (fast.ai's train.py)")


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """Each epoch's training resolution (FFCV's progressive resizing: min_res to max_res between two epochs, in
    steps of res_step) and batch (the global batch_size, larger at lower resolutions with batch_scale, or Mikami et
    al.'s batch-size control: (epoch, global batch) pairs)."""
    PREFIX = ""
    min_res: int = knob(160, above=0, whole=True)
    max_res: int = knob(192, above=0, whole=True)
    res_start_epoch: int = knob(11, low=0, whole=True)
    res_end_epoch: int = knob(13, low=0, whole=True)
    res_step: int = knob(32, above=0, whole=True)
    batch_scale: bool = knob(False)
    batch_schedule: tuple = knob((), low=0, whole=True)

    def check(self):
        if round(self.min_res / self.res_step) == 0:
            raise flag_error("res_step", self.res_step, f"rounds --min-res {self.min_res} to 0 pixels; use at most "
                                                        f"{self.min_res}")


@dataclass(frozen=True, kw_only=True)
class Augment:
    """torchvision's random-resized crops of the whole image (their area and aspect ratio ranges), a random flip,
    and brightness, contrast and saturation jitter of +- jitter."""
    PREFIX = ""
    crop_scale: tuple = numbers((0.08, 1.0), above=0, high=1)
    crop_ratio: tuple = numbers((3 / 4, 4 / 3), above=0)
    flip: bool = knob(True)
    jitter: float = knob(0.0, low=0)

    def check(self):
        if self.crop_scale[0] > self.crop_scale[-1] or len(self.crop_scale) != 2:
            raise flag_error("crop_scale", self.crop_scale, "must be two fractions, 0 < low <= high <= 1")
        if self.crop_ratio[0] > self.crop_ratio[-1] or len(self.crop_ratio) != 2:
            raise flag_error("crop_ratio", self.crop_ratio, "must be two aspect ratios, 0 < low <= high")


@dataclass(frozen=True, kw_only=True)
class Validation:
    """What validation sees (imagenet_data.val_view): the centre crop of side crop x the shorter side resized to res
    (crop 0: the whole image, shorter side res); tta flip adds each image's mirror."""
    PREFIX = "val"
    res: int = knob(256, above=0, whole=True)
    crop: float = knob(0.875, low=0, high=1)
    tta: str = knob("flip", choices=("none", "flip"), flag="tta")


@dataclass(frozen=True, kw_only=True)
class SGD:
    """Momentum SGD, with no weight decay on batch norm and biases, and label smoothing of the loss."""
    PREFIX = ""
    momentum: float = knob(0.9, low=0, high=1)
    nesterov: bool = knob(False)
    weight_decay: float = knob(1e-4, low=0)
    label_smoothing: float = knob(0.1, low=0, high=1)


@dataclass(frozen=True, kw_only=True)
class LARSSettings:
    """LARS (You et al. 2017) instead of SGD: each layer's step a fraction `trust` of its weights' norm."""
    PREFIX = "lars"
    trust: float = knob(0.001, low=0)


@dataclass(frozen=True, kw_only=True)
class RMSpropWarmup:
    """Akiba et al. 2017's RMSprop warm-up instead of plain SGD: RMSprop at rate lr handing over to momentum SGD,
    half done at epoch beta_center, over beta_period epochs (optim.RMSpropToSGD)."""
    PREFIX = "rmsprop"
    lr: float = knob(1e-3, low=0)
    beta_center: float = knob(10.0, low=0)
    beta_period: float = knob(5.0, above=0)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What an ImageNet run computes. Settings left out (None) are techniques the recipe does not use."""
    name: str = "custom"
    doc: str = ""
    notes: tuple = ()           # what a setting given changed in another, said before training
    epochs: int = knob(16, above=0, high=MAX_EPOCHS, whole=True)
    batch_size: int = knob(512, above=0, whole=True, doc="the global batch, split over the ranks (with "
                           "--per-gpu-batch true: each GPU's)")
    per_gpu_batch: bool = knob(False, doc="--batch-size is each GPU's batch, so the global batch grows with the GPUs "
                               "(FFCV's rn50 and rn18 configurations: 512 and 1024 images per GPU)")
    accumulate: int = knob(1, above=0, whole=True, doc="micro-batches per step on each rank, their gradients added "
                           "before one update (DDP's all-reduce on the last alone): a batch that does not fit in one "
                           "pass, with the same update")
    bn_workers: int = knob(0, low=0, whole=True, doc="batch norm over groups of global batch / bn_workers images: the "
                           "per-GPU batch of a paper's bn_workers GPUs, whatever the GPUs here (ghost batch norm); "
                           "0: over each micro-batch")
    network: Network = always_present(Network())
    schedule: Schedule = always_present(Schedule())
    resolution: Resolution = always_present(Resolution())
    augment: Augment = always_present(Augment())
    validation: Validation = always_present(Validation())
    sgd: SGD = always_present(SGD())
    lars: LARSSettings = component(LARSSettings)
    rmsprop: RMSpropWarmup = component(RMSpropWarmup)
    ema: T.EMA = component(T.EMA)
    lookahead: T.Lookahead = component(T.Lookahead)
    target_top5: float = knob(0.0, low=0, high=1, doc="the top-5 accuracy whose first epoch stops the clock, instead "
                              "of --target's top-1 (fast.ai: 0.93); 0: none")
    bn_stats: str = knob("running", choices=("running", "last_batch"), doc="last_batch: the last batch's statistics "
                         "averaged over the ranks before each evaluation (Akiba et al.)")
    comm_hook: str = knob("none", choices=D.HOOKS, doc="under torchrun: how gradients travel (fp16, bf16: "
                          "compressed; torus: a 2D torus, Mikami et al.)")

    def check(self):
        if self.lars and self.rmsprop:
            raise UsageError("--lars and --rmsprop: one optimiser at a time")
        if self.ema and self.lookahead:
            raise UsageError("--ema-momentum and --lookahead-momentum: one weight average at a time")
        table = self.schedule.phases
        try:
            if table and phases(table)[-1].end != self.epochs:
                raise ValueError(f"ends at epoch {phases(table)[-1].end}, the run at {self.epochs}")
        except ValueError as e:
            raise flag_error("phases", table, str(e)) from None
        try:
            for e in range(self.epochs):
                batch_for(self, e)        # a bad batch schedule fails here, not mid-run
        except ValueError as e:
            raise flag_error("batch_schedule", self.resolution.batch_schedule, str(e)) from None


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------

# FFCV's rn50 configurations (libffcv/ffcv-imagenet rn50_configs/, train_imagenet.py): ResNet-50 with BlurPool, 512
# images per GPU at lr 1.7 (their 8 GPUs: 4,096 a step), which their script applies whatever the number of GPUs,
# from 1e-4 of it up to it at epoch 2 and linearly to 0, label smoothing 0.1, res 160 -> 192, validation at 256 with
# flip TTA (published: 73.8% top-1 in 14.9 min on 8 A100s).
RN50_16EP = Recipe(
    name="rn50_16ep", doc="ResNet-50, 16 epochs, res 160->192, 512 images per GPU at lr 1.7 (published by FFCV: 73.8% "
                          "top-1 in 14.9 min on 8 A100s)",
    epochs=16, batch_size=512, per_gpu_batch=True,
    network=Network(model="resnet50", blurpool=True),
    schedule=Schedule(lr=1.7, lr_scaling="none", warmup_epochs=2.0, warmup_start=1e-4, schedule="linear"),
    resolution=Resolution(min_res=160, max_res=192, res_start_epoch=11, res_end_epoch=13, res_step=32),
    augment=Augment(crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), flip=True),
    validation=Validation(res=256, crop=0.875, tta="flip"),
    sgd=SGD(momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.1))


def ffcv(name, doc, *, epochs, res_start, res_end, **changes):
    """An FFCV configuration: rn50_16ep stretched to `epochs` with its resolution ramp between res_start and
    res_end, and changes (rn18's network, batch, rate and decay)."""
    return replace(RN50_16EP, name=name, doc=doc, epochs=epochs, **changes,
                   resolution=replace(RN50_16EP.resolution, res_start_epoch=res_start, res_end_epoch=res_end))


RN18 = dict(network=Network(model="resnet18", blurpool=True), batch_size=1024,      # rn18: lr 0.5 for 1 GPU x 1024
            schedule=replace(RN50_16EP.schedule, lr=0.5), sgd=replace(RN50_16EP.sgd, weight_decay=5e-5))

# The cluster papers: torchvision's ResNet-50 (no BlurPool) for 90 epochs at 224 px, momentum SGD 0.9 with weight
# decay 1e-4 off batch norm and biases, validated at 224 px without TTA, batch norm over each paper's per-GPU batch
# whatever the GPUs here (docs/imagenet.md gives each setting's source and what their texts leave open). Goyal et al.
# 2017: batch 8,192 on 256 GPUs, lr 0.1 per 256 after a 5-epoch warm-up from one worker's 0.1, x0.1 at epochs 30, 60
# and 80, each block's last batch-norm scale at 0 (published: 76.3% in 1 hour).
GOYAL_8K = Recipe(
    name="goyal_8k", doc="Goyal et al. 2017: batch 8,192, lr 0.1 per 256 (3.2) after a 5-epoch warm-up from 0.1, x0.1 "
                         "at epochs 30/60/80, zero-init residual BN (published: 76.3% top-1 in 1 hour on 256 P100s)",
    epochs=90, batch_size=8192, bn_workers=256,
    network=Network(model="resnet50", blurpool=False, zero_init=True),
    schedule=Schedule(lr=0.1, lr_scale_base=256, warmup_epochs=5.0, warmup_start=256 / 8192, schedule="step",
                      step_epochs=(30.0, 60.0, 80.0)),
    resolution=Resolution(min_res=224, max_res=224, res_start_epoch=0, res_end_epoch=0),
    validation=Validation(res=224, crop=0.875, tta="none"),
    sgd=SGD(momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.0))
CLUSTER = dict(epochs=90, validation=GOYAL_8K.validation, resolution=GOYAL_8K.resolution,
               network=replace(GOYAL_8K.network, zero_init=False))


def mikami(name, doc, *, gpus, per_gpu, **changes):
    """Mikami et al. 2018 (Sony) on `gpus` GPUs: batch-size control, per_gpu images a GPU for 5 epochs then twice as
    many, at the rate 0.1 per 256 of the first batch, rising linearly from 0 over the 5 epochs and falling linearly to
    0 at epoch 90, unchanged when the batch doubles; 2D-torus all-reduce in fp16."""
    small, large = gpus * per_gpu, gpus * per_gpu * 2
    peak = 0.1 * small / 256
    return replace(GOYAL_8K, name=name, doc=doc, **CLUSTER, batch_size=large, bn_workers=gpus, comm_hook="torus_fp16",
                   schedule=Schedule(lr_scaling="none", phases=(0, 5, 224, small, 0.0, peak, 0.08, 0, 0,
                                                                5, 90, 224, large, peak, 0.0, 0.08, 0, 0)), **changes)


def fastai(name, doc, *, machines, rows):
    """fast.ai and DIU's run on `machines` AWS machines of 8 V100s (cybertronai/imagenet18, train.py): its phase
    table, rows of (start epoch, end epoch, size, batch per GPU, lr at start, lr at end, smallest crop scale,
    rectangular validation), each phase validated at its size; else GOYAL_8K, with batch norm over each GPU's batch."""
    gpus = 8 * machines
    table = sum(((a, b, size, per_gpu * gpus, lr0, lr1, crop, size, rect)
                 for a, b, size, per_gpu, lr0, lr1, crop, rect in rows), ())
    return replace(GOYAL_8K, name=name, doc=doc, epochs=rows[-1][1], batch_size=rows[0][3] * gpus, bn_workers=gpus,
                   target_top5=0.93, schedule=Schedule(lr_scaling="none", phases=table))


# fast.ai's tables (train.py): the rates are the optimiser's, for the table's global batch
FASTAI = dict(
    fastai_1x8=dict(machines=1, doc="fast.ai and DIU, 1 machine of 8 V100s: 128 -> 224 -> 288 px, 35 epochs "
                    "(published: 93.00% top-5 in 109:12, train.py)", rows=(
                        (0, 5, 128, 512, 1.0, 2.0, 0.08, 0), (5, 14, 128, 512, 1.0, 1.0, 0.08, 0),
                        (14, 16, 224, 224, 0.4375, 0.4375, 0.08, 0), (16, 27, 224, 224, 0.04375, 0.04375, 0.08, 0),
                        (27, 32, 224, 224, 0.004375, 0.004375, 0.08, 0),
                        (32, 33, 288, 128, 0.0025, 0.0025, 0.5, 1), (33, 35, 288, 128, 0.00025, 0.00025, 0.5, 1))),
    fastai_4x8=dict(machines=4, doc="fast.ai and DIU, 4 machines of 8 V100s: 128 -> 224 -> 288 px, 30 epochs "
                    "(published: 93.05% top-5 in 29:44, train.py)", rows=(
                        (0, 6, 128, 256, 2.0, 4.0, 0.08, 0), (6, 11, 128, 512, 4.0, 4.0, 0.08, 0),
                        (11, 13, 128, 512, 4.0, 2.0, 0.08, 0),
                        (13, 16, 224, 224, 1.75, 1.75, 0.087, 0), (16, 23, 224, 224, 1.75, 0.175, 0.087, 0),
                        (23, 28, 224, 224, 0.175, 0.0175, 0.087, 0), (28, 30, 288, 128, 0.01, 0.001, 0.5, 1))),
    fastai_8x8=dict(machines=8, doc="fast.ai and DIU, 8 machines of 8 V100s: 128 -> 224 -> 288 px, 35 epochs "
                    "(published: 93.0% top-5 in 19:04, train.py)", rows=(
                        (0, 6, 128, 128, 1.88, 3.76, 0.08, 0), (6, 11, 128, 256, 3.76, 3.76, 0.08, 0),
                        (11, 14, 128, 256, 3.76, 1.88, 0.08, 0), (14, 17, 224, 128, 1.88, 1.88, 0.087, 0),
                        (17, 23, 224, 224, 1.88, 0.329, 0.087, 0), (23, 29, 224, 224, 0.329, 0.0329, 0.087, 0),
                        (29, 35, 288, 128, 0.0188, 0.00188, 0.5, 1))),
    fastai_16x8=dict(machines=16, doc="fast.ai and DIU, 16 machines of 8 V100s: 128 -> 224 -> 288 px, 50 epochs "
                     "(published: 93.04% top-5 in 16:08 after prewarming, train.py; 18 minutes in their README)", rows=(
                         (0, 6, 128, 64, 1.88, 3.76, 0.08, 0), (6, 16, 128, 128, 3.76, 3.76, 0.08, 0),
                         (16, 19, 224, 64, 1.88, 1.88, 0.08, 0), (19, 31, 224, 192, 0.564, 0.564, 0.08, 0),
                         (31, 37, 224, 192, 0.0564, 0.0564, 0.08, 0),
                         (37, 38, 288, 128, 0.0376, 0.0376, 0.5, 1), (38, 50, 288, 128, 0.00376, 0.00376, 0.5, 1))))

RECIPES = {r.name: r for r in (
    RN50_16EP,
    ffcv("rn50_24ep", "ResNet-50, 24 epochs, res 160->192, 512 images per GPU at lr 1.7 (published by FFCV: 75.6% "
                      "top-1 in 21.7 min on 8 A100s)", epochs=24, res_start=17, res_end=20),
    ffcv("rn50_88ep", "ResNet-50, 88 epochs, res 160->192, 512 images per GPU at lr 1.7 (published by FFCV: 78.4% "
                      "top-1 in 77.2 min on 8 A100s)", epochs=88, res_start=65, res_end=76),
    ffcv("rn18_16ep", "ResNet-18, 16 epochs, res 160->192, 1024 images per GPU at lr 0.5 (published by FFCV: 66.9% "
                      "top-1 in 35.0 min on 1 A100)", epochs=16, res_start=11, res_end=13, **RN18),
    ffcv("rn18_88ep", "ResNet-18, 88 epochs, res 160->192, 1024 images per GPU at lr 0.5 (published by FFCV: 72.4% "
                      "top-1 in 187.3 min on 1 A100)", epochs=88, res_start=65, res_end=76, **RN18),
    GOYAL_8K,
    # Akiba et al. 2017: RMSprop warm-up handing over to SGD, slow-start rates, last-batch batch norm, fp16 gradients
    replace(GOYAL_8K, name="akiba_32k", **CLUSTER, doc="Akiba et al. 2017: batch 32,768, RMSprop warm-up handing over "
            "to SGD, slow-start lr, batch norm from the last batch averaged over ranks, fp16 gradients (published: "
            "74.9% top-1 in 15 min on 1,024 P100s)", batch_size=32768, bn_workers=1024,
            schedule=Schedule(lr=0.1, warmup_epochs=0.0, schedule="slow_start"),
            rmsprop=RMSpropWarmup(beta_center=10.0, beta_period=5.0), bn_stats="last_batch", comm_hook="fp16"),
    mikami("mikami_68k", "Mikami et al. 2018 (Sony), first version: batch-size control 34,816 -> 69,632 after 5 "
           "epochs, 2D-torus all-reduce in fp16 (published: 75.03% top-1 in 224 s on 2,176 V100s)",
           gpus=2176, per_gpu=16),
    mikami("mikami_122s", "Mikami et al. 2018 (Sony), second version: batch-size control (27,648 -> 55,296 after 5 "
           "epochs, assumed), label smoothing, 2D-torus all-reduce in fp16 (published: 75.29% top-1 in 122 s on 3,456 "
           "V100s)",
           gpus=3456, per_gpu=8, sgd=replace(GOYAL_8K.sgd, label_smoothing=0.1)),
    # Yamazaki et al. 2019 (Fujitsu): batch 81,920 on 2,048 GPUs, LARS; the rest assumed (docs/imagenet.md)
    replace(GOYAL_8K, name="yamazaki_81k", **CLUSTER, doc="Yamazaki et al. 2019 (Fujitsu): batch 81,920, LARS (the "
            "schedule, label smoothing and the rest assumed) (published: 75.08% top-1 in 74.7 s on 2,048 V100s)",
            batch_size=81920, bn_workers=2048, lars=LARSSettings(trust=0.001),
            schedule=Schedule(lr=0.1, warmup_epochs=5.0, schedule="linear"),
            sgd=replace(GOYAL_8K.sgd, label_smoothing=0.1), comm_hook="fp16"),
    *(fastai(name, **kw) for name, kw in FASTAI.items()),
    Recipe(name="tiny", doc="resnet_tiny width 16 for tests and CPU demonstrations on small stores (res 32, 8 epochs)",
           epochs=8, batch_size=32, network=Network(model="resnet_tiny", width=16, blurpool=False),
           schedule=Schedule(lr=0.2, warmup_epochs=1.0), sgd=SGD(weight_decay=5e-5),
           resolution=Resolution(min_res=32, max_res=32, res_start_epoch=0, res_end_epoch=0, res_step=8),
           augment=Augment(crop_scale=(0.35, 1.0)), validation=Validation(res=32, crop=0.0, tta="none")),
)}


def recipe(name, **changes):
    """A recipe by name with settings changed by flag name, checked: the one value a run passes down. An --epochs
    that ends inside the recipe's warm-up shortens it in proportion, and .notes says so. A bad name or value is a
    UsageError of one line."""
    if name not in RECIPES:
        raise UsageError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    r, warm = changed(RECIPES[name], **changes), RECIPES[name].schedule.warmup_epochs
    if r.schedule.phases:
        r = phased(r, changes)
    check(r)
    notes = []
    if "warmup_epochs" not in changes and not r.schedule.phases and 0 < r.epochs <= warm < RECIPES[name].epochs:
        shorter = warm * r.epochs / RECIPES[name].epochs          # the same share of the run
        notes.append(f"note: --epochs {r.epochs} ends inside the recipe's {warm:g}-epoch warm-up, so the warm-up is "
                     f"shortened in proportion to {shorter:g} epochs (--warmup-epochs sets it)")
        r = replace(r, schedule=replace(r.schedule, warmup_epochs=shorter))
    return replace(r, notes=tuple(notes))


# what a phase table sets, so that a flag for one of them beside it would be ignored
PHASED = ("epochs", "batch_size", "lr", "warmup_epochs", "warmup_start", "schedule", "step_epochs", "min_res",
          "max_res", "res_start_epoch", "res_end_epoch", "res_step", "batch_scale", "batch_schedule", "crop_scale",
          "per_gpu_batch")


def phased(r, changes):
    """Recipe r, which has a phase table, as long as the table (a table that cannot be read: left to check()); a
    setting the table replaces, given beside it, is a UsageError of one line."""
    for name in PHASED:
        if name in changes:
            raise flag_error(name, changes[name], "the phase table (--phases) sets each phase's epochs, resolution, "
                             "batch and rate; change --phases instead")
    try:
        table = phases(r.schedule.phases)
    except ValueError:
        return r
    if "val_res" in changes and any(ph.val_res for ph in table):
        raise flag_error("val_res", changes["val_res"], "the phase table (--phases) sets each phase's validation "
                         "resolution; change --phases instead")
    return replace(r, epochs=table[-1].end)


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

COLUMNS = ["epoch", "res", "batch", "lr", "train_loss", "train_acc", "val_loss", "top1", "top5", "epoch_time",
           "total_time", "decode"]      # decode: imagenet_data.decode_text, which of nvJPEG's paths took the images
PROGRESS_AFTER_S = 5.0    # an epoch that looks longer shows its steps on stderr


@dataclass(kw_only=True)
class Options(T.Options):
    """How a run runs (not what it computes): training.Options with the top-1 that stops the clock, and a checkpoint
    written after every epoch (resumed from with resume; interrupt_after: exit after that epoch's, as a preempted job
    would)."""
    target: float = 0.75
    checkpoint: str = None
    resume: bool = False
    interrupt_after: int = None
    store: dict = None          # store_identity(): a checkpoint records it, and resumes only on that store


@dataclass(frozen=True, kw_only=True)
class EpochPlan:
    """One epoch of a run on this rank (schedules.plan's row): its resolution, this rank's batch in micro-batches of
    `micro` images normalised in groups of `group` (0: whole micro-batches), the steps of the epoch, the run's steps
    before it and in all, its crops (augment) and what validation after it sees."""
    epoch: int
    res: int
    batch: int
    micro: int
    group: int
    steps: int
    first_step: int
    total_steps: int
    augment: Augment
    validation: Validation


def epoch_plans(r, world, n=None):
    """Each epoch's EpochPlan of recipe r on world ranks, each holding n training images (None: as many as the
    batches need): a ValueError of one line, naming the flag, when a rank's batch does not split into --accumulate
    micro-batches of whole batch-norm groups."""
    out, first = [], 0
    for e, row in enumerate(plan(r, world)):
        batch, k, workers = row["batch"] // world, r.accumulate, r.bn_workers
        batch = batch if n is None else min(batch, n)
        if batch % k:
            raise ValueError(f"--accumulate {k}: the {batch} images of a rank's batch in epoch {e + 1} do not split "
                             f"into {k} micro-batches")
        if workers and row["batch"] % workers:
            raise ValueError(f"--bn-workers {workers}: the global batch of epoch {e + 1}, {row['batch']} images, is "
                             f"not a multiple of it")
        if workers and (batch // k) % (row["batch"] // workers):
            raise ValueError(f"--bn-workers {workers}: batch norm's groups of {row['batch'] // workers} images (the "
                             f"global batch / {workers}) do not fill micro-batches of {batch // k} images in epoch "
                             f"{e + 1}; change --accumulate")
        steps = (batch if n is None else n) // batch
        out.append(EpochPlan(epoch=e, res=row["res"], batch=batch, micro=batch // k, steps=steps, first_step=first,
                             group=row["batch"] // workers if workers else 0, total_steps=0,
                             augment=replace(r.augment, crop_scale=(row["crop_min"], r.augment.crop_scale[1])),
                             validation=replace(r.validation, res=row["val"][0], crop=row["val"][1])))
        first += steps
    return [replace(p, total_steps=first) for p in out]


def train_run(r, data, o, *, ctx, seed, on_epoch=None):
    """One run of recipe r on this process's Data (place()) with Options o: {"seed", "rows", "final_top1",
    "final_top5", "train_time", "final_eval_time", "time", "time_to_target"}. Under torchrun every rank builds the
    same network and draws its own batches."""
    device = torch.device(ctx.device)
    dtype, memory_format = devices.compute_dtype(device, o.precision), devices.memory_format(device)
    plans = epoch_plans(r, ctx.world_size, data.per_epoch())
    seeds = T.run_seeds(seed, ctx.rank)          # the network, the data's order and its augmentation: 3 streams
    torch.manual_seed(seeds["init"])
    order, augment = (torch.Generator().manual_seed(seeds[k]) for k in ("order", "augment"))
    with devices.parameters_dtype(dtype):
        model = build_model(r, len(data.store.index["classes"])).to(device, memory_format=memory_format)
    opt = make_optimizer(model, r)
    forward = D.register_comm_hook(D.wrap_ddp(model, ctx, ctx.bucket_mb), ctx.hook) if ctx.distributed else model
    clock = devices.timer(device)                # starts once the network is built, as the references' does
    if r.bn_stats == "last_batch":               # no moving averages: the last batch's, pooled over ranks (Akiba)
        D.use_last_batch_stats(model)
    average = T.averaging(model, ema=r.ema, lookahead=r.lookahead)
    scaler = loss_scaler(device, dtype)          # fp16: the mean loss's gradients need it; saved with the optimiser
    run = T.Trainable(model=model, optimizers=[opt, scaler] if scaler else [opt], average=average,
                      generators=[order, augment])
    done = resumed(r, run, o, forward=forward, plans=plans, ctx=ctx, on_epoch=on_epoch)
    rows, time_to_target, clock.total = done["rows"], done["time_to_target"], done["train_time"]
    final_eval_time = 0.0
    for p, work in epochs_ahead(data, plans[done["epoch"]:], run.generators, shares=seeds["shares"]):
        decoded = Counter(data.decoded)
        losses, correct, seen, lr = train_epoch(r, run, data, p, work=work, forward=forward, ctx=ctx, o=o)
        decoded = decode_text(data.decoded - decoded)
        if r.lookahead and p.epoch == r.epochs - 1:
            average.finish(model)                # lookahead: the slow weights end the run
        epoch_time, last = clock(), p.epoch == r.epochs - 1
        T.check_finite_loss(epoch_loss(losses, ctx) / (seen * ctx.world_size), epoch=p.epoch + 1,
                            hint=divergence_hint(r))
        metrics = dict.fromkeys(("val_loss", "top1", "top5"))
        if last or (o.eval_every and (p.epoch + 1) % o.eval_every == 0):
            with Heartbeat("final evaluation" if last else f"evaluation of epoch {p.epoch + 1}", on=o.progress):
                metrics = validation(r, run, data, p.validation, ctx=ctx, dtype=dtype, final=last)
            final_eval_time = clock(include=False)
            if time_to_target is None and metrics["top5" if r.target_top5 else "top1"] >= o.target:
                time_to_target = clock.total
        rows.append({"epoch": p.epoch + 1, "res": p.res, "batch": p.batch * ctx.world_size, "lr": lr,   # global
                     "train_loss": losses.item() / seen, "train_acc": correct.item() / seen, **metrics,
                     "epoch_time": epoch_time, "total_time": clock.total, "decode": decoded})
        if o.checkpoint:
            T.save_checkpoint(o.checkpoint, run, settings=flat(r), ctx=ctx, store=o.store, progress={
                "epoch": p.epoch + 1, "rows": rows, "train_time": clock.total, "time_to_target": time_to_target})
        on_epoch and on_epoch(rows[-1])
        if o.checkpoint and o.interrupt_after == p.epoch + 1:
            D.print0(f"stopped after epoch {p.epoch + 1} (--interrupt-after-epoch), exit status {T.INTERRUPTED}; "
                     f"its checkpoint is {o.checkpoint}: the same command with --resume continues from it",
                     file=sys.stderr)
            D.leave_together(ctx)
            raise SystemExit(T.INTERRUPTED)
        clock(include=False)
    return {"seed": seed, "rows": rows, "final_top1": rows[-1]["top1"], "final_top5": rows[-1]["top5"],
            "train_time": clock.total, "final_eval_time": final_eval_time, "time": clock.total + final_eval_time,
            "time_to_target": time_to_target}


def epoch_loss(losses, ctx):
    """The epoch's summed training loss over every rank (under torchrun one all-reduce an epoch, after its steps), so
    that a loss diverged on any rank stops every rank alike."""
    total = losses.detach().clone()
    if ctx.distributed:
        torch.distributed.all_reduce(total)
    return total.item()


def divergence_hint(r):
    """The setting most likely behind a training loss gone NaN or infinite: the rate, as the recipe sets it."""
    if r.schedule.phases:
        return "lower the phase table's rates (--phases)"
    return (f"lower --lr (here {r.schedule.lr:g}) or warm up longer (--warmup-epochs, here "
            f"{r.schedule.warmup_epochs:g})")


def epochs_ahead(data, plans, generators, *, shares):
    """(EpochPlan, its EpochWork) for each of plans in turn, drawn from the run's generators (order, augmentation),
    which are then set where the epoch's draws leave them (so a checkpoint after it resumes the next draws); each
    epoch's work is done in a thread of its own while the epoch before trains, off the training thread's path."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="draws")
    try:
        states = [g.get_state() for g in generators]
        pending = pool.submit(epoch_work, data, plans[0], states, shares) if plans else None
        for i, p in enumerate(plans):
            work = pending.result()
            for g, state in zip(generators, work.states):
                g.set_state(state)
            if i + 1 < len(plans):
                pending = pool.submit(epoch_work, data, plans[i + 1], work.states, shares)
            yield p, work
    finally:
        pool.shutdown(cancel_futures=True)


def epoch_work(data, p, states, shares):
    """The EpochWork of epoch p (an EpochPlan) drawn as draw_epoch draws it, from copies of the run's generators at
    `states` (so that the run's own stay where a checkpoint expects them while the next epoch is drawn)."""
    order, augment = (torch.Generator().set_state(s) for s in states)
    draws = draw_epoch(data, p.augment, augment, order=order, epoch_seed=[shares, p.epoch])   # a JPEG store's share
    draws.perm = draws.perm[:p.steps * p.batch]          # the epoch's whole batches; the rest is dropped
    return EpochWork(draws=draws, smalls=batch_indices(data, draws, p.micro),
                     states=[order.get_state(), augment.get_state()])


def train_epoch(r, run, data, p, *, work, forward, ctx, o):
    """The steps of one epoch (EpochPlan p, its EpochWork drawn ahead): each a step of this rank's batch, in
    p.micro-image micro-batches normalised in groups of p.group (accumulated_step), at the rate of its fractional
    epoch. Returns the summed loss, the correct predictions, the images seen (on the device, unread) and the last
    rate."""
    device, (opt, *scaler) = torch.device(ctx.device), run.optimizers      # a GradScaler beside it in fp16
    dtype = devices.compute_dtype(device, o.precision)
    set_ghost_groups(run.model, p.group)
    micro = train_batches(data, p.augment, work.draws, res=p.res, batch_size=p.micro, device=device, dtype=dtype,
                          smalls=work.smalls)
    losses, correct, lr = torch.zeros((), device=device), torch.zeros((), device=device), 0.0
    bar = Progress(p.steps, f"epoch {p.epoch + 1}", PROGRESS_AFTER_S) if o.progress else None
    for i, batch in enumerate(zip(*[micro] * r.accumulate)):       # r.accumulate micro-batches at a time
        t = p.epoch + i / p.steps                # the fractional epoch: the schedule's and RMSprop-to-SGD's clock
        lr = step_lr(r, t, p.batch * ctx.world_size)
        set_lr([opt], lr, p.first_step + i, t)
        hits, loss = accumulated_step(forward, opt, batch, ctx=ctx, label_smoothing=r.sgd.label_smoothing, dtype=dtype,
                                      scaler=scaler[0] if scaler else None)
        if run.average:
            run.average.update(run.model, p.first_step + i + 1, p.total_steps)
        losses, correct = losses + loss, correct + hits
        bar and bar.update()
    bar and bar.close()
    return losses, correct, p.steps * p.batch, lr


def loss_scaler(device, dtype):
    """torch.amp.GradScaler for steps in fp16 on the device, whose 5 exponent bits flush the small gradients of a mean
    loss to 0 (docs/perf-notes.md counts them; CIFAR-10's summed loss needs none); None in another dtype (bf16 has
    float32's range). A step scales the loss, unscales the gradients, and skips an update whose gradients overflowed."""
    return torch.amp.GradScaler(torch.device(device).type) if dtype == torch.float16 else None


def accumulated_step(forward, opt, batch, *, ctx, label_smoothing, dtype, scaler=None):
    """One update from the micro-batches [(x, y), ...] of this rank's batch: the gradients of each one's mean loss /
    their number added up (under DDP, all-reduced after the last alone: no_sync before), then the optimiser's step
    (with a GradScaler, loss_scaler: of the scaled loss, unscaled, skipped on overflow). Returns the correct
    predictions and the summed loss, on the device."""
    k, hits, total = len(batch), 0, 0
    for i, (x, y) in enumerate(batch):
        with forward.no_sync() if ctx.distributed and i < k - 1 else contextlib.nullcontext():
            with devices.autocast(x.device, dtype):
                logits = forward(x)
                loss = F.cross_entropy(devices.float32_or_wider(logits), y, label_smoothing=label_smoothing)
            part = loss / k if k > 1 else loss
            (scaler.scale(part) if scaler else part).backward()
        hits, total = hits + (logits.argmax(1) == y).sum(), total + loss.detach() * len(y)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return hits, total


def resumed(r, run, o, *, forward, plans, ctx, on_epoch):
    """Where a run starts: epoch 0, or (with o.resume) where its checkpoint left it, its state loaded into run and
    its rows replayed to on_epoch."""
    state = (T.read_checkpoint(o.checkpoint, settings=flat(r), ctx=ctx, store=o.store) if o.resume and o.checkpoint
             else None)
    if state is None:
        return {"epoch": 0, "rows": [], "train_time": 0.0, "time_to_target": None}
    if ctx.distributed:     # DDP's buckets as the uninterrupted run has them, so that its sums round the same
        res = plans[state["progress"]["epoch"] - 1].res
        example = torch.zeros(2, 3, res, res, device=ctx.device).contiguous(
            memory_format=devices.memory_format(ctx.device))
        with devices.autocast(ctx.device, devices.compute_dtype(ctx.device, o.precision)):
            D.rehearse_backward(forward, example.to(devices.compute_dtype(ctx.device, o.precision)))
    T.load_checkpoint(state, run, ctx=ctx)
    for row in state["progress"]["rows"]:
        on_epoch and on_epoch(row)
    return state["progress"]


def validation(r, run, data, val, *, ctx, dtype, final):
    """{"val_loss", "top1", "top5"} of the weights the run evaluates (the EMA's when there is one) over the whole
    validation set (each rank its part, summed), each image seen as val (a Validation) says; the final one with the
    recipe's TTA. With last-batch statistics, every rank first takes the global batch's."""
    if r.bn_stats == "last_batch":
        D.sync_batch_norm_stats(run.model, ctx)
        if run.average and run.average.model is not None:
            D.sync_batch_norm_stats(run.average.model, ctx, counted=run.model)
    tta = val.tta if final else "none"
    loss, top1, top5 = loss_top1_top5(T.evaluation_model(run.model, run.average), data, val, tta=tta,
                                      device=ctx.device, dtype=dtype, ctx=ctx)
    return {"val_loss": loss, "top1": top1, "top5": top5}


def warmup(r, data, *, device, dtype, world=1):
    """Two steps at every (resolution, micro-batch, batch-norm group) of the schedule on a throwaway model, so that
    cuDNN's autotuning for each new shape happens before the clock starts."""
    memory_format = devices.memory_format(device)
    with devices.parameters_dtype(dtype):
        model = build_model(r, len(data.store.index["classes"])).to(device, memory_format=memory_format)
    opt = make_optimizer(model, r)
    gen = torch.Generator().manual_seed(0)
    n = data.per_epoch()
    for res, bs, group in sorted({(p.res, p.micro, p.group) for p in epoch_plans(r, world, n)}):
        set_ghost_groups(model, group)
        draws = draw_epoch(data, r.augment, gen)
        draws.perm = draws.perm[np.arange(2 * bs) % n]
        for x, y in train_batches(data, r.augment, draws, res=res, batch_size=bs, device=device, dtype=dtype):
            with devices.autocast(device, dtype):
                F.cross_entropy(devices.float32_or_wider(model(x)), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    devices.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

TRAIN = """Train a recipe on a store, on one GPU or under torchrun on many.

--batch-size is the global batch, split over the GPUs, and the rate per --lr-scale-base images of it, but for:
  FFCV's recipes (rn50_*, rn18_*), which train FFCV's batch on each GPU (512; 1024 for ResNet-18) at FFCV's rate
    (1.7; 0.5) whatever the number of GPUs, as FFCV's train_imagenet.py does (--per-gpu-batch true, --lr-scaling
    none; --lr-scaling linear --lr 0.10625 keeps FFCV's rate per image instead);
  phase tables (--phases: fast.ai's recipes, Mikami et al.'s), whose rows give each phase's global batch and rate.
--accumulate K steps on each rank's batch in K micro-batches, --bn-workers W normalises groups of global batch / W.
"""


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="decode an ImageFolder tree into a store")
    pp.add_argument("--src", required=True, help="folder with train/<class>/* and val/<class>/*")
    pp.add_argument("--dst", required=True, help="store folder to write (resumes if partly written)")
    pp.add_argument("--format", default="jpeg", type=one_of(FORMATS),
                    help="jpeg: whole images, longer side <= --max-side, for full-quality training (default); "
                         "raw: uint8 pixels at --size, for low-resolution work")
    pp.add_argument("--max-side", type=int, default=500, help="jpeg: longest side kept (default 500, as FFCV)")
    pp.add_argument("--quality", type=int, default=90, help="jpeg: quality of re-encoded images (default 90)")
    pp.add_argument("--size", type=int, default=128, help="raw: shorter side of stored images (default 128)")
    pp.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPU count)")
    pp.add_argument("--shard-size", type=int, default=1000, help="images per shard, the unit of resumption")
    pp.add_argument("--max-aspect", type=float, default=2.0, help="longest val aspect kept (default 2)")
    pp.add_argument("--max-shards", type=int, default=None, help="stop after decoding this many new shards")

    tp = sub.add_parser("train", help="train on a store", description=TRAIN,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("--store", help="a folder written by prepare")
    tp.add_argument("--recipe", default="rn50_16ep", help="recipe name (default rn50_16ep; see --list-recipes)")
    tp.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    tp.add_argument("--print-recipe", action="store_true",
                    help="print the recipe's every setting (with the flags given) as the command that trains it, and "
                         "exit")
    tp.add_argument("--data-on", default="auto", choices=["auto", "device", "host"],
                    help="where a raw store lives (auto: on the device if it fits beside training)")
    tp.add_argument("--decoder", default="auto", type=one_of(devices.DECODERS),
                    help="where a JPEG store is decoded (auto: nvJPEG on a CUDA GPU, else the CPU's worker processes; "
                         "nvimgcodec: nvImageCodec on the GPU, decoding just each crop, pip install "
                         "nvidia-nvimgcodec-cu12 or -cu13)")
    tp.add_argument("--loader-workers", type=int, default=None,
                    help="CPU decoding processes per training process (default: its share of the node's cores, "
                         "less one for the training thread and one for the reader thread; at least 1)")
    tp.add_argument("--target", type=float, default=None,
                    help="top-1 whose first epoch stops the clock (default 0.75; a recipe with a --target-top5 stops "
                         "it at that top-5 instead)")
    tp.add_argument("--checkpoint", default=None, help="checkpoint file, written atomically after every epoch")
    tp.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    tp.add_argument("--out", default=None, help="write the recipe, environment, rows and summary as JSON")
    tp.add_argument("--interrupt-after-epoch", type=int, default=None,
                    help=f"exit with status {T.INTERRUPTED} right after this epoch's checkpoint, as a preempted job "
                         "would; a restart with --resume (or torchrun --max-restarts) continues from it")
    add_run_flags(tp)
    add_flags(tp, Recipe, recipe=RN50_16EP)
    sub.add_parser("simulate", add_help=False,
                   help="project step time and scaling efficiency over many GPUs (as python scaling.py)")
    args = p.parse_args(argv)
    return args, changes_from(args, Recipe) if args.command == "train" else {}


def main_prepare(args):
    finished = (Path(args.dst) / "index.json").is_file()       # then prepare says "already prepared" and writes nothing
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
    if finished:
        return 0
    shape = (f"longer side <= {args.max_side}" if args.format == "jpeg" else f"size {args.size}")
    gb = (index["train"]["bytes"] + index["val"]["bytes"]) / 1e9
    print(f"wrote {args.dst}: {len(index['classes'])} classes, {index['train']['count']} train and "
          f"{index['val']['count']} val images, {args.format} at {shape}, {gb:.3f} GB; "
          f"{index['train']['skipped'] + index['val']['skipped']} unreadable files skipped")
    return 0


def check_train(args):
    """Raises UsageError for the first bad flag of the train command that is not a setting; before anything is
    loaded or started."""
    for flag, bad, message in (
            ("store", not args.store, "is required (a folder written by `imagenet_fast.py prepare`)"),
            ("resume", args.resume and not args.checkpoint, "needs --checkpoint"),
            ("resume", args.resume and args.runs > 1, "works with a single run"),
            ("interrupt-after-epoch", args.interrupt_after_epoch and not args.checkpoint, "needs --checkpoint"),
            ("loader-workers", args.loader_workers is not None and args.loader_workers < 1, "must be positive")):
        if bad:
            raise UsageError(f"--{flag} {message}")
    check_run(args.runs, args.target, device=args.device, out=args.out, eval_every=args.eval_every)
    check_output(args.checkpoint, "--checkpoint")


def goal(r, target):
    """The accuracy whose first epoch stops the clock: --target (top-1, default 0.75), or the recipe's top-5 target;
    a UsageError of one line when both are given."""
    if r.target_top5 and target is not None:
        raise UsageError(f"--target {target:g}: {r.name} stops its clock at top-5 {r.target_top5:g} (--target-top5); "
                         f"give --target-top5 0 to time to a top-1 --target")
    return r.target_top5 or (0.75 if target is None else target)


# what run() does before the first run, by function: what Ctrl-C stopped there
BEFORE_TRAINING = {"open_store": "opening the store", "placed": "placing the store",
                   "warmup": "warming up (cuDNN's autotuning at every resolution)"}


def recipe_command(r, name):
    """Recipe r as the command that trains it from recipe `name`: its every setting a flag (a phase table's recipe
    without those the table sets, which its flags refuse), after a line of its name and what it is."""
    table = phases(r.schedule.phases) if r.schedule.phases else []
    skip = PHASED + (("val_res",) if any(ph.val_res for ph in table) else ()) if table else ()
    head = f"# {r.name}: {r.doc}" + ("; its phase table sets the epochs, batches, rates, resolutions" if skip else "")
    return head + "\n" + command_text(["python", "imagenet_fast.py", "train", "--recipe", name], as_flags(r, skip=skip))


def main_train(args, changes, argv):
    if args.list_recipes:
        print("\n".join(f"{name:12s} {r.doc}" for name, r in RECIPES.items()))
        return 0
    try:
        r = recipe(args.recipe, **changes)
        if args.print_recipe:
            print(recipe_command(r, args.recipe))
            return 0
        args.target = goal(r, args.target)
        check_train(args)
        ctx = join_ranks(args, r.comm_hook)
    except UsageError as e:
        D.print0(f"error: {e}", file=sys.stderr)
        end_torchrun()
        return 2
    try:
        return run(args, r, ctx=ctx, argv=argv)
    except KeyboardInterrupt as e:       # before the runs (train_runs says where a run stopped)
        close_progress()
        D.print0(interrupted(1, 1, 0, out=args.out, checkpoint=args.checkpoint,
                             during=phase_of(e, BEFORE_TRAINING) or "preparing the runs"), file=sys.stderr)
        end_torchrun(others_wait=False)
        return 130
    except RuntimeError as e:
        return lost_peer(e, ctx)
    finally:
        D.leave(ctx)


def run(args, r, *, ctx, argv):
    """main_train's work once this process has its place: the store placed, the runs, the summary, the JSON; the
    exit status."""
    device, say, progress = torch.device(ctx.device), D.print0, ctx.is_main and not args.quiet
    for note in r.notes:
        say(note, file=sys.stderr)
    if r.per_gpu_batch and r.schedule.lr_scaling == "none":     # FFCV's recipes: the rate does not follow the GPUs
        say(f"note: {r.batch_size} images on each GPU, {r.batch_size * ctx.world_size} a step on {ctx.world_size}, at lr "
            f"{r.schedule.lr:g} whatever the number of GPUs, as FFCV's train_imagenet.py trains (--lr-scaling linear "
            "scales the rate with the images of a step instead)", file=sys.stderr)
    if devices.is_cpu(device) and ctx.is_main:
        print("warning: no GPU in use: training on the CPU in float32, which is slow; for a demonstration use "
              "a small store, --model resnet_tiny and few --epochs", file=sys.stderr)
    try:
        plans = epoch_plans(r, ctx.world_size)   # a schedule that does not divide over the ranks fails here
        decoder = devices.jpeg_decoder(device, args.decoder)
        store = open_store(args.store)
        data = placed(r, store, args, ctx=ctx, decoder=decoder, progress=progress)
        check_batch(r, world=ctx.world_size, n_train=len(store.train))    # placed first: only a tiny store fails it
    except (ValueError, DataError) as e:         # UsageError is a ValueError
        if ctx.is_main or isinstance(e, DataError) and ctx.local_rank == 0:     # bad data: each node's own store
            print(f"error: {e}", file=sys.stderr, flush=True)
        end_torchrun()
        return 1 if isinstance(e, DataError) else 2
    dtype = devices.compute_dtype(device, args.precision)
    on_gpu = devices.GPU_DECODERS.get(decoder)
    cpus = f"{data.workers} CPU process{'es' * (data.workers != 1)}"
    held = ((f"jpeg store, decoded on the GPU ({on_gpu})" if on_gpu else f"jpeg store, decoded by {cpus}")
            if store.format == "jpeg" else f"raw store of size {store.size} in {data.where} memory")
    say(f"recipe {r.name} on {devices.name(device)} ({device}, {str(dtype)[6:]}), {len(store.train)} train and "
        f"{len(store.val)} val images, {len(store.index['classes'])} classes, {held}"
        + (f", {ctx.world_size} ranks of {plans[0].batch} images per step, each training on {data.per_epoch()} "
           "images " + ("of a new share every epoch" if data.shares else "of its own") if ctx.distributed else ""))
    say(schedule_text(r, plans, world=ctx.world_size))
    if not devices.is_cpu(device):
        devices.autotune(device)
        with Heartbeat("warm-up: cuDNN's autotuning at every resolution and batch", on=progress):
            warmup(r, data, device=device, dtype=dtype, world=ctx.world_size)
    return train_runs(args, r, data, ctx=ctx, argv=argv, store=store)


def check_batch(r, *, world, n_train):
    """Raises UsageError (one line, naming the flag that sets it) when an epoch's global batch is larger than the
    store's n_train training images, as CIFAR's check_data does: a rank's batch is never silently shrunk."""
    for row in plan(r, world):
        if row["batch"] <= n_train:
            continue
        if r.schedule.phases or r.resolution.batch_schedule or r.resolution.batch_scale:
            flag = "--phases" if r.schedule.phases else "--batch-schedule" if r.resolution.batch_schedule else \
                "--batch-scale"
            raise UsageError(f"{flag}: the global batch of epoch {row['epoch']}, {row['batch']} images, is larger "
                             f"than the store's {n_train} training images")
        per_gpu = f" ({r.batch_size} on each of {world} GPU{'s' * (world != 1)}, --per-gpu-batch)"
        raise flag_error("batch_size", r.batch_size, f"larger than the {n_train} training images"
                         + (per_gpu if r.per_gpu_batch else ""))


def schedule_text(r, plans, *, world):
    """The run's schedule, one line per epoch (schedules.plan: the global batch, the optimiser's rate at the epoch's
    start and end, the crops' smallest scale, what validation sees), after how a rank's batch is split."""
    p = plans[0]
    lines = [f"schedule on {world} rank{'s' * (world > 1)}" + (
        f": each rank's batch in {r.accumulate} micro-batches, their gradients added before one update"
        if r.accumulate > 1 else "") + (
        f"; batch norm over groups of global batch / {r.bn_workers} images ({p.group} in epoch 1)"
        if r.bn_workers else "; batch norm over each rank's micro-batch" if r.accumulate > 1 else ""),
        f"{'ep':>5} {'res':>5} {'batch':>7} {'lr start':>10} {'lr end':>10} {'crop':>6}  validation"]
    for row in plan(r, world):
        lines.append(f"{row['epoch']:>5} {row['res']:>5} {row['batch']:>7} {row['lr_start']:>10.5g} "
                     f"{row['lr_end']:>10.5g} {row['crop_min']:>6.3g}  {view_text(row['val'])}")
    return "\n".join(lines)


def view_text(view):
    """What validation sees, (shorter side, centre crop) as schedules.val_at gives it, in words: "224 px, centre
    0.875" (of the shorter side, square) or "288 px, whole image"."""
    res, crop = view
    return f"{res} px, centre {crop:g}" if crop else f"{res} px, whole image"


def placed(r, store, args, *, ctx, decoder, progress):
    """This process's Data (imagenet_data.place), once what training needs of the device is known to fit (and
    whether a raw store fits beside it): a UsageError of one line, before anything is loaded, when not."""
    device = torch.device(ctx.device)
    dtype, classes = devices.compute_dtype(device, args.precision), len(store.index["classes"])
    training = 0 if devices.is_cpu(device) else check_memory(r, classes, device=device, world=ctx.world_size,
                                                                 dtype=dtype)
    with Heartbeat(f"placing {args.store}", on=progress):
        return place(store, device, where=args.data_on, ctx=ctx, seed=args.seed, decoder=decoder,
                     workers=args.loader_workers, training=training)     # under torchrun, this rank's share alone


def store_identity(store, name):
    """What a checkpoint records of the store it was written on: the digest of its index (its settings, source,
    classes and every count; the same store prepared again has the same) and its name (the folder given)."""
    index = json.dumps(store.index, sort_keys=True).encode()
    return {"digest": hashlib.sha1(index).hexdigest()[:12], "name": str(name)}


def train_runs(args, r, data, *, ctx, argv, store):
    """The runs of the command line (seeds --seed, +1, ...), each its table, its line and --out rewritten after it;
    the exit status."""
    o = Options(target=args.target, eval_every=args.eval_every, precision=args.precision, store=store_identity(store,
                args.store), interrupt_after=args.interrupt_after_epoch, resume=args.resume,
                progress=ctx.is_main and not args.quiet)
    aim = f"{args.target:.2%}" + (" top-5" if r.target_top5 else "")
    accuracy = "final_top5" if r.target_top5 else "final_top1"       # the first label: the t-test's
    labels = {k: (f"final top-{k[-1]}", "") for k in (accuracy, "final_top1", "final_top5")}
    labels.update({"time_to_target": (f"time to {aim}", " s"), "train_time": ("training time", " s")})
    runs = []

    def save(complete):
        if args.out and ctx.is_main:
            write_json(args.out, run_record({
                "recipe": r.name, "settings": r, "target": args.target, "store": str(args.store),
                "store_format": store.format, "data_on": data.where, "decoder": data.decoder, "complete": complete,
                "runs": runs, "summary": summarize_runs(runs, args.target, labels, accuracy)}, args, argv=argv,
                device=ctx.device, ctx=ctx))
    for k in range(args.runs):
        seed, epochs = args.seed + k, []
        if args.runs > 1:
            D.print0(f"run {k + 1}/{args.runs} (seed {seed})")
        table = Table(COLUMNS, width=11, formats={"epoch_time": ".2f", "total_time": ".2f"},
                      file=None if ctx.is_main else io.StringIO())
        checkpoint = args.checkpoint if args.runs == 1 else (args.checkpoint and f"{args.checkpoint}.seed{seed}")
        try:
            result = train_run(r, data, replace(o, checkpoint=checkpoint), ctx=ctx, seed=seed,
                               on_epoch=lambda row: (table.append(row), epochs.append(row["epoch"])))
        except DataError as e:
            D.print0(f"error: {e}", file=sys.stderr)      # the checkpoint's, the loss's: the same on every rank
            end_torchrun()
            return 1
        except KeyboardInterrupt:
            close_progress()
            D.print0(interrupted(max(epochs, default=0) + 1, k + 1, len(runs), out=args.out, checkpoint=checkpoint),
                     file=sys.stderr)
            end_torchrun(others_wait=False)
            return 130
        runs.append(result)
        save(complete=False)
        ttt = result["time_to_target"]
        D.print0(f"final top-1 {result['final_top1']:.4f}, top-5 {result['final_top5']:.4f}; "
                 + (f"time to {aim}: {ttt:.2f} s" if ttt is not None else f"did not reach {aim}")
                 + f"; training time {result['train_time']:.2f} s")
    if args.runs > 1 and ctx.is_main:
        print_summary(r.name, summarize_runs(runs, args.target, labels, accuracy), args.target, labels)
    save(complete=True)
    if args.out and ctx.is_main:
        print(f"wrote {args.out}")
    D.barrier()       # leave together
    return 0


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if argv_list[:1] == ["simulate"]:
        return scaling.main_simulate(argv_list[1:])
    args, changes = parse_args(argv)
    if args.command == "prepare":
        return main_prepare(args)
    return main_train(args, changes, argv)


if __name__ == "__main__":
    status = main()
    if status == 130:
        exit_now(status)        # Ctrl-C: at once, not seconds later (torch.compile's state finalised)
    sys.exit(status)
