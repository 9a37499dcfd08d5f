"""The defining property of every speed technique of the fast recipes, on the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

import cifar10_fast as cf
import cifar_data as cd
import optim
import torch_backend as tb

CPU = torch.device("cpu")


def correlated_images(n=300, size=16):
    torch.manual_seed(0)
    x = F.avg_pool2d(torch.randn(n, 3, size + 2, size + 2), 3, 1)      # neighbouring pixels correlate
    return x * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1) + 0.3 * x[:, [1, 2, 0]]


def test_2x2_whitening_with_both_signs_gives_identity_covariance():
    x = correlated_images()
    w = tb.Whitening(2, eps=1e-6, both_signs=True, bias=True)
    w.fit(x)
    assert w.weight.shape == (24, 3, 2, 2) and not w.weight.requires_grad and w.bias.requires_grad
    out = F.conv2d(x, w.weight)
    z = out.permute(0, 2, 3, 1).reshape(-1, 24)
    torch.testing.assert_close(torch.cov(z[:, :12].T), torch.eye(12), atol=0.02, rtol=0)
    torch.testing.assert_close(z[:, 12:], -z[:, :12])                   # the negated copies


def test_fastnet_architecture_and_parameter_count():
    hp = cf.recipe("fast94")
    net = tb.build_model(hp, CPU)
    # whitening 24·3·2·2 + 24 bias; convs 24·64·9 + 64·64·9 + 64·256·9 + 256·256·9 + 2·256·256·9;
    # linear 256·10; batch norm 2·(2·64 + 4·256)
    expected = 288 + 24 + 13824 + 36864 + 147456 + 589824 + 1179648 + 2560 + 2304
    assert tb.count_parameters(net) == expected == 1_972_792
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(not m.weight.requires_grad and m.momentum == 0.4 and m.eps == 1e-12 for m in bns)
    deep = tb.build_model(cf.recipe("fast96"), CPU)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in deep.modules()) == 1 + 3 * 3


def test_dirac_init_passes_the_input_through():
    hp = cf.recipe("fast94")
    layer = tb.conv(16, 32, hp)
    x = torch.randn(2, 16, 8, 8)
    torch.testing.assert_close(layer(x)[:, :16], x)
    assert layer(x)[:, 16:].abs().sum() > 0                              # the rest stays random


def test_muon_orthogonalises_its_update():
    torch.manual_seed(0)
    for shape in [(64, 27), (256, 576), (576, 256)]:
        s = torch.linalg.svdvals(optim.newton_schulz(torch.randn(*shape)).float())
        assert 0.6 < s.min() and s.max() < 1.25, (shape, s.min(), s.max())
    # one Muon step on a conv filter bank moves it by lr × (orthogonalised momentum)
    w = torch.nn.Parameter(torch.randn(32, 16, 3, 3))
    w.grad = torch.randn_like(w) * 1e-3                                   # scale must not matter
    w0 = w.detach().clone()
    optim.Muon([w], lr=0.1, momentum=0.0, nesterov=False).step()
    s = torch.linalg.svdvals((w0 - w.detach()).reshape(32, -1) / 0.1)
    assert 0.6 < s.min() and s.max() < 1.25


def test_muon_takes_the_conv_filters_only():
    hp = cf.recipe("fast94", optimizer="muon", muon_lr=0.2)
    net = tb.build_model(hp, CPU)
    sgd, muon = optim.make_optimizers(net, hp)
    filters = muon.param_groups[0]["params"]
    assert all(p.ndim == 4 for p in filters) and len(filters) == 6
    assert all(p.ndim < 4 for g in sgd.param_groups for p in g["params"])
    optim.set_lr([sgd, muon], max(hp["lr_values"]) / 2)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.1)


def test_alternating_flip_flips_each_image_in_exactly_alternate_epochs():
    n = 1000
    g = torch.Generator().manual_seed(0)
    base = cd.flip_bits(n, g)
    flips = torch.stack([cd.draw_augmentation(n, 32, 0, "alternate", 0, g, epoch, base)["flip"] for epoch in range(6)])
    assert torch.equal(flips[1:], ~flips[:-1])                             # every image changes every epoch
    assert abs(flips[0].float().mean().item() - 0.5) < 0.06


def test_flip_translate_views_are_what_they_claim():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    views = tb.tta_views(x, "flip_translate")
    assert [w for w, _ in views] == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    assert sum(w for w, _ in views) == 1.0
    ident, mirror, up_left, up_left_m, down_right, down_right_m = [v for _, v in views]
    assert torch.equal(ident, x) and torch.equal(mirror, x.flip(3))
    # shifted by one pixel: view[i, j] = x[i - 1, j - 1] inside, reflected at the border
    torch.testing.assert_close(up_left[..., 1:, 1:], x[..., :-1, :-1])
    torch.testing.assert_close(up_left[..., 0, 1:], x[..., 1, :-1])
    torch.testing.assert_close(down_right[..., :-1, :-1], x[..., 1:, 1:])
    assert torch.equal(up_left_m, up_left.flip(3)) and torch.equal(down_right_m, down_right.flip(3))
    assert [w for w, _ in tb.tta_views(x, "flip")] == [0.5, 0.5]
    with pytest.raises(ValueError, match="tta must be none, flip or flip_translate"):
        tb.tta_views(x, "five_crop")


def test_lookahead_matches_its_formula():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    la = tb.Lookahead(model)
    slow = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(2.0)                                            # the fast weights move
    fast = model.weight.detach().clone()
    la.update(model, decay=0.7)
    expected = slow + 0.3 * (fast - slow)
    torch.testing.assert_close(la.slow[0], expected)
    torch.testing.assert_close(model.weight.detach(), expected)           # fast weights restart from slow
    with torch.no_grad():
        model.weight.add_(1.0)
    la.update(model, decay=1.0)                                           # the end: hand over the slow weights
    torch.testing.assert_close(model.weight.detach(), expected)


def test_decoupled_weight_decay_does_not_depend_on_lr_or_bias_multiplier():
    hp = cf.recipe("fast94", width=0.125)
    net = tb.build_model(hp, CPU)
    opts = optim.make_optimizers(net, hp)
    peak = max(hp["lr_values"])
    optim.set_lr(opts, peak * 0.5, epoch=0)
    gain = 1 + 1 / (1 - hp["momentum"])
    groups = {g["name"]: g for g in opts[0].param_groups}
    for g in groups.values():                                             # decay per step: lr × weight_decay
        assert g["lr"] * g["weight_decay"] == pytest.approx(0.5 * hp["weight_decay"] * hp["batch_size"] / (1024 * gain))
    assert groups["bn_biases"]["lr"] == pytest.approx(64 * groups["weights"]["lr"])
    assert groups["weights"]["lr"] == pytest.approx(peak * 0.5 / (1024 * gain))
    optim.set_lr(opts, peak, epoch=3)                                        # whiten_bias_epochs = 3
    assert groups["whiten_bias"]["lr"] == 0.0 and groups["weights"]["lr"] > 0


def test_fractional_epochs_and_lookahead_in_a_short_run():
    torch.manual_seed(0)
    n, bs = 96, 16
    x = torch.randn(n, 3, 36, 36)
    data = {"train_images": x, "train_labels": torch.arange(n) % 10,
            "test_images": x[:32, :, 2:-2, 2:-2], "test_labels": torch.arange(32) % 10}
    hp = cf.recipe("fast94", width=1 / 16, batch_size=bs, epochs=1.5)
    res = tb.train(hp, data, CPU, seed=0, target=2.0)
    assert len(res["rows"]) == 2 and res["time_to_target"] is None
    assert res["time"] == pytest.approx(res["train_time"] + res["final_eval_time"])
    flops = tb.count_flops(hp, data)
    assert flops["train"] == pytest.approx(round(1.5 * (n // bs)) * bs * flops["per_train_image"])
    assert flops["per_test_image"] > 0 and flops["per_train_image"] > 2 * flops["per_test_image"] / 6


def test_fastnet_flops_per_image_match_the_architecture():
    """Forward conv/linear FLOPs of fast94's network, counted by hand: 2·MACs per output."""
    hp = cf.recipe("fast94", tta="none")
    data = {"train_images": torch.zeros(1024, 3, 36, 36), "train_labels": torch.zeros(1024, dtype=torch.long),
            "test_images": torch.zeros(8, 3, 32, 32), "test_labels": torch.zeros(8, dtype=torch.long)}
    macs = (31 * 31 * 24 * 12 + 31 * 31 * 64 * 24 * 9 + 15 * 15 * 64 * 64 * 9 + 15 * 15 * 256 * 64 * 9
            + 7 * 7 * 256 * 256 * 9 + 7 * 7 * 256 * 256 * 9 + 3 * 3 * 256 * 256 * 9 + 256 * 10)
    assert tb.count_flops(hp, data)["per_test_image"] == 2 * macs


