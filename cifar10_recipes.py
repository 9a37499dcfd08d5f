"""The CIFAR-10 recipes: what a run computes, as a small typed tree (Recipe) of each technique's settings, present or
absent (each class beside the code that reads it); the headline recipes (myrtle24, fast94, fast94_next) written out
whole, the others as their differences, and Myrtle's journey as its steps. cifar10_fast.py runs them. Above each
recipe, a line benchmarks/report.py writes from results/ (`# measured: ...`): our figure on a GPU beside the one its
peer published.
"""
import re
from dataclasses import dataclass, replace
from pathlib import Path

from cifar_data import AugmentSettings
from core import UsageError
from optim import MuonSettings, SGDSettings
from schedules import LRSettings
from settings import always_present, changed, check, component, flag_error, knob
from torch_backend import (WHITENING_FITS, BatchNormSettings, NetworkSettings, TTASettings, WhiteningBiasSettings,
                           WhiteningSettings, pools_to_one_pixel)
from training import EMASettings, LookaheadSettings, LookaheadTailSettings

MAX_EPOCHS = 1000         # beyond it a typo (--epochs 1e12), not a run: its rate would round to 0 at every step


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a run computes; a technique it does not use is None."""
    name: str = "custom"
    doc: str = ""
    epochs: float = knob(24, above=0, high=MAX_EPOCHS, doc="epochs to train; a fraction cuts the last short")
    batch_size: int = knob(512, above=0, whole=True, doc="images per step, split over torchrun's ranks")
    label_smoothing: float = knob(0.0, low=0, high=1, doc="the loss's label smoothing (0: none)")
    network: NetworkSettings = always_present(NetworkSettings())
    batch_norm: BatchNormSettings = always_present(BatchNormSettings())
    whitening: WhiteningSettings = component(WhiteningSettings)
    lr: LRSettings = always_present(LRSettings(), title="learning rate")
    sgd: SGDSettings = always_present(SGDSettings(), title="SGD")
    muon: MuonSettings = component(MuonSettings, title="Muon")
    augment: AugmentSettings = always_present(AugmentSettings(), title="augmentation")
    tta: TTASettings = component(TTASettings, title="test-time augmentation")
    ema: EMASettings = component(EMASettings, title="EMA")
    lookahead: LookaheadSettings = component(LookaheadSettings)
    lookahead_tail: LookaheadTailSettings = component(LookaheadTailSettings)
    compile_step: bool = knob(False, doc="with --compile: the forward and the loss compiled as one function")

    def __post_init__(self):
        check(self)

    def check(self):
        averages = [flag for flag, on in (("--ema-momentum", self.ema), ("--lookahead-momentum", self.lookahead),
                                          ("--lookahead-tail-decay", self.lookahead_tail)) if on]
        if len(averages) > 1:
            raise UsageError(f"{' and '.join(averages)}: one weight average at a time; set "
                             f"{'the other' if len(averages) == 2 else 'all but one'} to 0")
        ghost = self.batch_norm.ghost_batch
        if ghost and self.batch_size % ghost:       # GhostBatchNorm would fall back to the whole batch's statistics
            raise flag_error("bn_ghost_batch", ghost, f"must divide --batch-size {self.batch_size} into whole groups "
                             "(0: the whole batch's statistics)")
        for side in sorted(set(self.augment.resolution_schedule)):
            if not pools_to_one_pixel(self, side):
                raise flag_error("resolution_schedule", self.augment.resolution_schedule,
                                 f"the network cannot pool {side}x{side} images down to its head"
                                 + ("" if self.network.global_max_pool else
                                    " (its fixed last window; --global-max-pool true pools a map of any size)"))


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------

# "How to train your ResNet" part 4, Myrtle's DAWNBench entry.
# measured: not measured on a GPU; published: 94%, 79 s (V100, Myrtle)
MYRTLE24 = Recipe(
    name="myrtle24", doc="Myrtle's DAWNBench ResNet-9: 24 epochs, batch 512, cutout 8x8",
    epochs=24, batch_size=512, label_smoothing=0.0,
    network=NetworkSettings(model="resnet9", act="relu", output_scale=0.125),
    batch_norm=BatchNormSettings(momentum=0.1, eps=1e-5),
    lr=LRSettings(knots=(0, 5 / 24, 1), values=(0.0, 0.4, 0.0)),
    sgd=SGDSettings(lr_units="myrtle", momentum=0.9, nesterov=True, weight_decay=5e-4),
    augment=AugmentSettings(crop_pad=4, flip="random", cutout=8))

# Part 8, the bag of tricks' final run.
# measured: not measured on a GPU; published: 94.1%, 26 s (V100, Myrtle)
MYRTLE10 = replace(
    MYRTLE24, name="myrtle10", doc="Myrtle's bag-of-tricks ResNet-9: 10 epochs, CELU, ghost BN, frozen BN scales, "
                                   "whitening, EMA, flip TTA",
    epochs=10, label_smoothing=0.2,
    network=replace(MYRTLE24.network, act="celu", celu_alpha=0.3, pool_first=True, output_scale=1 / 16),
    batch_norm=replace(MYRTLE24.batch_norm, ghost_batch=32, freeze_scale=True),
    whitening=WhiteningSettings(),
    lr=LRSettings(knots=(0, 0.2, 0.8), values=(0.0, 1.0, 0.1)), sgd=replace(MYRTLE24.sgd, bias_lr_mult=64.0),
    augment=replace(MYRTLE24.augment, cutout=0), tta=TTASettings(views="flip"), ema=EMASettings(momentum=0.99, every=5))

# The journey (Myrtle.ai, 2018-19), each stage the one before plus `changes` (flag names), with Myrtle's numbers from
# their experiments.ipynb (parts 1-4) and bag_of_tricks.ipynb (part 8) and their published V100 training time. Two
# steps were loader and kernel fixes our loader has built in ("same"): kept, so the table lines up with theirs.
JOURNEY = [
    # measured: not measured on a GPU; published: 297 s (V100, Myrtle)
    dict(name="baseline_resnet18", published_v100_s=297,
         doc="Myrtle's ResNet-18 (pre-activation, 64/128/256/256 channels, max+average pool), 35 epochs, batch 128, "
             "crop+flip, lr 0.1 peak at epoch 15",
         changes=dict(model="resnet18", epochs=35, batch_size=128, lr_knots=(0, 15 / 35, 30 / 35, 1),
                      lr_values=(0.0, 0.1, 0.005, 0.0), cutout=0, output_scale=1.0)),
    # measured: not measured on a GPU; published: 256 s (V100, Myrtle)
    dict(name="batch512", published_v100_s=256, doc="batch 512, lr peak 0.44",
         changes=dict(batch_size=512, lr_values=(0.0, 0.44, 0.005, 0.0))),
    # measured: not measured on a GPU; published: 186 s (V100, Myrtle)
    dict(name="faster_bn", published_v100_s=186, changes=dict(),
         doc="same as batch512: Myrtle's step kept batch norm out of a slow fp16 path; ours keeps batch "
             "norm's parameters and statistics in float32 on every device"),
    # measured: not measured on a GPU; published: 161 s (V100, Myrtle)
    dict(name="cutout30", published_v100_s=161, doc="cutout 8x8, 30 epochs, lr peak 0.4 at epoch 8",
         changes=dict(cutout=8, epochs=30, lr_knots=(0, 8 / 30, 1), lr_values=(0.0, 0.4, 0.0))),
    # measured: not measured on a GPU; published: 154 s (V100, Myrtle)
    dict(name="cutout30_bs768", published_v100_s=154, doc="batch 768, lr peak 0.6",
         changes=dict(batch_size=768, lr_values=(0.0, 0.6, 0.0))),
    # measured: not measured on a GPU; published: 79 s (V100, Myrtle)
    dict(name="resnet9_24", published_v100_s=79,
         doc="Myrtle's ResNet-9, 24 epochs, batch 512, lr peak 0.4 at epoch 5, logits x 1/8 (= myrtle24)",
         changes=dict(model="resnet9", epochs=24, batch_size=512, lr_knots=(0, 5 / 24, 1),
                      lr_values=(0.0, 0.4, 0.0), output_scale=0.125)),
    # measured: not measured on a GPU; published: 70 s (V100, Myrtle)
    dict(name="gpu_aug", published_v100_s=70, changes=dict(),
         doc="same as resnet9_24: Myrtle's step moved preprocessing and augmentation to the GPU; ours always runs "
             "there"),
    # measured: not measured on a GPU; published: 64 s (V100, Myrtle)
    dict(name="maxpool_pre", published_v100_s=64,
         doc="max-pool before batch norm (4x fewer pixels to normalise), 25 epochs to win back the accuracy",
         changes=dict(pool_first=True, epochs=25, lr_knots=(0, 0.2, 1))),
    # measured: not measured on a GPU; published: 59 s (V100, Myrtle)
    dict(name="label_smoothing", published_v100_s=59, doc="label smoothing 0.2, 23 epochs",
         changes=dict(label_smoothing=0.2, epochs=23)),
    # measured: not measured on a GPU; published: 52 s (V100, Myrtle)
    dict(name="celu", published_v100_s=52, doc="CELU(0.075) instead of ReLU, 20 epochs",
         changes=dict(act="celu", celu_alpha=0.075, epochs=20)),
    # measured: not measured on a GPU; published: 46 s (V100, Myrtle)
    dict(name="ghost_bn", published_v100_s=46, doc="ghost batch norm (groups of 32), 18 epochs, lr peak 0.6",
         changes=dict(bn_ghost_batch=32, epochs=18, lr_values=(0.0, 0.6, 0.0))),
    # measured: not measured on a GPU; published: 43 s (V100, Myrtle)
    dict(name="frozen_bn_scale", published_v100_s=43,
         doc="batch-norm scales frozen at 1, CELU(0.3), bias lr x64, logits x 1/16, 17 epochs",
         changes=dict(bn_freeze_scale=True, celu_alpha=0.3, bias_lr_mult=64.0, output_scale=1 / 16, epochs=17)),
    # measured: not measured on a GPU; published: 36 s (V100, Myrtle)
    dict(name="whitening", published_v100_s=36, doc="frozen 3x3 patch-whitening input layer, 14 epochs, lr peak 1.0, "
                                                    "cutout 5x5",
         changes=dict(whiten=True, epochs=14, lr_values=(0.0, 1.0, 0.0), cutout=5)),
    # measured: not measured on a GPU; published: 33.5 s (V100, Myrtle)
    dict(name="ema", published_v100_s=33.5,
         doc="EMA of the weights (0.99 every 5 steps), lr floored at 0.1 for the last 2 epochs, 13 epochs",
         changes=dict(ema_momentum=0.99, ema_every=5, epochs=13, lr_knots=(0, 0.2, 11 / 13),
                      lr_values=(0.0, 1.0, 0.1))),
    # measured: not measured on a GPU; published: 26 s (V100, Myrtle)
    dict(name="tta10", published_v100_s=26, doc="flip test-time augmentation, no cutout, 10 epochs (= myrtle10)",
         changes=dict(tta="flip", cutout=0, epochs=10, lr_knots=(0, 0.2, 0.8))),
]


def journey_recipes(steps):
    """The journey's recipes: each stage MYRTLE24 with its predecessors' changes and its own."""
    recipes, changes = {}, {}
    for i, step in enumerate(steps, 1):
        changes = {**changes, **step["changes"]}
        recipes[step["name"]] = replace(changed(MYRTLE24, **changes), name=step["name"],
                                        doc=f"journey {i}/{len(steps)}: {step['doc']}")
    return recipes


# airbench94.py (Jordan 2024, "94% on CIFAR-10 in 3.29 seconds"; our implementation of its published settings):
# the three-block network, 2x2 whitening of both signs with a bias trained 3 epochs, lookahead, alternating flips,
# translate 2, 6-view TTA; rates per 1024 images over the Nesterov gain.
# measured: 93.999%, 1.58 s (H200, n = 100, commit not recorded); published: 94%, 3.83 s (A100, airbench94)
FAST94 = Recipe(
    name="fast94", doc="3-block net, 2x2 whitening, dirac init, lookahead, alternating flip, 6-view TTA: 9.9 epochs at "
                       "batch 1024 (target 94%)",
    epochs=9.9, batch_size=1024, label_smoothing=0.2,
    network=NetworkSettings(model="fastnet", block_widths=(64, 256, 256), block_depth=2, act="gelu",
                            dirac_init=True, output_scale=1 / 9),
    batch_norm=BatchNormSettings(momentum=0.4, eps=1e-12, freeze_scale=True),      # 0.6 in airbench's convention
    whitening=WhiteningSettings(size=2, pad=0, both_signs=True, eps=5e-4, fit=WHITENING_FITS["airbench94"],
                                bias=WhiteningBiasSettings(epochs=3)),
    # the rate per 1024 images over the Nesterov gain (its hyp['opt']['lr']): from 0.2x to its peak at 23% of the run,
    # then to 0.07x
    lr=LRSettings(knots=(0, 0.23, 1), values=(0.2 * 11.5, 11.5, 0.07 * 11.5)),
    sgd=SGDSettings(lr_units="decoupled", momentum=0.85, nesterov=True,
                    weight_decay=0.0153,                    # per 1024 images, decoupled from the rate (its hyp['opt'])
                    bias_lr_mult=64.0),                     # batch norm's biases 64x the rate (its bias_scaler)
    augment=AugmentSettings(crop_pad=2, flip="alternate", cutout=0),
    tta=TTASettings(views="flip_translate", weights="airbench"),
    lookahead=LookaheadSettings(momentum=0.95, every=5))   # every 5 steps, decay 0.95^5 x (step / steps)^3

# airbench95 widens fast94; airbench96 (legacy/airbench96.py) widens it to 128/384/512 with a third convolution per
# block (the residual added before the last activation), translate 4, cutout 12, 37 epochs, lr 9 per 1024 warming up
# from 0.2x over the first 10% of the steps then linear to 0, weight decay 0.012, batch-norm momentum 0.1.
# measured: not measured on a GPU; published: none quoted here (airbench95)
FAST95 = replace(FAST94, name="fast95", doc="fast94 widened to 128/384/384 for 15 epochs (target 95%)", epochs=15,
                 network=replace(FAST94.network, block_widths=(128, 384, 384)),
                 lr=LRSettings(knots=(0, 0.23, 1), values=(0.2 * 10, 10.0, 0.07 * 10)))
# measured: not measured on a GPU; published: 96.03%, 34.7 s (A100, airbench96)
FAST96 = replace(FAST94, name="fast96", doc="airbench96 (legacy/airbench96.py): 128/384/512, 3 convs per block with a "
                                            "residual, translate 4, cutout 12, 37 epochs (target 96%)",
                 epochs=37, network=replace(FAST94.network, block_widths=(128, 384, 512), block_depth=3),
                 batch_norm=replace(FAST94.batch_norm, momentum=0.1),
                 lr=LRSettings(knots=(0, 0.1, 1), values=(0.2 * 9, 9.0, 0.0)),
                 sgd=replace(FAST94.sgd, weight_decay=0.012),
                 augment=replace(FAST94.augment, crop_pad=4, cutout=12))

# airbench94_muon.py: batch 2000, 8 epochs (200 steps), no lookahead, every
# rate linear from its peak to 0; Muon for the filters, SGD (torch's units) for the head (0.67) and the biases
# (0.053), weight decay 2e-6 x batch; the whitening bias from the convolution's initialisation, its rate falling to
# 0 over its 3 epochs; the head at unit std and the logits / its width.
# measured: not measured on a GPU; published: 94.01%, 2.59 s (A100, airbench94_muon.py)
FAST94_MUON = replace(
    FAST94, name="fast94_muon", doc="airbench94 with Muon (airbench94_muon.py): batch 2000, 8 epochs, Muon for the "
                                    "filters, no lookahead (target 94%)",
    epochs=8, batch_size=2000,
    network=replace(FAST94.network, head_unit_std=True, output_scale=1.0),
    whitening=replace(FAST94.whitening, bias=WhiteningBiasSettings(epochs=3, lr_mult=0.053 / 0.67, init="default",
                                                                   decay="linear")),
    lr=LRSettings(knots=(0, 1), values=(0.67, 0.0)),      # the head's rate a step (torch's units): its 0.67, to 0
    sgd=SGDSettings(lr_units="sum", momentum=0.85, nesterov=True,
                    weight_decay=2e-6,                      # per image of the batch: its wd = 2e-6 x 2,000
                    bias_lr_mult=0.053 / 0.67),             # batch norm's biases at its 0.053
    muon=MuonSettings(lr=0.24, momentum=0.6, ns_steps=3,
                      renorm_every=(1, 1)),                 # the filters back to their norm every step, as it does
    lookahead=None)

# The 2-second record (hiverge/cifar10-speedrun, cifar10_speedrun.py), each number its main()'s. Ours differs in: bf16
# weights with float32 masters and batch norm, Newton-Schulz in bf16 (theirs: all in fp16), and no rescaling of the
# Newton-Schulz input before its normalisation (theirs divides it away again).
# measured: 94.01%, 1.14 s (H200, n = 91, commit not recorded); published: 94.01%, 2.015 s (A100, hiverge)
FAST94_NEXT = Recipe(
    name="fast94_next", doc="the 2-second record: batched Newton-Schulz, SiLU, jitter, selective TTA (target 94%)",
    epochs=7.59,  # ceil(7.59 x 32) = 243 steps of 1,536 images: its total_train_steps
    batch_size=1536,  # images a step: its training_batch_size
    label_smoothing=0.09,
    network=NetworkSettings(model="fastnet", block_widths=(64, 256, 256), block_depth=2, act="silu",
                            dirac_init=True, output_scale=1.0, head_unit_std=True),
    batch_norm=BatchNormSettings(momentum=1 - 0.5566, eps=1e-12, freeze_scale=True),  # 0.5566 in their convention
    whitening=WhiteningSettings(
        size=2, pad=0, both_signs=True, eps=5e-4, act="gelu", fit=WHITENING_FITS["record"],
        bias=WhiteningBiasSettings(epochs=0.19,  # ceil(0.19 x 32) = 7 steps
                                   lr_mult=0.0573 / 0.5415,  # its bias_lr / head_lr
                                   init="default", decay="linear")),
    lr=LRSettings(knots=(0, 1), values=(0.5415, 0.0)),  # the head's rate a step (torch's units): its head_lr, to 0
    sgd=SGDSettings(lr_units="sum", momentum=0.825, nesterov=True,
                    weight_decay=1.0418e-6,  # per image: its wd = 1.0418e-6 x 1,536
                    bias_lr_mult=0.0573 / 0.5415),  # batch norm's biases at its bias_lr
    muon=MuonSettings(lr=0.205, momentum=0.655, ns_steps=3,
                      ns_coeffs=(3.4576, -4.7391, 2.0843),  # its tuned quintic (Jordan et al.'s: MUON_COEFFS)
                      renorm_every=(2, 17),  # its norm_freq = 2 + int(15 x progress): 2 to 17 steps
                      weight_decay=1.0418e-6, momentum_dtype="fp16", batched=True),
    augment=AugmentSettings(crop_pad=2, flip="alternate", cutout=0, jitter_brightness=0.1399,
                            jitter_contrast=0.1308),
    tta=TTASettings(views="flip_translate", fraction=0.25, weights="equal"),  # the 25% least confident images
    compile_step=True)

# measured: not measured on a GPU; published: none (an idea of ours)
FAST94_NEXT_LOWRES = replace(FAST94_NEXT, name="fast94_next_lowres",
                             doc="fast94_next with its first 2 epochs at 24 px: an idea of ours, measured beside "
                                 "fast94_next before it joins it (target 94%)",
                             augment=replace(FAST94_NEXT.augment, resolution_schedule=(24, 24)))

# Our lowest-FLOP 94% attempt: fast94_next_lowres with 0.3 epochs more at 32 px, which win back the low-resolution
# epochs' accuracy (94.07% +- 0.16 on the CPU, n = 13, at 0.242 PFLOP of training against fast94_next's 0.264).
# measured: not measured on a GPU; published: none (an idea of ours)
FAST94_LOWFLOP = replace(FAST94_NEXT_LOWRES, name="fast94_lowflop",
                         doc="fast94_next_lowres for 7.89 epochs: our lower-FLOP schedule (target 94%)", epochs=7.89)

# A resolution curriculum and its tail (Fulcrum Research's E1, 2026, published: 94.05% in 1.828 s on an A100,
# n = 200): fast94_lowflop's first epochs at 24 then 28 px, the rest at 32, the rate linear to 5% of its peak at 8.5
# epochs and held there, lookahead over the last 0.625 epochs (E1's: 20 steps of 32, from 8 steps before its decay's
# end, every 4).
# Its length is E1's own, chosen by E1's measurements of this schedule (its runners/results): 94.046% at 8.875
# epochs, the decay ending at 8.5 (n = 200), and 93.935% at 8.5, the decay at 8.125 (n = 64): about 0.3 points an
# epoch near 94%, so 8.875 is the shortest length measured above 94% and a shorter one would be a guess
# (docs/perf-notes.md).
# measured: not measured on a GPU; published: 94.05%, 1.828 s (A100, E1)
FAST94_CURRICULUM = replace(FAST94_LOWFLOP, name="fast94_curriculum",
                            doc="fast94_lowflop with E1's curriculum (3 epochs at 24 px, 3 at 28, the rest at 32) "
                                "and tail (the rate floored at 5% from 8.5 epochs, lookahead over the last 20 steps): "
                                "8.875 epochs (target 94%)", epochs=8.875,
                            lr=LRSettings(knots=(0, 8.5 / 8.875, 1), values=(0.5415, 0.0, 0.0), floor=0.05),
                            lookahead_tail=LookaheadTailSettings(decay=0.7, every=4, epochs=0.625),
                            augment=replace(FAST94_LOWFLOP.augment, resolution_schedule=(24, 24, 24, 28, 28, 28)))

RECIPES = {r.name: r for r in (MYRTLE24, MYRTLE10)}
RECIPES.update(journey_recipes(JOURNEY))
RECIPES.update({r.name: r for r in (FAST94, FAST95, FAST96, FAST94_MUON, FAST94_NEXT, FAST94_NEXT_LOWRES,
                                      FAST94_LOWFLOP, FAST94_CURRICULUM)})


# What each recipe's peer published (by its authors, not measured here), beside our figure on a GPU; the journey's
# stages: Myrtle's V100 times (JOURNEY's published_v100_s).
PEERS_PUBLISHED = {
    "myrtle24": "94%, 79 s (V100, Myrtle)", "myrtle10": "94.1%, 26 s (V100, Myrtle)",
    "fast94": "94%, 3.83 s (A100, airbench94)", "fast95": "none quoted here (airbench95)",
    "fast96": "96.03%, 34.7 s (A100, airbench96)", "fast94_muon": "94.01%, 2.59 s (A100, airbench94_muon.py)",
    "fast94_next": "94.01%, 2.015 s (A100, hiverge)", "fast94_curriculum": "94.05%, 1.828 s (A100, E1)",
    **{s["name"]: f"{s['published_v100_s']} s (V100, Myrtle)" for s in JOURNEY}}
MEASURED = re.compile(r"^(?P<indent>[ \t]*)# measured: (?P<text>.*)$")
DEFINITION = re.compile(r"^[ \t]*(?:[A-Z0-9_]+ = (?:Recipe|replace)\(|dict\(name=)")


def definitions(lines):
    """{recipe: the index of the line its definition starts on} in this file's lines (its name= on that line or the
    next)."""
    found = {}
    for i, line in enumerate(lines):
        if DEFINITION.match(line):
            name = re.search(r'name="(\w+)"', " ".join(lines[i:i + 2]))
            if name and name.group(1) not in found:
                found[name.group(1)] = i
    return found


def measured():
    """{recipe: its evidence line}: the comment benchmarks/report.py writes above its definition (our figure on a GPU
    and the peer's published one)."""
    lines = Path(__file__).read_text().splitlines()
    return {name: MEASURED.match(lines[i - 1])["text"] for name, i in definitions(lines).items()
            if i and MEASURED.match(lines[i - 1])}


def recipe(name, **changes):
    """The recipe `name` with settings changed by flag name, checked."""
    check_recipe_name(name)
    return changed(RECIPES[name], **changes)


def check_recipe_name(name):
    """Raises UsageError (one line, naming the recipes) unless `name` is a recipe's."""
    if name not in RECIPES:
        raise UsageError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
