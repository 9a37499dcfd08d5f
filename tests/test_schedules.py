"""Every schedule of a run (learning rate, steps, resolution, batch), plain arithmetic checked against the published
schedules it reproduces."""
import re

import pytest

import cifar10_fast as cf
import imagenet_fast as inf
import schedules
import settings
from conftest import ROOT
from core import UsageError
from settings import changed


def test_the_cifar_rate_is_linear_between_its_knots_and_exact_at_them():
    s = schedules.LRSettings(knots=(0, 5, 24), values=(0.0, 0.4, 0.0)).at
    assert [s(t) for t in (0, 5, 24)] == [0.0, 0.4, 0.0]
    assert s(2.5) == pytest.approx(0.2)
    assert s(14.5) == pytest.approx(0.2)
    assert s(-1) == 0.0 and s(30) == 0.0          # constant beyond the ends


def test_the_cifar_rate_has_a_flat_tail_like_myrtle10():
    s = schedules.LRSettings(knots=(0, 0.2, 0.8), values=(0.0, 1.0, 0.1)).at
    assert s(0.2) == 1.0 and s(0.8) == pytest.approx(0.1) and s(1.0) == pytest.approx(0.1)
    assert s(0.5) == pytest.approx(0.55)
    step = schedules.LRSettings(knots=(0, 0.5, 0.5, 1), values=(0.0, 1.0, 2.0, 0.0))
    assert step.at(0.5) == 1.0                                      # a step: its first value


def test_a_floor_holds_the_rate_at_a_fraction_of_its_peak_as_e1s_schedule_does():
    """E1 (fast94_curriculum): lr = peak × max(1 − s / 272, 0.05) at step s of 284 (its decay over 8.5 epochs of
    32 steps, the run 8.875); without a floor the same knots fall to 0."""
    r = cf.recipe("fast94_curriculum")
    e1 = [0.5415 * max(1 - s / 272, 0.05) for s in range(284)]
    assert [r.lr.at(s / 284) for s in range(284)] == pytest.approx(e1, rel=1e-12)
    assert r.lr.at(258 / 284) > 0.05 * 0.5415 == r.lr.at(259 / 284) == r.lr.at(1.0)
    assert changed(r, lr_floor=0).lr.at(1.0) == 0.0
    assert schedules.LRSettings(knots=(0, 0.2, 1), values=(0.1, 1.0, 0.0), floor=0.5).at(0) == 0.5   # of the peak
    with pytest.raises(UsageError, match=r"^--lr-floor 1.5: must be between 0 and 1$"):
        changed(r, lr_floor=1.5)


def test_the_cifar_rate_refuses_bad_knots_in_one_line():
    with pytest.raises(UsageError, match="must have the same length"):
        cf.recipe("myrtle24", lr_knots=(0, 1), lr_values=(0,))
    with pytest.raises(UsageError, match="must not decrease"):
        cf.recipe("myrtle24", lr_knots=(0, 0.5, 0.2), lr_values=(0, 1, 0))


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
    assert schedules.lr_at(r, 0) == pytest.approx(1e-4 * lr) and schedules.lr_at(r, 1) == pytest.approx(
        lr * (1e-4 + (1 - 1e-4) / 2))                                   # FFCV's warm-up starts at 1e-4 of the peak
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
    assert schedules.batch_for(scaled, 0, world=2) == schedules.batch_at(512, scaled_res, 160)     # each GPU's own
    shared = changed(scaled, per_gpu_batch=False)
    assert schedules.batch_for(shared, 0, world=2) == schedules.batch_at(256, scaled_res, 160)     # each rank's share


@pytest.mark.parametrize("name, per_gpu, lr", [("rn50_16ep", 512, 1.7), ("rn50_88ep", 512, 1.7),
                                               ("rn18_16ep", 1024, 0.5)])
