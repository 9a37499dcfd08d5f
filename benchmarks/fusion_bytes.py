"""What Inductor keeps between fast94_next's forward and backward, and what each of its fused kernels reads and
writes, counted on the CPU at the recipe's shapes (width 1, 32 px, bf16 autocast, forward and summed loss compiled as
one graph as --compile-step does): bytes per image, which do not depend on the batch (every tensor here is the batch
times a per-image size), so a small --batch counts what batch 1,536 moves.

    python benchmarks/fusion_bytes.py                      # batch 13: the saved tensors and kernels, as compiled
    python benchmarks/fusion_bytes.py --setting inductor.realize_reads_threshold=64 \
        --setting inductor.realize_opusers_threshold=64   # Inductor's settings changed while compiling

1. The saved-for-backward tensors: AOTAutograd's partition with Inductor's own partitioner
   (min_cut_rematerialization_partition), each with the forward operation that makes it, its dtype and its bytes per
   image; their sum is what the forward writes for the backward and the backward reads again. Torch decides some:
   where the max-pool's gradient takes the pool's input (pool_gradient_takes_its_input), that input is kept too.
2. The kernels after Inductor's fusion, forward then backward (its scheduler's nodes, read through its
   _post_fusion_custom_pass hook): extern kernels (convolutions, matmuls) and fused ones, with the aten operations
   each holds and the bytes it reads and writes per image (Scheduler's own buffer sizes). The CPU's C++ backend fuses
   with the same scheduler as Triton on a GPU, but not always alike (--setting's triton.* settings change nothing
   here): the counts say what is re-read, not a GPU's kernels one for one.
"""
import argparse
import contextlib
import functools
import operator
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core import Parser  # noqa: E402
import cifar10_fast as cf  # noqa: E402
import torch_backend as tb  # noqa: E402


# Inductor realises (writes out) a pointwise result read often by thresholds that differ on a CPU: the GPU's values
# here (its _realize_*_threshold_default), so that the CPU decides what a GPU's compile would
GPU_THRESHOLDS = {("inductor", "realize_opcount_threshold"): 30, ("inductor", "realize_acc_reads_threshold"): 8}


def settings_of(texts):
    """--setting NAME=VALUE (functorch.X or inductor.X) as {(module, name): value}; ValueError in one line."""
    out = {}
    for text in texts:
        name, _, value = text.partition("=")
        module, _, key = name.partition(".")
        if module not in ("functorch", "inductor") or not key or not value:
            raise ValueError(f"--setting {text!r}: not functorch.NAME=VALUE or inductor.NAME=VALUE")
        out[(module, key)] = {"True": True, "False": False}.get(value, value)
        if isinstance(out[(module, key)], str):
            try:
                out[(module, key)] = float(value) if "." in value else int(value)
            except ValueError:
                pass
    return out


