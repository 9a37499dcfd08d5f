"""ImageNet's checkpoints: what an interrupted run saves after every epoch and resumes from exactly (the model, its
optimisers, its weight averaging, every rank's random streams, the rows and clock so far), refused when written by
another run (other settings, another number of ranks, another store). The file itself is written and found by
distributed.save_state (atomically; rank 0, or every node's first rank for node-local copies) and
distributed.load_newest_state (the newest copy that any rank holds).
"""
import hashlib
import json
import sys
from dataclasses import dataclass

import torch

import devices
import distributed
from core import DataError
from settings import flat

INTERRUPTED = 75      # EX_TEMPFAIL: stopped on purpose after a checkpoint, resumable


@dataclass(kw_only=True)
class Trainable:
    """What a checkpoint saves of a run in training and a resumed run loads back: the model, its optimisers, its
    weight averaging (or None) and its random generators (beside torch's global one)."""
    model: torch.nn.Module
    optimizers: list
    average: object
    generators: list


CHECKPOINT_KEYS = {"model", "optimizers", "averaging", "rng", "progress", "settings", "world", "store"}


def save_checkpoint(path, run, *, progress, settings, ctx, store=None, each_node=True, writers=None):
    """Writes everything a resumed run needs (atomically, by rank 0 or with each_node by every node's first rank,
    which receive rank 0's over writers; a failed write stops every rank with one line): the Trainable run,
    `progress` (the epoch reached, its rows, its clock, ...), the settings, the data's identity (`store`: {"digest",
    "name"}), and the random states of every rank gathered to all, so that each rank resumes its own streams
    exactly."""
    rng = [torch.get_rng_state(), *(g.get_state() for g in run.generators)]
    every = [rng]
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, rng)
    distributed.save_state(path, {
        "model": run.model.state_dict(), "optimizers": [o.state_dict() for o in run.optimizers],
        "averaging": run.average.state_dict() if run.average else None, "rng": every, "progress": progress,
        "settings": settings, "world": ctx.world_size, "store": store}, ctx, each_node=each_node, writers=writers)


def checkpoint_epoch(state):
    """The epoch a checkpoint's state reached; a DataError when it is not one of this version's."""
    missing = CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS
    if missing:
        raise DataError(f"not a readable checkpoint of this version (no {', '.join(sorted(missing))})")
    return state["progress"]["epoch"]


def read_checkpoint(path, *, settings, ctx, store=None):
    """The newest state save_checkpoint left at path on any rank (distributed.load_newest_state: its holder reads it,
    every rank receives it), or None when no rank holds one. A checkpoint of another run (other settings, another
    number of ranks, another store than this rank's) is a DataError of one line on every rank."""
    state, holder = distributed.load_newest_state(path, ctx, epoch_of=checkpoint_epoch)
    if state is None:
        distributed.print0(f"no checkpoint at {path}{' on any rank' * ctx.distributed}: training from the start")
        return None
    distributed.agree_on_error(refusal(path, state, settings=settings, ctx=ctx, store=store), ctx)
    distributed.print0(f"resumed from epoch {state['progress']['epoch']} of {path}"
                       + (f", rank {holder}'s copy" if ctx.distributed else ""))
    return state


def refusal(path, state, *, settings, ctx, store):
    """Why this rank cannot resume from a checkpoint's state (one line), or None."""
    if state["world"] != ctx.world_size:
        return (f"{path}: written by {state['world']} rank{'s' * (state['world'] > 1)}, resumed by {ctx.world_size}; "
                "cannot resume")
    saved = state["store"] or {}
    if store and saved.get("digest") != store["digest"]:
        return (f"{path}: written on another store ({saved.get('name')}, index {saved.get('digest')}), resumed on "
                f"{store['name']}{distributed.on_rank(ctx)} (index {store['digest']}); resume on that store, or "
                "start afresh without --resume")
    if state["settings"] != settings:
        diff = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        return f"{path}: written with other settings ({', '.join(diff)}); cannot resume"
    return None


def restore_run(state, run, *, ctx):
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


def store_identity(store, name):
    """What a checkpoint records of the store it was written on: the digest of its index (its settings, source,
    classes and every count; the same store prepared again has the same) and its name (the folder given)."""
    index = json.dumps(store.index, sort_keys=True).encode()
    return {"digest": hashlib.sha1(index).hexdigest()[:12], "name": str(name)}


def resume_run(r, run, o, *, forward, plans, ctx, on_epoch):
    """Where a run starts, as save_checkpoint's progress: epoch 0, or (with o.resume) where the newest checkpoint
    of any rank left it, its state loaded into run (a Trainable) and its rows replayed to on_epoch. What writes
    killed midway left beside this rank's checkpoint is removed first."""
    if o.checkpoint and distributed.writes_checkpoints(ctx, each_node=o.each_node):
        left = distributed.remove_unfinished_writes(o.checkpoint)
        if left:
            print(f"removed what {len(left)} unfinished write{'s' * (len(left) > 1)} of {o.checkpoint} left"
                  f"{distributed.on_rank(ctx)}: {', '.join(left)}", file=sys.stderr, flush=True)
    state = (read_checkpoint(o.checkpoint, settings=flat(r), ctx=ctx, store=o.store) if o.resume and o.checkpoint
             else None)
    if state is None:
        return {"epoch": 0, "rows": [], "train_time": 0.0, "time_to_target": None}
    if ctx.distributed:     # DDP's buckets as the uninterrupted run has them, so that its sums round the same
        res = plans[state["progress"]["epoch"] - 1].res
        example = torch.zeros(2, 3, res, res, device=ctx.device).contiguous(
            memory_format=devices.memory_format(ctx.device))
        with devices.autocast(ctx.device, devices.compute_dtype(ctx.device, o.precision)):
            distributed.rehearse_backward(forward, example.to(devices.compute_dtype(ctx.device, o.precision)))
    restore_run(state, run, ctx=ctx)
    for row in state["progress"]["rows"]:
        on_epoch and on_epoch(row)
    return state["progress"]
