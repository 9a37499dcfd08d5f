"""experiments.ipynb: trains the journey, myrtle10 -> fast94 -> fast94_next and fast94's ablation through the library at
the size it is given (tiny here, the CPU size under -m slow), prints the run's expected time first and each stage's
before it starts, counts its epochs on a bar, closes with a note from its own figures, shows the suite's stored
results apart from its own run, writes no file, and is committed without outputs. notebook_pace's sums, exactly."""
import getpass
import json
import math
import os
import sys

import nbclient
import nbformat
import numpy as np
import pandas as pd
import pytest
import torch

import cifar10_fast as cf
import notebook_pace as pace
from conftest import ROOT, synthetic_arrays
from run_statistics import one_sided_welch_p

sys.path.insert(0, str(ROOT / "benchmarks"))
import suite  # noqa: E402

TINY = "tiny size: width 0.0625, 256 training and 128 test images"


def execute(timeout=600, **env):
    """The notebook executed from clean (no committed outputs) with these environment variables, headless."""
    nb = nbformat.read(ROOT / "experiments.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {"MPLBACKEND": "agg", **env}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)                      # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return nb


def outputs(nb, mime):
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code"
            for o in c.outputs
            if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})]


def text(nb):
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def captioned(nb, words):
    return [h for h in outputs(nb, "text/html") if words in h]


def stored_result(name, sides, fp, *, smoke=False):
    """A result as the suite writes it (suite.new_result, suite.finish) with made-up runs: {side: accuracies}."""
    piece = next(pc for pc in suite.pieces() if pc.name == name)
    ctx = {"smoke": smoke, "data": "cifar10.npz", "device": None, "out": "out.json"}
    result = suite.new_result(piece, fp, ctx)
    for side, accs in sides.items():
        result["sides"][side]["runs"] = [
            {"seed": k, "final_acc": a, "time": 2.0 + k, "time_to_target": None,
             "rows": [{"epoch": 1, "test_acc": a, "total_time": 2.0 + k}]} for k, a in enumerate(accs)]
    return suite.finish(result, fp)


STORED_ABLATION = {"fast94": [0.941, 0.939, 0.942], "no TTA": [0.932, 0.930, 0.935]}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebook")
    np.savez(folder / "synthetic.npz", **synthetic_arrays(n_train=512, n_test=256))
    fp = {"device_name": "NVIDIA stand-in", "torch": "2.11.0", "date": "2026-01-02T03:04:05", "slug": "stand-in"}
    gpu = folder / "results" / "stand-in"
    gpu.mkdir(parents=True)
    (gpu / "journey.json").write_text(json.dumps(stored_result("journey", {"ghost_bn": [0.9123, 0.9141]}, fp)))
    (gpu / "ablation.json").write_text(json.dumps(stored_result("ablation", STORED_ABLATION, fp)))
    smoke = folder / "results" / "cpu-smoke"
    smoke.mkdir()
    (smoke / "journey.json").write_text(json.dumps(stored_result("journey", {"ghost_bn": [0.5]}, {
        **fp, "device_name": "CPU smoke"}, smoke=True)))
    (folder / "tmp").mkdir()
    before = sorted(p.name for p in ROOT.iterdir())
    nb = execute(NOTEBOOK_SIZE="tiny", CIFAR10_NPZ=str(folder / "synthetic.npz"), RESULTS=str(folder / "results"),
                 TMPDIR=str(folder / "tmp"), OMP_NUM_THREADS="")     # unset: the notebook chooses its threads
    return nb, folder, before


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(ROOT / "experiments.ipynb", as_version=4)
    assert [o for c in nb.cells if c.cell_type == "code" for o in c.outputs] == []


def test_it_trains_every_stage_into_a_running_table_with_the_size_and_device_on_each(tiny_run):
    nb, _, _ = tiny_run
    assert TINY in text(nb).splitlines()[0]                          # the size and device, first of all
    running = captioned(nb, "The journey so far")
    names = [s["name"] for s in cf.JOURNEY]
    assert len(running) == len(names)                                # one table a stage, each one stage longer
    for k, table in enumerate(running, 1):
        assert TINY in table
        assert all(f">{n}<" in table for n in names[:k]) and not any(f">{n}<" in table for n in names[k:])
    for column in ("accuracy", "time (s)", "published V100 (s)", "ours / first", "published / first"):
        assert f">{column}<" in running[-1]
    assert ">297<" in running[-1] and ">26<" in running[-1]          # Myrtle's published times beside ours


