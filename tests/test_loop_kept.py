"""What training computes stays what it was when its loop last moved: the per-step training losses and the final
evaluation of fast94, fast94_next and myrtle10 (CIFAR-10) and of ImageNet's tiny recipe, at tiny sizes with fixed
seeds on one CPU thread, recorded in tests/data/loop_reference.json before the CIFAR-10 and ImageNet loops became
one (ImageNet's again when its store began to keep whole images and its crops became torchvision's). Identical to the bit on the CPU model that recorded them; elsewhere other kernels may round differently, so
there within 1e-5."""
import json

import pytest
import torch
import torch.nn.functional as F

import cifar10_fast as cf
import distributed as D
import imagenet_data as idt
import imagenet_fast as inf
import imagenet_store as ims
import loop
from conftest import ROOT, synthetic_arrays

REFERENCE = json.loads((ROOT / "tests" / "data" / "loop_reference.json").read_text())


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


@pytest.fixture
def steps(monkeypatch, one_thread):
    """The training losses, as the steps compute them (not the FLOP count's batch of 2, nor evaluations)."""
    losses, real = [], F.cross_entropy

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled() and len(args[0]) >= 8:
            losses.append(out.item())
        return out
    monkeypatch.setattr(F, "cross_entropy", recording)
    return losses


def same(got, expected):
    if cpu_model() == REFERENCE["cpu"]:
        assert got == expected
    else:
        assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("recipe", ["fast94", "fast94_next", "myrtle10"])
def test_cifar10_trains_as_it_did(steps, recipe):
    result = cf.train(recipe, data=synthetic_arrays(n_train=256, n_test=64), device="cpu", seed=3, epochs=3,
                      width=1 / 16, batch_size=64)
    ref = REFERENCE["runs"][recipe]
    same(steps, ref["steps"])
    same([result.runs[0]["final_acc"], result.rows[-1]["test_loss"]], [ref["final_acc"], ref["test_loss"]])


def test_imagenet_trains_as_it_did(steps, tmp_path):
    ims.synthetic_imagefolder(tmp_path / "src", 4, 24, 8, sizes=(20, 40))
    ims.prepare(tmp_path / "src", tmp_path / "store", workers=1, log=lambda s: None)
    data = idt.place(ims.open_store(tmp_path / "store"), torch.device("cpu"), threads=1)
    hp = inf.hyperparameters("tiny", width=8, epochs=3, batch_size=16, min_res=24, max_res=24, val_res=24,
                             ema_momentum=0.9, ema_every=5)
    cpu = torch.device("cpu")
    result = loop.train(inf.start(hp, data, classes=5, device=cpu, dtype=torch.float32, ctx=D.Context()), hp,
                        device=cpu, seed=1)
    ref = REFERENCE["runs"]["imagenet_tiny"]
    same(steps, ref["steps"])
    same([result["final_acc"], result["rows"][-1]["val_loss"]], [ref["final_acc"], ref["test_loss"]])
