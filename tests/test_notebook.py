"""experiments.ipynb runs top to bottom, headless, in SMOKE mode on the CPU, and shows its tables and figures."""
import os

import nbclient
import nbformat
import pytest

import cifar10_fast as cf
from conftest import ROOT


@pytest.fixture(scope="module")
def executed(cifar10_npz, tmp_path_factory):
    nb = nbformat.read(ROOT / "experiments.ipynb", as_version=4)
    for cell in nb.cells:                       # start from a clean notebook, not the committed outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {"SMOKE": "1", "CIFAR10_NPZ": str(cifar10_npz), "N_RUNS": "2",
           "MPLBACKEND": "agg"}           # as on a headless CI machine: the notebook must still draw inline
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)                      # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs(nb, mime):
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})]


def test_every_cell_ran_without_error(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]


def test_one_table_per_stage_and_the_summary(executed):
    html = outputs(executed, "text/html")
    stages = [s["name"] for s in cf.JOURNEY] + [n for n in ("fast94", "fast95", "fast96") if n in cf.RECIPES]
    for name in stages:                          # each stage's own table, captioned with its name
        assert any(f"{name}: " in h for h in html), name
    summary = [h for h in html if "Journey summary" in h]
    assert len(summary) == 1
    for column in ("acc mean", "acc std", "time mean (s)", "time std (s)", "published V100 (s)", "our ratio", "published ratio"):
        assert column in summary[0], column
    assert all(name in summary[0] for name in stages)
    # everything from this run is labelled as a smoke run, never as results
    assert all("SMOKE run, not results" in h for h in html if "Journey summary" in h or "seed" in h)


def test_the_figures_are_drawn(executed):
    assert len(outputs(executed, "image/png")) == 2       # accuracy/time frontier, per-epoch curves


def test_a_smoke_run_writes_no_results(executed):
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "SMOKE run: results/journey.csv not written" in text
