"""Data-parallel training on torch.distributed, with the large-batch and communication techniques of the
ImageNet-in-minutes papers, and an alpha-beta model of how a training step scales with the GPU count.

    torchrun --nproc_per_node=8 cifar10_fast.py ...            # the scripts call init_from_env(), wrap_ddp(), ...
    python distributed.py simulate --gpus 8,64,512,2048 --step-time 0.1 --model-mb 51.2 --link-gbps 50
    python distributed.py simulate --published                 # our model against the published figures

Everything collective goes through PyTorch's own engine (NCCL on GPUs, gloo on CPUs): DistributedDataParallel,
its communication hooks and torch.distributed collectives. Nothing here opens a socket of its own.

Papers:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks" (LARS, arXiv:1708.03888)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (Preferred Networks, arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, 2D-torus all-reduce and
      batch-size control, arXiv:1811.05233)
  Yamazaki et al. 2019, "Yet Another Accelerated SGD: ResNet-50 Training on ImageNet in 74.7 seconds"
      (Fujitsu, arXiv:1903.12650)
"""
import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


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

    The file is written under a temporary name in the same folder and renamed with os.replace (atomic on
    POSIX): a crash mid-write leaves the previous checkpoint intact for the elastic restart to resume from.
    """
    if ctx.is_main:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    if ctx.distributed:
        barrier()


def load_checkpoint(path, map_location="cpu"):
    """The state saved by save_checkpoint, read by every rank; None if there is no checkpoint yet (a fresh run)."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location=map_location, weights_only=True)


# ----------------------------------------------------------------------------------------------------------
# Large-batch techniques

def linear_scaled_lr(base_lr, global_batch, base_batch=256):
    """Goyal et al. 2017, linear scaling rule: multiply the learning rate by k when the batch grows k times."""
    return base_lr * global_batch / base_batch


def _closure_loss(closure):
    """The loss of an optimizer's closure (torch.optim's step(closure) protocol), with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling, You et al. 2017 (Algorithm 1), with momentum and weight decay.

    For every weight tensor w with gradient g (lr = the global rate gamma, eta = trust_coefficient,
    beta = weight_decay, m = momentum):
        local_lr = eta * ||w|| / (||g|| + beta * ||w||)        (1 where ||w|| or ||g|| is 0)
        v = m * v + lr * local_lr * (g + beta * w)
        w = w - v
    Each layer's step is then a fixed fraction eta of its weight norm, whatever its gradient's scale: the
    reason large batches (8K-32K) train at high rates. 1-D tensors (batch-norm scales and shifts, biases) get
    neither adaptation nor decay (v = m * v + lr * g), as is usual since their norms mean nothing as a scale.
    """

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.ndim > 1:
                    w_norm, g_norm = p.norm(), g.norm()
                    local = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])
                    # torch.where, not `if`: no GPU-to-host sync per layer
                    local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
                    g = (g + group["weight_decay"] * p) * local
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                v = state["momentum_buffer"]
                v.mul_(group["momentum"]).add_(g, alpha=group["lr"])
                p.sub_(v)
        return loss


def alpha_sgd(epoch, beta_center, beta_period):
    """Akiba et al. 2017 sec. 3.1: the share of SGD in the RMSprop-to-SGD update at a (fractional) epoch.

    An ELU-shaped curve: exponential rise to 1/2 at beta_center, then a straight line of slope 1/beta_period
    up to 1 at beta_center + beta_period / 2, then 1 (pure momentum SGD):
        alpha = 1/2 * exp(2 * (e - c) / p)    e < c
        alpha = 1/2 + (e - c) / p             c <= e < c + p/2
        alpha = 1                             otherwise
    Both pieces meet at c with value 1/2 and slope 1/p, as ELU's do at 0. The paper text was not reachable
    when this was written; this is our reading of its description (check against arXiv:1711.04325 sec. 3.1).
    """
    if epoch < beta_center:
        return 0.5 * math.exp(2 * (epoch - beta_center) / beta_period)
    if epoch < beta_center + beta_period / 2:
        return 0.5 + (epoch - beta_center) / beta_period
    return 1.0


