"""What one CIFAR-10 training step launches on a CUDA GPU, counted on the CPU, for a recipe and for the 2-second
record's own script (hiverge/cifar10-speedrun's cifar10_speedrun.py in the git-ignored peers/cifar10-speedrun/: git
clone https://github.com/hiverge/cifar10-speedrun peers/cifar10-speedrun) at the same batch and shapes:

  launches   the kernels a step launches outside the network's compiled forward and backward: every eager aten
             operation as CUDA runs it (cuda_launches: ATen's foreach fast-path rules, fused SGD's one launch a
             group) and, for each call of another compiled graph (Newton–Schulz, the one optimiser step), its kernels;
             from set_lr to the next batch: the rates, the optimisers, zero_grad and the step's own metrics
  fallbacks  the aten operations Inductor leaves to ATen (FallbackKernel) in the compiled forward and backward
  kernels    the kernels of the compiled forward and of the backward after Inductor's fusion: its generated
             (fused) kernels and its extern calls (convolutions, matmuls, fallbacks), MultiOutput's tuple reads not
             counted

    python benchmarks/step_counts.py                            # fast94_next and the record, batch 13
    python benchmarks/step_counts.py --recipes fast94_curriculum fast94_next --no-record

Counted as a GPU compiles: Inductor's realisation thresholds at their GPU values (fusion_bytes.GPU_THRESHOLDS) and
no CPU-only scatter-add fallback; the whitening bias detached, as in all but a run's first 0.19 epochs; bf16
autocast for ours (devices.compute_dtype on CUDA), its weights held as a GPU's run holds them
(cifar10_fast.held_weights), the record in fp16 as it trains; each graph with the outputs its step returns.
Inductor's kernels are generated, not compiled (each runs as a no-op): the counts are the same, in seconds. What the
counts cannot see: the kernels a GPU's Triton fusion or split reductions would add or merge where the CPU's C++
scheduler decides otherwise (its loop fusion of siblings, OuterLoopFusedSchedulerNode), a convolution's bias, which
Inductor adds in a pointwise kernel of its own on a GPU (the whitening's, ours and the record's), max-autotune's
templates and CUDA graphs, the several kernels cuDNN or cuBLAS may run for one extern call, and the time of anything.
"""
import argparse
import contextlib
import copy
import functools
import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import cifar10_fast as cf  # noqa: E402
import fusion_bytes  # noqa: E402
import optim  # noqa: E402
import torch_backend as tb  # noqa: E402
from core import Parser  # noqa: E402

RECORD = Path(__file__).resolve().parents[1] / "peers" / "cifar10-speedrun" / "cifar10_speedrun.py"
RECORD_CLONE = "git clone https://github.com/hiverge/cifar10-speedrun peers/cifar10-speedrun"
RECORD_BATCH = 1536
RECORD_RUN_STEPS = 243          # its ceil(7.59 × len(train_loader)), 32 batches of 1,536 an epoch


def record_renormalising_steps(total=RECORD_RUN_STEPS):
    """How many of the record's steps its Muon renormalises the filters at: those a norm_freq of
    2 + int(15 × step / total) or more after the last."""
    last = count = 0
    for step in range(1, total + 1):
        if step - last >= 2 + int(15 * step / total):
            last, count = step, count + 1
    return count


# Inductor as on a GPU: its realisation thresholds, and scatter-add generated (a GPU's atomic add) rather than left
# to ATen, which the CPU's C++ backend alone does by default
GPU_LOWERING = {**fusion_bytes.GPU_THRESHOLDS, ("inductor", "cpp.fallback_scatter_reduce_sum"): False}
COUNT_BATCH = 13          # a prime that divides none of the network's sizes (fusion_bytes' choice)
# a fallback that launches more than one kernel: ATen's _foreach_norm on its fast path (foreach_launches), its
# tensors of one dtype and layout (a network's filters) and fewer than MAX_TENSORS[1]
FALLBACK_LAUNCHES = {"_foreach_norm": 3}


# ---------------------------------------------------------------------------------------------------------------
# (b), (c): the compiled forward and backward, after Inductor's fusion

