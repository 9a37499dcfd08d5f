"""The parts of a training loop, each loop written out in its own script (cifar10_fast.train_run,
imagenet_fast.train_run). Both scripts share a run's independent random streams (run_seeds), how a run runs
(RunOptions), the clock of its epochs and the table of their rows (EpochClock, epoch_table), the finite-loss check and weight averaging
(EMA, lookahead). CIFAR-10's alone: its step (train_step), lookahead's tail (LookaheadTail), a run's profile
(profiled), its warm-up's call count and a compiled run's strictness.
The clock underneath is devices.timer, batch-norm statistics over ranks distributed.py's, ImageNet's checkpoints
imagenet_checkpoints.py's.
"""
import copy
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import devices
from core import DataError
from outputs import write_atomic
from progress import Table
from settings import knob


def run_seeds(seed, rank=0):
    """The seeds of a run's independent random streams, from numpy's SeedSequence of (seed, stream[, rank]): "init"
    (the network, torch's global generator) and "shares" (the epochs' shares of the data among the ranks), the same
    on every rank, and the data's "order" and "augment"ation, each rank its own."""
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
    """One step on the batch-summed loss (CIFAR-10's; ImageNet's is imagenet_fast.accumulated_step): forward (with its
    loss_and_sums, when forward computes them: cifar10_fast.WithLoss), backward, every optimiser. Returns the step's
    sums (nothing waits for them)."""
    with devices.autocast(x.device, dtype):
        if getattr(forward, "takes_labels", False):
            loss, sums = forward(x, y)
        else:
            loss, sums = loss_and_sums(forward(x), y, label_smoothing=label_smoothing)
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return sums


def loss_and_sums(logits, y, *, label_smoothing):
    """(the batch's summed cross-entropy, the step's sums: [that loss, its correct predictions] detached, in the loss's
    dtype, counts exact below 2^24): each image's loss and whether it is right summed in one reduction, inside a
    compiled step's graph where it has one (what an epoch adds up for its table)."""
    losses = F.cross_entropy(devices.float32_or_wider(logits), y, label_smoothing=label_smoothing, reduction="none")
    sums = torch.stack([losses, logits.detach().argmax(1).eq(y).to(losses.dtype)]).sum(1)
    # the sums copied, not a view: a compiled graph's output that views another loses its gradient (torch 2.11, 2.14)
    return sums[0], sums.detach().clone()


def check_finite_loss(mean_loss, *, epoch, hint):
    """Raises DataError (one line: the epoch, the loss, `hint` at the likely setting) unless mean_loss is finite."""
    if not math.isfinite(mean_loss):
        raise DataError(f"epoch {epoch}: the training loss is {mean_loss}; {hint}")


def epoch_table(columns, file=None):
    """The per-epoch table both scripts print (progress.Table): accuracies and losses to 4 decimals, times to 2, each
    column as wide as its name or its numbers, under 100 characters for either script's columns."""
    return Table(columns, width=7, file=file, formats={"epoch_time": ".2f", "total_time": ".2f"},
                 widths={"epoch": 6, "res": 4, "batch": 6, "lr": 8, "decode": 11})


