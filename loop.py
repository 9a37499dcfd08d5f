"""The one training loop, for CIFAR-10 and ImageNet alike: one network trained from a fixed seed, epoch by epoch,
read top to bottom in train(). Each script builds what differs as a Run (cifar10_fast.start, imagenet_fast.start):
its network, optimisers, batches, schedule and evaluation. The loop holds what they share: the seeds and the
clock, the steps, weight averaging (EMA, lookahead), batch-norm statistics from the last batch, progress, the
evaluation of the chosen epochs, the rows, and checkpoints that an interrupted run resumes from exactly.

The clock starts once the network is built (as the references' does: airbench's starts after the model is
constructed) and covers everything training needs from there except the per-epoch evaluations and checkpoint writes:
the run's timed set-up (CIFAR-10's whitening fit), augmentation, the steps. On a GPU it reads CUDA events, as the
references do (devices.timer). The final evaluation is timed on its own (final_eval_time), and time = train_time +
final_eval_time is what a user waits for a trained, evaluated network.
"""
import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import devices
import distributed as D
from core import DataError, Heartbeat, Progress
from optim import set_lr

INTERRUPTED = 75      # EX_TEMPFAIL: stopped on purpose after a checkpoint, resumable


@dataclass(kw_only=True)
class Run:
    """What a script builds for one run (the network from torch's seed, already set; random draws from `generators`).
    batches(epoch) yields that epoch's (x, y) on the device; schedule(epoch, i, step) gives the rate of the coming
    step (in the optimisers' units, see optim.set_lr) and the fractional epoch it falls in; evaluate(model, final)
    gives the row's `metrics` (final: with the recipe's test-time augmentation), of which `accuracy` meets the
    target; before_step(step) does what a step needs first; columns(epoch) adds an epoch's own row fields;
    example(epoch) is an input of that epoch's shape, for DDP's buckets on resume (distributed.rehearse_backward)."""
    model: torch.nn.Module           # the parameters: trained, averaged, checkpointed, returned
    forward: object                  # what a step calls: model, or it inside DistributedDataParallel and/or compiled
    optimizers: list
    generators: dict                 # the run's own random streams: "order" of the data, its "augment"ation
    steps: list                      # steps in each full epoch
    total_steps: int                 # the run's steps: fewer than the epochs' when the last epoch is fractional
    batches: object
    schedule: object
    evaluate: object
    metrics: tuple
    accuracy: str
    wrapped: bool = False            # inside DistributedDataParallel (under torchrun, with one process too)
    mean_loss: bool = False          # the batch's mean loss (ImageNet) rather than its sum (CIFAR-10's units)
    before_step: object = None
    columns: object = None
    example: object = None
    init: object = None              # set-up the clock counts, done once the clock starts (the whitening fit)


def train_step(forward, optimizers, x, y, *, label_smoothing, dtype, mean=False):
    """One step: forward (with its loss, when forward computes it: tb.WithLoss), backward, every optimiser. Returns
    the logits and the batch's summed loss, detached (nothing waits for them)."""
    with devices.autocast(x.device, dtype):
        if getattr(forward, "takes_labels", False):
            logits, loss = forward(x, y)
        else:
            logits = forward(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=label_smoothing,
                                   reduction="mean" if mean else "sum")
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach() * len(y) if mean else loss.detach()


# ---------------------------------------------------------------------------------------------------------------
# Weight averaging

def float_state(model):
    return [t for t in model.state_dict().values() if t.is_floating_point()]


class EMA:
    """Exponential moving average of a model's parameters and batch-norm statistics, updated every `every` steps
    with decay momentum**every (so `momentum` is per step); the averaged model is the one evaluated."""

    def __init__(self, model, momentum, every):
        self.model = copy.deepcopy(model)
        self.rho, self.every = momentum ** every, every

    @torch.no_grad()
    def update(self, model, step, total_steps):
        if step % self.every == 0:
            torch._foreach_lerp_(float_state(self.model), float_state(model), 1 - self.rho)

    def finish(self, model):
        pass

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


class Lookahead:
    """Lookahead (Zhang et al. 2019) used as weight averaging (Jordan 2024): every `every` steps the slow weights
    move towards the fast ones, slow ← slow + (1 - decay)(fast - slow), and the fast weights restart from the slow
    ones, with decay = momentum**every × (step / total steps)³, rising over the run; finish() hands the slow
    weights to the model (decay 1). The model itself is the one evaluated."""
    model = None

    def __init__(self, model, momentum, every):
        self.slow = [t.detach().clone() for t in float_state(model)]
        self.momentum, self.every = momentum, every

    @torch.no_grad()
    def update(self, model, step, total_steps, decay=None):
        if decay is None:
            if step % self.every:
                return
            decay = self.momentum ** self.every * (step / total_steps) ** 3
        fast = float_state(model)
        torch._foreach_lerp_(self.slow, fast, 1 - decay)
        torch._foreach_copy_(fast, self.slow)

    def finish(self, model):
        """The hand-over, after the last scheduled update (airbench94)."""
        self.update(model, 0, 1, decay=1.0)

    def state_dict(self):
        return self.slow

    def load_state_dict(self, state):
        torch._foreach_copy_(self.slow, state)


