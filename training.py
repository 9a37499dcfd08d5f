"""The parts of a training loop that both scripts share, each loop written out in its own script
(cifar10_fast.train_run, imagenet_fast.train_run): a run's independent random streams and its steps, the step,
weight averaging (EMA, lookahead), a compiled run's strictness, and the checkpoint an interrupted run resumes from
exactly. The clock is devices.timer; batch-norm statistics over ranks are distributed.py's.
"""
import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import devices
import distributed as D
from core import DataError
from settings import knob

INTERRUPTED = 75      # EX_TEMPFAIL: stopped on purpose after a checkpoint, resumable


def run_seeds(seed, rank=0):
    """The seeds of a run's independent random streams, from numpy's SeedSequence of (seed, stream[, rank]): "init"
    (the network, torch's global generator) and "shares" (the epochs' shares of the data among the ranks), the same
    on every rank, and the data's "order" and "augment"ation, each rank its own."""
    draw = lambda *key: int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)
    return {"init": draw(0), "order": draw(1, rank), "augment": draw(2, rank), "shares": draw(3)}


def epoch_steps(epochs, steps_per_epoch):
    """ceil(epochs × steps per epoch), as airbench counts steps (9.9 epochs of 48 steps: 476); epochs may be
    fractional. Less a hair, so that a product that should be whole (1.1 × 10 = 11.000000000000002) stays so."""
    return math.ceil(epochs * steps_per_epoch - 1e-9)


def run_steps(n_train, batch, epochs):
    """(steps per epoch, total steps) of a run of `epochs` (fractional: the last epoch is cut short) over n_train
    images in batches of `batch`; the last partial batch of an epoch is dropped."""
    steps_per_epoch = n_train // batch
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {batch} is larger than the {n_train} training images")
    return steps_per_epoch, max(1, epoch_steps(epochs, steps_per_epoch))


@dataclass(kw_only=True)
class Options:
    """How a run runs in either script (not what it computes): the accuracy whose first evaluation stops its clock,
    the evaluations between epochs (every eval_every-th; 0: only the last), the precision, progress on stderr."""
    target: float = 0.94
    eval_every: int = 1
    precision: str = "auto"
    progress: bool = False


def train_step(forward, optimizers, x, y, *, label_smoothing, dtype):
    """One step on the batch-summed loss (CIFAR-10's; ImageNet's is imagenet_fast.accumulated_step): forward (with its
    loss, when forward computes it: cifar10_fast.WithLoss), backward, every optimiser. Returns the logits and the
    batch's summed loss, detached (nothing waits for them)."""
    with devices.autocast(x.device, dtype):
        if getattr(forward, "takes_labels", False):
            logits, loss = forward(x, y)
        else:
            logits = forward(x)
            loss = F.cross_entropy(devices.float32_or_wider(logits), y, label_smoothing=label_smoothing,
                                   reduction="sum")
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach()


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

def float_state(model):
    return [t for t in model.state_dict().values() if t.is_floating_point()]


@dataclass(frozen=True, kw_only=True)
class EMA:
    """An exponential moving average of the weights, evaluated instead of them (Myrtle)."""
    PREFIX = "ema"
    OFF = ("momentum", 0.0)
    momentum: float = knob(0.99, low=0, high=1, doc="per step")
    every: int = knob(5, above=0, whole=True)


@dataclass(frozen=True, kw_only=True)
class Lookahead:
    """Lookahead (Zhang et al. 2019) as weight averaging (Jordan 2024): the slow weights end the run."""
    PREFIX = "lookahead"
    OFF = ("momentum", 0.0)
    momentum: float = knob(0.95, low=0, high=1)
    every: int = knob(5, above=0, whole=True)


class ExponentialAverage:
    """Exponential moving average of a model's parameters and batch-norm statistics, updated every `every` steps
    with decay momentum**every (so `momentum` is per step); the averaged model is the one evaluated."""

    def __init__(self, model, momentum, every):
        self.model = copy.deepcopy(model)
        self.rho, self.every = momentum ** every, every

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            torch._foreach_lerp_(float_state(self.model), float_state(model), 1 - self.rho)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