def test_compiled_and_eager_steps_give_the_same_loss():
    hp = cf.recipe("fast94", width=1 / 16, batch_size=16)
    torch.manual_seed(0)
    net = tb.build_model(hp, CPU)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 10
    tb.fit_whitening(net, x, 32)
    twin = copy.deepcopy(net)
    forward = torch.compile(twin)
    eager, compiled = optim.make_optimizers(net, hp), optim.make_optimizers(twin, hp)
    for opts in (eager, compiled):
        optim.set_lr(opts, max(hp["lr_values"]))
    for _ in range(3):
        _, a = tb.train_step(net, eager, x, y, hp, torch.float32)
        _, b = tb.train_step(forward, compiled, x, y, hp, torch.float32)
        assert b.item() == pytest.approx(a.item(), rel=1e-4)
    for p, q in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)


def tiny_data(n, size=16, pad=2, n_test=16):
    torch.manual_seed(0)
    x = torch.randn(n, 3, size + 2 * pad, size + 2 * pad)
    return {"train_images": x, "train_labels": torch.arange(n) % 10,
            "test_images": x[:n_test, :, pad:-pad, pad:-pad], "test_labels": torch.arange(n_test) % 10}


def test_lookahead_runs_its_last_scheduled_update_before_the_hand_over(monkeypatch):
    """airbench94: when the step count is a multiple of 5, the scheduled averaging still runs at the last step
    (decay 0.95^5), and only then the hand-over with decay 1; replacing it would drop the last 5 steps."""
    decays = []

    class Recording(tb.Lookahead):
        def update(self, model, decay):
            decays.append(decay)
            super().update(model, decay)
    monkeypatch.setattr(tb, "Lookahead", Recording)
    hp = cf.recipe("fast94", width=1 / 16, batch_size=16, epochs=2)      # 5 steps an epoch, 10 in all
    tb.train(hp, tiny_data(80), CPU, target=2.0)
    rho = 0.95 ** 5
    assert decays == pytest.approx([rho * (5 / 10) ** 3, rho, 1.0])


