"""What training computes stays what it was: the per-step training losses and the final evaluation of every CIFAR-10
recipe family and of ImageNet's tiny recipe with SGD and EMA, LARS, and RMSprop-to-SGD, at tiny sizes with fixed
seeds on one CPU thread, recorded in tests/data/loop_reference.json (`python tests/test_loop_kept.py --record`).

Their inputs decode alike on any machine (CIFAR-10-shaped arrays, and an ImageNet raw store of lossless images kept
at their own size). Bit for bit on a machine of the recording one's instruction set and torch. Elsewhere kernels
round differently, and a run amplifies the difference step by step (most in the Muon recipes, whose Newton-Schulz
runs in bfloat16): each value is held within ten times the deviation that other kernels (oneDNN's convolutions off)
gave on the recording machine by that step, and at least 1e-6. A test shows a third way of rounding (two threads)
inside that tolerance and two real changes (Nesterov momentum switched, label smoothing 0.01 higher) outside it."""
import json
import platform
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

PATH = ROOT / "tests" / "data" / "loop_reference.json"
CIFAR = ["myrtle24", "myrtle10", "fast94", "fast94_muon", "fast94_next", "fast94_next_lowres"]
IMAGENET = {"imagenet_tiny": dict(ema_momentum=0.9, ema_every=5),
            "imagenet_lars": dict(lars=True, lars_trust=0.02),
            "imagenet_rmsprop_sgd": dict(rmsprop=True, rmsprop_beta_center=1.0, rmsprop_beta_period=2.0)}
MARGIN, FLOOR = 10.0, 1e-6     # the tolerance: this many times the rounding envelope, and at least this (relative)


def machine():
    """What decides a kernel's rounding: the CPU's instruction set (its flags, not its model name), and torch."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return {"arch": platform.machine(), "flags": sorted(flags), "torch": torch.__version__}


def record_losses():
    """Training losses as the steps compute them (not the FLOP count's batch of 2, nor evaluations), into a list;
    undo with the returned function."""
    losses, real = [], F.cross_entropy

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled() and len(args[0]) >= 8:
            losses.append(out.item())
        return out
    F.cross_entropy = recording
    return losses, lambda: setattr(F, "cross_entropy", real)


def cifar10(recipe, **changes):
    """(per-step losses, final accuracy, final test loss) of a tiny CIFAR-10 run of the recipe."""
    losses, undo = record_losses()
    try:
        result = cf.train(recipe, data=synthetic_arrays(n_train=256, n_test=64), device="cpu", seed=3, epochs=3,
                          width=1 / 16, batch_size=64, **changes)
    finally:
        undo()
    return losses, result.runs[0]["final_acc"], result.rows[-1]["test_loss"]


def imagenet(name, folder, **changes):
    store = Path(folder) / "store"
    if not (store / "index.json").is_file():
        ims.synthetic_imagefolder(Path(folder) / "src", 4, 24, 8, sizes=(24, 24), lossless=True)
        ims.prepare(Path(folder) / "src", store, ims.Settings(format="raw", size=24), workers=1, log=lambda s: None)
    data = idt.place(ims.open_store(store), torch.device("cpu"), workers=1)
    r = inf.recipe("tiny", width=8, epochs=3, batch_size=16, min_res=24, max_res=24, val_res=24,
                   **{**IMAGENET[name], **changes})
    losses, undo = record_losses()
    try:
        result = inf.train_run(r, data, inf.Options(), ctx=D.Context(), seed=1)
    finally:
        undo()
    return losses, result["final_top1"], result["rows"][-1]["val_loss"]


def values(losses, accuracy, loss):
    return {"steps": losses, "final_acc": accuracy, "test_loss": loss}


def deviations(got, ref):
    """Each step's loss and the final test loss, relative to the reference's."""
    return [abs(a - b) / abs(b) for a, b in zip(got["steps"] + [got["test_loss"]], ref["steps"] + [ref["test_loss"]])]


def same(got, ref, exact):
    """Bit for bit (exact), or each value within its tolerance (the final accuracy of 64 images moves in steps of
    1/64 and is held only bit for bit)."""
    if exact:
        assert got == {k: ref[k] for k in got}
        return
    assert len(got["steps"]) == len(ref["steps"])
    tolerance = [max(FLOOR, MARGIN * e) for e in ref["rounding"]]
    bad = [(k, d, t) for k, (d, t) in enumerate(zip(deviations(got, ref), tolerance)) if d > t]
    assert not bad, f"values outside their tolerance (index, deviation, tolerance): {bad}"


@pytest.fixture(scope="module")
def reference():
    return json.loads(PATH.read_text())


@pytest.mark.parametrize("recipe", CIFAR)
def test_cifar10_trains_as_it_did(reference, recipe, one_thread):
    same(values(*cifar10(recipe)), reference["runs"][recipe], machine() == reference["machine"])


@pytest.mark.parametrize("name", IMAGENET)
def test_imagenet_trains_as_it_did(reference, name, tmp_path_factory, one_thread):
    same(values(*imagenet(name, tmp_path_factory.mktemp(name))), reference["runs"][name],
         machine() == reference["machine"])


def test_rounding_stays_inside_the_tolerance_and_a_real_change_does_not(reference, one_thread):
    """The record's recipe, the most sensitive: two threads round otherwise than one (and than the kernels the
    tolerance was measured with), and stay inside it; Nesterov momentum switched off, or label smoothing 0.01
    higher, are real changes and leave it."""
    ref = reference["runs"]["fast94_next"]
    torch.set_num_threads(2)
    rounded = values(*cifar10("fast94_next"))
    torch.set_num_threads(1)
    assert rounded["steps"] != ref["steps"]
    same(rounded, ref, exact=False)
    for change in (dict(nesterov=False), dict(label_smoothing=cf.recipe("fast94_next").label_smoothing + 0.01)):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            same(values(*cifar10("fast94_next", **change)), ref, exact=False)


def envelope(deviation):
    """The largest deviation by each step (it only grows)."""
    out, top = [], 0.0
    for d in deviation:
        top = max(top, d)
        out.append(top)
    return out


def main():
    import tempfile
    torch.set_num_threads(1)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CIFAR + list(IMAGENET):
            run = (lambda: cifar10(name)) if name in CIFAR else (lambda: imagenet(name, Path(tmp) / name))
            runs[name] = values(*run())
            with torch.backends.mkldnn.flags(enabled=False):       # other kernels: how far rounding carries a run
                runs[name]["rounding"] = envelope(deviations(values(*run()), runs[name]))
    PATH.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {PATH}:", ", ".join(f"{k} ({len(v['steps'])} steps)" for k, v in runs.items()))


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_loop_kept.py --record")
    main()
