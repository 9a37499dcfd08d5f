"""The optimisers and the learning-rate logic they share: Muon for conv filters, the large-batch LARS and
RMSprop-to-SGD, the choice among them from a recipe's hyperparameters, the parameter groups (weight decay
or none; Myrtle's or the decoupled learning-rate units) and the learning-rate and batch-size schedules.

Papers:
  Jordan et al. 2024, Muon (github.com/KellerJordan/Muon)
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677)
  You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks" (LARS, arXiv:1708.03888)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (Preferred Networks, arXiv:1711.04325)
  Mikami et al. 2018, "ImageNet/ResNet-50 Training in 224 Seconds" (Sony, batch-size control, arXiv:1811.05233)
"""
import math

import torch
from torch import nn

from distributed import per_rank_batch


# ----------------------------------------------------------------------------------------------------------
# Muon: orthogonalised momentum for conv filters

def newton_schulz(g, steps=5, eps=1e-7):
    """Approximately the orthogonal factor U Vᵀ of g = U S Vᵀ (all singular values pushed towards 1),
    by a quintic Newton–Schulz iteration in bf16. The coefficients (Jordan et al. 2024, Muon) trade
    exactness for speed: five steps leave singular values roughly in [0.7, 1.2]."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)                     # spectral norm ≤ Frobenius norm ≤ 1: inside the basin
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


# Ours: torch.optim.Muon is absent from torch 2.4 (which we support), takes 2-D weights only and averages momentum
class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024): SGD momentum whose update for each weight matrix (a conv filter
    bank flattened to out × in·k·k) is orthogonalised by newton_schulz, so every direction of the
    update moves at the same rate. Scaled by sqrt(max(1, rows/cols)) as in the original."""

    def __init__(self, params, lr, momentum=0.9, nesterov=True, ns_steps=5):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p.grad))
                buf.mul_(group["momentum"]).add_(p.grad)
                g = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                g = g.reshape(len(g), -1)
                update = newton_schulz(g, group["ns_steps"]) * max(1.0, g.shape[0] / g.shape[1]) ** 0.5
                p.add_(update.view_as(p), alpha=-group["lr"])


# ----------------------------------------------------------------------------------------------------------
# The large-batch optimisers

