"""CIFAR-10's optimisers and the learning-rate logic both scripts share: Muon for conv filters, SGD and Muon as one
compiled step, the choice among them from a recipe's hyperparameters and the parameter groups (weight decay or none;
Myrtle's or the decoupled learning-rate units), and set_lr, which sets every group's rate from a schedule
(schedules.py) in either script. ImageNet's large-batch LARS and RMSprop-to-SGD sit with its models
(imagenet_models.py).

Papers:
  Jordan et al. 2024, Muon (github.com/KellerJordan/Muon)
"""
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import devices
from schedules import epoch_steps
from settings import knob, numbers


# ----------------------------------------------------------------------------------------------------------
# Muon: orthogonalised momentum for conv filters

MUON_COEFFS = (3.4445, -4.7750, 2.0315)      # Jordan et al. 2024; the 2-second record tuned (3.4576, -4.7391, 2.0843)


def newton_schulz(g, steps=5, coeffs=MUON_COEFFS, *, dtype=torch.bfloat16):
    """About U Vᵀ of g = U S Vᵀ (of each matrix of a batch), in dtype:  X <- aX + (bA + cA²)X,  A = XXᵀ"""
    a, b, c = coeffs
    x = g.to(dtype)
    if tall := x.shape[-2] > x.shape[-1]:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm ≤ Frobenius norm ≤ 1: inside the basin
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if tall else x).to(g.dtype)


