"""The schedules. CIFAR-10's: the learning rate over the run, linear between knots (LRSettings). ImageNet's: the
learning rate over the run (warm-up then linear, cosine, step or slow-start decay), the training resolution and batch
size of each epoch (progressive resizing, batch-size control) and a batch's share per rank, and the phase tables
(fast.ai's: epoch ranges, each with its size, batch, rate or ramp, crop scale and validation) that every ImageNet
schedule is read as, one row per epoch (plan), and each epoch on a rank (epoch_plans: its micro-batches and batch-norm
groups), with the settings they read (LRScheduleSettings, ProgressiveResizingSettings); and a CIFAR-10 run's steps
(run_steps).

Nothing here imports torch: each schedule is plain arithmetic on epochs and steps, tested on its own.

Papers:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, batch-size control, arXiv:1811.05233)
  Howard, Shaw, Bulatov 2018, fast.ai and DIU's "ImageNet in 18 minutes" (github.com/cybertronai/imagenet18, train.py)
"""
import bisect
import functools
import math
from dataclasses import dataclass, replace

from core import UsageError
from settings import check_own, flag_error, knob


def epoch_steps(epochs, steps_per_epoch):
    """ceil(epochs × steps per epoch), as airbench counts steps."""
    return math.ceil(epochs * steps_per_epoch - 1e-9)  # 1.1 × 10 = 11.000000000000002 stays 11


def run_steps(n_train, batch, epochs):
    """(steps per epoch, total steps) of `epochs` over n_train images in full batches."""
    check_batch_fits(n_train, batch)
    return n_train // batch, max(1, epoch_steps(epochs, n_train // batch))


def check_batch_fits(n_train, batch):
    """Raises ValueError unless n_train images make at least one batch of `batch`."""
    if n_train < batch:
        raise ValueError(f"batch size {batch} is larger than the {n_train} training images")


def per_rank_batch(global_batch, world):
    """The batch size of each rank; one global batch size defines the run whatever the number of processes."""
    if global_batch % world:
        raise ValueError(f"global batch size {global_batch} is not divisible by the world size {world}")
    return global_batch // world


# ----------------------------------------------------------------------------------------------------------
# CIFAR-10: the rate over the run

@dataclass(frozen=True, kw_only=True)
class LRSettings:
    """The learning rate over the run, linear between knots."""
    PREFIX = "lr"
    knots: tuple = knob((0, 5 / 24, 1), low=0, high=1, doc="fractions of the run where the rate's linear pieces meet")
    values: tuple = knob((0.0, 0.4, 0.0), low=0, doc="the rate at each knot (in --lr-units)")
    floor: float = knob(0.0, low=0, high=1, doc="a floor under the rate, as a fraction of its peak (E1: 0.05; 0: none)")

    def check(self):
        if len(self.knots) != len(self.values):
            raise UsageError(f"--lr-knots and --lr-values: must have the same length (here {len(self.knots)} and "
                             f"{len(self.values)})")
        if any(b < a for a, b in zip(self.knots, self.knots[1:])):
            raise flag_error("lr_knots", self.knots, "must not decrease")

    def at(self, t):
        """The rate at t (a fraction of the run)."""
        k, v = self.knots, self.values
        i = bisect.bisect_left(k, t)  # k[i - 1] < t <= k[i]
        if i in (0, len(k)):  # constant beyond the ends
            rate = v[min(i, len(v) - 1)]
        else:
            rate = v[i - 1] + (t - k[i - 1]) / (k[i] - k[i - 1]) * (v[i] - v[i - 1])
        return max(float(rate), self.floor * max(v))


# ----------------------------------------------------------------------------------------------------------
# ImageNet: the rate per lr_scale_base images over (fractional) epochs

