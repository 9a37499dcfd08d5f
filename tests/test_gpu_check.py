"""benchmarks/gpu_check.py: the first GPU lease's measurements, run tiny under the CPU stand-in for CUDA, as they
would run on a GPU (the 2-second record stood in by tests/record_standin/)."""
import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import suite  # noqa: E402


def test_the_smoke_pass_runs_the_record_beside_fast94_next_then_fast94_fastest_in_turn_with_it(tmp_path, capsys):
    assert gpu_check.main(["--smoke", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("suite on NVIDIA stand-in (CPU)")                 # as on a GPU
    assert [line.split(":")[0] for line in lines[1:]] == list(gpu_check.PIECES)     # in this order
    assert all(": complete in " in line for line in lines[2:]), lines
    (device,) = tmp_path.iterdir()
    env = json.loads((device / "env.json").read_text())
    assert env["counted_flops"]["fast94_fastest"]["train"] < env["counted_flops"]["fast94_next"]["train"]
    beside = json.loads((device / "fast94_next_record.json").read_text())
    ours, record = beside["sides"]["fast94_next"], beside["sides"]["record"]
    assert ours["command"].startswith("python benchmarks/side_by_side.py --recipes fast94_next --runs 2 --peer-runs 2")
    assert "--peer record --record-dir tests/record_standin" in record["command"]
    assert [run["seed"] for run in ours["runs"]] == [0, 1]
    assert [(run["process"], run["run"], run["final_acc"], run["time"], run["edit"]) for run in record["runs"]] == [
        (1, 1, 0.9401, 2.01, "for run in range(200): -> for run in range(2):"),
        (1, 2, 0.9402, 2.02, "for run in range(200): -> for run in range(2):")]
    assert beside["time_ratio"]["of"] == "fast94_next" and beside["time_ratio"]["to"] == "record"
    fastest = json.loads((device / "fast94_fastest.json").read_text())
    assert list(fastest["sides"]) == list(suite.FASTEST_SIDES) and fastest["kind"] == "alternating"
    assert fastest["sides"]["fast94_fastest"]["command"].startswith(
        "python benchmarks/side_by_side.py --recipes fast94_next,fast94_fastest "
        "--alternate --peer none --runs 2")
    assert all([run["seed"] for run in side["runs"]] == [0, 1] for side in fastest["sides"].values())
    ratio = fastest["time_ratios"]["fast94_fastest"]
    assert (ratio["of"], ratio["to"]) == ("fast94_fastest", "fast94_next") and ratio["low"] <= ratio["ratio"]


def test_the_gpu_pass_wants_a_gpu_its_data_and_the_record(capsys, monkeypatch, tmp_path):
    assert gpu_check.main(["--data-dir", "c.npz"]) == 1                 # this machine has no GPU
    assert capsys.readouterr().err.strip() == "error: gpu_check measures a CUDA GPU; use --smoke on the CPU"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err.startswith("error: --data-dir: CIFAR-10 as one .npz")
    monkeypatch.setattr(suite, "RECORD_DIR", tmp_path)
    assert gpu_check.main(["--data-dir", "c.npz"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: the record's script is not at {tmp_path / 'cifar10_speedrun.py'}: fetch") and \
        len(err.splitlines()) == 1
    asked = []
    monkeypatch.setattr(suite, "RECORD_DIR", gpu_check.suite.RECORD_STANDIN)
    monkeypatch.setattr(suite, "main", lambda argv, n: asked.append((argv, n)) or 0)
    assert gpu_check.main(["--data-dir", "c.npz"]) == 0
    assert asked == [(["--pieces", "env,fast94_next_record,fast94_fastest", "--budget-s", "540.0", "--data-dir",
                       "c.npz"], gpu_check.RUNS)]
    assert gpu_check.RUNS["fast94_next_record"] == {"fast94_next": 25, "record": 25}     # n >= 25 each
