"""The optimiser step of a Muon recipe (SGD for the rest, Muon for the conv filters), as optim.py is now and as it
was at an earlier commit, alternating in one process on the same network's shapes: the CPU time of one
step of each, their medians and ratio. Both start from the same weights and gradients; each keeps its own state.

    python benchmarks/muon_step.py --before d37da60                  # fast94_muon, 20 repetitions
    python benchmarks/muon_step.py --before d37da60 --recipe fast94_next --reps 50
"""
import copy
import inspect
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from core import Parser  # noqa: E402
import cifar10_fast as cf  # noqa: E402
import optim  # noqa: E402
import torch_backend as tb  # noqa: E402
from machine import alternating  # noqa: E402


def module_at(rev, name):
    """The module `name`.py as it was at git revision rev, imported beside today's."""
    source = subprocess.run(["git", "show", f"{rev}:{name}.py"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(f"{name}_at_{rev}")
    exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
    return module


def stepper(module, net, hp):
    # today's make_optimizers is handed the whitening bias with its rate; earlier ones its steps, or found them
    bias, takes = tb.whitening_bias(net, 10), inspect.signature(module.make_optimizers).parameters
    handed = ({"own_rates": [bias]} if "own_rates" in takes else
              {"whitening_bias": bias.param, "bias_steps": bias.until_step} if "whitening_bias" in takes else {})
    opts = module.make_optimizers(net, hp, 10, **(handed if bias else {}))
    module.set_lr(opts, 1e-9)        # every kernel runs; the weights barely move

    def step():
        for opt in opts:
            opt.step()
    return step


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision whose optim.py is 'before'")
    parser.add_argument("--recipe", default="fast94_muon")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    r = cf.recipe(args.recipe)
    torch.manual_seed(0)
    net = tb.build_model(r, torch.device("cpu"))
    twin = copy.deepcopy(net)           # (a parameter's deep copy leaves its gradient behind)
    for p, q in zip(net.parameters(), twin.parameters()):
        if p.requires_grad:
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
    steps = {"before": stepper(module_at(args.before, "optim"), net, r), "after": stepper(optim, twin, r)}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = alternating(steps, args.reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.recipe} (muon batched={r.muon.batched}), {sum(p.numel() for p in net.parameters())} parameters, "
          f"{torch.get_num_threads()} threads, {args.warmup} warm-up steps each")
    print(f"n={args.reps} alternating repetitions: median before {med['before'] * 1e3:.2f} ms, "
          f"after {med['after'] * 1e3:.2f} ms, after/before {med['after'] / med['before']:.4f}")
    print("min before {:.2f} ms, after {:.2f} ms".format(min(times["before"]) * 1e3, min(times["after"]) * 1e3))


if __name__ == "__main__":
    main()