class EpochClock:
    """A run's clock (devices.timer, started once the network is built) and its table's rows, epoch by epoch: stop()
    ends an epoch's training on the clock, evaluated() its evaluation off it (the last one's time is the run's
    final_eval_time), rows_read() reads the clock where the host waits anyway, resume() leaves what the host did with
    the rows off the clock. Nothing waits for the device before a read."""

    def __init__(self, device, *, columns, accuracy, target, eval_every, reads_every_epoch=False):
        self.clock, self.columns, self.eval_every = devices.timer(device), columns, eval_every
        self.accuracy, self.target, self.reads_every_epoch = accuracy, target, reads_every_epoch
        self.rows, self.time_to_target, self.final_eval_time = [], None, 0.0
        self.pending, self.host_has_read = [], False

    def continue_from(self, progress):
        """A resumed run's rows, training time and time to target (as a checkpoint's progress records them)."""
        self.rows, self.clock.total, self.time_to_target = (progress[k] for k in ("rows", "train_time",
                                                                                   "time_to_target"))

    def stop(self, sums, seen, **columns):
        """The epoch's training ends on the clock (a mark, not waited for): its columns, and its summed loss and
        correct predictions (a tensor [loss, correct] on the device, read later) over `seen` images."""
        self.pending.append({**columns, "sums": sums, "seen": seen, "mark": self.clock.mark()})

    def evaluates(self, epoch, *, last):
        """Whether epoch (from 0) ends with an evaluation: the last, and every eval_every-th (0: the last alone)."""
        return last or bool(self.eval_every and (epoch + 1) % self.eval_every == 0)

    def evaluated(self, **metrics):
        """The epoch's evaluation ends, its columns `metrics`: its time off the clock."""
        self.pending[-1].update(metrics, eval_mark=self.clock.mark(include=False))

    def rows_read(self):
        """The rows of the epochs stopped since the last reading (added to self.rows), their times and sums read in
        one wait and one copy; none while the clock reads later (devices.EventTimer) and no evaluation has waited
        for the device, unless it reads every epoch."""
        if not self.pending or not (self.reads_every_epoch or "eval_mark" in self.pending[-1]
                                    or not self.clock.reads_later):
            return []
        readings, sums = self.clock.read(), torch.stack([p["sums"] for p in self.pending]).tolist()
        rows = []
        for p, (loss, correct) in zip(self.pending, sums):
            row = {**p, "train_loss": loss / p["seen"], "train_acc": correct / p["seen"],
                   "epoch_time": readings[p["mark"]][0], "total_time": readings[p["mark"]][1]}
            rows.append({c: row.get(c) for c in self.columns})
            if "eval_mark" in p:
                self.final_eval_time = readings[p["eval_mark"]][0]
                if self.time_to_target is None and row[self.accuracy] >= self.target:
                    self.time_to_target = row["total_time"]
        self.rows += rows
        self.pending, self.host_has_read = [], True
        return rows

    def resume(self):
        """The clock runs on, the host's reading and printing since rows_read off it (nothing when none were read)."""
        if self.host_has_read:
            self.clock.mark(include=False)
            self.host_has_read = False

    @property
    def train_time(self):
        return self.clock.total

    def times(self):
        """{"train_time", "final_eval_time", "time" (the two together), "time_to_target"} of the run so far."""
        return {"train_time": self.clock.total, "final_eval_time": self.final_eval_time,
                "time": self.clock.total + self.final_eval_time, "time_to_target": self.time_to_target}


