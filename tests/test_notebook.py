"""experiments.ipynb: shows the journey from results/ (measured results or nothing), re-runs the stages through
the suite only when asked, and is committed with measured outputs or none."""
import json
import os
import shutil

import nbclient
import nbformat
import pytest

import cifar10_fast as cf
from conftest import ROOT


def execute(**env):
    nb = nbformat.read(ROOT / "experiments.ipynb", as_version=4)
    for cell in nb.cells:                       # start from a clean notebook, not the committed outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {"MPLBACKEND": "agg", "RUN_STAGES": "0", "SMOKE": "0", **env}   # headless, as on a CI machine
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)                      # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    return nb


def outputs(nb, mime):
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})]


def text(nb):
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def measured_journeys():
    return [p for p in (ROOT / "results").glob("*/journey.json") if not json.loads(p.read_text()).get("smoke")]


def test_committed_outputs_are_measured_results_or_none():
    nb = nbformat.read(ROOT / "experiments.ipynb", as_version=4)
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    if not measured_journeys():
        assert shown == []
    assert "SMOKE" not in json.dumps(shown)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("journey")
    return folder, execute(RUN_STAGES="1", SMOKE="1", RESULTS=str(folder))


def test_asked_to_run_it_trains_every_stage_through_the_suite(smoke_run):
    folder, nb = smoke_run
    assert "journey: complete" in text(nb)
    (path,) = folder.glob("*/journey.json")
    assert json.loads(path.read_text())["smoke"]
    (summary,) = [h for h in outputs(nb, "text/html") if "Journey summary" in h]
    assert "SMOKE run on tiny synthetic data, not results" in summary     # never shown as results
    assert all(s["name"] in summary for s in cf.JOURNEY)
    for column in ("acc mean", "time mean (s)", "published V100 (s)", "our ratio", "published ratio"):
        assert column in summary
    assert len(outputs(nb, "image/png")) == 2                             # accuracy/time, per-epoch curves


def test_it_shows_measured_results_without_training(smoke_run, tmp_path):
    folder, _ = smoke_run
    (path,) = folder.glob("*/journey.json")
    result = json.loads(path.read_text())
    result["smoke"] = False                          # as the suite writes a GPU run's result
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "journey.json").write_text(json.dumps(result))
    nb = execute(RESULTS=str(tmp_path))
    assert "journey: complete" not in text(nb)                 # nothing trained
    (summary,) = [h for h in outputs(nb, "text/html") if "Journey summary" in h]
    runs = result["sides"]["ghost_bn"]["runs"]
    acc = sum(r["final_acc"] for r in runs) / len(runs)
    assert f"{acc:.4f}" in summary and "(measured)" in summary
    shutil.rmtree(tmp_path / "gpu")
    nb = execute(RESULTS=str(tmp_path))
    assert f"No journey results in {tmp_path}/ yet" in text(nb) and not outputs(nb, "text/html")
