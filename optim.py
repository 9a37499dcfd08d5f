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


def newton_schulz(g, steps=5, coeffs=MUON_COEFFS, *, eps=1e-7, dtype=torch.bfloat16):
    """Approximately the orthogonal factor U Vᵀ of g = U S Vᵀ, or of each matrix of a batch (..., m, n), by a quintic
    Newton–Schulz iteration in `dtype` (Jordan et al. 2024: five steps leave singular values roughly in [0.7, 1.2]).
    Zero rows and columns stay zero, so a zero-padded matrix gives the padded result."""
    a, b, c = coeffs
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)    # spectral norm ≤ Frobenius norm ≤ 1: inside the basin
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if tall else x).to(g.dtype)


def newton_schulz_padded(mats, steps=5, coeffs=MUON_COEFFS, dtype=torch.bfloat16):
    """newton_schulz of every matrix in `mats` in one batched call: each is zero-padded to the largest row and
    column counts (columns rounded up to a multiple of 16, for the tensor cores) and cut back out after. One
    set of kernels for all the filter banks of a network instead of a set per bank (the 2-second record)."""
    rows = max(m.shape[0] for m in mats)
    cols = -(-max(m.shape[1] for m in mats) // 16) * 16
    batch = torch.stack([F.pad(m.to(dtype), (0, cols - m.shape[1], 0, rows - m.shape[0])) for m in mats])
    out = newton_schulz(batch, steps, coeffs, dtype=dtype)
    return [o[:m.shape[0], :m.shape[1]].to(m.dtype) for o, m in zip(out, mats)]


_COMPILED = {}


def compiled(fn, backend="inductor"):
    """fn torch.compile'd once per process and backend, so every Muon of every run shares its graphs. dynamic=False:
    a graph per set of matrix shapes (a few, under dynamo's limit of 8), all met in the untimed warm-up; dynamic
    shapes would compile again inside a timed run."""
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[fn, backend]


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """Muon (Jordan et al. 2024) for the convolutions' filters: momentum orthogonalised by Newton-Schulz."""
    PREFIX = "muon"
    lr: float = knob(0.24, low=0, doc="at the schedule's peak")
    momentum: float = knob(0.6, low=0, high=1, doc="Muon's momentum")
    ns_steps: int = knob(3, low=0, whole=True, doc="Newton-Schulz iterations per step")
    ns_coeffs: tuple = numbers(MUON_COEFFS, doc="Newton-Schulz's a, b, c: X <- aX + bAX + cA²X, A = XXᵀ")
    renorm_every: tuple = numbers((1, 1), low=0, whole=True, doc="every k steps, k growing from the first to the "
                               "second over the run, the filters back to their norm (0: never)")
    weight_decay: float = knob(0.0, low=0, doc="decoupled, per image")
    momentum_dtype: str = knob("fp32", choices=("fp32", "fp16", "bf16"), doc="the dtype of Muon's momentum buffers")
    batched: bool = knob(False, doc="every filter bank in one Newton-Schulz call (the record)")


def momentum_buffers(state, params, dtype, weights=None):
    """Each parameter's momentum buffer in state, made (zeros like its weight in `weights`, else like it, of `dtype`; a
    float64 run's in float64) on the first call only: not setdefault, whose argument would allocate every step."""
    weights = weights or params
    exact = weights[0].dtype == torch.float64
    for p, w in zip(params, weights):
        if "momentum" not in state[p]:
            state[p]["momentum"] = torch.zeros_like(w, dtype=None if exact else dtype)
    return [state[p]["momentum"] for p in params]


def muon_updates(grads, buffers, group):
    """Muon's momentum over every bank at once, its buffers updated in place; the updates (Nesterov's, or the buffers):
        v = momentum v + g,  u = g + momentum v (nesterov) or v"""
    m = group["momentum"]
    if buffers[0].dtype in (torch.float16, torch.bfloat16):   # a Python scalar would be rounded to their dtype
        m = torch.full((), m, dtype=torch.float32, device=buffers[0].device)
    torch._foreach_mul_(buffers, m)
    torch._foreach_add_(buffers, grads)
    return torch._foreach_add(grads, buffers, alpha=group["momentum"]) if group["nesterov"] else buffers


def orthogonalised(updates, params, group, ns):
    """Each bank's update as a matrix (out × in·k·k) through ns (newton_schulz, or newton_schulz_padded with
    group["batched"]), in bfloat16, or float64 in a float64 run."""
    updates = [u.reshape(len(p), -1) for u, p in zip(updates, params)]
    dtype = torch.float64 if params[0].dtype == torch.float64 else torch.bfloat16
    if group["batched"]:
        return ns(updates, group["ns_steps"], group["ns_coeffs"], dtype=dtype)
    return [ns(u, group["ns_steps"], group["ns_coeffs"], dtype=dtype) for u in updates]


def muon_apply(params, updates, group, *, renorm, lr):
    """Each bank back to norm sqrt(rows) where renorm (a 0-d bool tensor; where false each scale is 1, and x × 1 is
    x), then its orthogonalised update at lr (a 0-d tensor) × sqrt(max(1, rows / cols)), the banks of each scale
    together, then the decoupled decay:  w = (w sqrt(rows) / |w| - lr scale u)(1 - lr weight_decay)"""
    norms = torch._foreach_norm(params)         # one ATen call for every bank: a few kernels, not one a bank
    torch._foreach_mul_(params, [torch.where(renorm, n.reciprocal() * len(p) ** 0.5, 1.0)
                                 for n, p in zip(norms, params)])
    by_scale = {}
    for p, u in zip(params, updates):
        by_scale.setdefault(max(1.0, u.shape[0] / u.shape[1]) ** 0.5, []).append((p, u.view_as(p)))
    for scale, pairs in by_scale.items():           # a tensor is no foreach alpha: the steps scaled first
        banks, steps = [p for p, _ in pairs], [u for _, u in pairs]
        torch._foreach_add_(banks, torch._foreach_mul(steps, (-lr * scale).to(steps[0].dtype)))
    if group["weight_decay"]:
        torch._foreach_mul_(params, (1 - lr * group["weight_decay"]).to(params[0].dtype))


def renorm_due(step, last, renorm_every, total_steps):
    """Whether Muon renormalises at `step`, `last` the step it last did: every k steps, k from k0 to k1 over the run
    (0: never)."""
    k0, k1 = renorm_every
    return k0 > 0 and step - last >= k0 + (k1 - k0) * step / total_steps // 1


# ----------------------------------------------------------------------------------------------------------
# SGD and Muon as one compiled step

class MasterWeights:
    """The float32 masters of the parameters a network holds in a lower precision (its copies, in autocast's dtype,
    which the forward reads as autocast would have cast them), by position: what the optimiser steps, weight averaging
    averages and the whitening fit writes, the copies then taking their values. Empty where nothing is held."""

    def __init__(self, copies=(), masters=()):
        self.copies, self.masters = list(copies), list(masters)
        self.of = {id(c): m for c, m in zip(self.copies, self.masters)}

    @classmethod
    def of_fresh(cls, model, fresh):
        """The masters of model's lower-precision parameters: the same parameters of `fresh`, a network of the same
        build just initialised in float32 (values never rounded)."""
        pairs = [(p, q.detach()) for p, q in zip(model.parameters(), fresh.parameters()) if p.dtype != q.dtype]
        return cls([p for p, _ in pairs], [q for _, q in pairs])

    def __bool__(self):
        return bool(self.copies)

    def weights(self, params):
        """params, each held one as its master."""
        return [self.of.get(id(p), p) for p in params]

    def held(self, params):
        """(the copies among params, their masters), or None where params holds none."""
        copies = [p for p in params if id(p) in self.of]
        return (copies, self.weights(copies)) if copies else None

    @torch.no_grad()
    def refresh(self):
        """The copies take their masters' values, rounded to their dtype."""
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    def float_copy(self, model):
        """A copy of model holding its masters' float32 values where it holds copies: what a run returns."""
        out = copy.deepcopy(model)
        for p, q in zip(model.parameters(), out.parameters()):
            if id(p) in self.of:
                q.data = self.of[id(p)].clone()
        return out


def sgd_foreach(params, grads, buffers, rate, *, weight_decay, momentum, nesterov):
    """torch.optim.SGD's step (its arithmetic, in its order) as foreach operations, rate a 0-d tensor:
        d = g + weight_decay w,  v = momentum v + d,  w = w - rate (d + momentum v if nesterov, else v)"""
    if weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_add_(buffers, grads)
    steps = torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers
    torch._foreach_add_(params, torch._foreach_mul(steps, -rate.to(params[0].dtype)))


def sgd_muon_step(sgd, muon, *, momentum, nesterov):
    """One step of every group, the rates 0-d tensors: SGD's, a (weights, grads, buffers, rate, unit, weight_decay,
    held) a group (rate x unit its step size), and Muon's, muon (None, or (filters, grads, buffers, rate, unit, renorm,
    group, held): renorm a 0-d bool tensor, whether this step renormalises, so that neither it nor the rate changes the
    graph). A weight the network holds in a lower precision steps as its float32 master, its gradient upcast
    (exactly); then its group's held (MasterWeights.held: the copies, their masters) takes the masters' values, rounded
    as autocast rounded them (a list as long as the group's, which a GPU's foreach kernel fuses with its update)."""
    upcast = lambda grads, weights: [g.to(w.dtype) for g, w in zip(grads, weights)]
    for weights, grads, buffers, rate, unit, weight_decay, held in sgd:
        sgd_foreach(weights, upcast(grads, weights), buffers, rate * unit, weight_decay=weight_decay,
                    momentum=momentum, nesterov=nesterov)
        if held:
            torch._foreach_copy_(*held)
    if muon:
        filters, grads, buffers, rate, unit, renorm, group, held = muon
        updates = muon_updates(upcast(grads, filters), buffers, group)
        updates = orthogonalised(updates, filters, group, newton_schulz_padded if group["batched"] else newton_schulz)
        muon_apply(filters, updates, group, renorm=renorm, lr=rate * unit)
        if held:
            torch._foreach_copy_(*held)


class SGDAndMuon(torch.optim.Optimizer):
    """The optimiser of a recipe with Muon (make_optimizers): its SGD groups and Muon's ("filters", muon_group)
    stepping as one function, sgd_muon_step, the rates 0-d tensors set_lr fills: compiled where Newton–Schulz is
    (CUDA; one graph whatever the rates, a second once the whitening bias is detached), eager elsewhere. Muon's
    clock (its steps, its last renormalisation) is the host's: whether a step renormalises depends on the step alone,
    and the device is told by a 0-d flag, filled where it changes (fill). masters (MasterWeights): the float32 weights
    it steps for the parameters the network holds in a lower precision, whose copies it then writes."""

    def __init__(self, groups, *, momentum, nesterov, masters=None, compile=None, compile_backend="inductor"):
        super().__init__(groups, dict(momentum=momentum, nesterov=nesterov))
        self.compile, self.compile_backend = compile, compile_backend
        self.masters = masters or MasterWeights()
        device = groups[0]["params"][0].device
        scalar = lambda value=0: torch.full((), value, dtype=torch.float64 if devices.has_float64(device)
                                            else torch.float32, device=device)
        self.lr = scalar()
        # the groups that train at a rate of their own (OwnRate: until_step), each with its 0-d rate
        self.own_rates = [(g, scalar()) for g in self.param_groups if g["until_step"] is not None]
        own = {id(g): rate for g, rate in self.own_rates}
        # each group's (rate, unit), by position: the schedule's rate x its unit, or its own rate as set_lr fills it
        self.rates = [(own[id(g)], 1.0) if id(g) in own else (self.lr, g["lr_unit"]) for g in self.param_groups]
        muon = next((g for g in self.param_groups if g.get("name") == "filters"), None)
        # Muon's settings the step reads (constants of its graph), its clock and whether this step renormalises
        self.muon = muon and {k: muon[k] for k in MUON_STEP_SETTINGS}
        self.muon_steps = self.last_renorm = 0
        self.renorm = torch.zeros((), dtype=torch.bool, device=device)
        self.filled = {}                # id of a 0-d tensor: the value it was last filled with
        for g in self.param_groups:
            momentum_buffers(self.state, g["params"], g.get("momentum_dtype"), self.masters.weights(g["params"]))

    def fill(self, scalar, value):
        """scalar (a 0-d tensor of this optimiser) filled with value, unless it holds it already: a launch, no wait."""
        if self.filled.get(id(scalar)) != value:
            scalar.fill_(value)
            self.filled[id(scalar)] = value

    def function(self):
        """sgd_muon_step, compiled or eager as `compile` and the device say."""
        on = devices.compiles_helpers(self.lr.device) if self.compile is None else self.compile
        return compiled(sgd_muon_step, self.compile_backend) if on else sgd_muon_step

    @torch.no_grad()
    def step(self):
        sgd, muon = [], None
        for g, (rate, unit) in zip(self.param_groups, self.rates):
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            weights, grads = self.masters.weights(params), [p.grad for p in params]
            buffers, held = [self.state[p]["momentum"] for p in params], self.masters.held(params)
            if g.get("name") == "filters":
                self.muon_steps += 1
                if renorm_due(self.muon_steps, self.last_renorm, g["renorm_every"], g["total_steps"]):
                    self.last_renorm = self.muon_steps
                self.fill(self.renorm, self.last_renorm == self.muon_steps)
                muon = (weights, grads, buffers, rate, unit, self.renorm, self.muon, held)
            else:
                sgd.append((weights, grads, buffers, rate, unit, g["weight_decay"], held))
        self.function()(sgd, muon, momentum=self.defaults["momentum"], nesterov=self.defaults["nesterov"])


MUON_STEP_SETTINGS = ("momentum", "nesterov", "batched", "ns_steps", "ns_coeffs", "renorm_every", "weight_decay")


# Muon's settings in SGDAndMuon's group, and their defaults (Jordan et al. 2024's)
MUON_DEFAULTS = {"lr_unit": 1.0, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "ns_coeffs": MUON_COEFFS,
                 "renorm_every": (0, 0), "total_steps": 1, "weight_decay": 0.0, "momentum_dtype": None,
                 "batched": False}


def muon_group(filters, **settings):
    """SGDAndMuon's parameter group of Muon for the conv filters (MUON_DEFAULTS changed by `settings`): orthogonalised
    momentum, each bank's update (out × in·k·k) by newton_schulz and scaled by sqrt(max(1, rows/cols)); decoupled
    weight_decay; renorm_every (k0, k1; airbench94_muon): each bank back to norm sqrt(out) every k steps, k linear from
    k0 to k1 over total_steps (0: never)."""
    unknown = set(settings) - set(MUON_DEFAULTS)
    if unknown:
        raise TypeError(f"muon_group: no setting {', '.join(sorted(unknown))}")
    group = {**MUON_DEFAULTS, **settings}
    return {**group, "params": list(filters), "name": "filters", "until_step": None,
            "ns_coeffs": tuple(group["ns_coeffs"]), "renorm_every": tuple(group["renorm_every"])}


# Ours: torch.optim.Muon is absent from torch 2.4 (which we support), takes 2-D weights only and averages momentum
def Muon(filters, lr, *, compile=None, compile_backend="inductor", **settings):  # noqa: N802 (an optimiser's name)
    """An SGDAndMuon of Muon alone (muon_group's settings) at the rate lr: the one Muon step, for a network's
    filters on their own."""
    opt = SGDAndMuon([muon_group(filters, **settings)], momentum=0.0, nesterov=False, compile=compile,
                     compile_backend=compile_backend)
    opt.lr.fill_(lr)
    return opt


# ----------------------------------------------------------------------------------------------------------
# Choosing the optimisers, their parameter groups and learning-rate units

@dataclass(frozen=True, kw_only=True)
class SGDSettings:
    """Momentum SGD on the batch-summed loss (make_optimizers), in one of three units of rate and decay."""
    PREFIX = ""
    lr_units: str = knob("myrtle", choices=("myrtle", "decoupled", "sum"), doc="myrtle: per image; decoupled: per "
                         "1024 images over the Nesterov gain (Jordan 2024); sum: torch's (airbench94_muon)")
    momentum: float = knob(0.9, low=0, high=1, doc="SGD's momentum")
    nesterov: bool = knob(True, doc="Nesterov's momentum")
    weight_decay: float = knob(5e-4, low=0, doc="the weight decay (in --lr-units)")
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

    @classmethod
    def over_epochs(cls, epochs, steps_per_epoch, **fields):
        """The OwnRate whose own rate lasts `epochs` (fractional) of steps_per_epoch steps each."""
        return cls(until_step=epoch_steps(epochs, steps_per_epoch), **fields)


MOMENTUM_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_optimizers(model, r, steps_per_epoch=1, world=1, *, own_rates=(), masters=None):
    """The optimisers of a run of recipe r (set_lr sets their steps from the schedule's lr): SGD on the summed loss of b
    images a rank of `world`, in units by r.sgd.lr_units (docs/cifar10.md), and Muon (r.muon) for the conv filters,
    the two as one SGDAndMuon. own_rates: OwnRate, a group each (None: none). masters: MasterWeights, which only
    SGDAndMuon steps (steps_masters).
        SGD lr = lr x unit x scale,  unit = 1/b (myrtle), world / (1024 (1 + 1/(1 - momentum))) (decoupled), world (sum)
        decay per step = lr x unit x wd x b (myrtle), / peak otherwise;  Muon lr = muon.lr x lr / peak
        scale = bias_lr_mult (batch-norm biases), an own rate's lr_mult to its until_step (to 0 if linear), 1
    """
    own_rates = [o for o in own_rates if o is not None]
    own = check_own_rates(model, own_rates)
    sgd = r.sgd
    bs, m, wd, peak = r.batch_size // world, sgd.momentum, sgd.weight_decay, max(r.lr.values)
    unit = {"myrtle": 1 / bs, "decoupled": world / (1024 * (1 + 1 / (1 - m))), "sum": world}[sgd.lr_units]
    decay = (lambda scale: wd * bs / scale) if sgd.lr_units == "myrtle" else (lambda scale: wd * bs / (peak * scale))
    bn_biases = {id(mod.bias) for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)}
    groups = {"weights": [], "bn_biases": [], "filters": []}
    for p in model.parameters():
        if p.requires_grad and id(p) not in own:
            groups["bn_biases" if id(p) in bn_biases else "filters" if r.muon and p.ndim == 4 else "weights"].append(p)
    groups_sgd = [{"params": groups[k], "lr_unit": unit * scale, "weight_decay": decay(scale), "name": k, "peak": peak,
                   "until_step": None} for k, scale in (("weights", 1.0), ("bn_biases", sgd.bias_lr_mult)) if groups[k]]
    groups_sgd += [{"params": [o.param], "lr_unit": unit * o.lr_mult, "weight_decay": decay(o.lr_mult), "name": o.name,
                    "peak": peak, "until_step": o.until_step, "linear": o.linear} for o in own_rates]
    if groups["filters"]:
        return [SGDAndMuon(groups_sgd + [muon_for(groups["filters"], r, steps_per_epoch=steps_per_epoch, world=world)],
                           momentum=m, nesterov=sgd.nesterov, masters=masters)]
    if masters:
        raise ValueError(f"make_optimizers: {r.name}'s optimiser (SGD) steps its parameters themselves; it keeps no "
                         "float32 masters (steps_masters)")
    device = next(model.parameters()).device
    return [torch.optim.SGD(groups_sgd, lr=0.0, momentum=m, nesterov=sgd.nesterov, **devices.sgd_options(device))]


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


