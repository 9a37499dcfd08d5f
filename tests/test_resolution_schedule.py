"""The resolution schedule (each epoch at a side of its own, AugmentSettings.resolution_schedule), the global max-pool
switch (NetworkSettings.global_max_pool) and the curriculum recipe built from them (fast94_curriculum)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import cifar10_fast as cf
import cifar_data as cd
import distributed as D
import settings
import torch_backend as tb
from conftest import pattern_arrays, synthetic_arrays, train_once

# fast94_curriculum's flags with a bad schedule, or a switch that rules its schedule out: the last line on stderr
REFUSED = [
    (["--resolution-schedule", "24,0"], "error: --resolution-schedule 24,0: must be positive"),
    (["--resolution-schedule", "24,28.5"], "error: --resolution-schedule 24,28.5: must be a whole number"),
    (["--resolution-schedule", "24,-28"], "error: --resolution-schedule 24,-28: must be positive"),
    (["--resolution-schedule", "24,8"],
     "error: --resolution-schedule 24,8: the network cannot pool 8x8 images down to its head"),
    (["--global-max-pool", "false"],
     "error: --resolution-schedule 24,24,24,28,28,28: the network cannot pool 24x24 images down to its head (its "
     "fixed last window; --global-max-pool true pools a map of any size)"),
    (["--model", "resnet18", "--global-max-pool", "false", "--resolution-schedule", ""],
     "error: --global-max-pool false: resnet18 has no fixed window to pool with; it pools globally (max and mean)"),
]
SHAPES = {"train_images": torch.zeros(1, 3, 1, 1).expand(50000, 3, 1, 1), "train_labels": torch.zeros(50000),
          "test_images": torch.zeros(8, 3, 32, 32), "test_labels": torch.zeros(8, dtype=torch.long)}


@pytest.mark.parametrize("flags, message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_a_bad_schedule_is_refused_in_one_line_before_the_data_is_loaded(flags, message, tmp_path, capsys):
    rc = cf.main(["--recipe", "fast94_curriculum", "--data-dir", str(tmp_path / "none"), "--device", "cpu", *flags])
    assert (rc, capsys.readouterr().err.strip().splitlines()[-1]) == (2, message)


def forward_pools_to_one_pixel(model, h, w=None):
    """Whether model runs an h x w image (w: h) through to its logits (a narrow network on the CPU, one image: the
    meta device's Python kernels are slower)."""
    try:
        with torch.no_grad():
            return model(torch.zeros(1, 3, h, w or h)).shape == (1, 10)
    except RuntimeError:
        return False


def every_network():
    """{what shapes it: a recipe of that network}: every recipe's network with its own last pool and the other
    (resnet18 has one only), whitened or not, narrow."""
    networks = {}
    for r in cf.RECIPES.values():
        for global_max_pool in {True, r.network.model == "resnet18"}:
            for whitening in {r.whitening, None}:
                n = settings.changed(r, width=1 / 16, resolution_schedule=(), global_max_pool=global_max_pool)
                n = dataclasses.replace(n, whitening=whitening)
                key = (n.network.model, n.whitening and (n.whitening.size, n.whitening.pad),
                       len(n.network.block_widths), global_max_pool)
                networks.setdefault(key, n)
    assert {key[0] for key in networks} == set(tb.MODELS) and len(networks) >= 8
    return networks


def test_the_shape_arithmetic_says_what_a_forward_says_for_every_network_and_side():
    """At 1 to 72 px: past twice every fixed window, so both ends of each window's range are met; then oblong
    images whose sides are each at an end of that range or one past it, which each side decides alone."""
    for key, n in every_network().items():
        model = tb.build_model(n, "cpu").eval()
        said = [side for side in range(1, 73) if tb.pools_to_one_pixel(n, side)]
        assert said == [side for side in range(1, 73) if forward_pools_to_one_pixel(model, side)], key
        assert said, key
        ends = {side for side in (said[0] - 1, said[0], said[-1], said[-1] + 1) if 1 <= side <= 72}
        for h, w in ((h, w) for h in ends for w in ends if h != w):
            assert forward_pools_to_one_pixel(model, h, w) == (h in said and w in said), (key, h, w)


def test_images_too_small_for_the_network_are_refused_by_either_side_and_its_width_is_not_built():
    """check_data's shape check builds nothing: a network too wide for any machine passes it (the run's own build
    then meets the allocator, one line), as a forward would have to allocate its weights first."""
    r, ctx = cf.recipe("fast94", batch_size=64), D.Context()
    for size in ((32, 8), (8, 32)):
        with pytest.raises(cf.UsageError, match=rf"^--model fastnet: {size[0]}x{size[1]} images are too small for "
                                                r"this network$"):
            cf.check_data(r, pattern_arrays(128, 8, size=size), ctx)
    assert cf.check_data(settings.changed(r, width=1e5), synthetic_arrays(128, 8), ctx) is None


def test_a_schedule_the_images_rule_out_is_refused_in_one_line():
    r, ctx = cf.recipe("fast94_curriculum", batch_size=64), D.Context()
    with pytest.raises(cf.UsageError, match=r"^--resolution-schedule 24,40: 40 is larger than the 32x32 images$"):
        cf.check_data(settings.changed(r, resolution_schedule=(24, 40)), synthetic_arrays(128, 8), ctx)
    with pytest.raises(cf.UsageError, match=r"^--resolution-schedule 24,24,24,28,28,28: needs square images, "
                                            r"not 32x40$"):
        cf.check_data(r, pattern_arrays(128, 8, size=(32, 40)), ctx)


def test_the_flag_reads_a_list_of_whole_sides_and_an_empty_word_as_no_schedule():
    args, changes = cf.parse_args(["--resolution-schedule", "24,28,32"])
    assert changes["resolution_schedule"] == (24, 28, 32) and all(type(v) is int for v in (24, 28, 32))
    assert cf.parse_args(["--resolution-schedule", ""])[1]["resolution_schedule"] == ()
    a = cf.recipe("fast94", resolution_schedule=(24, 28)).augment
    assert [a.resolution(epoch, 32) for epoch in range(4)] == [24, 28, 32, 32]


def test_each_epoch_trains_at_its_side_in_the_schedule_and_the_last_map_pools_whole(monkeypatch):
    """Epochs 1-3 at 24, 28, 28 px, the 4th (past the list) at the images' 32; a 24 px epoch resizes the whole
    augmented epoch (antialiased) before the network sees it, and its 2x2 last map is max-pooled to 1x1."""
    r = cf.recipe("fast94_curriculum", width=1 / 16, batch_size=32, epochs=4, resolution_schedule=(24, 28, 28))
    seen, maps = [], []
    real_step, real_pool = cf.train_step, tb.GlobalMaxPool.forward
    monkeypatch.setattr(cf, "train_step", lambda step, opts, x, y, **kw: seen.append(x.shape[-2:])
                        or real_step(step, opts, x, y, **kw))
    monkeypatch.setattr(tb.GlobalMaxPool, "forward", lambda self, x: maps.append(x.shape[-2:]) or real_pool(self, x))
    data = cd.dataset_on_device(synthetic_arrays(64, 16), "cpu", dtype=torch.float32, pad=r.augment.crop_pad)
    train_once(r, data, eval_every=0)
    assert seen == [(s, s) for s in (24, 24, 28, 28, 28, 28, 32, 32)]          # 2 steps an epoch
    assert maps[:8] == [(2, 2)] * 2 + [(3, 3)] * 6          # 24: 23 -> 11 -> 5 -> 2; 28 and 32: 27, 31 -> 3
    # what a 24 px epoch yields: that epoch's augmented 32 px images, resized
    g, h = (torch.Generator().manual_seed(1) for _ in range(2))
    base = cd.flip_bits(64, torch.Generator().manual_seed(0))
    small = next(cd.epoch_batches(data, r.augment, g, batch_size=32, flip_base=base))[0]      # epoch 0: 24 px
    whole = dataclasses.replace(r.augment, resolution_schedule=())
    full = next(cd.epoch_batches(data, whole, h, batch_size=32, flip_base=base))[0]
    torch.testing.assert_close(small, F.interpolate(full, size=(24, 24), mode="bilinear", antialias=True))


def test_a_run_shorter_than_the_list_trains_its_first_sides_and_the_flops_follow_the_sides():
    r = cf.recipe("fast94_curriculum")
    assert [r.augment.resolution(e, 32) for e in range(9)] == [24, 24, 24, 28, 28, 28, 32, 32, 32]
    # 8.875 epochs of 32 steps (50000 // 1536): 284 steps, 96 at 24 px, 96 at 28, 92 at 32
    per_step = {s: cf.count_flops(settings.changed(r, resolution_schedule=(s,) * 9), SHAPES)["train"] / 284
                for s in (24, 28, 32)}
    assert cf.count_flops(r, SHAPES)["train"] == pytest.approx(96 * per_step[24] + 96 * per_step[28]
                                                               + 92 * per_step[32], rel=1e-9)
    two = settings.changed(r, epochs=2)
    assert cf.count_flops(two, SHAPES)["train"] == pytest.approx(64 * per_step[24], rel=1e-9)


@pytest.mark.parametrize("model", ["fastnet", "resnet9"])
def test_global_max_pooling_is_the_published_fixed_window_at_32_px_and_pools_a_smaller_map_too(model):
    """Myrtle's ResNet-9 ends in a 4x4 window, airbench's three blocks in a 3x3 one: at 32 px each the whole last
    map, so the two networks compute the same logits and gradients; at 24 px only the global pool takes the map."""
    torch.manual_seed(0)
    r = cf.recipe("fast94" if model == "fastnet" else "myrtle24", width=1 / 16, resolution_schedule=())
    nets = [tb.build_model(settings.changed(r, global_max_pool=on), "cpu").double() for on in (True, False)]
    nets[1].load_state_dict(nets[0].state_dict())
    assert isinstance(nets[0][-4], tb.GlobalMaxPool) and isinstance(nets[1][-4], torch.nn.MaxPool2d)
    x, y = torch.randn(6, 3, 32, 32, dtype=torch.float64), torch.arange(6)
    for net in nets:
        tb.fit_whitening(net, x, 32)
    losses = [F.cross_entropy(net(x), y) for net in nets]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == losses[1].item()
    for p, q in zip(*(net.parameters() for net in nets)):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    small = torch.randn(6, 3, 24, 24, dtype=torch.float64)
    assert nets[0](small).shape == (6, 10)
    with pytest.raises(RuntimeError):
        nets[1](small)


def test_the_curriculum_is_fast94_lowflop_with_e1s_schedule_length_floor_and_tail_at_fewer_flops():
    """E1's 3 epochs at 24 px, 3 at 28, the rest at 32, for its 8.875 epochs (284 steps: 96, 96 and 92), its rate
    floored at 5% from 8.5 epochs and its lookahead tail; every other recipe without a floor or a tail."""
    curriculum, lowflop = cf.recipe("fast94_curriculum"), cf.recipe("fast94_lowflop")
    flat_curriculum, flat_lowflop = settings.flat(curriculum), settings.flat(lowflop)
    assert {k for k in flat_curriculum if flat_curriculum[k] != flat_lowflop.get(k)} == {
        "resolution_schedule", "epochs", "lr_knots", "lr_values", "lr_floor", "lookahead_tail_decay",
        "lookahead_tail_every", "lookahead_tail_epochs"}
    assert curriculum.epochs == 8.875 and curriculum.lr.knots[1] * curriculum.epochs == 8.5
    assert all(r.lr.floor == 0 and r.lookahead_tail is None for r in cf.RECIPES.values() if r.name != curriculum.name)
    assert lowflop.augment.resolution_schedule == (24, 24) and lowflop.network.global_max_pool
    assert cf.recipe("fast94_next_lowres").augment.resolution_schedule == (24, 24)   # the old 2 epochs at 24 px
    ours, theirs = (cf.count_flops(r, SHAPES)["train"] for r in (curriculum, lowflop))
    # docs/perf-notes.md: 0.233 PFLOP of training against fast94_lowflop's 0.242 (3.5% fewer)
    assert ours < theirs and (round(ours / 1e15, 3), round(theirs / 1e15, 3)) == (0.233, 0.242)


def test_print_recipe_shows_the_curriculum_flags(capsys):
    assert cf.main(["--recipe", "fast94_curriculum", "--print-recipe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# fast94_curriculum: fast94_lowflop with E1's curriculum")
    assert "  --resolution-schedule 24,24,24,28,28,28 \\\n" in out and "  --global-max-pool true \\\n" in out
    assert "  --lr-floor 0.05 \\\n" in out and "  --lookahead-tail-decay 0.7 \\\n" in out
