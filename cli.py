"""The command-line machinery both training scripts share: the flags they both have, one typed flag per
hyperparameter of a recipe's BASE dict (--batch-size 768, --lr-knots 0,0.2,1, --output-scale 1/16; one that takes
one of a few values accepts only those), the checks of values before any work, the hyperparameters a command line
overrides, and the record of where and how a run ran, for its JSON file.
"""
import argparse
import datetime
import platform
import sys

import torch

import devices
from core import UsageError, check_output
from distributed import comm_hook, first_sentence, init_from_env, print0


def flag(key, value):
    """A flag and its value as typed, `--lr-values 0,0.4,0` (key: the flag's or hyperparameter's name)."""
    show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)
    return f"--{key.replace('_', '-')} {','.join(map(show, value)) if isinstance(value, tuple) else show(value)}"


def flag_error(key, value, why):
    """The UsageError of a flag's value: `--batch-size 0: must be positive`."""
    return UsageError(f"{flag(key, value)}: {why}")


def check_values(values, choices, *, positive=(), not_negative=(), fractions=(), whole=()):
    """Raises flag_error for the first of `values` (a dict of hyperparameters) outside its range: not one of its
    `choices`, not above 0 (`positive`), below 0 (`not_negative`), outside [0, 1] (`fractions`), not an integer
    (`whole`)."""
    for key, allowed in choices.items():
        if values[key] not in allowed:
            raise flag_error(key, values[key], f"must be one of {show_choices(allowed)}")
    for keys, bad, why in ((positive, lambda v: not v > 0, "must be positive"),
                           (not_negative, lambda v: v < 0, "must not be negative"),
                           (fractions, lambda v: not 0 <= v <= 1, "must be between 0 and 1"),
                           (whole, lambda v: not isinstance(v, int), "must be a whole number")):
        for key in keys:
            if bad(values[key]):
                raise flag_error(key, values[key], why)


def recipe_values(name, overrides, *, base, recipes):
    """base, then recipe `name`'s changes, then the overrides: a new dict of every hyperparameter. An unknown recipe
    or hyperparameter is a UsageError of one line."""
    if name not in recipes:
        raise UsageError(f"unknown recipe {name!r}; choose from {', '.join(recipes)}")
    unknown = sorted(set(overrides) - set(base))
    if unknown:
        raise UsageError(f"unknown hyperparameters {unknown}")
    return {**base, **{k: v for k, v in recipes[name].items() if k != "doc"}, **overrides}


def check_run(runs, target, *, device=None, out=None, eval_every=1):
    """Raises UsageError unless runs is at least 1, target a fraction above 0 and eval_every not negative, the
    device exists (torch_backend.resolve_device) and a file can be written at out (core.check_output)."""
    if runs < 1:
        raise flag_error("runs", runs, "must be at least 1")
    if eval_every < 0:
        raise flag_error("eval_every", eval_every, "must not be negative (0: evaluate only after the last epoch)")
    if not 0 < target <= 1:
        raise flag_error("target", target, "must be in (0, 1]")
    devices.resolve(device)
    check_output(out, "--out")


def one_of(choices, convert):
    """A converter that accepts only `choices` (the values of `convert(s)`), naming them when it refuses."""
    def check(s):
        value = convert(s)
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{s!r} is not one of {show_choices(choices)}")
        return value
    check.__name__ = convert.__name__
    return check


def show_choices(choices):
    return ", ".join(str(c) or "''" for c in choices)


