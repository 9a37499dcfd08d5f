"""The CIFAR-10 speed-run loop at ImageNet scale, on one GPU or, under torchrun, on many.

    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in500   # JPEG, max side 500
    python imagenet_fast.py train --store /data/in500 --recipe rn50_16ep --out rn50.json
    python imagenet_fast.py prepare --src /data/imagenet --dst /data/in128 --format raw --size 128
    python imagenet_fast.py train --list-recipes
    python imagenet_fast.py train --store S --device cpu --recipe tiny --epochs 2    # CPU demo

`prepare` writes an ImageFolder tree (train/<class>/*, val/<class>/*) once, in worker processes, into a store that
`train` memory-maps (imagenet_store.py; docs/imagenet.md gives the format). `train` draws random-resized crops of
the whole image, decodes them on the GPU or in the CPU's worker processes (imagenet_decoders.py, imagenet_workers.py)
and augments them on the device (imagenet_data.py). A recipe is a small typed tree (imagenet_recipes.Recipe); any
setting is also a flag. This file holds the training loop (train_run) and the command line; the networks, the
optimiser and the memory they take are imagenet_models.py's, the checkpoints imagenet_checkpoints.py's.
"""
import contextlib
import errno
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from versions import torchvision_mismatch
if __name__ == "__main__" and torchvision_mismatch():       # one line, before imagenet_models' import of it fails
    sys.exit(f"error: {torchvision_mismatch()}")

import numpy as np
import torch
import torch.nn.functional as F

import devices
import scaling
import training
from cli import (HelpFormatter, add_recipe_flags, add_run_flags, check_run, claim_output, command, cpu_warning,
                 ctrl_c_exit, interrupted, join_ranks, phase_of, recipe_list, run_record, runtime_error_exit, stop_of)
from core import DataError, Parser, UsageError, say_error
from distributed import (barrier, broadcast_buffers, checkpoint_writers, data_parallel, leave, leave_together, print0,
                         sync_batch_norm_stats, use_last_batch_stats)
from imagenet_checkpoints import INTERRUPTED, Trainable, resume_run, save_checkpoint, store_identity
from imagenet_data import EpochWork, batch_indices, draw_epoch, loss_top1_top5, rank_data, train_batches
from imagenet_decoders import DECODERS, GPU_DECODERS, decoded_by_text, jpeg_decoder
from imagenet_models import imagenet_network, check_memory, imagenet_optimizer
from imagenet_recipes import RECIPES, RN50_16EP, Recipe, recipe, recipe_command
from imagenet_store import FORMATS, StoreSettings, check_classes, check_prepare, kept, open_store, prepare
from optim import set_lr
from outputs import check_output, write_result
from processes import exit_now
from progress import EpochClock, Heartbeat, epoch_table, with_progress
from run_statistics import print_summary, summarize_runs
from schedules import epoch_plans, plan, step_lr
from settings import add_flags, changes_from, flag_error, flat, one_of
from torch_backend import set_ghost_groups
from training import averaging, check_finite_loss, evaluation_model, run_seeds

# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

COLUMNS = ["epoch", "res", "batch", "lr", "train_loss", "train_acc", "val_loss", "top1", "top5", "epoch_time",
           "total_time", "decode"]      # decode: which decoder, or nvJPEG's paths, took the images (decoded_by_text)
SMALL_STORE = 10_000      # more training images than this: the CPU warning suggests a smaller store
PROGRESS_AFTER_S = 5.0    # an epoch that looks longer shows its steps on stderr


@dataclass(kw_only=True)
class Options(training.RunOptions):
    """How a run runs (not what it computes): training.RunOptions with the top-1 that stops the clock, and a checkpoint
    written after every epoch (each_node: by every node's first rank, else by rank 0; resumed from with resume;
    interrupt_after: exit after that epoch's, as a preempted job would)."""
    target: float = 0.75
    checkpoint: str = None
    each_node: bool = True
    resume: bool = False
    interrupt_after: int = None
    store: dict = None          # store_identity(): a checkpoint records it, and resumes only on that store