def test_ffcvs_recipes_train_ffcvs_batch_on_each_gpu_at_ffcvs_rate_whatever_the_number_of_gpus(name, per_gpu, lr):
    """FFCV's train_imagenet.py: each GPU loads batch_size images, and the rate is the configuration's (get_lr does
    not scale it by the batch or the GPUs): 1.7 for ResNet-50 (their 8 GPUs: 4,096 images), 0.5 for ResNet-18."""
    r = inf.recipe(name)
    for world in (1, 8, 64):
        assert schedules.batch_for(r, 0, world) == per_gpu
        rows = schedules.plan(r, world)
        assert rows[0]["batch"] == per_gpu * world and rows[1]["lr_end"] == pytest.approx(lr)       # the peak, epoch 2
    linear = changed(r, lr_scaling="linear", lr=lr * 256 / 4096)         # --lr-scaling linear: the rate per image
    assert schedules.plan(linear, 8)[1]["lr_end"] == pytest.approx(lr * 8 * per_gpu / 4096)


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
    assert schedules.epoch_steps(9.9, 48) == 476 and schedules.epoch_steps(1.1, 10) == 11
    assert schedules.run_steps(50000, 1024, 9.9) == (48, 476)
    with pytest.raises(ValueError, match="batch size 64 is larger than the 32 training images"):
        schedules.run_steps(32, 64, 1)
    assert schedules.per_rank_batch(1024, 4) == 256
    with pytest.raises(ValueError, match="global batch size 63 is not divisible by the world size 2"):
        schedules.per_rank_batch(63, 2)


def test_the_cluster_recipes_hold_the_papers_settings():
    """ResNet-50 without BlurPool, momentum 0.9 and weight decay 1e-4, batch norm over each paper's per-GPU batch;
    Goyal et al.'s 8k batch at 3.2 after 5 epochs rising from 0.1; Akiba et al.'s 32k batch on a slow start from half
    of 12.8 with RMSprop handing over to SGD and last-batch statistics; Mikami et al.'s batch doubling after 5
    epochs over a 2D torus in fp16, label smoothing in the second version alone; Yamazaki et al.'s 81,920 with LARS;
    fast.ai's tables, each block's last batch norm at 0, timed to top-5 93%. Their per-epoch schedules are checked
    against docs/imagenet.md's tables below."""
    rate = lambda r, t: schedules.step_lr(r, t, schedules.batch_for(r, int(t)))
    groups = {"goyal_8k": 32, "akiba_32k": 32, "mikami_68k": 16, "mikami_122s": 8, "yamazaki_81k": 40,
              "fastai_1x8": 512, "fastai_4x8": 256, "fastai_8x8": 128, "fastai_16x8": 64}
    for name, group in groups.items():
        r = inf.recipe(name)
        assert r.network.model == "resnet50" and not r.network.blurpool, name
        assert r.sgd.momentum == 0.9 and r.sgd.weight_decay == 1e-4, name
        assert schedules.batch_for(r, 0) // r.bn_workers == group, name              # each paper GPU's first batch
    goyal = inf.recipe("goyal_8k")
    assert goyal.batch_size == 8192 and goyal.network.zero_init and goyal.sgd.label_smoothing == 0
    assert [rate(goyal, t) for t in (0, 5, 29.9, 30, 60, 80)] == pytest.approx([0.1, 3.2, 3.2, 0.32, 0.032, 0.0032])
    akiba = inf.recipe("akiba_32k")
    assert (akiba.batch_size, akiba.lars, akiba.bn_stats) == (32768, None, "last_batch") and akiba.rmsprop
    assert [rate(akiba, t) for t in (0, 39.9, 40, 70, 85)] == pytest.approx([6.4, 6.4, 0.96, 0.128, 0.0128])
    first, second = inf.recipe("mikami_68k"), inf.recipe("mikami_122s")
    assert [schedules.batch_for(first, e) for e in (0, 4, 5, 89)] == [34816, 34816, 69632, 69632]
    assert [schedules.batch_for(second, e) for e in (0, 4, 5, 89)] == [27648, 27648, 55296, 55296]
    assert (first.comm_hook, first.sgd.label_smoothing, second.sgd.label_smoothing) == ("torus_fp16", 0.0, 0.1)
    assert rate(first, 4.999) == pytest.approx(rate(first, 5.0), rel=1e-3)      # the rate goes on as the batch doubles
    fujitsu = inf.recipe("yamazaki_81k")
    assert (fujitsu.batch_size, fujitsu.lars.trust, fujitsu.sgd.label_smoothing) == (81920, 0.001, 0.1)
    for name in ("fastai_1x8", "fastai_4x8", "fastai_8x8", "fastai_16x8"):
        r = inf.recipe(name)
        assert r.network.zero_init and r.sgd.label_smoothing == 0 and r.target_top5 == 0.93, name
        assert schedules.res_at(r, 0) == 128 and schedules.res_at(r, r.epochs - 1) == 288, name


# --- phases: a table of epoch ranges, each with its size, batch, rate, crop scale and validation -------------------