def averaging(model, hp):
    """The run's weight averaging from its hyperparameters: EMA, lookahead or none."""
    if hp["ema_momentum"]:
        return EMA(model, hp["ema_momentum"], hp["ema_every"])
    if hp["lookahead_momentum"]:
        return Lookahead(model, hp["lookahead_momentum"], hp["lookahead_every"])
    return None


# ---------------------------------------------------------------------------------------------------------------
# Random streams

def run_seeds(seed, rank=0):
    """The seeds of a run's independent random streams, from numpy's SeedSequence of (seed, stream[, rank]), so that
    no draw of one depends on another: "init" for the network (torch's global generator; the same on every rank),
    "order" of the data and its "augment"ation (each rank its own)."""
    draw = lambda *key: int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)
    return {"init": draw(0), "order": draw(1, rank), "augment": draw(2, rank)}


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints

CHECKPOINT_KEYS = {"model", "optimizers", "averaging", "rng", "epoch", "rows", "train_time", "time_to_target", "hp",
                   "world"}


def checkpoint_state(run, average, epoch, *, rows, timer, time_to_target, hp, world):
    """Everything a resumed run needs, with the random states of every rank (gathered to all), so that each rank
    resumes its own augmentation stream exactly."""
    rng = [torch.get_rng_state(), *(g.get_state() for g in run.generators.values())]
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, rng)
    else:
        every = [rng]
    return {"model": run.model.state_dict(), "optimizers": [o.state_dict() for o in run.optimizers],
            "averaging": average.state_dict() if average else None, "rng": every, "epoch": epoch, "rows": rows,
            "train_time": timer.total, "time_to_target": time_to_target, "hp": dict(hp), "world": world}


def check_checkpoint(state, checkpoint, hp, world):
    """A DataError of one line unless state is a checkpoint of this run: the same number of ranks, then the same
    hyperparameters (a world of another size would show as another batch otherwise)."""
    missing = CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    if missing:
        raise DataError(f"{checkpoint}: not a readable checkpoint of this version (no {', '.join(sorted(missing))})")
    if state["world"] != world:
        raise DataError(f"{checkpoint}: written by {state['world']} rank{'s' * (state['world'] > 1)}, resumed by "
                        f"{world}; cannot resume")
    if state["hp"] != dict(hp):
        diff = sorted(k for k in hp if state["hp"].get(k) != hp[k])
        raise DataError(f"{checkpoint}: written with other hyperparameters ({', '.join(diff)}); cannot resume")


# ---------------------------------------------------------------------------------------------------------------
# The loop

