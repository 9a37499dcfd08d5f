"""ImageNet's recipes: what a run computes (Recipe, its settings each beside the code that reads them), the published
runs it reproduces (FFCV's configurations; Goyal et al., Akiba et al., Mikami et al., Yamazaki et al.; fast.ai and
DIU's phase tables), a recipe by name with settings changed by flag, and a recipe as the command that trains it.
"""
from dataclasses import dataclass, replace

from core import UsageError
from distributed import HOOKS
from imagenet_data import CropAugmentSettings, ValidationSettings
from imagenet_models import LARSSettings, ImageNetNetworkSettings, RMSpropWarmupSettings, ImageNetSGDSettings
from schedules import ProgressiveResizingSettings, LRScheduleSettings, batch_for, phases
from settings import (always_present, as_flags, changed, check, check_own, command_text, component, flag_error,
                      knob)
from training import EMASettings, LookaheadSettings

MAX_EPOCHS = 1000         # beyond it a typo, not a run (every epoch is planned before the first)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What an ImageNet run computes. Settings left out (None) are techniques the recipe does not use."""
    name: str = "custom"
    doc: str = ""
    notes: tuple = ()           # what a setting given changed in another, said before training
    epochs: int = knob(16, above=0, high=MAX_EPOCHS, whole=True, doc="epochs to train")
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
    network: ImageNetNetworkSettings = always_present(ImageNetNetworkSettings())
    schedule: LRScheduleSettings = always_present(LRScheduleSettings(), title="learning rate")
    resolution: ProgressiveResizingSettings = always_present(ProgressiveResizingSettings(),
                                                             title="resolution and batch")
    augment: CropAugmentSettings = always_present(CropAugmentSettings(), title="augmentation")
    validation: ValidationSettings = always_present(ValidationSettings())
    sgd: ImageNetSGDSettings = always_present(ImageNetSGDSettings(), title="SGD")
    lars: LARSSettings = component(LARSSettings, title="LARS")
    rmsprop: RMSpropWarmupSettings = component(RMSpropWarmupSettings, title="RMSprop warm-up")
    ema: EMASettings = component(EMASettings, title="EMA")
    lookahead: LookaheadSettings = component(LookaheadSettings)
    target_top5: float = knob(0.0, low=0, high=1, doc="the top-5 accuracy whose first epoch stops the clock, instead "
                              "of --target's top-1 (fast.ai: 0.93); 0: none")
    bn_stats: str = knob("running", choices=("running", "last_batch"), doc="last_batch: the last batch's statistics "
                         "averaged over the ranks before each evaluation (Akiba et al.)")
    comm_hook: str = knob("none", choices=HOOKS, doc="under torchrun: how gradients travel (fp16, bf16: "
                          "compressed; torus: a 2D torus, Mikami et al.)")

    def __post_init__(self):
        check_own(self)

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


# FFCV's rn50 configurations (libffcv/ffcv-imagenet rn50_configs/, train_imagenet.py): ResNet-50 with BlurPool, 512
# images per GPU at lr 1.7 (their 8 GPUs: 4,096 a step), which their script applies whatever the number of GPUs,
# from 1e-4 of it up to it at epoch 2 and linearly to 0, label smoothing 0.1, res 160 -> 192, validation at 256 with
# flip TTA (published: 73.8% top-1 in 14.9 min on 8 A100s).
RN50_16EP = Recipe(
    name="rn50_16ep", doc="ResNet-50, 16 epochs, res 160->192, 512 images per GPU at lr 1.7 (published by FFCV: 73.8% "
                          "top-1 in 14.9 min on 8 A100s)",
    epochs=16, batch_size=512, per_gpu_batch=True,
    network=ImageNetNetworkSettings(model="resnet50", blurpool=True),
    schedule=LRScheduleSettings(lr=1.7, lr_scaling="none", warmup_epochs=2.0, warmup_start=1e-4, schedule="linear"),
    resolution=ProgressiveResizingSettings(min_res=160, max_res=192, res_start_epoch=11, res_end_epoch=13, res_step=32),
    augment=CropAugmentSettings(crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), flip=True),
    validation=ValidationSettings(res=256, crop=0.875, tta="flip"),
    sgd=ImageNetSGDSettings(momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.1))


def ffcv(name, doc, *, epochs, res_start, res_end, **changes):
    """An FFCV configuration: rn50_16ep stretched to `epochs` with its resolution ramp between res_start and
    res_end, and changes (rn18's network, batch, rate and decay)."""
    return replace(RN50_16EP, name=name, doc=doc, epochs=epochs, **changes,
                   resolution=replace(RN50_16EP.resolution, res_start_epoch=res_start, res_end_epoch=res_end))


