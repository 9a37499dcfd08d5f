"""Data-parallel training on torch.distributed: process groups, sharding, DDP wrapping, checkpoints that every
rank can resume from, gradient communication hooks (fp16, bf16, 2D torus) and batch-norm statistics averaged
over ranks. The large-batch optimisers are in optim.py; the scaling model over many GPUs in scaling.py.

    torchrun --nproc_per_node=8 cifar10_fast.py ...            # the scripts call init_from_env(), wrap_ddp(), ...

Everything collective goes through PyTorch's own engine (NCCL on GPUs, gloo on CPUs): DistributedDataParallel,
its communication hooks and torch.distributed collectives. Nothing here opens a socket of its own.

Papers:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (Preferred Networks, arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, 2D-torus all-reduce, arXiv:1811.05233)
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from core import write_atomic
from scaling import square_grid


# ----------------------------------------------------------------------------------------------------------
# Process group

@dataclass
class Context:
    """Where this process stands: its rank among world_size processes, its GPU (local_rank) and device."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    is_main: bool = True
    distributed: bool = False  # a process group exists (torchrun, even with one process)


def init_from_env(device=None, backend=None):
    """The Context of this process from torchrun's RANK / WORLD_SIZE / LOCAL_RANK, joining the process group.

    Without those variables (plain `python script.py`) it is one process and no process group, so the same
    script runs unchanged. nccl for CUDA devices, gloo otherwise; MASTER_ADDR / MASTER_PORT come from torchrun.
    """
    if "RANK" not in os.environ:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return Context(device=device)
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # before the group, so NCCL binds this rank to its own GPU
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.startswith("cuda") else "gloo"), rank=rank, world_size=world)
    return Context(rank, world, local, device, rank == 0, True)


def is_main():
    """True on rank 0, or when there is no process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs):
    """print on rank 0 only, so N processes do not print N copies of every line."""
    if is_main():
        print(*args, **kwargs, flush=True)


def barrier():
    """Wait for every rank; nothing to wait for without a process group."""
    if dist.is_initialized():
        dist.barrier()


def shard(n, rank, world):
    """The index range of rank's contiguous shard of n items (a device-resident dataset, or one global batch).

    The n % world leftover items are dropped, so that every rank runs the same number of steps: a rank with
    one more batch would wait forever in DDP's allreduce.
    """
    per = n // world
    return range(rank * per, (rank + 1) * per)


def per_rank_batch(global_batch, world):
    """The batch size of each rank; one global batch size defines the run whatever the number of processes."""
    if global_batch % world:
        raise ValueError(f"global batch size {global_batch} is not divisible by the world size {world}")
    return global_batch // world


def wrap_ddp(model, ctx, bucket_mb=25.0, **kwargs):
    """DistributedDataParallel with a configurable bucket size and gradient_as_bucket_view.

    Gradients are all-reduced in buckets of bucket_mb MB while backward is still running (Goyal et al. sec. 4:
    overlap communication with the backward pass); gradient_as_bucket_view makes .grad a view into the bucket,
    saving one gradient-sized copy. Without a process group the model is returned as it is.
    """
    if not ctx.distributed:
        return model
    device_ids = [ctx.local_rank] if ctx.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb,
                                   gradient_as_bucket_view=True, **kwargs)


def save_checkpoint(path, state, ctx):
    """Rank 0 writes state to path atomically; then every rank waits, so nobody reads a half-written file.

    A crash mid-write leaves the previous checkpoint intact for the elastic restart to resume from.
    """
    if ctx.is_main:
        write_atomic(path, lambda tmp: torch.save(state, tmp))
    if ctx.distributed:
        barrier()


def load_checkpoint(path, map_location="cpu"):
    """The state saved by save_checkpoint, read by every rank; None if there is no checkpoint yet (a fresh run)."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location=map_location, weights_only=True)


# ----------------------------------------------------------------------------------------------------------
# Batch-norm statistics averaged over ranks

