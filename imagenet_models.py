"""ImageNet's networks and what a recipe builds around them: torchvision's ResNets (or resnet_tiny, for tests and CPU
demonstrations) with BlurPool and ghost batch norm, the optimiser, and the device memory training them takes, each
beside the settings it reads (ImageNetNetworkSettings, ImageNetSGDSettings, LARSSettings, RMSpropWarmupSettings): the
optimisers are momentum SGD (torch's), LARS and RMSprop-to-SGD (here), their rates set by optim.set_lr.

Papers:
  You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks" (LARS, arXiv:1708.03888)
  Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in 15 Minutes"
      (Preferred Networks, arXiv:1711.04325)
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import devices
from schedules import epoch_plans, res_at, val_at
from settings import check_own, knob
from torch_backend import GhostBatchNorm

# ---------------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------------

IMAGENET_MODELS = ("resnet_tiny", "resnet18", "resnet34", "resnet50", "resnet101")


@dataclass(frozen=True, kw_only=True)
class ImageNetNetworkSettings:
    """torchvision's ResNets (resnet_tiny: ours, for tests and CPU demonstrations)."""
    PREFIX = ""
    model: str = knob("resnet50", choices=IMAGENET_MODELS,
                      doc="torchvision's ResNets; resnet_tiny: ours, for tests and CPU demonstrations")
    width: int = knob(16, above=0, whole=True, doc="resnet_tiny's first stage's channels")
    blurpool: bool = knob(True, doc="a blur before each strided convolution (Zhang 2019; FFCV)")
    zero_init: bool = knob(False, doc="each residual block's last batch-norm scale starts at 0 (Goyal et al.)")

    def __post_init__(self):
        check_own(self)


class BlurPool(nn.Module):
    """A fixed 3x3 binomial low-pass filter, put before every strided convolution so that it subsamples a smoothed
    signal (anti-aliasing, Zhang 2019), as FFCV's ResNets build it: one depthwise convolution that pads with zeros,
    so a channels_last input stays channels_last (CUDA's reflection pad returns NCHW, forward and backward)."""

    def __init__(self, channels):
        super().__init__()
        k = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("kernel", (k[:, None] * k[None, :] / 16).expand(channels, 1, 3, 3).clone())

    def forward(self, x):
        return F.conv2d(x, self.kernel.to(x.dtype), padding=1, groups=x.shape[1])


def add_blurpool(model, min_channels=16):
    """Replaces each strided conv with >= min_channels inputs by BlurPool then that conv."""
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= min_channels:
                setattr(m, child_name, nn.Sequential(BlurPool(child.in_channels), child))
    return model


def resnet_tiny(num_classes, width, norm=nn.BatchNorm2d):
    """A 4-stage ResNet of torchvision BasicBlocks, one per stage, `width` channels in the first stage
    (torchvision's ResNets have fixed widths), batch norm of class `norm`: for tests and CPU demonstrations."""
    from torchvision.models.resnet import BasicBlock
    layers, c_in = [nn.Conv2d(3, width, 3, 1, 1, bias=False), norm(width), nn.ReLU(inplace=True)], width
    for i in range(4):
        c, stride = width * 2 ** i, 1 if i == 0 else 2
        down = None if stride == 1 else nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), norm(c))
        layers.append(BasicBlock(c_in, c, stride, down, norm_layer=norm))
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))


def imagenet_network(r, num_classes):
    """The network of recipe r (its .network): torchvision's ResNet or resnet_tiny, with BlurPool if asked, and
    ghost batch norm (torch_backend.GhostBatchNorm, its groups consecutive images: set_ghost_groups) where the recipe
    reproduces a paper's per-GPU groups (bn_workers)."""
    net, norm = r.network, GhostBatchNorm if r.bn_workers else nn.BatchNorm2d
    if net.model == "resnet_tiny":
        model = resnet_tiny(num_classes, net.width, norm)
    else:
        model = getattr(torchvision.models, net.model)(num_classes=num_classes, zero_init_residual=net.zero_init,
                                                       norm_layer=norm)
    return add_blurpool(model) if net.blurpool else model