# rn18: lr 0.5 for 1 GPU x 1024
RN18 = dict(network=ImageNetNetworkSettings(model="resnet18", blurpool=True), batch_size=1024,
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
    network=ImageNetNetworkSettings(model="resnet50", blurpool=False, zero_init=True),
    schedule=LRScheduleSettings(lr=0.1, lr_scale_base=256, warmup_epochs=5.0, warmup_start=256 / 8192, schedule="step",
                      step_epochs=(30.0, 60.0, 80.0)),
    resolution=ProgressiveResizingSettings(min_res=224, max_res=224, res_start_epoch=0, res_end_epoch=0),
    validation=ValidationSettings(res=224, crop=0.875, tta="none"),
    sgd=ImageNetSGDSettings(momentum=0.9, nesterov=False, weight_decay=1e-4, label_smoothing=0.0))
CLUSTER = dict(epochs=90, validation=GOYAL_8K.validation, resolution=GOYAL_8K.resolution,
               network=replace(GOYAL_8K.network, zero_init=False))


def mikami(name, doc, *, gpus, per_gpu, **changes):
    """Mikami et al. 2018 (Sony) on `gpus` GPUs: batch-size control, per_gpu images a GPU for 5 epochs then twice as
    many, at the rate 0.1 per 256 of the first batch, rising linearly from 0 over the 5 epochs and falling linearly to
    0 at epoch 90, unchanged when the batch doubles; 2D-torus all-reduce in fp16."""
    small, large = gpus * per_gpu, gpus * per_gpu * 2
    peak = 0.1 * small / 256
    return replace(GOYAL_8K, name=name, doc=doc, **CLUSTER, batch_size=large, bn_workers=gpus, comm_hook="torus_fp16",
                   schedule=LRScheduleSettings(lr_scaling="none", phases=(0, 5, 224, small, 0.0, peak, 0.08, 0, 0,
                                                                5, 90, 224, large, peak, 0.0, 0.08, 0, 0)), **changes)


def fastai(name, doc, *, machines, rows):
    """fast.ai and DIU's run on `machines` AWS machines of 8 V100s (cybertronai/imagenet18, train.py): its phase
    table, rows of (start epoch, end epoch, size, batch per GPU, lr at start, lr at end, smallest crop scale,
    rectangular validation), each phase validated at its size; else GOYAL_8K, with batch norm over each GPU's batch."""
    gpus = 8 * machines
    table = sum(((a, b, size, per_gpu * gpus, lr0, lr1, crop, size, rect)
                 for a, b, size, per_gpu, lr0, lr1, crop, rect in rows), ())
    return replace(GOYAL_8K, name=name, doc=doc, epochs=rows[-1][1], batch_size=rows[0][3] * gpus, bn_workers=gpus,
                   target_top5=0.93, schedule=LRScheduleSettings(lr_scaling="none", phases=table))


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
            schedule=LRScheduleSettings(lr=0.1, warmup_epochs=0.0, schedule="slow_start"),
            rmsprop=RMSpropWarmupSettings(beta_center=10.0, beta_period=5.0), bn_stats="last_batch", comm_hook="fp16"),
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
            schedule=LRScheduleSettings(lr=0.1, warmup_epochs=5.0, schedule="linear"),
            sgd=replace(GOYAL_8K.sgd, label_smoothing=0.1), comm_hook="fp16"),
    *(fastai(name, **kw) for name, kw in FASTAI.items()),
    Recipe(name="tiny", doc="resnet_tiny width 16 for tests and CPU demonstrations on small stores (res 32, 8 epochs)",
           epochs=8, batch_size=32, network=ImageNetNetworkSettings(model="resnet_tiny", width=16, blurpool=False),
           schedule=LRScheduleSettings(lr=0.2, warmup_epochs=1.0), sgd=ImageNetSGDSettings(weight_decay=5e-5),
           resolution=ProgressiveResizingSettings(min_res=32, max_res=32, res_start_epoch=0, res_end_epoch=0,
                                                  res_step=8),
           augment=CropAugmentSettings(crop_scale=(0.35, 1.0)),
           validation=ValidationSettings(res=32, crop=0.0, tta="none")),
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


def recipe_command(r, name):
    """Recipe r as the command that trains it from recipe `name`: its every setting a flag (a phase table's recipe
    without those the table sets, which its flags refuse), after a line of its name and what it is."""
    table = phases(r.schedule.phases) if r.schedule.phases else []
    skip = PHASED + (("val_res",) if any(ph.val_res for ph in table) else ()) if table else ()
    head = f"# {r.name}: {r.doc}" + ("; its phase table sets the epochs, batches, rates, resolutions" if skip else "")
    return head + "\n" + command_text(["python", "imagenet_fast.py", "train", "--recipe", name], as_flags(r, skip=skip))