def _batch_norms(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _count_batch(module, inputs):
    # elements per channel in this batch: needed to turn the unbiased batch variance back into E[x^2]
    x = inputs[0]
    if module.training:
        module.last_count = x.numel() // x.shape[1]


def use_last_batch_stats(model):
    """Batch norm without moving averages (Akiba et al. 2017 sec. 3.3): each BN's running statistics become
    the last training minibatch's (momentum 1), to be averaged over ranks by sync_batch_norm_stats."""
    for bn in _batch_norms(model):
        bn.momentum = 1.0
        bn.register_forward_pre_hook(_count_batch)
    return model


def sync_batch_norm_stats(model, ctx):
    """Before validation: every BN's running mean and variance become those of the whole global minibatch.

    Each rank's running stats hold its own last minibatch (use_last_batch_stats). All ranks have the same
    count n per channel, so the all_reduce mean of the per-rank mean and of E[x^2] = var * (n - 1) / n + mean^2
    are the global batch's; the global variance is E[x^2] - mean^2, stored unbiased (times N / (N - 1),
    N = n * world) as PyTorch does. One all_reduce carries every layer's statistics.
    Exact for each layer's input as the ranks computed it; below the first BN those inputs were normalised
    with each rank's own batch statistics during training (plain BN, not SyncBatchNorm), as the model trained.
    """
    bns = _batch_norms(model)
    if not ctx.distributed or not bns:
        return
    if any(not hasattr(bn, "last_count") for bn in bns):
        raise RuntimeError("sync_batch_norm_stats needs use_last_batch_stats(model) before the training steps")
    # n (images × pixels per channel) differs between layers at different resolutions
    sq = [bn.running_var * (bn.last_count - 1) / bn.last_count + bn.running_mean ** 2 for bn in bns]
    flat = torch.cat([torch.cat([bn.running_mean for bn in bns]), torch.cat(sq)])
    dist.all_reduce(flat)
    flat /= ctx.world_size
    means, sqs = flat.split(flat.numel() // 2)
    sizes = [bn.num_features for bn in bns]
    for bn, mean, square in zip(bns, means.split(sizes), sqs.split(sizes)):
        N = bn.last_count * ctx.world_size
        bn.running_mean.copy_(mean)
        bn.running_var.copy_((square - mean ** 2) * N / (N - 1))


# ----------------------------------------------------------------------------------------------------------
# Communication hooks

class TorusState:
    """The process subgroups of a rows x cols grid of ranks (rank r sits at row r // cols, column r % cols)."""

    def __init__(self, grid, device_type):
        rows, cols = grid
        world = dist.get_world_size()
        if rows * cols != world:
            raise ValueError(f"torus grid {rows}x{cols} does not match the world size {world}")
        self.rows, self.cols, self.world = rows, cols, world
        mesh = init_device_mesh(device_type, (rows, cols))       # mesh dimension 0 runs down a column, 1 along a row
        self.col, self.row = mesh.get_group(0), mesh.get_group(1)


def torus_allreduce_hook(state, bucket):
    """2D-torus all-reduce (Mikami et al. 2018), as a DDP communication hook returning the averaged bucket.

    1. reduce-scatter within the row: each of the cols ranks of a row gets the row's sum of 1/cols of the bucket
    2. all-reduce along the column: that chunk summed over all rows (messages are 1/cols the size)
    3. all-gather within the row: every rank gets the whole summed bucket
    Same bytes per rank as a ring, but 2 (rows + cols - 2) sequential steps instead of 2 (world - 1): the
    latency term that dominates at thousands of GPUs. The bucket is padded to a multiple of cols.
    """
    buf = bucket.buffer()
    n = buf.numel()
    chunk = -(-n // state.cols)
    flat = torch.zeros(chunk * state.cols, dtype=buf.dtype, device=buf.device)
    flat[:n] = buf / state.world
    part = torch.empty(chunk, dtype=buf.dtype, device=buf.device)
    dist.reduce_scatter_tensor(part, flat, group=state.row)
    dist.all_reduce(part, group=state.col)
    dist.all_gather_into_tensor(flat, part, group=state.row)
    buf.copy_(flat[:n])
    # the collectives above are synchronous (simple to read); on NCCL they only order the CUDA stream
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


HOOKS = ("none", "fp16", "bf16", "torus")


def register_comm_hook(ddp_model, name, grid=None):
    """Install a gradient communication hook on a DDP model: none (plain allreduce in fp32), fp16 / bf16
    (torch's built-in compression: half the bytes on the wire, as in the ImageNet-in-minutes runs), or torus
    (2D-torus all-reduce over a rows x cols grid, default the most square grid of the world size)."""
    if name not in HOOKS:
        raise ValueError(f"unknown communication hook {name!r}; choose from {', '.join(HOOKS)}")
    if name == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "torus":
        state = TorusState(grid or square_grid(dist.get_world_size()), ddp_model.device_type)
        ddp_model.register_comm_hook(state, torus_allreduce_hook)
    return ddp_model