def scheduled(nodes, lists=()):
    """{"kernels", "fused", "extern", "fallbacks"} of an Inductor graph's scheduler nodes after fusion: its generated
    kernels, the nodes that hold members of one foreach operation's list (`lists`, of operation names) taken as one,
    as a GPU's foreach kernel holds them; its extern calls (MultiOutput, a read of a fallback's tuple, launches
    nothing) and the aten operations among them left to ATen."""
    from torch._inductor import ir
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    extern, fallbacks, kernels = 0, [], []          # kernels: the sets of foreach lists each fused kernel holds
    for node in nodes:
        if isinstance(node, NopKernelSchedulerNode):
            continue
        if not isinstance(node, ExternKernelSchedulerNode):
            held = {i for i, names in enumerate(lists) if names & set(node.get_operation_names())}
            if len({len(lists[i]) for i in held}) > 1:      # a GPU fuses foreach lists of one length alone
                raise ValueError("a kernel holds foreach lists of different lengths: not counted as a GPU's")
            kernels.append(held)
        elif not isinstance(node.node, ir.MultiOutput):
            extern += 1
            if isinstance(node.node, ir.FallbackKernel) or type(node.node).__name__.endswith("Fallback"):
                fallbacks.append(str(node.node.op_overload).removeprefix("aten.").split(".")[0])
                extern += FALLBACK_LAUNCHES.get(fallbacks[-1], 1) - 1
    merged = []                                      # kernels sharing a foreach list, joined
    for held in kernels:
        joined = [m for m in merged if m & held]
        merged = [m for m in merged if not m & held] + [held.union(*joined)] if held else merged + [held]
    return {"kernels": len(merged) + extern, "fused": len(merged), "extern": extern, "fallbacks": fallbacks}


