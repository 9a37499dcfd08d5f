"""What predicts a GPU's speed where there is no GPU: the aten operations one ResNet-50 training step launches on the
CPU, counted by a dispatch mode (the count depends on neither the batch nor the image size: 2 images of 32 px).

  optimisers  the step of torchvision's ResNet-50 without BlurPool (as the cluster recipes train it, goyal_8k):
              forward and backward alone, then with fused SGD (what CUDA runs), LARS and RMSprop-to-SGD, each as
              optim.py has it (foreach operations) and as the per-tensor loops it replaced (kept below as references)
  blurpool    forward and backward of rn50_16ep's ResNet-50 with BlurPool as imagenet_models builds it (one zero-padded
              depthwise convolution, as FFCV's) and with the reflection-padded BlurPool it replaced (re-created below)
  cifar10     one opt.step() of each CIFAR-10 optimiser of fast94, fast94_muon and fast94_next (full width): SGD as
              the CPU runs it and fused (as CUDA runs it), Muon eager as a loop over the filter banks and as foreach
              operations (--muon-foreach), and the Newton–Schulz share of Muon's (compiled on CUDA)
  cifar10_flops  the FLOPs of a run (cifar10_fast.count_flops, CIFAR-10's shapes) of the recipes with a resolution
              schedule and of the curriculum's alternatives: the steps at each side, training and the whole run

    python benchmarks/op_counts.py --out results/<machine>/op_counts.json
    python benchmarks/op_counts.py --flops --out results/<machine>/op_counts.json    # cifar10_flops alone, the rest kept
"""
import argparse
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import cifar10_fast as cf  # noqa: E402
import imagenet_models  # noqa: E402
import imagenet_recipes  # noqa: E402
import optim  # noqa: E402
import torch_backend as tb  # noqa: E402
from core import Parser, write_json  # noqa: E402


class Count(TorchDispatchMode):
    """Counts the aten operations run inside it (n), and those of them that launch a kernel on a GPU (launches: not
    views of their inputs, nor the profiler's markers)."""

    def __init__(self):
        super().__init__()
        self.n = self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.launches += not (func.is_view or "record_function" in func.__name__)
        return func(*args, **(kwargs or {}))


