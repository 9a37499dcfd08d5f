"""What predicts a GPU's speed where there is no GPU: the aten operations one ResNet-50 training step launches on the
CPU, counted by a dispatch mode (the count depends on neither the batch nor the image size: 2 images of 32 px).

  optimisers  the step of torchvision's ResNet-50 without BlurPool (as the cluster recipes train it, goyal_8k):
              forward and backward alone, then with fused SGD (what CUDA runs), LARS and RMSprop-to-SGD, each as
              optim.py has it (foreach operations) and as the per-tensor loops it replaced (kept below as references)
  blurpool    forward and backward of rn50_16ep's ResNet-50 with BlurPool as imagenet_models builds it (one zero-padded
              depthwise convolution, as FFCV's) and with the reflection-padded BlurPool it replaced (re-created below)
  cifar10_flops  the FLOPs of a run (cifar10_fast.count_flops, CIFAR-10's shapes) of the recipes with a resolution
              schedule and of the curriculum's alternatives: the steps at each side, training and the whole run

    python benchmarks/op_counts.py --out results/<machine>/op_counts.json
    python benchmarks/op_counts.py --flops --out results/<machine>/op_counts.json  # cifar10_flops alone, the rest kept

A CIFAR-10 training step's kernels, as CUDA launches them, are counted by benchmarks/step_counts.py.
"""
import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import cifar10_fast as cf  # noqa: E402
import imagenet_models  # noqa: E402
import imagenet_recipes  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402


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
                    local = (group["trust_coefficient"] * w_norm
                             / (g_norm + group["weight_decay"] * w_norm + group["eps"]))
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
    default imagenet_models.imagenet_optimizer's), counted at the second step (the first makes the optimiser's
    state)."""
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


# (recipe, its changes): the recipes that train at more than one side, and the curriculum's alternatives
SCHEDULES = [("fast94_next", {}), ("fast94_next_lowres", {}), ("fast94_lowflop", {}), ("fast94_curriculum", {}),
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
    """{"optimisers": [rows], "blurpool": [rows], "cifar10_flops": [rows]} of operation and FLOP counts."""
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
    return {"optimisers": rows, "blurpool": blur, "cifar10_flops": schedule_flops()}


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
    print_schedule_flops(result["cifar10_flops"])
    if args.out:
        import machine
        write_json(args.out, {"piece": "op_counts", **result, "command": "python benchmarks/op_counts.py",
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