def train_run(r, data, o, *, ctx, seed, on_epoch=None):
    """One run of recipe r on this process's RankData (rank_data()) with Options o: {"seed", "rows", "final_top1",
    "final_top5", "train_time", "final_eval_time", "time", "time_to_target", "resumed_from", "trained_epochs",
    "trained_steps"} (the last two counted as this process trains them). Under torchrun every rank builds the same
    network and draws its own batches."""
    device = torch.device(ctx.device)
    dtype, memory_format = devices.compute_dtype(device, o.precision), devices.memory_format(device)
    plans = epoch_plans(r, ctx.world_size, data.per_epoch())
    seeds = run_seeds(seed, ctx.rank)          # the network, the data's order and its augmentation: 3 streams
    torch.manual_seed(seeds["init"])
    order, augment = (torch.Generator().manual_seed(seeds[k]) for k in ("order", "augment"))
    with devices.parameters_dtype(dtype):
        model = imagenet_network(r, len(data.store.index["classes"])).to(device, memory_format=memory_format)
    opt = imagenet_optimizer(model, r)
    forward = data_parallel(model, ctx) if ctx.distributed else model
    clock = EpochClock(devices.timer(device), o, columns=COLUMNS, accuracy="top5" if r.target_top5 else "top1",
                       reads_every_epoch=True)      # its checkpoint records its rows
    if r.bn_stats == "last_batch":               # no moving averages: the last batch's, pooled over ranks (Akiba)
        use_last_batch_stats(model)
    average = averaging(model, ema=r.ema, lookahead=r.lookahead)
    scaler = loss_scaler(device, dtype)          # fp16: the mean loss's gradients need it; saved with the optimiser
    run = Trainable(model=model, optimizers=[opt, scaler] if scaler else [opt], average=average,
                    generators=[order, augment])
    done = resume_run(r, run, o, forward=forward, plans=plans, ctx=ctx, on_epoch=on_epoch)
    clock.continue_from(done)
    writers = checkpoint_writers(ctx, each_node=o.each_node) if o.checkpoint else None     # rank 0's to the nodes
    trained = {"resumed_from": done["epoch"], "trained_epochs": 0, "trained_steps": 0}
    for p, work in epochs_ahead(data, plans[done["epoch"]:], run.generators, shares=seeds["shares"]):
        decoded = Counter(data.decoded)
        losses, correct, steps, lr = train_epoch(r, run, data, p, work=work, forward=forward, ctx=ctx, o=o)
        seen = steps * p.batch
        trained["trained_epochs"] += 1
        trained["trained_steps"] += steps
        decoded = decoded_by_text(data.decoded - decoded)
        last = p.epoch == r.epochs - 1
        clock.stop(torch.stack([losses, correct]), seen, epoch=p.epoch + 1, res=p.res, lr=lr, decode=decoded,
                   batch=p.batch * ctx.world_size)       # the global batch
        check_finite_loss(epoch_loss(losses, ctx) / (seen * ctx.world_size), epoch=p.epoch + 1,
                          hint=divergence_hint(r))
        if clock.evaluates(p.epoch, last=last):
            with Heartbeat("final evaluation" if last else f"evaluation of epoch {p.epoch + 1}", on=o.progress):
                metrics = validation_metrics(r, run, data, p.validation, ctx=ctx, dtype=dtype, final=last)
            clock.evaluated(**metrics)
        row, = clock.rows_read()
        if o.checkpoint:
            save_checkpoint(o.checkpoint, run, settings=flat(r), ctx=ctx, store=o.store, each_node=o.each_node,
                            writers=writers, progress={"epoch": p.epoch + 1, "rows": clock.rows,
                                                       "train_time": clock.train_time,
                                                       "time_to_target": clock.time_to_target})
        on_epoch and on_epoch(row)
        if o.checkpoint and o.interrupt_after == p.epoch + 1:
            print0(f"stopped after epoch {p.epoch + 1} (--interrupt-after-epoch), exit status {INTERRUPTED}; "
                   f"its checkpoint is {o.checkpoint}: the same command with --resume continues from it",
                   file=sys.stderr)
            leave_together(ctx)
            raise SystemExit(INTERRUPTED)
        clock.resume()
    return {"seed": seed, "rows": clock.rows, "final_top1": clock.rows[-1]["top1"],
            "final_top5": clock.rows[-1]["top5"], **clock.times(), **trained}


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
    epoch. Returns the summed loss and the correct predictions (on the device, unread), the steps taken and the last
    rate."""
    device, (opt, *scaler) = torch.device(ctx.device), run.optimizers      # a GradScaler beside it in fp16
    dtype = devices.compute_dtype(device, o.precision)
    set_ghost_groups(run.model, p.group)
    micro = train_batches(data, p.augment, work.draws, res=p.res, batch_size=p.micro, device=device, dtype=dtype,
                          smalls=work.smalls)
    losses, correct, lr, taken = torch.zeros((), device=device), torch.zeros((), device=device), 0.0, 0
    steps = enumerate(zip(*[micro] * r.accumulate))          # r.accumulate micro-batches at a time
    for i, batch in with_progress(steps, p.steps, f"epoch {p.epoch + 1}", PROGRESS_AFTER_S, on=o.progress):
        t = p.epoch + i / p.steps                # the fractional epoch: the schedule's and RMSprop-to-SGD's clock
        lr = step_lr(r, t, p.batch * ctx.world_size)
        set_lr([opt], lr, p.first_step + i, t)
        hits, loss = accumulated_step(forward, opt, batch, ctx=ctx, label_smoothing=r.sgd.label_smoothing, dtype=dtype,
                                      scaler=scaler[0] if scaler else None)
        if run.average:
            run.average.update(run.model, p.first_step + i + 1, p.total_steps)
        losses, correct, taken = losses + loss, correct + hits, taken + 1
    return losses, correct, taken, lr


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


def validation_metrics(r, run, data, val, *, ctx, dtype, final):
    """{"val_loss", "top1", "top5"} of the weights the run evaluates (the EMA's when there is one) over the whole
    validation set (each rank its part, summed), each image seen as val (a Validation) says; the final one with the
    recipe's TTA. With last-batch statistics, every rank first takes the global batch's; under torchrun every rank
    then takes rank 0's batch-norm statistics, so that all evaluate the weights rank 0's checkpoint keeps."""
    if r.bn_stats == "last_batch":
        sync_batch_norm_stats(run.model, ctx)
        if run.average and run.average.model is not None:
            sync_batch_norm_stats(run.average.model, ctx, counted=run.model)
    tta = val.tta if final else "none"
    model = evaluation_model(run.model, run.average)
    broadcast_buffers(model, ctx)           # each rank evaluates its part of the set: all of them with one model
    loss, top1, top5 = loss_top1_top5(model, data, val, tta=tta, device=ctx.device, dtype=dtype, ctx=ctx)
    return {"val_loss": loss, "top1": top1, "top5": top5}


def warmup(r, data, *, device, dtype, world=1):
    """Two steps at every (resolution, micro-batch, batch-norm group) of the schedule on a throwaway model, so that
    cuDNN's autotuning for each new shape happens before the clock starts."""
    memory_format = devices.memory_format(device)
    with devices.parameters_dtype(dtype):
        model = imagenet_network(r, len(data.store.index["classes"])).to(device, memory_format=memory_format)
    opt = imagenet_optimizer(model, r)
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

--batch-size is the global batch, split over the GPUs, and the rate per --lr-scale-base images of
it, but for:
  FFCV's recipes (rn50_*, rn18_*), which train FFCV's batch on each GPU (512; 1024 for ResNet-18)
    at FFCV's rate (1.7; 0.5) whatever the number of GPUs, as FFCV's train_imagenet.py does
    (--per-gpu-batch true, --lr-scaling none; --lr-scaling linear --lr 0.10625 keeps FFCV's rate
    per image instead);
  phase tables (--phases: fast.ai's recipes, Mikami et al.'s), whose rows give each phase's global
    batch and rate.
--accumulate K steps on each rank's batch in K micro-batches, --bn-workers W normalises groups of
global batch / W.
"""


def parse_args(argv=None):
    args = parser().parse_args(argv)
    return args, changes_from(args, Recipe) if args.command == "train" else {}


def parser():
    """The command line's parser: prepare's flags, train's (its own, the runs' and the recipe's settings), and
    simulate (scaling.py's own)."""
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="decode an ImageFolder tree into a store", formatter_class=HelpFormatter)
    pp.add_argument("--src", required=True, metavar="FOLDER",
                    help="a folder of train/<class>/* and val/<class>/* (required)")
    pp.add_argument("--dst", required=True, metavar="FOLDER",
                    help="the store folder to write; a partly written one is resumed (required)")
    pp.add_argument("--format", default="jpeg", type=one_of(FORMATS), metavar="{" + ",".join(FORMATS) + "}",
                    help="jpeg: whole images, longer side <= --max-side, for full-quality training; raw: uint8 "
                         "pixels at --size, for low-resolution work (default: jpeg)")
    pp.add_argument("--max-side", type=int, default=None, metavar="N",
                    help="jpeg: the longest side kept, in pixels (default: 500, as FFCV's)")
    pp.add_argument("--quality", type=int, default=None, metavar="N",
                    help="jpeg: the JPEG quality of re-encoded images (default: 90)")
    pp.add_argument("--size", type=int, default=None, metavar="N",
                    help="raw: the stored images' shorter side, in pixels (default: 128)")
    pp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="encoding processes (default: the CPU count)")
    pp.add_argument("--shard-size", type=int, default=1000, metavar="N",
                    help="images per shard, the unit a resumed prepare starts from (default: 1000)")
    pp.add_argument("--max-aspect", type=float, default=2.0, metavar="X",
                    help="raw: validation images' longer side capped at this x --size (default: 2)")
    pp.add_argument("--max-shards", type=int, default=None, metavar="N",
                    help="stop after decoding this many new shards (default: every shard)")
    pp.add_argument("--exif-transpose", action="store_true",
                    help="store an image that carries an EXIF orientation upright, re-encoded (default: off: as its "
                         "pixels lie; prepare counts such images)")

    tp = sub.add_parser("train", help="train on a store", description=TRAIN, formatter_class=HelpFormatter,
                        usage="%(prog)s --store FOLDER [--recipe NAME] [options] [--SETTING VALUE ...]")
    tp.add_argument("--store", metavar="FOLDER",
                    help="a folder written by prepare (required, but for --list-recipes and --print-recipe)")
    add_recipe_flags(tp, default="rn50_16ep")
    tp.add_argument("--data-on", default="auto", choices=["auto", "device", "host"],
                    help="where a raw store lives (default: auto: on the device if it fits beside training)")
    tp.add_argument("--decoder", default="auto", type=one_of(DECODERS),
                    metavar="{" + ",".join(DECODERS) + "}",
                    help="where a JPEG store is decoded; nvimgcodec: nvImageCodec on the GPU, decoding just each "
                         "crop (pip install nvidia-nvimgcodec-cu12 or -cu13) (default: auto: nvJPEG on a CUDA GPU, "
                         "else the CPU's worker processes)")
    tp.add_argument("--loader-workers", type=int, default=None, metavar="N",
                    help="CPU decoding processes per training process (default: its share of the node's cores, "
                         "less one for the training thread and one for the reader thread; at least 1)")
    tp.add_argument("--target", type=float, default=None, metavar="X",
                    help="the top-1 whose first epoch stops the clock (default: 0.75; a recipe with a --target-top5 "
                         "stops it at that top-5 instead)")
    tp.add_argument("--checkpoint", default=None, metavar="FILE",
                    help="a checkpoint file, written atomically after every epoch (default: none)")
    tp.add_argument("--checkpoint-on", default="each-node", choices=["each-node", "shared"],
                    help="under torchrun on several nodes, where --checkpoint lies: each-node (a node-local path): "
                         "every node's first process keeps its node's copy current; shared (a path every node sees): "
                         "rank 0 alone writes it (default: each-node)")
    tp.add_argument("--resume", action="store_true",
                    help="continue from the newest --checkpoint that any rank finds (none anywhere: a line says so, "
                         "and the run starts afresh) (default: off)")
    tp.add_argument("--out", default=None, metavar="FILE",
                    help="write the recipe, environment, rows and summary there as JSON (default: none)")
    tp.add_argument("--interrupt-after-epoch", type=int, default=None, metavar="N",
                    help=f"exit with status {INTERRUPTED} right after epoch N's checkpoint, as a preempted job "
                         "would; a restart with --resume (or torchrun --max-restarts) continues from it (default: "
                         "none)")
    add_run_flags(tp)
    add_flags(tp, Recipe, recipe=RN50_16EP)
    sub.add_parser("simulate", add_help=False,
                   help="project step time and scaling efficiency over many GPUs (as python scaling.py)")
    return p


