"""What a timed CIFAR-10 run does besides training: it stops on a loss that is not finite, in one line naming the
epoch, keeping the runs before."""
import json

import numpy as np
import pytest

import cifar10_fast as cf
import training as T
from conftest import synthetic_arrays
from core import DataError

TINY = ["--width", "0.0625", "--batch-size", "32", "--epochs", "3"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    p = tmp_path_factory.mktemp("synth") / "synth.npz"
    np.savez(p, **synthetic_arrays(n_train=128, n_test=64))
    return p


def test_a_loss_that_is_not_finite_is_a_data_error_naming_the_epoch_and_the_likely_setting():
    T.check_finite_loss(2.3, epoch=1, hint="unused")
    for loss in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(DataError, match=rf"^epoch 4: the training loss is {loss}; lower --lr$"):
            T.check_finite_loss(loss, epoch=4, hint="lower --lr")


def test_a_diverging_run_exits_1_in_one_line_and_the_runs_before_it_are_kept(npz, tmp_path, monkeypatch, capsys,
                                                                             one_thread):
    real = cf.train_run

    def second_diverges(r, built, o, *, seed, **kwargs):
        return real(cf.changed(r, lr_values=(0, 1e30, 0)) if seed == 1 else r, built, o, seed=seed, **kwargs)
    monkeypatch.setattr(cf, "train_run", second_diverges)
    out = tmp_path / "r.json"
    assert cf.main(["--recipe", "fast94", "--data-dir", str(npz), *TINY, "--runs", "2", "--out", str(out)]) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error in (f"error: epoch 1: the training loss is {loss}; the learning rate is the likely cause "
                     "(--lr-values peaks at 1e+30)" for loss in ("nan", "inf"))
    saved = json.loads(out.read_text())
    assert [run["seed"] for run in saved["runs"]] == [0] and saved["complete"] is False
