"""distributed.py on CPU: gloo process groups spawned on 127.0.0.1, compared with one process on the whole batch."""
import contextlib
import dataclasses
import errno
import io
import os
import re
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import distributed as D
import schedules
import imagenet_models
import conftest
from conftest import ROOT, free_port

GLOBAL_BATCH, STEPS = 16, 5
OPTIMIZERS = ("sgd", "lars", "rmsprop_to_sgd")


def join(rank, world, port):
    """Set torchrun's variables for this rank on loopback, and let init_from_env start gloo from them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    return D.init_from_env(device="cpu", timeout_minutes=1)        # ranks that disagree fail, not hang


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
        return imagenet_models.LARS(params, lr=1.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02)
    # beta_center 2, period 2, one step an epoch: the 5 steps go through all three pieces of alpha_sgd
    return imagenet_models.RMSpropToSGD(params, lr=0.1, lr_rmsprop=0.01, weight_decay=5e-4, beta_center=2,
                                        beta_period=2)


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


def attempt(fn, *args, **kwargs):
    """fn(*args, **kwargs), or the line its exception says: one failing check leaves the others in the worker
    running."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def worker_two(rank, port, out):
    ctx = join(rank, 2, port)
    res = {name: train(name, ctx) for name in OPTIMIZERS}
    res["bn"] = bn_stats(ctx)
    res.update({f"grad_{h}": hook_grads(ctx, h) for h in ("none", "fp16", "bf16")})
    res.update(checkpoints(ctx, out))
    res["ctx"] = (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    D.leave(ctx)


def checkpoints(ctx, out):
    """What load_checkpoint gives each rank, and what save_checkpoint raises, for checkpoints in each rank's own folder,
    as on nodes without a shared disk (here each rank is a node of its own, so each writes with each_node)."""
    node, res = os.path.join(out, f"node{ctx.rank}"), {}
    os.makedirs(node)
    path = lambda name: os.path.join(node, name)
    epoch_of = lambda state: state["step"]
    D.save_state(path("ckpt.pt"), {"step": 7, "w": torch.arange(3.0)}, ctx, each_node=False)
    res["ckpt"] = attempt(D.load_newest_state, path("ckpt.pt"), ctx)                    # rank 0's folder alone
    res["ckpt_here"] = os.path.exists(path("ckpt.pt"))
    res["missing"] = attempt(D.load_newest_state, path("missing.pt"), ctx)              # none anywhere
    if ctx.is_main:
        open(path("bad.pt"), "wb").write(b"not a checkpoint")
    res["bad"] = attempt(D.load_newest_state, path("bad.pt"), ctx)
    own_node = dataclasses.replace(ctx, local_rank=0)
    D.save_state(path("each.pt"), {"step": 3 + 4 * ctx.rank}, own_node)                 # each node its copy
    res["each"] = os.path.exists(path("each.pt")) and torch.load(path("each.pt"))["step"]
    for name, older in (("newer_on_1.pt", 0), ("newer_on_0.pt", 1)):        # two copies, of epochs 5 and 6
        D.save_state(path(name), {"step": 5 if ctx.rank == older else 6}, own_node)
        res[name] = attempt(D.load_newest_state, path(name), ctx, epoch_of=epoch_of)
    if ctx.rank == 1:
        D.save_state(path("on_1.pt"), {"step": 2}, D.Context())       # rank 1's folder alone
    res["on_1.pt"] = attempt(D.load_newest_state, path("on_1.pt"), ctx, epoch_of=epoch_of)
    for name, damaged in (("damaged_on_0.pt", [0]), ("damaged_on_both.pt", [0, 1])):    # each node its copy
        D.save_state(path(name), {"step": 4, "w": torch.linspace(-1, 1, 1000)}, own_node)
        if ctx.rank in damaged:
            damage_tensors(path(name), records=1)
        with contextlib.redirect_stderr(io.StringIO()) as said:
            got = attempt(D.load_newest_state, path(name), ctx, epoch_of=epoch_of)
        res[name] = (got, said.getvalue())
    real_save = torch.save
    if ctx.is_main:
        torch.save = disk_full
    try:                                    # rank 0's write fails; rank 1 writes nothing
        res["full"] = attempt(D.save_state, path("full.pt"), {"step": 1}, ctx, each_node=False)
    finally:
        torch.save = real_save
    res["left"], res["node"] = sorted(os.listdir(node)), node
    return res


REAL_SAVE = torch.save


def disk_full(state, f, *args, **kwargs):
    """torch.save on a full disk: some bytes written, then the OSError of Python's file as the context of torch's
    own RuntimeError; into memory (pickling a tensor for a collective) as ever."""
    if isinstance(f, io.BytesIO):
        return REAL_SAVE(state, f, *args, **kwargs)
    f.write(b"half a checkpoint")
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def damage_tensors(path, records=2):
    """Flips an exponent bit of every 7th float32 in the `records` largest tensors of torch's zip file at path, in
    place, as a failing disk or a bad copy would: the file still loads (torch checks nothing of the tensors' bytes).
    Returns the names of the records changed."""
    with zipfile.ZipFile(path) as z:
        largest = sorted((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: -i.file_size)[:records]
    data = bytearray(open(path, "rb").read())
    for info in largest:
        at = info.header_offset             # its local header: 30 bytes, then its name and its extra field
        name, extra = (int.from_bytes(data[at + k:at + k + 2], "little") for k in (26, 28))
        start = at + 30 + name + extra      # the tensor's bytes, stored as they are (torch does not deflate them)
        for k in range(start + 3, start + info.file_size, 28):
            data[k] ^= 0x40
    open(path, "wb").write(bytes(data))
    return [i.filename for i in largest]


class Bucket:
    """What a DDP communication hook reads from its bucket: the flat gradient buffer."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


def hook_returns_at_once(ctx, out):
    """Whether the torus hook had finished when it returned on rank 0, and the average it gives. Rank 1 calls its hook
    only once rank 0's has returned (a file says so), so a hook that waited for its collectives would never return
    on rank 0: rank 1 then gives up after a minute and the spawn fails."""
    state = D.TorusState((2, 3), "cpu")
    dist.barrier()
    returned = os.path.join(out, "rank0-returned")
    if ctx.rank == 1:
        for _ in range(600):
            if os.path.exists(returned):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("rank 0's torus hook never returned: it waits for the other ranks")
    fut = D.torus_allreduce_hook(state, Bucket(torch.full((10,), float(ctx.rank))))
    done_on_return = fut.done()
    if ctx.rank == 0:
        open(returned, "w").close()
    return done_on_return, fut.wait().clone()


def worker_torus(rank, port, out):
    ctx = join(rank, 6, port)
    res = {"plain": hook_grads(ctx, "none")}
    for grid in ((2, 3), (3, 2)):
        res[grid] = attempt(hook_grads, ctx, "torus", grid)
    res["bf16"] = attempt(hook_grads, ctx, "torus_bf16", (2, 3))
    res["async"] = hook_returns_at_once(ctx, out)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    D.leave(ctx)


def spawn(fn, world, out):
    mp.spawn(fn, args=(free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_the_tests_rendezvous_ports_are_free_unshared_and_outside_the_ephemeral_range():
    import socket
    mine, other = conftest.port_block("gw0"), conftest.port_block("gw1")
    assert not set(mine) & set(other) and max(other) < 32768
    handed = conftest.free_ports(3, worker="gw1")
    with socket.socket() as held:                      # a port someone listens on is passed over
        held.bind(("127.0.0.1", handed[-1] + 1))
        held.listen()
        after = conftest.free_ports(2, worker="gw1")
    assert not set(handed) & set(after) and handed[-1] + 1 not in after
    assert all(p in other for p in handed + after)


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


def test_checkpoint_on_rank0s_disk_alone_reaches_every_rank(two_ranks):
    for r, res in reversed(list(enumerate(two_ranks))):
        assert isinstance(res["ckpt"], tuple), f"rank {r} got {res['ckpt']!r}, not rank 0's checkpoint"
        state, holder = res["ckpt"]
        assert holder == 0 and state["step"] == 7 and torch.equal(state["w"], torch.arange(3.0))
        assert res["missing"] == (None, None)              # every rank agrees: a fresh run
        assert res["ctx"] == (r, 2, r == 0, True)
        # an unreadable checkpoint is the same one-line error on every rank: the file rank 0 read
        assert re.fullmatch(r"DataError: \S+/node0/bad\.pt on rank 0: not a readable checkpoint \(.+\)",
                            res["bad"]), res["bad"]
        assert res["bad"] == two_ranks[0]["bad"]


def test_each_node_writes_its_own_copy_and_every_rank_resumes_from_the_newest_copy_anywhere(two_ranks):
    for r, res in enumerate(two_ranks):
        assert res["each"] == 3 + 4 * r                    # each node's first rank wrote its node's copy
        assert res["ckpt_here"] == (r == 0)                # without each_node, rank 0 alone wrote
        # the newest copy wins wherever it lies, never an older one on a lower rank
        assert res["newer_on_1.pt"] == ({"step": 6}, 1) and res["newer_on_0.pt"] == ({"step": 6}, 0)
        assert res["on_1.pt"] == ({"step": 2}, 1)          # rank 0 has none: rank 1's, not a fresh start


def test_a_damaged_copy_is_passed_over_for_another_nodes_good_one_and_refused_where_none_is_good(two_ranks):
    """Each node's copy of the same state, rank 0's damaged in its tensors' bytes: every rank reads rank 1's good
    copy, rank 0 printing one warning that names the damaged one; both damaged: the same one line on every rank."""
    for r, res in enumerate(two_ranks):
        (state, holder), said = res["damaged_on_0.pt"]
        assert holder == 1 and state["step"] == 4 and torch.equal(state["w"], torch.linspace(-1, 1, 1000))
        assert said == ("" if r else f"warning: {two_ranks[0]['node']}/damaged_on_0.pt on rank 0: damaged since it "
                        "was written (its contents' sha256 is not the one written with it); rank 1's copy is read "
                        "instead\n")
        got, said = res["damaged_on_both.pt"]
        assert got == (f"DataError: {two_ranks[0]['node']}/damaged_on_both.pt on rank 0: damaged since it was written "
                       "(its contents' sha256 is not the one written with it)") and said == ""


def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_with_its_line(two_ranks):
    """A full disk under rank 0: every rank (rank 1 wrote nothing and would otherwise wait at the next collective)
    raises the same line naming the path and the error; the write's temporary file is gone."""
    for r, res in enumerate(two_ranks):
        assert re.fullmatch(r"DataError: cannot write the checkpoint \S+/node0/full\.pt on rank 0: No space left on "
                            r"device \(ENOSPC\)", res["full"]), res["full"]
        assert res["full"] == two_ranks[0]["full"]
    assert two_ranks[0]["left"] == ["bad.pt", "ckpt.pt", "damaged_on_0.pt", "damaged_on_both.pt", "each.pt",
                                    "newer_on_0.pt", "newer_on_1.pt"]


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory):
    return spawn(worker_torus, 6, tmp_path_factory.mktemp("six"))


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)])
def test_torus_hook_equals_plain_allreduce_on_six_ranks(six_ranks, grid):
    for res in six_ranks:
        assert not isinstance(res[grid], str), res[grid]
        for a, b in zip(res[grid], res["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for res in six_ranks[1:]:  # every rank ends with the same average
        for a, b in zip(res[grid], six_ranks[0][grid]):
            torch.testing.assert_close(a, b)


def test_torus_hook_in_bf16_is_close_to_fp32(six_ranks):
    for res in six_ranks:
        assert not isinstance(res["bf16"], str), res["bf16"]
        for a, b in zip(res["bf16"], res["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())


def test_torus_hook_returns_before_its_collectives_finish(six_ranks):
    done_on_return, average = six_ranks[0]["async"]
    assert not done_on_return                   # rank 1 had not started: rank 0's hook returned a pending future
    torch.testing.assert_close(average, torch.full((10,), 2.5))     # mean of ranks 0..5


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
    assert schedules.per_rank_batch(512, 8) == 64
    with pytest.raises(ValueError, match="^global batch size 512 is not divisible by the world size 3$"):
        schedules.per_rank_batch(512, 3)


def test_checkpoint_is_replaced_atomically(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    D.save_state(str(path), {"a": 1}, D.Context())
    D.save_state(str(path), {"a": 2}, D.Context())
    assert D.load_newest_state(str(path)) == ({"a": 2}, 0)
    assert os.listdir(path.parent) == ["last.pt"]  # no temporary left behind
    assert D.load_newest_state(str(tmp_path / "missing.pt")) == (None, None)


def test_checkpoint_disk_full_mid_write_keeps_the_previous_one_and_says_why(tmp_path, monkeypatch):
    path = str(tmp_path / "last.pt")
    D.save_state(path, {"a": 1}, D.Context())
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(D.DataError) as e:
        D.save_state(path, {"a": 2}, D.Context())
    assert str(e.value) == f"cannot write the checkpoint {path}: No space left on device (ENOSPC)"
    monkeypatch.undo()
    assert D.load_newest_state(path) == ({"a": 1}, 0) and os.listdir(tmp_path) == ["last.pt"]


def killed_write(path):
    """write_atomic of path killed by SIGKILL midway, in a process of its own: what a killed run leaves."""
    code = ("import os, signal, sys, outputs; outputs.write_atomic(sys.argv[1], lambda tmp: (open(tmp, 'wb').write("
            "b'x' * 1000), os.kill(os.getpid(), signal.SIGKILL)))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_unfinished_writes_of_a_checkpoint_are_found_and_removed(tmp_path):
    ckpt, other = tmp_path / "ckpt.pt", tmp_path / "ckpt.pt.seed1"
    D.save_state(ckpt, {"a": 1}, D.Context())
    for p in (ckpt, ckpt, other):
        killed_write(p)
    left = sorted(set(os.listdir(tmp_path)) - {"ckpt.pt"})
    assert len(left) == 3                       # two of ckpt.pt's, one of ckpt.pt.seed1's
    removed = D.remove_unfinished_writes(ckpt)
    assert len(removed) == 2 and set(removed) < set(left)
    assert sorted(os.listdir(tmp_path)) == sorted({"ckpt.pt"} | set(left) - set(removed))
    assert D.remove_unfinished_writes(other) == sorted(set(left) - set(removed))
    assert os.listdir(tmp_path) == ["ckpt.pt"] and D.load_newest_state(ckpt) == ({"a": 1}, 0)
    assert D.remove_unfinished_writes(tmp_path / "absent" / "x.pt") == []


def test_print0_prints_once_without_a_group(capsys):
    D.print0("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_unknown_hook_is_an_exact_error():
    with pytest.raises(ValueError, match=r"^unknown communication hook 'fp8'; choose from none, fp16, bf16, torus, "
                                         r"torus_fp16, torus_bf16$"):
        D.register_comm_hook(None, "fp8")


def test_torus_grid_defaults_to_one_row_per_node():
    assert D.torus_grid(None, 16, 8) == (2, 8)          # 2 nodes of 8 GPUs: a row is a node
    assert D.torus_grid(None, 6, 3) == (2, 3) and D.torus_grid(None, 4, 4) == (1, 4)
    assert D.torus_grid((3, 2), 6, 3) == (3, 2)
    with pytest.raises(ValueError, match=r"^--torus-grid 2x3 is 6 ranks, but the world size is 4$"):
        D.torus_grid((2, 3), 4, 4)


# ---------------------------------------------------------------------------------------- launching

@pytest.mark.parametrize("script", ["imagenet_fast", "cifar10_fast"])
def test_srun_without_torchrun_stops_with_the_command_to_use(script, monkeypatch, capsys, tmp_path):
    """srun starting N copies of the script itself would be N independent full runs writing the same files."""
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.delenv("RANK", raising=False)
    args = ["--device", "cpu", "--epochs", "1"]
    args = (["train", "--store", str(tmp_path), *args] if script == "imagenet_fast"
            else ["--data-dir", str(tmp_path), *args])
    rc = __import__(script).main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: srun started 16 tasks without torchrun")
    assert "srun --ntasks-per-node=1 torchrun" in err[0]


def test_device_cuda_under_torchrun_is_the_local_rank_and_the_timeout_reaches_the_group(monkeypatch):
    calls = {}
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.update(device=d))
    ctx = D.init_from_env("cuda")
    assert ctx.device == "cuda:1" and str(calls["device"]) == "cuda:1" and calls["backend"] == "nccl"
    assert D.init_from_env("cuda:0").device == "cuda:0"            # a device named in full is kept
    assert D.init_from_env("cpu", timeout_minutes=45).device == "cpu" and calls["backend"] == "gloo"
    assert calls["timeout"].total_seconds() == 45 * 60


@pytest.mark.parametrize("flags,message", [(["--dist-timeout", "0"], "--dist-timeout must be positive (minutes)"),
                                           (["--torus-grid", "2x3", "--comm-hook", "torus"],
                                            "--torus-grid 2x3 is 6 ranks, but the world size is 1"),
                                           (["--torus-grid", "1x1"], "--torus-grid needs --comm-hook torus, "
                                                                     "torus_fp16 or torus_bf16")])
@pytest.mark.parametrize("script", ["imagenet_fast", "cifar10_fast"])
def test_launch_flags_are_checked_in_one_line(script, flags, message, capsys, tmp_path):
    args = ["--device", "cpu", *flags]
    args = (["train", "--store", str(tmp_path), *args] if script == "imagenet_fast"
            else ["--data-dir", str(tmp_path), *args])
    rc = __import__(script).main(args)
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_a_shared_checkpoint_needs_a_checkpoint_in_one_line(capsys, tmp_path):
    rc = __import__("imagenet_fast").main(["train", "--store", str(tmp_path), "--device", "cpu", "--checkpoint-on",
                                           "shared"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == ["error: --checkpoint-on shared needs "
                                                                        "--checkpoint"]


class Launched:
    """What an async collective returns: a work whose future is already complete (or failed)."""

    def __init__(self, error=None):
        self.future = torch.futures.Future()
        self.future.set_exception(error) if error else self.future.set_result(None)

    def get_future(self):
        return self.future


def test_the_torus_chain_runs_its_steps_in_order_and_an_error_anywhere_fails_the_bucket_instead_of_hanging():
    done_before = torch.futures.Future()
    order, done = [], torch.futures.Future()
    launch = lambda name, error=None: lambda: order.append(name) or Launched(error)
    D._chain(done_before, [launch("scatter"), launch("column"), launch("row")], lambda: done.set_result("ok"), done)
    assert order == [] and not done.done()             # nothing starts before the previous bucket's chain ends
    done_before.set_result(None)
    assert order == ["scatter", "column", "row"] and done.wait() == "ok"

    for broken in range(3):                            # a collective that fails: the steps after it never start
        order, done, after = [], torch.futures.Future(), torch.futures.Future()
        steps = [launch(n, RuntimeError(f"{n} failed") if i == broken else None)
                 for i, n in enumerate(("scatter", "column", "row"))]
        D._chain(after, steps, lambda: pytest.fail("finished after an error"), done)
        after.set_result(None)
        assert order == ["scatter", "column", "row"][:broken + 1]
        with pytest.raises(RuntimeError, match=f"{('scatter', 'column', 'row')[broken]} failed"):
            done.wait()
    failed_before, done = torch.futures.Future(), torch.futures.Future()
    D._chain(failed_before, [launch("scatter")], lambda: pytest.fail("finished"), done)
    failed_before.set_exception(RuntimeError("the previous bucket failed"))
    with pytest.raises(RuntimeError, match="the previous bucket failed"):
        done.wait()
    broken_launch = lambda: 1 / 0                        # a launch that raises before it returns a work
    done, ready = torch.futures.Future(), torch.futures.Future()
    ready.set_result(None)
    D._chain(ready, [broken_launch], lambda: pytest.fail("finished"), done)
    with pytest.raises(ZeroDivisionError):
        done.wait()