@contextlib.contextmanager
def counting_graphs():
    """While inside, every graph Inductor compiles (as a GPU would lower it, no cache) appends its scheduled() counts
    to the list yielded, and each compiled graph keeps its own counts (gpu_counts), read by cuda_launches. Its kernels'
    code is generated but not compiled: each runs as a no-op (counts, not values; seconds, not a minute of g++)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codegen.common import BackendFeature
    from torch._inductor.graph import GraphLowering
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.scheduler import Scheduler
    import torch._inductor.config as inductor_config
    graphs, init, has = [], CompiledFxGraph.__init__, GraphLowering.has_feature

    def look(nodes):            # Inductor's post-fusion hook: the nodes given back unchanged
        from torch._inductor.virtualized import V
        graphs.append(scheduled(nodes, [set(names) for names in V.graph.lists.values()]))
        return nodes

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.gpu_counts = graphs[-1] if graphs else None

    def has_feature(graph, device, feature):        # foreach operations lowered into lists, as for Triton
        return feature == BackendFeature.FOREACH or has(graph, device, feature)
    with fusion_bytes.configured(GPU_LOWERING), inductor_config.patch(
            {"_post_fusion_custom_pass": look, "fx_graph_cache": False, "force_disable_caches": True}), \
            mock.patch.object(CompiledFxGraph, "__init__", keep), \
            mock.patch.object(GraphLowering, "has_feature", has_feature), \
            mock.patch.object(AsyncCompile, "cpp_pybinding", lambda compiler, argtypes, code: lambda *args: None), \
            mock.patch.object(Scheduler, "create_foreach_nodes", lambda scheduler: None):   # C++ fuses no such node
        yield graphs


def training_graphs(step_of, x, y):
    """{"forward", "backward"}: scheduled() of the two graphs Inductor compiles of step_of(x, y) (a network, its summed
    loss and whatever else a step returns, as one function: the loss, or a tuple led by it) and its backward."""
    torch._dynamo.reset()
    with counting_graphs() as graphs:
        out = torch.compile(step_of, dynamic=False)(x, y)
        (out[0] if isinstance(out, tuple) else out).backward()
    forward, backward = graphs
    return {"forward": forward, "backward": backward}


def recipe_network(name, *, width=1.0, side=32, batch=COUNT_BATCH, **changes):
    """(a function of (images, labels) to what recipe `name`'s compiled step returns (cifar10_fast.WithLoss: its summed
    loss and step sums; its network in train mode, channels_last, its weights held as a GPU's run holds them
    (cifar10_fast.held_weights), bf16 autocast, the whitening bias detached), a batch of bf16 images, as a GPU's run
    holds them, and labels)."""
    r = cf.recipe(name, width=width, **changes)
    torch.manual_seed(0)
    net = tb.build_model(r, "cpu").to(memory_format=torch.channels_last).train()
    if held := cf.held_weights(r, torch.bfloat16):
        tb.hold_weights(net, held)
    tb.fit_whitening(net, torch.randn(64, 3, 32, 32), 32)
    bias = tb.whitening_bias(net)
    if bias:
        bias.param.requires_grad_(False)
    step = cf.WithLoss(net, r.label_smoothing)

    def step_of(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(x, y)
    x = torch.randn(batch, 3, side, side, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    return step_of, x, torch.randint(0, 10, (batch,))


def record_module():
    """The record's cifar10_speedrun.py imported as a module (nothing of it runs but its definitions); a clear error
    where peers/ lacks it."""
    if not RECORD.is_file():
        raise FileNotFoundError(f"{RECORD} is missing: {RECORD_CLONE}")
    if "cifar10_speedrun" not in sys.modules:                 # dynamo finds a compiled function's module by name
        spec = importlib.util.spec_from_file_location("cifar10_speedrun", RECORD)
        sys.modules["cifar10_speedrun"] = module = importlib.util.module_from_spec(spec)
        with mock.patch.object(sys, "argv", [str(RECORD)]):    # it reads its own source through sys.argv[0]
            spec.loader.exec_module(module)
    return sys.modules["cifar10_speedrun"]


def record_network(batch=COUNT_BATCH):
    """(the record's compiled training function of (images, labels): its fp16 CifarNet, whitening bias detached, and
    its summed, label-smoothed loss; a batch of images and labels), as its main() builds them."""
    record = record_module()
    torch.manual_seed(0)
    model = record.CifarNet().to(memory_format=torch.channels_last)
    model.reset()
    model.init_whiten(torch.randn(64, 3, 32, 32).half())
    model.train()
    loss_of = lambda x, y: F.cross_entropy(model(x, whiten_bias_grad=False), y, label_smoothing=0.09,
                                           reduction="sum")
    x = torch.randn(batch, 3, 32, 32).half().to(memory_format=torch.channels_last)
    return loss_of, x, torch.randint(0, 10, (batch,))


# ---------------------------------------------------------------------------------------------------------------
# (a): the kernels a step launches outside the network's graphs, as CUDA launches them

CHUNK, MAX_BLOCKS = 65536, 320                 # ATen's MultiTensorApply.cuh: kChunkSize, depth_to_max_blocks
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}      # depth_to_max_tensors
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_unsafe_view"}


def multi_tensor_launches(tensors, depth):
    """The kernels ATen's multi_tensor_apply launches over `tensors` (the first list) with `depth` lists: one for each
    MAX_BLOCKS chunks of 65,536 elements or MAX_TENSORS[depth] tensors, whichever fills first."""
    launches = blocks = count = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        count += 1
        chunks = math.ceil(t.numel() / CHUNK)
        for chunk in range(chunks):
            blocks += 1
            if blocks == MAX_BLOCKS or (count == MAX_TENSORS[depth] and chunk == chunks - 1):
                launches, blocks = launches + 1, 0
                count = 0 if chunk == chunks - 1 else 1
    return launches + (blocks > 0)


def _dense_strides(t):
    strides, size = [], 1
    for s, n in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if s != size:
            return None
        strides.append(s)
        size *= n
    return strides


def same_strides(a, b):
    """ATen's _check_tensors_share_sizes_and_strides for one pair: equal sizes, equal strides where a size is not 1."""
    return a.shape == b.shape and all(n == 1 or s == u for n, s, u in zip(a.shape, a.stride(), b.stride()))


def fast_route(lists, scalars=(), *, cross_dtype=True):
    """ATen's check_fast_path_restrictions (ForeachUtils.h): every tensor strided, non-overlapping and dense, of its
    list's dtype (and of the first list's, unless cross_dtype is off, as _foreach_copy_ has it), corresponding tensors
    of equal sizes and strides, and each scalar leaving the first list's dtype as it is."""
    first = lists[0][0]
    for tensors in lists:
        for t in tensors:
            if t.layout != torch.strided or _dense_strides(t) is None or t.dtype != tensors[0].dtype or \
                    (cross_dtype and t.dtype != first.dtype):
                return False
    if not all(same_strides(a, b) for tensors in lists[1:] for a, b in zip(lists[0], tensors)):
        return False
    return all(torch.result_type(t, s) == t.dtype for t, s in zip(lists[0], scalars) if not isinstance(s, torch.Tensor))


