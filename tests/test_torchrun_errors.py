"""A mistake under torchrun ends the job once, in one line: torchrun restarts after every failed exit status (a bad
flag or bad data would only fail again, each time with torchrun's report), so the script stops torchrun itself
(core.end_torchrun). 2 CPU processes, gloo on loopback, tiny."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, synthetic_arrays


def torchrun(*args, restarts=3, script=("cifar10_fast.py",)):
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


@pytest.mark.parametrize("flags, line", [
    (["--epochs", "0"], "error: --epochs 0: must be positive"),
    (["--tta", "all"], "error: argument --tta: 'all' is not one of none, flip, flip_translate"),    # core.Parser's
])
def test_a_usage_error_under_torchrun_with_restarts_ends_the_job_once_in_one_line(flags, line):
    rc, out, err = ended(torchrun(*flags))
    assert err == [line] and rc == -signal.SIGKILL, err         # the worker stopped torchrun: no restart, no report


def test_a_data_error_under_torchrun_with_restarts_ends_the_job_once_in_one_line(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    rc, out, err = ended(torchrun("--data-dir", bad))
    assert len(err) == 2 and err[0].startswith("warning: no GPU in use") and err[1].startswith(f"error: {bad}: "), err
    assert rc == -signal.SIGKILL


def test_imagenet_without_its_store_under_torchrun_ends_the_job_once_in_one_line(tmp_path):
    rc, out, err = ended(torchrun("--store", tmp_path / "none", "--recipe", "tiny",
                                  script=("imagenet_fast.py", "train")))
    assert err[-1] == (f"error: {tmp_path / 'none'}: not a prepared store (no index.json); run `imagenet_fast.py "
                       "prepare` first") and sum(line.startswith("error:") for line in err) == 1, err
    assert rc == -signal.SIGKILL


@pytest.mark.slow          # torchrun, then two epochs of training: 6 s on a quiet 2-core CPU, 24 s on a busy one
def test_ctrl_c_under_torchrun_leaves_the_projects_line_and_no_report(tmp_path):
    data = tmp_path / "synth.npz"
    np.savez(data, **synthetic_arrays(n_train=256, n_test=64))
    proc = torchrun("--data-dir", data, "--epochs", "50", "--width", "0.0625", "--batch-size", "64", restarts=0)
    for row in proc.stdout:
        if row.split()[:1] == ["2"]:         # epoch 2's row: training is under way
            break
    os.killpg(proc.pid, signal.SIGINT)       # what Ctrl-C in a terminal sends
    rc, out, err = ended(proc)
    assert err[-1].startswith("interrupted in epoch ") and err[-1].endswith(" of run 1"), err
    assert not any("Traceback" in line or "ChildFailedError" in line for line in err), err


def test_nothing_is_stopped_but_the_torchrun_that_started_this_process(monkeypatch):
    """Without torchrun's variables, or with them but a parent that is not torchrun, end_torchrun stops nothing."""
    import core
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail(f"stopped {a}"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    core.end_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_RANK", "0")
    core.end_torchrun()                                    # this process's parent runs pytest, not torchrun
    assert not core.started_by_torchrun(os.getppid()) and not core.started_by_torchrun(-1)