@contextmanager
def profiled(path, device, *, rows=12, file=None):
    """While inside, torch.profiler records the CPU's operators and, on a CUDA GPU, its kernels; then the trace is
    written to path (Chrome's JSON, for Perfetto or chrome://tracing) and its top kernels by time printed on file
    (stderr). path None: nothing recorded."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    on_gpu = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * on_gpu]) as prof:
        yield
        devices.synchronize(device)
    write_atomic(path, prof.export_chrome_trace)
    print(f"wrote a trace of the run to {path}\n" + top_kernels(prof, rows), file=file or sys.stderr, flush=True)


def top_kernels(prof, rows=12):
    """A table of the events of torch.profiler's `prof` that took the most time: the GPU's kernels (their time on
    it) where any were recorded, else the CPU's operators (their own time), with their calls and share of the total."""
    from torch.autograd import DeviceType
    events = prof.key_averages()
    chosen = [e for e in events if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    time, what = (lambda e: e.self_device_time_total), "kernels by their time on the GPU"
    if not chosen:
        chosen = [e for e in events if e.self_cpu_time_total > 0]
        time, what = (lambda e: e.self_cpu_time_total), "operators by their own time on the CPU (no GPU kernels)"
    total = sum(time(e) for e in chosen)
    top = sorted(chosen, key=time, reverse=True)[:rows]
    lines = [f"top {len(top)} {what}, of {total / 1e3:.1f} ms in all:", f"{'ms':>9} {'share':>6} {'calls':>6}  name"]
    return "\n".join(lines + [f"{time(e) / 1e3:9.3f} {time(e) / total:6.1%} {e.count:6d}  {e.key[:100]}" for e in top])


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
    """Exponential moving average of a model's parameters (their float32 masters, where masters holds them) and
    batch-norm statistics, updated every `every` steps with decay momentum**every (so `momentum` is per step); the
    averaged model, in float32, is the one evaluated."""

    def __init__(self, model, momentum, every, masters=None):
        self.model = masters.float_copy(model) if masters else copy.deepcopy(model)
        self.rho, self.every, self.masters = momentum ** every, every, masters

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            torch._foreach_lerp_(float_state(self.model), float_state(model, self.masters), 1 - self.rho)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


class LookaheadAverage:
    """Lookahead (Zhang et al. 2019) as weight averaging (Jordan 2024), every `every` steps, of the weights (their
    float32 masters, where masters holds them, whose copies then take them); the model is evaluated:
        slow <- slow + (1 - decay)(fast - slow);  fast <- slow;  decay = momentum^every x (step / total steps)^3"""
    model = None

    def __init__(self, model, momentum, every, masters=None):
        self.slow = [t.detach().clone() for t in float_state(model, masters)]
        self.momentum, self.every, self.masters = momentum, every, masters

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            fast = float_state(model, self.masters)
            torch._foreach_lerp_(self.slow, fast, 1 - self.momentum ** self.every * (step / total_steps) ** 3)
            torch._foreach_copy_(fast, self.slow)
            if self.masters:
                self.masters.refresh()

    @torch.no_grad()
    def finish(self, model):
        """The hand-over, after the last scheduled update (airbench94): the slow weights end the run."""
        torch._foreach_copy_(float_state(model, self.masters), self.slow)
        if self.masters:
            self.masters.refresh()

    def state_dict(self):
        return self.slow

    def load_state_dict(self, state):
        torch._foreach_copy_(self.slow, state)


class LookaheadTail:
    """Lookahead over a run's last `steps` steps (E1): the average starts as the weights (their float32 masters, where
    masters holds them, whose copies then take them) and batch-norm statistics at the tail's first step, then every
    `every` steps
        ema <- decay ema + (1 - decay) w;  w <- ema"""
    model = None

    def __init__(self, model, decay, every, steps, masters=None):
        self.ema = [t.detach().clone() for t in float_state(model, masters)]     # made once; the tail's start fills it
        self.decay, self.every, self.steps, self.masters = decay, every, steps, masters

    @torch.no_grad()
    def update(self, model, step, total_steps):
        since = step - max(total_steps - self.steps, 0)     # from 0, the weights as built: those cloned above
        if since == 0:
            torch._foreach_copy_(self.ema, float_state(model, self.masters))
        elif since > 0 and since % self.every == 0:
            weights = float_state(model, self.masters)
            torch._foreach_lerp_(self.ema, weights, 1 - self.decay)
            torch._foreach_copy_(weights, self.ema)
            if self.masters:
                self.masters.refresh()

    def state_dict(self):
        return self.ema

    def load_state_dict(self, state):
        torch._foreach_copy_(self.ema, state)


def averaging(model, *, ema=None, lookahead=None, tail=None, steps_per_epoch=None, masters=None):
    """The run's weight averaging from its settings (EMASettings, LookaheadSettings, LookaheadTailSettings, or None):
    EMA, lookahead, lookahead's tail (its length from the run's steps_per_epoch) or None; of the float32 masters of
    the weights the model holds in a lower precision (masters: optim.MasterWeights)."""
    if ema:
        return ExponentialAverage(model, ema.momentum, ema.every, masters)
    if lookahead:
        return LookaheadAverage(model, lookahead.momentum, lookahead.every, masters)
    if tail:
        return LookaheadTail(model, tail.decay, tail.every, math.ceil(tail.epochs * steps_per_epoch), masters)
    return None


def evaluation_model(model, average, masters=None):
    """The weights a run evaluates: the EMA's when there is one, else the model's; given the masters of weights the
    model holds in a lower precision, a float32 copy holding them (what a run returns)."""
    if average is not None and average.model is not None:
        return average.model
    return masters.float_copy(model) if masters else model
