"""The optimisers of optim.py, one step at a time against their formulas, on the CPU."""
import math

import pytest
import torch

import optim


def test_lars_one_step_by_hand():
    torch.manual_seed(3)
    w, b = torch.randn(4, 3), torch.randn(4)
    gw, gb = torch.randn(4, 3), torch.randn(4)
    pw, pb = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    opt = optim.LARS([pw, pb], lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.001)
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
    assert optim.alpha_sgd(c, c, p) == 0.5
    assert optim.alpha_sgd(c - p / 2, c, p) == pytest.approx(0.5 * math.exp(-1))
    assert optim.alpha_sgd(c + p / 4, c, p) == pytest.approx(0.75)
    assert optim.alpha_sgd(c + p / 2, c, p) == 1.0 == optim.alpha_sgd(90, c, p)
    assert optim.alpha_sgd(0, c, p) == pytest.approx(0.5 * math.exp(-4))
    # continuous with a continuous slope at the centre (the ELU shape)
    h = 1e-6
    assert optim.alpha_sgd(c - h, c, p) == pytest.approx(0.5, abs=1e-6)
    assert (optim.alpha_sgd(c, c, p) - optim.alpha_sgd(c - h, c, p)) / h == pytest.approx(1 / p, rel=1e-4)


def test_rmsprop_to_sgd_is_rmsprop_then_sgd():
    g = torch.tensor([0.5, -2.0])
    # long after the warm-up: momentum SGD, w -= lr * g
    p = torch.nn.Parameter(torch.zeros(2))
    opt = optim.RMSpropToSGD([p], lr=0.1, lr_rmsprop=0.01, beta_center=-10, beta_period=1)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -0.1 * g)
    # far before beta_center: RMSprop, w -= lr_rmsprop * g / (sqrt((1 - mu2) g^2) + eps)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = optim.RMSpropToSGD([p], lr=0.1, lr_rmsprop=0.01, beta_center=1000, beta_period=1)
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
        a = optim.alpha_sgd(epochs[k], c, period)
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
    opt = optim.RMSpropToSGD([p], lr=rates[0], lr_rmsprop=0.01, beta_center=2.0, beta_period=2.0)
    for k, (g, want) in enumerate(zip(grads, rmsprop_to_sgd_by_formula(grads, rates, epochs, 0.01))):
        opt.param_groups[0].update(lr=rates[k], epoch=epochs[k])
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), want, rtol=1e-10, atol=1e-12, msg=f"step {k + 1}")


