"""Train a ResNet on CIFAR-10 to 94% and report the time it took.

    python cifar10_fast.py                          # myrtle24: Myrtle's DAWNBench ResNet-9
    python cifar10_fast.py --recipe fast94 --runs 10 --out results.json
    python cifar10_fast.py --list-recipes
    python cifar10_fast.py --device cpu --subset 5000 --epochs 2 --width 0.25    # a CPU demo

A recipe (cifar10_recipes.py) is a small typed tree: each technique's settings in its component, present or absent,
each component's class beside the code that reads it. Any setting is also a flag named after it (--batch-size 768,
--whiten-eps 1e-3, --lookahead-momentum 0). train_run is one run, every trick at the line where it acts or is handed
to the part that applies it (label smoothing to training.train_step's loss).
"""
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from itertools import islice

import numpy as np
import torch
import torch.nn.functional as F

import devices
# the recipes, re-exported: cf.recipe("fast94"), cf.FAST94, cf.RECIPES, cf.JOURNEY
from cifar10_recipes import (FAST94, FAST94_CURRICULUM, FAST94_LOWFLOP, FAST94_MUON,  # noqa: F401
                             FAST94_NEXT, FAST94_NEXT_LOWRES, FAST95, FAST96, JOURNEY, MYRTLE10, MYRTLE24,
                             RECIPES, Recipe, journey_recipes, measured, recipe)
from cifar_data import (DATASETS, channel_stats, check_arrays, epoch_batches, flip_bits, load, low_resolution,
                        upload_normalised, num_classes, pair, take_subset, dataset_on_device)
from cli import (COMPILE_MODES, check_run, check_whole, cifar10_parser, claim_output, command, cpu_warning,
                 ctrl_c_exit, interrupted, join_ranks, phase_of, recipe_list, run_record, runtime_error_exit, stop_of)
from core import DataError, UsageError, say_error
from distributed import Context, barrier, data_parallel, leave, shard
from optim import MasterWeights, make_optimizers, set_lr, steps_masters
from outputs import check_output, profiled, write_result
from processes import exit_now
from progress import EpochClock, Heartbeat, epoch_table, with_progress
from run_statistics import print_summary, summarize_runs
from schedules import per_rank_batch, run_steps
from settings import as_flags, by_name, changed, changes_from, check, command_text, flag_error
from torch_backend import (TTASettings, build_model, fit_whitening, hold_weights, loss_and_accuracy,
                           pools_to_one_pixel, tta_views, whitening_bias)
from training import (RunOptions, averaging, check_finite_loss, evaluation_model, loss_and_sums, run_seeds,
                      strict_compile, train_step, warmup_calls)
from versions import torchvision_mismatch

# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

COLUMNS = ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time", "total_time"]


def train_run(r, built, o, *, ctx, seed, table=None):
    """One run of recipe r on a Built: {"seed", "rows", "final_acc", "model", and its times}; each epoch's row to
    `table` (progress.epoch_table) and o.on_epoch."""
    data, net, device = built.data, built.network, torch.device(ctx.device)
    n, batch = len(data["train_labels"]), r.batch_size // ctx.world_size
    dtype = devices.compute_dtype(device, o.precision)
    steps_per_epoch, total_steps = run_steps(n, batch, r.epochs)
    seeds = run_seeds(seed, ctx.rank)
    masters = net.reset(seeds["init"])  # float32 masters of a GPU's bf16 weights
    order, augment = (devices.generator(device, seeds[k]) for k in ("order", "augment"))
    bias = whitening_bias(net.module, steps_per_epoch)  # its own rate, then detached (airbench94)
    opts = make_optimizers(net.module, r, steps_per_epoch, ctx.world_size, own_rates=[bias], masters=masters)
    flip_base = flip_bits(n, augment) if r.augment.flip == "alternate" else None
    clock = EpochClock(devices.timer(device), o, columns=COLUMNS, accuracy="test_acc", table=table)
    fit_whitening(net.module, data.get("whiten_images", data["train_images"]), data["test_images"].shape[-2:], masters)
    average = averaging(net.module, ema=r.ema, lookahead=r.lookahead, tail=r.lookahead_tail,
                        steps_per_epoch=steps_per_epoch, masters=masters)
    step = 0
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        sums, steps = torch.zeros(2, device=device), min(steps_per_epoch, total_steps - step)
        batches = islice(epoch_batches(data, r.augment, augment, order=order, epoch=epoch, flip_base=flip_base,
                                       batch_size=batch), steps)
        for x, y in with_progress(batches, steps, f"epoch {epoch + 1}", PROGRESS_AFTER_S, on=o.progress):
            lr = r.lr.at(step / total_steps)
            set_lr(opts, lr, step)
            if bias and not ctx.distributed:  # DDP wants every gradient: the bias's rate goes to 0 instead
                bias.param.requires_grad_(step < bias.until_step)
            sums = sums + train_step(net.train_forward, opts, x, y, label_smoothing=r.label_smoothing, dtype=dtype)
            step += 1
            average and average.update(net.module, step, total_steps)
        last = step == total_steps
        clock.stop(sums, steps * batch, epoch=epoch + 1, lr=lr)
        if clock.evaluates(epoch, last=last):
            with Heartbeat("final evaluation" if last else f"evaluation of epoch {epoch + 1}", on=o.progress):
                loss, acc = loss_and_accuracy(evaluation_model(net.eval_forward, average), data["test_images"],
                                              data["test_labels"], dtype=dtype, tta=r.tta if last else None)
            clock.evaluated(test_loss=loss, test_acc=acc)
        for row in clock.rows_read():
            check_loss(row, r)
            say_estimate(r, row, o, first=seed == o.seed, device=device, epochs=total_steps / steps_per_epoch)
            o.on_epoch and o.on_epoch(row)
        clock.resume()
    return {"seed": seed, "rows": clock.rows, "final_acc": clock.rows[-1]["test_acc"], **clock.times(),
            "model": evaluation_model(net.module, average, masters)}


