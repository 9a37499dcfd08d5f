"""The optimisers of optim.py, one step at a time against their formulas, on the CPU."""
import math
import sys
from dataclasses import replace

import pytest
import torch

import imagenet_models
import optim
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from op_counts import LoopLARS, LoopRMSpropToSGD, fused_sgd, step_operations  # noqa: E402


def test_lars_one_step_by_hand():
    torch.manual_seed(3)
    w, b = torch.randn(4, 3), torch.randn(4)
    gw, gb = torch.randn(4, 3), torch.randn(4)
    pw, pb = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    opt = imagenet_models.LARS([pw, pb], lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.001)
    for _ in range(2):  # the second step uses the momentum buffer
        pw.grad, pb.grad = gw.clone(), gb.clone()
        opt.step()
    vw = vb = 0
    for _ in range(2):
        local = 0.001 * w.norm() / (gw.norm() + 0.01 * w.norm())
        vw = 0.9 * vw + 0.5 * local * (gw + 0.01 * w)
        vb = 0.9 * vb + 0.5 * gb  # 1-D: no trust ratio, no decay
        w, b = w - vw, b - vb
    torch.testing.assert_close(pw.detach(), w)
    torch.testing.assert_close(pb.detach(), b)


def test_alpha_sgd_at_its_knots():
    c, p = 10, 5
    assert imagenet_models.alpha_sgd(c, c, p) == 0.5
    assert imagenet_models.alpha_sgd(c - p / 2, c, p) == pytest.approx(0.5 * math.exp(-1))
    assert imagenet_models.alpha_sgd(c + p / 4, c, p) == pytest.approx(0.75)
    assert imagenet_models.alpha_sgd(c + p / 2, c, p) == 1.0 == imagenet_models.alpha_sgd(90, c, p)
    assert imagenet_models.alpha_sgd(0, c, p) == pytest.approx(0.5 * math.exp(-4))
    # continuous with a continuous slope at the centre (the ELU shape)
    h = 1e-6
    assert imagenet_models.alpha_sgd(c - h, c, p) == pytest.approx(0.5, abs=1e-6)
    assert ((imagenet_models.alpha_sgd(c, c, p) - imagenet_models.alpha_sgd(c - h, c, p)) / h
            == pytest.approx(1 / p, rel=1e-4))


def test_rmsprop_to_sgd_is_rmsprop_then_sgd():
    g = torch.tensor([0.5, -2.0])
    # long after the warm-up: momentum SGD, w -= lr * g
    p = torch.nn.Parameter(torch.zeros(2))
    opt = imagenet_models.RMSpropToSGD([p], lr=0.1, lr_rmsprop=0.01, beta_center=-10, beta_period=1)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -0.1 * g)
    # far before beta_center: RMSprop, w -= lr_rmsprop * g / (sqrt((1 - mu2) g^2) + eps)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = imagenet_models.RMSpropToSGD([p], lr=0.1, lr_rmsprop=0.01, beta_center=1000, beta_period=1)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -0.01 * g / (0.01 ** 0.5 * g.abs() + 1e-8))
    assert opt.state_dict()["param_groups"][0]["epoch"] == 0.0     # the loop's clock, carried in checkpoints


def rmsprop_to_sgd_by_formula(grads, rates, epochs, lr_rms, mu1=0.9, mu2=0.99, eps=1e-8, c=2.0, period=2.0):
    """The parameter after each step, evaluated directly (no momentum buffer): step k contributes
        s_k = (η_k α_k + η_rms (1 - α_k) / (√m_k + ε)) g_k,   m_k = Σ_{i<=k} (1 - μ2) μ2^(k-i) g_i²,
    with α_k = alpha_sgd(epoch_k), to every later step t as μ1^(t-k) s_k: the rates of its own step. That is
    Δ ← μ1 Δ - (α_SGD + α_RMSprop / (√m + ε)) g, θ ← θ + η Δ with a schedule change leaving Δ's past alone."""
    steps, out = [], []
    for k, g in enumerate(grads):
        m = sum((1 - mu2) * mu2 ** (k - i) * grads[i] ** 2 for i in range(k + 1))
        a = imagenet_models.alpha_sgd(epochs[k], c, period)
        steps.append((rates[k] * a + lr_rms * (1 - a) / (m.sqrt() + eps)) * g)
        out.append(-sum(mu1 ** (t - k) * steps[k] for t in range(len(steps)) for k in range(t + 1)))
    return out