@contextlib.contextmanager
def configured(settings):
    """torch._functorch.config and torch._inductor.config with settings while inside."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    modules = {"functorch": functorch_config, "inductor": inductor_config}
    with contextlib.ExitStack() as stack:
        for (module, key), value in settings.items():
            stack.enter_context(modules[module].patch({key: value}))
        yield


def model_and_batch(batch, *, width=1.0):
    """(fast94_next as --compile-step compiles it, WithLoss, in train mode, its weights held as a GPU's run holds them;
    a batch of images and labels)."""
    r = cf.recipe("fast94_next", width=width)
    net = tb.build_model(r, "cpu").to(memory_format=torch.channels_last)
    tb.hold_weights(net, cf.held_weights(r, torch.bfloat16))
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 32, 32).to(memory_format=torch.channels_last)
    return cf.WithLoss(net, r.label_smoothing).train(), x, torch.randint(0, 10, (batch,))


def step(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[0]
    loss.backward()


def saved_tensors(batch, settings, *, width=1.0):
    """[(name, the forward operation that makes it, dtype, shape, bytes)] of the tensors the partition saves for the
    backward (the backward graph's inputs other than its incoming gradients), with Inductor's decompositions."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    import torch._inductor.lowering  # noqa: F401  (its max-pool decomposition asks the lowering whether to fall back)
    from torch._inductor.decomposition import select_decomp_table
    graphs = []
    keep = lambda gm, inputs: graphs.append(gm) or gm.forward
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    model, x, y = model_and_batch(batch, width=width)
    with configured(settings):
        step(torch.compile(model, backend=backend, dynamic=False), x, y)
    forward, backward = graphs
    made_by = {n.name: n for n in forward.graph.nodes}
    out = []
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta["val"]
        out.append((node.name, maker(made_by.get(node.name)), str(val.dtype).removeprefix("torch."),
                    tuple(val.shape), val.numel() * val.element_size()))
    return out


def pool_gradient_takes_its_input():
    """Whether Inductor's decompositions leave the max-pool's gradient as aten.max_pool2d_with_indices_backward, which
    takes the pool's input (torch 2.11), rather than a scatter-add that reads only its shape (torch 2.14)."""
    from torch._inductor.decomposition import select_decomp_table
    return torch.ops.aten.max_pool2d_with_indices_backward.default not in select_decomp_table()


def maker(node):
    """The forward operation that makes a saved tensor: its target (of a getitem, the tuple's maker and the index)."""
    if node is None or node.op == "placeholder":
        return "an input"
    if node.target is operator.getitem:
        return f"{maker(node.args[0])}[{node.args[1]}]"
    return str(node.target).removeprefix("aten.").removesuffix(".default")


def fused_kernels(batch, settings):
    """{"forward": [...], "backward": [...]}: Inductor's scheduler nodes after fusion, each (kind, the aten
    operations it holds, bytes read per image, bytes written per image)."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode
    import torch._inductor.config as inductor_config
    graphs = []

    def look(nodes):            # Inductor's post-fusion hook: the scheduler's nodes, given back unchanged
        rows = []
        for node in nodes:
            ops = sorted({str(o.target).removeprefix("aten.").removeprefix("prims.").split(".")[0]
                          for n in node.get_nodes() for o in getattr(n.node, "origins", ()) if o.op == "call_function"})
            kind = "extern" if isinstance(node, ExternKernelSchedulerNode) else "fused"
            rows.append((kind, ops, *split_bytes(node, batch, reads=True), *split_bytes(node, batch, reads=False)))
        graphs.append(rows)
        return nodes
    model, x, y = model_and_batch(batch)
    with configured(settings), inductor_config.patch({"_post_fusion_custom_pass": look, "fx_graph_cache": False,
                                                      "force_disable_caches": True}):
        step(torch.compile(model, dynamic=False), x, y)
    return {"forward": graphs[0], "backward": graphs[1]}


def split_bytes(node, batch, *, reads):
    """(bytes an image, bytes a step) that a scheduler node reads (or writes), by Inductor's own count of each
    buffer's accesses: a count the batch divides is per image (the batch is a prime that divides none of the network's
    other sizes, so weights and statistics never are; flattened buffers are still told apart), any other per step."""
    per_image = per_step = 0.0
    for nbytes in node.get_read_write_buffer_accesses(include_reads=reads, include_writes=not reads).values():
        if nbytes % batch == 0:
            per_image += nbytes / batch
        else:
            per_step += nbytes
    return per_image, per_step


RECIPE_BATCH = 1536         # fast94_next's


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=13, help="images a step (bytes per image do not depend on it): a "
                   "prime that divides none of the network's sizes (its channels and sides: 2, 3, 7, 31), as 13 or 17")
    p.add_argument("--setting", action="append", default=[], help="functorch.NAME=VALUE or inductor.NAME=VALUE, "
                   "set while compiling (repeatable)")
    p.add_argument("--saved-only", action="store_true", help="the saved tensors alone (no Inductor compile)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.batch < 11 or args.batch == 31 or any(args.batch % k == 0 for k in range(2, args.batch)):
            raise ValueError(f"--batch {args.batch}: a prime from 11 up, not 31 (13, 17, 19, ...)")
        settings = {**GPU_THRESHOLDS, **settings_of(args.setting)}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    saved = saved_tensors(args.batch, settings)
    per_image = [s for s in saved if s[3] and s[3][0] == args.batch]      # activations: the batch times an image's
    print(f"saved for the backward at batch {args.batch}: {len(per_image)} activations, "
          f"{sum(s[-1] for s in per_image) / args.batch / 1e3:.1f} kB an image; {len(saved) - len(per_image)} others "
          f"(weights' copies, statistics), {sum(s[-1] for s in saved if s not in per_image) / 1e3:.1f} kB a step")
    by_op = Counter()
    for name, what, dtype, shape, nbytes in per_image:
        by_op[(what.split("[")[0], dtype)] += nbytes / args.batch
        print(f"  {name:22s} {what:44s} {dtype:9s} {str(shape):20s} {nbytes / args.batch / 1e3:8.1f} kB an image")
    print("  by operation: " + "; ".join(f"{w} {d} {b / 1e3:.1f} kB" for (w, d), b in by_op.most_common()))
    if args.saved_only:
        return 0
    for graph, rows in fused_kernels(args.batch, settings).items():
        total = [sum(r[k] for r in rows) for k in (2, 3, 4, 5)]
        print(f"{graph}: {len(rows)} kernels ({sum(r[0] == 'extern' for r in rows)} extern); an image: "
              f"{total[0] / 1e3:.1f} kB read, {total[2] / 1e3:.1f} kB written; a step besides: {total[1] / 1e3:.1f} "
              f"kB read, {total[3] / 1e3:.1f} kB written")
        for kind in ("extern", "fused"):
            mine = [r for r in rows if r[0] == kind]
            image, step_ = sum(r[2] + r[4] for r in mine), sum(r[3] + r[5] for r in mine)
            print(f"  {kind} kernels: {image / 1e3:.1f} kB an image read and written, {step_ / 1e3:.1f} kB a step "
                  f"besides: {(RECIPE_BATCH * image + step_) / 1e9:.2f} GB a step at batch {RECIPE_BATCH}")
        for kind, ops, r_image, r_step, w_image, w_step in rows:
            print(f"  {kind:6s} an image {r_image / 1e3:7.1f} kB read {w_image / 1e3:7.1f} kB written; a step "
                  f"{r_step / 1e3:7.1f} / {w_step / 1e3:7.1f} kB  {', '.join(ops)[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