def check_loss(row, r):
    """Raises DataError (one line, naming the likely setting) unless the epoch's training loss is finite."""
    check_finite_loss(row["train_loss"], epoch=row["epoch"],
                      hint=f"the learning rate is the likely cause (--lr-values peaks at {max(r.lr.values):g})")


def compile_counts(since=None):
    """(graphs torch.compile has made in this process, frames it left to run eagerly): torch._dynamo's counts; given
    an earlier count `since`, {"recompiles", "eager_fallbacks"} since then."""
    from torch._dynamo.utils import counters
    now = counters["stats"]["unique_graphs"], counters["frames"]["total"] - counters["frames"]["ok"]
    return now if since is None else dict(zip(("recompiles", "eager_fallbacks"), (a - b for a, b in zip(now, since))))


# ---------------------------------------------------------------------------------------------
# What a process builds once: the data on the device, the network compiled and warmed up
# ---------------------------------------------------------------------------------------------

def rank_dataset(arrays, r, ctx, device, *, dtype, stats):
    """The rank's contiguous shard of the training set on the device, and the images every rank fits the whitening on
    (whiten_images, taken before sharding: frozen parameters, which DDP never syncs)."""
    rows = shard(len(arrays["train_labels"]), ctx.rank, ctx.world_size)
    own = {**arrays, "train_images": arrays["train_images"][rows.start:rows.stop],
           "train_labels": arrays["train_labels"][rows.start:rows.stop]}
    data = dataset_on_device(own, device, dtype=dtype, pad=r.augment.crop_pad, stats=stats)
    fit = r.whitening.fit.images if r.whitening else 0
    data["whiten_images"] = upload_normalised(arrays["train_images"][:fit], device, dtype=dtype, stats=stats)
    data["num_classes"] = num_classes(arrays)
    return data


@dataclass(kw_only=True)
class Network:
    """The network a process builds once (build_network()) and each run resets: `module`, what a training step calls
    (`train_forward`) and what an evaluation calls (`eval_forward`); `recipe` and `num_classes` build it afresh."""
    module: torch.nn.Module
    train_forward: object
    eval_forward: object
    recipe: Recipe
    num_classes: int = 10

    def reset(self, seed):
        """The MasterWeights of the module re-initialised in place from `seed`."""
        torch.manual_seed(seed)
        device = next(self.module.parameters()).device
        fresh = build_model(self.recipe, device, num_classes=self.num_classes)
        self.module.load_state_dict(fresh.state_dict())
        return MasterWeights.of_fresh(self.module, fresh)


def held_weights(r, dtype, distributed=False):
    """The low dtype (a GPU's bf16) r's network holds its weights in, with float32 masters; else None."""
    return dtype if dtype in (torch.bfloat16, torch.float16) and steps_masters(r) and not distributed else None