@pytest.mark.parametrize("case", ["constant rate", "warm-up"])
def test_rmsprop_to_sgd_follows_its_formula_when_the_rate_changes(case):
    torch.manual_seed(0)
    grads = [torch.randn(3, dtype=torch.float64) for _ in range(8)]
    rates = [0.4] * 8 if case == "constant rate" else [0.4 * (k + 1) / 8 for k in range(8)]
    epochs = [float(k) for k in range(8)]        # the loop's clock, one step an epoch: through all of alpha_sgd
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = imagenet_models.RMSpropToSGD([p], lr=rates[0], lr_rmsprop=0.01, beta_center=2.0, beta_period=2.0)
    for k, (g, want) in enumerate(zip(grads, rmsprop_to_sgd_by_formula(grads, rates, epochs, 0.01))):
        opt.param_groups[0].update(lr=rates[k], epoch=epochs[k])
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), want, rtol=1e-10, atol=1e-12, msg=f"step {k + 1}")


def filter_banks():
    """Conv filter banks with gradients, in the shapes of a small network: two of them alike."""
    torch.manual_seed(5)
    shapes = [(16, 8, 3, 3), (16, 16, 3, 3), (32, 16, 3, 3), (32, 32, 3, 3), (32, 32, 3, 3)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_muon_makes_its_momentum_buffers_once(monkeypatch):
    params = filter_banks()
    made, real = [], torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: (made.append(1), real(*a, **k))[1])
    opt = optim.Muon(params, lr=0.1)
    buffers = [opt.state[p]["momentum"] for p in params]
    for _ in range(3):
        opt.step()
    assert len(made) == len(params)
    assert all(opt.state[p]["momentum"] is b for p, b in zip(params, buffers))


@pytest.mark.parametrize("without", [[0], [3], [1, 4]])
def test_a_group_steps_whole_or_not_at_all_and_some_grads_missing_is_one_error(without):
    """No gradient anywhere in a group (a detached one): skipped, nothing moves; some missing, wherever they are in the
    group: one ValueError before anything moves, none of the others' gradients silently dropped."""
    params = filter_banks()
    opt, before = optim.Muon(params, lr=0.1), [p.detach().clone() for p in params]
    for i in without:
        params[i].grad = None
    with pytest.raises(ValueError, match=r"^SGDAndMuon: some parameters of group 'filters' have no gradient, others "
                                         r"have one; it steps a group whole \(leave the unused ones out of it\)$"):
        opt.step()
    for p in params:
        p.grad = None
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and opt.muon_steps == 0


@pytest.mark.parametrize("batched", [False, True])
def test_newton_schulz_compiled_equals_eager(batched):
    torch._dynamo.reset()
    mats = [p.grad.reshape(len(p), -1) for p in filter_banks()]
    fn = optim.newton_schulz_padded if batched else optim.newton_schulz
    eager = fn(mats) if batched else [fn(m) for m in mats]
    ns = optim.compiled(fn, "aot_eager")
    got = ns(mats) if batched else [ns(m) for m in mats]
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-2)      # bf16 iterations: a rounding step is 2^-8 of 1


@pytest.mark.slow
def test_newton_schulz_compiled_by_inductor_equals_eager_within_bf16_rounding():
    torch._dynamo.reset()
    mats = [p.grad.reshape(len(p), -1) for p in filter_banks()]
    got, eager = optim.compiled(optim.newton_schulz_padded)(mats), optim.newton_schulz_padded(mats)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=3e-2)


