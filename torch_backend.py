"""The CIFAR-10 networks: ResNet-9, ResNet-18 and the three-block fastnet with their batch-norm and whitening
options, test-time augmentation and evaluation, each technique's settings above its code;
and the ghost batch norm ImageNet's networks use too. Each network is built from a recipe's settings
(cifar10_recipes.Recipe: its network, batch_norm and whitening); the data and its augmentation are in cifar_data.py,
the optimisers in optim.py, the loop in cifar10_fast.py, every device decision in devices.py.
"""
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

import devices
from cifar_data import pair
from core import UsageError
from optim import OwnRate
from schedules import epoch_steps
from settings import component, knob, numbers

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

ACTIVATIONS = {"relu": lambda net: nn.ReLU(inplace=True), "celu": lambda net: nn.CELU(net.celu_alpha),
               "gelu": lambda net: nn.GELU(), "silu": lambda net: nn.SiLU()}


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    """Myrtle's ResNet-9 or ResNet-18, or Jordan's (2024) three-block fastnet."""
    PREFIX = ""
    model: str = knob("resnet9", choices=("resnet9", "resnet18", "fastnet"), doc="fastnet: Jordan's (2024) network")
    width: float = knob(1.0, above=0, doc="every layer's channels x this")
    block_widths: tuple = numbers((64, 256, 256), above=0, whole=True, doc="fastnet's three blocks' channels")
    block_depth: int = knob(2, choices=(2, 3), doc="fastnet's convolutions per block (3: airbench96's residual)")
    act: str = knob("relu", choices=tuple(ACTIVATIONS), doc="the activation after each batch norm")
    celu_alpha: float = knob(0.3, above=0, doc="CELU's alpha (with --act celu)")
    pool_first: bool = knob(False, doc="max-pool before batch norm (Myrtle): the same maths on 4x fewer pixels")
    dirac_init: bool = knob(False, doc="convolutions start as the identity (Jordan 2024)")
    output_scale: float = knob(0.125, above=0, doc="the logits x this")
    head_unit_std: bool = knob(False, doc="the head starts at unit std, the logits / its width (airbench94_muon)")
    global_max_pool: bool = knob(True, doc="the last map max-pooled whole (any size pools to 1x1); false: the "
                                           "published networks' fixed window")

    def check(self):
        if not self.global_max_pool and self.model not in FINAL_POOL_WINDOWS:
            raise UsageError(f"--global-max-pool false: {self.model} has no fixed window to pool with; it pools "
                             "globally (max and mean)")


