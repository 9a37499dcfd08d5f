"""The one-line errors that every module raises and the scripts report: UsageError (a bad flag or argument, exit
status 2) and DataError (bad or missing data, 1), each said as one line, `error: ...`: by say_error (once in a
torchrun job: say_once asks torchrun's store, which its agent serves before the job's process group exists), and
by Parser for argparse's own.

Nothing here imports torch (but say_once, under torchrun), so it can be read and tested on its own.
"""
import argparse
import os
import sys
from pathlib import Path


class DataError(Exception):
    """Bad or missing data: the message names the file and what is wrong."""


class UsageError(ValueError):
    """A bad flag or argument: the message names it, says what is wrong and what is allowed (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (`error: argument --tta: ...`, say_error's) and exit status 2; a flag
    given an empty value (`--device ""`, an unset shell variable) is refused, never read as its default."""

    def _get_value(self, action, arg_string):
        # argparse's one place where each given string becomes a value; a typed flag (a recipe's list, where an empty
        # word is an empty list) reads "" its own way
        if arg_string == "" and action.option_strings and action.type in (None, str, Path):
            self.error(f"{action.option_strings[-1]} '': empty; give a value"
                       + (", or leave the flag out for its default" if action.default is not None else ""))
        return super()._get_value(action, arg_string)

    def error(self, message):
        say_error(message)
        self.exit(2)


def say_error(error, *, each_node=False):
    """Prints a usage or data error's one line, `error: ...`: under torchrun once in the job, by the first process to
    meet it (say_once; each_node: once on each node, for what each node reads of its own, its data), at the
    workers' first start only; else on rank 0. Every process then exits with the same status (2, or 1 for data)
    unless torchrun stops it first; a restart torchrun was asked for meets the same error and says nothing; torchrun
    returns 1, its status whenever a worker fails (its report lists each worker's)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if torchrun_attempt() == 0:
            say_once(f"error: {error}", f"error/{os.environ['GROUP_RANK'] if each_node else 'all'}")
    elif os.environ.get("LOCAL_RANK" if each_node else "RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)      # one process, or another launcher's rank 0


def torchrun_attempt():
    """How many times torchrun has restarted this job's workers (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say_once(line, what):
    """Prints `line` on stderr once in the torchrun job's attempt: by the first process to count `what` in the store
    at MASTER_ADDR:MASTER_PORT (torchrun's agent's, which outlives its workers and serves them before their process
    group exists), or by any that cannot reach it within seconds (its machine gone); the others wait up to 5 s until
    it is said, since torchrun stops every worker once one has ended."""
    import datetime
    from torch.distributed import DistError, TCPStore
    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=5))
        key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{torchrun_attempt()}/{what}"
        first = store.add(key, 1) == 1
    except (KeyError, ValueError, RuntimeError, DistError):
        first, store = True, None
    if first:
        print(line, file=sys.stderr, flush=True)
    try:
        if first and store:
            store.set(f"{key}/said", "1")
        elif store:
            store.wait([f"{key}/said"])
    except (RuntimeError, DistError):
        pass            # the first gone, or the store: nothing more to wait for