@pytest.mark.parametrize("batched", [True, False])
def test_compiled_muon_is_one_graph_and_steps_as_eager(batched):
    """The whole step one graph, Newton–Schulz batched or one bank at a time."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    params, twins = filter_banks(), filter_banks()
    compiled = optim.Muon(params, lr=0.1, batched=batched)
    compiled.function = optim.compiled(optim.sgd_muon_step, "eager")
    eager = optim.Muon(twins, lr=0.1, batched=batched)
    assert eager.function is optim.sgd_muon_step
    for _ in range(4):
        compiled.step()
        eager.step()
    assert counters["stats"]["unique_graphs"] == 1
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_sgd_takes_the_options_of_its_parameters_device(monkeypatch):
    import cifar10_fast as cf
    import imagenet_fast as inf
    changes = dict(momentum=0.9, nesterov=True)
    makers = {"imagenet": lambda model: inf.imagenet_optimizer(model, inf.recipe("tiny", **changes)),
              "cifar": lambda model: optim.make_optimizers(model, cf.recipe("myrtle24", **changes))[0]}
    for name, make in makers.items():
        model = torch.nn.Linear(2, 2)
        seen = []
        monkeypatch.setattr(optim.devices, "sgd_options", lambda device: (seen.append(device), {"foreach": False})[1])
        opt = make(model)
        assert seen == [torch.device("cpu")] and opt.defaults["foreach"] is False, name
        monkeypatch.undo()
        assert not make(model).defaults["fused"], name


# ---------------------------------------------------------------------------------------------------------------
# LARS and RMSprop-to-SGD with foreach operations: the numbers of the per-tensor loops they replaced, and the
# operations a ResNet-50 step takes

def tensors_of_a_network(seed):
    """Parameters of the shapes a ResNet holds (filters, a matrix, 1-D scales and biases; one all zero, so its trust
    ratio falls back to 1), two groups (with and without decay) as imagenet_fast makes them."""
    torch.manual_seed(seed)
    shapes = [(16, 3, 3, 3), (32, 16, 3, 3), (10, 32), (16,), (16,), (10,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    params[1].data.zero_()
    return params, [dict(params=params[:3], weight_decay=1e-2), dict(params=params[3:], weight_decay=0.0)]


@pytest.mark.parametrize("ours, reference, options", [
    (imagenet_models.LARS, LoopLARS, dict(trust_coefficient=0.02)),
    (imagenet_models.RMSpropToSGD, LoopRMSpropToSGD, dict(lr_rmsprop=0.01, beta_center=2.0, beta_period=2.0))],
    ids=["lars", "rmsprop_to_sgd"])
def test_the_foreach_optimisers_step_as_their_loops_did(ours, reference, options):
    """Five steps through the RMSprop-to-SGD hand-over, with a rate that changes: the same parameters and state as
    the per-tensor loops, bit for bit on the CPU (the same operations in the same order)."""
    ours, ref = (cls(tensors_of_a_network(0)[1], lr=0.7, momentum=0.9, **options) for cls in (ours, reference))
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g)
                 for p in ours.param_groups[0]["params"] + ours.param_groups[1]["params"]]
        for opt in (ours, ref):
            for group in opt.param_groups:
                group.update(lr=0.7 * (step + 1) / 5, epoch=float(step))
            for p, grad in zip(opt.param_groups[0]["params"] + opt.param_groups[1]["params"], grads):
                p.grad = grad.clone()
            opt.step()
    mine, theirs = ours.param_groups, ref.param_groups
    for a, b in zip(mine[0]["params"] + mine[1]["params"], theirs[0]["params"] + theirs[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key in ours.state[a]:
            torch.testing.assert_close(ours.state[a][key], ref.state[b][key], rtol=0, atol=0)


def test_lars_and_rmsprop_to_sgd_add_a_few_operations_to_a_resnet50_step_not_several_per_tensor():
    """Counted on the CPU (ResNet-50 without BlurPool, as the cluster recipes train it; benchmarks/op_counts.py
    writes the counts): as foreach operations, LARS and RMSprop-to-SGD add a few dozen operations to a step whatever
    the number of tensors, as fused SGD adds a few; the per-tensor loops they replaced added several a tensor."""
    backward, sgd = step_operations("goyal_8k", fused_sgd)
    _, lars = step_operations("goyal_8k", lars=True)
    _, rmsprop = step_operations("goyal_8k", rmsprop=True)
    assert sgd - backward <= 10 and lars - backward <= 30 and rmsprop - backward <= 30, (backward, sgd, lars, rmsprop)
    assert lars <= 770 and rmsprop <= 770


# ---------------------------------------------------------------------------------------------------------------
# SGD and Muon as one step (optim.SGDAndMuon): torch.optim.SGD's numbers, compiled as eager, one graph whatever the rate

def steps_of(recipe, *, backend=None, steps=8, ddp=False, as_one=False):
    """The parameters of recipe's network (width 1/16, float64) after `steps` steps of random gradients at a falling
    rate, its whitening bias trained for 3 (then detached, or under DDP kept at rate 0), 4 steps an epoch; and the
    optimisers. backend: SGDAndMuon compiled with it (else eager); as_one: a recipe without Muon stepped by an
    SGDAndMuon of torch.optim.SGD's groups."""
    import cifar10_fast as cf
    import torch_backend as tb
    r = cf.recipe(recipe, width=1 / 16)
    torch.manual_seed(0)
    net = tb.build_model(r, "cpu").double()
    bias = replace(tb.whitening_bias(net), until_step=3)
    opts = optim.make_optimizers(net, r, steps_per_epoch=4, own_rates=[bias])
    if as_one:
        opts = [optim.SGDAndMuon([dict(g) for g in opts[0].param_groups], momentum=r.sgd.momentum,
                                 nesterov=r.sgd.nesterov)]
    if backend:
        opts[0].function = optim.compiled(optim.sgd_muon_step, backend)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        optim.set_lr(opts, max(r.lr.values) * (1 - step / 10), step)
        bias.param.requires_grad_(step < 3 or ddp)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) if p.requires_grad else None
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach() for p in net.parameters()], opts


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_sgd_and_muon_steps_sgds_groups_as_torch_sgd(backend, one_thread):
    """fast94's groups (no Muon), its whitening bias at a rate of its own for 3 steps, then detached: equal within
    1e-12 (relative to each tensor's largest value) in float64, eager and through dynamo's graph: the rate, a tensor,
    scales a step before it is added, where torch.optim.SGD's alpha adds in one rounding."""
    torch._dynamo.reset()
    ref, (sgd,) = steps_of("fast94")
    got, (one,) = steps_of("fast94", backend=backend, as_one=True)
    assert isinstance(one, optim.SGDAndMuon) and isinstance(sgd, torch.optim.SGD)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * b.abs().max().item())


