"""What a new user meets on a mistake: a run that diverges, a checkpoint of another store, a batch larger than the
store, an --out that cannot be written, an --interrupt-after-epoch and a Ctrl-C before training: each one line,
the right exit status, and nothing finished lost. In this process on a tiny raw store (a second a case)."""
import json
import os
import sys

import pytest
import torch

import core
import imagenet_fast as inf
import imagenet_store as ims
import outputs
import progress
from conftest import main_output
from imagefolders import synthetic_imagefolder

SIZE = 16
TINY = ["--recipe", "tiny", "--device", "cpu", "--width", "4", "--batch-size", "8", "--min-res", SIZE, "--max-res",
        SIZE, "--val-res", SIZE, "--warmup-epochs", "0", "--quiet"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two tiny raw stores of 4 classes (24 and 32 training images): the same recipe trains on either."""
    root = tmp_path_factory.mktemp("stores")
    out = []
    for name, per_class in (("a", 6), ("b", 8)):
        src = synthetic_imagefolder(root / f"src_{name}", 4, per_class, 2, sizes=(16, 20), seed=len(out))
        ims.prepare(src, root / name, ims.StoreSettings(format="raw", size=SIZE), workers=1, shard_size=64,
                    log=lambda s: None)
        out.append(root / name)
    return out


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys, *args):
    """(exit status, stdout, stderr lines) of imagenet_fast.main(args) in this process."""
    return main_output(inf.main, args, capsys)


def test_a_diverging_run_stops_at_the_end_of_its_epoch_with_one_line_and_exit_1(stores, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, stdout, err = run(capsys, "train", "--store", stores[0], *TINY, "--epochs", "3", "--lr", "1e30", "--out", out)
    assert rc == 1 and err == ["error: epoch 1: the training loss is nan; lower --lr (here "
                               "1e+30) or warm up longer (--warmup-epochs, here 0)"], err
    assert "final top-1" not in stdout and not out.exists()


def test_a_run_that_diverges_keeps_the_runs_before_it(stores, tmp_path, capsys, monkeypatch):
    real, calls = inf.epoch_loss, []

    def third_epoch_infinite(losses, ctx):           # the second run's first epoch (2 epochs a run)
        calls.append(1)
        return float("inf") if len(calls) == 3 else real(losses, ctx)
    monkeypatch.setattr(inf, "epoch_loss", third_epoch_infinite)
    out = tmp_path / "r.json"
    rc, _, err = run(capsys, "train", "--store", stores[0], *TINY, "--epochs", "2", "--runs", "2", "--out", out)
    assert rc == 1 and err[-1].startswith("error: epoch 1: the training loss is inf; "), err
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0]


def test_check_finite_loss_names_the_epoch_and_the_hint():
    import training as T
    T.check_finite_loss(2.5, epoch=3, hint="lower --lr")
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(core.DataError) as e:
            T.check_finite_loss(bad, epoch=3, hint="lower --lr")
        assert str(e.value) == f"epoch 3: the training loss is {bad}; lower --lr"


def test_a_checkpoint_resumes_only_on_the_store_it_was_written_on(stores, tmp_path, capsys):
    ckpt = tmp_path / "c.pt"
    args = [*TINY, "--epochs", "2", "--checkpoint", ckpt]
    rc, stdout, err = run(capsys, "train", "--store", stores[0], *args, "--interrupt-after-epoch", "1")
    assert rc == inf.INTERRUPTED, err
    digest = {s: inf.store_identity(ims.open_store(s), s)["digest"] for s in stores}
    rc, stdout, err = run(capsys, "train", "--store", stores[1], *args, "--resume")
    assert rc == 1 and err == [
        f"error: {ckpt}: written on another store ({stores[0]}, index {digest[stores[0]]}), resumed on {stores[1]} "
        f"(index {digest[stores[1]]}); resume on that store, or start afresh without --resume"]
    assert torch.load(ckpt, weights_only=False)["progress"]["epoch"] == 1          # left as it was
    rc, stdout, err = run(capsys, "train", "--store", stores[0], *args, "--resume")
    assert rc == 0 and f"resumed from epoch 1 of {ckpt}" in stdout, err


def test_interrupt_after_epoch_prints_its_row_and_names_resume(stores, tmp_path, capsys):
    ckpt = tmp_path / "c.pt"
    rc, stdout, err = run(capsys, "train", "--store", stores[0], *TINY, "--epochs", "3", "--checkpoint", ckpt,
                          "--interrupt-after-epoch", "2")
    assert rc == 75 and err == [f"stopped after epoch 2 (--interrupt-after-epoch), exit status 75; its checkpoint is "
                                f"{ckpt}: the same command with --resume continues from it"]
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "res"])
    assert [line.split()[0] for line in lines[header + 1:]] == ["1", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "64"], "error: --batch-size 64: larger than the 24 training images"),
    (["--batch-size", "16", "--per-gpu-batch", "true", "--epochs", "2"], None),
    (["--batch-size", "32", "--per-gpu-batch", "true"],
     "error: --batch-size 32: larger than the 24 training images (32 on each of 1 GPU, --per-gpu-batch)"),
    (["--batch-size", "8", "--batch-schedule", "0,8,1,32", "--epochs", "2"],
     "error: --batch-schedule: the global batch of epoch 2, 32 images, is larger than the store's 24 training "
     "images"),
])
def test_a_global_batch_larger_than_the_store_is_refused_before_training(stores, capsys, monkeypatch, flags,
                                                                         message):
    if message:
        monkeypatch.setattr(inf, "train_runs", lambda *a, **k: pytest.fail("trained"))
    rc, _, err = run(capsys, "train", "--store", stores[0], *TINY, *flags)
    assert (rc, err) == ((2, [message]) if message else (0, [])), err


def test_the_results_table_counts_the_global_batch_as_the_schedule_does(stores):
    """A row's batch is the global batch (the schedule's), not a rank's: here a run planned for 2 ranks of 4."""
    import distributed as D
    import imagenet_data as idt
    r = inf.recipe("tiny", width=4, batch_size=8, epochs=1, min_res=SIZE, max_res=SIZE, val_res=SIZE)
    data = idt.rank_data(ims.open_store(stores[0]), torch.device("cpu"))
    result = inf.train_run(r, data, inf.Options(), ctx=D.Context(world_size=2), seed=0)
    assert inf.epoch_plans(r, 2)[0].batch == 4 and [row["batch"] for row in result["rows"]] == [8]
    assert inf.schedule_text(r, inf.epoch_plans(r, 2), world=2).splitlines()[2].split()[2] == "8"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_an_out_that_cannot_be_written_is_refused_before_any_work(stores, capsys, monkeypatch):
    """/proc admits no new file, whatever its permissions say (as root they say yes): --out is tried by writing."""
    monkeypatch.setattr(outputs.os, "access", lambda *a: True)
    rc, _, err = run(capsys, "train", "--store", stores[0], *TINY, "--out", "/proc/r.json")
    assert rc == 2 and err == ["error: --out /proc/r.json: /proc: cannot write --out's file there (No such file or "
                               "directory); give a path in a folder you can write in"]


