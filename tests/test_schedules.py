"""Every schedule of a run (learning rate, steps, resolution, batch), plain arithmetic checked against the published
schedules it reproduces."""
import pytest

import cifar10_fast as cf
import cifar_data
import imagenet_fast as inf
import schedules
from core import UsageError
from settings import changed


def test_the_cifar_rate_is_linear_between_its_knots_and_exact_at_them():
    s = cf.LR(knots=(0, 5, 24), values=(0.0, 0.4, 0.0)).at
    assert [s(t) for t in (0, 5, 24)] == [0.0, 0.4, 0.0]
    assert s(2.5) == pytest.approx(0.2)
    assert s(14.5) == pytest.approx(0.2)
    assert s(-1) == 0.0 and s(30) == 0.0          # constant beyond the ends


def test_the_cifar_rate_has_a_flat_tail_like_myrtle10():
    s = cf.LR(knots=(0, 0.2, 0.8), values=(0.0, 1.0, 0.1)).at
    assert s(0.2) == 1.0 and s(0.8) == pytest.approx(0.1) and s(1.0) == pytest.approx(0.1)
    assert s(0.5) == pytest.approx(0.55)
    assert cf.LR(knots=(0, 0.5, 0.5, 1), values=(0.0, 1.0, 2.0, 0.0)).at(0.5) == 1.0     # a step: its first value


def test_the_cifar_rate_refuses_bad_knots_in_one_line():
    with pytest.raises(UsageError, match="must have the same length"):
        cf.recipe("myrtle24", lr_knots=(0, 1), lr_values=(0,))
    with pytest.raises(UsageError, match="must not decrease"):
        cf.recipe("myrtle24", lr_knots=(0, 0.5, 0.2), lr_values=(0, 1, 0))


def test_linear_scaling():
    assert schedules.linear_scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert schedules.linear_scaled_lr(0.4, 2048, base_batch=512) == pytest.approx(1.6)


def test_slow_start_lr_is_akiba_et_al_s_schedule_at_its_knots():
    # 90 epochs: 0.5 η for 40, 0.075 η for 30, 0.01 η for 15, 0.001 η for 5
    knots = {0: 0.5, 39.99: 0.5, 40: 0.075, 69.99: 0.075, 70: 0.01, 84.99: 0.01, 85: 0.001, 90: 0.001}
    for epoch, factor in knots.items():
        assert schedules.slow_start_lr(epoch, 3.2) == pytest.approx(3.2 * factor), epoch
    # other lengths stretch it: 45 epochs change at 20, 35 and 42.5
    for epoch, factor in {0: 0.5, 19.9: 0.5, 20: 0.075, 35: 0.01, 42.4: 0.01, 42.5: 0.001}.items():
        assert schedules.slow_start_lr(epoch, 3.2, epochs=45) == pytest.approx(3.2 * factor), epoch


def test_batch_size_schedule():
    s = schedules.BatchSizeSchedule([(0, 16384), (30, 32768), (60, 65536)])
    assert [s.batch(e) for e in (0, 29, 30, 59, 60, 89)] == [16384, 16384, 32768, 32768, 65536, 65536]
    assert s.lr_scale(45) == 2.0 and s.lr_scale(0) == 1.0
    assert s.per_rank(60, 1024) == 64
    for knots, msg in [([], "must start at epoch 0"), ([(1, 8)], "must start at epoch 0"),
                       ([(0, 0)], "batch sizes must be positive"),
                       ([(0, 8), (5, 16), (5, 32)], "epochs must increase strictly"),
                       ([(0, 16), (5, 8)], "must not shrink the batch")]:
        with pytest.raises(ValueError, match=msg):
            schedules.BatchSizeSchedule(knots)


def test_schedules_of_rn50_16ep():
    r = inf.recipe("rn50_16ep")
    lr = r.schedule.lr
    assert [schedules.res_at(r, e) for e in range(16)] == [160] * 12 + [192] * 4  # 176 at epoch 12 rounds to 192
    assert schedules.lr_at(r, 0) == 0 and schedules.lr_at(r, 1) == pytest.approx(lr / 2)
    assert schedules.lr_at(r, 2) == pytest.approx(lr) and schedules.lr_at(r, 16) == pytest.approx(0)
    assert schedules.lr_at(r, 9) == pytest.approx(lr / 2)
    cos = changed(r, schedule="cosine")
    assert schedules.lr_at(cos, 9) == pytest.approx(lr / 2)
    assert schedules.lr_at(cos, 5.5) > schedules.lr_at(r, 5.5)
    step = changed(r, schedule="step", step_epochs=(8, 12))
    assert schedules.lr_at(step, 7.9) == pytest.approx(lr)
    assert schedules.lr_at(step, 12) == pytest.approx(lr / 100)
    scaled = changed(r, batch_scale=True)
    res, scaled_res = r.resolution, scaled.resolution
    assert schedules.batch_at(512, res, 160) == 512 and schedules.batch_at(512, scaled_res, 192) == 512
    assert schedules.batch_at(512, scaled_res, 160) == 736
    assert schedules.batch_for(scaled, 0, world=2) == schedules.batch_at(256, scaled_res, 160)     # each rank's share