def foreach_launches(func, args, kwargs):
    """The kernels CUDA launches for one _foreach_ operation (or fused SGD): multi_tensor_apply's where ATen's fast
    path holds, else one a tensor (its slow path, one at:: operation each)."""
    name = func._schema.name.split("::")[1].rstrip("_")
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    n = len(lists[0])
    if name == "_fused_sgd":             # one launch a group of multi_tensor_apply_for_fused_optimizer
        return multi_tensor_launches(lists[0], len([t for t in lists if t]))
    scalar = next((a for a in list(args[len(lists):]) + list(kwargs.values())
                   if isinstance(a, (int, float, torch.Tensor)) and not isinstance(a, bool)), None)
    if isinstance(scalar, torch.Tensor) and scalar.dim() == 0:          # a 0-d tensor scalar: of the lists' dtype
        fast = fast_route(lists) and scalar.dtype == lists[0][0].dtype
    elif isinstance(scalar, (int, float)):
        fast = fast_route(lists, [scalar] * n)
    else:
        fast = fast_route(lists, cross_dtype=name != "_foreach_copy")
    if name == "_foreach_norm":
        fast = fast and all(t.is_floating_point() for t in lists[0])
        return 1 + multi_tensor_launches(lists[0], 1) + 1 if fast else n      # zeros, the norms, their clean-up
    depth = len(lists) + (0 if func._schema.name.endswith("_") else 1)     # an out-of-place op writes a new list
    return multi_tensor_launches(lists[0], depth) if fast else n


class CudaLaunches(TorchDispatchMode):
    """Counts the kernels the aten operations run inside it would launch on CUDA (launches; by operation name in
    by_op): none for a view or an allocation, foreach_launches for a foreach operation, one for any other; inside a
    compiled graph's call, that graph's own kernel count (counting_graphs) instead of what it runs."""

    def __init__(self):
        super().__init__()
        self.launches, self.by_op, self.graph_calls, self.inside = 0, {}, 0, 0

    def add(self, name, n):
        self.launches += n
        self.by_op[name] = self.by_op.get(name, 0) + n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[1]
        if not self.inside:
            if name.startswith(("_foreach_", "_fused_sgd")):
                self.add(name, foreach_launches(func, args, kwargs))
            elif not (func.is_view or name in NO_KERNEL or "record_function" in name):
                self.add(name, 1)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def graphs(self):
        """While inside, a compiled graph's call counts its own kernels, not the operations it runs."""
        from torch._inductor.output_code import CompiledFxGraph
        call = CompiledFxGraph.__call__

        def counted(graph, inputs):
            counts = getattr(graph, "gpu_counts", None)
            self.graph_calls += 1
            self.add("compiled graph", counts["kernels"] if counts else 0)
            self.inside += 1
            try:
                return call(graph, inputs)
            finally:
                self.inside -= 1
        with mock.patch.object(CompiledFxGraph, "__call__", counted):
            yield self


def outside_the_mode(fn):
    """fn called with no dispatch mode on (dynamo compiles and runs nothing under one): a compiled function's graphs
    are counted by CudaLaunches.graphs."""
    from torch.utils._python_dispatch import _disable_current_modes

    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def as_cuda():
    """devices' decisions as on CUDA while inside: fused SGD and the step's helpers compiled."""
    with mock.patch.object(optim.devices, "sgd_options", lambda device: {"fused": True}), \
            mock.patch.object(optim.devices, "compiles_helpers", lambda device: True):
        yield


def recipe_steps(name, steps=21, *, backend="inductor", **changes):
    """[CudaLaunches of each of recipe `name`'s first `steps` steps], from set_lr through its optimisers and the sums
    of cifar10_fast.train_run, the gradients random, the whitening bias detached (as after its first 0.19 epochs: one
    compiled graph), the network at full width, channels_last, its weights held as on CUDA (cifar10_fast.held_weights:
    bf16 copies of float32 masters), 243 steps a run. backend: the compiled optimiser step's ("eager": its graph's
    kernels left uncounted, the rest counted in seconds)."""
    r = cf.recipe(name, **changes)
    torch.manual_seed(0)
    model = tb.build_model(r, "cpu").to(memory_format=torch.channels_last)
    fresh = copy.deepcopy(model)
    if held := cf.held_weights(r, torch.bfloat16):
        tb.hold_weights(model, held)
    masters = optim.MasterWeights.of_fresh(model, fresh)
    tb.fit_whitening(model, torch.randn(64, 3, 32, 32), 32, masters)
    bias = replace(tb.whitening_bias(model), until_step=0) if tb.whitening_bias(model) else None
    torch._dynamo.reset()
    compiled = lambda fn, _="inductor": outside_the_mode(torch.compile(fn, backend=backend, dynamic=False))
    with as_cuda(), counting_graphs(), mock.patch.object(optim, "compiled", functools.cache(compiled)):
        opts = optim.make_optimizers(model, r, steps_per_epoch=32, own_rates=[bias], masters=masters)
        sums, step_sums = torch.zeros(2), torch.zeros(2)       # step_sums: the compiled step's output
        counts = []
        for k in range(steps):
            if bias:
                bias.param.requires_grad_(k < bias.until_step)
            for p in model.parameters():
                p.grad = torch.randn_like(p) if p.requires_grad else None
            with CudaLaunches() as count, count.graphs():
                optim.set_lr(opts, max(r.lr.values) * (1 - k / 243), k)
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sums = sums + step_sums                                 # cifar10_fast.train_run's sums
            counts.append(count)
    return counts