def main_prepare(args):
    finished = (Path(args.dst) / "index.json").is_file()       # then prepare says "already prepared" and writes nothing
    try:
        settings = store_settings(args)
        claim_output(args.dst, "--dst", lock=False)         # a lost stdout: the store is still written (its own lock)
        index = prepare(args.src, Path(args.dst), settings, workers=args.workers, shard_size=args.shard_size,
                        max_shards=args.max_shards)
    except (DataError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt as e:          # Ctrl-C, or SIGTERM
        how, status = stop_of(e)
        print(f"{how}; {kept(args.dst)}; the same command resumes from there", file=sys.stderr)
        return status
    if index is None:
        return 3
    if finished:
        return 0
    shape = (f"longer side <= {settings.max_side}" if settings.format == "jpeg" else f"size {settings.size}")
    gb = (index["train"]["bytes"] + index["val"]["bytes"]) / 1e9
    too_large = index["train"]["too_large"] + index["val"]["too_large"]
    print(f"wrote {args.dst}: {len(index['classes'])} classes, {index['train']['count']} train and "
          f"{index['val']['count']} val images, {settings.format} at {shape}, {gb:.3f} GB; "
          f"{index['train']['skipped'] + index['val']['skipped'] - too_large} unreadable files skipped"
          + (f", {too_large} too large" if too_large else ""))
    return 0


# prepare's flags that one format reads and the other does not: (the format that reads them, what they set)
FORMAT_FLAGS = {"max_side": ("jpeg", "a JPEG store's longer side"), "quality": ("jpeg", "the JPEG quality"),
                "size": ("raw", "a raw store's shorter side")}


def store_settings(args):
    """The StoreSettings of prepare's flags (a flag not given: its default); a UsageError of one line for a flag out
    of its range, or one that --format does not read, before anything is read or written."""
    given = {k: getattr(args, k) for k in FORMAT_FLAGS if getattr(args, k) is not None}
    settings = StoreSettings(format=args.format, max_aspect=args.max_aspect, exif_transpose=args.exif_transpose,
                             **given)
    check_prepare(settings, workers=args.workers, shard_size=args.shard_size, max_shards=args.max_shards)
    for name, value in given.items():
        fmt, what = FORMAT_FLAGS[name]
        if fmt != args.format:
            raise UsageError(f"--{name.replace('_', '-')} {value}: sets {what}; a {args.format} store does not read "
                             f"it: leave it out, or give --format {fmt}")
    return settings


def check_train(args):
    """Raises UsageError for the first bad flag of the train command that is not a setting; before anything is
    loaded or started."""
    for flag, bad, message in (
            ("store", not args.store, "is required (a folder written by `imagenet_fast.py prepare`)"),
            ("resume", args.resume and not args.checkpoint, "needs --checkpoint"),
            ("checkpoint-on", args.checkpoint_on == "shared" and not args.checkpoint, "shared needs --checkpoint"),
            ("resume", args.resume and args.runs > 1, "works with a single run"),
            ("interrupt-after-epoch", args.interrupt_after_epoch is not None and args.interrupt_after_epoch < 1,
             "must be positive"),
            ("interrupt-after-epoch", args.interrupt_after_epoch and not args.checkpoint, "needs --checkpoint"),
            ("loader-workers", args.loader_workers is not None and args.loader_workers < 1, "must be positive")):
        if bad:
            raise UsageError(f"--{flag} {message}")
    check_run(args.runs, args.target, seed=args.seed, device=args.device, out=args.out, eval_every=args.eval_every)
    check_output(args.checkpoint, "--checkpoint")


def clock_target(r, target):
    """The accuracy whose first epoch stops the clock: --target (top-1, default 0.75), or the recipe's top-5 target;
    a UsageError of one line when both are given."""
    if r.target_top5 and target is not None:
        raise UsageError(f"--target {target:g}: {r.name} stops its clock at top-5 {r.target_top5:g} (--target-top5); "
                         f"give --target-top5 0 to time to a top-1 --target")
    return r.target_top5 or (0.75 if target is None else target)


# what train_command() does before the first run, by function: what Ctrl-C stopped there
BEFORE_TRAINING = {"open_store": "opening the store", "place_data": "placing the store",
                   "warmup": "warming up (cuDNN's autotuning at every resolution)"}
LESS_MEMORY = "a larger --accumulate (micro-batches), a smaller --batch-size or more GPUs need less on each"
# after a kept checkpoint: each of those ways is another setting or number of ranks, which --resume refuses
LESS_MEMORY_AFRESH = f"{LESS_MEMORY}, in a run started afresh (a checkpoint resumes only its own settings and ranks)"


def main_train(args, changes, argv):
    if args.list_recipes:
        print(recipe_list(RECIPES))
        return 0
    try:
        r = recipe(args.recipe, **changes)
        if args.print_recipe:
            print(recipe_command(r, args.recipe))
            return 0
        args.target = clock_target(r, args.target)
        check_train(args)
        claim_output(args.out if os.environ.get("RANK", "0") == "0" else None)      # the rank that writes it
        ctx = join_ranks(args, r.comm_hook)
    except UsageError as e:
        say_error(e)
        return 2
    try:
        return train_command(args, r, ctx=ctx, argv=argv)
    except DataError as e:              # a damaged record met by the warm-up (train_runs says those of a run)
        say_error(e, each_node=True)
        return 1
    except KeyboardInterrupt as e:       # Ctrl-C or SIGTERM, before the runs (train_runs says where a run stopped)
        how, status = stop_of(e)
        return ctrl_c_exit(interrupted(1, 1, 0, out=args.out, checkpoint=args.checkpoint, how=how,
                                       during=phase_of(e, BEFORE_TRAINING) or "preparing the runs"), status)
    except RuntimeError as e:       # out of memory, or a peer lost: one line; else raised whole
        return runtime_error_exit(e, ctx, ways=LESS_MEMORY, epoch=1, run=1, finished=0, out=args.out,
                                  checkpoint=args.checkpoint,
                                  during=phase_of(e, BEFORE_TRAINING) or "preparing the runs")
    finally:
        leave(ctx)


def train_command(args, r, *, ctx, argv):
    """main_train's work once this process has its place: the store placed, the runs, the summary, the JSON; the
    exit status."""
    device, say, progress = torch.device(ctx.device), print0, ctx.is_main and not args.quiet
    for note in r.notes:
        say(note, file=sys.stderr)
    if r.per_gpu_batch and r.schedule.lr_scaling == "none":     # FFCV's recipes: the rate does not follow the GPUs
        say(f"note: {r.batch_size} images on each GPU, {r.batch_size * ctx.world_size} a step on {ctx.world_size}, "
            f"at lr {r.schedule.lr:g} whatever the number of GPUs, as FFCV's train_imagenet.py trains "
            "(--lr-scaling linear scales the rate with the images of a step instead)", file=sys.stderr)
    try:
        plans = epoch_plans(r, ctx.world_size)   # a schedule that does not divide over the ranks fails here
        decoder = jpeg_decoder(device, args.decoder)
        store = open_store(args.store)
        check_classes(store, args.store)
        if devices.is_cpu(device) and ctx.is_main:
            taken = {"a small store": len(store.train) <= SMALL_STORE, "few --epochs": args.epochs is not None,
                     "--model resnet_tiny": r.network.model == "resnet_tiny"}
            print(cpu_warning([way for way, done in taken.items() if not done],
                              devices.compute_dtype(device, args.precision)), file=sys.stderr)
        data = place_data(r, store, args, ctx=ctx, decoder=decoder, progress=progress)
        check_batch(r, world=ctx.world_size, n_train=len(store.train))    # placed first: only a tiny store fails it
    except (ValueError, DataError) as e:         # UsageError is a ValueError
        say_error(e, each_node=isinstance(e, DataError))        # bad data: each node's own store
        return 1 if isinstance(e, DataError) else 2
    dtype = devices.compute_dtype(device, args.precision)
    on_gpu = GPU_DECODERS.get(decoder)
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


def place_data(r, store, args, *, ctx, decoder, progress):
    """This process's RankData (imagenet_data.rank_data), once what training needs of the device is known to fit (and
    whether a raw store fits beside it): a UsageError of one line, before anything is loaded, when not."""
    device = torch.device(ctx.device)
    dtype, classes = devices.compute_dtype(device, args.precision), len(store.index["classes"])
    gpu_decoder = store.format == "jpeg" and decoder in GPU_DECODERS
    side = max(int(split.rows[k].max(initial=0)) for split in (store.train, store.val) for k in ("height", "width")) \
        if gpu_decoder else 0        # a batch is padded to its tallest and widest image: side x side at worst
    need = 0 if devices.is_cpu(device) else check_memory(r, classes, device=device, world=ctx.world_size, dtype=dtype,
                                                         side=side, gpu_decoder=gpu_decoder)
    with Heartbeat(f"placing {args.store}", on=progress):
        return rank_data(store, device, where=args.data_on, ctx=ctx, seed=args.seed, decoder=decoder,
                     workers=args.loader_workers, training=need)     # under torchrun, this rank's share alone


def train_runs(args, r, data, *, ctx, argv, store):
    """The runs of the command line (seeds --seed, +1, ...), each its table, its line and --out rewritten after it;
    the exit status."""
    o = Options(target=args.target, eval_every=args.eval_every, precision=args.precision, store=store_identity(store,
                args.store), interrupt_after=args.interrupt_after_epoch, resume=args.resume,
                each_node=args.checkpoint_on == "each-node",
                progress=ctx.is_main and not args.quiet)
    aim = f"{args.target:.2%}" + (" top-5" if r.target_top5 else "")
    accuracy = "final_top5" if r.target_top5 else "final_top1"       # the first label: the t-test's
    classes = len(store.index["classes"])
    five = classes > 5          # of 5 classes or fewer, top-5 is 1 by construction: not reported
    labels = {k: (f"final top-{k[-1]}", "") for k in (accuracy, "final_top1", "final_top5") if five or k != "final_top5"
              or k == accuracy}
    labels.update({"time_to_target": (f"time to {aim}", " s"), "train_time": ("training time", " s")})
    runs = []

    def save(complete):
        if args.out and ctx.is_main:
            write_result(args.out, run_record({
                "recipe": r.name, "settings": r, "target": args.target, "store": str(args.store),
                "store_format": store.format, "data_on": data.where, "decoder": data.decoder, "complete": complete,
                "runs": runs, "summary": summarize_runs(runs, args.target, labels, accuracy)}, args, argv=argv,
                device=ctx.device, ctx=ctx))
    for k in range(args.runs):
        seed, epochs = args.seed + k, []
        if args.runs > 1:
            print0(f"run {k + 1}/{args.runs} (seed {seed})")
        table = epoch_table(COLUMNS, on=ctx.is_main)
        checkpoint = args.checkpoint if args.runs == 1 else (args.checkpoint and f"{args.checkpoint}.seed{seed}")
        try:        # an epoch counted before its row is shown: a stop once the row is out names its checkpoint
            result = train_run(r, data, replace(o, checkpoint=checkpoint), ctx=ctx, seed=seed,
                               on_epoch=lambda row: (epochs.append(row["epoch"]),
                                                     table.append(row if five else {**row, "top5": None})))
        except DataError as e:
            say_error(e)            # the checkpoint's, the loss's: the same on every rank
            return 1
        except KeyboardInterrupt as e:       # Ctrl-C, or SIGTERM
            how, status = stop_of(e)
            return ctrl_c_exit(interrupted(max(epochs, default=0) + 1, k + 1, len(runs), out=args.out,
                                           checkpoint=checkpoint, how=how), status)
        except RuntimeError as e:   # where in the runs it stopped, and what is kept
            epoch = max(epochs, default=0) + 1
            return runtime_error_exit(e, ctx, ways=LESS_MEMORY_AFRESH if checkpoint and epoch > 1 else LESS_MEMORY,
                                      epoch=epoch, run=k + 1, finished=len(runs), out=args.out, checkpoint=checkpoint)
        except OSError as e:        # the checkpoint's write, the one write inside a run, met a full disk
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            epoch = max(epochs, default=0) + 1
            kept_text = interrupted(epoch, k + 1, len(runs), out=args.out, checkpoint=checkpoint).split("; ", 1)[1]
            say_error(f"--checkpoint {checkpoint}: not written after epoch {epoch} ({e.strerror}); {kept_text}")
            return 1
        runs.append(result)
        try:
            save(complete=False)
        except DataError as e:
            return write_failed(e)
        ttt = result["time_to_target"]
        print0(f"final top-1 {result['final_top1']:.4f}, "
               + (f"top-5 {result['final_top5']:.4f}; " if five else f"top-5 not reported ({classes} classes); ")
               + (f"time to {aim}: {ttt:.2f} s" if ttt is not None else f"did not reach {aim}")
               + f"; training time {result['train_time']:.2f} s")
    if args.runs > 1 and ctx.is_main:
        print_summary(r.name, summarize_runs(runs, args.target, labels, accuracy), args.target, labels)
    try:
        save(complete=True)
    except DataError as e:
        return write_failed(e)
    if args.out and ctx.is_main:
        print(f"wrote {args.out}")
    barrier()       # leave together
    return 0


def write_failed(error):
    """Exit status 1 once --out's failed write (outputs.write_result's DataError, the result printed) says so in one
    line, torchrun ended without restarts."""
    say_error(error)
    return 1


@command
def main(argv=None):
    """The command line: simulate (scaling.py's), prepare or train, with --out claimed by one train at a time, a lost
    stdout kept from losing the work, and SIGTERM met as Ctrl-C (cli.command); the exit status."""
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if argv_list[:1] == ["simulate"]:
        return scaling.main_simulate(argv_list[1:])
    args, changes = parse_args(argv)
    if args.command == "prepare":
        return main_prepare(args)
    return main_train(args, changes, argv)


if __name__ == "__main__":
    status = main()
    if status in (130, 143):
        exit_now(status)        # Ctrl-C, SIGTERM: at once, not seconds later (torch.compile's state finalised)
    sys.exit(status)
