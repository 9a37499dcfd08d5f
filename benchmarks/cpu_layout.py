"""The CPU's memory layout for the CIFAR-10 networks: contiguous (NCHW) against channels_last (NHWC), side by side.

For each recipe, the median time of its real training step (training.train_step: forward, loss, backward, every
optimiser, at the recipe's batch size, float32) and of an evaluation forward of --eval-batch images, with the
network, its parameters and its batches in each layout (devices.memory_format picks one for a run). The layouts take
turns in each repetition, so the machine's drift falls on both; one untimed step and evaluation first. And how
exact each layout's batch norm is at the recipe's batch (batch_norm_error: a (batch, 64, 32, 32) activation, forward
and backward in float32 against float64).

    python benchmarks/cpu_layout.py --out results/<machine>/cpu_layout.json
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar10_fast as cf  # noqa: E402
import torch_backend as tb  # noqa: E402
import training as T  # noqa: E402
from core import Parser  # noqa: E402
from optim import make_optimizers, set_lr  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def setup(r, layout, *, eval_batch):
    """(one training step, one evaluation forward) of recipe r's network in layout, on fixed random batches."""
    gen = torch.Generator().manual_seed(0)
    model = tb.build_model(r, "cpu").to(memory_format=layout)
    opts = make_optimizers(model, r, own_rates=[tb.whitening_bias(model)])
    set_lr(opts, max(r.lr.values), 0)
    x = torch.randn(r.batch_size, 3, 32, 32, generator=gen).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (r.batch_size,), generator=gen)
    test = torch.randn(eval_batch, 3, 32, 32, generator=gen)

    def step():
        model.train()
        T.train_step(model, opts, x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)

    def evaluate():
        model.eval()
        with torch.no_grad():
            model(test.contiguous(memory_format=layout))
    return step, evaluate


def batch_norm_error(batch, layout, *, channels=64, size=32):
    """The largest error of training-mode batch norm's output and gradients (input, scale, shift) in float32 and
    layout against float64, each relative to the largest float64 value: max |a - b| / max |b|."""
    gen = torch.Generator().manual_seed(0)
    x, g = (torch.randn(batch, channels, size, size, generator=gen) * 2 + 0.5 for _ in range(2))
    w, b = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)

    def run(dtype, memory_format):
        leaves = [x.to(dtype).contiguous(memory_format=memory_format).requires_grad_()] + \
                 [t.to(dtype, copy=True).requires_grad_() for t in (w, b)]
        y = torch.nn.functional.batch_norm(leaves[0], None, None, leaves[1], leaves[2], True)
        y.backward(g.to(dtype).contiguous(memory_format=memory_format))
        return [y.detach().double()] + [t.grad.double() for t in leaves]
    exact = run(torch.float64, torch.contiguous_format)
    return max(((a - e).abs().max() / e.abs().max()).item() for a, e in zip(run(torch.float32, layout), exact))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name, *, repeats, eval_batch, batch_size=None):
    """(batch size, {layout: {"step": [s...], "eval": [s...]}}, {layout: batch_norm_error}) of recipe `name` (at its
    batch size unless given), the layouts taking turns."""
    r = cf.recipe(name, **({"batch_size": batch_size} if batch_size else {}))
    built = {k: setup(r, v, eval_batch=eval_batch) for k, v in LAYOUTS.items()}
    for step, evaluate in built.values():
        step(), evaluate()                            # untimed: first-call allocations and oneDNN's primitives
    seen = {k: {"step": [], "eval": []} for k in LAYOUTS}
    for _ in range(repeats):
        for k, (step, evaluate) in built.items():
            seen[k]["step"].append(timed(step))
            seen[k]["eval"].append(timed(evaluate))
    return r.batch_size, seen, {k: batch_norm_error(r.batch_size, v) for k, v in LAYOUTS.items()}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="fast94,fast94_muon,fast94_next", help="CIFAR-10 recipes, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed steps and evaluations per layout (default 5)")
    p.add_argument("--batch-size", type=int, default=None, help="training batch (default: each recipe's own)")
    p.add_argument("--eval-batch", type=int, default=1000, help="images an evaluation forward (default 1000)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch's CPU threads (default: "
                   "torch's own choice)")
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    for flag in ("repeats", "eval_batch", "threads", "batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in cf.RECIPES]
    if unknown:
        p.error(f"--recipes {args.recipes}: no recipe {', '.join(unknown)} (choose from {', '.join(cf.RECIPES)})")
    torch.set_num_threads(args.threads)
    rows, table = [], Table(["recipe", "batch", "layout", "step s", "eval s", "batch_norm_error"], width=17,
                            formats={"step s": ".3f", "eval s": ".3f", "batch_norm_error": ".1e"})
    for name in names:
        batch, seen, errors = measure(name, repeats=args.repeats, eval_batch=args.eval_batch,
                                      batch_size=args.batch_size)
        for layout, runs in seen.items():
            rows.append({"recipe": name, "batch": batch, "layout": layout, "step s": statistics.median(runs["step"]),
                         "eval s": statistics.median(runs["eval"]), "n": args.repeats,
                         "batch_norm_error": errors[layout], "runs": runs})
            table.append(rows[-1])
    if args.out:
        import machine
        write_json(args.out, {"piece": "cpu_layout", "command": "python benchmarks/cpu_layout.py " + " ".join(
            a for a in (sys.argv[1:] if argv is None else argv) if a != args.out and a != "--out").rstrip(),
            "threads": args.threads, "eval_batch": args.eval_batch,
            "fingerprint": machine.fingerprint(torch.device("cpu"), True), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
