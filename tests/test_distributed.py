"""distributed.py on CPU: gloo process groups spawned on 127.0.0.1, compared with one process on the whole batch."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import distributed as D
import optim

GLOBAL_BATCH, STEPS = 16, 5
OPTIMIZERS = ("sgd", "lars", "rmsprop_to_sgd")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, world, port):
    """Set torchrun's variables for this rank on loopback, and let init_from_env start gloo from them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return D.init_from_env(device="cpu")


def tiny_model():
    """No batch norm: its statistics would differ per rank. Biases exercise LARS's 1-D path."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
    if name == "lars":
        return optim.LARS(params, lr=1.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02)
    # beta_center 2, period 2, one step an epoch: the 5 steps go through all three pieces of alpha_sgd
    return optim.RMSpropToSGD(params, lr=0.1, lr_rmsprop=0.01, weight_decay=5e-4, beta_center=2, beta_period=2)


def train(name, ctx):
    """STEPS steps on this rank's shard of each global batch, under DDP when there is a process group."""
    model = tiny_model()
    ddp = D.wrap_ddp(model, ctx, bucket_mb=1e-4)  # tiny buckets: several allreduces per step
    opt = make_optimizer(name, ddp.parameters())
    rows = D.shard(GLOBAL_BATCH, ctx.rank, ctx.world_size)
    for step, (x, y) in enumerate(batches()):
        for g in opt.param_groups:
            g["epoch"] = step           # the training loop's clock (RMSprop-to-SGD's hand-over reads it)
        opt.zero_grad()
        F.cross_entropy(ddp(x[rows.start:rows.stop]), y[rows.start:rows.stop]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def bn_model():
    torch.manual_seed(0)
    # one BN layer: a deeper one sees activations normalised by each rank's own batch statistics in training,
    # so its input is not the single process's (see sync_batch_norm_stats)
    return D.use_last_batch_stats(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))


def bn_input():
    return 3 + 2 * torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(2))


def bn_stats(ctx):
    model = bn_model()
    rows = D.shard(8, ctx.rank, ctx.world_size)
    with torch.no_grad():
        model(bn_input()[rows.start:rows.stop])
    D.sync_batch_norm_stats(model, ctx)
    return [t.clone() for bn in D._batch_norms(model) for t in (bn.running_mean, bn.running_var)]


def hook_grads(ctx, hook, grid=None):
    """The averaged gradients DDP leaves after one backward, with a given communication hook."""
    model = tiny_model()
    ddp = D.register_comm_hook(D.wrap_ddp(model, ctx, bucket_mb=1e-4), hook, grid)
    x, y = batches()[0]
    rows = D.shard(GLOBAL_BATCH, ctx.rank, ctx.world_size)
    F.cross_entropy(ddp(x[rows.start:rows.stop]), y[rows.start:rows.stop]).backward()
    return [p.grad.clone() for p in model.parameters()]


def worker_two(rank, port, out):
    ctx = join(rank, 2, port)
    res = {name: train(name, ctx) for name in OPTIMIZERS}
    res["bn"] = bn_stats(ctx)
    res.update({f"grad_{h}": hook_grads(ctx, h) for h in ("none", "fp16", "bf16")})
    ckpt = os.path.join(out, "ckpt.pt")
    D.save_checkpoint(ckpt, {"step": 7, "w": torch.arange(3.0)}, ctx)
    res["ckpt"] = D.load_checkpoint(ckpt)  # every rank reads it right after the barrier
    res["ctx"] = (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def worker_torus(rank, port, out):
    ctx = join(rank, 4, port)
    plain, torus = hook_grads(ctx, "none"), hook_grads(ctx, "torus", grid=(2, 2))
    torch.save({"plain": plain, "torus": torus}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn(fn, world, out):
    mp.spawn(fn, args=(free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(worker_two, 2, tmp_path_factory.mktemp("two"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_ranks_equal_one_process_on_the_whole_batch(two_ranks, name):
    single = train(name, D.Context())
    for res in two_ranks:
        for a, b in zip(res[name], single):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and training moved the weights, so the comparison means something
    assert not torch.allclose(single[0], tiny_model()[0].weight)


def test_synced_batch_norm_stats_are_the_whole_batch_stats(two_ranks):
    whole = bn_model()
    with torch.no_grad():
        whole(bn_input())
    want = [t for bn in D._batch_norms(whole) for t in (bn.running_mean, bn.running_var)]
    for res in two_ranks:
        for a, b in zip(res["bn"], want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # without the sync each rank would hold its half's statistics, which differ
    half = bn_model()
    with torch.no_grad():
        half(bn_input()[:4])
    assert not torch.allclose(half[1].running_mean, want[0], atol=1e-3)


@pytest.mark.parametrize("hook,tol", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_compressed_gradients_are_close_to_fp32(two_ranks, hook, tol):
    for res in two_ranks:
        for a, b in zip(res[f"grad_{hook}"], res["grad_none"]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_fp32_ddp_gradient_is_the_whole_batch_gradient(two_ranks):
    model = tiny_model()
    x, y = batches()[0]
    F.cross_entropy(model(x), y).backward()
    for a, p in zip(two_ranks[0]["grad_none"], model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def test_checkpoint_written_by_rank0_read_by_all(two_ranks, tmp_path):
    for r, res in enumerate(two_ranks):
        assert res["ckpt"]["step"] == 7 and torch.equal(res["ckpt"]["w"], torch.arange(3.0))
        assert res["ctx"] == (r, 2, r == 0, True)


def test_torus_hook_equals_plain_allreduce_on_a_2x2_grid(tmp_path):
    results = spawn(worker_torus, 4, tmp_path)
    for res in results:
        for a, b in zip(res["torus"], res["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for res in results[1:]:  # every rank ends with the same average
        for a, b in zip(res["torus"], results[0]["torus"]):
            torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------- single process

def test_init_from_env_without_torchrun_is_one_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ctx = D.init_from_env(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_main, ctx.distributed) == (0, 1, 0, True, False)
    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 2)
    assert D.wrap_ddp(model, ctx) is model
    D.sync_batch_norm_stats(bn_model(), ctx)  # a no-op, not an error


def test_shard_and_per_rank_batch():
    assert [D.shard(10, r, 3) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 9)]
    assert D.shard(10, 0, 1) == range(10)
    assert D.per_rank_batch(512, 8) == 64
    with pytest.raises(ValueError, match="^global batch size 512 is not divisible by the world size 3$"):
        D.per_rank_batch(512, 3)


def test_checkpoint_is_replaced_atomically(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    D.save_checkpoint(str(path), {"a": 1}, D.Context())
    D.save_checkpoint(str(path), {"a": 2}, D.Context())
    assert D.load_checkpoint(str(path)) == {"a": 2}
    assert os.listdir(path.parent) == ["last.pt"]  # no temporary left behind
    assert D.load_checkpoint(str(tmp_path / "missing.pt")) is None


def test_checkpoint_crash_mid_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = str(tmp_path / "last.pt")
    D.save_checkpoint(path, {"a": 1}, D.Context())
    def crash(state, f):
        open(f, "wb").write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        D.save_checkpoint(path, {"a": 2}, D.Context())
    monkeypatch.undo()
    assert D.load_checkpoint(path) == {"a": 1} and os.listdir(tmp_path) == ["last.pt"]


def test_print0_prints_once_without_a_group(capsys):
    D.print0("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_unknown_hook_is_an_exact_error():
    with pytest.raises(ValueError, match=r"^unknown communication hook 'fp8'; choose from none, fp16, bf16, torus$"):
        D.register_comm_hook(None, "fp8")
