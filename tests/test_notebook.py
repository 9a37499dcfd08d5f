"""experiments.ipynb: trains the journey, myrtle10 -> fast94 -> fast94_next and fast94's ablation through the library at
the size it is given (tiny here, the CPU size under -m slow), shows the suite's stored results apart from its own
run, writes no file, and is committed without outputs."""
import getpass
import json
import os
import sys

import nbclient
import nbformat
import numpy as np
import pytest

import cifar10_fast as cf
from conftest import ROOT, synthetic_arrays
from core import one_sided_welch_p

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
            for o in c.outputs if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})]


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
                 TMPDIR=str(folder / "tmp"), OMP_NUM_THREADS="1")     # one thread: tiny networks, a shared machine
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
    trained, passed_over = len(captioned(nb, "The journey so far")), text(nb).count("not trained at the cpu size")
    assert trained == 3 and trained + passed_over == len(cf.JOURNEY)
    assert len(outputs(nb, "image/png")) >= 4