# ---------------------------------------------------------------------------------------------
# The optimiser
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ImageNetSGDSettings:
    """Momentum SGD, with no weight decay on batch norm and biases, and label smoothing of the loss."""
    PREFIX = ""
    momentum: float = knob(0.9, low=0, high=1, doc="SGD's momentum")
    nesterov: bool = knob(False, doc="Nesterov's momentum")
    weight_decay: float = knob(1e-4, low=0, doc="the weight decay (none on batch norm and biases)")
    label_smoothing: float = knob(0.1, low=0, high=1, doc="the loss's label smoothing (0: none)")

    def __post_init__(self):
        check_own(self)


@dataclass(frozen=True, kw_only=True)
class LARSSettings:
    """LARS (You et al. 2017) instead of SGD: each layer's step a fraction `trust` of its weights' norm."""
    PREFIX = "lars"
    trust: float = knob(0.001, low=0, doc="each layer's step as this fraction of its weights' norm")

    def __post_init__(self):
        check_own(self)


@dataclass(frozen=True, kw_only=True)
class RMSpropWarmupSettings:
    """Akiba et al. 2017's RMSprop warm-up instead of plain SGD: RMSprop at rate lr handing over to momentum SGD,
    half done at epoch beta_center, over beta_period epochs (RMSpropToSGD, below)."""
    PREFIX = "rmsprop"
    lr: float = knob(1e-3, low=0, doc="RMSprop's rate in the warm-up")
    beta_center: float = knob(10.0, low=0, doc="the epoch the hand-over to SGD is half done")
    beta_period: float = knob(5.0, above=0, doc="epochs the hand-over takes")

    def __post_init__(self):
        check_own(self)


# The large-batch optimisers, ImageNet's alone

def _closure_loss(closure):
    """The loss of an optimizer's closure (torch.optim's step(closure) protocol), with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# Ours, not timm's Lars: as in You et al., lr goes inside the momentum and 1-D tensors are never adapted
# (timm: by group)
class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling, You et al. 2017 (Algorithm 1): each weight tensor's step is a fraction eta
    (trust_coefficient) of its norm whatever its gradient's scale, so large batches train at high rates; 1-D tensors
    (batch-norm, biases) get neither adaptation nor decay. With beta = weight_decay, m = momentum:
        local_lr = eta * ||w|| / (||g|| + beta * ||w||)        (1 where ||w|| or ||g|| is 0)
        v = m * v + lr * local_lr * (g + beta * w)
        w = w - v
    """

    def __init__(self, params, lr, *, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            # one foreach operation for all the weights (or all the 1-D tensors) at a time, not a loop of them
            for some in ([p for p in params if p.ndim > 1], [p for p in params if p.ndim <= 1]):
                if some:
                    self.update(some, group, adapt=some[0].ndim > 1)
        return loss

    def update(self, params, group, *, adapt):
        """v = m v + lr local (g + beta w), w = w - v for params: local the trust ratio (adapt), or 1 and no decay."""
        grads, buffers = [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params]
        if adapt:
            w_norm, g_norm = torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(grads))
            local = group["trust_coefficient"] * w_norm / (g_norm + group["weight_decay"] * w_norm + group["eps"])
            # torch.where, not `if`: no GPU-to-host sync per layer
            local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
            grads = torch._foreach_mul(params, group["weight_decay"])
            torch._foreach_add_(grads, [p.grad for p in params])
            torch._foreach_mul_(grads, local.unbind(0))
        torch._foreach_mul_(buffers, group["momentum"])
        torch._foreach_add_(buffers, grads, alpha=group["lr"])
        torch._foreach_sub_(params, buffers)


