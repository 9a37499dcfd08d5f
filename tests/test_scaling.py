"""The alpha-beta scaling model of scaling.py: pure arithmetic, checked against its formulas."""
import os
import subprocess
import sys

import pytest

import scaling


def test_unknown_algorithm_is_an_exact_error():
    with pytest.raises(ValueError, match=r"^unknown allreduce algorithm 'star'; choose from ring, tree, torus$"):
        scaling.allreduce_time(1e6, 8, "star", link_gbps=10, latency_us=5)


def test_square_grid():
    assert scaling.square_grid(1024) == (32, 32)
    assert scaling.square_grid(2048) == (32, 64)
    assert scaling.square_grid(4) == (2, 2) and scaling.square_grid(7) == (1, 7)


SIM = dict(step_time_s=0.1, model_bytes=100e6, buckets=4, batch_per_gpu=32)
LINKS = scaling.Links(link_gbps=100, latency_us=10)


def test_simulate_efficiency_falls_with_gpus():
    rows = scaling.simulate([1, 8, 64, 512, 2048], LINKS, algorithm="ring", **SIM)
    assert rows[0]["efficiency"] == 1.0 and rows[0]["images_per_s"] == pytest.approx(320)
    effs = [r["efficiency"] for r in rows]
    assert all(a > b for a, b in zip(effs, effs[1:]))


def test_simulate_torus_beats_ring_when_latency_bound():
    kw, slow = {**SIM, "model_bytes": 1e6}, scaling.Links(link_gbps=100, latency_us=20)
    ring, torus = (scaling.simulate([2048], slow, algorithm=a, **kw)[0]["step_s"] for a in ("ring", "torus"))
    assert torus < ring
    # and a small count with a large message: the same bandwidth term, little latency, nearly equal
    ring, torus = (scaling.simulate([4], LINKS, algorithm=a, **SIM)[0]["step_s"] for a in ("ring", "torus"))
    assert torus == pytest.approx(ring, rel=1e-3)


def test_simulate_exact_formula_small_case():
    # 4 GPUs, ring, 1 bucket: c = 2*3*alpha + 2*3/4 * n * beta; step = F + B + c
    alpha, beta, n = 10e-6, 8 / 100e9, 100e6
    c = 6 * alpha + 1.5 * n * beta
    row = scaling.simulate([4], LINKS, algorithm="ring", **{**SIM, "buckets": 1})[0]
    assert row["step_s"] == pytest.approx(0.1 + c)
    # 4 buckets, communication-bound (c4 > B/4): step = F + B/4 + 4 c4
    row = scaling.simulate([4], scaling.Links(link_gbps=1, latency_us=10), algorithm="ring", **SIM)[0]
    c4 = 6 * alpha + 1.5 * n / 4 * 8 / 1e9
    F_, B = 0.1 / 3, 0.2 / 3
    assert row["step_s"] == pytest.approx(F_ + B / 4 + 4 * c4)
    assert row["efficiency"] == pytest.approx(0.1 / row["step_s"])


def test_simulate_command_prints_table_and_assumptions():
    out = subprocess.run([sys.executable, "scaling.py", "--gpus", "1,8,64", "--algorithm", "torus"],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(scaling.__file__)).stdout
    assert "assumptions:" in out and "A model, not a measurement" in out
    lines = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [ln[0] for ln in lines] == ["1", "8", "64"] and lines[0][-1] == "100.0%"
    assert scaling.main_simulate(["--published"]) == 0


def test_simulate_command_prints_the_time_for_some_epochs(capsys):
    assert scaling.main_simulate(["--gpus", "8", "--algorithm", "ring", "--epochs", "90", "--images-per-epoch",
                                  "1000"]) == 0
    header, row = capsys.readouterr().out.splitlines()[1:3]
    assert header.split()[-2:] == ["90", "epochs"]
    images_per_s = float(row.split()[4].replace(",", ""))
    seconds = float(row.split()[-2].replace(",", ""))
    assert seconds == pytest.approx(90 * 1000 / images_per_s, rel=5e-3)     # images/s as printed, rounded


def test_a_recipes_time_adds_its_phases_at_the_modelled_rate():
    """Each phase's epochs over ImageNet's images at simulate()'s images/s, a GPU's step taking its batch over the
    per-GPU rate at 224 px, in proportion to the pixels."""
    run = {**scaling.RECIPE_RUNS[0], "phases": ((2, 224, 32), (1, 112, 64)), "gpus": 1}
    per_s = run["per_gpu_224"]
    assert scaling.recipe_time(run, images=1000) == pytest.approx(2 * 1000 / per_s + 1000 / (4 * per_s))


def test_every_cluster_recipe_has_a_row_whose_phases_are_the_recipes_on_its_papers_gpus():
    import imagenet_fast as inf
    import schedules
    rows = {run["recipe"]: run for run in scaling.RECIPE_RUNS}
    assert sorted(rows) == sorted(["goyal_8k", "akiba_32k", "mikami_68k", "mikami_122s", "yamazaki_81k", "fastai_1x8",
                                   "fastai_4x8", "fastai_8x8", "fastai_16x8"])
    for name, run in rows.items():
        phases = []
        for p in schedules.plan(inf.recipe(name), world=run["gpus"]):
            shape = (p["res"], p["batch"] // run["gpus"])
            if phases and phases[-1][1:] == shape:
                phases[-1] = (phases[-1][0] + 1, *shape)
            else:
                phases.append((1, *shape))
        assert tuple(phases) == run["phases"], name
        assert 0 < scaling.recipe_time(run) and run["published_s"] > 0, name


def test_the_recipes_table_sets_the_model_beside_each_published_time(capsys):
    assert scaling.main_simulate(["--recipes"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| `")]
    assert len(lines) == len(scaling.RECIPE_RUNS) and "| `fastai_16x8` | 128 V100 |" in out
    for line, run in zip(lines, scaling.RECIPE_RUNS):
        model, ratio = line.split("|")[4:6]
        assert float(ratio) == pytest.approx(scaling.recipe_time(run) / run["published_s"], abs=5e-3)