# two phases: 2 epochs at 16 px and a global batch of 64 with the rate rising 0.1 -> 0.3 and crops down to 0.35 of the
# image, validated at the recipe's --val-res; then 1 epoch at 24 px, 128 images, rate 0.2, crops of at least half the
# image, validated on whole images at 24 px
TWO = (0, 2, 16, 64, 0.1, 0.3, 0.35, 0, 0,
       2, 3, 24, 128, 0.2, 0.2, 0.5, 24, 1)


def test_a_phase_table_sets_each_epochs_size_batch_rate_crop_and_validation():
    r = inf.recipe("tiny", phases=TWO, lr_scaling="none")
    assert r.epochs == 3                                                  # the table's end
    assert [schedules.res_at(r, e) for e in range(3)] == [16, 16, 24]
    assert [schedules.batch_for(r, e, world=2) for e in range(3)] == [32, 32, 64]       # each rank's share
    assert [schedules.lr_at(r, t) for t in (0, 1, 1.5, 2, 2.9)] == pytest.approx([0.1, 0.2, 0.25, 0.2, 0.2])
    assert [schedules.crop_at(r, e) for e in (0, 2)] == [(0.35, 1.0), (0.5, 1.0)]
    assert [schedules.val_at(r, e) for e in (0, 2)] == [(32, 0.0), (24, 0.0)]      # tiny validates whole images
    crop = changed(r, val_crop=0.875)
    assert [schedules.val_at(crop, e) for e in (0, 2)] == [(32, 0.875), (24, 0.0)]  # rectangular: whole images
    rows = schedules.plan(r, world=2)
    assert [(p["epoch"], p["res"], p["batch"], p["crop_min"], p["val"]) for p in rows] == [
        (1, 16, 64, 0.35, (32, 0.0)), (2, 16, 64, 0.35, (32, 0.0)), (3, 24, 128, 0.5, (24, 0.0))]
    assert [p[k] for p in rows for k in ("lr_start", "lr_end")] == pytest.approx([0.1, 0.2, 0.2, 0.3, 0.2, 0.2])


def test_a_rate_per_images_follows_the_global_batch_and_a_plain_rate_does_not():
    """lr_scaling linear: lr is per lr_scale_base images of the global batch (Goyal et al.); none: the optimiser's
    rate as written, whatever the batch (FFCV's script, fast.ai's tables)."""
    per = inf.recipe("tiny", phases=TWO)
    plain = changed(per, lr_scaling="none")
    assert schedules.step_lr(per, 1.0, 64) == pytest.approx(0.2 * 64 / 256)
    assert schedules.step_lr(plain, 1.0, 64) == schedules.step_lr(plain, 1.0, 4096) == pytest.approx(0.2)
    assert [p["lr_start"] for p in schedules.plan(per, world=1)] == pytest.approx([0.025, 0.05, 0.1])


def test_every_schedule_gives_the_same_per_epoch_plan():
    """Without a table the plan comes from the warm-up, decay, resolution ramp and batch settings."""
    r = inf.recipe("goyal_8k")
    rows = schedules.plan(r, world=256)
    assert len(rows) == 90 and {(p["res"], p["batch"], p["crop_min"], p["val"]) for p in rows} == {
        (224, 8192, 0.08, (224, 0.875))}
    assert (rows[0]["lr_start"], rows[4]["lr_end"], rows[5]["lr_start"], rows[30]["lr_start"]) == pytest.approx(
        (0.1, 3.2, 3.2, 0.32))


@pytest.mark.parametrize("table, message", [
    (TWO[:-1], "must be rows of 9 numbers (start, end, res, batch, lr at start, lr at end, smallest crop scale, "
               "validation res or 0, rectangular validation 0 or 1); got 17 numbers"),
    ((1, 2, 16, 64, 0.1, 0.1, 0.35, 0, 0), "row 1 starts at epoch 1; the first starts at 0"),
    (TWO[:9] + (3,) + TWO[10:], "row 2 starts at epoch 3; the row before ends at 2"),
    ((0, 0, 16, 64, 0.1, 0.1, 0.35, 0, 0), "row 1 ends at epoch 0, not after its start 0"),
    ((0, 1.5, 16, 64, 0.1, 0.1, 0.35, 0, 0), "row 1: epochs, res, batch and validation res are whole numbers"),
    ((0, 1, 16, 0, 0.1, 0.1, 0.35, 0, 0), "row 1: res and batch must be positive"),
    ((0, 1, 16, 64, 0.1, 0.1, 0, 0, 0), "row 1: the smallest crop scale must be in (0, 1]"),
    ((0, 1, 16, 64, 0.1, 0.1, 0.35, 0, 2), "row 1: rectangular validation is 0 or 1"),
])
def test_a_bad_phase_table_is_one_line_naming_the_flag(table, message):
    with pytest.raises(inf.UsageError) as e:
        inf.recipe("tiny", phases=table)
    assert str(e.value) == f"--phases {','.join(f'{v:g}' for v in table)}: {message}"