def test_an_out_is_tried_by_writing_and_nothing_is_left(tmp_path):
    outputs.check_output(tmp_path / "new" / "r.json", "--out")
    outputs.check_output(tmp_path / "r.json", "--out")
    assert os.listdir(tmp_path) == []


def test_ctrl_c_while_placing_the_store_says_so(stores, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(inf, "rank_data", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "r.json"
    rc, _, err = run(capsys, "train", "--store", stores[0], *TINY, "--out", out)
    assert rc == 130 and err == [f"interrupted while placing the store; no run finished, so nothing was written to "
                                 f"{out}"]


def test_prepare_on_a_finished_store_says_so_once(stores, capsys):
    src = stores[0].parent / "src_a"
    rc, stdout, err = run(capsys, "prepare", "--src", src, "--dst", stores[0], "--format", "raw", "--size", SIZE)
    assert rc == 0 and stdout.splitlines() == [f"{stores[0]}: already prepared (24 train, 8 val images)"], stdout


# --- CIFAR-10's command line ---------------------------------------------------------------------------------------

def cifar(capsys, *args):
    """(exit status, stderr lines) of cifar10_fast.main(args) in this process, the CPU's warning left out."""
    import cifar10_fast as cf
    rc, _, err = main_output(cf.main, args, capsys)
    return rc, err


def test_ctrl_c_while_loading_says_so_not_epoch_1(tmp_path, capsys, monkeypatch):
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "load", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "r.json"
    rc, err = cifar(capsys, "--data-dir", tmp_path / "x.npz", "--device", "cpu", "--out", out)
    assert rc == 130 and err == [f"interrupted while loading the data; no run finished, so nothing was written to "
                                 f"{out}"]


def test_a_file_that_is_no_npz_and_one_without_the_arrays_are_named_in_one_line(tmp_path, capsys):
    import numpy as np
    text, other = tmp_path / "text.npz", tmp_path / "other.npz"
    text.write_text("train_images,train_labels\n")
    np.savez(other, images=np.zeros((2, 32, 32, 3), np.uint8), train_labels=np.zeros(2, np.uint8))
    rc, err = cifar(capsys, "--data-dir", text, "--device", "cpu")
    assert rc == 1 and err == [f"error: {text}: not a readable .npz (not a zip archive of arrays, as numpy.savez "
                               "writes)"]
    rc, err = cifar(capsys, "--data-dir", other, "--device", "cpu")
    assert rc == 1 and err == [f"error: {other}: missing arrays ['train_images', 'test_images', 'test_labels']; it "
                               "holds ['images', 'train_labels'], expected ['train_images', 'train_labels', "
                               "'test_images', 'test_labels']"]


def test_close_progress_ends_a_bar_left_open():
    import io
    from tqdm import tqdm
    bar = tqdm(total=10, file=io.StringIO())
    bar.update(3)
    progress.close_progress()
    assert bar not in tqdm._instances and bar.disable


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="Linux's CPU model")
def test_the_cpu_is_named_by_its_model_not_its_architecture():
    import platform
    import devices
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    assert devices.name("cpu") == (models[0] if models else platform.processor() or platform.machine())


@pytest.mark.parametrize("cpuinfo", [None, "processor\t: 0\nBogoMIPS\t: 50.00\n"])     # no /proc; an ARM's
def test_without_a_model_name_the_cpu_is_named_by_what_platform_knows(cpuinfo, monkeypatch):
    import io
    import platform
    import devices

    def cpuinfo_file(path, *args, **kwargs):
        if cpuinfo is None:
            raise FileNotFoundError(path)
        return io.StringIO(cpuinfo)
    monkeypatch.setattr(devices, "open", cpuinfo_file, raising=False)         # devices' own name for open
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert devices.name("cpu") == "aarch64"
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert devices.name("cpu") == "arm"


def test_exit_now_flushes_the_output_and_runs_nothing_more(tmp_path):
    """After Ctrl-C the scripts leave by processes.exit_now: the line printed, the status kept, and none of the
    interpreter's finalisation (here an atexit handler that would write a file) run after it."""
    import subprocess
    late = tmp_path / "late"
    code = (f"import atexit, sys, processes; atexit.register(open, {str(late)!r}, 'w'); print('kept', end=''); "
            "print('line', file=sys.stderr, end=''); processes.exit_now(130)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(core.__file__)})
    assert (r.returncode, r.stdout, r.stderr) == (130, "kept", "line") and not late.exists()


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-5"], "--seed -5: must not be negative (the runs' seeds: seed, seed + 1, ...)"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--runs", "0"], "--runs 0: must be at least 1"),
    (["--subset", "0"], "--subset 0: must be positive"),
    (["--eval-every", "-1"], "--eval-every -1: must not be negative (0: evaluate only after the last epoch)"),
    (["--whiten", "false", "--whiten-eps", "1e-3"], "--whiten false leaves out what --whiten-eps 0.001 sets; give one "
                                                    "or the other"),
    (["--whiten-eps", "1e-3", "--whiten", "false"], "--whiten false leaves out what --whiten-eps 0.001 sets; give one "
                                                    "or the other"),
    (["--ema-every", "2", "--ema-momentum", "0"], "--ema-momentum 0 leaves out what --ema-every 2 sets; give one or "
                                                  "the other"),
    (["--device", ""], "--device '': empty; give a value"),          # an unset shell variable, never the default
    (["--out="], "--out '': empty; give a value"),
    (["--recipe", ""], "--recipe '': empty; give a value, or leave the flag out for its default"),
])
def test_cifar_refuses_a_bad_run_flag_or_contradicting_switches_before_loading(flags, message, tmp_path, capsys,
                                                                             monkeypatch):
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "load", lambda *a, **k: pytest.fail("loaded"))
    rc, err = cifar(capsys, "--data-dir", tmp_path / "x.npz", "--device", "cpu", *flags)
    assert (rc, err) == (2, [f"error: {message}"])