class GhostBatchNorm(nn.BatchNorm2d):
    """Batch norm with training statistics from groups of `group` images (ghost batch norm, Hoffer et al. 2017), the
    running statistics moving towards the groups' average; group 0, or a batch of one group: plain batch norm. Groups
    "interleaved": image i in group i mod (batch / group) (Myrtle's); "consecutive": images in order, so that a
    micro-batch of whole groups is normalised as in the batch it is part of. wide_stats: the statistics of a float32
    (float64 in a float64 run) copy of the batch, not of its bf16, which rounds them to 8 bits."""
    GROUPINGS = ("interleaved", "consecutive")

    def __init__(self, c, *, group=0, grouping="consecutive", wide_stats=True, **kwargs):
        super().__init__(c, **kwargs)
        self.group, self.grouping, self.wide_stats = group, grouping, wide_stats
        self.check()

    def check(self):
        if self.grouping not in self.GROUPINGS:
            raise ValueError(f"grouping must be interleaved or consecutive, not {self.grouping!r}")

    def forward(self, x):
        g, n = self.group, len(x)
        return self.ghost_forward(x) if self.training and 0 < g < n and n % g == 0 else super().forward(x)

    def ghost_forward(self, x):
        """forward over groups of self.group images, grouped as self.grouping says."""
        n, g, c = len(x), self.group, x.shape[1]
        # splitting the batch dimension is a view in any memory format (a reshape to (g, s·c, h, w) would copy a
        # channels_last batch, and the result back)
        members = 0 if self.grouping == "interleaved" else 1
        xs = x.unflatten(0, (g, n // g) if members == 0 else (n // g, g))
        # on a GPU var_mean accumulates bf16 in float32, then rounds the statistics to bf16 (2^-9 relative)
        var, mean = torch.var_mean(devices.float32_or_wider(xs) if self.wide_stats else xs, (members, 3, 4),
                                   correction=0, keepdim=True)
        var, mean = devices.float32_or_wider(var), devices.float32_or_wider(mean)
        scale = self.weight.view(1, 1, c, 1, 1) * torch.rsqrt(var + self.eps)
        shift = self.bias.view(1, 1, c, 1, 1) - mean * scale
        with torch.no_grad():
            count = g * x.shape[2] * x.shape[3]
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean.mean((0, 1)).flatten(), self.momentum)
            self.running_var.lerp_(var.mean((0, 1)).flatten() * count / (count - 1), self.momentum)
        return torch.addcmul(shift.to(x.dtype), xs, scale.to(x.dtype)).flatten(0, 1)


def set_ghost_groups(model, group):
    """Every GhostBatchNorm of model normalises groups of `group` images from now on."""
    for m in model.modules():
        if isinstance(m, GhostBatchNorm):
            m.group = group


@dataclass(frozen=True, kw_only=True)
class BatchNormSettings:
    """Batch norm, with Myrtle's ghost batches and frozen scales."""
    PREFIX = "bn"
    momentum: float = knob(0.1, low=0, high=1, doc="PyTorch's convention: the new batch's weight")
    eps: float = knob(1e-5, above=0, doc="added to the batch variance")
    ghost_batch: int = knob(0, low=0, whole=True, doc="statistics over groups of this many images (0: the batch)")
    ghost_grouping: str = knob("interleaved", choices=GhostBatchNorm.GROUPINGS, doc="interleaved: image i in group "
                               "i mod (batch / ghost_batch), as Myrtle's; consecutive: images in order")
    freeze_scale: bool = knob(False, doc="the scales stay 1; only the biases learn")


def batch_norm(c, bn):
    """Batch norm of c channels with the settings bn (BatchNormSettings)."""
    if bn.ghost_batch:
        layer = GhostBatchNorm(c, eps=bn.eps, momentum=bn.momentum, group=bn.ghost_batch, grouping=bn.ghost_grouping,
                               wide_stats=False)
    else:
        layer = nn.BatchNorm2d(c, eps=bn.eps, momentum=bn.momentum)
    layer.weight.requires_grad_(not bn.freeze_scale)
    return layer


def activation(net, act=None):
    return ACTIVATIONS[act or net.act](net)


def conv(c_in, c_out, net, kernel=3):
    """A bias-free convolution; with dirac_init its first c_in filters the identity."""
    layer = nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False)
    if net.dirac_init and kernel > 1 and c_out >= c_in:
        nn.init.dirac_(layer.weight[:c_in])
    return layer


