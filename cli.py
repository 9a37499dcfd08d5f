"""What the two training scripts' command lines share: the flags of how a run runs (runs, seed, device, precision,
evaluation, progress, determinism, torchrun's communication), their checks, joining and leaving torchrun's ranks, the
line Ctrl-C leaves, and the record of where and how a run ran, for its JSON file. The recipes' own flags come from
their settings (settings.py).
"""
import argparse
import contextlib
import dataclasses
import datetime
import errno
import functools
import math
import os
import platform
import signal
import shutil
import sys
import textwrap
import threading
import traceback

import torch

import devices
from core import Parser, UsageError, say_once
from distributed import HOOKS, comm_hook, first_sentence, init_from_env, leave, print0
from outputs import check_output, output_lock
from progress import close_progress
from settings import add_flags, flag_error, flat, one_of


PRECISION_CHOICES = ("auto", *devices.PRECISIONS)         # --precision's choices


COMPILE_MODES = ("default", "max-autotune", "reduce-overhead")       # torch.compile's modes


def check_run(runs, target, *, seed=0, device=None, out=None, eval_every=1, precision="auto"):
    """Raises UsageError unless runs is a whole number of at least 1, seed and eval_every whole and not negative,
    target a fraction above 0, precision one of PRECISION_CHOICES, the device exists (devices.resolve) and a file can be
    written at out (outputs.check_output)."""
    check_whole("runs", runs, "must be at least 1", low=1)
    check_whole("seed", seed, "must not be negative (the runs' seeds: seed, seed + 1, ...)")
    check_whole("eval_every", eval_every, "must not be negative (0: evaluate only after the last epoch)")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise flag_error("target", target, "must be in (0, 1]")
    if precision not in PRECISION_CHOICES:
        raise flag_error("precision", precision, f"must be one of {', '.join(PRECISION_CHOICES)}")
    devices.resolve(device)
    check_output(out, "--out")


def check_whole(name, value, why, *, low=0):
    """Raises flag_error (`why`, or that it must be a whole number) unless value is an int of at least low."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise flag_error(name, value, f"must be a whole number, not {type(value).__name__} {value!r}")
    if value < low:
        raise flag_error(name, value, why)


def grid(s):
    """ROWSxCOLS, e.g. 4x8."""
    rows, _, cols = s.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise ValueError(s)
    return int(rows), int(cols)


class HelpFormatter(argparse.HelpFormatter):
    """--help at most 100 columns wide (narrower in a narrower terminal), a flag's help beside it where the flag
    and its metavar take at most 26 columns; a description's paragraphs filled to the width, but for those with
    indented lines (commands, lists), kept as written."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=28, width=min(100, shutil.get_terminal_size().columns) - 2)

    def _fill_text(self, text, width, indent):
        paragraphs = textwrap.dedent(text).strip("\n").split("\n\n")
        return "\n\n".join(indent + p.replace("\n", "\n" + indent) if "\n " in "\n" + p
                             else textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                                                subsequent_indent=indent) for p in paragraphs)


def add_run_flags(p, *, comm_hook=False):
    """The flags both training scripts have, in two groups: how the runs run (runs, seed, device and precision,
    evaluation, progress, determinism) and torchrun's communication settings (with comm_hook, --comm-hook too: a
    recipe of the other script sets its own)."""
    g = p.add_argument_group("how the runs run")
    g.add_argument("--runs", type=int, default=1, metavar="N",
                   help="train N fresh networks, seeds --seed to --seed + N - 1 (default: 1)")
    g.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the first run's seed: its network's initialisation, data order and augmentation (default: 0)")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu, mps, ... (default: cuda if available, else cpu)")
    g.add_argument("--precision", default="auto", choices=PRECISION_CHOICES,
                   help="autocast dtype; fp64: the whole computation in float64, the recipe's lower-precision settings "
                        "too (the algorithm without rounding; slow) (default: auto: bf16 on a CUDA GPU, else fp32)")
    g.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="evaluate every N epochs on the plain test images (0: none), and after the last with the "
                        "recipe's test-time augmentation (default: 1)")
    g.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (loading, the warm-up, an epoch's steps, the final evaluation); the "
                        "table and the results still print (default: off)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms: the same seed gives the same parameters on the same machine "
                        "(docs/cifar10.md, Reproducibility) (default: off)")
    t = p.add_argument_group("under torchrun")
    t.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB",
                   help="DDP's gradient bucket size (default: 25)")
    if comm_hook:
        t.add_argument("--comm-hook", default="none", choices=HOOKS,
                       help="how gradients travel (fp16, bf16: compressed; torus: a 2D torus) (default: none: "
                            "DDP's all-reduce)")
    t.add_argument("--torus-grid", type=grid, default=None, metavar="RxC",
                   help="with --comm-hook torus*: the 2D torus's rows x columns (default: a row per node, as many "
                        "columns as the node's GPUs)")
    t.add_argument("--dist-timeout", type=float, default=10.0, metavar="MINUTES",
                   help="how long a collective may wait for the other ranks before the run stops (default: 10: "
                        "torch's own for NCCL, for gloo too)")