def test_cifar_refuses_a_run_shorter_than_one_step(tmp_path, capsys):
    from conftest import synthetic_arrays
    import numpy as np
    np.savez(tmp_path / "d.npz", **synthetic_arrays(256, 32))
    rc, err = cifar(capsys, "--data-dir", tmp_path / "d.npz", "--device", "cpu", "--batch-size", "64", "--epochs",
                    "0.0001", "--out", tmp_path / "r.json")
    assert (rc, err) == (2, ["error: --epochs 0.0001: shorter than one step (an epoch here is 4 steps of 64 images); "
                             "give at least 1/4"])
    assert os.listdir(tmp_path) == ["d.npz"]


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "--seed -1: must not be negative (the runs' seeds: seed, seed + 1, ...)"),
    (["--interrupt-after-epoch", "0", "--checkpoint", "c.pt"], "--interrupt-after-epoch must be positive"),
    (["--ema-every", "2", "--ema-momentum", "0"], "--ema-momentum 0 leaves out what --ema-every 2 sets; give one or "
                                                  "the other"),
    (["--checkpoint", ""], "--checkpoint '': empty; give a value"),
])
def test_imagenet_refuses_a_bad_run_flag_before_opening_the_store(flags, message, stores, capsys, monkeypatch):
    monkeypatch.setattr(inf, "open_store", lambda *a, **k: pytest.fail("opened"))
    rc, _, err = run(capsys, "train", "--store", stores[0], *TINY, *flags)
    assert (rc, err) == (2, [f"error: {message}"])