def build_network(r, device, *, compile_mode=None, ctx=None, num_classes=10, dtype=torch.float32):
    """The Network of recipe r in dtype: in DDP under torchrun, compiled with compile_mode."""
    distributed = ctx is not None and ctx.distributed
    module = build_model(r, device, num_classes=num_classes)
    if held := held_weights(r, dtype, distributed):
        hold_weights(module, held)
    forward = data_parallel(module, ctx) if distributed else module
    if compile_mode:
        if r.compile_step:
            forward = WithLoss(forward, r.label_smoothing)
        # dynamic=False: a graph for each shape (low-resolution epochs), each compiled in the warm-up
        forward = torch.compile(forward, mode=compile_mode, dynamic=False)
    return Network(module=module, train_forward=forward, eval_forward=module if distributed else forward, recipe=r,
                   num_classes=num_classes)


class WithLoss(torch.nn.Module):
    """The network, and given labels the step's training.loss_and_sums instead: compiled (compile_step), the forward,
    the loss and the sums are one graph, and AOTAutograd compiles their backward as one graph with it; the logits,
    which no step reads, are not among its outputs. Called without labels it is the network."""
    takes_labels = True

    def __init__(self, net, label_smoothing):
        super().__init__()
        self.net, self.label_smoothing = net, label_smoothing

    def forward(self, x, y=None):
        logits = self.net(x)
        return logits if y is None else loss_and_sums(logits, y, label_smoothing=self.label_smoothing)


def warmup(r, built, o, *, ctx, calls=None):
    """Runs off the clock, `calls` times (by default training.warmup_calls), a whole run of r on the Built from the
    first run's seed, so that the first timed run meets nothing new (graphs compiled and captured, kernels loaded and
    autotuned, buffers cached); each run resets the network and re-seeds its streams: the numbers stay as they were."""
    devices.autotune(torch.device(ctx.device))
    calls = calls or warmup_calls(o.compile)
    what = "compiling every graph the runs meet (torch.compile)" if o.compile else "cuDNN's autotuning"
    with Heartbeat(f"warm-up: {calls} whole run{'s' * (calls > 1)} off the clock, {what}", on=o.progress):
        for _ in range(calls):
            train_run(r, built, replace(o, progress=False, on_epoch=None), ctx=ctx, seed=o.seed)
        devices.synchronize(torch.device(ctx.device))


# ---------------------------------------------------------------------------------------------
# The library: train() and scores(); the command line below is a thin layer over them
# ---------------------------------------------------------------------------------------------

SUMMARY = ("final_acc", "time", "train_time", "time_to_target")     # the results summarised over runs
PROGRESS_AFTER_S = 5.0          # an epoch that looks longer shows its steps on stderr


@dataclass(kw_only=True)
class Options(RunOptions):
    """How train() runs a recipe (not what it computes): training.RunOptions, and where, how many runs from which seed,
    compiled or not, the table and results on stdout (verbose), the file of the first run's torch.profiler trace
    (profile); on_run(Result so far) follows every run, on_epoch(row) every epoch."""
    device: object = None
    runs: int = 1
    seed: int = 0
    compile: str = None
    verbose: bool = False
    profile: str = None
    on_run: object = None
    on_epoch: object = None
    data_flag: str = "data"          # how a message names the data: train()'s data="FILE.npz", or a script's flag

    def __new__(cls, **options):
        check_options(options)
        return super().__new__(cls)


@dataclass(kw_only=True)
class Result:
    """What train() returns: the last run's trained network (the weights evaluated: the EMA's or lookahead's when
    the recipe averages), the (mean, std) its images were normalised by, its per-epoch rows, the summary over all
    runs, every run's result, the recipe and the FLOPs of a run."""
    model: torch.nn.Module
    stats: tuple
    rows: list
    summary: dict
    runs: list
    recipe: Recipe
    flops: dict