def alpha_sgd(epoch, beta_center, beta_period):
    """Akiba et al. 2017 sec. 3.1: the share of SGD in the RMSprop-to-SGD update at a (fractional) epoch e, an
    ELU-shaped curve (c = beta_center, p = beta_period; our reading of the paper, not checked against its text):
        alpha = 1/2 * exp(2 * (e - c) / p)    e < c
        alpha = 1/2 + (e - c) / p             c <= e < c + p/2
        alpha = 1                             otherwise
    """
    if epoch < beta_center:
        return 0.5 * math.exp(2 * (epoch - beta_center) / beta_period)
    if epoch < beta_center + beta_period / 2:
        return 0.5 + (epoch - beta_center) / beta_period
    return 1.0


class RMSpropToSGD(torch.optim.Optimizer):
    """RMSprop warm-up (Akiba et al. 2017; defaults ours): RMSprop, which copes with the early large batch, slides into
    momentum SGD along alpha_sgd of the fractional `epoch` set_lr puts in each group; lr_rmsprop is RMSprop's own rate
    (its steps are about lr an element). Per element, g the gradient + weight_decay * w:
        m = rms_decay * m + (1 - rms_decay) * g^2
        a = alpha_sgd(epoch, beta_center, beta_period)
        v = momentum * v + (lr * a + lr_rmsprop * (1 - a) / (sqrt(m) + eps)) * g
        w = w - v
    """

    def __init__(self, params, lr, *, lr_rmsprop=1e-3, momentum=0.9, rms_decay=0.99, eps=1e-8, weight_decay=0.0,
                 beta_center=10.0, beta_period=5.0):
        super().__init__(params, dict(lr=lr, lr_rmsprop=lr_rmsprop, momentum=momentum, rms_decay=rms_decay, eps=eps,
                                      weight_decay=weight_decay, beta_center=beta_center, beta_period=beta_period,
                                      epoch=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            a = alpha_sgd(group["epoch"], group["beta_center"], group["beta_period"])
            sgd, rms = group["lr"] * a, group["lr_rmsprop"] * (1 - a)
            for p in params:
                if not self.state[p]:
                    self.state[p]["square_avg"], self.state[p]["momentum_buffer"] = (torch.zeros_like(p),
                                                                                     torch.zeros_like(p))
            # one foreach operation for all the group's tensors at a time, each in the order of the formula's terms
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            m, v = ([self.state[p][k] for p in params] for k in ("square_avg", "momentum_buffer"))
            torch._foreach_mul_(m, group["rms_decay"])
            torch._foreach_addcmul_(m, grads, grads, value=1 - group["rms_decay"])
            rate = torch._foreach_sqrt(m)
            torch._foreach_add_(rate, group["eps"])
            torch._foreach_reciprocal_(rate)             # rms / x is x.reciprocal() * rms, as the formula's rounding
            torch._foreach_mul_(rate, rms)
            torch._foreach_add_(rate, sgd)
            torch._foreach_mul_(v, group["momentum"])
            # rates enter v with each step, not the paper's lr * d: a change of lr leaves past steps as they were
            torch._foreach_add_(v, torch._foreach_mul(grads, rate))
            torch._foreach_sub_(params, v)
        return loss


def param_groups_no_decay_1d(model, weight_decay):
    """Two optimizer groups: weight decay for weight matrices and kernels, none for 1-D tensors (BN, biases); each
    at the schedule's rate (set_lr)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [dict(params=[p for p in params if p.ndim > 1], weight_decay=weight_decay, lr_unit=1.0, until_step=None),
            dict(params=[p for p in params if p.ndim <= 1], weight_decay=0.0, lr_unit=1.0, until_step=None)]


def imagenet_optimizer(model, r):
    """Momentum SGD, LARS or RMSprop-to-SGD (above) as the recipe says, at lr 0 until the schedule sets it;
    weight decay only on conv and linear weights (none on batch-norm scales and biases)."""
    groups, s = param_groups_no_decay_1d(model, r.sgd.weight_decay), r.sgd
    if r.lars:
        return LARS(groups, lr=0.0, momentum=s.momentum, trust_coefficient=r.lars.trust)
    if r.rmsprop:
        return RMSpropToSGD(groups, lr=0.0, lr_rmsprop=r.rmsprop.lr, momentum=s.momentum,
                            beta_center=r.rmsprop.beta_center, beta_period=r.rmsprop.beta_period)
    device = next(model.parameters()).device
    return torch.optim.SGD(groups, lr=0.0, momentum=s.momentum, nesterov=s.nesterov, **devices.sgd_options(device))


# ---------------------------------------------------------------------------------------------
# The device memory training takes
# ---------------------------------------------------------------------------------------------

def saved_bytes_per_image(r, classes, res, dtype):
    """Bytes of activations a training step saves for backward, per image at res x res in dtype: autograd's saved
    tensors (parameters left out, each storage once) counted on the meta device, which holds no memory."""
    with torch.device("meta"):
        model = imagenet_network(r, classes).to(dtype)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            storages[s._cdata] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(torch.empty(2, 3, res, res, device="meta", dtype=dtype)).float(),
                        torch.zeros(2, dtype=torch.long, device="meta"))
    return sum(storages.values()) / 2


def memory_parts(r, classes, dtype):
    """(bytes a rank holds whatever its batch: float32 parameters, gradients, the optimiser's state and an EMA's copy;
    {resolution: saved_bytes_per_image} at each of the run's resolutions)."""
    with torch.device("meta"):
        params = sum(p.numel() * 4 for p in imagenet_network(r, classes).parameters())
    copies = 2 + (2 if r.rmsprop else 1) + (r.ema is not None)
    return copies * params, {res: saved_bytes_per_image(r, classes, res, dtype) for res in
                             {res_at(r, e) for e in range(r.epochs)}}


def eval_bytes_per_image(r, classes, res, dtype):
    """Bytes an evaluation pass (no autograd) holds at once per image at res x res in dtype: its largest layer's input
    and output, with the largest activation beside them (a residual block's input), counted on the meta device."""
    with torch.device("meta"):
        model = imagenet_network(r, classes).to(dtype).eval()
    pairs, largest = [0], [0]

    def note(module, inputs, output):
        held = [t.nbytes for t in (*inputs, output) if isinstance(t, torch.Tensor)]
        pairs.append(sum(held))
        largest.append(max(held, default=0))
    hooks = [m.register_forward_hook(note) for m in model.modules() if not any(True for _ in m.children())]
    with torch.no_grad():
        model(torch.empty(2, 3, res, res, device="meta", dtype=dtype))
    for h in hooks:
        h.remove()
    return (max(pairs) + max(largest)) / 2


def input_bytes(batch, out_pixels, *, side, gpu_decoder, dtype):
    """Device bytes of one batch's inputs: `batch` images made into out_pixels each (res x res), from a store of
    images up to side x side. The GPU decoder holds the batch it crops and the next it decodes (uint8), the first
    padded into one in float16 and its rows' product; every decoder the float32 crops, their normalised copy and the
    batch in dtype with its flipped copy:
      gpu: 2 * 3 n side^2 + 2 * 3 n side^2 + 2 * 3 n side sqrt(out) + (4 + 4 + 2 b) * 3 n out
      cpu: 2 * 3 n out + (4 + 4 + 2 b) * 3 n out        (b: dtype's bytes)"""
    n, b = batch, torch.empty(0, dtype=dtype).element_size()
    crops = (4 + 4 + 2 * b) * 3 * n * out_pixels
    if not gpu_decoder:
        return 2 * 3 * n * out_pixels + crops
    return 4 * 3 * n * side ** 2 + 2 * 3 * n * side * round(out_pixels ** 0.5) + crops


@dataclass(frozen=True)
class MemoryNeed:
    """A rank's device memory, in bytes: what it holds whatever the batch (parameters, gradients, the optimiser's state,
    an EMA), and in the worst epoch: training's saved activations and its inputs, and validation's (activations and
    inputs, after training's are freed)."""
    fixed: int
    activations: int
    inputs: int
    validation: int

    @property
    def total(self):
        return self.fixed + max(self.activations + self.inputs, self.validation)

    def text(self):
        return (f"{devices.size_text(self.fixed)} of weights and optimiser state, "
                f"{devices.size_text(self.activations)} of activations, "
                f"{devices.size_text(self.inputs)} of input buffers, "
                f"{devices.size_text(self.validation)} for validation")


VAL_BATCH = 256         # imagenet_data.validation_sums' batch


def memory_need(r, classes, *, world, dtype, parts=None, side=500, gpu_decoder=False):
    """A rank's MemoryNeed in the epoch that needs most: memory_parts's fixed bytes, that epoch's micro-batch of saved
    activations at its resolution and its batch's input_bytes (images up to side x side in the store, gpu_decoder: on
    the device), and validation's batch of VAL_BATCH at the largest validation side, flipped for TTA (parts:
    memory_parts's, when known)."""
    fixed, per_image = parts or memory_parts(r, classes, dtype)
    plans = epoch_plans(r, world)
    worst = max(plans, key=lambda p: p.micro * per_image[p.res] + input_bytes(p.batch, p.res ** 2, side=side,
                                                                           gpu_decoder=gpu_decoder, dtype=dtype))
    val_res, crop = max(val_at(r, e) for e in range(r.epochs))
    val_pixels = val_res ** 2 * (1 if crop else 2)          # a whole image: its longer side up to twice the shorter
    validation = VAL_BATCH * eval_bytes_per_image(r, classes, val_res, dtype) * (1 + (crop == 0)) + input_bytes(
        VAL_BATCH, val_pixels, side=side, gpu_decoder=gpu_decoder, dtype=dtype)
    return MemoryNeed(fixed=int(fixed), activations=int(worst.micro * per_image[worst.res]),
                      inputs=int(input_bytes(worst.batch, worst.res ** 2, side=side, gpu_decoder=gpu_decoder,
                                             dtype=dtype)), validation=int(validation))


def training_bytes(r, classes, *, world, dtype, parts=None, **inputs):
    """memory_need's total: the most device memory a rank needs in any epoch (inputs: memory_need's side
    and gpu_decoder)."""
    return memory_need(r, classes, world=world, dtype=dtype, parts=parts, **inputs).total


def check_memory(r, classes, *, device, world, dtype, **inputs):
    """training_bytes of a rank, once it fits the device; a UsageError of one line otherwise, with memory_need's
    parts, naming the smallest --accumulate that would fit (schedules permitting), or more GPUs (inputs:
    memory_need's side and gpu_decoder)."""
    parts = memory_parts(r, classes, dtype)
    need, free = memory_need(r, classes, world=world, dtype=dtype, parts=parts, **inputs), devices.free_memory(device)
    if free is None or need.total <= devices.USABLE * free:
        return need.total
    first = epoch_plans(r, world)[0]
    remedy = "use more GPUs (the batch is split over them)"
    for k in (k for k in range(r.accumulate + 1, first.batch + 1) if first.batch % k == 0):
        try:
            fits = training_bytes(replace(r, accumulate=k), classes, world=world, dtype=dtype, parts=parts,
                                  **inputs) <= devices.USABLE * free
        except ValueError:              # k does not split every epoch's batch into whole groups
            continue
        if fits:
            remedy = f"add --accumulate {k} (micro-batches of {first.batch // k} images), or use more GPUs"
            break
    what = f"{first.batch} images per process" + (f" in micro-batches of {first.micro}" if r.accumulate > 1 else "")
    devices.check_training_fits(device, need.total, why=f"training {r.network.model} at {what}", remedy=remedy,
                                parts=need.text())
