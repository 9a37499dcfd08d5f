"""How many of a network's gradients fp16 would lose: the float32 gradients of a few training steps, counted against
fp16's smallest normal number (2^-14, below which it keeps fewer bits) and its smallest subnormal (2^-24, below
which it rounds to 0), for the gradients that flow between layers (each module's output; under fp16 autocast the
backward pass carries them in fp16) and the parameters' own (float32 in the optimiser, but computed in fp16).

CIFAR-10's recipes step on the batch's summed loss, so a logit's gradient is softmax - target, whatever the batch;
ImageNet's (imagenet_fast.accumulated_step) on the mean, every gradient smaller by the batch: the "mean" columns
count the same gradients divided by --mean-batch (512: rn50_16ep's per GPU). On the CPU, in float32, no autocast.

    python benchmarks/fp16_gradients.py --data /work/cifar10.npz --recipe fast94 --batch-size 128 --steps 0,10,40
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar10_fast as cf  # noqa: E402
import cifar_data as cd  # noqa: E402
import torch_backend as tb  # noqa: E402
from core import DataError, Parser, UsageError  # noqa: E402
from optim import make_optimizers, set_lr  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from schedules import run_steps  # noqa: E402

NORMAL, SUBNORMAL = 2.0 ** -14, 2.0 ** -24
OUTPUTS = []        # the module outputs of the step being counted, in the order the forward pass made them


def keep_output(module, inputs, output):
    """A forward hook: keeps each leaf module's output that backward passes a gradient through."""
    if isinstance(output, torch.Tensor) and output.requires_grad:
        OUTPUTS.append(output)


def below(grads, scale=1.0):
    """The shares of a list of gradient tensors (each x scale) below 2^-14 and below 2^-24: of their non-zero
    elements, and of their summed magnitude (what the step loses if they are lost)."""
    g = torch.cat([t.detach().abs().flatten() for t in grads]).double() * scale
    g = g[g > 0]
    return {"n": len(g), "<2^-14": (g < NORMAL).double().mean().item(),
            "<2^-24": (g < SUBNORMAL).double().mean().item(),
            "mass <2^-24": (g * (g < SUBNORMAL)).sum().item() / g.sum().item()}


def counted(step, outputs, params, *, mean_batch):
    """A table row of a step's gradients (below's shares): for the layers' outputs and the parameters, of the summed
    loss and of the mean loss at mean_batch."""
    row = {"step": step}
    for name, grads in (("out", outputs), ("param", params)):
        row.update({f"{name} {k}": v for k, v in below(grads).items()})
        row.update({f"{name} mean {k}": v for k, v in below(grads, 1 / mean_batch).items() if k != "n"})
    return row


SHARES = ("n", "<2^-14", "<2^-24", "mass <2^-24", "mean <2^-14", "mean <2^-24", "mean mass <2^-24")
COLUMNS = ["step"] + [f"{name} {k}" for name in ("out", "param") for k in SHARES]


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="CIFAR-10 as one .npz (cifar_data.read_npz)")
    p.add_argument("--recipe", default="fast94")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", default="0,10,40", help="the steps whose gradients are counted, comma-separated")
    p.add_argument("--mean-batch", type=int, default=512, help="the batch of the mean loss's columns (default 512)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        steps = sorted(int(s) for s in args.steps.split(","))
    except ValueError:
        p.error(f"--steps {args.steps}: must be whole numbers, comma-separated")
    for flag, value, bad in (("steps", args.steps, min(steps) < 0),
                             ("batch-size", args.batch_size, args.batch_size < 1),
                             ("mean-batch", args.mean_batch, args.mean_batch < 1)):
        if bad:
            p.error(f"--{flag} {value}: must be {'positive' if flag != 'steps' else 'at least 0'}")
    torch.manual_seed(0)
    try:
        r, arrays = cf.recipe(args.recipe), cd.read_npz(args.data)
    except (DataError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    data = cd.dataset_on_device(arrays, "cpu", dtype=torch.float32, pad=r.augment.crop_pad,
                        stats=cd.channel_stats(arrays["train_images"]))
    model = tb.build_model(r, "cpu", num_classes=10)
    tb.fit_whitening(model, data["train_images"], data["test_images"].shape[-2:])
    per_epoch, total = run_steps(len(data["train_labels"]), args.batch_size, r.epochs)
    bias = tb.whitening_bias(model, per_epoch)
    opts = make_optimizers(model, r, per_epoch, 1, own_rates=[bias])
    params = [q for q in model.parameters() if q.requires_grad]
    leaves = [m for m in model.modules() if not list(m.children())]
    table = Table(COLUMNS, width=24, formats={c: ".3e" for c in COLUMNS})
    gen = torch.Generator().manual_seed(0)
    print(f"{args.recipe} on the CPU in float32, batch {args.batch_size}, summed loss (mean: / {args.mean_batch}); "
          "shares of the non-zero gradients (mass: of their summed magnitude)", flush=True)
    step = 0
    flip_base = cd.flip_bits(len(data["train_labels"]), gen) if r.augment.flip == "alternate" else None
    for x, y in cd.epoch_batches(data, r.augment, gen, batch_size=args.batch_size, flip_base=flip_base):
        hooks = [m.register_forward_hook(keep_output) for m in leaves] if step in steps else []
        set_lr(opts, r.lr.at(step / total), step)
        loss = F.cross_entropy(model(x).float(), y, label_smoothing=r.label_smoothing, reduction="sum")
        grads = torch.autograd.grad(loss, OUTPUTS + params)
        for q, g in zip(params, grads[len(OUTPUTS):]):
            q.grad = g
        if hooks:
            table.append(counted(step, grads[:len(OUTPUTS)], grads[len(OUTPUTS):], mean_batch=args.mean_batch))
            for h in hooks:
                h.remove()
            OUTPUTS.clear()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        if step > steps[-1]:
            break
    if args.out:
        write_json(args.out, {"piece": "fp16_gradients", "argv": sys.argv[1:] if argv is None else list(argv),
                              "recipe": args.recipe, "batch_size": args.batch_size, "mean_batch": args.mean_batch,
                              "rows": table.rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