def newton_schulz_padded(mats, steps=5, coeffs=MUON_COEFFS, dtype=torch.bfloat16):
    """newton_schulz of every matrix in one call, each zero-padded to the largest (zero rows stay zero)."""
    rows = max(len(m) for m in mats)
    cols = -(-max(m.shape[1] for m in mats) // 16) * 16  # a multiple of 16, for the tensor cores
    batch = torch.stack([F.pad(m.to(dtype), (0, cols - m.shape[1], 0, rows - len(m))) for m in mats])
    return [o[:len(m), :m.shape[1]].to(m.dtype) for o, m in zip(newton_schulz(batch, steps, coeffs, dtype=dtype), mats)]


_COMPILED = {}


def compiled(fn, backend="inductor"):
    """fn torch.compile'd once per process and backend, so every Muon of every run shares its graphs. dynamic=False:
    a graph per set of matrix shapes (a few, under dynamo's limit of 8), all met in the untimed warm-up; dynamic
    shapes would compile again inside a timed run."""
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[fn, backend]


MOMENTUM_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """Muon (Jordan et al. 2024) for the conv filters."""
    PREFIX = "muon"
    lr: float = knob(0.24, low=0, doc="at the schedule's peak")
    momentum: float = knob(0.6, low=0, high=1, doc="Muon's momentum")
    ns_steps: int = knob(3, low=0, whole=True, doc="Newton-Schulz iterations per step")
    ns_coeffs: tuple = numbers(MUON_COEFFS, doc="Newton-Schulz's a, b, c: X <- aX + bAX + cA²X, A = XXᵀ")
    renorm_every: tuple = numbers((1, 1), low=0, whole=True, doc="filters back to their norm every k steps, k growing "
                                  "from the first to the second over the run (0: never)")
    weight_decay: float = knob(0.0, low=0, doc="decoupled, per image")
    momentum_dtype: str = knob("fp32", choices=tuple(MOMENTUM_DTYPES), doc="Muon's momentum buffers' dtype")
    batched: bool = knob(False, doc="every filter bank in one Newton-Schulz call (the record)")


def momentum_step(grads, buffers, momentum, nesterov):
    """v = momentum v + g (in place), then g + momentum v (nesterov) or v"""
    torch._foreach_mul_(buffers, devices.scalar_for(buffers[0], momentum))
    torch._foreach_add_(buffers, grads)
    return torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers


def muon_step(filters, grads, buffers, lr, *, group):
    """Muon's step:  w = (w sqrt(rows) / |w| (if renorm) - lr sqrt(max(1, rows / cols)) NS(v))(1 - lr weight_decay)"""
    mats = [u.flatten(1) for u in momentum_step(grads, buffers, group["momentum"], group["nesterov"])]  # out x in k k
    ns = dict(steps=group["ns_steps"], coeffs=group["ns_coeffs"],
              dtype=devices.low_dtype(filters[0].dtype, torch.bfloat16))
    mats = newton_schulz_padded(mats, **ns) if group["batched"] else [newton_schulz(m, **ns) for m in mats]
    torch._foreach_mul_(filters, [torch.where(group["renorm"], n.reciprocal() * len(p) ** 0.5, 1.0)
                                  for n, p in zip(torch._foreach_norm(filters), filters)])
    scales = [max(1.0, len(m) / m.shape[1]) ** 0.5 for m in mats]
    for s in dict.fromkeys(scales):  # a tensor is no foreach alpha: the steps scaled first, a call per scale
        banks = [p for p, t in zip(filters, scales) if t == s]
        steps = [m.view_as(p) for p, m, t in zip(filters, mats, scales) if t == s]
        torch._foreach_add_(banks, torch._foreach_mul(steps, (-lr * s).to(steps[0].dtype)))
    if group["weight_decay"]:
        torch._foreach_mul_(filters, (1 - lr * group["weight_decay"]).to(filters[0].dtype))


def sgd_step(weights, grads, buffers, rate, *, group):
    """torch.optim.SGD's step, in its order:  w = w - rate v,  v of g + weight_decay w"""
    if group["weight_decay"]:
        grads = torch._foreach_add(grads, weights, alpha=group["weight_decay"])
    steps = momentum_step(grads, buffers, group["momentum"], group["nesterov"])
    torch._foreach_add_(weights, torch._foreach_mul(steps, -rate.to(weights[0].dtype)))


# ----------------------------------------------------------------------------------------------------------
# SGD and Muon as one compiled step

class MasterWeights(dict):
    """{copy: its float32 master} of the parameters a network holds in a lower precision (its copies, in autocast's
    dtype, which the forward reads as autocast would have cast them): what the optimiser steps, weight averaging
    averages and the whitening fit writes, the copies then taking their values. Empty where nothing is held."""

    @classmethod
    def of_fresh(cls, model, fresh):
        """The masters of model's lower-precision parameters: fresh's, the same network in float32."""
        return cls((p, q.detach()) for p, q in zip(model.parameters(), fresh.parameters()) if p.dtype != q.dtype)

    def weights(self, params):
        """params, each held one as its master."""
        return [self.get(p, p) for p in params]

    @torch.no_grad()
    def refresh(self):
        """The copies take their masters' values, rounded to their dtype."""
        if self:
            torch._foreach_copy_(list(self), list(self.values()))

    def float_copy(self, model):
        """A copy of model holding its masters' float32 values where it holds copies: what a run returns."""
        out = copy.deepcopy(model)
        for p, q in zip(model.parameters(), out.parameters()):
            if p in self:
                q.data = self[p].clone()
        return out


def sgd_muon_step(groups):
    """Each group's step (sgd_step or muon_step) at rate x unit of the float32 masters, then their copies (held)."""
    for (step, weights, buffers, rate, unit, held, settings), grads in groups:
        step(weights, [g.to(w.dtype) for g, w in zip(grads, weights)], buffers, rate * unit, group=settings)
        if held:  # as long as the group: a GPU's foreach kernel fuses it with the update
            torch._foreach_copy_(*held)


class SGDAndMuon(torch.optim.Optimizer):
    """The optimiser of a recipe with Muon (make_optimizers): its SGD groups and Muon's ("filters", muon_group)
    stepping as one function, sgd_muon_step, given each group's grads and step_parts (made once: its step and the
    step's settings, its weights, buffers, unit and rate, a 0-d tensor set_lr fills), a detached group skipped:
    compiled where Newton–Schulz is (CUDA; one graph whatever the rates, a second once the whitening bias is
    detached), eager elsewhere. Muon's clock (its steps, its last renormalisation) is the host's: whether a step
    renormalises depends on the step alone, and the device is told by a 0-d flag, filled where it changes (fill).
    masters (MasterWeights): the float32 weights it steps for the parameters the network holds in a lower precision,
    whose copies it then writes."""

    def __init__(self, groups, *, momentum, nesterov, masters=None):
        super().__init__(groups, dict(momentum=momentum, nesterov=nesterov))
        device, masters = groups[0]["params"][0].device, masters or MasterWeights()
        self.lr = torch.zeros((), dtype=devices.widest_float(device), device=device)
        self.muon_steps = self.last_renorm = 0
        self.filled = {}  # id of a 0-d tensor: the value it was last filled with
        self.function = compiled(sgd_muon_step) if devices.compiles_helpers(device) else sgd_muon_step
        for g in self.param_groups:  # its rate x unit: the schedule's x lr_unit, or its own (set_lr's group_rate) x 1
            g["rate"], g["unit"] = (self.lr, g["lr_unit"]) if g["until_step"] is None else (self.lr.new_zeros(()), 1.0)
            if muon := g["name"] == "filters":  # told by a 0-d flag whether a step renormalises
                g["renorm"] = torch.zeros((), dtype=torch.bool, device=device)
            weights, copies = masters.weights(g["params"]), [p for p in g["params"] if p in masters]
            buffers = [torch.zeros_like(w, dtype=devices.low_dtype(w.dtype, g.get("momentum_dtype"))) for w in weights]
            self.state.update((p, {"momentum": v}) for p, v in zip(g["params"], buffers))
            g["step_parts"] = (muon_step if muon else sgd_step, weights, buffers, g["rate"], g["unit"],
                               copies and [copies, masters.weights(copies)],  # held in a lower precision: written too
                               {k: g[k] for k in (MUON_STEP_SETTINGS if muon else SGD_STEP_SETTINGS)})

    def fill(self, scalar, value):
        """scalar filled with value unless it holds it."""
        if self.filled.get(id(scalar)) != value:
            scalar.fill_(value)
            self.filled[id(scalar)] = value

    @torch.no_grad()
    def step(self):
        groups = [g for g in self.param_groups if check_grads(g)]
        for g in groups:
            if g["name"] == "filters":  # Muon's clock, the host's: it renormalises every k steps, k from k0 to k1
                self.muon_steps += 1
                t, (k0, k1) = self.muon_steps, g["renorm_every"]
                if k0 and t - self.last_renorm >= k0 + (k1 - k0) * t // g["total_steps"]:
                    self.last_renorm = t
                self.fill(g["renorm"], self.last_renorm == t)
        self.function([(g["step_parts"], [p.grad for p in g["params"]]) for g in groups])


def check_grads(group):
    """Whether an SGDAndMuon group's parameters have gradients, all of them (False: none has, a detached group); a
    ValueError where only some have: one step takes the whole group."""
    have = {p.grad is not None for p in group["params"]}
    if len(have) > 1:
        raise ValueError(f"SGDAndMuon: some parameters of group {group['name']!r} have no gradient, others have one; "
                         "it steps a group whole (leave the unused ones out of it)")
    return True in have


MUON_STEP_SETTINGS = ("momentum", "nesterov", "batched", "ns_steps", "ns_coeffs", "weight_decay", "renorm")
SGD_STEP_SETTINGS = ("momentum", "nesterov", "weight_decay")


# Muon's settings in SGDAndMuon's group, and their defaults (Jordan et al. 2024's)
MUON_DEFAULTS = {"lr_unit": 1.0, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "ns_coeffs": MUON_COEFFS,
                 "renorm_every": (0, 0), "total_steps": 1, "weight_decay": 0.0, "momentum_dtype": None,
                 "batched": False}


def muon_group(filters, **settings):
    """SGDAndMuon's group of Muon for the conv filters: MUON_DEFAULTS changed by settings."""
    check_muon_settings(settings)
    return {**MUON_DEFAULTS, **settings, "params": filters, "name": "filters", "until_step": None}


def check_muon_settings(settings):
    """A TypeError naming any setting muon_group does not know."""
    unknown = set(settings) - set(MUON_DEFAULTS)
    if unknown:
        raise TypeError(f"muon_group: no setting {', '.join(sorted(unknown))}")


# Ours: torch.optim.Muon is absent from torch 2.4 (which we support), takes 2-D weights only and averages momentum
def Muon(filters, lr, **settings):  # noqa: N802 (an optimiser's name)
    """An SGDAndMuon of Muon alone (muon_group's settings) at the rate lr: the one Muon step, for a network's
    filters on their own."""
    opt = SGDAndMuon([muon_group(filters, **settings)], momentum=0.0, nesterov=False)
    opt.lr.fill_(lr)
    return opt


# ----------------------------------------------------------------------------------------------------------
# Choosing the optimisers, their parameter groups and learning-rate units

@dataclass(frozen=True, kw_only=True)
class SGDSettings:
    """Momentum SGD on the batch-summed loss (make_optimizers), in one of three units of rate and decay."""
    PREFIX = ""
    lr_units: str = knob("myrtle", choices=("myrtle", "decoupled", "sum"),
                         doc="myrtle: per image; decoupled: per 1024 images over the Nesterov gain (Jordan 2024); "
                             "sum: torch's (airbench94_muon)")
    momentum: float = knob(0.9, low=0, high=1, doc="SGD's momentum")
    nesterov: bool = knob(True, doc="Nesterov's momentum")
    weight_decay: float = knob(5e-4, low=0, doc="in --lr-units")
    bias_lr_mult: float = knob(1.0, low=0, doc="batch norm's biases learn at this times the rate")


@dataclass(frozen=True, kw_only=True, eq=False)
class OwnRate:
    """A parameter (`param`, its optimizer group `name`) that trains at a rate of its own for its first until_step
    steps and at 0 from then on (make_optimizers, group_rate):
        rate = lr x lr_mult,  or with linear: peak x lr_mult x (1 - step / until_step)"""
    name: str
    param: object
    lr_mult: float
    until_step: int
    linear: bool = False


def make_optimizers(model, r, steps_per_epoch=1, world=1, *, own_rates=(), masters=None):
    """Recipe r's optimisers: SGD, and Muon (r.muon) for the conv filters, as one SGDAndMuon (docs/cifar10.md):
        SGD's rate = lr unit mult,  unit = 1/b (myrtle), world / (1024 (1 + 1/(1 - momentum))) (decoupled), world (sum)
        its weight_decay = wd b / mult (myrtle), wd b / (peak mult) (else);  Muon's rate = lr muon.lr / peak"""
    own_rates = [o for o in own_rates if o]
    own = check_own_rates(model, own_rates)
    sgd, b, peak = r.sgd, r.batch_size // world, max(r.lr.values)
    unit = {"myrtle": 1 / b, "decoupled": world / (1024 * (1 + 1 / (1 - sgd.momentum))), "sum": world}[sgd.lr_units]
    bn_biases = {id(mod.bias) for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)}
    groups = {"weights": [], "bn_biases": [], "filters": []}
    for p in model.parameters():
        if p.requires_grad and id(p) not in own:
            groups["bn_biases" if id(p) in bn_biases else "filters" if r.muon and p.ndim == 4 else "weights"].append(p)
    parts = [(k, groups[k], mult, None, False) for k, mult in (("weights", 1.0), ("bn_biases", sgd.bias_lr_mult))]
    parts += [(o.name, [o.param], o.lr_mult, o.until_step, o.linear) for o in own_rates]
    decay = lambda mult: sgd.weight_decay * b / (mult if sgd.lr_units == "myrtle" else peak * mult)
    groups_sgd = [{"params": ps, "name": name, "lr_unit": unit * mult, "weight_decay": decay(mult), "peak": peak,
                   "until_step": until, "linear": linear} for name, ps, mult, until, linear in parts if ps]
    if not groups["filters"]:
        return [sgd_optimizer(model, r, groups_sgd, masters)]
    m, same = r.muon, ("momentum", "ns_steps", "ns_coeffs", "renorm_every", "batched")
    muon = muon_group(groups["filters"], **{k: getattr(m, k) for k in same}, lr_unit=m.lr / peak,
                      nesterov=sgd.nesterov, total_steps=max(1, epoch_steps(r.epochs, steps_per_epoch)),
                      weight_decay=m.weight_decay * b * world, momentum_dtype=MOMENTUM_DTYPES[m.momentum_dtype])
    return [SGDAndMuon(groups_sgd + [muon], momentum=sgd.momentum, nesterov=sgd.nesterov, masters=masters)]