def record_steps(steps=6):
    """{"plain", "renormalising"}: CudaLaunches of the record's last step of the first `steps` at which its Muon
    renormalises the filters and of the last at which it does not: its learning rates set, its fused SGD and its Muon
    stepping with its compiled Newton–Schulz, zero_grad; the network at full size in fp16 and channels_last, as its
    main() builds it."""
    record = record_module()
    torch.manual_seed(0)
    model = record.CifarNet().to(memory_format=torch.channels_last)
    model.reset()
    filters = [p for p in model.parameters() if len(p.shape) == 4 and p.requires_grad]
    norm_biases = [p for n, p in model.named_parameters() if "norm" in n and p.requires_grad]
    sgd = torch.optim.SGD([dict(params=[model.whiten.bias], lr=0.0573), dict(params=norm_biases, lr=0.0573),
                           dict(params=[model.head.weight], lr=0.5415)], momentum=0.825, nesterov=True, fused=True)
    muon = record.Muon(filters, lr=0.205, momentum=0.655, nesterov=True, total_train_steps=RECORD_RUN_STEPS,
                       weight_decay=1.0418e-6 * RECORD_BATCH)
    muon.param_groups[0]["momentum_buffer_dtype"] = torch.half
    torch._dynamo.reset()
    with counting_graphs(), mock.patch.object(record, "_zeropower_via_newtonschulz5",
                                              outside_the_mode(record._zeropower_via_newtonschulz5)):
        counts = {}
        for k in range(steps):
            for p in model.parameters():        # the whitening bias detached, as after its first 0.19 epochs
                p.grad = torch.randn_like(p) if p.requires_grad and p is not model.whiten.bias else None
            last = muon.last_norm_step
            with CudaLaunches() as count, count.graphs():
                for i, group in enumerate(sgd.param_groups + muon.param_groups):
                    group["lr"] = (0.0573, 0.0573, 0.5415, 0.205)[i] * (1 - k / RECORD_RUN_STEPS)
                for opt in (sgd, muon):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            counts["renormalising" if muon.last_norm_step != last else "plain"] = count
    return counts


# ---------------------------------------------------------------------------------------------------------------

def summary(graphs, step):
    """One line of the three counts."""
    fw, bw = graphs["forward"], graphs["backward"]
    fallbacks = sorted(set(fw["fallbacks"] + bw["fallbacks"]))
    return (f"launches a step outside the network's graphs {step.launches} ({step.graph_calls} compiled-graph "
            f"call(s)); kernels forward {fw['kernels']} ({fw['fused']} fused + {fw['extern']} extern), backward "
            f"{bw['kernels']} ({bw['fused']} + {bw['extern']}); fallbacks: {', '.join(fallbacks) or 'none'}")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["fast94_next"], metavar="NAME", help="the recipes to count")
    p.add_argument("--no-record", action="store_true", help="leave the record out")
    args = p.parse_args(argv)
    for name in args.recipes:
        if name not in cf.RECIPES:
            print(f"error: unknown recipe {name!r}; choose from {', '.join(cf.RECIPES)}", file=sys.stderr)
            return 2
    if not args.no_record and not RECORD.is_file():
        print(f"error: {RECORD} is missing: {RECORD_CLONE} (or --no-record)", file=sys.stderr)
        return 2
    for name in args.recipes:
        steps = recipe_steps(name)
        print(f"{name}: {summary(training_graphs(*recipe_network(name)), steps[-1])}; by step "
              f"{[s.launches for s in steps]}")
        print(f"  launches by operation: {steps[-1].by_op}")
    if not args.no_record:
        steps = record_steps()
        print(f"the record: {summary(training_graphs(*record_network()), steps['plain'])}; "
              f"{steps['renormalising'].launches} at a step that renormalises its filters")
        print(f"  launches by operation: {steps['plain'].by_op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
