"""The defining property of every speed technique of the fast recipes, on the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

import cifar10_fast as cf
import cifar_data as cd
import distributed as D
import optim
import settings
import torch_backend as tb
import training as T
from conftest import synthetic_arrays, train_once
from core import UsageError

CPU = torch.device("cpu")


def correlated_images(n=300, size=16):
    torch.manual_seed(0)
    x = F.avg_pool2d(torch.randn(n, 3, size + 2, size + 2), 3, 1)      # neighbouring pixels correlate
    return x * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1) + 0.3 * x[:, [1, 2, 0]]


def test_2x2_whitening_with_both_signs_gives_identity_covariance():
    x = correlated_images()
    w = tb.Whitening(tb.WhiteningSettings(size=2, pad=0, eps=1e-6, both_signs=True, bias=tb.WhiteningBiasSettings()))
    tb.fit_whitening(w, x, x.shape[-2:])
    assert w.weight.shape == (24, 3, 2, 2) and not w.weight.requires_grad and w.bias.requires_grad
    out = F.conv2d(x, w.weight)
    z = out.permute(0, 2, 3, 1).reshape(-1, 24)
    torch.testing.assert_close(torch.cov(z[:, :12].T), torch.eye(12), atol=0.02, rtol=0)
    torch.testing.assert_close(z[:, 12:], -z[:, :12])                   # the negated copies


def test_fastnet_architecture_and_parameter_count():
    net = tb.build_model(cf.recipe("fast94"), CPU)
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
    layer = tb.conv(16, 32, cf.recipe("fast94").network)
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


def step_sizes(opt):
    """{group name: its step size}: an SGDAndMuon's rate (a 0-d tensor) × the group's unit."""
    return {g["name"]: g["rate"].item() * g["unit"] for g in opt.param_groups}


def test_muon_takes_the_conv_filters_only():
    r = cf.recipe("fast94", muon=True, muon_lr=0.2)
    net = tb.build_model(r, CPU)
    (opt,) = optim.make_optimizers(net, r, own_rates=[tb.whitening_bias(net)])
    groups = {g["name"]: g for g in opt.param_groups}
    assert all(p.ndim == 4 for p in groups.pop("filters")["params"]) and len(opt.param_groups[-1]["params"]) == 6
    assert all(p.ndim < 4 for g in groups.values() for p in g["params"])
    optim.set_lr([opt], max(r.lr.values) / 2)
    assert step_sizes(opt)["filters"] == pytest.approx(0.1)


def test_alternating_flip_flips_each_image_in_exactly_alternate_epochs():
    n = 1000
    g = torch.Generator().manual_seed(0)
    base = cd.flip_bits(n, g)
    augment = cd.AugmentSettings(crop_pad=0, flip="alternate", cutout=0)
    flips = torch.stack([cd.draw_augmentation(n, 32, augment, generator=g, epoch=epoch, flip_base=base)["flip"]
                         for epoch in range(6)])
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
    la = T.LookaheadAverage(model, T.LookaheadSettings(momentum=0.95, every=5))
    slow = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(2.0)                                            # the fast weights move
    fast = model.weight.detach().clone()
    la.update(model, 4, 10)                                               # not a multiple of every: nothing
    torch.testing.assert_close(la.slow[0], slow)
    la.update(model, 5, 10)                                               # decay 0.95^5 x (5 / 10)^3
    expected = slow + (1 - 0.95 ** 5 / 8) * (fast - slow)
    torch.testing.assert_close(la.slow[0], expected)
    torch.testing.assert_close(model.weight.detach(), expected)           # fast weights restart from slow
    with torch.no_grad():
        model.weight.add_(1.0)
    la.finish(model)                                                      # the end: hand over the slow weights
    torch.testing.assert_close(model.weight.detach(), expected)
    la.update(model, 10, 10)                                              # scheduled: 0.95^5 × (10 / 10)^3
    torch.testing.assert_close(la.slow[0], expected)


def test_lookaheads_tail_is_e1s_average_of_the_last_steps():
    """E1's tail over a run of 30 steps, its last 2.5 epochs of 4 steps (10), every 4: the weights and batch-norm
    statistics at step 20 start the average; at steps 24 and 28 ema <- 0.7 ema + 0.3 w and the weights take it;
    nothing at other steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    tail = T.averaging(model, tail=T.LookaheadTailSettings(decay=0.7, every=4, epochs=2.5), steps_per_epoch=4)
    state = lambda: [t.clone() for t in T.float_state(model)]
    ema = None
    for step in range(1, 31):
        with torch.no_grad():
            for t in T.float_state(model):
                t.add_(torch.randn_like(t))                               # a step moves weights and statistics
        moved = state()
        tail.update(model, step, 30)
        if step == 20:
            ema = moved
        elif step in (24, 28):
            ema = [0.7 * e + 0.3 * w for e, w in zip(ema, moved)]
            moved = ema
        for a, b in zip(state(), moved):
            torch.testing.assert_close(a, b)
    assert tail.model is None and T.evaluation_model(model, tail) is model
    with pytest.raises(UsageError, match=r"^--lookahead-momentum and --lookahead-tail-decay: one weight average at a "
                                         r"time; set the other to 0$"):
        cf.recipe("fast94_curriculum", lookahead_momentum=0.95)
    assert cf.recipe("fast94_curriculum", lookahead_tail_decay=0).lookahead_tail is None