def conv_bn(c_in, c_out, r, *, pool=False, kernel=3):
    """conv -> batch norm -> activation, with an optional 2x2 max-pool after it, or moved to straight after the conv
    (net.pool_first), which does the same maths on 4x fewer pixels."""
    layers = [conv(c_in, c_out, r.network, kernel), batch_norm(c_out, r.batch_norm), activation(r.network)]
    if pool:
        layers.insert(1 if r.network.pool_first else 3, nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    """x + body(x), then `act` if given (airbench96 adds the branch before its last activation)."""

    def __init__(self, *layers, act=None):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.act = act or nn.Identity()

    def forward(self, x):
        return self.act(x + self.body(x))


class Mul(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


# the published networks' last pooling (Myrtle's ResNet-9, airbench's three blocks): a fixed window, the whole map
# only for 32 px images
FINAL_POOL_WINDOWS = {"resnet9": 4, "fastnet": 3}


class GlobalMaxPool(nn.Module):
    """The maximum over each channel's map, whatever its size, as amax: Inductor compiles its backward (the gradient to
    the maximum, shared equally among ties) into its own kernels, deterministic on CUDA, where adaptive max-pooling's
    backward is left to ATen's kernel (atomic adds on a GPU, which Inductor cannot fuse)."""

    def forward(self, x):
        return x.amax((2, 3), keepdim=True)


@dataclass(frozen=True)
class WhiteningFit:
    """A reference's whitening fit: the terms of fit_whitening's formula."""
    name: str
    images: int
    centre: bool
    ddof: int
    decomp: str


WHITENING_FITS = {f.name: f for f in (
    WhiteningFit("myrtle", 10000, True, 1, "eigh"),         # Myrtle, bag_of_tricks.ipynb
    WhiteningFit("airbench94", 5000, False, 0, "eigh"),     # airbench94.py
    WhiteningFit("record", 960, False, 0, "svd"))}          # the record's cifar10_speedrun.py


@dataclass(frozen=True, kw_only=True)
class WhiteningBiasSettings:
    """The whitening bias: trained its first `epochs`, then detached (airbench94)."""
    PREFIX = "bias"
    epochs: float = knob(3.0, low=0, doc="epochs before it is detached")
    lr_mult: float = knob(1.0, low=0, doc="its rate: the schedule's x this")
    init: str = knob("zero", choices=("zero", "default"), doc="default: the convolution's own (airbench94_muon)")
    decay: str = knob("none", choices=("none", "linear"), doc="linear: from its peak to 0 over its epochs")


@dataclass(frozen=True, kw_only=True)
class WhiteningSettings:
    """Patch whitening (Myrtle 2018): a frozen first convolution whitening the images' patches."""
    PREFIX = "whiten"
    size: int = knob(3, above=0, whole=True, doc="the patches' side, in pixels")
    pad: int = knob(1, low=0, whole=True, doc="the convolution's padding")
    both_signs: bool = knob(False, doc="each filter and its negative (Jordan 2024)")
    eps: float = knob(1e-2, low=0, doc="added to each eigenvalue")
    act: str = knob("", choices=("",) + tuple(ACTIVATIONS), doc="the activation after it ('': the network's)")
    fit: WhiteningFit = knob(WHITENING_FITS["myrtle"], choices=WHITENING_FITS, doc="whose fit to copy: myrtle's "
                             "(10,000 images, centred), airbench94's (5,000) or the record's (960, by SVD)")
    bias: WhiteningBiasSettings = component(WhiteningBiasSettings)


class Whitening(nn.Conv2d):
    """Patch whitening with the settings w (WhiteningSettings): a frozen convolution whose filters fit_whitening
    fits, and a bias (w.bias) that trains at a rate of its own (whitening_bias) until the run detaches it."""

    def __init__(self, w):
        super().__init__(3, 3 * w.size ** 2 * (2 if w.both_signs else 1), w.size, padding=w.pad, bias=bool(w.bias))
        self.w = w
        self.weight.requires_grad_(False)
        if w.bias:  # make_optimizers refuses a network not handing it over, saying how
            self.bias.own_rate_from = "torch_backend.whitening_bias(model, steps_per_epoch)"
            if w.bias.init == "zero":
                nn.init.zeros_(self.bias)


def whitening_bias(net, steps_per_epoch=1):
    """The whitening layer's bias as an optim.OwnRate, or None."""
    white = next((m for m in net.modules() if isinstance(m, Whitening)), None)
    if white is None or white.bias is None:
        return None
    b = white.w.bias
    return OwnRate(name="whiten_bias", param=white.bias, lr_mult=b.lr_mult, linear=b.decay == "linear",
                   until_step=epoch_steps(b.epochs, steps_per_epoch))


@torch.no_grad()
def fit_whitening(model, train_images, size, masters=None):
    """Fits model's Whitening filters (and float32 master) to the first fit.images training images, cropped to size:
        filters = eigenvectors of C / sqrt(eigenvalues + eps),  C = P'P / (n - ddof), P the patches (centred or not)"""
    white = next((m for m in model.modules() if isinstance(m, Whitening)), None)
    if white is None:
        return
    (h, w), k, fit = pair(size), white.w.size, white.w.fit
    pad = (train_images.shape[-1] - w) // 2
    x = devices.float32_or_wider(train_images[:fit.images, :, pad:pad + h, pad:pad + w])
    patches = x.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k)  # a patch a row
    if fit.centre:
        patches = patches - patches.mean(0)
    cov = devices.in_float64(patches.T @ patches / (len(patches) - fit.ddof))
    if fit.decomp == "svd":  # cov is symmetric: its singular vectors are its eigenvectors, largest first
        eigvecs, eigvals, _ = torch.linalg.svd(cov)
    else:
        eigvals, eigvecs = (t.flip(-1) for t in torch.linalg.eigh(cov))  # ascending: flipped, largest first
    filters = (eigvecs / torch.sqrt(eigvals + white.w.eps)).T.reshape(-1, 3, k, k)
    if white.w.both_signs:
        filters = torch.cat([filters, -filters])
    master = masters.weights([white.weight])[0] if masters else white.weight
    master.copy_(filters.to(master))
    white.weight.copy_(master)  # the held bf16 copy, where there is one


def widths(net, base):
    return [max(1, round(c * net.width)) for c in base]


def classifier(c, net, num_classes):
    """The last max-pool, the linear head and the logits' scale."""
    pool = GlobalMaxPool() if net.global_max_pool else nn.MaxPool2d(FINAL_POOL_WINDOWS[net.model])
    head = nn.Linear(c, num_classes, bias=False)
    if net.head_unit_std:
        with torch.no_grad():
            head.weight /= head.weight.std()
    return [pool, nn.Flatten(), head, Mul(net.output_scale / (c if net.head_unit_std else 1))]


def resnet9(r, num_classes=10):
    """Myrtle's ResNet-9: prep 64, layer1 128 + residual, layer2 256, layer3 512 + residual, global max-pool, linear,
    logits x output_scale. 6,573,120 parameters at width 1. With whitening, the prep conv becomes a frozen 3x3
    whitening layer and a 1x1 conv (Myrtle)."""
    c0, c1, c2, c3 = widths(r.network, (64, 128, 256, 512))
    if r.whitening:
        white = Whitening(r.whitening)
        prep = nn.Sequential(white, conv_bn(white.out_channels, c0, r, kernel=1))
    else:
        prep = conv_bn(3, c0, r)
    return nn.Sequential(
        prep,
        conv_bn(c0, c1, r, pool=True),
        Residual(conv_bn(c1, c1, r), conv_bn(c1, c1, r)),
        conv_bn(c1, c2, r, pool=True),
        conv_bn(c2, c3, r, pool=True),
        Residual(conv_bn(c3, c3, r), conv_bn(c3, c3, r)),
        *classifier(c3, r.network, num_classes),
    )


def conv_group(c_in, c_out, r):
    """Jordan's block (airbench94's ConvGroup), or at block_depth 3 airbench96's (residual_group)."""
    net, bn = r.network, r.batch_norm
    first = [conv(c_in, c_out, net), nn.MaxPool2d(2), batch_norm(c_out, bn), activation(net)]
    if net.block_depth == 3:
        return residual_group(first, c_out, r)
    return nn.Sequential(*first, conv(c_out, c_out, net), batch_norm(c_out, bn), activation(net))


def residual_group(first, c, r):
    """airbench96's block: the layers `first`, then x <- act(x + BN(conv(act(BN(conv(x))))))."""
    unit = lambda: [conv(c, c, r.network), batch_norm(c, r.batch_norm)]
    return nn.Sequential(*first, Residual(*unit(), activation(r.network), *unit(), act=activation(r.network)))


def fastnet(r, num_classes=10):
    """Jordan's (2024) network: patch whitening, conv groups, classifier."""
    net, w = r.network, r.whitening
    white = Whitening(w) if w else nn.Conv2d(3, 2 * 3 * 2 ** 2, 2, bias=True)  # else a trainable conv of its shape
    c = [white.out_channels, *widths(net, net.block_widths)]
    groups = [conv_group(c_in, c_out, r) for c_in, c_out in pairwise(c)]
    return nn.Sequential(white, activation(net, w.act if w else ""), *groups, *classifier(c[-1], net, num_classes))


class PreActBlock(nn.Module):
    """Myrtle's pre-activation block (experiments.ipynb): bn-relu, then conv-bn-relu-conv, plus a shortcut that
    starts from the bn-relu output (the identity, or a strided 1×1 conv when the shape changes)."""

    def __init__(self, c_in, c_out, stride, r):
        super().__init__()
        self.bn1, self.bn2 = batch_norm(c_in, r.batch_norm), batch_norm(c_out, r.batch_norm)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.act = activation(r.network)
        self.shortcut = None if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        out = self.act(self.bn1(x))
        shortcut = out if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        return self.conv2(self.act(self.bn2(out))) + shortcut


class ConcatPool(nn.Module):
    """Global max- and average-pooling, concatenated (Myrtle's ResNet-18 classifier)."""

    def forward(self, x):
        return torch.cat([x.amax((2, 3)), x.mean((2, 3))], 1)


def resnet18(r, num_classes=10):
    """Myrtle's ResNet-18, the baseline of their series (experiments.ipynb, DAWN_net): a 3x3 conv of 64 channels
    (no batch norm), four stages of two PreActBlocks of 64/128/256/256 channels (strides 1, 2, 2, 2), then
    concatenated max- and average-pooling into a 512-wide linear layer with bias. 5,205,834 parameters."""
    c = widths(r.network, (64, 128, 256, 256))
    layers, c_in = [nn.Conv2d(3, c[0], 3, 1, 1, bias=False)], c[0]
    for c_out, stride in zip(c, (1, 2, 2, 2)):
        layers += [PreActBlock(c_in, c_out, stride, r), PreActBlock(c_out, c_out, 1, r)]
        c_in = c_out
    layers += [ConcatPool(), nn.Linear(2 * c_in, num_classes), Mul(r.network.output_scale)]
    return nn.Sequential(*layers)


MODELS = {"resnet9": resnet9, "resnet18": resnet18, "fastnet": fastnet}


def build_model(r, device, *, num_classes=10):
    """The network of recipe r on device, in the device's memory format."""
    return MODELS[r.network.model](r, num_classes).to(device, memory_format=devices.memory_format(device))


def autocast_weights(model):
    """The parameters autocast casts to its dtype wherever it runs them: every convolution's and linear layer's weight
    and bias (batch norm's scales and biases run in float32, as torch.autocast leaves them)."""
    return [p for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) for p in m.parameters(recurse=False)]