def train(recipe, data=None, *, changes=None, options=None, subset=None, dataset=None, ctx=None):
    """The Result of `recipe` (a Recipe or a name) with `changes` trained on `data`."""
    o = options or Options()
    r, arrays, stats, ctx = recipe_and_data(recipe, data, o, changes=changes, subset=subset, dataset=dataset, ctx=ctx)
    device, results = torch.device(ctx.device), []
    with strict_compile(), devices.parameters_dtype(devices.compute_dtype(device, o.precision)):
        built = build(r, arrays, o, ctx=ctx, stats=stats)
        for k in range(o.runs):
            table = epoch_table(COLUMNS, on=o.verbose, title=o.runs > 1 and f"run {k + 1}/{o.runs} (seed {o.seed + k})")
            started, compiled = time.perf_counter(), compile_counts()
            with profiled(o.profile if k == 0 and ctx.is_main else None, device) as profile:  # the first run's
                result = train_run(r, built, o, ctx=ctx, seed=o.seed + k, table=table)
            last = result_so_far(r, result, results, built=built, o=o, started=started, compiled=compiled,
                                 profile=profile)
            o.on_run and o.on_run(last)
    return last


def result_so_far(r, result, results, *, built, o, started, compiled, profile):
    """The Result once `result` joins `results`, with its wall time since `started`, the graphs compiled inside it
    (none the warm-up met) since `compiled` and whether it was profiled: the summary over the runs so far, its FLOPs,
    its network and the statistics it trained on (for scores()); with o.verbose, the run's line printed."""
    model, wall_s = result.pop("model"), time.perf_counter() - started
    result.update(compile_counts(since=compiled), **({"profiled": True} if profile else {}))
    results.append({**result, "wall_s": wall_s})
    summary = summarize_runs(results, o.target, SUMMARY, "final_acc")
    flops = built.flops["total"]
    summary.update(flops_per_run=flops, tflops_per_s=flops / summary["time"]["mean"] / 1e12)
    if o.verbose:
        ttt = result["time_to_target"]
        print(f"final test accuracy {result['final_acc']:.4f}; "
              + (f"time to {o.target:.2%}: {ttt:.2f} s" if ttt is not None else f"did not reach {o.target:.2%}")
              + f"; training {result['train_time']:.2f} s + final evaluation {result['final_eval_time']:.2f} s",
              flush=True)
    return Result(model=model, stats=built.stats, rows=result["rows"], summary=summary, runs=list(results), recipe=r,
                  flops=built.flops)


def check_options(options):
    """Raises UsageError (one line, naming where it belongs) for a name in `options` that is not a run option."""
    fields = [f.name for f in dataclasses.fields(Options)]
    for name in options:
        if name in by_name(Recipe):
            raise UsageError(f"Options({name}=...): {name} is a recipe setting, not a run option; give it in "
                             f"train(..., changes={{{name!r}: ...}})")
        if name not in fields:
            raise UsageError(f"Options({name}=...): not a run option; the run options are {', '.join(fields)}")


def check_changes(changes):
    """Raises UsageError (one line, naming where it belongs) unless `changes` is a dict of recipe settings."""
    if not isinstance(changes, dict):
        raise UsageError(f"train: changes must be a dict of recipe settings by flag name ({{'epochs': 3}}), not "
                         f"{type(changes).__name__}")
    for name in changes:
        if name in Options.__dataclass_fields__:
            raise UsageError(f"changes={{{name!r}: ...}}: {name} is a run option, not a recipe setting; give it in "
                             f"train(..., options=cf.Options({name}=...))")