@dataclass(frozen=True, kw_only=True)
class LRScheduleSettings:
    """The learning rate per lr_scale_base images of the batch (Goyal et al.'s linear scaling) or as written: a linear
    warm-up from warmup_start of it, then linear to 0, cosine, x0.1 at each of step_epochs, or Akiba et al.'s slow
    start; or a phase table (schedules.Phase), which sets each phase's resolution, batch, rate, crops and validation."""
    PREFIX = ""
    lr: float = knob(0.10625, low=0, doc="the rate after the warm-up (per --lr-scale-base images with --lr-scaling "
                     "linear)")
    lr_scale_base: int = knob(256, above=0, whole=True, doc="the images --lr is a rate per")
    warmup_epochs: float = knob(2.0, low=0, doc="epochs of linear warm-up to --lr")
    warmup_start: float = knob(0.0, low=0, high=1, doc="where the warm-up starts, as a fraction of --lr")
    schedule: str = knob("linear", choices=("linear", "cosine", "step", "slow_start"),
                         doc="the rate after the warm-up: linear to 0, cosine, x0.1 at each --step-epochs, or Akiba "
                             "et al.'s")
    step_epochs: tuple = knob((30.0, 60.0, 80.0), low=0,
                              doc="with --schedule step: the epochs where the rate drops x0.1")
    lr_scaling: str = knob("linear", choices=("linear", "none"),
                           doc="linear: lr is per --lr-scale-base images of the global batch (Goyal et al.); none: lr "
                               "is the optimiser's rate, whatever the batch and the number of GPUs (FFCV's script, "
                               "fast.ai's tables)")
    phases: tuple = knob((), low=0, doc="a phase table instead of the warm-up, decay, resolution and batch settings: "
                         "rows of start epoch, end epoch, res, global batch, lr at start, lr at end (linear between), "
                         "smallest crop scale, validation res (0: --val-res), rectangular validation (0 or 1), commas "
                         "between all (fast.ai's train.py)")

    def __post_init__(self):
        check_own(self)


# Akiba et al. 2017's 90 epochs: (from epoch, fraction of the peak rate)
SLOW_START = ((0, 0.5), (40, 0.075), (70, 0.01), (85, 0.001))


def slow_start_lr(epoch, peak_lr, epochs=90):
    """The slow-start schedule of Akiba et al. 2017 (sec. 3.2, their 90-epoch run), stretched to `epochs`:
    0.5 × peak for the first 40/90 of training, while the RMSprop warm-up hands over to SGD, then 0.075 ×
    peak to 70/90, 0.01 × to 85/90 and 0.001 × to the end."""
    at = epoch * 90 / epochs
    return peak_lr * [factor for start, factor in SLOW_START if start <= at][-1]


def lr_at(r, t):
    """Learning rate at t epochs of ImageNet recipe r, per lr_scale_base images or as the optimiser takes it
    (step_lr): linear across its phase when r has a phase table; else a linear warm-up over warmup_epochs from
    warmup_start x the rate there (0: from zero), then the schedule's decay (decayed_lr)."""
    if r.schedule.phases:
        ph = phase_at(r, t)
        return ph.lr_start + (ph.lr_end - ph.lr_start) * (t - ph.start) / (ph.end - ph.start)
    warm = r.schedule.warmup_epochs
    if t < warm:
        top, start = decayed_lr(r, warm), r.schedule.warmup_start
        return top * start + top * (1 - start) * t / warm
    return decayed_lr(r, t)


def decayed_lr(r, t):
    """The schedule after the warm-up, at t epochs (lr_at)."""
    s = r.schedule
    peak, warm, end = s.lr, s.warmup_epochs, r.epochs
    f = min(1.0, (t - warm) / max(end - warm, 1e-9))
    if s.schedule == "linear":
        return peak * (1 - f)
    if s.schedule == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * f))
    if s.schedule == "step":
        return peak * 0.1 ** sum(t >= e for e in s.step_epochs)
    if s.schedule == "slow_start":
        return slow_start_lr(t, peak, end)
    raise ValueError(f"unknown schedule {s.schedule!r}; choose from linear, cosine, step, slow_start")


@dataclass(frozen=True, kw_only=True)
class ProgressiveResizingSettings:
    """Each epoch's training resolution (FFCV's progressive resizing: min_res to max_res between two epochs, in
    steps of res_step) and batch (the global batch_size, larger at lower resolutions with batch_scale, or Mikami et
    al.'s batch-size control: (epoch, global batch) pairs)."""
    PREFIX = ""
    min_res: int = knob(160, above=0, whole=True, doc="the training resolution until --res-start-epoch")
    max_res: int = knob(192, above=0, whole=True, doc="the training resolution from --res-end-epoch")
    res_start_epoch: int = knob(11, low=0, whole=True, doc="the epoch the resolution starts to grow")
    res_end_epoch: int = knob(13, low=0, whole=True, doc="the epoch it reaches --max-res")
    res_step: int = knob(32, above=0, whole=True, doc="resolutions rounded to a multiple of this")
    batch_scale: bool = knob(False, doc="larger batches at lower resolutions, by the pixels saved")
    batch_schedule: tuple = knob((), low=0, whole=True, doc="Mikami et al.'s batch-size control: epoch,global batch "
                                 "pairs from epoch 0 (empty: none)")

    def __post_init__(self):
        check_own(self)

    def check(self):
        if round(self.min_res / self.res_step) == 0:
            raise flag_error("res_step", self.res_step, f"rounds --min-res {self.min_res} to 0 pixels; use at most "
                                                        f"{self.min_res}")


