"""The optimisers and schedules of optim.py, one step at a time against their formulas, on the CPU."""
import math

import pytest
import torch

import optim


def test_linear_scaling():
    assert optim.linear_scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert optim.linear_scaled_lr(0.4, 2048, base_batch=512) == pytest.approx(1.6)


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
    assert opt.state_dict()["param_groups"][0]["step"] == 1


def test_slow_start_lr():
    assert optim.slow_start_lr(0, 3.2) == pytest.approx(1.6)
    assert optim.slow_start_lr(5, 3.2) == 3.2
    assert optim.slow_start_lr(30, 3.2) == pytest.approx(0.32)
    assert optim.slow_start_lr(85, 3.2) == pytest.approx(0.0032)


def test_batch_size_schedule():
    s = optim.BatchSizeSchedule([(0, 16384), (30, 32768), (60, 65536)])
    assert [s.batch(e) for e in (0, 29, 30, 59, 60, 89)] == [16384, 16384, 32768, 32768, 65536, 65536]
    assert s.lr_scale(45) == 2.0 and s.lr_scale(0) == 1.0
    assert s.per_rank(60, 1024) == 64
    for knots, msg in [([], "must start at epoch 0"), ([(1, 8)], "must start at epoch 0"),
                       ([(0, 0)], "batch sizes must be positive"),
                       ([(0, 8), (5, 16), (5, 32)], "epochs must increase strictly"),
                       ([(0, 16), (5, 8)], "must not shrink the batch")]:
        with pytest.raises(ValueError, match=msg):
            optim.BatchSizeSchedule(knots)