def _parse(kind):
    """A converter for a flag whose default has the type of `kind` (named after it, for argparse's errors)."""
    if isinstance(kind, bool):
        convert = lambda s: {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[s.lower()]
    elif isinstance(kind, tuple):
        item = int if all(isinstance(v, int) for v in kind) else float
        convert = lambda s: tuple(item(eval_number(v)) for v in s.split(","))
    elif isinstance(kind, int):      # an integer unless written as a fraction: --epochs 9.9
        convert = lambda s: int(eval_number(s)) if float(eval_number(s)).is_integer() else float(eval_number(s))
    elif isinstance(kind, float):
        convert = lambda s: float(eval_number(s))
    else:
        return type(kind)
    convert.__name__ = type(kind).__name__
    return convert


def grid(s):
    """ROWSxCOLS, e.g. 4x8."""
    rows, _, cols = s.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise ValueError(s)
    return int(rows), int(cols)


def join_ranks(args, hook):
    """This process's distributed.Context and communication hook (distributed.CommHook) from the shared flags and
    the recipe's hook (a name of distributed.HOOKS): checks --dist-timeout, refuses srun without torchrun, joins
    torchrun's process group (if any) and checks --torus-grid against its world. A bad value is a ValueError of
    one line."""
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise ValueError("--dist-timeout must be positive (minutes)")
    ctx = init_from_env(args.device, timeout_minutes=args.dist_timeout)
    try:
        return ctx, comm_hook(hook, args.torus_grid, ctx)
    except ValueError:
        if ctx.distributed:
            torch.distributed.destroy_process_group()
        raise


def run_in_ranks(args, hp, work):
    """Runs work(ctx, hook) in this process's place (torchrun: its rank; plain python: one process), after
    --deterministic's settings, with the recipe's communication hook hp["comm_hook"], and leaves the process group
    however work ends; the exit status: work's, or 2 for a bad communication flag (one line, rank 0 alone)."""
    if args.deterministic:
        devices.set_deterministic()           # before CUDA starts (joining torchrun's group may start it)
    try:
        ctx, hook = join_ranks(args, hp["comm_hook"])
    except ValueError as e:
        print0(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return work(ctx, hook)
    except RuntimeError as e:
        if not (ctx.distributed and lost_peers(e)):
            raise
        print(f"error: rank {ctx.rank} lost its peers: {first_sentence(e)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if ctx.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def lost_peers(error):
    """Whether a collective failed because another rank is gone (it ended, or its machine did): what gloo and NCCL
    raise then, rather than a fault of this rank's own."""
    return isinstance(error, torch.distributed.DistError) or any(
        mark in str(error) for mark in ("Connection reset by peer", "Connection closed by peer", "Connection refused",
                                        "NCCL communicator was aborted", "Socket Timeout", "Broken pipe"))


def interrupted(epoch, run, finished, *, out=None, checkpoint=None):
    """The line Ctrl-C leaves: where the work stopped and what of it is kept (only what was written)."""
    line = f"interrupted in epoch {epoch} of run {run}"
    if checkpoint:
        line += (f"; the checkpoint of epoch {epoch - 1} is kept in {checkpoint} (--resume continues from it)"
                 if epoch > 1 else "; no epoch finished, so no checkpoint was written")
    if out:
        line += (f"; {finished} finished run{'s' * (finished != 1)} kept in {out}" if finished
                 else f"; no run finished, so nothing was written to {out}")
    return line


def eval_number(s):
    """Accepts plain numbers and simple fractions such as 1/16."""
    if "/" in s:
        a, b = s.split("/")
        return float(a) / float(b)
    return float(s)


def add_shared_flags(p, base, choices):
    """The flags both training scripts have: runs, seed, device and precision, determinism, torchrun's
    communication settings, and one flag per hyperparameter of `base` (--batch-size for batch_size), typed after
    its value; a hyperparameter in `choices` takes only its listed values, which --help shows."""
    p.add_argument("--runs", type=int, default=1, help="train this many fresh networks (seeds seed..seed+runs-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, mps, ... (default: cuda if available)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast dtype (default: bf16 on a CUDA GPU, fp32 elsewhere)")
    p.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="evaluate every N epochs on the plain test images (0: none), and after the last with the "
                        "recipe's test-time augmentation (default 1)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (what takes long: loading, the warm-up, an epoch's steps, the final "
                        "evaluation); the table and the results still print")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms: the same seed gives the same parameters on the same machine "
                        "(docs/cifar10.md, Reproducibility)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="under torchrun: DDP gradient bucket size in MB")
    p.add_argument("--torus-grid", type=grid, default=None, metavar="RxC",
                   help="under torchrun, with --comm-hook torus*: the 2D torus's rows x columns (default: a row per "
                        "node, as many columns as the node's GPUs)")
    p.add_argument("--dist-timeout", type=float, default=None, metavar="MINUTES",
                   help="under torchrun: how long a collective may wait for the other ranks (default: torch's)")
    hp = p.add_argument_group("hyperparameters (override the recipe)")
    for key, value in base.items():
        allowed = choices.get(key)
        hp.add_argument("--" + key.replace("_", "-"), dest=key, default=None, help=f"(base {value!r})",
                        type=one_of(allowed, _parse(value)) if allowed else _parse(value), choices=allowed)


def overrides_from(args, base):
    """The hyperparameters given on the command line."""
    return {k: getattr(args, k) for k in base if getattr(args, k, None) is not None}


def environment(device):
    """The machine: torch and Python versions, the device and its name (and the CPU threads on a CPU)."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "device_name": devices.name(device)}
    if devices.is_cpu(device):
        env["threads"] = torch.get_num_threads()
    return env


def run_record(fields, args, *, argv, device, ctx):
    """The JSON record of a command-line run: `fields` (recipe, hyperparameters, runs, summary, ...), the
    command line, the environment with torchrun's world size and communication settings, and the date."""
    return {**fields, "argv": sys.argv[1:] if argv is None else list(argv),
            "environment": {**environment(device), "world_size": ctx.world_size, "bucket_mb": args.bucket_mb,
                            "torus_grid": args.torus_grid},
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