def muon_for(filters, r, *, steps_per_epoch, world):
    """muon_group of the filters with the settings r.muon, at muon.lr x the schedule's lr / its peak."""
    muon, bs = r.muon, r.batch_size // world
    return muon_group(filters, lr_unit=muon.lr / max(r.lr.values), momentum=muon.momentum, nesterov=r.sgd.nesterov,
                      ns_steps=muon.ns_steps, ns_coeffs=muon.ns_coeffs, renorm_every=muon.renorm_every,
                      total_steps=max(1, epoch_steps(r.epochs, steps_per_epoch)),
                      weight_decay=muon.weight_decay * bs * world, momentum_dtype=MOMENTUM_DTYPES[muon.momentum_dtype],
                      batched=muon.batched)


def set_lr(opts, lr, step=0, epoch=0.0):
    """Sets each group's step size to group_rate's; an SGDAndMuon's rates are 0-d tensors, filled (no host wait, no
    guard of its compiled step on their values). Every other group's clock becomes the (fractional) epoch of the
    coming step, which RMSprop-to-SGD's hand-over reads."""
    for opt in opts:
        if isinstance(opt, SGDAndMuon):
            opt.fill(opt.lr, lr)
            for g, rate in opt.own_rates:
                opt.fill(rate, group_rate(g, lr, step))
            continue
        for g in opt.param_groups:
            g["lr"], g["epoch"] = group_rate(g, lr, step), epoch


def group_rate(g, lr, step):
    """lr (the schedule's value, in the recipe's units) × the group's unit; a group that trains only until_step steps
    gets 0 from then on, and before, with `linear`, its peak falling linearly to 0."""
    until = g["until_step"]
    if until is not None and step >= until:
        return 0.0
    if until is not None and g.get("linear"):
        return g["peak"] * g["lr_unit"] * (1 - step / until)
    return lr * g["lr_unit"]