def recipe_and_data(recipe_or_name, data, o, *, changes, subset, dataset, ctx):
    """train()'s arguments checked and its data loaded: (the recipe with its changes, the four arrays of the subset,
    the whole training set's per-channel statistics, ctx)."""
    if not isinstance(o, Options):
        raise UsageError(f"train: options must be a cf.Options, not {type(o).__name__}")
    check_changes(changes or {})
    if not isinstance(recipe_or_name, (Recipe, str)):
        raise UsageError(f"train: the recipe must be a Recipe or a recipe's name, not {type(recipe_or_name).__name__}")
    if data is not None and not isinstance(data, (str, os.PathLike, dict)):
        what = f"of shape {tuple(data.shape)}" if hasattr(data, "shape") else f"{data!r:.40}"     # not an array's repr
        raise UsageError(f"train: data must be a path (a .npz, a data folder, an unpacked archive) or a dict of the "
                         f"four arrays, not {type(data).__name__} {what}")
    r = (changed(recipe_or_name, **changes) if changes else recipe_or_name) if isinstance(recipe_or_name, Recipe) \
        else recipe(recipe_or_name, **(changes or {}))
    check_run(o.runs, o.target, seed=o.seed, eval_every=o.eval_every, precision=o.precision)
    check_output(o.profile, "--profile")
    if o.compile not in (None, *COMPILE_MODES):
        raise flag_error("compile", o.compile, f"must be one of {', '.join(COMPILE_MODES)} (or None: not compiled)")
    check_subset(subset)
    if dataset is not None and dataset not in DATASETS:
        raise UsageError(f"--dataset {dataset}: must be one of {', '.join(DATASETS)}")
    device = torch.device(ctx.device) if ctx else devices.resolve(o.device)
    ctx = ctx or Context(device=str(device))
    with Heartbeat(f"loading {data or 'data'}", on=o.progress and not isinstance(data, dict)):
        arrays = (check_arrays(as_numpy(data), "data") if isinstance(data, dict)
                  else load(data or "data", dataset, flag=o.data_flag))
    stats = channel_stats(arrays["train_images"])        # the whole training set's, whatever the subset
    if not any(stats[1]):
        raise DataError(f"{data if isinstance(data, (str, os.PathLike)) else 'data'}: every pixel of every training "
                        f"image is ({', '.join(f'{m:g}' for m in stats[0])}); there is nothing to learn")
    check_subset(subset, len(arrays["train_labels"]))
    arrays = take_subset(arrays, subset)
    check_data(r, arrays, ctx, say=print if o.verbose else None)
    if o.verbose:
        print(f"recipe {r.name} on {devices.name(device)} ({device}, "
              f"{str(devices.compute_dtype(device, o.precision))[6:]}), {len(arrays['train_labels'])} training and "
              f"{len(arrays['test_labels'])} test images of {'x'.join(map(str, arrays['test_images'].shape[1:3]))} "
              f"pixels, {num_classes(arrays)} classes"
              + (f", {ctx.world_size} ranks of {r.batch_size // ctx.world_size} images per step" if ctx.distributed
                 else ""), flush=True)
    return r, arrays, stats, ctx


def as_numpy(arrays):
    """A dict of the four arrays with any torch tensor among them as a numpy array (a copy in host memory)."""
    return {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in arrays.items()}