def hold_weights(model, dtype):
    """model's autocast_weights held in dtype from now on (their storage made once, here: the addresses CUDA graphs
    record), so that no step casts them; the float32 values they are rounded from kept by optim.MasterWeights."""
    for p in autocast_weights(model):
        p.data = p.data.to(dtype)
    return model


def pools_to_one_pixel(r, side):
    """Whether recipe r's network takes side x side images down to the 1x1 map its linear head reads. Shape
    arithmetic, equal to a forward (tested): a forward on the meta device would import torch's compiler at every
    start."""
    net, w = r.network, r.whitening
    if net.model == "resnet18":          # strided 3x3 convolutions of padding 1, then a global pool
        return side >= 1
    if w:
        side += 2 * w.pad - w.size + 1
    elif net.model == "fastnet":
        side -= 1                        # the 2x2 trainable stand-in for the whitening layer, unpadded
    for _ in range(3 if net.model == "resnet9" else len(net.block_widths)):
        side //= 2                       # 2x2 max-pools: a 1x1 map pools to nothing
    if net.global_max_pool:
        return side >= 1
    window = FINAL_POOL_WINDOWS[net.model]
    return window <= side < 2 * window   # a fixed window pools one point only from these


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

TTA_VIEWS = ("none", "flip", "flip_translate")


