"""The parts of a training loop, each loop written out in its own script (cifar10_fast.train_run,
imagenet_fast.train_run). Both scripts share a run's independent random streams (run_seeds), how a run runs
(RunOptions), the finite-loss check and weight averaging (EMA, lookahead). CIFAR-10's alone: its step (train_step),
lookahead's tail (LookaheadTail), its warm-up's call count and a compiled run's strictness. The clock of the epochs
and the table of their rows are progress.py's (EpochClock, epoch_table), a run's profile outputs.py's (profiled),
batch-norm statistics over ranks distributed.py's, ImageNet's checkpoints imagenet_checkpoints.py's.
"""
import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import devices
from core import DataError
from schedules import epoch_steps
from settings import knob


def run_seeds(seed, rank=0):
    """{stream: seed} of a run's independent streams; "order" and "augment" per rank."""
    draw = lambda *key: int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)
    return {"init": draw(0), "order": draw(1, rank), "augment": draw(2, rank), "shares": draw(3)}


@dataclass(kw_only=True)
class RunOptions:
    """How a run runs in either script (not what it computes): the accuracy whose first evaluation stops its clock,
    the evaluations between epochs (every eval_every-th; 0: only the last), the precision, progress on stderr."""
    target: float = 0.94
    eval_every: int = 1
    precision: str = "auto"
    progress: bool = False


def train_step(forward, optimizers, x, y, *, label_smoothing, dtype):
    """One step on the batch-summed loss (forward's own where it takes labels: WithLoss): its sums, unread."""
    with devices.autocast(x.device, dtype):
        loss, sums = (forward(x, y) if getattr(forward, "takes_labels", False)
                      else loss_and_sums(forward(x), y, label_smoothing=label_smoothing))
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return sums


def loss_and_sums(logits, y, *, label_smoothing):
    """(the summed cross-entropy, [that loss, correct predictions] detached): one reduction, exact below 2^24."""
    losses = F.cross_entropy(devices.float32_or_wider(logits), y, label_smoothing=label_smoothing, reduction="none")
    sums = torch.stack([losses, logits.detach().argmax(1).eq(y).to(losses.dtype)]).sum(1)
    # copied, not a view: a compiled graph's output that views another loses its gradient
    return sums[0], sums.detach().clone()


def check_finite_loss(mean_loss, *, epoch, hint):
    """Raises DataError (one line: the epoch, the loss, `hint` at the likely setting) unless mean_loss is finite."""
    if not math.isfinite(mean_loss):
        raise DataError(f"epoch {epoch}: the training loss is {mean_loss}; {hint}")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")     # torch.compile's modes that capture CUDA graphs


def warmup_calls(compile_mode):
    """How often an untimed warm-up calls each compiled path: 3 where compile_mode captures CUDA graphs (CUDA-graph
    trees run a new function eagerly, record it on a later call and replay it from the next), else 1."""
    return 3 if compile_mode in CUDA_GRAPH_MODES else 1