def test_the_settings_a_phase_table_replaces_are_refused_beside_it():
    with pytest.raises(inf.UsageError) as e:
        inf.recipe("tiny", phases=TWO, val_res=16)             # the table's second row validates at 24 px
    assert str(e.value) == ("--val-res 16: the phase table (--phases) sets each phase's validation resolution; change "
                            "--phases instead")
    assert inf.recipe("tiny", phases=TWO[:9], val_res=16).validation.res == 16
    for flag, value in (("epochs", 4), ("batch_size", 64), ("lr", 0.1), ("min_res", 32), ("warmup_epochs", 1.0),
                        ("batch_schedule", (0, 16))):
        with pytest.raises(inf.UsageError) as e:
            inf.recipe("tiny", phases=TWO, **{flag: value})
        assert str(e.value) == (f"--{flag.replace('_', '-')} {settings.show(value)}: the phase table (--phases) "
                                f"sets each phase's epochs, resolution, batch and rate; change --phases instead")


def test_imagenet_settings_are_checked_when_built():
    """A bad value fails where its settings are built, in the line a flag gives; what depends on several settings
    (the resolution's step and smallest size) waits for the recipe's check, since flags change one at a time."""
    import imagenet_data
    import imagenet_models
    for build, message in ((lambda: schedules.LRScheduleSettings(warmup_start=2),
                            "--warmup-start 2: must be between 0 and 1"),
                           (lambda: imagenet_data.ValidationSettings(res=0), "--val-res 0: must be positive"),
                           (lambda: imagenet_models.LARSSettings(trust=-1), "--lars-trust -1: must not be negative"),
                           (lambda: inf.Recipe(epochs=0), "--epochs 0: must be positive")):
        with pytest.raises(UsageError) as e:
            build()
        assert str(e.value) == message
    assert schedules.ProgressiveResizingSettings(min_res=8).min_res == 8
    assert inf.recipe("rn50_16ep", min_res=8, res_step=8)


# --- the cluster recipes' schedules as docs/imagenet.md gives them from their sources -----------------------------

CLUSTER = ("goyal_8k", "akiba_32k", "mikami_68k", "mikami_122s", "yamazaki_81k", "fastai_1x8", "fastai_4x8",
           "fastai_8x8", "fastai_16x8")


def documented_schedules():
    """{recipe: rows} of the tables docs/imagenet.md marks `<!-- schedule: NAME -->`: (first epoch, last epoch, size,
    global batch, rate at the start, rate at the end, smallest crop scale, validation)."""
    text = (ROOT / "docs" / "imagenet.md").read_text()
    tables = {}
    for m in re.finditer(r"<!-- schedule: (\w+) -->\n((?:\|.*\n)+)", text):
        rows = []
        for line in m[2].strip().splitlines()[2:]:
            epochs, size, batch, lr, crop, val = (c.strip() for c in line.strip("|").split("|"))
            first, _, last = epochs.partition("-")
            start, _, end = lr.partition("→")
            rows.append((int(first), int(last or first), int(size), int(batch.replace(",", "")), float(start),
                         float(end or start), float(crop), val))
        tables[m[1]] = rows
    return tables


@pytest.mark.parametrize("name", CLUSTER)
def test_each_cluster_recipe_trains_the_schedule_its_source_gives(name):
    """Every epoch of the recipe, as a run prints it (schedules.plan), is the row of docs/imagenet.md's table that
    holds it: its size, global batch, smallest crop scale and validation, and its rate at its start and end on the
    row's line from the start rate to the end rate."""
    plan = schedules.plan(inf.recipe(name), world=1)
    seen = []
    for first, last, size, batch, lr0, lr1, crop, val in documented_schedules()[name]:
        for e in range(first, last + 1):
            row, span = plan[e - 1], last - first + 1
            assert (row["res"], row["batch"], row["crop_min"], inf.view_text(row["val"])) == (size, batch, crop, val), e
            want = [lr0 + (lr1 - lr0) * (e - first + k) / span for k in (0, 1)]
            assert [row["lr_start"], row["lr_end"]] == pytest.approx(want, rel=1e-6, abs=1e-9), e
            seen.append(e)
    assert seen == list(range(1, len(plan) + 1))
