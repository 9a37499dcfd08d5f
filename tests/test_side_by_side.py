import json
import sys
import time
import types

import numpy as np
import pytest
import torch

from conftest import ROOT, synthetic_arrays

sys.path.insert(0, str(ROOT / "benchmarks"))
import loop  # noqa: E402
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


def fake_airbench(load_s, build_s):
    """A stand-in for the airbench package, shaped like it: train94 (lib_airbench94) runs airbench.utils.train,
    which builds the model (build_s) and loads the test set from disk (load_s) inside itself."""
    calls = []

    class CifarLoader:
        def __init__(self, path, train=True, batch_size=500, aug=None, altflip=False):
            time.sleep(0 if train else load_s)
            self.train, self.batch_size, self.aug, self.altflip = train, batch_size, aug, altflip

    def train(train_loader, verbose=True):
        test_loader = utils.CifarLoader("cifar10", train=False, batch_size=2000)
        time.sleep(build_s)
        calls.append(("train", train_loader, test_loader, verbose))
        return "model"

    def evaluate(model, loader, tta_level=0):
        calls.append(("evaluate", model, loader, tta_level))
        return 0.9401
    utils = types.SimpleNamespace(CifarLoader=CifarLoader, train=train)
    lib = types.SimpleNamespace(hyp={"opt": {"batch_size": 1024}, "aug": {"flip": True, "translate": 2},
                                     "net": {"tta_level": 2}})
    return types.SimpleNamespace(utils=utils, CifarLoader=CifarLoader, train94=train, lib_airbench94=lib,
                                 evaluate=evaluate), calls


def test_the_peers_clock_holds_its_model_construction_but_not_its_test_set_load():
    airbench, calls = fake_airbench(load_s=0.5, build_s=0.05)
    loader, test_loader = side_by_side.peer_loaders(airbench, "94")
    assert (loader.batch_size, loader.aug, loader.altflip, test_loader.train) == (1024, {"flip": True, "translate": 2},
                                                                                  True, False)
    r = side_by_side.time_peer(airbench, "94", loader=loader, test_loader=test_loader, sync=lambda: None)
    assert 0.05 <= r["time"] < 0.5 and r["final_acc"] == 0.9401
    (_, trained_on, tested_on, verbose), evaluation = calls
    assert trained_on is loader and tested_on is test_loader and not verbose
    assert evaluation == ("evaluate", "model", test_loader, 2)               # its own default TTA level
    assert airbench.utils.CifarLoader("cifar10", train=False).train is False   # put back after the run


def test_ours_gets_the_convolution_autotuning_the_command_line_gives_it(tmp_path, monkeypatch):
    # airbench's modules turn cuDNN's autotuning on when imported: without the peer (--peer none), ours must
    # still get it, as cifar10_fast.py gives it, or the two tools time different code
    npz = tmp_path / "synth.npz"
    np.savez(npz, **synthetic_arrays(128, 32))
    calls = []
    monkeypatch.setattr(side_by_side.devices, "autotune", lambda device: calls.append(("autotune", str(device))))
    train = loop.train
    monkeypatch.setattr(loop, "train", lambda *a, **k: calls.append(("train",)) or train(*a, **k))
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


def test_a_peer_script_runs_interleaved_with_ours_on_the_same_data(tmp_path, capsys, monkeypatch):
    evaluations = []
    real = loop.train
    monkeypatch.setattr(loop, "train", lambda *a, **k: evaluations.append(k.get("eval_every")) or real(*a, **k))
    rc, captured, res = peer_script_run(tmp_path, capsys)
    assert rc == 0, captured.err
    lines = [l.strip() for l in captured.out.splitlines() if " run " in l]
    assert [l.split(":")[0] for l in lines] == ["fast94 run 1/2", "fast94 peer run 1/2", "fast94 run 2/2",
                                                "fast94 peer run 2/2"]
    r = res["recipes"]["fast94"]
    assert r["peer_name"] == "stand_in.py" and [p["final_acc"] for p in r["peer"]] == [0.9412, 0.9412]
    assert [p["time"] for p in r["peer"]] == [3.0, 4.0]                       # each its own run, read from its output
    assert r["peer"][0]["matched"] == "accuracy 0.9412 time 3.0"
    assert evaluations == [0, 0]          # ours: evaluated only at the end of each timed run, never per epoch
    peer_row = next(row for row in res["table"] if row["recipe"] == "stand_in.py")
    assert peer_row["n"] == 2 and peer_row["mean_time"] == pytest.approx(3.5)


def test_a_percentage_is_read_as_one(tmp_path, capsys):
    rc, captured, res = peer_script_run(tmp_path, capsys, acc="94.12%")
    assert rc == 0, captured.err
    assert res["recipes"]["fast94"]["peer"][0]["final_acc"] == pytest.approx(0.9412)


@pytest.mark.parametrize("flags, message", [
    (["--peer-pattern", "acc (?P<acc>"], "--peer-pattern 'acc (?P<acc>': not a regular expression"),
    (["--peer-pattern", "acc (?P<acc>[0-9.]+)"], "--peer-pattern 'acc (?P<acc>[0-9.]+)': needs the named groups acc "
                                                 "and time (missing: time)"),
])
def test_a_bad_pattern_stops_before_anything_runs(tmp_path, capsys, flags, message):
    rc, captured, res = peer_script_run(tmp_path, capsys, *flags)
    assert rc == 2 and captured.err.startswith(f"error: {message}") and len(captured.err.splitlines()) == 1
    assert res is None


def test_a_missing_script_a_failing_one_and_one_without_a_match_are_one_line_each(tmp_path, capsys):
    rc = side_by_side.main(["--device", "cpu", "--peer-script", str(tmp_path / "nope.py")])
    assert rc == 2 and capsys.readouterr().err.strip() == f"error: --peer-script {tmp_path / 'nope.py'}: no such file"
    rc, captured, _ = peer_script_run(tmp_path, capsys, "--peer-pattern", r"score (?P<acc>\d+) in (?P<time>\d+)")
    (line,) = captured.err.strip().splitlines()
    assert rc == 1 and line.startswith("error: ") and "no line of its output matches --peer-pattern" in line
    assert "training images" in line                                        # the end of what it printed
    (tmp_path / "stand_in.py").write_text("raise SystemExit('no data here')")
    npz = tmp_path / "synth.npz"
    rc = side_by_side.main(["--device", "cpu", "--data-dir", str(npz), "--recipes", "fast94", "--runs", "0",
                            "--peer-runs", "1", "--batch-size", "64", "--width", "0.0625",
                            "--peer-script", str(tmp_path / "stand_in.py")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == f"error: {tmp_path / 'stand_in.py'} exited with status 1: no data here"
