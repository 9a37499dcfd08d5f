import json
import sys
import types

import numpy as np
import pytest
import torch

from conftest import ROOT, synthetic_arrays

sys.path.insert(0, str(ROOT / "benchmarks"))
import side_by_side  # noqa: E402


def test_airbench_layout_is_what_airbench_reads(tmp_path):
    arrays = synthetic_arrays(20, 10)
    root = side_by_side.write_airbench_layout(arrays, tmp_path)
    for split, n in (("train", 20), ("test", 10)):
        d = torch.load(root / "cifar10" / f"{split}.pt")
        assert d["images"].dtype == torch.uint8 and d["images"].shape == (n, 32, 32, 3)        # NHWC
        assert torch.equal(d["images"], torch.from_numpy(arrays[f"{split}_images"]))
        assert d["labels"].dtype == torch.int64 and d["labels"].tolist() == arrays[f"{split}_labels"].tolist()
        assert d["classes"][:2] == ["airplane", "automobile"] and len(d["classes"]) == 10


def test_missing_peer_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "airbench", None)            # makes `import airbench` fail
    assert side_by_side.main(["--device", "cpu"]) == 1
    assert "pip install airbench" in capsys.readouterr().err


def test_ours_alone_on_the_cpu_prints_the_table_and_json(tmp_path, capsys):
    npz = tmp_path / "synth.npz"
    np.savez(npz, **synthetic_arrays(256, 64))
    out = tmp_path / "sbs.json"
    rc = side_by_side.main(["--peer", "none", "--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94",
                            "--runs", "2", "--epochs", "1", "--width", "0.0625", "--batch-size", "64", "--out", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(l for l in lines if l.split()[:2] == ["recipe", "n"])
    assert header.split() == ["recipe", "n", "mean_acc", "std_acc", "p_above_target", "mean_time", "std_time",
                              "time_ratio", "ratio_lo95", "ratio_hi95"]
    row = lines[lines.index(header) + 1].split()
    assert row[:2] == ["fast94", "2"]
    res = json.loads(out.read_text())
    ours = res["recipes"]["fast94"]["ours"]
    assert len(ours) == 2 and res["recipes"]["fast94"]["peer"] == []
    assert float(row[2]) == pytest.approx(np.mean([r["final_acc"] for r in ours]), abs=1e-4)
    assert res["recipes"]["fast94"]["flops"]["total"] > 0


def test_alternation_spreads_the_peer_runs_evenly():
    assert side_by_side.alternation(3, 3) == ["ours", "peer"] * 3
    order = side_by_side.alternation(100, 25)
    assert order.count("ours") == 100 and order.count("peer") == 25
    assert order[:10] == ["ours"] * 4 + ["peer"] + ["ours"] * 4 + ["peer"]
    assert side_by_side.alternation(0, 2) == ["peer", "peer"] and side_by_side.alternation(2, 0) == ["ours", "ours"]
    # the record's processes: each in the middle of its share of ours
    assert side_by_side.centred(25, 1) == ["ours"] * 13 + ["peer"] + ["ours"] * 12
    assert side_by_side.centred(25, 2) == ["ours"] * 7 + ["peer"] + ["ours"] * 12 + ["peer"] + ["ours"] * 6
    assert side_by_side.centred(0, 2) == ["peer", "peer"] and side_by_side.centred(2, 2) == ["ours", "peer"] * 2


class VirtualClock:
    """Stands in for side_by_side's time module: its seconds pass only when sleep says so, whatever the load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def fake_airbench(load_s, build_s, clock):
    """A stand-in for the airbench package, shaped like it: train94 (lib_airbench94) runs airbench.utils.train,
    which builds the model (build_s on clock) and loads the test set from disk (load_s) inside itself."""
    calls = []

    class CifarLoader:
        def __init__(self, path, train=True, batch_size=500, aug=None, altflip=False):
            clock.sleep(0 if train else load_s)
            self.train, self.batch_size, self.aug, self.altflip = train, batch_size, aug, altflip

    def make_net94():
        clock.sleep(build_s)
        return "model"

    def train(train_loader, verbose=True, make_net=make_net94):
        test_loader = utils.CifarLoader("cifar10", train=False, batch_size=2000)
        model = make_net()
        clock.sleep(0.25)                           # the whitening fit and the training steps
        calls.append(("train", train_loader, test_loader, verbose))
        return model

    def evaluate(model, loader, tta_level=0):
        clock.sleep(0.02)
        calls.append(("evaluate", model, loader, tta_level))
        return 0.9401
    utils = types.SimpleNamespace(CifarLoader=CifarLoader, train=train)
    lib = types.SimpleNamespace(hyp={"opt": {"batch_size": 1024}, "aug": {"flip": True, "translate": 2},
                                     "net": {"tta_level": 2}}, make_net94=make_net94)
    return types.SimpleNamespace(utils=utils, CifarLoader=CifarLoader, train94=train, lib_airbench94=lib,
                                 evaluate=evaluate), calls


def test_the_peers_clock_holds_its_model_construction_timed_apart_but_not_its_test_set_load(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(side_by_side, "time", clock)
    airbench, calls = fake_airbench(load_s=0.5, build_s=0.05, clock=clock)
    loader, test_loader = side_by_side.peer_loaders(airbench, "94")
    assert (loader.batch_size, loader.aug, loader.altflip, test_loader.train) == (1024, {"flip": True, "translate": 2},
                                                                                  True, False)
    r = side_by_side.time_peer(airbench, "94", loader=loader, test_loader=test_loader, sync=lambda: None)
    assert r["time"] == pytest.approx(0.32, abs=1e-9) and r["final_acc"] == 0.9401
    assert r["construct_s"] == pytest.approx(0.05, abs=1e-9)              # ours leaves it out: it is told apart
    assert r["eval_s"] == pytest.approx(0.02, abs=1e-9)                   # as ours records its final evaluation
    (_, trained_on, tested_on, verbose), evaluation = calls
    assert trained_on is loader and tested_on is test_loader and not verbose
    assert evaluation == ("evaluate", "model", test_loader, 2)               # its own default TTA level
    assert airbench.utils.CifarLoader("cifar10", train=False).train is False   # put back after the run


def test_the_airbench_peer_runs_beside_ours_on_a_gpu_with_its_model_construction_timed_apart(tmp_path, capsys,
                                                                                             monkeypatch):
    from cuda_standin import StandIn
    clock = VirtualClock()
    monkeypatch.setattr(side_by_side, "time", clock)
    airbench, calls = fake_airbench(load_s=0.5, build_s=0.05, clock=clock)
    monkeypatch.setitem(sys.modules, "airbench", airbench)
    npz, out = tmp_path / "synth.npz", tmp_path / "sbs.json"
    np.savez(npz, **synthetic_arrays(256, 64))
    with StandIn():
        assert side_by_side.main(["--data-dir", str(npz), "--recipes", "fast94", "--runs", "2", "--peer-runs", "2",
                                  "--epochs", "1", "--width", "0.0625", "--batch-size", "64", "--out", str(out)]) == 0
    assert "fast94 peer run 2/2: airbench94 0.9401 in 0.320 s (its model construction 0.050 s)" in capsys.readouterr().out
    peer = json.loads(out.read_text())["recipes"]["fast94"]["peer"]
    assert [(r["time"], r["construct_s"], r["eval_s"]) for r in peer] == [pytest.approx((0.32, 0.05, 0.02))] * 2
    assert [c[0] for c in calls] == ["train", "evaluate"] * 3              # an untimed warm-up run first


def test_ours_gets_the_convolution_autotuning_the_command_line_gives_it(tmp_path, monkeypatch):
    # airbench's modules turn cuDNN's autotuning on when imported: without the peer (--peer none), ours must
    # still get it, as cifar10_fast.py gives it, or the two tools time different code
    npz = tmp_path / "synth.npz"
    np.savez(npz, **synthetic_arrays(128, 32))
    calls = []
    monkeypatch.setattr(side_by_side.devices, "autotune", lambda device: calls.append(("autotune", str(device))))
    train = side_by_side.cf.train_run
    monkeypatch.setattr(side_by_side.cf, "train_run", lambda *a, **k: calls.append(("train",)) or train(*a, **k))
    assert side_by_side.main(["--peer", "none", "--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94",
                              "--runs", "1", "--epochs", "1", "--width", "0.0625", "--batch-size", "64"]) == 0
    assert calls[:2] == [("autotune", "cpu"), ("train",)]


STAND_IN = '''
import sys
from pathlib import Path
import torch
train = torch.load(Path("cifar10") / "train.pt")          # the data is where airbench's scripts read it
count = Path(sys.argv[1])
k = int(count.read_text()) if count.exists() else 0
count.write_text(str(k + 1))
print("epoch 1 accuracy 0.10 time 0.5 s")                    # an earlier line: the last match counts
Path("seen").write_text(str(len(train["labels"])))
print(f"final: accuracy {sys.argv[2]} time {3.0 + k} s, {len(train['labels'])} training images")
'''


def peer_script_run(tmp_path, capsys, *extra, acc="0.9412"):
    npz = tmp_path / "synth.npz"
    np.savez(npz, **synthetic_arrays(128, 32))
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    out = tmp_path / "sbs.json"
    rc = side_by_side.main(["--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94", "--runs", "2",
                            "--peer-runs", "2", "--epochs", "1", "--width", "0.0625", "--batch-size", "64",
                            "--peer-script", str(script), "--peer-args", f"{tmp_path / 'count'} {acc}",
                            "--out", str(out), *extra])
    captured = capsys.readouterr()
    return rc, captured, (json.loads(out.read_text()) if out.exists() else None)


def test_a_peer_script_runs_interleaved_with_ours_on_the_same_data(tmp_path, capsys):
    rc, captured, res = peer_script_run(tmp_path, capsys)
    assert rc == 0, captured.err
    lines = [l.strip() for l in captured.out.splitlines() if " run " in l]
    assert [l.split(":")[0] for l in lines] == ["fast94 run 1/2", "fast94 peer run 1/2", "fast94 run 2/2",
                                                "fast94 peer run 2/2"]
    r = res["recipes"]["fast94"]
    assert r["peer_name"] == "stand_in.py" and [p["final_acc"] for p in r["peer"]] == [0.9412, 0.9412]
    assert [p["time"] for p in r["peer"]] == [3.0, 4.0]                       # each its own run, read from its output
    assert r["peer"][0]["matched"] == "accuracy 0.9412 time 3.0"
    assert [(p["acc_raw"], p["time_raw"], p["percent"]) for p in r["peer"]] == [("0.9412", "3.0", False),
                                                                                ("0.9412", "4.0", False)]
    peer_row = next(row for row in res["table"] if row["recipe"] == "stand_in.py")
    assert peer_row["n"] == 2 and peer_row["mean_time"] == pytest.approx(3.5)
    assert "time as each reports it" in captured.out and res["time_protocol"].startswith("time as each reports it")
    assert res["complete"]


def test_ours_evaluate_once_per_timed_run_at_its_end_in_both_modes(tmp_path, capsys, monkeypatch):
    # two epochs: an evaluation per epoch would show as two per run; the one there is has the recipe's TTA
    evaluations = []
    real = side_by_side.cf.loss_and_accuracy
    monkeypatch.setattr(side_by_side.cf, "loss_and_accuracy",
                        lambda *a, **k: evaluations.append(k["tta"]) or real(*a, **k))
    tta = side_by_side.cf.recipe("fast94").tta
    assert tta is not None
    rc, captured, res = peer_script_run(tmp_path, capsys, "--epochs", "2")
    assert rc == 0, captured.err
    assert evaluations == [tta, tta]                                            # 2 runs of ours, one each
    assert [[row["test_acc"] is None for row in r["rows"]] for r in res["recipes"]["fast94"]["ours"]] == [
        [True, False], [True, False]]
    evaluations.clear()
    out = tmp_path / "alone.json"
    assert side_by_side.main(["--peer", "none", "--device", "cpu", "--data-dir", str(tmp_path / "synth.npz"),
                              "--recipes", "fast94", "--runs", "2", "--epochs", "2", "--width", "0.0625",
                              "--batch-size", "64", "--out", str(out)]) == 0
    assert evaluations == [tta, tta]


def test_a_percentage_is_read_as_one(tmp_path, capsys):
    rc, captured, res = peer_script_run(tmp_path, capsys, acc="94.12%")
    assert rc == 0, captured.err
    (first, _) = res["recipes"]["fast94"]["peer"]
    assert first["final_acc"] == pytest.approx(0.9412) and (first["acc_raw"], first["percent"]) == ("94.12", True)


@pytest.mark.parametrize("output, acc, percent", [
    ("accuracy 0.9412 time 3.21 s", 0.9412, False),
    ("val_acc: 94.12%, time: 3.21", 0.9412, True),
    ("Accuracy 94.12 Time 3.21", 0.9412, True),                  # above 1: a percentage; case-insensitive
    ("acc 0.5% time 3.21", 0.005, True),                          # a "%" after it: a percentage, however small
    ("train_acc 0.99 val_acc 0.9412 time 3.21 s", 0.9412, False),  # the accuracy nearest before the time
    ("accuracy 0.80 time 1.0\nepoch 9\naccuracy 0.9412 time 3.21 s\ndone", 0.9412, False),   # the last match
])
def test_the_default_pattern(output, acc, percent):
    r = side_by_side.read_peer_output(output, side_by_side.peer_pattern("default"), script="s.py")
    assert r["final_acc"] == pytest.approx(acc) and r["time"] == 3.21 and r["percent"] is percent


def test_the_airbench_table_pattern_reads_the_last_runs_eval_row():
    rule = "-" * 81
    output = "\n".join([rule, "|  run     |  epoch  |  train_acc  |  val_acc  |  tta_val_acc  |  time_seconds  |", rule,
                        "|  warmup  |      1  |     0.1016  |   0.1000  |               |        1.2345  |",
                        "|          |   eval  |     0.1016  |   0.1000  |       0.1000  |        9.8765  |", rule,
                        "|       0  |      1  |     0.5000  |   0.4000  |               |        0.3100  |",
                        "|          |   eval  |     0.9600  |   0.9350  |       0.9401  |        2.5912  |", rule,
                        "Mean: 0.9401    Std: nan"])
    r = side_by_side.read_peer_output(output, side_by_side.peer_pattern("airbench-table"), script="airbench94_muon.py")
    assert (r["final_acc"], r["time"]) == (0.9401, 2.5912)


def test_a_match_that_holds_no_accuracy_is_one_line():
    with pytest.raises(side_by_side.DataError, match="matched 'acc 128 time 3', whose acc '128'"):
        side_by_side.read_peer_output("acc 128 time 3", side_by_side.peer_pattern("default"), script="s.py")


def test_the_peer_script_sees_our_gpu_as_its_default_one():
    env = side_by_side.peer_environment("cuda:1", {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1"}
    assert side_by_side.peer_environment("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert side_by_side.peer_environment("cuda", {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert "CUDA_VISIBLE_DEVICES" not in side_by_side.peer_environment("cpu", {})


@pytest.mark.parametrize("flags, message", [
    (["--peer-pattern", "acc (?P<acc>"], "--peer-pattern 'acc (?P<acc>': not a regular expression"),
    (["--peer-pattern", "acc (?P<acc>[0-9.]+)"], "--peer-pattern 'acc (?P<acc>[0-9.]+)': needs the named groups acc "
                                                 "and time (missing: time)"),
    (["--peer-runs", "0"], "--peer-runs 0: a --peer-script needs at least one run"),
    (["--runs", "-1"], "--runs and --peer-runs must not be negative"),
    (["--peer-cwd", "/no/such/folder"], "--peer-cwd /no/such/folder: no such folder"),
    (["--peer", "none"], "--peer none and --peer-script: choose one"),
])
def test_a_bad_flag_stops_before_anything_runs(tmp_path, capsys, flags, message):
    rc, captured, res = peer_script_run(tmp_path, capsys, *flags)
    assert rc == 2 and captured.err.startswith(f"error: {message}") and len(captured.err.splitlines()) == 1
    assert res is None and not (tmp_path / "count").exists()                # the script never ran


def test_peer_flags_without_a_script_are_refused(capsys):
    assert side_by_side.main(["--peer", "none", "--device", "cpu", "--peer-pattern", "x"]) == 2
    assert capsys.readouterr().err.strip() == "error: --peer-pattern: only with --peer-script"


def test_a_given_peer_cwd_is_where_the_script_runs(tmp_path, capsys):
    own = tmp_path / "own"
    side_by_side.write_airbench_layout(synthetic_arrays(16, 8), own)
    rc, captured, res = peer_script_run(tmp_path, capsys, "--peer-cwd", str(own))
    assert rc == 0, captured.err
    assert [p["final_acc"] for p in res["recipes"]["fast94"]["peer"]] == [0.9412, 0.9412]
    assert (own / "seen").read_text() == "16"                                # its data, not ours (128 images)


def test_a_missing_script_a_failing_one_and_one_without_a_match_are_one_line_each(tmp_path, capsys):
    rc = side_by_side.main(["--device", "cpu", "--peer-script", str(tmp_path / "nope.py")])
    assert rc == 2 and capsys.readouterr().err.strip() == f"error: --peer-script {tmp_path / 'nope.py'}: no such file"
    rc, captured, res = peer_script_run(tmp_path, capsys, "--peer-pattern", r"score (?P<acc>\d+) in (?P<time>\d+)")
    (line,) = captured.err.strip().splitlines()
    assert rc == 1 and line.startswith("error: ") and "no line of its output matches --peer-pattern" in line
    assert r"'score (?P<acc>\\d+) in (?P<time>\\d+)'" in line                  # the pattern, named
    assert "training images" in line                                        # the end of what it printed
    assert not res["complete"] and len(res["recipes"]["fast94"]["ours"]) == 1   # written after our first run
    (tmp_path / "stand_in.py").write_text("import sys\nprint('about to fail')\nraise SystemExit('no data here')")
    npz = tmp_path / "synth.npz"
    rc = side_by_side.main(["--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94", "--runs", "0",
                            "--peer-runs", "1", "--batch-size", "64", "--width", "0.0625",
                            "--peer-script", str(tmp_path / "stand_in.py")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == f"error: {tmp_path / 'stand_in.py'} exited with status 1: no data here"
    (tmp_path / "stand_in.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    rc = side_by_side.main(["--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94", "--runs", "0",
                            "--peer-runs", "1", "--batch-size", "64", "--width", "0.0625",
                            "--peer-script", str(tmp_path / "stand_in.py")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == f"error: {tmp_path / 'stand_in.py'} was killed by signal 9: (nothing on stderr)"


# ---- the 2-second record's own script as the peer (tests/record_standin/ stands in for it on the CPU) ----

RECORD_STANDIN = ROOT / "tests" / "record_standin"


def test_the_records_run_count_is_its_one_edit_and_a_changed_script_is_refused():
    source = (RECORD_STANDIN / side_by_side.RECORD_SCRIPT).read_text()
    edited, edit = side_by_side.with_run_count(source, 7)
    assert edit == "for run in range(200): -> for run in range(7):"
    changed = [(a, b) for a, b in zip(source.splitlines(), edited.splitlines()) if a != b]
    assert changed == [("for run in range(200):", "for run in range(7):")] and len(edited.splitlines()) == len(
        source.splitlines())
    for bad in (source.replace("for run in range(200):", "for run in range(runs):"),
                source + "\nfor run in range(3):\n    pass\n"):
        with pytest.raises(side_by_side.DataError, match="lines 'for run in range"):
            side_by_side.with_run_count(bad, 7)


RECORD_TABLE = """|  run     |  epoch  |  train_acc  |  val_acc  |  tta_val_acc  |  time_seconds  |
|  warmup  |   eval  |     0.1016  |   0.1000  |       0.1000  |        9.8765  |
|       1  |   eval  |     0.9600  |   0.9350  |       0.9401  |        2.0150  |
Mean accuracy after 1 runs: 0.940100 | Mean time: 2.015000s\r|       2  |   eval  |     0.9610  |   0.9360  |       0.9411  |        2.0170  |
Mean accuracy after 2 runs: 0.940600 | Mean time: 2.016000s
Accuracies: Mean: 0.940600    Std: 0.000707
Times (s):  Mean: 2.016000    Std: 0.001414
"""


def test_the_records_table_gives_each_runs_tta_accuracy_and_its_own_time_and_its_summary():
    runs, summary = side_by_side.read_record_output(RECORD_TABLE, 2)
    assert [(r["run"], r["final_acc"], r["time"], r["val_acc"], r["train_acc"]) for r in runs] == [
        (1, 0.9401, 2.015, 0.935, 0.96), (2, 0.9411, 2.017, 0.936, 0.961)]          # the warm-up's row left out
    assert summary == {"mean_acc": 0.9406, "mean_time": 2.016}
    with pytest.raises(side_by_side.DataError, match=r"its table holds the runs \['1', '2'\], not 1 to 3"):
        side_by_side.read_record_output(RECORD_TABLE, 3)


def test_the_record_runs_beside_ours_a_process_a_turn_on_our_data_timed_by_its_table(tmp_path, capsys):
    npz, out = tmp_path / "synth.npz", tmp_path / "sbs.json"
    np.savez(npz, **synthetic_arrays(128, 32))
    rc = side_by_side.main(["--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94_next", "--runs", "2",
                            "--peer-runs", "3", "--epochs", "1", "--width", "0.0625", "--batch-size", "64",
                            "--peer", "record", "--record-dir", str(RECORD_STANDIN), "--record-processes", "2",
                            "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    ours_and_peer = [l.strip() for l in captured.out.splitlines() if l.strip().startswith("fast94_next ")]
    lines = [l.split(":")[0] for l in ours_and_peer if ":" in l]
    assert lines == ["fast94_next run 1/2", "fast94_next peer run 1/3", "fast94_next peer run 2/3",
                     "fast94_next run 2/2", "fast94_next peer run 3/3"]            # 2 runs, then 1, each after ours
    r = json.loads(out.read_text())["recipes"]["fast94_next"]
    assert r["peer_name"] == "cifar10_speedrun.py"
    assert [(p["process"], p["run"], p["final_acc"], p["time"]) for p in r["peer"]] == [
        (1, 1, 0.9401, 2.01), (1, 2, 0.9402, 2.02), (2, 1, 0.9401, 2.01)]
    processes = r["record"]["processes"]
    assert [(p["runs"], p["edit"], p["summary"]) for p in processes] == [
        (2, "for run in range(200): -> for run in range(2):", {"mean_acc": 0.94015, "mean_time": 2.015}),
        (1, "for run in range(200): -> for run in range(1):", {"mean_acc": 0.9401, "mean_time": 2.01})]
    assert all(p["wall_s"] > 0 for p in processes)
    assert r["record"]["source"] == str(RECORD_STANDIN / "cifar10_speedrun.py") and len(r["record"]["sha256"]) == 64
    assert "the record's, its CUDA events as its table prints them" in captured.out


def test_an_absent_record_and_bad_record_flags_stop_before_anything_runs(tmp_path, capsys):
    rc = side_by_side.main(["--device", "cpu", "--peer", "record", "--record-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"error: the record's script is not at {tmp_path / 'cifar10_speedrun.py'}: fetch "
                          "github.com/hiverge/cifar10-speedrun's cifar10_speedrun.py into")
    for flags, message in ((["--record-processes", "2"], "--record-processes: only with --peer record"),
                           (["--peer", "record", "--record-dir", str(RECORD_STANDIN), "--peer-runs", "2",
                             "--record-processes", "3"], "--peer-runs 2 and --record-processes 3: the record needs"),
                           (["--peer", "record", "--peer-script", __file__], "--peer record and --peer-script: "),
                           (["--alternate", "--recipes", "fast94,fast94_next"], "--alternate: with --peer none")):
        assert side_by_side.main(["--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


def test_a_record_process_that_fails_or_prints_a_short_table_is_one_line(tmp_path):
    side_by_side.write_airbench_layout(synthetic_arrays(16, 8), tmp_path)
    failing = "import sys\nfor run in range(200):\n    pass\nsys.exit('no GPU here')\n"
    with pytest.raises(side_by_side.DataError, match="^cifar10_speedrun.py exited with status 1: no GPU here$"):
        side_by_side.run_record(failing, 2, cwd=tmp_path, env=None, process=1)
    short = "for run in range(200):\n    pass\nprint('|  1  |  eval  |  0.9  |  0.9  |  0.9400  |  2.0000  |')\n"
    with pytest.raises(side_by_side.DataError, match=r"its table holds the runs \['1'\], not 1 to 2"):
        side_by_side.run_record(short, 2, cwd=tmp_path, env=None, process=1)


def test_the_records_runs_reach_the_caller_as_its_table_prints_them(tmp_path):
    source = (ROOT / "tests" / "record_standin" / "cifar10_speedrun.py").read_text()
    side_by_side.write_airbench_layout(synthetic_arrays(16, 8), tmp_path)
    printed = []
    rows, process = side_by_side.run_record(source, 3, cwd=tmp_path, env=None, process=2, on_run=printed.append)
    assert printed == rows and [r["run"] for r in rows] == [1, 2, 3] and rows[2]["process"] == 2
    assert (rows[0]["final_acc"], rows[0]["time"]) == (0.9401, 2.01) and process["runs"] == 3