def sgd_optimizer(model, r, groups, masters):
    """torch.optim.SGD of the groups: the optimiser of a recipe without Muon, which keeps no float32 masters."""
    if masters:
        raise ValueError(f"make_optimizers: {r.name}'s optimiser (SGD) steps its parameters themselves; it keeps no "
                         "float32 masters (steps_masters)")
    device = next(model.parameters()).device
    return torch.optim.SGD(groups, lr=0.0, momentum=r.sgd.momentum, nesterov=r.sgd.nesterov,
                           **devices.sgd_options(device))


def steps_masters(r):
    """Whether make_optimizers' optimiser for recipe r steps float32 masters of the weights a network holds in a lower
    precision: SGDAndMuon, a recipe with Muon (torch.optim.SGD updates the parameters themselves)."""
    return r.muon is not None


def check_own_rates(model, own_rates):
    """{id(parameter): its OwnRate}; a ValueError naming a parameter that trains at a rate of its own (a Whitening
    bias: its own_rate_from says how to hand it over) where own_rates leaves it out."""
    own = {id(o.param): o for o in own_rates}
    stray = next(((name, p.own_rate_from) for name, p in model.named_parameters()
                  if hasattr(p, "own_rate_from") and id(p) not in own), None)
    if stray:
        raise ValueError(f"make_optimizers: {stray[0]} trains at a rate of its own: hand it over in own_rates "
                         f"({stray[1]})")
    return own


def set_lr(opts, lr, step=0, epoch=0.0):
    """Sets each group's rate to group_rate's (SGDAndMuon's shared one to lr, its step multiplying in the unit)."""
    for opt in opts:
        if isinstance(opt, SGDAndMuon):  # its 0-d tensors filled: no recompile
            for g in opt.param_groups:
                opt.fill(g["rate"], lr if g["rate"] is opt.lr else group_rate(g, lr, step))
        else:
            set_group_rates(opt, lr, step, epoch)


def set_group_rates(opt, lr, step, epoch):
    """Each group's rate (group_rate) and clock: the coming step's epoch, which RMSprop-to-SGD's hand-over reads."""
    for g in opt.param_groups:
        g["lr"], g["epoch"] = group_rate(g, lr, step), epoch


def group_rate(g, lr, step):
    """lr × the group's unit; from until_step 0, and before it with linear its peak falling to 0."""
    until = g["until_step"]
    if until is None or (step < until and not g["linear"]):
        return lr * g["lr_unit"]
    return 0.0 if step >= until else g["peak"] * g["lr_unit"] * (1 - step / until)
