"""The journey stages: Myrtle's published steps as recipes that build on each other."""
import dataclasses
import re

import pytest

import cifar10_fast as cf
from conftest import synthetic_arrays
from run_statistics import summarize_runs


def test_every_stage_is_a_recipe_in_order_with_a_published_time():
    names = [s["name"] for s in cf.JOURNEY]
    assert len(set(names)) == len(names)
    recipe_names = list(cf.RECIPES)
    assert [n for n in recipe_names if n in names] == names          # same order as published
    times = [s["published_v100_s"] for s in cf.JOURNEY]
    assert times[0] == 297 and times[-1] == 26
    assert all(b < a for a, b in zip(times, times[1:]))               # every published step was faster
    for name in names:
        cf.recipe(name)                                                 # only known settings, each allowed


def settings_of(name):
    """The recipe's settings: the recipe without what it says of itself (its name and description)."""
    return dataclasses.replace(cf.recipe(name), name="", doc="")


def test_the_journey_lands_on_the_existing_myrtle_recipes():
    # the cumulative changes must reproduce the two recipes written out independently
    assert settings_of("resnet9_24") == settings_of("myrtle24")
    assert settings_of("tta10") == settings_of("myrtle10")


def test_stages_carry_myrtles_numbers():
    r = cf.recipe
    first, bs768 = r("baseline_resnet18"), r("cutout30_bs768")
    assert (first.network.model, first.epochs, first.batch_size) == ("resnet18", 35, 128)
    assert settings_of("faster_bn") == settings_of("batch512")                  # fixes we have built in
    assert settings_of("gpu_aug") == settings_of("resnet9_24")
    assert (bs768.batch_size, bs768.epochs, bs768.augment.cutout) == (768, 30, 8)
    assert [r(n).epochs for n in ("maxpool_pre", "label_smoothing", "celu", "ghost_bn", "frozen_bn_scale",
                                  "whitening", "ema", "tta10")] == [25, 23, 20, 18, 17, 14, 13, 10]
    assert r("celu").network.celu_alpha == 0.075 and r("frozen_bn_scale").network.celu_alpha == 0.3
    assert r("ghost_bn").batch_norm.ghost_batch == 32 and not r("celu").batch_norm.ghost_batch
    assert r("ema").lr.knots[-1] * 13 == pytest.approx(11)            # lr floored for the last 2 of 13 epochs


def test_list_recipes_prints_one_line_per_stage(capsys):
    assert cf.main(["--list-recipes"]) == 0
    text = capsys.readouterr().out.split("\n", 1)[1]         # after the header; a doc's further lines indented
    entries = re.split(r"\n(?=\S)", text.strip())
    assert len(entries) == len(cf.RECIPES)
    by_name = {e.split()[0]: " ".join(e.split()) for e in entries}
    assert "journey 1/" in by_name["baseline_resnet18"] and "297 s" in by_name["baseline_resnet18"]


def test_train_trains_every_run_and_summarize_runs_summarises():
    result = cf.train("ema", synthetic_arrays(n_train=128, n_test=64),
                      changes=dict(epochs=2, width=0.125, batch_size=64),
                      options=cf.Options(device="cpu", runs=2, seed=3, target=0.01))
    runs = result.runs
    summary = summarize_runs(runs, 0.01, cf.SUMMARY, "final_acc")
    assert [r["seed"] for r in runs] == [3, 4] and all(len(r["rows"]) == 2 for r in runs)
    assert "model" not in runs[0] and result.summary["final_acc"] == summary["final_acc"]
    assert summary["final_acc"]["n"] == 2 and summary["fraction_reaching_target"] == 1.0
    assert summary["train_time"]["mean"] == pytest.approx(sum(r["train_time"] for r in runs) / 2)


def test_the_ablation_piece_switches_off_one_trick_of_fast94_a_side_as_the_notebook_does():
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite
    (piece,) = [pc for pc in suite.pieces() if pc.name == "ablation"]
    assert list(piece.sides) == list(suite.ABLATIONS) and set(piece.recipes.values()) == {"fast94"}
    off = {}
    for side, changes in suite.ABLATIONS.items():
        args, flags = cf.parse_args(["--recipe", "fast94", *piece.flags[side]])
        assert flags == changes                                            # the command trains the notebook's recipe
        r = cf.recipe("fast94", **flags)
        off[side] = (r.whitening is None, bool(r.whitening) and r.whitening.bias is None, r.lookahead is None,
                     r.augment.flip == "random", r.tta is None, r.label_smoothing == 0, not r.network.dirac_init)
    assert off.pop("fast94") == (False,) * 7
    assert [sum(v) for v in off.values()] == [1] * 7 and sorted(off.values(), reverse=True) == list(off.values())
