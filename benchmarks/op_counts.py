"""What predicts a GPU's speed where there is no GPU: the aten operations one ResNet-50 training step launches on the
CPU, counted by a dispatch mode (the count depends on neither the batch nor the image size: 2 images of 32 px).

  optimisers  the step of torchvision's ResNet-50 without BlurPool (as the cluster recipes train it, goyal_8k):
              forward and backward alone, then with fused SGD (what CUDA runs), LARS and RMSprop-to-SGD, each as
              optim.py has it (foreach operations) and as the per-tensor loops it replaced (kept below as references)
  blurpool    forward and backward of rn50_16ep's ResNet-50 with BlurPool as imagenet_fast builds it (one zero-padded
              depthwise convolution, as FFCV's) and with the reflection-padded BlurPool it replaced (re-created below)

    python benchmarks/op_counts.py --out results/<machine>/op_counts.json
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import imagenet_fast as inf  # noqa: E402
import optim  # noqa: E402
from core import Parser, write_json  # noqa: E402


class Count(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class LoopLARS(optim.LARS):
    """optim.LARS's step as it was, a loop over the parameters: the reference."""

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


class LoopRMSpropToSGD(optim.RMSpropToSGD):
    """optim.RMSpropToSGD's step as it was, a loop over the parameters: the reference."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            a = optim.alpha_sgd(group["epoch"], group["beta_center"], group["beta_period"])
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


class ReflectBlurPool(inf.BlurPool):
    """imagenet_fast.BlurPool as it was: reflection-padded, then an unpadded depthwise convolution."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), self.kernel.to(x.dtype), groups=x.shape[1])


def fused_sgd(model, r):
    return torch.optim.SGD(optim.param_groups_no_decay_1d(model, r.sgd.weight_decay), lr=0.1, momentum=0.9,
                           fused=True)


def loop_optimizer(model, r):
    """imagenet_fast.make_optimizer's LARS or RMSprop-to-SGD, stepping as the per-tensor loop it replaced."""
    opt = inf.make_optimizer(model, r)
    opt.__class__ = {optim.LARS: LoopLARS, optim.RMSpropToSGD: LoopRMSpropToSGD}[type(opt)]
    return opt


def step_operations(recipe, make=None, **changes):
    """(operations of forward and backward, of the whole step) of recipe's ResNet-50 with the optimiser `make` (by
    default imagenet_fast.make_optimizer's), counted at the second step (the first makes the optimiser's state)."""
    torch.manual_seed(0)
    r = inf.recipe(recipe, **changes)
    model = inf.build_model(r, 10)
    opt = (make or inf.make_optimizer)(model, r)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    for _ in range(2):
        with Count() as count:
            F.cross_entropy(model(x), y).backward()
            backward = count.n
            opt.step()
            opt.zero_grad(set_to_none=True)
    return backward, count.n


def blurpool_operations(blur=inf.BlurPool):
    """Operations of rn50_16ep's forward and backward (2 images of 32 px) with its BlurPools of class `blur`."""
    torch.manual_seed(0)
    model = inf.build_model(inf.recipe("rn50_16ep"), 10)
    for m in list(model.modules()):
        for name, child in m.named_children():
            if isinstance(child, inf.BlurPool):
                setattr(m, name, blur(child.kernel.shape[0]))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    with Count() as count:
        F.cross_entropy(model(x), y).backward()
    return count.n


def measure():
    """{"optimisers": [rows], "blurpool": [rows]} of operation counts."""
    backward, sgd = step_operations("goyal_8k", fused_sgd)
    rows = [{"step": "forward and backward alone", "ours": backward, "loop": None},
            {"step": "SGD, fused=True (what CUDA runs)", "ours": sgd, "loop": None}]
    for name, option in (("LARS", "lars"), ("RMSprop-to-SGD", "rmsprop")):
        rows.append({"step": name, "ours": step_operations("goyal_8k", **{option: True})[1],
                     "loop": step_operations("goyal_8k", loop_optimizer, **{option: True})[1]})
    blur = [{"blurpool": "zero-padded depthwise convolution (FFCV's, imagenet_fast.BlurPool)",
             "operations": blurpool_operations()},
            {"blurpool": "reflection pad, then an unpadded convolution (the one it replaced)",
             "operations": blurpool_operations(ReflectBlurPool)}]
    return {"optimisers": rows, "blurpool": blur}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    result = measure()
    for row in result["optimisers"]:
        print(f"{row['step']:34s} {row['ours']:6d}" + (f"  (as a loop: {row['loop']})" if row["loop"] else ""))
    for row in result["blurpool"]:
        print(f"BlurPool, {row['blurpool']}: {row['operations']}")
    if args.out:
        import machine
        write_json(args.out, {"piece": "op_counts", **result, "command": "python benchmarks/op_counts.py",
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