def test_it_prints_the_expected_time_first_then_each_stage_s_before_it_trains_with_a_bar(tiny_run):
    nb, _, _ = tiny_run
    lines = [line for c in nb.cells if c.cell_type == "code" for o in c.outputs      # stdout's and stderr's apart
             for line in o.get("text", "").replace("\r", "\n").splitlines()]
    assert "; 1 thread (OMP_NUM_THREADS sets another count)" in lines[1]         # one thread on a CPU, said
    first = next(k for k, line in enumerate(lines) if line.startswith("expected time of this run: about "))
    labels = [s["name"] for s in cf.JOURNEY] + ["fast94", "fast94_next"] + [a for a in suite.ABLATIONS if a != "fast94"]
    said = [line.split(":")[0] for line in lines if ": expected about " in line]
    assert said == labels                                     # every stage, in the order it trains, once
    assert first < next(k for k, line in enumerate(lines) if ": expected about " in line)
    for s in cf.JOURNEY:                                      # each stage's bar, full at its end (tiny: epochs x 1/14)
        n = math.ceil(cf.recipe(s["name"]).epochs * (1 / 14))
        assert any(line.startswith(f"{s['name']}: ") and f" {n}/{n} epochs, " in line for line in lines)


def test_its_closing_note_is_this_run_s(tiny_run):
    nb, _, _ = tiny_run
    note = text(nb).split("This run took ")[-1]
    planned = next(line for line in text(nb).splitlines() if line.startswith("expected time of this run: about "))
    assert f"planned {planned.split('about ')[1].split(' in all')[0]} from the steps timed" in note
    (running,) = [h for h in captioned(nb, "The journey so far") if ">tta10<" in h]
    first = running.split(">baseline_resnet18<")[1].split("</tr>")[0]        # the running table's first row
    shown = float(first.split("<td")[2].split(">")[1].split("<")[0])         # its accuracy, to 4 places
    said = float(note.split("reached baseline_resnet18 ")[1].split(" in ")[0])   # the note's, to 3
    assert abs(said - shown) <= 0.00055
    assert "In fast94's ablation (n = 2 a variant), switching each trick off in turn: " in note


def test_it_trains_the_modern_recipes_and_the_ablation_with_p_values(tiny_run):
    nb, _, _ = tiny_run
    (modern,) = captioned(nb, "myrtle10, fast94, fast94_next (")
    assert all(f">{n}<" in modern for n in ("myrtle10", "fast94", "fast94_next"))
    (live,) = [h for h in captioned(nb, "fast94's ablation") if TINY in h]
    assert "n = 2 runs each" in live and ">p (drop)<" in live
    assert all(f">{label}<" in live for label in suite.ABLATIONS)
    # live figures: the journey, its per-epoch curves, the modern recipes' curves, the ablation; stored: two more
    assert len(outputs(nb, "image/png")) == 6


def test_stored_results_are_shown_apart_and_smoke_results_never(tiny_run):
    nb, _, _ = tiny_run
    (journey,) = captioned(nb, "The journey (stored: NVIDIA stand-in, torch 2.11.0, 2026-01-02")
    assert ">ghost_bn<" in journey and f">{(0.9123 + 0.9141) / 2:.4f}<" in journey and TINY not in journey
    (ablation,) = captioned(nb, "fast94's ablation (stored: NVIDIA stand-in")
    base, off = STORED_ABLATION["fast94"], STORED_ABLATION["no TTA"]
    assert f">{np.mean(base) - np.mean(off):.4f}<" in ablation                     # the drop
    assert f">{one_sided_welch_p(base, off):.3g}<" in ablation                      # and Welch's p of it
    assert "CPU smoke" not in json.dumps(outputs(nb, "text/html"))


def test_it_writes_no_file(tiny_run):
    nb, folder, before = tiny_run
    # torch makes its compiler's cache folder in the temporary folder on first use, whoever trains: nothing else
    assert [p.name for p in (folder / "tmp").iterdir()] in ([], [f"torchinductor_{getpass.getuser()}"])
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_an_unknown_size_is_one_line(tmp_path):
    with pytest.raises(nbclient.exceptions.CellExecutionError) as e:
        execute(NOTEBOOK_SIZE="huge", CIFAR10_NPZ=str(tmp_path / "none.npz"))
    assert (e.value.ename, e.value.evalue) == ("UsageError", "NOTEBOOK_SIZE='huge': must be one of gpu, cpu, tiny")


