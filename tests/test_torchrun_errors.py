"""A mistake under torchrun ends the job in one line: the first worker to meet it says it (core.say_error), every
worker exits with its status (2 for a usage error, 1 for bad data) unless torchrun has stopped it first, a restart meets
the same error in silence, and torchrun returns 1: its own status whenever a worker fails, whatever the worker's (its
report names each worker's; nothing the workers do sets it but killing it). 2 CPU processes, gloo on loopback, tiny."""
import datetime
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cli
import core
import distributed as D
from conftest import ROOT, synthetic_arrays


def torchrun(*args, restarts=1, script=("cifar10_fast.py",)):
    """The Popen of torchrun --max-restarts `restarts` running script (cifar10_fast.py) on 2 CPU processes, in a
    session of its own (as a terminal's foreground job is)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             f"--max-restarts={restarts}", str(ROOT / script[0]), *script[1:], "--device", "cpu",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env, start_new_session=True)


def ended(proc):
    """(exit status, stdout, stderr lines) once proc and every process holding its pipes have ended."""
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err.strip().splitlines()


def ours(err):
    """The lines of stderr that the project's processes wrote (not torchrun's log, banner or report)."""
    report = err.index(next(line for line in err if line.startswith("Traceback"))) if any(
        line.startswith("Traceback") for line in err) else len(err)
    return [line for line in err[:report] if not re.match(r"[EWI]\d{4} |\*{5}|Setting OMP_NUM_THREADS", line)]


def root_cause_status(err):
    """The exit status torchrun's report gives its first failed worker."""
    at = err.index("Root Cause (first observed failure):")
    return int(next(re.match(r"\s*exitcode\s*: (-?\d+)", line)[1] for line in err[at:] if "exitcode" in line))


@pytest.mark.parametrize("flags, line", [
    (["--epochs", "0"], "error: --epochs 0: must be positive"),
    (["--tta", "all"], "error: argument --tta: 'all' is not one of none, flip, flip_translate"),    # core.Parser's
])
def test_a_usage_error_under_torchrun_with_a_restart_is_said_once_and_torchrun_returns_1(flags, line):
    rc, out, err = ended(torchrun(*flags))
    assert ours(err) == [line] and rc == 1, err          # the restart met it again, in silence
    assert root_cause_status(err) == 2 and sum("failed (exitcode: 2)" in e for e in err) >= 2, err   # each attempt


def test_a_data_error_under_torchrun_is_said_once_and_torchrun_returns_1(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    rc, out, err = ended(torchrun("--data-dir", bad, restarts=0))
    errors = [e for e in ours(err) if not e.startswith("warning: no GPU in use")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}: "), err
    assert rc == 1 and root_cause_status(err) == 1, err


def test_imagenet_without_its_store_under_torchrun_is_said_once_and_torchrun_returns_1(tmp_path):
    rc, out, err = ended(torchrun("--store", tmp_path / "none", "--recipe", "tiny", restarts=0,
                                  script=("imagenet_fast.py", "train")))
    assert [e for e in ours(err) if e.startswith("error:")] == [
        f"error: {tmp_path / 'none'}: not a prepared store (no index.json); run `imagenet_fast.py prepare` first"], err
    assert rc == 1 and root_cause_status(err) == 1, err


@pytest.mark.slow          # torchrun, then two epochs of training: 6 s on a quiet 2-core CPU, 24 s on a busy one
def test_ctrl_c_under_torchrun_leaves_the_projects_line_once_and_no_traceback_of_a_worker(tmp_path):
    """Ctrl-C reaches the workers from the terminal and again from torchrun (which then reports the signal and returns
    1): the second interrupt cuts nothing short."""
    data = tmp_path / "synth.npz"
    np.savez(data, **synthetic_arrays(n_train=256, n_test=64))
    proc = torchrun("--data-dir", data, "--epochs", "50", "--width", "0.0625", "--batch-size", "64", restarts=0)
    for row in proc.stdout:
        if row.split()[:1] == ["2"]:         # epoch 2's row: training is under way
            break
    os.killpg(proc.pid, signal.SIGINT)       # what Ctrl-C in a terminal sends
    rc, out, err = ended(proc)
    lines = [e for e in ours(err) if e.startswith("interrupted")]
    assert len(lines) == 1 and re.fullmatch(r"interrupted in epoch \d+ of run 1", lines[0]), err
    assert lines[0] == ours(err)[-1], err
    assert not any("cifar10_fast.py" in e for e in err) and rc == 1, err      # torchrun's traceback alone
    assert err[-1].startswith("torch.distributed.elastic.multiprocessing.api.SignalException: "), err


@pytest.fixture
def agent_store(monkeypatch):
    """A store standing in for torchrun's agent's, and the variables torchrun gives its workers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": "job",
                 "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_RANK": "0", "RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    return store


def test_the_first_worker_to_meet_an_error_says_it_and_a_restart_says_nothing(agent_store, monkeypatch, capsys):
    core.say_error("--epochs 0: must be positive")
    core.say_error("--epochs 0: must be positive")              # another worker, rank 1 or not
    assert capsys.readouterr().err == "error: --epochs 0: must be positive\n"
    core.say_error("data.npz: truncated", each_node=True)       # each node's: once on this one
    monkeypatch.setenv("GROUP_RANK", "1")
    core.say_error("data.npz: truncated", each_node=True)
    core.say_error("data.npz: truncated", each_node=True)
    assert capsys.readouterr().err == "error: data.npz: truncated\n" * 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    core.say_error("--epochs 0: must be positive")
    assert capsys.readouterr().err == ""


def test_without_torchrun_rank_0_says_the_error(monkeypatch, capsys):
    for k in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    core.say_error("x")                                         # one process
    monkeypatch.setenv("RANK", "1")
    core.say_error("y")
    monkeypatch.setenv("LOCAL_RANK", "0")
    core.say_error("z", each_node=True)
    assert capsys.readouterr().err == "error: x\nerror: z\n"


def test_a_lost_peer_is_said_once_in_all_and_where_no_store_answers(agent_store, monkeypatch, capsys):
    ctx = D.Context(rank=1, world_size=3, distributed=True)
    gone = dist.DistError("Connection closed by peer [127.0.0.1]:1234")
    assert [cli.lost_peer(gone, ctx) for _ in range(3)] == [1, 1, 1]           # three ranks left behind
    assert capsys.readouterr().err == "error: rank 1 lost its peers: Connection closed by peer [127.0.0.1]:1234\n"
    with pytest.raises(ValueError):
        cli.lost_peer(ValueError("a fault of its own"), ctx)
    monkeypatch.setenv("MASTER_PORT", "1")                                      # the agent's machine gone too
    assert cli.lost_peer(gone, ctx) == 1 and capsys.readouterr().err.startswith("error: rank 1 lost its peers")


def test_running_out_of_memory_under_torchrun_is_said_once_naming_the_rank(agent_store, capsys):
    ctx = D.Context(rank=1, world_size=2, distributed=True, device="cuda:1")
    refusal = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
                                     "79.19 GiB of which 1.06 GiB is free.")
    assert [cli.runtime_error_exit(refusal, ctx, ways="less", epoch=3, run=1, finished=0) for _ in range(2)] == [1, 1]
    assert capsys.readouterr().err == ("error: rank 1 ran out of memory on cuda:1 (asked for 2.0 GiB more) in epoch 3 "
                                       "of run 1; less\n")


def test_a_second_interrupt_under_torchrun_is_ignored():
    before = signal.signal(signal.SIGINT, cli.interrupt_once)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        os.kill(os.getpid(), signal.SIGINT)           # torchrun's, forwarded: nothing raised
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