class LoopLARS(imagenet_models.LARS):
    """imagenet_models.LARS's step as it was, a loop over the parameters: the reference."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.ndim > 1:
                    w_norm, g_norm = p.norm(), g.norm()
                    local = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])
                    local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
                    g = (g + group["weight_decay"] * p) * local
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                v = state["momentum_buffer"]
                v.mul_(group["momentum"]).add_(g, alpha=group["lr"])
                p.sub_(v)


class LoopRMSpropToSGD(imagenet_models.RMSpropToSGD):
    """imagenet_models.RMSpropToSGD's step as it was, a loop over the parameters: the reference."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            a = imagenet_models.alpha_sgd(group["epoch"], group["beta_center"], group["beta_period"])
            sgd, rms = group["lr"] * a, group["lr_rmsprop"] * (1 - a)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                state = self.state[p]
                if not state:
                    state["square_avg"], state["momentum_buffer"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["square_avg"], state["momentum_buffer"]
                m.mul_(group["rms_decay"]).addcmul_(g, g, value=1 - group["rms_decay"])
                v.mul_(group["momentum"]).add_(g * (sgd + rms / (m.sqrt() + group["eps"])))
                p.sub_(v)


class ReflectBlurPool(imagenet_models.BlurPool):
    """imagenet_models.BlurPool as it was: reflection-padded, then an unpadded depthwise convolution."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), self.kernel.to(x.dtype), groups=x.shape[1])


def fused_sgd(model, r):
    return torch.optim.SGD(imagenet_models.param_groups_no_decay_1d(model, r.sgd.weight_decay), lr=0.1, momentum=0.9,
                           fused=True)


def loop_optimizer(model, r):
    """imagenet_models.imagenet_optimizer's LARS or RMSprop-to-SGD, stepping as the per-tensor loop it replaced."""
    opt = imagenet_models.imagenet_optimizer(model, r)
    opt.__class__ = {imagenet_models.LARS: LoopLARS, imagenet_models.RMSpropToSGD: LoopRMSpropToSGD}[type(opt)]
    return opt


def step_operations(recipe, make=None, **changes):
    """(operations of forward and backward, of the whole step) of recipe's ResNet-50 with the optimiser `make` (by
    default imagenet_models.imagenet_optimizer's), counted at the second step (the first makes the optimiser's state)."""
    torch.manual_seed(0)
    r = imagenet_recipes.recipe(recipe, **changes)
    model = imagenet_models.imagenet_network(r, 10)
    opt = (make or imagenet_models.imagenet_optimizer)(model, r)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    for _ in range(2):
        with Count() as count:
            F.cross_entropy(model(x), y).backward()
            backward = count.n
            opt.step()
            opt.zero_grad(set_to_none=True)
    return backward, count.n


def blurpool_operations(blur=imagenet_models.BlurPool):
    """Operations of rn50_16ep's forward and backward (2 images of 32 px) with its BlurPools of class `blur`."""
    torch.manual_seed(0)
    model = imagenet_models.imagenet_network(imagenet_recipes.recipe("rn50_16ep"), 10)
    for m in list(model.modules()):
        for name, child in m.named_children():
            if isinstance(child, imagenet_models.BlurPool):
                setattr(m, name, blur(child.kernel.shape[0]))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    with Count() as count:
        F.cross_entropy(model(x), y).backward()
    return count.n


def counted(fn, counts):
    """fn, appending the Count of each call to `counts`."""
    def call(*args, **kwargs):
        with Count() as count:
            out = fn(*args, **kwargs)
        counts.append(count)
        return out
    return call


CIFAR_RECIPES = ("fast94", "fast94_muon", "fast94_next")


def cifar_step_operations(name, *, fused, step=3, **changes):
    """{"sgd", "muon", "newton_schulz"} and each's "_launches": the aten operations of recipe `name`'s opt.step() at
    `step` (its state made at the first; fast94_next renormalises at the second, not the third), random gradients,
    SGD fused (as on CUDA) or not (the CPU's), Muon eager with its Newton–Schulz share (compiled on CUDA)."""
    r = cf.recipe(name, **changes)
    torch.manual_seed(0)
    model = tb.build_model(r, "cpu")
    tb.fit_whitening(model, torch.randn(64, 3, 32, 32), 32)
    with mock.patch.object(optim.devices, "sgd_options", lambda device: {"fused": True} if fused else {}):
        opts = optim.make_optimizers(model, r, steps_per_epoch=32,
                                     own_rates=[replace(tb.whitening_bias(model), until_step=step)])
    ns = []
    for k in range(step):
        optim.set_lr(opts, max(r.lr.values), k)
        for p in model.parameters():
            p.grad = torch.randn_like(p) if p.requires_grad else None
        ns.clear()
        counts = []
        batched = "newton_schulz_padded" if r.muon and r.muon.batched else "newton_schulz"
        with mock.patch.object(optim, batched, counted(getattr(optim, batched), ns)):
            for opt in opts:
                with Count() as count:
                    opt.step()
                counts.append(count)
    muon = counts[1] if len(counts) > 1 else None
    return {"sgd": counts[0].n, "sgd_launches": counts[0].launches, "muon": muon and muon.n,
            "muon_launches": muon and muon.launches, "newton_schulz": muon and sum(c.n for c in ns),
            "newton_schulz_launches": muon and sum(c.launches for c in ns)}


def compiled_kernels(step):
    """{"graph_calls", "kernels", "library_calls", "outside", "outside_launches", "guard_reads"}: what one call of step
    runs, seen by torch.profiler with Inductor's CPU kernels recorded (compile first, inside kernel_profile()): the
    torch.compile'd graphs called, the kernels they run (Inductor's own; library calls: matmuls and fallbacks), the
    aten operations run outside them (of which launches: not views) and those of dynamo's guards (reads of 0-d float64
    CPU tensors, which it treats as numbers; a CUDA tensor it does not read)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = dict.fromkeys(("graph_calls", "kernels", "library_calls", "outside", "outside_launches", "guard_reads"), 0)
    for e in prof.events():
        parents = []
        parent = e.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        in_graph = parents and parents[0].startswith("## Call CompiledFxGraph")
        if e.name.startswith("## Call CompiledFxGraph"):
            counts["graph_calls"] += 1
        elif in_graph:
            counts["kernels" if "cpp_fused" in e.name else "library_calls"] += 1
        elif e.name.startswith("aten::") and not any(n.startswith(("aten::", "## Call")) for n in parents):
            guard = "TorchDynamo Cache Lookup" in parents
            counts["guard_reads" if guard else "outside"] += 1
            op = getattr(torch.ops.aten, e.name[6:])
            counts["outside_launches"] += not guard and not any(getattr(op, o).is_view for o in op.overloads())
    return counts


def kernel_profile():
    """Inductor's generated CPU kernels recorded by torch.profiler (set while a graph compiles)."""
    import torch._inductor.config
    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def one_step_operations(name, *, one_step, step=3, **changes):
    """compiled_kernels of recipe name's optimisers' step at `step` (as cifar_step_operations) compiled by Inductor on
    this CPU as on CUDA: with one_step, SGDAndMuon's one function (--compile-optimizer); without, fused SGD beside Muon
    with its Newton–Schulz compiled. Also "set_lr": the aten operations of set_lr (its fills)."""
    torch._dynamo.reset()
    r = cf.recipe(name, compile_optimizer=one_step, **changes)
    torch.manual_seed(0)
    model = tb.build_model(r, "cpu")
    with mock.patch.object(optim.devices, "sgd_options", lambda device: {"fused": True}), \
            mock.patch.object(optim.devices, "compiles_helpers", lambda device: True):
        opts = optim.make_optimizers(model, r, steps_per_epoch=32,
                                     own_rates=[replace(tb.whitening_bias(model), until_step=step)])
    with kernel_profile(), mock.patch.object(optim.devices, "compiles_helpers", lambda device: True):
        for k in range(step):
            set_lr = lambda: optim.set_lr(opts, max(r.lr.values) * (1 - k / 10), k)
            counts = {"set_lr": compiled_kernels(set_lr)["outside"]}
            for p in model.parameters():
                p.grad = torch.randn_like(p) if p.requires_grad else None
            counts.update(compiled_kernels(lambda: [opt.step() for opt in opts]))
    return counts


# (recipe, its changes): the recipes that train at more than one side, and the curriculum's alternatives
SCHEDULES = [("fast94_next", {}), ("fast94_next_lowres", {}), ("fast94_fastest", {}), ("fast94_curriculum", {}),
             ("fast94_curriculum", {"epochs": 7.89}), ("fast94_curriculum", {"epochs": 8.5}),
             ("fast94_curriculum", {"resolution_schedule": (24, 24, 28, 28)}),
             ("fast94_curriculum", {"resolution_schedule": (24, 24, 24, 28, 28, 28, 32, 32, 32), "epochs": 8.875})]


def schedule_flops():
    """[{"recipe", "changes", "epochs", "steps_at_side", "train", "total"}] of SCHEDULES: cifar10_fast.count_flops
    at full size on CIFAR-10's shapes (as benchmarks/suite.py counts them)."""
    from schedules import run_steps
    from suite import counted_flops
    rows = []
    for name, changes in SCHEDULES:
        r = cf.recipe(name, **changes)
        per_epoch, steps = run_steps(50000, r.batch_size, r.epochs)
        sides = [r.augment.resolution(step // per_epoch, 32) for step in range(steps)]
        with mock.patch.object(cf, "recipe", lambda _, r=r: r):
            f = counted_flops([name])[name]
        rows.append({"recipe": name, "changes": {k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()},
                     "epochs": r.epochs, "resolution_schedule": list(r.augment.resolution_schedule),
                     "steps_at_side": {str(side): sides.count(side) for side in dict.fromkeys(sides)},
                     "train": f["train"], "total": f["total"]})
    return rows


def measure():
    """{"optimisers": [rows], "blurpool": [rows], "cifar10": [rows], "cifar10_one_step": [rows]} of operation
    counts."""
    backward, sgd = step_operations("goyal_8k", fused_sgd)
    rows = [{"step": "forward and backward alone", "ours": backward, "loop": None},
            {"step": "SGD, fused=True (what CUDA runs)", "ours": sgd, "loop": None}]
    for name, option in (("LARS", "lars"), ("RMSprop-to-SGD", "rmsprop")):
        rows.append({"step": name, "ours": step_operations("goyal_8k", **{option: True})[1],
                     "loop": step_operations("goyal_8k", loop_optimizer, **{option: True})[1]})
    blur = [{"blurpool": "zero-padded depthwise convolution (FFCV's, imagenet_models.BlurPool)",
             "operations": blurpool_operations()},
            {"blurpool": "reflection pad, then an unpadded convolution (the one it replaced)",
             "operations": blurpool_operations(ReflectBlurPool)}]
    cifar = [{"recipe": name, "fused_sgd": fused, "muon_foreach": False,
              **cifar_step_operations(name, fused=fused, **({"muon_foreach": False} if name != "fast94" else {}))}
             for name in CIFAR_RECIPES for fused in (False, True)]
    cifar += [{"recipe": name, "fused_sgd": True, "muon_foreach": True,
               **cifar_step_operations(name, fused=True, muon_foreach=True)} for name in CIFAR_RECIPES[1:]]
    one_step = [{"recipe": "fast94_next", "one_step": one, **one_step_operations("fast94_next", one_step=one)}
                for one in (False, True)]
    return {"optimisers": rows, "blurpool": blur, "cifar10": cifar, "cifar10_one_step": one_step,
            "cifar10_flops": schedule_flops()}


def print_schedule_flops(rows):
    print("FLOPs of a CIFAR-10 run at each resolution schedule (cifar10_fast.count_flops): steps at each side, "
          "training and whole-run PFLOP")
    for row in rows:
        changes = " ".join(f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                           for k, v in row["changes"].items())
        print(f"{row['recipe']} {changes}".ljust(72) + f" {row['steps_at_side']}  {row['train'] / 1e15:.4f}  "
              f"{row['total'] / 1e15:.4f}")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    p.add_argument("--flops", action="store_true", help="count the resolution schedules' FLOPs alone (cifar10_flops), "
                                                        "into --out's file with the rest of it kept")
    args = p.parse_args(argv)
    if args.flops:
        rows = schedule_flops()
        print_schedule_flops(rows)
        if args.out:
            import json
            kept = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {"piece": "op_counts"}
            write_json(args.out, {**kept, "cifar10_flops": rows})
        return 0
    result = measure()
    for row in result["optimisers"]:
        print(f"{row['step']:34s} {row['ours']:6d}" + (f"  (as a loop: {row['loop']})" if row["loop"] else ""))
    for row in result["blurpool"]:
        print(f"BlurPool, {row['blurpool']}: {row['operations']}")
    print("one opt.step() of each CIFAR-10 optimiser: aten operations (of which kernel launches)")
    for row in result["cifar10"]:
        print(f"{row['recipe']:12s} SGD{' fused' if row['fused_sgd'] else ''} {row['sgd']} ({row['sgd_launches']})"
              + (f"; Muon{' foreach' if row['muon_foreach'] else ''} {row['muon']} ({row['muon_launches']}), "
                 f"Newton–Schulz {row['newton_schulz']} ({row['newton_schulz_launches']}) of them"
                 if row["muon"] else ""))
    print("one step of fast94_next's optimisers, compiled by Inductor on this CPU as on CUDA: operations outside "
          "compiled graphs (of which kernel launches); compiled-graph calls and the kernels they run")
    for row in result["cifar10_one_step"]:
        print(f"{'SGD and Muon as one step' if row['one_step'] else 'fused SGD, Muon, Newton–Schulz compiled':40s} "
              f"set_lr {row['set_lr']}; step {row['outside']} ({row['outside_launches']}) outside, "
              f"{row['graph_calls']} graph call(s): {row['kernels']} Inductor kernels + {row['library_calls']} library "
              f"calls; {row['guard_reads']} guard reads")
    print_schedule_flops(result["cifar10_flops"])
    if args.out:
        import machine
        write_json(args.out, {"piece": "op_counts", **result, "command": "python benchmarks/op_counts.py",
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