@pytest.mark.parametrize("recipe, ddp", [("fast94_next", False), ("fast94_next", True), ("fast94_muon", False)])
def test_sgd_and_muon_compiled_steps_as_eager(recipe, ddp, one_thread):
    """In float64, Muon renormalising (every step in fast94_muon, at steps 2 and 6 in fast94_next), the whitening
    bias detached after 3 steps or under DDP kept at rate 0: through dynamo's graph as eager within 1e-12."""
    torch._dynamo.reset()
    ref, (eager,) = steps_of(recipe, ddp=ddp)
    got, (one,) = steps_of(recipe, backend="aot_eager", ddp=ddp)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * b.abs().max().item())
    assert one.last_renorm == eager.last_renorm > 0          # the same last renormalisation


def test_sgd_and_muon_as_one_step_compile_once_whatever_the_rate_and_again_once_the_whitening_bias_is_detached(
        one_thread):
    """fast94_next's rate changing every step, Muon renormalising at some of them: two graphs, the second when the
    whitening bias loses its gradient; a further step at other rates recompiles nothing."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    _, (opt,) = steps_of("fast94_next", backend="aot_eager")
    assert counters["stats"]["unique_graphs"] == 2
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lr in (0.3, 0.01):
            optim.set_lr([opt], lr, step=20)
            for p in params:
                p.grad = torch.ones_like(p) if p.requires_grad else None
            opt.step()
    assert counters["stats"]["unique_graphs"] == 2


def test_set_lr_fills_the_one_steps_rates_and_leaves_its_groups_alone():
    import cifar10_fast as cf
    import torch_backend as tb
    r = cf.recipe("fast94_lowflop", width=1 / 16)
    net = tb.build_model(r, "cpu")
    (opt,) = optim.make_optimizers(net, r, steps_per_epoch=10,
                                   own_rates=[replace(tb.whitening_bias(net), until_step=2)])
    groups = [dict(g) for g in opt.param_groups]
    bias, = [g for g in opt.param_groups if g["rate"] is not opt.lr]
    bias_lr_tensor = bias["rate"]
    for step, lr, bias_lr in ((0, 0.5, bias["peak"] * bias["lr_unit"]), (1, 0.4, bias["peak"] * bias["lr_unit"] / 2),
                              (2, 0.3, 0.0)):
        optim.set_lr([opt], lr, step)
        assert (opt.lr.item(), bias_lr_tensor.item()) == (lr, bias_lr)
    assert [dict(g) for g in opt.param_groups] == groups and bias["params"] == [tb.whitening_bias(net).param]


@pytest.mark.slow
def test_sgd_and_muon_compiled_by_inductor_steps_as_eager(one_thread):
    torch._dynamo.reset()
    ref, _ = steps_of("fast94_next")
    got, _ = steps_of("fast94_next", backend="inductor")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * b.abs().max().item())