def test_decoupled_weight_decay_does_not_depend_on_lr_or_bias_multiplier():
    r = cf.recipe("fast94", width=0.125)
    net = tb.build_model(r, CPU)
    opts = optim.make_optimizers(net, r, own_rates=[tb.whitening_bias(net)])
    peak = max(r.lr.values)
    optim.set_lr(opts, peak * 0.5, step=0)
    gain = 1 + 1 / (1 - r.sgd.momentum)
    groups = {g["name"]: g for g in opts[0].param_groups}
    for g in groups.values():                                             # decay per step: lr × weight_decay
        assert g["lr"] * g["weight_decay"] == pytest.approx(0.5 * r.sgd.weight_decay * r.batch_size / (1024 * gain))
    assert groups["bn_biases"]["lr"] == pytest.approx(64 * groups["weights"]["lr"])
    assert groups["weights"]["lr"] == pytest.approx(peak * 0.5 / (1024 * gain))
    optim.set_lr(opts, peak, step=3)               # the whitening bias's 3 steps
    assert groups["whiten_bias"]["lr"] == 0.0 and groups["weights"]["lr"] > 0


def test_fractional_epochs_and_lookahead_in_a_short_run():
    torch.manual_seed(0)
    n, bs = 96, 16
    x = torch.randn(n, 3, 36, 36)
    data = {"train_images": x, "train_labels": torch.arange(n) % 10,
            "test_images": x[:32, :, 2:-2, 2:-2], "test_labels": torch.arange(32) % 10}
    r = cf.recipe("fast94", width=1 / 16, batch_size=bs, epochs=1.5)
    res = train_once(r, data, seed=0, target=2.0)
    assert len(res["rows"]) == 2 and res["time_to_target"] is None
    assert res["time"] == pytest.approx(res["train_time"] + res["final_eval_time"])
    flops = cf.count_flops(r, data)
    assert flops["train"] == pytest.approx(round(1.5 * (n // bs)) * bs * flops["per_train_image"])
    assert flops["per_test_image"] > 0 and flops["per_train_image"] > 2 * flops["per_test_image"] / 6


def test_fastnet_flops_per_image_match_the_architecture():
    """Forward conv/linear FLOPs of fast94's network, counted by hand: 2·MACs per output."""
    r = cf.recipe("fast94", tta="none")
    data = {"train_images": torch.zeros(1024, 3, 36, 36), "train_labels": torch.zeros(1024, dtype=torch.long),
            "test_images": torch.zeros(8, 3, 32, 32), "test_labels": torch.zeros(8, dtype=torch.long)}
    macs = (31 * 31 * 24 * 12 + 31 * 31 * 64 * 24 * 9 + 15 * 15 * 64 * 64 * 9 + 15 * 15 * 256 * 64 * 9
            + 7 * 7 * 256 * 256 * 9 + 7 * 7 * 256 * 256 * 9 + 3 * 3 * 256 * 256 * 9 + 256 * 10)
    assert cf.count_flops(r, data)["per_test_image"] == 2 * macs


def whitened_twins(r):
    """A network with its whitening fitted, an identical copy, and a batch of 16 random images with labels."""
    torch.manual_seed(0)
    net = tb.build_model(r, CPU)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 10
    tb.fit_whitening(net, x, 32)
    return net, copy.deepcopy(net), x, y


def test_the_step_with_its_loss_in_the_forward_is_the_plain_step():
    """compile_step's WithLoss, run eagerly: the network without labels; with them the summed loss (each image's,
    summed with the correct predictions in one reduction) and the sums, and the step through it moves every
    parameter exactly as the plain step does."""
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=16)
    net, twin, x, y = whitened_twins(r)
    with_loss = cf.WithLoss(twin, r.label_smoothing)
    loss, sums = with_loss(x, y)
    logits = net(x)
    assert torch.equal(with_loss(x), logits)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, y, label_smoothing=r.label_smoothing,
                                                        reduction="sum").item(), rel=1e-6)
    assert sums.tolist() == [loss.item(), (logits.argmax(1) == y).sum().item()] and sums.grad_fn is None
    plain, fused = (optim.make_optimizers(m, r, own_rates=[tb.whitening_bias(m)])
                     for m in (net, twin))
    for opts in (plain, fused):
        optim.set_lr(opts, max(r.lr.values))
    a = T.train_step(net, plain, x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
    b = T.train_step(with_loss, fused, x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
    assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin.parameters()))