def res_at(r, epoch):
    """Training resolution of an epoch (0-based) of ImageNet recipe r: its phase's, or min_res until res_start_epoch,
    linear to max_res at res_end_epoch, rounded to a multiple of res_step (FFCV's progressive resizing)."""
    if r.schedule.phases:
        return phase_at(r, epoch).res
    s = r.resolution
    a, b = s.res_start_epoch, s.res_end_epoch
    f = 1.0 if epoch >= b else 0.0 if epoch <= a else (epoch - a) / (b - a)
    res = s.min_res + f * (s.max_res - s.min_res)
    return int(round(res / s.res_step)) * s.res_step


def batch_at(batch, s, res):
    """Batch size at a resolution: `batch` at max_res, and with batch_scale, larger at lower resolutions in
    proportion to the pixels saved (same activation memory), a multiple of 8 (s: a recipe's .resolution)."""
    if not s.batch_scale:
        return batch
    return max(8, int(batch * (s.max_res / res) ** 2) // 8 * 8)


class BatchSizeSchedule:
    """Batch-size control (Mikami et al. 2018): knots [(epoch, global batch), ...] from epoch 0, small early to keep
    accuracy, large later for fewer steps to synchronise; the learning rate scales with the batch (Goyal's linear
    rule)."""

    def __init__(self, knots):
        knots = [(int(e), int(b)) for e, b in knots]
        if not knots or knots[0][0] != 0:
            raise ValueError("batch-size schedule must start at epoch 0")
        if any(b <= 0 for _, b in knots):
            raise ValueError("batch sizes must be positive")
        if any(e1 <= e0 for (e0, _), (e1, _) in zip(knots, knots[1:])):
            raise ValueError("batch-size schedule epochs must increase strictly")
        if any(b1 < b0 for (_, b0), (_, b1) in zip(knots, knots[1:])):
            raise ValueError("batch-size schedule must not shrink the batch")
        self.knots = knots

    def batch(self, epoch):
        return [b for e, b in self.knots if e <= epoch][-1]

    def lr_scale(self, epoch):
        return self.batch(epoch) / self.knots[0][1]

    def per_rank(self, epoch, world):
        return per_rank_batch(self.batch(epoch), world)


def batch_for(r, epoch, world=1):
    """This rank's batch in an epoch of ImageNet recipe r: its share of the phase table's global batch, else of the
    batch-size schedule's (BatchSizeSchedule's knots, flattened), else batch_at of its share of batch_size, or of
    batch_size itself with per_gpu_batch (FFCV: each GPU's batch)."""
    if r.schedule.phases:
        return per_rank_batch(phase_at(r, epoch).batch, world)
    pairs = r.resolution.batch_schedule
    if len(pairs) % 2:
        raise ValueError(f"batch schedule {pairs} is not (epoch, batch) pairs")
    if pairs:
        return BatchSizeSchedule(zip(pairs[::2], pairs[1::2])).per_rank(epoch, world)
    rank = r.batch_size if r.per_gpu_batch else per_rank_batch(r.batch_size, world)
    return batch_at(rank, r.resolution, res_at(r, epoch))


def step_lr(r, t, batch):
    """The optimiser's rate at t epochs of recipe r stepping on a global batch: lr_at x batch / lr_scale_base
    (lr_scaling linear: Goyal et al.'s rule), or lr_at itself (none: the rate as written, whatever the batch)."""
    s = r.schedule
    return lr_at(r, t) * batch / s.lr_scale_base if s.lr_scaling == "linear" else lr_at(r, t)


# ----------------------------------------------------------------------------------------------------------
# ImageNet: phase tables (fast.ai's train.py), and every schedule read as one row per epoch

PHASE_FIELDS = ("start", "end", "res", "batch", "lr_start", "lr_end", "crop_min", "val_res", "rect_val")


@dataclass(frozen=True)
class Phase:
    """Epochs [start, end) of a run: the training resolution, the global batch, the rate at the phase's start and
    end (linear in between; equal: a constant rate), the smallest crop scale, and validation at val_res (0: the
    recipe's) of the whole image when rect_val (fast.ai's rectangular validation), else as the recipe crops it."""
    start: int
    end: int
    res: int
    batch: int
    lr_start: float
    lr_end: float
    crop_min: float
    val_res: int
    rect_val: bool


@functools.lru_cache(maxsize=64)
def phases(table):
    """The Phases of a phase table (rows of PHASE_FIELDS, flattened), contiguous from epoch 0; a ValueError naming
    the first bad row otherwise."""
    width = len(PHASE_FIELDS)
    if len(table) % width or not table:
        raise ValueError(f"must be rows of {width} numbers (start, end, res, batch, lr at start, lr at end, smallest "
                         f"crop scale, validation res or 0, rectangular validation 0 or 1); got {len(table)} numbers")
    out = []
    for k in range(len(table) // width):
        start, end, res, batch, lr0, lr1, crop, val_res, rect = table[k * width:(k + 1) * width]
        at = f"row {k + 1}"
        before = out[-1].end if out else 0
        if start != before:
            raise ValueError(f"{at} starts at epoch {start:g}; " + (f"the row before ends at {before:g}" if out else
                                                                     "the first starts at 0"))
        if not all(float(v).is_integer() for v in (start, end, res, batch, val_res)):
            raise ValueError(f"{at}: epochs, res, batch and validation res are whole numbers")
        if end <= start:
            raise ValueError(f"{at} ends at epoch {end:g}, not after its start {start:g}")
        if res <= 0 or batch <= 0:
            raise ValueError(f"{at}: res and batch must be positive")
        if not 0 < crop <= 1:
            raise ValueError(f"{at}: the smallest crop scale must be in (0, 1]")
        if rect not in (0, 1):
            raise ValueError(f"{at}: rectangular validation is 0 or 1")
        out.append(Phase(int(start), int(end), int(res), int(batch), lr0, lr1, crop, int(val_res), bool(rect)))
    return out


def phase_at(r, t):
    """The Phase of recipe r's table holding t epochs (the last one from its end on)."""
    table = phases(r.schedule.phases)
    return next((ph for ph in table if t < ph.end), table[-1])


def crop_at(r, epoch):
    """The crop scale range (smallest, largest fraction of the image) of an epoch: the phase's smallest."""
    low, high = r.augment.crop_scale
    return (phase_at(r, epoch).crop_min, high) if r.schedule.phases else (low, high)


def val_at(r, epoch):
    """(shorter side, centre crop) that validation after an epoch sees: the recipe's (its .validation), or its phase's
    resolution and, with rect_val, the whole image (crop 0, imagenet_data.val_view)."""
    v = r.validation
    if not r.schedule.phases:
        return v.res, v.crop
    ph = phase_at(r, epoch)
    return ph.val_res or v.res, 0.0 if ph.rect_val else v.crop


def plan(r, world=1):
    """Every epoch of recipe r on world ranks: {"epoch" (1-based), "res", "batch" (global), "lr_start", "lr_end"
    (the optimiser's rates at its start and, in the limit, its end: step_lr), "crop_min", "val" (val_at)}."""
    rows = []
    for e in range(r.epochs):
        batch = batch_for(r, e, world) * world
        rows.append({"epoch": e + 1, "res": res_at(r, e), "batch": batch, "lr_start": step_lr(r, e, batch),
                     "lr_end": step_lr(r, e + 1 - 1e-9, batch), "crop_min": crop_at(r, e)[0], "val": val_at(r, e)})
    return rows


# ----------------------------------------------------------------------------------------------------------
# ImageNet: each epoch on this rank

@dataclass(frozen=True, kw_only=True)
class EpochPlan:
    """One epoch of a run on this rank (plan's row): its resolution, this rank's batch in micro-batches of `micro`
    images normalised in groups of `group` (0: whole micro-batches), the steps of the epoch, the run's steps before it
    and in all, its crops (an imagenet_data.CropAugmentSettings) and what validation after it sees (an
    imagenet_data.ValidationSettings)."""
    epoch: int
    res: int
    batch: int
    micro: int
    group: int
    steps: int
    first_step: int
    total_steps: int
    augment: object
    validation: object


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