def test_slow_start_schedule_is_akiba_et_al_s_stretched_to_the_run():
    # 0.5 η for 40 of 90 epochs, 0.075 η for 30, 0.01 η for 15, 0.001 η for 5; never above 0.5 η, even while
    # a linear warm-up (here 2 epochs) leads into it; 45 epochs stretch it by half
    r = inf.recipe("tiny", schedule="slow_start", lr=0.4, epochs=90, warmup_epochs=2.0)
    got = [schedules.lr_at(r, t) for t in (0, 1, 2, 39.9, 40, 69.9, 70, 85, 89.9)]
    assert got == pytest.approx([0, 0.1, 0.2, 0.2, 0.03, 0.03, 0.004, 0.0004, 0.0004])
    assert max(schedules.lr_at(r, t / 10) for t in range(900)) == pytest.approx(0.2)
    r = changed(r, epochs=45, warmup_epochs=0.0)
    assert [schedules.lr_at(r, t) for t in (0, 19.9, 20, 35, 42.5)] == pytest.approx([0.2, 0.2, 0.03, 0.004, 0.0004])


def test_a_warm_up_may_start_from_a_rate_of_its_own():
    """Goyal et al.'s gradual warm-up starts from the rate of one 256-image worker, not from zero, and rises by the
    same amount every step to the scaled rate after 5 epochs."""
    r = inf.recipe("rn50_16ep", lr=0.1, batch_size=8192, warmup_epochs=5.0, warmup_start=1 / 32,
                   schedule="step", step_epochs=(30, 60, 80), epochs=90)
    rates = [schedules.lr_at(r, t) * 8192 / 256 for t in (0, 2.5, 5, 29.9, 30, 60, 80)]
    assert rates == pytest.approx([0.1, 1.65, 3.2, 3.2, 0.32, 0.032, 0.0032])


def test_fractional_epochs_count_their_steps_as_airbench():
    assert cifar_data.epoch_steps(9.9, 48) == 476 and cifar_data.epoch_steps(1.1, 10) == 11
    assert cifar_data.run_steps(50000, 1024, 9.9) == (48, 476)
    with pytest.raises(ValueError, match="batch size 64 is larger than the 32 training images"):
        cifar_data.run_steps(32, 64, 1)
    assert schedules.per_rank_batch(1024, 4) == 256
    with pytest.raises(ValueError, match="global batch size 63 is not divisible by the world size 2"):
        schedules.per_rank_batch(63, 2)


def test_the_cluster_recipes_hold_the_papers_settings():
    """ResNet-50, 90 epochs at 224 px; Goyal et al.'s 8k batch at 3.2 after 5 epochs rising from 0.1; Akiba et al.'s
    32k batch on a slow start from half of 12.8 with RMSprop handing over to SGD and last-batch statistics; Mikami et
    al.'s batch growing from 34,816 to 69,632 after 5 epochs over a 2D torus in fp16."""
    rate = lambda r, t: schedules.lr_at(r, t) * schedules.batch_for(r, int(t)) / 256
    for name in ("goyal_8k", "akiba_32k", "mikami_68k"):
        r = inf.recipe(name)
        net, res = r.network, r.resolution
        assert (net.model, r.epochs, res.min_res, res.max_res) == ("resnet50", 90, 224, 224), name
        assert not net.blurpool and r.sgd.momentum == 0.9 and r.sgd.weight_decay == 1e-4, name
    goyal = inf.recipe("goyal_8k")
    assert goyal.batch_size == 8192 and goyal.network.zero_init and goyal.sgd.label_smoothing == 0
    assert [rate(goyal, t) for t in (0, 5, 29.9, 30, 60, 80)] == pytest.approx([0.1, 3.2, 3.2, 0.32, 0.032, 0.0032])
    akiba = inf.recipe("akiba_32k")
    assert (akiba.batch_size, akiba.lars, akiba.bn_stats) == (32768, None, "last_batch") and akiba.rmsprop
    assert [rate(akiba, t) for t in (0, 39.9, 40, 70, 85)] == pytest.approx([6.4, 6.4, 0.96, 0.128, 0.0128])
    mikami = inf.recipe("mikami_68k")
    assert [schedules.batch_for(mikami, e) for e in (0, 4, 5, 89)] == [34816, 34816, 69632, 69632]
    assert mikami.comm_hook == "torus_fp16" and mikami.sgd.label_smoothing == 0.1