class RMSpropToSGD(torch.optim.Optimizer):
    """RMSprop warm-up, Akiba et al. 2017 (Preferred Networks, ResNet-50 on ImageNet in 15 minutes, 32K batch).

    Starts as RMSprop, which copes with the early large-batch phase, and slides into momentum SGD, which
    generalises better, along alpha_sgd(epoch). With g the gradient (+ weight_decay * w), for each element:
        m = mu2 * m + (1 - mu2) * g^2                                   (RMSprop's mean square)
        a = alpha_sgd(epoch, beta_center, beta_period)
        d = mu1 * d - (a + (1 - a) * (lr_rmsprop / lr) / (sqrt(m) + eps)) * g
        w = w + lr * d
    so the step is lr * a * g (SGD) plus lr_rmsprop * (1 - a) * g / (sqrt(m) + eps) (RMSprop), under one
    momentum mu1. The RMSprop part has its own rate lr_rmsprop because RMSprop's steps are about lr in size
    per element, whatever the gradient's scale, and the scaled SGD rate (e.g. 0.1 * 32K / 256 = 12.8)
    would be far too large for it. epoch = steps taken / steps_per_epoch. Defaults mu1 = 0.9, mu2 = 0.99,
    eps = 1e-8, beta_center = 10, beta_period = 5 are our choices, not numbers taken from the paper.
    """

    def __init__(self, params, lr, lr_rmsprop=1e-3, momentum=0.9, rms_decay=0.99, eps=1e-8, weight_decay=0.0,
                 beta_center=10.0, beta_period=5.0, steps_per_epoch=1):
        super().__init__(params, dict(lr=lr, lr_rmsprop=lr_rmsprop, momentum=momentum, rms_decay=rms_decay, eps=eps,
                                      weight_decay=weight_decay, beta_center=beta_center, beta_period=beta_period,
                                      steps_per_epoch=steps_per_epoch, step=0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            if group["lr"] == 0:        # a schedule's first step (warm-up from 0): nothing moves, the clock goes on
                group["step"] += 1
                continue
            # the step count lives in the group, so state_dict() carries it into checkpoints
            a = alpha_sgd(group["step"] / group["steps_per_epoch"], group["beta_center"], group["beta_period"])
            rms_share = (1 - a) * group["lr_rmsprop"] / group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                state = self.state[p]
                if not state:
                    state["square_avg"], state["momentum_buffer"] = torch.zeros_like(p), torch.zeros_like(p)
                m, d = state["square_avg"], state["momentum_buffer"]
                m.mul_(group["rms_decay"]).addcmul_(g, g, value=1 - group["rms_decay"])
                d.mul_(group["momentum"]).sub_(g * (a + rms_share / (m.sqrt() + group["eps"])))
                p.add_(d, alpha=group["lr"])
            group["step"] += 1
        return loss


def slow_start_lr(epoch, peak_lr, start_factor=0.5, start_epochs=5, milestones=(30, 60, 80), gamma=0.1):
    """A slow-start learning-rate schedule (Akiba et al. 2017 sec. 3.2): a lower rate for the first epochs,
    while the RMSprop warm-up hands over to SGD, then the usual step decay (Goyal et al.: /10 at 30, 60, 80).

        lr = peak_lr * start_factor                  epoch < start_epochs
        lr = peak_lr * gamma ** (milestones passed)  otherwise
    The knots (start_factor, start_epochs) are our defaults, not the paper's exact numbers.
    """
    if epoch < start_epochs:
        return peak_lr * start_factor
    return peak_lr * gamma ** sum(epoch >= m for m in milestones)


def param_groups_no_decay_1d(model, weight_decay):
    """Two optimizer groups: weight decay for weight matrices and kernels, none for 1-D tensors (BN, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [dict(params=[p for p in params if p.ndim > 1], weight_decay=weight_decay),
            dict(params=[p for p in params if p.ndim <= 1], weight_decay=0.0)]


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


class BatchSizeSchedule:
    """Batch-size control, Mikami et al. 2018 (Sony): the global batch grows during training, per epoch.

    A small batch early keeps accuracy; a large batch later (when the loss landscape is flatter) gives fewer,
    cheaper-to-synchronise steps. knots = [(0, 16384), (30, 32768), ...]: from each epoch on, that batch size.
    The learning rate is scaled along with the batch (Goyal's linear rule): lr_scale = batch / first batch.
    """

    def __init__(self, knots):
        knots = [(int(e), int(b)) for e, b in knots]
        if not knots or knots[0][0] != 0:
            raise ValueError("batch-size schedule must start at epoch 0")
        if any(b <= 0 for _, b in knots):
            raise ValueError("batch sizes must be positive")
        if any(e1 <= e0 for (e0, _), (e1, _) in zip(knots, knots[1:])):
            raise ValueError("batch-size schedule epochs must increase strictly")
        if any(b1 < b0 for (_, b0), (_, b1) in zip(knots, knots[1:])):
            raise ValueError("batch-size schedule must not shrink the batch")
        self.knots = knots

    def batch(self, epoch):
        return [b for e, b in self.knots if e <= epoch][-1]

    def lr_scale(self, epoch):
        return self.batch(epoch) / self.knots[0][1]

    def per_rank(self, epoch, world):
        return per_rank_batch(self.batch(epoch), world)


# ----------------------------------------------------------------------------------------------------------
# Communication hooks

class TorusState:
    """The process subgroups of a rows x cols grid of ranks (rank r sits at row r // cols, column r % cols)."""

    def __init__(self, grid):
        rows, cols = grid
        world = dist.get_world_size()
        if rows * cols != world:
            raise ValueError(f"torus grid {rows}x{cols} does not match the world size {world}")
        self.rows, self.cols, self.world = rows, cols, world
        rank = dist.get_rank()
        # every rank must create every group, in the same order (new_group is collective)
        for r in range(rows):
            g = dist.new_group([r * cols + c for c in range(cols)])
            if r == rank // cols:
                self.row = g
        for c in range(cols):
            g = dist.new_group([r * cols + c for r in range(rows)])
            if c == rank % cols:
                self.col = g


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
        ddp_model.register_comm_hook(TorusState(grid or square_grid(dist.get_world_size())), torus_allreduce_hook)
    return ddp_model


def square_grid(world):
    """rows x cols = world with rows <= cols as close as possible (32 x 32 for 1,024)."""
    rows = max(r for r in range(1, math.isqrt(world) + 1) if world % r == 0)
    return rows, world // rows


# ----------------------------------------------------------------------------------------------------------
# Scaling model

def allreduce_time(nbytes, gpus, algorithm, link_gbps, latency_us):
    """Seconds to all-reduce nbytes over gpus, alpha-beta model (alpha = latency per step, beta = s/byte).

        ring:  2 (p - 1) alpha + 2 (p - 1) / p * n beta               (Patarasuk & Yuan 2009)
        tree:  2 ceil(log2 p) alpha + 2 n beta                          (pipelined double binary tree, as NCCL)
        torus: 2 (r + c - 2) alpha + 2 (p - 1) / p * n beta             (r x c = square_grid(p): reduce-scatter
               in rows, (c-1) alpha + (c-1)/c n beta, twice with the all-gather; ring all-reduce of n / c in
               columns, 2 (r-1) alpha + 2 (r-1)/r (n/c) beta; the bandwidth terms add up to the ring's)
    """
    if gpus == 1:
        return 0.0
    alpha, beta = latency_us * 1e-6, 8 / (link_gbps * 1e9)
    if algorithm == "ring":
        return 2 * (gpus - 1) * alpha + 2 * (gpus - 1) / gpus * nbytes * beta
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(gpus)) * alpha + 2 * nbytes * beta
    if algorithm == "torus":
        r, c = square_grid(gpus)
        return 2 * (r + c - 2) * alpha + 2 * (gpus - 1) / gpus * nbytes * beta
    raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose from ring, tree, torus")


def simulate(gpus, step_time_s, model_bytes, link_gbps, latency_us, algorithm="ring", buckets=4,
             batch_per_gpu=32, backward_fraction=2 / 3, gpus_per_node=1, intra_gbps=None, intra_latency_us=None):
    """Projected step time, images/s and scaling efficiency of data-parallel training on each GPU count.

    Weak scaling: every GPU keeps batch_per_gpu, so compute stays step_time_s (one GPU's measured or given
    step) and the gradient all-reduce is added. Backward is the last backward_fraction of compute; the
    gradient is split into `buckets` equal buckets, bucket i (1..k) is ready at F + i B / k (F forward,
    B backward) and the buckets are all-reduced one after the other, each taking c = allreduce_time(n / k).
    The last bucket then finishes at
        step = F + max(B + c, B / k + k c)
    (the first term: communication hides behind backward except the last bucket's; the second: communication
    is the bottleneck and only the first bucket's wait for backward shows). Efficiency = step_time_s / step.
    Runs that fit in one node (gpus <= gpus_per_node) use intra_gbps / intra_latency_us (NVLink); larger runs
    use link_gbps / latency_us, the bandwidth of the slowest link a ring or tree crosses: a node's network
    bandwidth, since with ranks placed node by node each node boundary carries one stream (NCCL's rings and
    trees, and the torus's columns, which split that stream between the node's GPUs). Ignored: the optimizer
    step, stragglers, congestion, I/O, and the per-message overheads that real libraries add.
    """
    rows = []
    for p in gpus:
        inside = p <= gpus_per_node and intra_gbps
        bw = intra_gbps if inside else link_gbps
        lat = (intra_latency_us if intra_latency_us is not None else latency_us) if inside else latency_us
        c = allreduce_time(model_bytes / buckets, p, algorithm, bw, lat)
        backward = backward_fraction * step_time_s
        step = step_time_s - backward + max(backward + c, backward / buckets + buckets * c)
        rows.append(dict(gpus=p, algorithm=algorithm, step_s=step, comm_s=buckets * c,
                         images_per_s=p * batch_per_gpu / step, efficiency=step_time_s / step))
    return rows


# The published figures (as quoted in issue 6) and the setup we assume for each. Step times are not measured
# here (no GPU): they are derived from published throughput or assumed, and say so.
# ABCI (both V100 runs): 4 V100 per node on NVLink, 2 x 100 Gbit/s EDR InfiniBand per node
ABCI = dict(link_gbps=200.0, latency_us=10.0, gpus_per_node=4, intra_gbps=400.0, intra_latency_us=5.0, buckets=4)
PUBLISHED = [
    dict(name="Goyal et al. 2017: 8 -> 256 P100 (Caffe2, 8 per server, 50 Gbit/s Ethernet)",
         published="~90% efficiency 8 -> 256 GPUs", metric="relative_efficiency", target=0.90, base_gpus=8,
         gpus=256, step_time_s=0.232, model_bytes=25.6e6 * 4, link_gbps=50.0, latency_us=50.0,
         algorithm="tree", buckets=4, batch_per_gpu=32, gpus_per_node=8, intra_gbps=160.0, intra_latency_us=5.0,
         note="step 0.232 s = 32 images / (1.28M x 90 epochs / 29 h / 8 GPUs), derived from their 29 h on "
              "8 P100s; fp32 gradients; one 50 Gbit/s Ethernet NIC per server; tree ~ their recursive halving/doubling"),
    dict(name="Mikami et al. 2018 (Sony): 1,024 V100 on ABCI, 2D-torus",
         published="84.75% scaling efficiency", metric="efficiency", target=0.8475, gpus=1024,
         step_time_s=32 / 1000, model_bytes=25.6e6 * 2, algorithm="torus", batch_per_gpu=32, **ABCI,
         note="assumed: 1,000 images/s per V100 in fp16 (batch 32 -> 32 ms); fp16 gradients; 2 x 100 Gbit/s "
              "EDR InfiniBand per 4-GPU node"),
    dict(name="Yamazaki et al. 2019 (Fujitsu): 2,048 V100 on ABCI",
         published="1.73M images/s", metric="images_per_s", target=1.73e6, gpus=2048,
         step_time_s=40 / 1000, model_bytes=25.6e6 * 2, algorithm="tree", batch_per_gpu=40, **ABCI,
         note="assumed: 1,000 images/s per V100 in fp16 (batch 40 -> 40 ms); fp16 gradients; same network; "
              "tree all-reduce assumed (their exact algorithm not modelled)"),
]

_SIM_ARGS = ("step_time_s", "model_bytes", "link_gbps", "latency_us", "algorithm", "buckets", "batch_per_gpu",
             "gpus_per_node", "intra_gbps", "intra_latency_us")


def published_metric(case, **override):
    """Our model's value of the case's published metric (efficiency, relative efficiency or images/s)."""
    kw = {**{k: case[k] for k in _SIM_ARGS}, **override}
    row = simulate([case["gpus"]], **kw)[0]
    if case["metric"] == "relative_efficiency":
        return row["efficiency"] / simulate([case["base_gpus"]], **kw)[0]["efficiency"]
    return row[case["metric"]]


def fitted_link_gbps(case, lo=0.01, hi=1e4):
    """The link bandwidth at which the model meets the published figure (bisection on a log scale):
    how far our network assumption is from what the published number implies. None if out of range."""
    f = lambda bw: published_metric(case, link_gbps=bw) - case["target"]
    if f(lo) > 0 or f(hi) < 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def published_table():
    """Markdown table: published figure, our model's output with the assumed setup, and the fitted bandwidth."""
    lines = ["| run | published | model (assumed setup) | model / published | link Gbit/s: assumed, fitted to the published figure |",
             "|---|---|---|---|---|"]
    for case in PUBLISHED:
        got = published_metric(case)
        fit = fitted_link_gbps(case)
        show = (lambda v: f"{v / 1e6:.2f}M images/s") if case["metric"] == "images_per_s" else (lambda v: f"{100 * v:.1f}%")
        lines.append(f"| {case['name']} | {case['published']} | {show(got)} | {got / case['target']:.3f} | "
                     f"{case['link_gbps']:g}, {'n/a' if fit is None else f'{fit:.2f}'} |")
    return "\n".join(lines)


def main_simulate(argv=None):
    """`simulate` command: print the projected scaling per GPU count, and its assumptions."""
    ap = argparse.ArgumentParser(prog="simulate", description=simulate.__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1,8,64,512,2048", help="comma-separated GPU counts")
    ap.add_argument("--step-time", type=float, default=0.1, help="one GPU's step time in seconds (measured or given)")
    ap.add_argument("--model-mb", type=float, default=102.4,
                    help="gradient MB all-reduced per step (ResNet-50: 102.4 fp32, 51.2 fp16)")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="Gbit/s of the slowest link (a node's network bandwidth)")
    ap.add_argument("--latency-us", type=float, default=10.0, help="latency per communication step, microseconds")
    ap.add_argument("--algorithm", default="all", choices=["ring", "tree", "torus", "all"])
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--batch-per-gpu", type=int, default=32)
    ap.add_argument("--backward-fraction", type=float, default=2 / 3)
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--intra-gbps", type=float, default=None, help="Gbit/s per GPU inside a node (NVLink)")
    ap.add_argument("--published", action="store_true", help="compare the model with the published figures")
    a = ap.parse_args(argv)
    if a.published:
        for case in PUBLISHED:
            print(f"- {case['name']}: {case['note']}; latency {case['latency_us']} us, {case['algorithm']}, "
                  f"{case['buckets']} buckets")
        print(published_table())
        return 0
    gpus = [int(g) for g in a.gpus.split(",")]
    print(f"assumptions: weak scaling, {a.batch_per_gpu} images per GPU, one-GPU step {a.step_time:g} s "
          f"({100 * a.backward_fraction:.0f}% backward), {a.model_mb:g} MB of gradients in {a.buckets} buckets "
          f"overlapped with backward, {a.link_gbps:g} Gbit/s and {a.latency_us:g} us per step between GPUs"
          + (f", {a.intra_gbps:g} Gbit/s inside {a.gpus_per_node}-GPU nodes" if a.intra_gbps else "")
          + "; no optimizer, I/O, straggler or congestion cost. A model, not a measurement.")
    print(f"{'gpus':>6} {'algorithm':>9} {'step ms':>9} {'comm ms':>9} {'images/s':>12} {'efficiency':>10}")
    for alg in (["ring", "tree", "torus"] if a.algorithm == "all" else [a.algorithm]):
        for r in simulate(gpus, a.step_time, a.model_mb * 1e6, a.link_gbps, a.latency_us, alg, a.buckets,
                          a.batch_per_gpu, a.backward_fraction, a.gpus_per_node, a.intra_gbps):
            print(f"{r['gpus']:>6} {alg:>9} {1e3 * r['step_s']:>9.2f} {1e3 * r['comm_s']:>9.2f} "
                  f"{r['images_per_s']:>12,.0f} {100 * r['efficiency']:>9.1f}%")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["simulate"]:
        sys.exit("usage: python distributed.py simulate [--help]")
    sys.exit(main_simulate(sys.argv[2:]))