def test_top5_is_not_reported_of_5_classes_or_fewer(stores, capsys):
    rc, stdout, err = run(capsys, "train", "--store", stores[0], *TINY, "--epochs", "1", "--target", "0.3")
    assert rc == 0, err
    lines = stdout.splitlines()
    header = next(k for k, line in enumerate(lines) if line.split()[:2] == ["epoch", "res"])
    row = dict(zip(lines[header].split(), lines[header + 1].split()))
    assert row["top5"] == "-" and float(row["top1"]) >= 0
    final = next(line for line in lines if line.startswith("final top-1"))
    assert "top-5 not reported (4 classes)" in final and "top-5 1" not in final


def test_a_store_of_one_class_is_refused_for_training(tmp_path, capsys):
    """prepare refuses a tree of one class (test_prepare_refusals); a store that says it holds one (its index.json
    written otherwise) is refused by train."""
    src = synthetic_imagefolder(tmp_path / "src", 2, 8, 2, sizes=(16, 20))
    ims.prepare(src, tmp_path / "one", ims.StoreSettings(format="raw", size=SIZE), workers=1, log=lambda s: None)
    index = json.loads((tmp_path / "one" / "index.json").read_text())
    (tmp_path / "one" / "index.json").write_text(json.dumps({**index, "classes": ["c000"]}))
    capsys.readouterr()                     # prepare's progress
    rc, _, err = run(capsys, "train", "--store", tmp_path / "one", *TINY)
    assert (rc, err) == (1, [f"error: {tmp_path / 'one'}: one class (c000); a classifier needs at least 2"])
