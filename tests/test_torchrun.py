"""cifar10_fast.py under torchrun: 2 CPU processes (gloo, loopback only), rank 0 alone prints and writes."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, free_port, synthetic_npz


@pytest.fixture(scope="module")
def synth_npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 256, 64)


def torchrun(nproc, *args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "cifar10_fast.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


COMMON = ["--device", "cpu", "--epochs", "2", "--width", "0.125", "--batch-size", "64"]


def test_two_ranks_train_with_one_voice(synth_npz, tmp_path):
    out = tmp_path / "r.json"
    r = torchrun(2, "--data-dir", str(synth_npz), *COMMON, "--comm-hook", "bf16", "--bucket-mb", "1", "--out",
                 str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert sum(ln.split()[:2] == ["epoch", "lr"] for ln in lines) == 1          # one table, from rank 0
    assert sum(ln.startswith("final test accuracy") for ln in lines) == 1
    assert "2 ranks of 32 images per step" in r.stdout
    res = json.loads(out.read_text())
    assert res["environment"]["world_size"] == 2 and res["environment"]["comm_hook"] == "bf16"
    assert res["settings"]["batch_size"] == 64                                # the global batch is recorded
    rows = res["runs"][0]["rows"]
    assert len(rows) == 2 and rows[1]["train_loss"] < rows[0]["train_loss"]
    # 256 images, 2 shards of 128, 4 steps of 32 per rank: every rank saw 128 images an epoch
    assert res["summary"]["final_acc"]["mean"] > 0.2                         # the synthetic classes are learnable


def test_global_batch_must_divide_over_ranks(synth_npz):
    r = torchrun(2, "--data-dir", str(synth_npz), "--device", "cpu", "--batch-size", "63", "--epochs", "1")
    assert r.returncode != 0
    assert "error: global batch size 63 is not divisible by the world size 2" in r.stderr


def fitted_whitening(out, argv):
    """Runs cifar10_fast.main(argv), saving the whitening filters this process fitted to `out`."""
    import cifar10_fast as cf
    import torch
    import torch_backend as tb
    torch.set_num_threads(1)
    fit, fitted = tb.fit_whitening, []

    def recording(model, *args, **kwargs):
        fit(model, *args, **kwargs)
        fitted.append(next(m for m in model.modules() if isinstance(m, tb.Whitening)).weight.detach().clone())
    cf.fit_whitening = recording            # where cifar10_fast looks the name up
    try:
        assert cf.main(argv) == 0
    finally:
        cf.fit_whitening = fit
    torch.save(fitted[-1], out)


def whitening_rank(rank, world, port, folder, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    fitted_whitening(folder / f"rank{rank}.pt", argv)


def test_every_rank_fits_the_whitening_of_the_whole_training_set(synth_npz, tmp_path):
    """The whitening filters are frozen parameters, which DDP never synchronises: every rank must fit them on the
    images one process would use (here all 256), not on its own shard."""
    import torch
    import torch.multiprocessing as mp
    argv = ["--recipe", "fast94", "--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "1", "--width", "0.0625",
            "--batch-size", "64"]
    mp.spawn(whitening_rank, args=(2, free_port(), tmp_path, argv), nprocs=2)
    fitted_whitening(tmp_path / "single.pt", argv)
    single, rank0, rank1 = (torch.load(tmp_path / f"{n}.pt") for n in ("single", "rank0", "rank1"))
    assert torch.equal(rank0, rank1)
    torch.testing.assert_close(rank0, single)


def test_one_process_under_torchrun_trains_past_the_whitening_bias(synth_npz):
    """One process under torchrun still trains inside DistributedDataParallel, which expects a gradient for every
    parameter it holds: the whitening bias must stay attached after its epochs, as with several ranks."""
    r = torchrun(1, "--recipe", "fast94", "--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "5", "--width",
                 "0.0625", "--batch-size", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "final test accuracy" in r.stdout