@pytest.mark.slow
def test_compiled_and_eager_steps_give_the_same_loss():
    r = cf.recipe("fast94", width=1 / 16, batch_size=16)
    net, twin, x, y = whitened_twins(r)
    forward = torch.compile(twin)
    eager, compiled = (optim.make_optimizers(m, r, own_rates=[tb.whitening_bias(m)])
                     for m in (net, twin))
    for opts in (eager, compiled):
        optim.set_lr(opts, max(r.lr.values))
    for _ in range(3):
        a = T.train_step(net, eager, x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
        b = T.train_step(forward, compiled, x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
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

    class Recording(T.LookaheadAverage):
        def update(self, model, step, total_steps):
            if step % self.every == 0:
                decays.append(self.momentum ** self.every * (step / total_steps) ** 3)
            super().update(model, step, total_steps)

        def finish(self, model):
            decays.append(1.0)
            super().finish(model)
    monkeypatch.setattr(T, "LookaheadAverage", Recording)
    r = cf.recipe("fast94", width=1 / 16, batch_size=16, epochs=2)      # 5 steps an epoch, 10 in all
    train_once(r, tiny_data(80), target=2.0)
    rho = 0.95 ** 5
    assert decays == pytest.approx([rho * (5 / 10) ** 3, rho, 1.0])


def test_total_steps_round_up_as_airbench(monkeypatch):
    """airbench: ceil(epochs × steps per epoch) steps (9.9 × 48 = 475.2: 476 steps), in training and in the count."""
    steps = []
    step = cf.train_step
    monkeypatch.setattr(cf, "train_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    r = cf.recipe("fast94", width=1 / 16, batch_size=16, epochs=1.1)    # 4 steps an epoch: 4.4 -> 5
    data = tiny_data(64)
    res = train_once(r, data, target=2.0)
    assert len(steps) == 5 and len(res["rows"]) == 2
    flops = cf.count_flops(r, data)
    assert flops["train"] == pytest.approx(5 * 16 * flops["per_train_image"])


def patch_covariance_inverse(images, k, centre, ddof, eps):
    p = images.unfold(2, k, 1).unfold(3, k, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k).double()
    if centre:
        p = p - p.mean(0)
    cov = p.T @ p / (len(p) - ddof)
    return torch.linalg.inv(cov + eps * torch.eye(len(cov), dtype=torch.float64))


def whitening_filters(r, images):
    net = tb.build_model(r, CPU)
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
    f = whitening_filters(cf.recipe("fast94_next", width=1 / 16), x)
    # the 2-second record: the first 960 images, uncentred, divided by n, by an SVD of the covariance
    torch.testing.assert_close(f.T @ f, patch_covariance_inverse(x[:960], 2, False, 0, 5e-4), rtol=2e-4, atol=1e-3)
    f = whitening_filters(cf.recipe("myrtle10", width=1 / 16), x)
    # today's myrtle10: up to 10,000 images, centred, divided by n - 1
    torch.testing.assert_close(f.T @ f, patch_covariance_inverse(x, 3, True, 1, 1e-2), rtol=2e-4, atol=1e-3)


# ---- the Muon record recipes' switches (fast94_muon, fast94_next) and fast96 ----

def test_batched_newton_schulz_equals_it_matrix_by_matrix():
    torch.manual_seed(0)
    mats = [torch.randn(32, 108), torch.randn(64, 288), torch.randn(40, 24), torch.randn(96, 576)]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        batched = optim.newton_schulz_padded(mats, 3, (3.4576, -4.7391, 2.0843), dtype=dtype)
        for m, b in zip(mats, batched):
            assert b.shape == m.shape
            torch.testing.assert_close(b, optim.newton_schulz(m, 3, (3.4576, -4.7391, 2.0843), dtype=dtype),
                                       atol=tol, rtol=0)
    # inside Muon: the same step for two filter banks, batched or one by one
    w, g = [torch.randn(16, 8, 3, 3), torch.randn(32, 16, 3, 3)], [torch.randn(16, 8, 3, 3), torch.randn(32, 16, 3, 3)]
    steps = []
    for batched in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in w]
        for p, grad in zip(params, g):
            p.grad = grad.clone()
        optim.Muon(params, lr=0.1, ns_steps=3, batched=batched).step()
        steps.append([p.detach() for p in params])
    for a, b in zip(*steps):
        torch.testing.assert_close(a, b, atol=0.1 * 0.05, rtol=0)


def muon_step(p, grad, **kw):
    p.grad = grad.clone()
    optim.Muon([p], **kw).step()


def test_muon_renormalises_then_steps_and_decays():
    """airbench94_muon: before each update every filter bank is scaled back to norm sqrt(out channels);
    the record adds decoupled weight decay after the update: w ← (w·√out/|w| − lr·u)·(1 − lr·wd)."""
    torch.manual_seed(0)
    w0, g = 5 * torch.randn(32, 16, 3, 3), torch.randn(32, 16, 3, 3)
    u = optim.newton_schulz(g.add(g, alpha=0.6).reshape(32, -1), 3).view_as(g)     # first step: Nesterov's g + m·g
    p = torch.nn.Parameter(w0.clone())
    muon_step(p, g, lr=0.1, momentum=0.6, ns_steps=3, renorm_every=(1, 1), weight_decay=0.05)
    expected = (w0 * 32 ** 0.5 / w0.norm() - 0.1 * u) * (1 - 0.1 * 0.05)
    torch.testing.assert_close(p.detach(), expected, atol=1e-5, rtol=1e-5)
    p = torch.nn.Parameter(w0.clone())
    muon_step(p, g, lr=0.1, momentum=0.6, ns_steps=3)                    # defaults: neither
    torch.testing.assert_close(p.detach(), w0 - 0.1 * u, atol=1e-5, rtol=1e-5)


def test_muon_renormalises_less_often_as_training_goes_on():
    """The record: every k = 2 + int(15 × progress) steps (renorm_every=(2, 17)); airbench94_muon: every step."""
    torch.manual_seed(0)
    # (2, 17) over 30 steps: k = 2 + int(step / 2); steps 3 (k = 3), 9 (k = 6), 21 (k = 12), then k > 9
    for every, expected in (((2, 17), [3, 9, 21]), ((1, 1), list(range(1, 31)))):
        p = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
        opt = optim.Muon([p], lr=0.0, renorm_every=every, total_steps=30)
        renormalised = []
        for step in range(1, 31):
            with torch.no_grad():
                p.mul_(2.0)                                                   # the norm drifts
            p.grad = torch.randn_like(p)
            opt.step()
            if abs(p.norm().item() - 8 ** 0.5) < 1e-4:
                renormalised.append(step)
        assert renormalised == expected, every


def test_muon_low_precision_momentum():
    torch.manual_seed(0)
    w, grads = torch.randn(16, 8, 3, 3), [torch.randn(16, 8, 3, 3) for _ in range(3)]
    out = {}
    for dtype in (None, torch.float16):
        p = torch.nn.Parameter(w.clone())
        opt = optim.Muon([p], lr=0.1, momentum=0.6, momentum_dtype=dtype)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[dtype] = p.detach()
        assert opt.state[p]["momentum"].dtype == (dtype or torch.float32)
    torch.testing.assert_close(out[torch.float16], out[None], atol=5e-3, rtol=0)


@pytest.mark.parametrize("weights, momentum, orthogonalised", [(torch.float32, torch.float16, torch.bfloat16),
                                                                (torch.float64, torch.float64, torch.float64)])
def test_muon_keeps_its_low_precisions_on_float32_weights_and_lifts_them_in_a_float64_run(
        weights, momentum, orthogonalised, monkeypatch):
    """The record's settings (fp16 momentum, Newton-Schulz in bf16) on float32 weights; all float64 on float64
    weights (--precision fp64)."""
    seen = []
    real = optim.newton_schulz_padded
    monkeypatch.setattr(optim, "newton_schulz_padded",
                        lambda *a, dtype, **k: seen.append(dtype) or real(*a, dtype=dtype, **k))
    p = torch.nn.Parameter(torch.randn(16, 8, 3, 3, dtype=weights))
    opt = optim.Muon([p], lr=0.1, momentum_dtype=torch.float16, batched=True)
    p.grad = torch.randn_like(p)
    opt.step()
    assert (opt.state[p]["momentum"].dtype, seen, p.dtype) == (momentum, [orthogonalised], weights)


def test_sum_units_and_the_whitening_bias_falling_to_zero():
    """airbench94_muon: SGD's lr as written on the summed loss (head 0.67, biases 0.053), decay per step
    2e-6 × batch × the schedule's factor; the whitening bias's rate falls from 0.053 to 0 over 3 epochs, Muon's
    follows the schedule from 0.24."""
    r = cf.recipe("fast94_muon", width=1 / 16)
    net = tb.build_model(r, CPU)
    (opt,) = optim.make_optimizers(net, r, steps_per_epoch=25, own_rates=[tb.whitening_bias(net, 25)])
    groups = {g["name"]: g for g in opt.param_groups}
    for step, factor, whiten in ((0, 1.0, 1.0), (30, 0.85, 0.6), (75, 0.625, 0.0)):
        optim.set_lr([opt], 0.67 * factor, step)
        lr = step_sizes(opt)
        assert lr["weights"] == pytest.approx(0.67 * factor) and lr["bn_biases"] == pytest.approx(0.053 * factor)
        assert lr["whiten_bias"] == pytest.approx(0.053 * whiten) and lr["filters"] == pytest.approx(0.24 * factor)
        for name in ("weights", "bn_biases"):
            assert lr[name] * groups[name]["weight_decay"] == pytest.approx(2e-6 * 2000 * factor)


def test_the_whitening_bias_is_an_own_rate_the_optimisers_must_be_handed():
    """Its group trains for its epochs' steps at its own multiple of the rate; built without it, make_optimizers says
    which parameter it was not handed rather than training it at the weights' rate."""
    r = cf.recipe("fast94_muon", width=1 / 16)
    net = tb.build_model(r, CPU)
    bias = tb.whitening_bias(net, 7)
    assert ((bias.name, bias.until_step, bias.linear, bias.lr_mult)
            == ("whiten_bias", 21, True, r.whitening.bias.lr_mult))
    assert bias.param is net[0].bias
    with pytest.raises(ValueError, match=r"^make_optimizers: 0\.bias trains at a rate of its own: hand it over"):
        optim.make_optimizers(net, r)
    assert tb.whitening_bias(tb.build_model(cf.recipe("fast94", whiten_bias=False, width=1 / 16), CPU)) is None
    assert tb.whitening_bias(tb.build_model(cf.recipe("myrtle24", width=1 / 16), CPU)) is None


def test_the_whitening_bias_is_detached_after_its_steps(monkeypatch):
    detached = []
    step = cf.train_step
    monkeypatch.setattr(cf, "train_step",
                        lambda f, *a, **k: detached.append(not tb.whitening_bias(f).param.requires_grad)
                        or step(f, *a, **k))
    r = cf.recipe("fast94_muon", width=1 / 16, batch_size=16, epochs=2, whiten_bias_epochs=0.5)
    res = train_once(r, tiny_data(80), target=2.0)                # 5 steps an epoch: 3 with the bias trained
    assert detached == [False] * 3 + [True] * 7
    assert tb.whitening_bias(res["model"]).param.grad is None


def test_muon_recipe_networks():
    """fast94_muon: head weights at unit std, logits ÷ 256; fast94_next: SiLU in the blocks, GELU after the
    whitening; fast96: airbench96's 128/384/512 with the residual added before the block's last activation."""
    torch.manual_seed(0)
    net = tb.build_model(cf.recipe("fast94_muon"), CPU)
    head, scale = net[-2], net[-1]
    assert head.weight.std().item() == pytest.approx(1.0) and scale.scale == 1 / 256
    acts = [type(m) for m in tb.build_model(cf.recipe("fast94_next"), CPU).modules()
            if isinstance(m, (torch.nn.GELU, torch.nn.SiLU))]
    assert acts == [torch.nn.GELU] + [torch.nn.SiLU] * 6
    net = tb.build_model(cf.recipe("fast96"), CPU)
    # whitening 24·12 + 24; convs 9·(24·128 + 2·128² + 128·384 + 2·384² + 384·512 + 2·512²); batch norm
    # 2·3·(128 + 384 + 512); linear 512·10
    assert tb.count_parameters(net) == 312 + 9_907_200 + 6_144 + 5_120 == 9_918_776
    residual = net[2][4]
    assert isinstance(residual, tb.Residual) and isinstance(residual.body[-1], torch.nn.BatchNorm2d)
    x = torch.randn(2, 128, 8, 8)
    residual.eval()
    torch.testing.assert_close(residual(x), F.gelu(x + residual.body(x)))
    assert all(m.momentum == 0.1 for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_brightness_and_contrast_jitter():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, 8, 8)
    jitter = cd.AugmentSettings(crop_pad=0, flip="none", cutout=0, jitter_brightness=0.14, jitter_contrast=0.13)
    r = cd.draw_augmentation(500, 8, jitter, generator=g)
    brightness, contrast = r["jitter"]
    assert brightness.abs().max() <= 0.14 and (contrast - 1).abs().max() <= 0.13
    assert brightness.std() > 0.07 and (contrast - 1).std() > 0.06          # uniform: std = range / √3
    out = cd.augment_images(x, r, 8, 0)
    torch.testing.assert_close(out, ((x + brightness.view(-1, 1, 1, 1)) * contrast.view(-1, 1, 1, 1))[r["perm"]])
    plain = cd.AugmentSettings(crop_pad=0, flip="none", cutout=0)
    assert "jitter" not in cd.draw_augmentation(500, 8, plain, generator=g)                       # off: no draw


def test_low_resolution_epochs_and_their_flops():
    r = cf.recipe("fast94", width=1 / 16, batch_size=16, epochs=2, resolution_schedule=(16,))
    data = tiny_data(32, size=24)
    g = torch.Generator().manual_seed(0)
    base = cd.flip_bits(32, g)
    sizes = [x.shape[-1] for e in (0, 1) for x, _ in cd.epoch_batches(data, r.augment, g, batch_size=r.batch_size,
                                                                        epoch=e, flip_base=base)]
    assert sizes == [16, 16, 24, 24]
    ratio = (cf.count_flops(r, data)["train"]
             / cf.count_flops(settings.changed(r, resolution_schedule=()), data)["train"])
    assert ratio == pytest.approx((1 + (16 / 24) ** 2) / 2, rel=0.1)       # half the steps at 4/9 of the pixels
    train_once(r, data, target=2.0)


def test_selective_tta():
    """The record's selective TTA: fraction 1 is full TTA (the weighted sum of every view's logits), a fraction so
    small it selects no image the plain pass; in between the views change only the least confident images."""
    torch.manual_seed(0)
    model = tb.build_model(cf.recipe("fast94", width=1 / 16), CPU).eval()
    x = torch.randn(40, 3, 16, 16)
    tta = lambda fraction: tb.TTASettings(views="flip_translate", fraction=fraction)
    with torch.no_grad():
        plain = model(x)
        full = sum(w * model(v) for w, v in tb.tta_views(x, "flip_translate"))
        half = tb.tta_logits(model, x, tta(0.5), batch_size=16)
        torch.testing.assert_close(tb.tta_logits(model, x, tta(1.0), batch_size=16), full)
        torch.testing.assert_close(tb.tta_logits(model, x, tta(0.01), batch_size=16), plain)
        torch.testing.assert_close(tb.tta_logits(model, x, None, batch_size=16), plain)
    confidence = plain.softmax(1).amax(1)
    unsure = confidence.argsort()[:20]
    sure = confidence.argsort()[20:]
    torch.testing.assert_close(half[unsure], full[unsure])
    assert torch.equal(half[sure], plain[sure])
    y = torch.arange(40) % 10
    accuracy = (half.argmax(1) == y).float().mean().item()
    assert tb.loss_and_accuracy(model, x, y, tta=tta(0.5))[1] == pytest.approx(accuracy)
    flops = cf.count_flops(cf.recipe("fast94", tta_fraction=0.25), tiny_data(1024, 32))
    assert flops["per_test_image"] == pytest.approx(flops["per_train_image"] / 3 * (1 + 0.25 * 5), rel=0.02)


def test_compiled_step_gives_the_eager_loss_and_gradients():
    """compile_step: forward and loss compiled as one function (its backward compiled with it by AOTAutograd)."""
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=8)
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    compiled = cf.build_network(r, CPU, compile_mode="default")
    net, step = compiled.module, compiled.train_forward
    assert isinstance(step._orig_mod, cf.WithLoss) and compiled.eval_forward is step
    tb.fit_whitening(net, x, 16)
    twin = copy.deepcopy(net)
    a = T.train_step(step, [], x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
    b = T.train_step(twin, [], x, y, label_smoothing=r.label_smoothing, dtype=torch.float32)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-5)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    # the warm-up and a run through a compiled WithLoss (dynamo without code generation, to keep this test short):
    # the whitening bias detached after its step, selective TTA through the network
    r, data = settings.changed(r, epochs=1, whiten_bias_epochs=0.5), tiny_data(16, n_test=8)
    step = torch.compile(cf.WithLoss(net, r.label_smoothing), backend="eager")
    eager = cf.Network(module=net, train_forward=step, eval_forward=step, recipe=r)
    cf.warmup(r, cf.Built(data=data, network=eager), cf.Options(target=2.0), ctx=D.Context(), calls=1)
    assert len(train_once(r, data, net=eager, target=2.0)["rows"]) == 1


def test_the_low_resolution_ablation_is_fast94_next_with_its_switch_and_the_predicted_flops():
    # docs/perf-notes.md predicts training FLOPs -12%: 2 of 7.59 epochs at (24/32)^2 of the pixels (counted:
    # 12.6%: the unpadded 2x2 whitening leaves 23 and 31 pixels a side, which the poolings round down to 11 of 15
    # and 5 of 7, each a little under 24/32)
    ablation, base = cf.recipe("fast94_next_lowres"), cf.recipe("fast94_next")
    flat_ablation, flat_base = settings.flat(ablation), settings.flat(base)
    assert {k for k in flat_base if flat_ablation[k] != flat_base[k]} == {"resolution_schedule"}
    shapes = {"train_images": torch.zeros(1, 3, 1, 1).expand(50000, 3, 1, 1), "train_labels": torch.zeros(50000),
              "test_images": torch.zeros(8, 3, 32, 32), "test_labels": torch.zeros(8, dtype=torch.long)}
    low, full = (cf.count_flops(r, shapes)["train"] for r in (ablation, base))
    assert 1 - low / full == pytest.approx(2 / 7.59 * (1 - (24 / 32) ** 2), abs=0.015)


def test_fast94_lowflop_is_the_low_resolution_ablation_for_7_89_epochs_at_the_counted_flops():
    # docs/perf-notes.md: 0.242 PFLOP of training against fast94_next's 0.264 (8.5% fewer), as README's CPU runs had it
    lowflop, lowres, base = cf.recipe("fast94_lowflop"), cf.recipe("fast94_next_lowres"), cf.recipe("fast94_next")
    flat_lowflop, flat_lowres = settings.flat(lowflop), settings.flat(lowres)
    assert {k for k in flat_lowres if flat_lowflop[k] != flat_lowres[k]} == {"epochs"} and lowflop.epochs == 7.89
    shapes = {"train_images": torch.zeros(1, 3, 1, 1).expand(50000, 3, 1, 1), "train_labels": torch.zeros(50000),
              "test_images": torch.zeros(8, 3, 32, 32), "test_labels": torch.zeros(8, dtype=torch.long)}
    fast, full = (cf.count_flops(r, shapes)["train"] for r in (lowflop, base))
    assert (round(fast / 1e15, 3), round(full / 1e15, 3)) == (0.242, 0.264)
    assert 1 - fast / full == pytest.approx(0.085, abs=0.001)


def test_the_whitening_bias_starts_as_each_reference_leaves_it():
    """legacy airbench94 zeroes it; airbench94_muon and the 2-second record keep nn.Conv2d's default, uniform in
    ±1/√fan_in = ±1/√12 for 2×2 filters over 3 channels."""
    from scipy.stats import kstest
    bias = lambda recipe: tb.whitening_bias(tb.build_model(cf.recipe(recipe, width=1 / 16), CPU)).param
    assert torch.equal(bias("fast94"), torch.zeros(24))
    bound = 1 / 12 ** 0.5
    for recipe in ("fast94_muon", "fast94_next"):
        torch.manual_seed(0)
        draws = torch.cat([bias(recipe).detach() for _ in range(100)]).numpy()
        assert abs(draws).max() <= bound
        assert kstest(draws, "uniform", args=(-bound, 2 * bound)).pvalue > 0.001, recipe


def test_the_records_test_time_augmentation_weighs_its_six_views_equally():
    x = torch.randn(2, 3, 32, 32)
    assert [w for w, _ in tb.tta_views(x, "flip_translate", "equal")] == [1 / 6] * 6
    assert [w for w, _ in tb.tta_views(x, "flip_translate")] == [0.25, 0.25] + [0.125] * 4
    assert cf.recipe("fast94_next").tta.weights == "equal"
    assert cf.recipe("fast94_muon").tta.weights == "airbench"      # airbench94_muon's tta_level=2
    model = tb.build_model(cf.recipe("fast94", width=1 / 16), CPU).eval()
    with torch.no_grad():
        views = [model(v) for _, v in tb.tta_views(x, "flip_translate")]
        torch.testing.assert_close(tb.tta_logits(model, x, tb.TTASettings(views="flip_translate", weights="equal")),
                                   torch.stack(views).mean(0))


def test_the_networks_initialisation_and_the_datas_order_and_augmentation_are_independent_streams(monkeypatch):
    """Changing only the augmentation's seed changes no initial weight and no order; changing only the order's changes
    no augmentation; and the whitening bias (drawn at initialisation) no longer repeats the flip bits' draws, as it
    did when both came from one CPU stream."""
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=32, epochs=1)
    data = cd.dataset_on_device(synthetic_arrays(n_train=64, n_test=32), "cpu", dtype=torch.float32,
                                pad=r.augment.crop_pad)
    run_seeds, step = cf.run_seeds, cf.train_step

    def built(seeds):
        """(the initial weights, the epoch's images and labels) of a run train_run starts from these seeds."""
        weights, batches = [], []

        def recording(forward, *a, **k):
            if not weights:                                               # before the first step
                weights.extend(t.clone() for t in forward.state_dict().values())
            batches.append(tuple(t.clone() for t in a[1:3]))
            return step(forward, *a, **k)
        monkeypatch.setattr(cf, "run_seeds", lambda seed, rank=0: seeds)
        monkeypatch.setattr(cf, "train_step", recording)
        train_once(r, data, target=2.0)
        x, y = (torch.cat(t) for t in zip(*batches))                    # the whole epoch: 2 batches of 32
        return weights, x, y
    as_set = lambda x: x.flatten(1)[x.flatten(1).sum(1).argsort()]     # the epoch's images whatever their order
    seeds = run_seeds(0)
    weights, x, y = built(seeds)
    other_augment, x2, y2 = built({**seeds, "augment": seeds["augment"] + 1})
    assert all(torch.equal(a, b) for a, b in zip(weights, other_augment)) and torch.equal(y, y2)
    assert not torch.equal(x, x2)
    _, x3, y3 = built({**seeds, "order": seeds["order"] + 1})
    assert not torch.equal(y, y3) and torch.equal(as_set(x), as_set(x3))
    assert len(set(run_seeds(0).values())) == 4 and run_seeds(0, rank=1)["init"] == seeds["init"]
    assert run_seeds(0, rank=1)["shares"] == seeds["shares"]          # the epochs' shares: the same on every rank
    assert run_seeds(0, rank=1)["augment"] != seeds["augment"]