@pytest.mark.slow
def test_it_runs_at_its_cpu_size_on_the_real_data():
    if not os.environ.get("CIFAR10_NPZ"):
        pytest.skip("set CIFAR10_NPZ to CIFAR-10 as one .npz")
    nb = execute(timeout=None, NOTEBOOK_SIZE="cpu", RESULTS=str(ROOT / "results"))
    assert "cpu size: width 0.25, 10000 training and 1000 test images" in text(nb)
    assert "expected time of this run: about " in text(nb) and "from the steps timed at the start: " in text(nb)
    trained, passed_over = len(captioned(nb, "The journey so far")), text(nb).count("not trained at the cpu size")
    assert trained == 3 and trained + passed_over == len(cf.JOURNEY)
    assert len(outputs(nb, "image/png")) >= 4


def test_on_a_cpu_it_trains_on_one_thread_unless_omp_num_threads_names_a_count(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert pace.train_threads(torch.device("cpu")) == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert pace.train_threads(torch.device("cpu")) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)


TIMING = pace.Timing(set_up_s=2.0, first_epoch_s=3.0, first_epoch_steps=4, step_s=0.5, plain_eval_s=0.25,
                     final_eval_s=1.0, run_extra_s=0.125)


def test_a_stage_s_expected_time_is_its_first_epoch_then_every_step_evaluation_and_set_up():
    r = cf.recipe("fast94", batch_size=100, epochs=2.5)      # 10 steps an epoch on 1,000 images, 25 in all, 3 epochs
    run = 3.0 + (25 - 4) * 0.5 + 2 * 0.25 + 1.0 + 0.125
    assert pace.expected_run_s(TIMING, r, 1000) == run
    assert pace.expected_stage_s(TIMING, r, n_train=1000, runs=3) == 2.0 + 3 * run


def test_each_expectation_follows_the_stage_before():
    p = pace.Pace()
    assert p.drift() == 1.0
    p.record("a", planned_s=10.0, expected_s=10.0, actual_s=15.0)
    p.record("b", planned_s=40.0, expected_s=60.0, actual_s=20.0)
    assert p.drift() == 0.5 and [s[0] for s in p.stages] == ["a", "b"]


def test_a_log_axis_where_the_times_span_a_factor_of_ten():
    assert not pace.spans_decades([2.0, 19.9]) and pace.spans_decades([2.0, 20.0])
    assert not pace.spans_decades([0.0, None, 5.0])          # zero and missing times are left out


def test_time_steps_times_two_epochs_of_the_steps_asked(one_thread):
    arrays = synthetic_arrays(n_train=256, n_test=64)
    timing = pace.time_steps(cf.recipe("fast94", width=0.0625, batch_size=32), arrays, device="cpu", steps=3,
                             test_images=16)
    assert timing.first_epoch_steps == 3
    assert min(timing.set_up_s, timing.first_epoch_s, timing.step_s, timing.plain_eval_s, timing.final_eval_s) > 0


def test_the_closing_note_is_computed_from_the_run():
    journey = pd.DataFrame({"accuracy": [0.7, 0.65], "time (s)": [150.0, 60.0], "ours / first": [1.0, 0.4],
                            "published / first": [1.0, 0.27]}, index=["baseline_resnet18", "resnet9_24"])
    modern = pd.DataFrame({"n": [2], "accuracy": [0.61], "accuracy std": [0.005], "time (s)": [24.0]},
                          index=["fast94"])
    ablation = pd.DataFrame({"n": [2, 2, 2], "drop": [np.nan, 0.02, -0.01], "p (drop)": [np.nan, 0.031, 0.8]},
                            index=["fast94", "no TTA", "no dirac init"])
    p = pace.Pace()
    p.record("baseline_resnet18", planned_s=100.0, expected_s=120.0, actual_s=150.0)
    lines = pace.closing_note(elapsed_s=600.0, planned_s=500.0, cpu_s=570.0, threads=1, pace=p, journey=journey,
                              modern=modern, ablation=ablation)
    assert lines[0].startswith("This run took 10.0 min (9.5 min of CPU time, 1 thread")
    assert lines[0].endswith("planned 8.3 min from the steps timed at the start: 1.20x.")
    assert lines[1] == "Each stage, expected then actual: baseline_resnet18 2.0 min / 2.5 min."
    assert lines[2] == ("The journey's stages reached baseline_resnet18 0.700 in 150 s; resnet9_24 0.650 in 60 s "
                        "(0.40 of the first stage's time; Myrtle's 0.27).")
    assert lines[3] == "Then fast94 0.610 (± 0.005, n = 2) in 24 s."
    assert lines[4] == ("In fast94's ablation (n = 2 a variant), switching each trick off in turn: no TTA cost 0.020 "
                        "(p = 0.031); no dirac init did not lower it (the accuracy changed by +0.010).")