@dataclass(frozen=True, kw_only=True)
class TTASettings:
    """Test-time augmentation of the final evaluation, of every image or of the least sure."""
    PREFIX = "tta"
    OFF = ("views", "none")
    views: str = knob("flip", choices=TTA_VIEWS, flag="tta", doc="the final evaluation's views of each test image")
    fraction: float = knob(1.0, above=0, high=1, doc="the share of test images, least sure first, given every view")
    weights: str = knob("airbench", choices=("airbench", "equal"),
                        doc="airbench: image and mirror count twice the shifted views; equal: their mean (the record)")


def tta_views(x, mode, weights="airbench"):
    """(weight, view) pairs: x, its mirror, with flip_translate both shifted a pixel up-left and down-right."""
    check_tta_views(mode)
    views = [x] if mode == "none" else [x, x.flip(3)]
    if mode == "flip_translate":
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        views += [v for shifted in (padded[..., :-2, :-2], padded[..., 2:, 2:]) for v in (shifted, shifted.flip(3))]
    counts = [2 if i < 2 and weights == "airbench" else 1 for i in range(len(views))]
    return [(c / sum(counts), v) for c, v in zip(counts, views)]


def check_tta_views(mode):
    if mode not in TTA_VIEWS:
        raise ValueError(f"tta must be none, flip or flip_translate, not {mode!r}")


