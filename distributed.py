"""Data-parallel training on torch.distributed: process groups, sharding, DDP wrapping, checkpoints that every
rank can resume from, gradient communication hooks (fp16, bf16, 2D torus) and batch-norm statistics averaged
over ranks. The large-batch optimisers (LARS, RMSprop-to-SGD) are in imagenet_models.py; the scaling model over
many GPUs in scaling.py.

    torchrun --nproc_per_node=8 cifar10_fast.py ...            # the scripts call init_from_env(), wrap_ddp(), ...

Everything collective goes through PyTorch's own engine (NCCL on GPUs, gloo on CPUs): DistributedDataParallel,
its communication hooks and torch.distributed collectives. Nothing here opens a socket of its own.

Papers:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (Preferred Networks, arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, 2D-torus all-reduce, arXiv:1811.05233)
"""
import contextlib
import datetime
import errno
import gc
import hashlib
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import devices
from core import DataError
from outputs import write_atomic
from processes import die_with_parent
from scaling import square_grid


# ----------------------------------------------------------------------------------------------------------
# Process group

@dataclass(kw_only=True)
class Context:
    """Where this process stands: its rank among world_size processes, its GPU (local_rank) and device, and how its
    gradients travel (hook: a CommHook; bucket_mb: DDP's buckets)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    is_main: bool = True
    distributed: bool = False  # a process group exists (torchrun, even with one process)
    local_world_size: int = 1  # processes on this node
    hook: object = None        # a CommHook (below); None: plain all-reduce
    bucket_mb: float = 25.0


def init_from_env(device=None, backend=None, timeout_minutes=None):
    """The Context of this process from torchrun's RANK / WORLD_SIZE / LOCAL_RANK, joining the process group (nccl
    for CUDA, else gloo); without them, one process and no group (several SLURM tasks stop with the command to use).
    "cuda" means cuda:LOCAL_RANK; timeout_minutes bounds every collective (None: torch's default). A worker of
    torchrun's agent ends with its agent."""
    if "RANK" not in os.environ:
        tasks = int(os.environ.get("SLURM_NTASKS", "1"))
        if tasks > 1:
            raise ValueError(
                f"srun started {tasks} tasks without torchrun, so each would train alone and write the same files; "
                "start one torchrun per node instead: srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_JOB_NUM_NODES "
                "--nproc-per-node=GPUS_PER_NODE --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d "
                f"--rdzv-endpoint=$(hostname):29500 {shlex.join(sys.argv)}")
        return Context(device=str(devices.resolve(device)))
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each worker in a session of its own: without this, a worker whose agent is killed trains
        # on unwatched, and would write rank 0's checkpoint beside the relaunched job's
        die_with_parent(os.getppid())
    device = devices.for_rank(device, local)
    devices.bind(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None     # None: torch's
        store = (attempt_store(rank, timeout or dist.default_pg_timeout)
                 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None)
        dist.init_process_group(backend or devices.backend(device), store=store, rank=rank, world_size=world,
                                timeout=timeout)
    return Context(rank=rank, world_size=world, local_rank=local, device=str(device), is_main=rank == 0,
                   distributed=True, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def attempt_store(rank, timeout):
    """The store of this attempt's process group, fresh for every attempt of a torchrun job: rank 0 serves it and
    leaves its address in the agent's store, whose own addresses go stale across --max-restarts (PyTorch issue
    135712); an address left by an earlier attempt fails to connect, and is read again."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/group_store"
    if rank == 0:
        here = address_towards(host, port)
        store = dist.TCPStore(here, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(key, f"{here} {store.port}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if agent.check([key]):
            there, there_port = agent.get(key).decode().split()
            try:       # a short timeout: connecting to a store that is gone is retried until the timeout
                store = dist.TCPStore(there, int(there_port), is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=5))
                store.set_timeout(timeout)
                return store
            except (RuntimeError, dist.DistError):       # an earlier attempt's rank 0, gone
                pass
        time.sleep(0.1)
    raise RuntimeError(f"rank {rank}: rank 0 left no store of this attempt in torchrun's store at {host}:{port}")


def address_towards(host, port):
    """This machine's address on the route to host (what the other nodes reach it by)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)             # a datagram socket sends nothing: this only picks the route
        return s.getsockname()[0]


def is_main():
    """True on rank 0, or when there is no process group (before it is joined, torchrun's RANK says, or
    SLURM's task number for tasks that srun started without torchrun)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def print0(*args, **kwargs):
    """print on rank 0 only, so N processes do not print N copies of every line (errors included)."""
    if is_main():
        print(*args, **kwargs, flush=True)


def barrier():
    """Wait for every rank; nothing to wait for without a process group."""
    if dist.is_initialized():
        dist.barrier()


def leave(ctx):
    """Leaves the process group, with the garbage collected before and after while the interpreter is whole: gloo
    work still referenced from cyclic garbage, freed at the interpreter's exit, aborted one run in four with
    "terminate called without an active exception" (measured on 2 CPU ranks with DDP)."""
    if ctx.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def leave_together(ctx):
    """Every rank leaves the process group at once, so that none sees a peer vanish mid-collective."""
    if ctx.distributed:
        barrier()
        leave(ctx)


def shard(n, rank, world):
    """The index range of rank's contiguous shard of n items (a device-resident dataset, or one global batch); the
    n % world left over are dropped, as a rank with one more batch would wait forever in DDP's allreduce."""
    per = n // world
    return range(rank * per, (rank + 1) * per)


def uneven_shard(n, rank, world):
    """The index range of rank's contiguous share of n items, all of them covered (sizes differ by at most
    one): for evaluation, whose sums are added over ranks, so nothing need be dropped to even the shares."""
    return range(rank * n // world, (rank + 1) * n // world)


def stratified_share(labels, rank, world, seed=0):
    """The sorted indices of rank's share of a training set with these labels: a seeded partition into world shares
    of n // world items, classes dealt round-robin in a random order, so every rank holds every class in proportion
    (±1) whatever the stored order; the n % world left over are dropped, so all ranks run the same steps."""
    labels = np.asarray(labels)
    order = np.random.default_rng(seed).permutation(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]
    return np.sort(order[rank::world][:len(labels) // world])


def wrap_ddp(model, ctx, bucket_mb=25.0, **kwargs):
    """DistributedDataParallel all-reducing buckets of bucket_mb MB while backward runs (Goyal et al. sec. 4), with
    gradient_as_bucket_view (.grad a view into the bucket: one gradient copy fewer); the model itself without a
    group."""
    if not ctx.distributed:
        return model
    return DistributedDataParallel(model, device_ids=devices.ddp_device_ids(ctx.device), bucket_cap_mb=bucket_mb,
                                   gradient_as_bucket_view=True, **kwargs)


def data_parallel(model, ctx):
    """model in DistributedDataParallel (wrap_ddp) with ctx's bucket size and communication hook."""
    return register_comm_hook(wrap_ddp(model, ctx, ctx.bucket_mb), ctx.hook)


def rehearse_backward(ddp_model, example):
    """One forward and backward of `example` through a new DDP model, gradients dropped, so its buckets are laid out
    as in a trained model: the layout sets the order of the ranks' sums, so a resumed run (beyond two ranks) would
    drift by rounding. It moves batch-norm statistics: load the state afterwards."""
    ddp_model(example).float().sum().backward()
    ddp_model.zero_grad(set_to_none=True)


def writes_checkpoints(ctx, *, each_node=True):
    """Whether this rank writes the checkpoint: the first rank of every node (each_node: each node keeps its own copy,
    for a node-local path), or rank 0 alone (a path that every node sees)."""
    return ctx.local_rank == 0 if each_node else ctx.is_main


def checkpoint_writers(ctx, *, each_node=True):
    """The process group (gloo: host memory) of the first ranks of every node, over which rank 0 sends its state to
    the others' writers, or None when rank 0 is the only writer. Every rank must call it."""
    if not (each_node and ctx.distributed and ctx.local_world_size < ctx.world_size):
        return None
    local = [None] * ctx.world_size
    dist.all_gather_object(local, ctx.local_rank)
    return dist.new_group([r for r, k in enumerate(local) if k == 0], backend="gloo")


def save_state(path, state, ctx, *, each_node=True, writers=None):
    """The writers (writes_checkpoints) write rank 0's state (sent to them over `writers`, checkpoint_writers: a
    rank's own holds its own batch-norm statistics and clock) to path atomically (a crash mid-write leaves the
    previous checkpoint); then every rank learns whether every write succeeded, so that a failed one (a full disk, a
    read-only mount) stops all ranks at once with the same DataError of one line, not at the collective timeout."""
    error = None
    if writes_checkpoints(ctx, each_node=each_node):
        if writers is not None:      # host copies: another node's writer has no GPU of rank 0's index to put them on
            box = [on_host(state) if ctx.is_main else None]
            dist.broadcast_object_list(box, src=0, group=writers)
            state, = box
        try:
            state = on_host(state)      # the bytes torch.save writes, digested (torch's zip checks none of them)
            digested = {**state, DIGEST: state_digest(state)}
            write_atomic(path, lambda tmp: save_to_file(digested, tmp))
        except Exception as e:      # whatever stopped the write, the other ranks must hear of it
            error = f"cannot write the checkpoint {path}{on_rank(ctx)}: {why_not_written(e)}"
    agree_on_error(error, ctx)


DIGEST = "sha256"       # the key of the digest save_state writes beside a state's own keys


def state_digest(state):
    """The sha256 (hex) of a state's contents in their order: each tensor's dtype, shape and bytes (on the host), each
    other value's type and repr, each dict's keys."""
    h = hashlib.sha256()
    digest_into(h, state)
    return h.hexdigest()


def digest_into(h, value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}:".encode())
        for k, v in value.items():
            h.update(f"{k!r}=".encode())
            digest_into(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)}:".encode())
        for v in value:
            digest_into(h, v)
    else:
        h.update(f"{type(value).__name__} {value!r};".encode())


def on_host(state):
    """state with every tensor in it (in dicts, lists and tuples) copied to the CPU."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_host(v) for v in state)
    return state


def save_to_file(state, path):
    # through a Python file, whose OSError (ENOSPC, EIO) torch keeps as its error's context; torch's own file
    # writer would say only "unexpected pos"
    with open(path, "wb") as f:
        torch.save(state, f)


def why_not_written(error):
    """What stopped a write, in words: the OSError in error's chain as its message and errno's name ("No space left
    on device (ENOSPC)"), else the error's type and first sentence."""
    e = error
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    if e is not None and e.errno in errno.errorcode:
        return f"{e.strerror or os.strerror(e.errno)} ({errno.errorcode[e.errno]})"
    return f"{type(error).__name__}: {first_sentence(error)}"


def on_rank(ctx):
    """" on rank R" under torchrun, where each node may have a file of its own at the same path; else nothing."""
    return f" on rank {ctx.rank}" if ctx is not None and ctx.distributed else ""


def agree_on_error(error, ctx):
    """Raises DataError with the first rank's error on every rank when any rank has one (a line, or None), so that
    all ranks stop together with the same line; a collective, so it also waits for every rank."""
    errors = [error]
    if ctx is not None and ctx.distributed:
        errors = [None] * ctx.world_size
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise DataError(first)


def remove_unfinished_writes(path):
    """Removes the temporary files that writes of path killed midway left beside it (write_atomic's
    .NAME.RANDOM.tmp; not those of another file, such as NAME.seed1's); returns their names."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    prefix = f".{name}."
    left = sorted(f for f in (os.listdir(folder) if os.path.isdir(folder) else ())
                  if f.startswith(prefix) and f.endswith(".tmp") and "." not in f[len(prefix):-len(".tmp")])
    for f in left:
        with contextlib.suppress(FileNotFoundError):        # another node's writer, on a shared folder
            os.remove(os.path.join(folder, f))
    return left


def load_newest_state(path, ctx=None, *, epoch_of=None):
    """(state, rank): the newest state saved by save_state that any rank holds at path (its node's own copy or
    a shared file; tensors on the CPU) and the rank that read it, or (None, None) when no rank holds one. Every rank
    says which epoch_of(state) it holds (None: all alike); the lowest rank holding the latest reads it whole, checks
    its digest (read_copy) and broadcasts it (one pickled copy in each rank's host memory). A copy that cannot be read,
    or that is damaged, is passed over with a warning for the next good one (the same epoch elsewhere first, then
    older ones); where no rank holds a good copy, the first one's line is a DataError, the same on every rank."""
    held = held_epoch(path, ctx, epoch_of)
    every = [held]
    if ctx is not None and ctx.distributed:
        every = [None] * ctx.world_size
        dist.all_gather_object(every, held)
    errors = [h for h in every if isinstance(h, str)]      # the same on every rank
    copies = sorted((-h[0], rank) for rank, h in enumerate(every) if isinstance(h, tuple))
    tried = set()
    for _, holder in copies:
        if every[holder][1] in tried:      # the same file seen by another rank (a shared disk): read once
            continue
        tried.add(every[holder][1])
        state, error, note = read_copy(path, ctx, holder)
        if error:
            errors.append(error)
            continue
        for line in errors:
            print0(f"warning: {line}; rank {holder}'s copy is read instead", file=sys.stderr)
        if note:
            print0(f"warning: {note}", file=sys.stderr)
        return state, holder
    if errors:
        raise DataError(errors[0])
    return None, None


def read_copy(path, ctx, holder):
    """(state, None, a note or None) of the copy at path that rank `holder` reads whole and checks against the
    digest save_state wrote with it, or (None, the line saying why it cannot be used, None); broadcast from holder to
    every rank. A state without a digest (written before save_state wrote one) is used, its note saying so."""
    state = error = note = None
    if ctx is None or ctx.rank == holder:
        try:    # CPU: random states must be there, and load_state_dict moves the rest where it belongs
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # its header was read: the rest of the file is damaged
            error = unreadable(path, ctx, e)
        if isinstance(state, dict) and DIGEST in state:
            if state.pop(DIGEST) != state_digest(state):
                state, error = None, (f"{path}{on_rank(ctx)}: damaged since it was written (its contents' sha256 is "
                                      "not the one written with it)")
        elif error is None:
            note = (f"{path}{on_rank(ctx)}: written without a digest (by an older version), so damage to its "
                    "contents cannot be found; used as it is")
    if ctx is not None and ctx.distributed:
        box = [state, error, note]
        dist.broadcast_object_list(box, src=holder)
        state, error, note = box
    return state, error, note


def held_epoch(path, ctx, epoch_of):
    """(epoch_of the checkpoint this rank finds at path, the file's identity), None when there is none, or the line
    saying why it cannot be read; only its pickled header is read (the tensors are mapped, not loaded). The identity
    (inode, size, modification time) is the same for every rank that sees one file on a shared disk."""
    if not os.path.exists(path):
        return None
    try:
        try:
            header = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:   # mmap reads zip files alone: loaded whole, another file says what it is not
            header = torch.load(path, map_location="cpu", weights_only=True)
        found = os.stat(path)
        return (epoch_of(header) if epoch_of else 0), (found.st_ino, found.st_size, found.st_mtime_ns)
    except DataError as e:
        return f"{path}{on_rank(ctx)}: {e}"
    except Exception as e:  # whatever reading it raises, the file is no checkpoint
        return unreadable(path, ctx, e)


def unreadable(path, ctx, error):
    return f"{path}{on_rank(ctx)}: not a readable checkpoint ({type(error).__name__}: {first_sentence(error)})"


def first_sentence(error):
    """The first sentence of an error's message, whole (torch's messages go on for several more)."""
    text = " ".join(str(error).split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


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


def sync_batch_norm_stats(model, ctx, counted=None):
    """Before validation: every BN's running mean and variance become those of the global minibatch, pooled in one
    all_reduce from each rank's last batch (use_last_batch_stats); `counted` is the model whose steps counted n, for a
    copy that never runs them (an EMA). With n per channel on each rank, N = n * world, and means over the ranks:
        E[x^2] = var * (n - 1) / n + mean^2,    global var = (E[x^2] - mean^2) * N / (N - 1)
    """
    bns = _batch_norms(model)
    if not ctx.distributed or not bns:
        return
    counts = [getattr(bn, "last_count", None) for bn in _batch_norms(counted or model)]
    if None in counts:
        raise RuntimeError("sync_batch_norm_stats needs use_last_batch_stats(model) before the training steps")
    for bn, n in zip(bns, counts):
        bn.last_count = n
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


def broadcast_buffers(model, ctx):
    """Every rank's buffers of model (its batch-norm statistics, which each rank's own batches move) become rank 0's,
    as DistributedDataParallel's forward makes them: so that every rank evaluates one model, the one rank 0's
    checkpoint keeps. One broadcast a dtype."""
    buffers = list(model.buffers())
    if not ctx.distributed or not buffers:
        return
    for dtype in sorted({b.dtype for b in buffers}, key=str):       # the same order on every rank
        group = [b for b in buffers if b.dtype == dtype]
        flat = torch.cat([b.reshape(-1) for b in group])
        dist.broadcast(flat, 0)
        for b, part in zip(group, flat.split([b.numel() for b in group])):
            b.copy_(part.view_as(b))


# ----------------------------------------------------------------------------------------------------------
# Communication hooks

def torus_grid(grid, world, local_world=None):
    """(rows, cols) of the 2D torus over world ranks: grid as given (validated), else one row per node
    (cols = local_world, torchrun's LOCAL_WORLD_SIZE), so only the columns' all-reduce crosses the network; the most
    square grid when nodes differ in size."""
    if grid is None:
        local = local_world or world
        return (world // local, local) if world % local == 0 else square_grid(world)
    rows, cols = grid
    if rows * cols != world:
        raise ValueError(f"--torus-grid {rows}x{cols} is {rows * cols} ranks, but the world size is {world}")
    return rows, cols


class TorusState:
    """The process subgroups of a rows x cols grid of ranks (rank r sits at row r // cols, column r % cols: with
    torchrun's numbering, node by node), the dtype gradients travel in (None: the bucket's own), and the
    future of the last bucket started, after which the next one goes."""

    def __init__(self, grid, device_type, dtype=None):
        rows, cols = grid
        world = dist.get_world_size()
        if rows * cols != world:
            raise ValueError(f"torus grid {rows}x{cols} does not match the world size {world}")
        self.rows, self.cols, self.world, self.dtype = rows, cols, world, dtype
        mesh = init_device_mesh(device_type, (rows, cols))       # mesh dimension 0 runs down a column, 1 along a row
        self.col, self.row = mesh.get_group(0), mesh.get_group(1)
        self.last = torch.futures.Future()
        self.last.set_result(None)


def torus_allreduce_hook(state, bucket):
    """2D-torus all-reduce (Mikami et al. 2018), an asynchronous DDP communication hook returning the averaged bucket
    in state.dtype: reduce-scatter along the row, all-reduce down the column, all-gather along the row; a ring's
    bytes in 2 (rows + cols - 2) sequential steps, not 2 (world - 1)."""
    buf = bucket.buffer()
    n, cols, device = buf.numel(), state.cols, buf.device
    chunk = -(-n // cols)
    flat = torch.zeros(chunk * cols, dtype=state.dtype or buf.dtype, device=device)
    flat[:n] = buf / state.world
    received, part = torch.empty_like(flat), flat.new_empty(chunk)
    ready = devices.record(device=device)      # callbacks run on side streams: the first collective waits for flat
    done = torch.futures.Future(devices=[device] if devices.overlaps(device) else None)

    def scatter():
        devices.wait(ready, device)
        # reduce-scatter as all-to-all plus a local sum: unlike gloo's reduce-scatter, it gives a future to chain on
        return dist.all_to_all_single(received, flat, group=state.row, async_op=True)

    def used_here(*tensors):
        # a callback's side stream: the allocator must not hand these on before its kernels have run
        for t in tensors:
            devices.keep_alive(t, device)

    def down_the_column():
        torch.sum(received.view(cols, chunk), 0, out=part)
        used_here(received, part)
        return dist.all_reduce(part, group=state.col, async_op=True)

    def unpack():
        buf.copy_(flat[:n])
        used_here(flat)
        done.set_result(buf)

    along_the_row = lambda: dist.all_gather_into_tensor(flat, part, group=state.row, async_op=True)
    # after the previous bucket's chain: every rank issues each group's collectives in the same order
    _chain(state.last, [scatter, down_the_column, along_the_row], unpack, done)
    state.last = done
    return done


def _chain(after, launches, finish, done):
    """When the future `after` completes, start each launch() (an asynchronous collective) once the one before
    has finished, then run finish(); an error anywhere becomes done's. Nothing here waits."""
    def step(fut, i):
        try:
            fut.value()                     # raises the previous step's error
            if i < len(launches):
                # chained, not waited on: a waiting callback would hold one of gloo's few worker threads
                launches[i]().get_future().add_done_callback(lambda f: step(f, i + 1))
            else:
                finish()
        except Exception as e:
            done.set_exception(e)
    after.add_done_callback(lambda f: step(f, 0))


HOOKS = ("none", "fp16", "bf16", "torus", "torus_fp16", "torus_bf16")
TORUS_DTYPES = {"torus": None, "torus_fp16": torch.float16, "torus_bf16": torch.bfloat16}


@dataclass(frozen=True)
class CommHook:
    """A gradient communication hook by name (HOOKS) and, for the torus ones, its grid (None: one row a node)."""
    name: str = "none"
    grid: tuple = None


def comm_hook(name, grid, ctx):
    """The CommHook of the command line's --comm-hook and --torus-grid (rows, cols), checked against the world."""
    if grid is not None and name not in TORUS_DTYPES:
        raise ValueError("--torus-grid needs --comm-hook torus, torus_fp16 or torus_bf16")
    if name in TORUS_DTYPES:
        grid = torus_grid(grid, ctx.world_size, ctx.local_world_size)
    return CommHook(name, grid)


def register_comm_hook(ddp_model, hook, grid=None):
    """The DDP model with a gradient communication hook (a name or a CommHook) installed: none (fp32 allreduce),
    fp16 / bf16 (torch's compression: half the bytes), or torus / torus_fp16 / torus_bf16 (torus_allreduce_hook over
    a rows x cols grid, by default one row per node)."""
    if hook is None:
        return ddp_model
    if isinstance(hook, CommHook):
        hook, grid = hook.name, hook.grid
    if hook not in HOOKS:
        raise ValueError(f"unknown communication hook {hook!r}; choose from {', '.join(HOOKS)}")
    if hook == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook in TORUS_DTYPES:
        world = dist.get_world_size()
        grid = grid or torus_grid(None, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        ddp_model.register_comm_hook(TorusState(grid, ddp_model.device_type, TORUS_DTYPES[hook]), torus_allreduce_hook)
    return ddp_model