def strict_compile():
    """While inside, a compiled function past dynamo's limit of graphs stops the run (it would otherwise run eagerly
    from then on, silently, inside the timed runs)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


# ---------------------------------------------------------------------------------------------------------------
# Weight averaging

def float_state(model, masters=None):
    """The model's floating-point parameters and buffers (state_dict's), each one it holds in a lower precision as its
    float32 master (masters: optim.MasterWeights): what weight averaging averages and hands over."""
    if not masters:
        return [t for t in model.state_dict().values() if t.is_floating_point()]
    return [t.detach() for t in masters.weights(model.state_dict(keep_vars=True).values()) if t.is_floating_point()]


@dataclass(frozen=True, kw_only=True)
class EMASettings:
    """An exponential moving average of the weights, evaluated instead of them (Myrtle)."""
    PREFIX = "ema"
    OFF = ("momentum", 0.0)
    momentum: float = knob(0.99, low=0, high=1, doc="per step")
    every: int = knob(5, above=0, whole=True, doc="steps between updates of the average")


@dataclass(frozen=True, kw_only=True)
class LookaheadSettings:
    """Lookahead (Zhang et al. 2019) as weight averaging (Jordan 2024): the slow weights end the run."""
    PREFIX = "lookahead"
    OFF = ("momentum", 0.0)
    momentum: float = knob(0.95, low=0, high=1, doc="per step, scaled by (step / steps)^3 over the run")
    every: int = knob(5, above=0, whole=True, doc="steps between the slow weights' updates")


@dataclass(frozen=True, kw_only=True)
class LookaheadTailSettings:
    """Lookahead over the run's last steps (Fulcrum Research's E1, 2026: its "EMA-lookahead tail"), LookaheadTail."""
    PREFIX = "lookahead_tail"
    OFF = ("decay", 0.0)
    decay: float = knob(0.7, low=0, high=1, doc="what the average keeps of itself at each update")
    every: int = knob(4, above=0, whole=True, doc="steps between the updates")
    epochs: float = knob(0.625, above=0, doc="the tail's length: it starts this many epochs (rounded up to whole "
                         "steps) before the run ends (E1: 20 steps of 32)")


class ExponentialAverage:
    """Exponential moving average (settings: EMASettings) of a model's parameters (their float32 masters, where
    masters holds them) and batch-norm statistics, updated every `every` steps with decay momentum**every (so
    `momentum` is per step); the averaged model, in float32, is the one evaluated."""

    def __init__(self, model, settings, masters=None):
        self.model = masters.float_copy(model) if masters else copy.deepcopy(model)
        self.rho, self.every, self.masters = settings.momentum ** settings.every, settings.every, masters

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            torch._foreach_lerp_(float_state(self.model), float_state(model, self.masters), 1 - self.rho)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


@torch.no_grad()
def pull_and_hand_over(average, weights, weight, masters):
    """Lookahead's update, in both its forms (and the network's lower-precision copies, where masters holds them):
        average <- average + weight (weights - average);  weights <- average"""
    torch._foreach_lerp_(average, weights, weight)
    torch._foreach_copy_(weights, average)
    if masters:
        masters.refresh()


class LookaheadAverage:
    """Lookahead (Zhang et al. 2019) as weight averaging (Jordan 2024; settings: LookaheadSettings), every `every`
    steps, of the weights (their float32 masters, where masters holds them, whose copies then take them), handed over
    whole at the last step:
        slow <- slow + (1 - decay)(fast - slow);  fast <- slow;  decay = momentum^every x (step / total steps)^3"""
    model = None

    def __init__(self, model, settings, masters=None):
        self.slow = [t.detach().clone() for t in float_state(model, masters)]
        self.momentum, self.every, self.masters = settings.momentum, settings.every, masters

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            decay = self.momentum ** self.every * (step / total_steps) ** 3
            pull_and_hand_over(self.slow, float_state(model, self.masters), 1 - decay, self.masters)
        if step == total_steps:
            self.finish(model)

    @torch.no_grad()
    def finish(self, model):
        """The hand-over, after the last step's scheduled update (airbench94): the slow weights end the run."""
        torch._foreach_copy_(float_state(model, self.masters), self.slow)
        if self.masters:
            self.masters.refresh()

    def state_dict(self):
        return self.slow

    def load_state_dict(self, state):
        torch._foreach_copy_(self.slow, state)


class LookaheadTail:
    """Lookahead over a run's last `epochs`, rounded up to whole steps (E1; settings: LookaheadTailSettings): the
    average starts as the weights (their float32 masters, where masters holds them, whose copies then take them) and
    batch-norm statistics at the tail's first step, then every `every` steps
        ema <- decay ema + (1 - decay) w;  w <- ema"""
    model = None

    def __init__(self, model, settings, steps_per_epoch, masters=None):
        self.ema = [t.detach().clone() for t in float_state(model, masters)]     # made once; the tail's start fills it
        self.decay, self.every, self.masters = settings.decay, settings.every, masters
        self.steps = epoch_steps(settings.epochs, steps_per_epoch)

    @torch.no_grad()
    def update(self, model, step, total_steps):
        since = step - max(total_steps - self.steps, 0)     # from 0, the weights as built: those cloned above
        if since == 0:
            torch._foreach_copy_(self.ema, float_state(model, self.masters))
        elif since > 0 and since % self.every == 0:
            pull_and_hand_over(self.ema, float_state(model, self.masters), 1 - self.decay, self.masters)

    def state_dict(self):
        return self.ema

    def load_state_dict(self, state):
        torch._foreach_copy_(self.ema, state)


def averaging(model, *, ema=None, lookahead=None, tail=None, steps_per_epoch=None, masters=None):
    """The run's weight average (of the float32 masters, given them), or None."""
    if ema:
        return ExponentialAverage(model, ema, masters)
    if lookahead:
        return LookaheadAverage(model, lookahead, masters)
    if tail:
        return LookaheadTail(model, tail, steps_per_epoch, masters)
    return None


def evaluation_model(model, average, masters=None):
    """The EMA's network, else the model (given masters, a float32 copy holding them)."""
    if getattr(average, "model", None) is not None:
        return average.model
    return masters.float_copy(model) if masters else model