def tta_logits(model, images, tta=None, *, batch_size=1000):
    """float32 (float64) logits of images; with tta, of the tta.fraction least sure (smallest top softmax) the
    views' weighted sum, the plain pass standing for the first view's:
        logits(x) = sum_v w_v model(v(x))"""
    def forward(x):  # the last batch zero-padded, every view in one memory format: one shape, one graph
        padded = torch.cat([x, x.new_zeros((batch_size - len(x), *x.shape[1:]))]) if len(x) < batch_size else x
        logits = model(padded.contiguous(memory_format=devices.memory_format(x.device)))[:len(x)]
        return logits.to(devices.wide_dtype(logits.dtype), copy=True)  # a CUDA graph's replay overwrites its outputs
    logits = torch.cat([forward(x) for x in images.split(batch_size)])
    n = round(tta.fraction * len(images)) if tta else 0
    if n:
        some = slice(None) if n == len(images) else logits.softmax(1).amax(1).topk(n, largest=False).indices
        sums = []
        for x, plain in zip(images[some].split(batch_size), logits[some].split(batch_size)):
            (w, _), *rest = tta_views(x, tta.views, tta.weights)
            sums.append(sum((v * forward(view) for v, view in rest), w * plain))
        logits[some] = torch.cat(sums)
    return logits


@torch.no_grad()
def loss_and_accuracy(model, images, labels, *, dtype=torch.float32, batch_size=1000, tta=None):
    """Mean loss and accuracy of model on images, with test-time augmentation tta (tta_logits)."""
    was_training = model.training
    with devices.autocast(images.device, dtype):
        logits = tta_logits(model.eval(), images, tta, batch_size=min(batch_size, len(images)))
    model.train(was_training)
    loss, correct = torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                                 (logits.argmax(1) == labels).sum().float()]).tolist()
    return loss / len(images), correct / len(images)
