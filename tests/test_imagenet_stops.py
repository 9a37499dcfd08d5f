"""How imagenet_fast.py's commands end when they are stopped from outside or cannot write their output: SIGTERM met
as Ctrl-C is (train keeps its checkpoint and says so; prepare its whole shards), one train at a time writing an
--out, stdout gone (a closed pipe, a full device) without the work lost, and the CPU warning's precision."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import imagenet_fast as inf
import outputs
from conftest import ROOT, small_jpeg_store
from imagefolders import synthetic_imagefolder
from test_cli import interrupted, read_first_line_then_close
from test_imagenet import children, left_alive

TINY = ["--recipe", "tiny", "--device", "cpu", "--batch-size", "8", "--width", "4", "--min-res", "24", "--max-res",
        "24", "--val-res", "24", "--loader-workers", "1", "--quiet"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_jpeg_store(tmp_path_factory)


def run_main(capsys, *args):
    """The command line in this process: (exit status, stdout, stderr's lines)."""
    rc = inf.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err.splitlines()


def test_sigterm_in_train_is_one_line_exit_143_and_the_checkpoint_kept(store, tmp_path):
    """SIGTERM (how SLURM, docker and CI stop a job) once epoch 1's row is printed, so after its checkpoint."""
    out, checkpoint = tmp_path / "r.json", tmp_path / "c.pt"
    rc, _, err = interrupted(["train", "--store", str(store), *TINY, "--epochs", "50", "--checkpoint", str(checkpoint),
                              "--out", str(out)], after=r"\s+1\s(?!.*\bpx\b)", sig=signal.SIGTERM,
                             script="imagenet_fast.py")      # the table's first row, not the schedule's
    assert rc == 143 and "Traceback" not in err, err
    line = re.fullmatch(rf"terminated \(SIGTERM\) in epoch (\d+) of run 1; the checkpoint of epoch (\d+) is kept in "
                        rf"{re.escape(str(checkpoint))} \(--resume continues from it\); no run finished, so nothing "
                        rf"was written to {re.escape(str(out))}", err.strip().splitlines()[-1])
    assert line and int(line[1]) == int(line[2]) + 1 >= 2, err
    assert torch.load(checkpoint, weights_only=False)["progress"]["epoch"] == int(line[2])
    assert not out.exists() and not (tmp_path / ".r.json.lock").exists()          # the lock of --out let go


def test_a_second_train_writing_the_same_out_is_refused_in_one_line_and_the_first_keeps_it(store, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["train", "--store", store, *TINY, "--epochs", "1", "--out", out]
    with outputs.output_lock(out, "--out"):           # the first run, still writing
        assert run_main(capsys, *args) == (2, "", [f"error: --out {out}: another run is writing it (process "
                                                   f"{os.getpid()}); give another --out, or wait for that run to end"])
        assert not out.exists()
    rc, _, err = run_main(capsys, *args)                # once it ends; no lock left
    assert rc == 0 and json.loads(out.read_text())["complete"] and os.listdir(tmp_path) == ["r.json"], err


@pytest.mark.parametrize("flags, status", [(["--out", "r.json"], 0), ([], 141)], ids=["out", "no_out"])
def test_train_read_by_head_1_goes_on_into_out_or_stops_quietly_as_sigpipe_would(store, tmp_path, flags, status):
    flags = [str(tmp_path / f) if f.endswith(".json") else f for f in flags]
    rc, first, err = read_first_line_then_close(["train", "--store", str(store), *TINY, "--epochs", "2", "--runs", "2",
                                                 *flags], script="imagenet_fast.py")
    assert (rc, err, first.split(" on ")[0]) == (status, [], "recipe tiny")
    if flags:
        res = json.loads(Path(flags[1]).read_text())
        assert res["complete"] and [r["seed"] for r in res["runs"]] == [0, 1]


@pytest.mark.parametrize("precision, dtype", [("auto", "float32"), ("bf16", "bfloat16"), ("fp64", "float64")])
def test_the_cpu_warning_names_the_precision_the_run_trains_in(store, capsys, precision, dtype):
    """Stopped by a batch larger than the store, right after the warning: nothing trained."""
    rc, _, err = run_main(capsys, "train", "--store", store, *TINY, "--epochs", "2", "--batch-size", "1000",
                          "--precision", precision)
    assert (rc, err) == (2, [f"warning: no GPU in use: training on the CPU in {dtype}, which is slow",
                             "error: --batch-size 1000: larger than the 48 training images"])


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return synthetic_imagefolder(tmp_path_factory.mktemp("tree") / "src", 4, 60, 2, sizes=(200, 300))


def prepare_command(tree, dst):
    return [sys.executable, str(ROOT / "imagenet_fast.py"), "prepare", "--src", str(tree), "--dst", str(dst),
            "--workers", "2", "--shard-size", "4"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_sigterm_to_prepare_and_its_workers_is_one_line_exit_143_and_keeps_the_whole_shards(tree, tmp_path):
    """As `timeout` and SLURM send it: to the whole process group, the encoding workers too."""
    proc = subprocess.Popen(prepare_command(tree, tmp_path / "s"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    journal = tmp_path / "s" / "train.journal.json"
    while proc.poll() is None and not (journal.is_file() and json.loads(journal.read_text())["shards"] >= 2):
        time.sleep(0.05)
    assert proc.poll() is None, "prepare finished before it could be stopped"
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    assert re.fullmatch(rf"terminated \(SIGTERM\); \d+ whole train shards \(\d+ images\) kept in {tmp_path / 's'}; the "
                        r"same command resumes from there", err.strip().splitlines()[-1]), err[-2000:]
    assert left_alive(workers) == []


def test_prepare_read_by_head_1_writes_the_whole_store_quietly(tree, tmp_path):
    rc, first, err = read_first_line_then_close(prepare_command(tree, tmp_path / "s")[2:], script="imagenet_fast.py")
    assert (rc, first.split(":")[0]) == (0, "train") and not [e for e in err if "error" in e or "Traceback" in e], err
    assert json.loads((tmp_path / "s" / "index.json").read_text())["train"]["count"] == 240


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose every write fails")
def test_prepare_with_stdout_on_a_full_device_says_so_in_one_line_and_writes_the_store(tree, tmp_path):
    dst = tmp_path / "s"
    with open("/dev/full", "w") as full:
        r = subprocess.run(prepare_command(tree, dst), cwd=ROOT, text=True, stdout=full, stderr=subprocess.PIPE,
                           timeout=600)
    warnings = [e for e in r.stderr.splitlines() if e.startswith(("warning", "error"))]
    assert (r.returncode, warnings) == (0, [f"warning: stdout: cannot write (No space left on device); the rest of "
                                            f"the output is dropped, the results still go to {dst}"]), r.stderr
    assert json.loads((dst / "index.json").read_text())["train"]["count"] == 240