def test_total_steps_round_up_as_airbench(monkeypatch):
    """airbench: ceil(epochs × steps per epoch) steps (9.9 × 48 = 475.2: 476 steps), in training and in the count."""
    steps = []
    step = tb.train_step
    monkeypatch.setattr(tb, "train_step", lambda *a: steps.append(1) or step(*a))
    hp = cf.recipe("fast94", width=1 / 16, batch_size=16, epochs=1.1)    # 4 steps an epoch: 4.4 -> 5
    data = tiny_data(64)
    res = tb.train(hp, data, CPU, target=2.0)
    assert len(steps) == 5 and len(res["rows"]) == 2
    flops = tb.count_flops(hp, data)
    assert flops["train"] == pytest.approx(5 * 16 * flops["per_train_image"])


def patch_covariance_inverse(images, k, centre, ddof, eps):
    p = images.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k).double()
    if centre:
        p = p - p.mean(0)
    cov = p.T @ p / (len(p) - ddof)
    return torch.linalg.inv(cov + eps * torch.eye(len(cov), dtype=torch.float64))


def whitening_filters(hp, images):
    net = tb.build_model(hp, CPU)
    tb.fit_whitening(net, images, images.shape[-1])
    w = next(m for m in net.modules() if isinstance(m, tb.Whitening)).weight
    k = w.shape[-1]
    return w[:3 * k * k].reshape(3 * k * k, -1).double()


def test_whitening_fit_follows_each_reference():
    """Each filter is an eigenvector over sqrt(eigenvalue + eps), so FᵀF = (C + eps·I)⁻¹ whatever the signs and
    order eigh picks: the check that the covariance C is the reference's."""
    x = correlated_images(n=6000, size=6) + torch.tensor([0.5, -0.3, 0.2]).view(1, 3, 1, 1)   # centring matters
    f = whitening_filters(cf.recipe("fast94", width=1 / 16), x)
    # airbench94: the first 5,000 images, uncentred, divided by n
    torch.testing.assert_close(f.T @ f, patch_covariance_inverse(x[:5000], 2, False, 0, 5e-4), rtol=2e-4, atol=1e-3)
    f = whitening_filters(cf.recipe("myrtle10", width=1 / 16), x)
    # today's myrtle10: up to 10,000 images, centred, divided by n - 1
    torch.testing.assert_close(f.T @ f, patch_covariance_inverse(x, 3, True, 1, 1e-2), rtol=2e-4, atol=1e-3)