def _closure_loss(closure):
    """The loss of an optimizer's closure (torch.optim's step(closure) protocol), with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# Ours, not timm's Lars: as in You et al., lr goes inside the momentum and 1-D tensors are never adapted (timm: by group)
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
    Both pieces meet at c with value 1/2 and slope 1/p, as ELU's do at 0. This is our reading of the paper's
    description, not yet checked against its text (arXiv:1711.04325 sec. 3.1).
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
        v = mu1 * v + (lr * a + lr_rmsprop * (1 - a) / (sqrt(m) + eps)) * g
        w = w - v
    which is the paper's  d = mu1 * d - (a_SGD + a_RMSprop / (sqrt(m) + eps)) * g,  w = w + lr * d  with
    a_SGD = a and a_RMSprop = (1 - a) * lr_rmsprop / lr, written so that each step's rates go into the buffer
    with it: when the schedule changes lr, what is already in v keeps the rates it was added with (rescaling
    it by lr_new / lr_old would, during a warm-up from a small lr, multiply every past RMSprop step). The
    RMSprop part has its own rate lr_rmsprop because RMSprop's steps are about lr in size per element,
    whatever the gradient's scale, and the scaled SGD rate (e.g. 0.1 * 32K / 256 = 12.8) would be far too
    large for it. `epoch` is the training loop's clock, set in each parameter group before every step as a
    fractional epoch (set_lr does it), so the hand-over stays on time when the batch size, and with it the
    number of steps per epoch, changes during training. Defaults mu1 = 0.9, mu2 = 0.99, eps = 1e-8,
    beta_center = 10, beta_period = 5 are our choices, not numbers taken from the paper.
    """

    def __init__(self, params, lr, lr_rmsprop=1e-3, momentum=0.9, rms_decay=0.99, eps=1e-8, weight_decay=0.0,
                 beta_center=10.0, beta_period=5.0):
        super().__init__(params, dict(lr=lr, lr_rmsprop=lr_rmsprop, momentum=momentum, rms_decay=rms_decay, eps=eps,
                                      weight_decay=weight_decay, beta_center=beta_center, beta_period=beta_period,
                                      epoch=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            a = alpha_sgd(group["epoch"], group["beta_center"], group["beta_period"])
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
        return loss


# ----------------------------------------------------------------------------------------------------------
# Choosing the optimisers, their parameter groups and learning-rate units

def optimizer(groups, hp):
    """hp["optimizer"] over the parameter groups, at lr 0 until the schedule sets it: momentum SGD ("sgd"),
    LARS ("lars", trust coefficient lars_trust) or RMSprop-to-SGD ("rmsprop_sgd": rms_lr, and rms_beta_center
    and rms_beta_period in epochs of the training loop's clock)."""
    name, m = hp["optimizer"], hp["momentum"]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=m, nesterov=hp["nesterov"])
    if name == "lars":
        return LARS(groups, lr=0.0, momentum=m, trust_coefficient=hp["lars_trust"])
    if name == "rmsprop_sgd":
        return RMSpropToSGD(groups, lr=0.0, lr_rmsprop=hp["rms_lr"], momentum=m, beta_center=hp["rms_beta_center"],
                            beta_period=hp["rms_beta_period"])
    raise ValueError(f"unknown optimizer {name!r}; choose from sgd, lars, rmsprop_sgd")


def param_groups_no_decay_1d(model, weight_decay):
    """Two optimizer groups: weight decay for weight matrices and kernels, none for 1-D tensors (BN, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [dict(params=[p for p in params if p.ndim > 1], weight_decay=weight_decay),
            dict(params=[p for p in params if p.ndim <= 1], weight_decay=0.0)]


def make_optimizers(model, hp, world=1):
    """The optimisers for one run; set_lr() then sets every group's step size from the schedule.

    Two parametrisations of lr and weight decay (wd), both on the batch-summed loss:
    - "myrtle" (Myrtle 2018): step size lr/batch_size and decay wd·batch_size, which together equal
      plain SGD on the batch-mean loss with (lr, wd).
    - "decoupled" (Jordan 2024): lr and wd are per 1024 examples and divided by the Nesterov gain
      1 + 1/(1 - momentum), so the average step does not change with momentum; the decay per step is
      wd·batch_size/(1024·gain) × the schedule's factor, whatever lr and bias_lr_mult are, so lr,
      wd and momentum can be tuned one at a time.
    Batch-norm biases get lr × bias_lr_mult: with frozen scales they are the only per-channel knobs.
    With optimizer="muon", conv filter banks (4-D weights) use Muon at muon_lr × the schedule factor.
    The bias of the whitening layer (a convolution whose filters are frozen) trains only for the first
    whiten_bias_epochs (its lr is then set to 0 rather than requires_grad flipped, which would make a
    compiled model recompile mid-run).
    optimizer="lars" or "rmsprop_sgd" use the large-batch optimisers on the same groups.

    Under DDP (world ranks of batch_size images each) gradients are averaged over ranks, i.e. 1/world of
    the summed loss's gradient over the global batch. In the myrtle units 1/batch_size = world/global
    batch absorbs this; in the decoupled units the step is multiplied by world to undo it.
    """
    bs, m, wd, peak = hp["batch_size"], hp["momentum"], hp["weight_decay"], max(hp["lr_values"])
    if hp["param"] == "myrtle":
        unit, decay = 1 / bs, lambda scale: wd * bs / scale
    elif hp["param"] == "decoupled":
        gain = 1 + 1 / (1 - m)
        unit, decay = world / (1024 * gain), lambda scale: wd * bs / (peak * scale)
    else:
        raise ValueError(f"param must be myrtle or decoupled, not {hp['param']!r}")
    if hp["optimizer"] == "lars":
        unit = 1.0      # LARS divides by the gradient's norm: its step is lr × trust × |w|, whatever the loss's scale
    bn_biases = {id(mod.bias) for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)}
    whiten_biases = {id(mod.bias) for mod in model.modules()
                     if isinstance(mod, nn.Conv2d) and mod.bias is not None and not mod.weight.requires_grad}
    muon = hp["optimizer"] == "muon"
    groups = {"weights": [], "bn_biases": [], "whiten_bias": [], "filters": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        key = ("bn_biases" if id(p) in bn_biases else "whiten_bias" if id(p) in whiten_biases
               else "filters" if muon and p.ndim == 4 else "weights")
        groups[key].append(p)
    scales = {"weights": 1.0, "bn_biases": hp["bias_lr_mult"], "whiten_bias": 1.0}
    sgd = [{"params": groups[k], "lr_unit": unit * scales[k], "weight_decay": decay(scales[k]), "name": k,
            "until_epoch": hp["whiten_bias_epochs"] if k == "whiten_bias" else None}
           for k in scales if groups[k]]
    opts = [optimizer(sgd, {**hp, "optimizer": "sgd"} if muon else hp)]
    if groups["filters"]:
        opts.append(Muon([{"params": groups["filters"], "lr_unit": hp["muon_lr"] / peak, "name": "filters",
                           "until_epoch": None}], lr=0.0, momentum=hp["muon_momentum"], nesterov=hp["nesterov"]))
    return opts


def set_lr(opts, lr, epoch=0.0):
    """Sets each group's step size to lr (the schedule's value, in the recipe's units) × its unit, and its
    clock to the (fractional) epoch of the coming step, which RMSprop-to-SGD's hand-over follows."""
    for opt in opts:
        for g in opt.param_groups:
            frozen = g["until_epoch"] is not None and epoch >= g["until_epoch"]
            g["lr"], g["epoch"] = 0.0 if frozen else lr * g["lr_unit"], epoch


# ----------------------------------------------------------------------------------------------------------
# Learning-rate and batch-size schedules

def linear_scaled_lr(base_lr, global_batch, base_batch=256):
    """Goyal et al. 2017, linear scaling rule: multiply the learning rate by k when the batch grows k times."""
    return base_lr * global_batch / base_batch


# Akiba et al. 2017's 90 epochs: (from epoch, fraction of the peak rate)
SLOW_START = ((0, 0.5), (40, 0.075), (70, 0.01), (85, 0.001))


def slow_start_lr(epoch, peak_lr, epochs=90):
    """The slow-start schedule of Akiba et al. 2017 (sec. 3.2, their 90-epoch run), stretched to `epochs`:
    0.5 × peak for the first 40/90 of training, while the RMSprop warm-up hands over to SGD, then 0.075 ×
    peak to 70/90, 0.01 × to 85/90 and 0.001 × to the end."""
    at = epoch * 90 / epochs
    return peak_lr * [factor for start, factor in SLOW_START if start <= at][-1]


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