class LookaheadAverage:
    """Lookahead (Zhang et al. 2019) as weight averaging (Jordan 2024), every `every` steps; the model is evaluated:
        slow <- slow + (1 - decay)(fast - slow);  fast <- slow;  decay = momentum^every x (step / total steps)^3"""
    model = None

    def __init__(self, model, momentum, every):
        self.slow = [t.detach().clone() for t in float_state(model)]
        self.momentum, self.every = momentum, every

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            fast = float_state(model)
            torch._foreach_lerp_(self.slow, fast, 1 - self.momentum ** self.every * (step / total_steps) ** 3)
            torch._foreach_copy_(fast, self.slow)

    @torch.no_grad()
    def finish(self, model):
        """The hand-over, after the last scheduled update (airbench94): the slow weights end the run."""
        torch._foreach_copy_(float_state(model), self.slow)

    def state_dict(self):
        return self.slow

    def load_state_dict(self, state):
        torch._foreach_copy_(self.slow, state)


def averaging(model, *, ema=None, lookahead=None):
    """The run's weight averaging from its settings (each with .momentum and .every, or None): EMA, lookahead or
    None."""
    if ema:
        return ExponentialAverage(model, ema.momentum, ema.every)
    if lookahead:
        return LookaheadAverage(model, lookahead.momentum, lookahead.every)
    return None


def evaluation_model(model, average):
    """The weights a run evaluates: the EMA's when there is one, else the model's."""
    return average.model if average is not None and average.model is not None else model


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints

@dataclass(kw_only=True)
class Trainable:
    """What a checkpoint saves of a run in training and a resumed run loads back: the model, its optimisers, its
    weight averaging (or None) and its random generators (beside torch's global one)."""
    model: torch.nn.Module
    optimizers: list
    average: object
    generators: list


CHECKPOINT_KEYS = {"model", "optimizers", "averaging", "rng", "progress", "settings", "world", "store"}


def save_checkpoint(path, run, *, progress, settings, ctx, store=None):
    """Writes everything a resumed run needs (rank 0, atomically; every rank waits): the Trainable run, `progress`
    (the epoch reached, its rows, its clock, ...), the settings, the data's identity (`store`: {"digest", "name"}),
    and the random states of every rank gathered to all, so that each rank resumes its own streams exactly."""
    rng = [torch.get_rng_state(), *(g.get_state() for g in run.generators)]
    every = [rng]
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, rng)
    D.save_checkpoint(path, {
        "model": run.model.state_dict(), "optimizers": [o.state_dict() for o in run.optimizers],
        "averaging": run.average.state_dict() if run.average else None, "rng": every, "progress": progress,
        "settings": settings, "world": ctx.world_size, "store": store}, ctx)


def read_checkpoint(path, *, settings, ctx, store=None):
    """The state save_checkpoint left at path (rank 0 reads, every rank receives), or None when there is none yet. A
    checkpoint of another run (other settings, another number of ranks, another store) is a DataError of one line."""
    state = D.load_checkpoint(path, ctx)
    if state is None:
        return None
    missing = CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    if missing:
        raise DataError(f"{path}: not a readable checkpoint of this version (no {', '.join(sorted(missing))})")
    if state["world"] != ctx.world_size:
        raise DataError(f"{path}: written by {state['world']} rank{'s' * (state['world'] > 1)}, resumed by "
                        f"{ctx.world_size}; cannot resume")
    saved = state["store"] or {}
    if store and saved.get("digest") != store["digest"]:
        raise DataError(f"{path}: written on another store ({saved.get('name')}, index {saved.get('digest')}), "
                        f"resumed on {store['name']} (index {store['digest']}); resume on that store, or start "
                        "afresh without --resume")
    if state["settings"] != settings:
        diff = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        raise DataError(f"{path}: written with other settings ({', '.join(diff)}); cannot resume")
    D.print0(f"resumed from epoch {state['progress']['epoch']} of {path}")
    return state


def load_checkpoint(state, run, *, ctx):
    """Loads a checkpoint's state (read_checkpoint) into the Trainable run: the model, its optimisers, its averaging
    and this rank's random streams."""
    run.model.load_state_dict(state["model"])
    for opt, saved in zip(run.optimizers, state["optimizers"]):
        opt.load_state_dict(saved)
    if run.average:
        run.average.load_state_dict(state["averaging"])
    # random states must be CPU bytes, whatever device or form the checkpoint was read into
    torch_state, *gen_states = (t.to("cpu", torch.uint8) for t in state["rng"][ctx.rank])
    torch.set_rng_state(torch_state)
    for g, saved in zip(run.generators, gen_states):
        g.set_state(saved)
