"""ImageNet's schedules: the learning rate over the run (warm-up then linear, cosine, step or slow-start decay), the
training resolution and batch size of each epoch (progressive resizing, batch-size control) and a batch's share per
rank. CIFAR-10's rate is its recipe's own (cifar10_fast.LR.at), its steps are its data's (cifar_data.run_steps).

Nothing here imports torch: each schedule is plain arithmetic on epochs and steps, tested on its own.

Papers:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, batch-size control, arXiv:1811.05233)
"""
import math
from dataclasses import dataclass


def per_rank_batch(global_batch, world):
    """The batch size of each rank; one global batch size defines the run whatever the number of processes."""
    if global_batch % world:
        raise ValueError(f"global batch size {global_batch} is not divisible by the world size {world}")
    return global_batch // world


def linear_scaled_lr(base_lr, global_batch, base_batch=256):
    """Goyal et al. 2017, linear scaling rule: multiply the learning rate by k when the batch grows k times."""
    return base_lr * global_batch / base_batch


# ----------------------------------------------------------------------------------------------------------
# ImageNet: the rate per lr_scale_base images over (fractional) epochs

# Akiba et al. 2017's 90 epochs: (from epoch, fraction of the peak rate)
SLOW_START = ((0, 0.5), (40, 0.075), (70, 0.01), (85, 0.001))


def slow_start_lr(epoch, peak_lr, epochs=90):
    """The slow-start schedule of Akiba et al. 2017 (sec. 3.2, their 90-epoch run), stretched to `epochs`:
    0.5 × peak for the first 40/90 of training, while the RMSprop warm-up hands over to SGD, then 0.075 ×
    peak to 70/90, 0.01 × to 85/90 and 0.001 × to the end."""
    at = epoch * 90 / epochs
    return peak_lr * [factor for start, factor in SLOW_START if start <= at][-1]


def lr_at(r, t):
    """Learning rate per lr_scale_base images at t epochs of an ImageNet recipe r (its .schedule): a linear warm-up
    over warmup_epochs from warmup_start x the schedule's rate there (0: from zero; Goyal et al. start from the rate
    of one 256-image worker) up to it, then the schedule: linear to 0 at the end, cosine to 0, x0.1 at each of
    step_epochs, or slow_start (Akiba et al.'s 90-epoch schedule stretched to the run: 0.5 x lr for the first 40/90
    while RMSprop-to-SGD hands over, then 0.075, 0.01 and 0.001 x lr)."""
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


def res_at(r, epoch):
    """Training resolution of an epoch (0-based) of an ImageNet recipe r (its .resolution): min_res until
    res_start_epoch, linear to max_res at res_end_epoch, rounded to a multiple of res_step (FFCV's progressive
    resizing)."""
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
    """Batch-size control, Mikami et al. 2018 (Sony): the global batch grows during training, per epoch.

    A small batch early keeps accuracy; a large batch later (when the loss landscape is flatter) gives fewer,
    cheaper-to-synchronise steps. knots = [(0, 16384), (30, 32768), ...]: from each epoch on, that batch size.
    The learning rate is scaled along with the batch (Goyal's linear rule): lr_scale = batch / first batch.
    """

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
    """This rank's batch in an epoch of an ImageNet recipe r: from the batch-size schedule (Mikami et al. 2018: the
    global batch grows during training; flattened (epoch, global batch) pairs) if there is one, else batch_at of
    this rank's share of batch_size."""
    pairs = r.resolution.batch_schedule
    if len(pairs) % 2:
        raise ValueError(f"batch schedule {pairs} is not (epoch, batch) pairs")
    if pairs:
        return BatchSizeSchedule(zip(pairs[::2], pairs[1::2])).per_rank(epoch, world)
    return batch_at(per_rank_batch(r.batch_size, world), r.resolution, res_at(r, epoch))