def count_flops(r, data, *, n_train=None, batch=2):
    """FLOPs of one run of recipe r over n_train images (None: data's): every training step (forward and backward,
    each epoch at its side in the resolution schedule) and the final selective-TTA evaluation, counted by
    torch.utils.flop_counter (convolutions, matmuls) on a small batch and scaled linearly; per-epoch evaluations are
    excluded, as they are from the time."""
    from torch.utils.flop_counter import FlopCounterMode
    device = data["test_images"].device
    model = build_model(r, device, num_classes=data.get("num_classes", 10))
    # contiguous: on one CPU thread, torch 2.14.1 crashed in the backward of the pre-activation ResNet-18
    # given this slice's channels-last strides (the training step always gets a contiguous batch)
    x, y = devices.float32_or_wider(data["test_images"][:batch]).contiguous(), data["test_labels"][:batch]

    def per_train_image(x):
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x), y).backward()
        return counter.get_total_flops() / len(x)
    steps_per_epoch, steps = run_steps(n_train or len(data["train_labels"]), r.batch_size, r.epochs)
    full = tuple(x.shape[-2:])
    steps_at = {}           # side: the run's steps at it
    for epoch in range(-(-steps // steps_per_epoch)):
        side = pair(r.augment.resolution(epoch, full))
        steps_at[side] = steps_at.get(side, 0) + min(steps_per_epoch, steps - epoch * steps_per_epoch)
    per_image = per_train_image(x)
    train = sum(n * (per_image if side == full else per_train_image(low_resolution(x, side)))
                for side, n in steps_at.items()) * r.batch_size
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    per_forward_image = counter.get_total_flops() / len(x)
    fraction = r.tta.fraction if r.tta else 1.0
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        views = tta_views(x, r.tta.views if r.tta else "none")
        for _, view in views if fraction >= 1 else views[:1]:
            model(view)
    per_test_image = counter.get_total_flops() / len(x)
    if fraction < 1:
        per_test_image *= 1 + fraction * (len(views) - 1)
    test = len(data["test_labels"]) * per_test_image
    return {"train": train, "final_eval": test, "total": train + test,
            "per_train_image": per_image, "per_test_image": per_test_image, "per_forward_image": per_forward_image}


@dataclass(kw_only=True)
class Built:
    """What a process builds once for a recipe: its data on the device (this rank's), its Network (build_network(),
    which each run resets), the FLOPs of a run (count_flops) and the (mean, std) the images were normalised by."""
    data: dict
    network: Network
    flops: dict = None
    stats: tuple = None


def build(r, arrays, o, *, ctx, stats):
    """Built for recipe r: data on the device, FLOPs, network, warmed up on an accelerator or compiled."""
    device = torch.device(ctx.device)
    dtype = devices.compute_dtype(device, o.precision)
    data = (rank_dataset(arrays, r, ctx, device, dtype=dtype, stats=stats) if ctx.distributed
            else dataset_on_device(arrays, device, dtype=dtype, pad=r.augment.crop_pad, stats=stats))
    flops = count_flops(r, data, n_train=len(arrays["train_labels"]))
    net = build_network(r, device, compile_mode=o.compile, ctx=ctx, num_classes=data["num_classes"], dtype=dtype)
    built = Built(data=data, network=net, flops=flops, stats=stats)
    if not devices.is_cpu(device) or o.compile:
        warmup(r, built, o, ctx=ctx)
    return built


def say_estimate(r, row, o, *, first, device, epochs):
    """On a CPU with o.progress, after the first run's first epoch: the time every run's training will take, from
    that epoch's `row` and the run's length in epochs of steps (on stderr)."""
    if not first or row["epoch"] != 1 or not o.progress or not devices.is_cpu(device):
        return
    runs, total = o.runs, o.runs * row["epoch_time"] * epochs
    print(f"estimated time: about {f'{total / 60:.0f} min' if total >= 90 else f'{total:.0f} s'} for {runs} run"
          f"{'s' * (runs > 1)} of {r.epochs:g} epoch{'s' * (r.epochs != 1)} on this CPU (from the first epoch, "
          "evaluations left out; an estimate)", file=sys.stderr, flush=True)


def scores(model, images, labels, *, tta=None, stats=None, batch_size=1000):
    """{"loss", "accuracy"} of a trained network (a Result, or a network) on images, with test-time augmentation `tta`
    (a TTASettings, or None). images: uint8 (N, H, W, 3) numpy arrays, normalised as in training (by a Result's stats,
    or stats = (mean, std)), or a float tensor (N, 3, H, W) already normalised."""
    if isinstance(model, Result):
        model, stats = model.model, stats or model.stats
    dtype = check_scores_input(model, images, labels, tta)
    device = next(model.parameters()).device
    if isinstance(images, np.ndarray):
        if stats is None:
            raise UsageError("scores: give stats=(mean, std), the training images' (Result.stats), or the Result "
                             "whole")
        images = upload_normalised(np.ascontiguousarray(images), device, dtype=dtype, stats=stats)
    images = images.to(device, dtype)
    labels = torch.as_tensor(np.asarray(labels) if isinstance(labels, (list, tuple)) else labels, device=device).long()
    loss, accuracy = loss_and_accuracy(model, images, labels, tta=tta, batch_size=batch_size,
                                       dtype=dtype if dtype == torch.float64 else devices.compute_dtype(device))
    return {"loss": loss, "accuracy": accuracy}


def check_scores_input(model, images, labels, tta):
    """Raises UsageError (one line) unless scores() can evaluate model on images and labels with tta; returns the
    dtype the images are normalised in: the model's float32, or float64 (a network train(precision="fp64") made)."""
    if not isinstance(model, torch.nn.Module) or not any(True for _ in model.parameters()):
        raise UsageError(f"scores: model must be a Result or a trained network (Result.model), not "
                         f"{type(model).__name__}")
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):
        raise UsageError(f"scores: the model's parameters are {str(dtype)[6:]}; give it in float32 (or float64)")
    kind, shape = type(images).__name__, tuple(getattr(images, "shape", ()))
    if isinstance(images, np.ndarray) and (images.dtype != np.uint8 or images.ndim != 4 or shape[3] != 3):
        raise UsageError(f"scores: images are a numpy array of {images.dtype} {shape}; expected uint8 (N, H, W, 3), "
                         "pixels 0..255 as train() takes them (or a normalised float tensor (N, 3, H, W))")
    if isinstance(images, torch.Tensor) and (not images.is_floating_point() or images.ndim != 4 or shape[1] != 3):
        raise UsageError(f"scores: images are a tensor of {str(images.dtype)[6:]} {shape}; expected normalised floats "
                         "(N, 3, H, W) (or uint8 pixels as a numpy array (N, H, W, 3))")
    if not isinstance(images, (np.ndarray, torch.Tensor)):
        raise UsageError(f"scores: images must be a numpy array (N, H, W, 3) of uint8 or a normalised tensor (N, 3, H, "
                         f"W), not {kind}")
    if len(images) == 0:
        raise UsageError("scores: no images (N = 0)")
    if not hasattr(labels, "__len__") or len(labels) != len(images):
        raise UsageError(f"scores: labels must hold one label for each of the {len(images)} images, not "
                         f"{type(labels).__name__}" + (f" of {len(labels)}" if hasattr(labels, "__len__") else ""))
    values = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    classes = heads[-1].out_features if heads else None          # the network's classes: its last layer's outputs
    if not np.issubdtype(values.dtype, np.integer) or values.min() < 0 or classes and values.max() >= classes:
        raise UsageError(f"scores: labels must be whole numbers 0..{classes - 1 if classes else 'C-1'}" +
                         (f" (the model's {classes} classes)" if classes else "") + f", not {values.dtype} "
                         f"{values.min()}..{values.max()}")
    if tta is not None and not isinstance(tta, TTASettings):
        raise UsageError(f"scores: tta must be a TTASettings (a recipe's: result.recipe.tta) or None, not "
                         f"{type(tta).__name__} {tta!r:.40}")
    if tta is not None:
        check(tta)
    return dtype


def check_subset(subset, n_train=None):
    """Raises UsageError unless --subset is positive (and, given the training images there are, at most that)."""
    if subset is not None:
        check_whole("subset", subset, "must be positive", low=1)
    if subset is not None and n_train is not None and subset > n_train:
        raise flag_error("subset", subset, f"larger than the {n_train} training images")


def check_data(r, arrays, ctx, say=None):
    """Raises UsageError for a setting the data rules out: the batch (for each rank), the crop, cutout, resolution
    schedule and network against the images' size. say: where a class with no training image is warned of."""
    n_train, (h, w) = len(arrays["train_labels"]), arrays["train_images"].shape[1:3]
    try:
        batch = per_rank_batch(r.batch_size, ctx.world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if batch * ctx.world_size > n_train:
        raise flag_error("batch_size", r.batch_size, f"larger than the {n_train} training images")
    steps = n_train // (batch * ctx.world_size)
    if r.epochs * steps < 1 - 1e-9:         # else ceil() would train a whole step
        raise flag_error("epochs", r.epochs, f"shorter than one step (an epoch here is {steps} step"
                         f"{'s' * (steps > 1)} of {batch * ctx.world_size} images); give at least "
                         f"{'1' if steps == 1 else f'1/{steps}'}")
    ghost = r.batch_norm.ghost_batch
    if ghost and batch % ghost:
        raise flag_error("bn_ghost_batch", ghost, f"must divide each rank's batch into whole groups (--batch-size "
                         f"{r.batch_size} over {ctx.world_size} ranks: {batch} images)")
    if len(np.unique(arrays["train_labels"])) < 2:
        raise UsageError(f"the {n_train} training images are all of one class (label {arrays['train_labels'][0]}); a "
                         "classifier needs at least 2 (a larger --subset?)")
    if r.augment.crop_pad >= min(h, w):
        raise flag_error("crop_pad", r.augment.crop_pad, f"must be smaller than the {h}x{w} images")
    if r.augment.cutout > min(h, w):
        raise flag_error("cutout", r.augment.cutout, f"larger than the {h}x{w} images")
    schedule = r.augment.resolution_schedule
    if schedule and h != w:
        raise flag_error("resolution_schedule", schedule, f"needs square images, not {h}x{w}")
    if schedule and max(schedule) > h:
        raise flag_error("resolution_schedule", schedule, f"{max(schedule)} is larger than the {h}x{w} images")
    if not (pools_to_one_pixel(r, h) and pools_to_one_pixel(r, w)):     # each side's convolutions and pools alone
        raise flag_error("model", r.network.model, f"{h}x{w} images are too small for this network")
    classes = num_classes(arrays)
    empty = [c for c, n in enumerate(np.bincount(arrays["train_labels"], minlength=classes)) if n == 0]
    if empty and say:
        say(f"warning: {len(empty)} of the {classes} classes have no training image (labels "
            f"{', '.join(map(str, empty[:10]))}{', ...' if len(empty) > 10 else ''})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    args = cifar10_parser(__doc__).parse_args(argv)
    return args, changes_from(args, Recipe)


# what train() does before a run's first epoch, by function: what Ctrl-C stopped there
BEFORE_TRAINING = {"recipe_and_data": "loading the data",
                   "build": "putting the data on the device and building the network",
                   "warmup": "warming up (cuDNN's autotuning, or torch.compile compiling)"}


@command
def main(argv=None):
    """The command line: the recipe and every flag checked, --out claimed, this process's place among torchrun's ranks
    joined, the runs trained (train()), their summary printed and --out written after every run; the exit status."""
    args, changes = parse_args(argv)
    if args.list_recipes:
        print(recipe_list(RECIPES, notes=measured()))
        return 0
    if mismatch := torchvision_mismatch():          # before any import of torchvision fails in a traceback
        say_error(mismatch)
        return 1
    try:            # every flag, before any data is loaded (what depends on the data: in train(), before training)
        r = recipe(args.recipe, **changes)
        if args.print_recipe:
            print(f"# {r.name}: {r.doc}\n" + command_text(["python", "cifar10_fast.py", "--recipe", args.recipe],
                                                          as_flags(r)))
            return 0
        check_subset(args.subset)
        check_run(args.runs, args.target, seed=args.seed, device=args.device, out=args.out,
                  eval_every=args.eval_every)
        check_output(args.profile, "--profile")
        claim_output(args.out if os.environ.get("RANK", "0") == "0" else None)      # the rank that writes it
        ctx = join_ranks(args)
    except UsageError as e:
        say_error(e)
        return 2
    device, where = torch.device(ctx.device), {"run": 1, "epoch": 1, "finished": 0}
    if devices.is_cpu(device) and ctx.is_main:
        given = {"subset"} if args.subset is not None else set()
        print(cpu_warning([f"--{name}" for name in ("subset", "epochs", "width") if name not in given | set(changes)],
                          devices.compute_dtype(device, args.precision)), file=sys.stderr)

    def save(result, complete):     # after every run: a run cut short, or a failure later, never loses the others
        if args.out and ctx.is_main:
            write_result(args.out, run_record({
                "recipe": r.name, "settings": r, "target": args.target, "subset": args.subset,
                "dataset": args.dataset, "compile": args.compile, "flops": result.flops, "complete": complete,
                "runs": result.runs, "summary": result.summary}, args, argv=argv, device=device, ctx=ctx))

    def run_done(result):
        where.update(run=len(result.runs) + 1, epoch=1, finished=len(result.runs))
        save(result, False)
    try:
        o = Options(runs=args.runs, seed=args.seed, target=args.target, eval_every=args.eval_every,
                    precision=args.precision, compile=args.compile, profile=args.profile, verbose=ctx.is_main,
                    progress=ctx.is_main and not args.quiet, on_run=run_done, data_flag="--data-dir",
                    on_epoch=lambda row: where.update(epoch=row["epoch"] + 1))
        result = train(r, args.data_dir, options=o, subset=args.subset, dataset=args.dataset, ctx=ctx)
        barrier()                 # leave together
    except (UsageError, DataError) as e:
        say_error(e)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt as e:          # Ctrl-C, or SIGTERM
        how, status = stop_of(e)
        return ctrl_c_exit(interrupted(where["epoch"], where["run"], where["finished"], out=args.out, how=how,
                                       during=phase_of(e, BEFORE_TRAINING)), status)
    except RuntimeError as e:       # out of memory, or a peer lost: one line; else raised whole
        return runtime_error_exit(e, ctx, ways="a smaller --batch-size or --width needs less", out=args.out,
                                  epoch=where["epoch"], run=where["run"], finished=where["finished"],
                                  during=phase_of(e, BEFORE_TRAINING))
    finally:
        leave(ctx)
    if args.runs > 1 and ctx.is_main:
        print_summary(r.name, result.summary, args.target, {
            "final_acc": ("final test accuracy", ""), "time": ("time (training + final evaluation)", " s"),
            "time_to_target": (f"time to {args.target:.2%}", " s")})
    try:
        save(result, True)
    except DataError as e:
        say_error(e)
        return 1
    if args.out and ctx.is_main:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    status = main()
    if status in (130, 143):
        exit_now(status)        # Ctrl-C, SIGTERM: at once, not seconds later (torch.compile's state finalised)
    sys.exit(status)
