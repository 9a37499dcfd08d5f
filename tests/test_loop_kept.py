"""What training computes stays what it was: the per-step training losses and the final evaluation of every CIFAR-10
recipe family and of ImageNet's tiny recipe with SGD and EMA, LARS, and RMSprop-to-SGD, at tiny sizes with fixed
seeds, recorded in tests/data/loop_reference.json (`python tests/test_loop_kept.py --record`).

Each run computes in float64 from end to end (--precision fp64: the data, the weights, batch norm's statistics, the
loss, Muon's momentum and Newton-Schulz, which the record's settings keep in fp16 and bf16 otherwise; those settings
are tested in tests/test_techniques.py). In float64 other kernels move a run very little: forcing ATen's default
and AVX2 kernels on an AVX-512 AMD EPYC moved no value by more than 2e-15 (relative), where float32's kernels on
another CPU (an Intel Xeon with AMX) had moved fast94's tenth step by 2e-3. Each value is held to TOLERANCE, a bound
a thousand times above what other kernels do and a thousand times below what a real change does (both shown below).
No comparison depends on which machine recorded the values."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import cifar10_fast as cf  # noqa: E402
import distributed as D  # noqa: E402
import imagenet_data as idt  # noqa: E402
import imagenet_fast as inf  # noqa: E402
import imagenet_store as ims  # noqa: E402
from conftest import ROOT, synthetic_arrays  # noqa: E402
from imagefolders import synthetic_imagefolder  # noqa: E402

PATH = ROOT / "tests" / "data" / "loop_reference.json"
CIFAR = ["myrtle24", "myrtle10", "fast94", "fast94_muon", "fast94_next", "fast94_next_lowres", "fast94_curriculum"]
# the resolution curriculum's sides, one epoch each in the 3 epochs every run here has, and its lookahead tail over
# the last 3 of the 12 steps updating at each (its floored rate holds from step 11)
CIFAR_CHANGES = {"fast94_curriculum": dict(resolution_schedule=(24, 28), lookahead_tail_every=1)}
IMAGENET = {"imagenet_tiny": dict(ema_momentum=0.9, ema_every=5),
            "imagenet_lars": dict(lars=True, lars_trust=0.02),
            "imagenet_rmsprop_sgd": dict(rmsprop=True, rmsprop_beta_center=1.0, rmsprop_beta_period=2.0)}
TOLERANCE = 1e-9        # relative, for every per-step loss and the final test loss
# Other kernels forced on one machine, each as its variable names it: ATen's vector instructions, oneDNN's
KERNELS = {"aten_default": {"ATEN_CPU_CAPABILITY": "default"}, "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
           "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


def record_losses():
    """Training losses as the steps compute them (not the FLOP count's batch of 2, nor evaluations), into a list;
    undo with the returned function."""
    losses, real = [], F.cross_entropy

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled() and len(args[0]) >= 8:
            losses.append(out.sum().item())         # CIFAR-10's step sums each image's loss itself
        return out
    F.cross_entropy = recording
    return losses, lambda: setattr(F, "cross_entropy", real)


def cifar10(recipe, **changes):
    """{"steps", "final_acc", "test_loss"} of a tiny float64 CIFAR-10 run of the recipe."""
    losses, undo = record_losses()
    try:
        result = cf.train(recipe, data=synthetic_arrays(n_train=256, n_test=64),
                          changes=dict(epochs=3, width=1 / 16, batch_size=64, **changes),
                          options=cf.Options(device="cpu", seed=3, precision="fp64"))
    finally:
        undo()
    return {"steps": losses, "final_acc": result.runs[0]["final_acc"], "test_loss": result.rows[-1]["test_loss"]}


def imagenet(name, folder, **changes):
    """{"steps", "final_acc", "test_loss"} of a tiny float64 ImageNet run of IMAGENET[name] on a raw store of
    lossless images made in folder."""
    store = Path(folder) / "store"
    if not (store / "index.json").is_file():
        synthetic_imagefolder(Path(folder) / "src", 4, 24, 8, sizes=(24, 24), lossless=True)
        ims.prepare(Path(folder) / "src", store, ims.StoreSettings(format="raw", size=24), workers=1,
                    log=lambda s: None)
    data = idt.rank_data(ims.open_store(store), torch.device("cpu"), workers=1)
    r = inf.recipe("tiny", width=8, epochs=3, batch_size=16, min_res=24, max_res=24, val_res=24,
                   **{**IMAGENET[name], **changes})
    losses, undo = record_losses()
    try:
        result = inf.train_run(r, data, inf.Options(precision="fp64"), ctx=D.Context(), seed=1)
    finally:
        undo()
    return {"steps": losses, "final_acc": result["final_top1"], "test_loss": result["rows"][-1]["val_loss"]}


def run(name, folder, **changes):
    return (cifar10(name, **{**CIFAR_CHANGES.get(name, {}), **changes}) if name in CIFAR
            else imagenet(name, Path(folder) / name, **changes))


def deviation(got, ref):
    """The largest relative difference between got's per-step losses and final test loss and the reference's."""
    assert len(got["steps"]) == len(ref["steps"])
    pairs = zip(got["steps"] + [got["test_loss"]], ref["steps"] + [ref["test_loss"]])
    return max(abs(a - b) / abs(b) for a, b in pairs)


def same(got, ref):
    """Every value within TOLERANCE of the reference's; the final accuracy (of 64 images, in steps of 1/64) exact."""
    d = deviation(got, ref)
    assert d <= TOLERANCE, f"a value moved {d:.3g} (relative) from the reference's, outside the tolerance {TOLERANCE}"
    assert got["final_acc"] == ref["final_acc"]


@pytest.fixture(scope="module")
def reference():
    return json.loads(PATH.read_text())["runs"]


@pytest.mark.parametrize("name", CIFAR + list(IMAGENET))
def test_each_recipe_family_trains_as_it_did(reference, name, tmp_path, one_thread):
    same(run(name, tmp_path), reference[name])


def test_a_real_change_moves_the_values_a_thousand_times_past_the_tolerance(reference, one_thread):
    """The record's recipe with Nesterov momentum switched off, or label smoothing 0.01 higher."""
    ref = reference["fast94_next"]
    for change in (dict(nesterov=False), dict(label_smoothing=cf.recipe("fast94_next").label_smoothing + 0.01)):
        got = cifar10("fast94_next", **change)
        with pytest.raises(AssertionError, match="outside the tolerance"):
            same(got, ref)
        assert deviation(got, ref) > 1000 * TOLERANCE


@pytest.mark.parametrize("kernels", KERNELS)
def test_other_kernels_move_the_values_a_thousand_times_less_than_the_tolerance(kernels, tmp_path):
    """The most sensitive runs (Muon's, and ImageNet's with EMA) in a process of their own with other kernels
    forced (KERNELS)."""
    out = subprocess.run([sys.executable, __file__, "--deviation", "1", str(tmp_path), "fast94_next", "imagenet_tiny"],
                         env={**os.environ, **KERNELS[kernels]}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    deviations = json.loads(out.stdout.splitlines()[-1])
    assert max(deviations.values()) < TOLERANCE / 1000, deviations


def test_two_threads_move_the_values_a_thousand_times_less_than_the_tolerance(reference):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert deviation(cifar10("fast94_next"), reference["fast94_next"]) < TOLERANCE / 1000
    finally:
        torch.set_num_threads(threads)


def main(argv):
    """--record [NAME...]: writes the reference (of the runs named, the others kept); --deviation THREADS FOLDER
    NAME...: prints each run's deviation from it."""
    import tempfile
    if argv[:1] == ["--record"]:
        torch.set_num_threads(1)
        names = argv[1:] or CIFAR + list(IMAGENET)
        with tempfile.TemporaryDirectory() as tmp:
            runs = {name: run(name, tmp) for name in names}
        kept = json.loads(PATH.read_text())["runs"] if argv[1:] else {}
        ordered = {name: {**kept, **runs}[name] for name in CIFAR + list(IMAGENET) if name in {**kept, **runs}}
        PATH.write_text(json.dumps({"precision": "fp64", "runs": ordered}, indent=1) + "\n")
        print(f"wrote {PATH}:", ", ".join(f"{k} ({len(v['steps'])} steps)" for k, v in runs.items()))
    elif argv[:1] == ["--deviation"] and len(argv) >= 4:
        torch.set_num_threads(int(argv[1]))
        ref = json.loads(PATH.read_text())["runs"]
        print(json.dumps({name: deviation(run(name, argv[2]), ref[name]) for name in argv[3:]}))
    else:
        sys.exit("usage: python tests/test_loop_kept.py --record [NAME...] | --deviation THREADS FOLDER NAME...")


if __name__ == "__main__":
    main(sys.argv[1:])