def train(start, hp, *, device, seed=0, dtype=torch.float32, ctx=None, target=1.0, eval_every=1, on_epoch=None,
          checkpoint=None, resume=False, interrupt_after=None, progress_after_s=None, on_first_steps=None):
    """Trains one network: start(run_seeds(seed, rank)) builds its Run after torch's seed is set; returns
    {"seed", "rows", "final_acc", "train_time", "final_eval_time", "time", "time_to_target", "model"} (the model
    evaluated: the EMA's when there is one).

    Every eval_every-th epoch before the last is evaluated without test-time augmentation (0: none), the last with
    it; the others' rows hold None. The first evaluated epoch whose accuracy reaches target stops time_to_target.
    With `checkpoint`, the state after every epoch is written there (rank 0, atomically); `resume` continues from it
    exactly; interrupt_after (an epoch) exits with INTERRUPTED after that epoch's checkpoint, as a preempted job
    would. Under torchrun (ctx) every rank builds the same network and draws its own batches. on_epoch(row) follows
    every epoch; with progress_after_s an epoch that looks longer shows its steps on stderr (core.Progress);
    on_first_steps(seconds per step) is called once, after the third step."""
    ctx = ctx or D.Context()
    seeds = run_seeds(seed, ctx.rank)
    torch.manual_seed(seeds["init"])
    run = start(seeds)          # the network built: before the clock, as the references build it
    timer = devices.timer(device)
    if run.init:
        run.init()
    if hp["bn_stats"] == "last_batch":
        D.use_last_batch_stats(run.model)
    average = averaging(run.model, hp)
    first, rows, time_to_target = 0, [], None
    state = D.load_checkpoint(checkpoint, ctx) if resume and checkpoint else None   # rank 0 reads, all receive
    if state is not None:
        check_checkpoint(state, checkpoint, hp, ctx.world_size)
        if run.wrapped:         # DDP's buckets as the uninterrupted run has them, so its sums round the same
            with devices.autocast(device, dtype):
                D.rehearse_backward(run.forward, run.example(state["epoch"]))
        run.model.load_state_dict(state["model"])
        for opt, saved in zip(run.optimizers, state["optimizers"]):
            opt.load_state_dict(saved)
        if average:
            average.load_state_dict(state["averaging"])
        # random states must be CPU bytes, whatever device or form the checkpoint was read into
        torch_state, *gen_states = (t.to("cpu", torch.uint8) for t in state["rng"][ctx.rank])
        torch.set_rng_state(torch_state)
        for g, saved in zip(run.generators.values(), gen_states):
            g.set_state(saved)
        first, rows, time_to_target = state["epoch"], state["rows"], state["time_to_target"]
        timer.total = state["train_time"]
        D.print0(f"resumed from epoch {first} of {checkpoint}")
        for row in rows:
            on_epoch and on_epoch(row)

    epochs, step, final_eval_time = len(run.steps), sum(run.steps[:first]), 0.0
    for epoch in range(first, epochs):
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        seen = 0
        bar = (Progress(min(run.steps[epoch], run.total_steps - step), f"epoch {epoch + 1}", progress_after_s)
               if progress_after_s is not None else None)
        for i, (x, y) in enumerate(run.batches(epoch)):
            lr, clock = run.schedule(epoch, i, step)
            set_lr(run.optimizers, lr, step, clock)        # the fractional epoch: RMSprop-to-SGD's clock
            if run.before_step:
                run.before_step(step)
            logits, loss = train_step(run.forward, run.optimizers, x, y, label_smoothing=hp["label_smoothing"],
                                      dtype=dtype, mean=run.mean_loss)
            step += 1
            if average:
                average.update(run.model, step, run.total_steps)
            loss_sum += loss
            correct += (logits.argmax(1) == y).sum()
            seen += len(y)
            if bar:
                bar.update()
            if on_first_steps and step in (1, 3):           # step 1 pays one-time costs: time steps 2 and 3
                devices.synchronize(device)
                if step == 1:
                    first_steps_start = time.perf_counter()
                else:
                    on_first_steps((time.perf_counter() - first_steps_start) / 2)
            if step == run.total_steps:
                break
        if bar:
            bar.close()
        if average and step == run.total_steps:
            average.finish(run.model)
        epoch_time = timer()
        last = epoch == epochs - 1
        metrics = dict.fromkeys(run.metrics)
        if last or (eval_every and (epoch + 1) % eval_every == 0):
            if hp["bn_stats"] == "last_batch":
                D.sync_batch_norm_stats(run.model, ctx)
                if average and average.model is not None:
                    D.sync_batch_norm_stats(average.model, ctx, counted=run.model)
            evaluated = average.model if average and average.model is not None else (
                run.model if run.wrapped else run.forward)
            with Heartbeat("final evaluation" if last else f"evaluation of epoch {epoch + 1}",
                           on=progress_after_s is not None):
                metrics = run.evaluate(evaluated, last)
            final_eval_time = timer(include=False)
            if time_to_target is None and metrics[run.accuracy] >= target:
                time_to_target = timer.total
        row = {"epoch": epoch + 1, **(run.columns(epoch) if run.columns else {}), "lr": lr,
               "train_loss": loss_sum.item() / seen, "train_acc": correct.item() / seen, **metrics,
               "epoch_time": epoch_time, "total_time": timer.total}
        rows.append(row)
        if checkpoint:
            state = checkpoint_state(run, average, epoch + 1, rows=rows, timer=timer, time_to_target=time_to_target,
                                     hp=hp, world=ctx.world_size)
            D.save_checkpoint(checkpoint, state, ctx)   # rank 0 writes; nobody restarts from a half-written one
            if interrupt_after == epoch + 1:
                if ctx.distributed:         # leave together, so no rank sees a peer vanish mid-collective
                    D.barrier()
                    torch.distributed.destroy_process_group()
                raise SystemExit(INTERRUPTED)
        if on_epoch:
            on_epoch(row)
        timer(include=False)
    return {"seed": seed, "rows": rows, "final_acc": rows[-1][run.accuracy], "train_time": timer.total,
            "final_eval_time": final_eval_time, "time": timer.total + final_eval_time,
            "time_to_target": time_to_target,
            "model": average.model if average and average.model is not None else run.model}