def add_recipe_flags(p, *, default):
    """--recipe, --list-recipes and --print-recipe, as both scripts take them."""
    p.add_argument("--recipe", default=default, metavar="NAME",
                   help=f"what to train (--list-recipes) (default: {default})")
    p.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    p.add_argument("--print-recipe", action="store_true",
                   help="print the recipe's every setting (with the flags given) as the command that trains it, and "
                        "exit")


def cifar10_parser(description):
    """cifar10_fast.py's parser: its flags, the runs' (add_run_flags) and the recipe's settings."""
    from cifar10_recipes import MYRTLE24, Recipe       # here: the recipes import torch_backend, optim, ...
    from cifar_data import DATASETS
    p = Parser(description=description, formatter_class=HelpFormatter,
               usage="%(prog)s [--recipe NAME] [--data-dir PATH] [options] [--SETTING VALUE ...]")
    add_recipe_flags(p, default="myrtle24")
    p.add_argument("--dataset", default=None, type=one_of(DATASETS), metavar="{" + ",".join(DATASETS) + "}",
                   help="what a data folder holds, downloaded there if missing; for a .npz, that it is that dataset, "
                        "checked as such (default: cifar10; a .npz: your own data)")
    p.add_argument("--data-dir", default="data", metavar="PATH",
                   help="a data folder (the dataset downloaded and cached there), an unpacked archive folder, or a "
                        ".npz (train_images, train_labels, test_images, test_labels: any images (N, H, W, 3) uint8) "
                        "(default: data)")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help="train on the first N training images (default: all)")
    p.add_argument("--target", type=float, default=0.94, metavar="X",
                   help="the test accuracy whose first epoch stops the clock (default: 0.94)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the recipe, environment, per-epoch rows and summary there as JSON (default: none)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="write a torch.profiler trace (Chrome's JSON) of the first timed run, after the warm-up (the "
                        "GPU's kernels on a GPU), and print its top kernels by time on stderr; that run's time is the "
                        "profiler's too (default: none)")
    p.add_argument("--compile", default=None, choices=COMPILE_MODES,
                   help="torch.compile the network in this mode, once, in the untimed warm-up; reduce-overhead also "
                        "captures CUDA graphs (default: not compiled)")
    add_run_flags(p, comm_hook=True)
    add_flags(p, Recipe, recipe=MYRTLE24)
    return p


def join_ranks(args, hook=None):
    """This process's distributed.Context: --deterministic's settings first (before CUDA starts), then torchrun's
    process group joined (if any), with the communication hook (hook, or --comm-hook) and --torus-grid checked
    against its world. A bad value is a UsageError of one line (the group left again)."""
    if args.dist_timeout is not None and not (math.isfinite(args.dist_timeout) and args.dist_timeout > 0):
        raise UsageError("--dist-timeout must be positive (minutes)")
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        raise flag_error("bucket_mb", args.bucket_mb, "must be a positive number of MB")
    if args.deterministic:
        devices.set_deterministic()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        signal.signal(signal.SIGINT, interrupt_once)
    try:
        ctx = init_from_env(args.device, timeout_minutes=args.dist_timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        return dataclasses.replace(ctx, hook=comm_hook(hook or args.comm_hook, args.torus_grid, ctx),
                                   bucket_mb=args.bucket_mb)
    except ValueError as e:
        leave(ctx)
        raise UsageError(str(e)) from None


def lost_peer(error, ctx):
    """For a RuntimeError a rank's work raised: exit status 1 and one line in all (say_once) when a collective
    failed because another rank is gone (it ended, or its machine did); the error raised again when it is a fault of
    this rank's own."""
    lost = isinstance(error, torch.distributed.DistError) or any(
        mark in str(error) for mark in ("Connection reset by peer", "Connection closed by peer", "Connection refused",
                                        "NCCL communicator was aborted", "Socket Timeout", "Broken pipe"))
    if not (ctx.distributed and lost):
        raise error
    say_once(f"error: rank {ctx.rank} lost its peers: {first_sentence(error)}", "lost_peer")
    return 1


def runtime_error_exit(error, ctx, *, ways, **stop):
    """For a RuntimeError a rank's work raised: exit status 1 once one line says that an allocator refused on this rank
    (devices.out_of_memory; its device, the allocation, interrupted()'s where and what is kept (stop: its arguments)
    and `ways` to need less, over any progress bar), or lost_peer's exit status (it raises the error again)."""
    if not devices.out_of_memory(error):
        return lost_peer(error, ctx)
    asked = devices.refused_size(error)
    how = f"out of memory on {ctx.device}" + (f" (asked for {asked} more)" if asked else "")
    close_progress()
    rank = f"rank {ctx.rank} ran " if ctx.distributed else ""
    line = f"error: {rank}{interrupted(how=how, **stop)}; {ways}"
    if ctx.distributed:
        say_once(line, "out_of_memory")
    else:
        print(line, file=sys.stderr, flush=True)
    return 1


def phase_of(error, phases):
    """What the work was doing when `error` (a KeyboardInterrupt) stopped it: phases[name] of the innermost function
    of that name the interrupt came through ({"recipe_and_data": "loading the data"}), or None (inside an epoch)."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return next((phases[name] for name in reversed(names) if name in phases), None)


def ctrl_c_exit(line, status=130):
    """Exit status 130 (or `status`: SIGTERM's 143) once Ctrl-C's one line (interrupted()'s) is printed, over any
    progress bar. Under torchrun, whose own status is then 1 (it stops its workers and reports the signal),
    interrupt_once has kept its second SIGINT from cutting this short."""
    close_progress()
    print0(line, file=sys.stderr)
    return status


class Terminated(KeyboardInterrupt):
    """SIGTERM (how SLURM, docker and CI stop a job), met as Ctrl-C is: the same line of what was kept, exit status
    128 + SIGTERM."""
    status = 128 + signal.SIGTERM
    how = "terminated (SIGTERM)"


def stop_of(error):
    """(how interrupted() says it, the exit status) of a KeyboardInterrupt: Ctrl-C's, or SIGTERM's (Terminated)."""
    return (error.how, error.status) if isinstance(error, Terminated) else ("interrupted", 130)


def terminate_once(signum, frame):
    """SIGTERM's handler: raises Terminated where the work is; a second SIGTERM (torchrun forwards the one it caught)
    is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


class StdoutGone(Exception):
    """stdout cannot be written (its reader gone, its disk full) and no file keeps the results."""


class KeptStdout:
    """sys.stdout for a command whose reader may go (`| head`) or whose disk may fill: the first write that fails
    sends all later output to /dev/null; then, unless kept_in names the file the results go to (the work goes on),
    StdoutGone is raised. A closed pipe is quiet, as with other command-line tools; another error says so once."""

    def __init__(self, stream):
        self.stream, self.kept_in, self.lost = stream, None, None
        # read by what is imported while a command runs (sympy's pretty printer, through torch): here, not through
        # __getattr__, so the same functions run however the command was started (benchmarks/reading_path.py)
        self.encoding, self.errors = getattr(stream, "encoding", "utf-8"), getattr(stream, "errors", "strict")
        self.held = contextlib.ExitStack()        # what the command holds until it returns (claim_output's lock)

    def _do(self, action):
        if self.lost is None:
            try:
                return action(self.stream)
            except OSError as e:
                self.lost = e
                self._drop_the_rest()
                if e.errno != errno.EPIPE and self.kept_in:
                    print(f"warning: stdout: cannot write ({e.strerror or e}); the rest of the output is dropped, the "
                          f"results still go to {self.kept_in}", file=sys.stderr, flush=True)
                if not self.kept_in:
                    raise StdoutGone(e) from None
        return None

    def _drop_the_rest(self):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:        # the stream's own file onto /dev/null: what it still buffers, and Python's last flush, go nowhere
            os.dup2(devnull, self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            self.stream = open(os.devnull, "w")
        finally:
            os.close(devnull)

    def write(self, text):
        written = self._do(lambda stream: stream.write(text))
        return len(text) if written is None else written

    def flush(self):
        self._do(lambda stream: stream.flush())

    def __getattr__(self, name):
        return getattr(self.stream, name)


def claim_output(path, flag="--out", *, lock=True):
    """For the command running (command()): path is this process's alone to write until it returns (outputs.output_lock:
    another's is refused, OutputLocked, a UsageError; lock=False: path has a lock of its own, as prepare's store does),
    and a lost stdout lets the work go on, its results kept there. None claims nothing."""
    stdout = sys.stdout
    if isinstance(stdout, KeptStdout) and path is not None:
        stdout.held.enter_context(output_lock(path, flag) if lock else contextlib.nullcontext())
        stdout.kept_in = path


def command(main):
    """main(argv) run as a command line: its stdout a KeptStdout (a lost stdout stops it with exit status 141, as
    SIGPIPE would, quietly for a closed pipe, else with one line and status 1) and SIGTERM, unless a caller handles
    it, raising Terminated; both undone when it returns."""
    @functools.wraps(main)
    def run(argv=None):
        stdout = KeptStdout(sys.stdout)
        # only where SIGTERM is unclaimed (a caller's own handler, benchmarks/suite.py's, stays), in the main thread
        here = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        before = signal.signal(signal.SIGTERM, terminate_once) if here else None
        try:
            with contextlib.redirect_stdout(stdout), stdout.held:
                return main(argv)
        except StdoutGone as e:
            error = e.args[0]
            if error.errno == errno.EPIPE:
                return 128 + signal.SIGPIPE
            close_progress()
            print(f"error: stdout: cannot write ({error.strerror or error}); stopped", file=sys.stderr, flush=True)
            return 1
        finally:
            if here:
                signal.signal(signal.SIGTERM, before)
    return run


def interrupt_once(signum, frame):
    """SIGINT's handler under torchrun: Ctrl-C reaches a worker from the terminal and again from torchrun, which
    forwards the signal it caught to its workers; the first raises KeyboardInterrupt, the rest are ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupted(epoch, run, finished, *, out=None, checkpoint=None, during=None, how="interrupted"):
    """The line a stop leaves (Ctrl-C's, or `how` else): where the work stopped (in an epoch, or `during` what before
    the first) and what of it is kept (only what was written)."""
    line = f"{how} while {during}" if during else f"{how} in epoch {epoch} of run {run}"
    if checkpoint:
        line += (f"; the checkpoint of epoch {epoch - 1} is kept in {checkpoint} (--resume continues from it)"
                 if epoch > 1 else "; no epoch finished, so no checkpoint was written")
    if out:
        line += (f"; {finished} finished run{'s' * (finished != 1)} kept in {out}" if finished
                 else f"; no run finished, so nothing was written to {out}")
    return line


def recipe_list(recipes, width=100, *, notes=None):
    """What --list-recipes prints: a header, then each recipe's name and its doc (and its note, where notes has one:
    CIFAR-10's measured figure beside the published), wrapped in a column of its own so that no line is longer than
    width."""
    names = max(map(len, recipes)) + 2
    lines = [f"{'recipe':{names}}what it trains (--print-recipe --recipe NAME: its every setting)"]
    for name, r in recipes.items():
        doc = textwrap.wrap(r.doc, width - names) or [""]
        note = textwrap.wrap(f"measured: {notes[name]}", width - names) if notes and name in notes else []
        lines += [f"{name:{names}}{doc[0]}", *(" " * names + line for line in doc[1:] + note)]
    return "\n".join(lines)


def cpu_warning(untaken, dtype=torch.float32):
    """The warning of a run on the CPU in dtype (--precision's), with the advice of untaken (the ways to shrink the
    work that this run has not already taken: "--subset", "--width"), if any."""
    line = f"warning: no GPU in use: training on the CPU in {str(dtype).removeprefix('torch.')}, which is slow"
    if not untaken:
        return line
    ways = untaken[0] if len(untaken) == 1 else f"{', '.join(untaken[:-1])} and {untaken[-1]}"
    return f"{line}; for a demonstration, shrink the work with {ways}"


def environment(device):
    """The machine: torch and Python versions, the device and its name (and the CPU threads on a CPU)."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "device_name": devices.name(device)}
    if devices.is_cpu(device):
        env["threads"] = torch.get_num_threads()
    return env


def run_record(fields, args, *, argv, device, ctx):
    """The JSON record of a command-line run: `fields` (recipe, settings, runs, summary, ...; a recipe's settings by
    flag name), the command line, the environment with torchrun's world size and communication settings, and the
    date."""
    fields = {k: flat(v) if dataclasses.is_dataclass(v) else v for k, v in fields.items()}
    return {**fields, "argv": sys.argv[1:] if argv is None else list(argv),
            "environment": {**environment(device), "world_size": ctx.world_size, "bucket_mb": args.bucket_mb,
                            "comm_hook": ctx.hook.name, "torus_grid": args.torus_grid},
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
