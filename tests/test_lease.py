"""benchmarks/lease.py and benchmarks/fulcrum_adapter.py: the lease's plan rehearsed on a charged clock, the compile
cache's parts, the standard 6-view evaluation, the headline under both timings, and both calls run tiny on the CPU
with the peers' stand-ins (tests/peer_standins/)."""
import json
import shutil
import sys
import warnings

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fulcrum_adapter as fa  # noqa: E402
import lease  # noqa: E402

H200 = ROOT / "results" / "nvidia-h200"


@pytest.fixture
def suite_times(tmp_path):
    """The H200's suite results without a lease's own figures (lease.json): the planner's logic tested on fixed
    inputs, whatever a later lease measured."""
    for path in H200.glob("*.json"):
        if path.name != "lease.json":
            shutil.copy(path, tmp_path)
    return tmp_path


def test_the_planner_starts_from_the_h200s_measured_times(suite_times):
    found = lease.measured_times(suite_times)
    assert found["run_s"]["fast94_next"] == pytest.approx(1.1412, abs=1e-4)      # fast94_next.json, 91 runs
    assert found["cold_s"]["fast94_next"] == pytest.approx(164.0, abs=0.1)        # its first, cold, start
    assert found["warm_s"]["fast94_next"] == pytest.approx(46.3, abs=0.1)         # a later start, the cache filled
    times, source = lease.times_for(["fast94_next", "e1"], suite_times)
    assert times["run_s"] == {"fast94_next": found["run_s"]["fast94_next"], "e1": lease.ASSUMED["run_s"]["e1"]}
    assert source["run_s e1"] == "assumed" and source["run_s fast94_next"].startswith("measured")


def test_an_earlier_leases_own_figures_come_first(suite_times):
    tmp_path = suite_times
    (tmp_path / "lease.json").write_text(json.dumps({"sides": ["fast94_next", "e1"], "wall_s": {"e1": 1.9, "fast94_next": 1.2},
                                                     "build_s": {"cold": {"e1": 99.0}, "warm": {"e1": 33.0}}}))
    found = lease.measured_times(tmp_path)
    assert found["run_s"]["e1"] == 1.9 and found["run_s"]["fast94_next"] == 1.2
    assert found["cold_s"] == {"fast94_next": pytest.approx(164.0, abs=0.1), "e1": 99.0}
    assert found["warm_s"]["e1"] == 33.0


def test_the_rehearsal_brings_the_headline_home_inside_12_minutes_under_both_timings(capsys, suite_times):
    sides = ["fast94_next", "fast94_fastest", "fast94_curriculum", "e1", "hiverge"]
    times, _ = lease.times_for(sides, suite_times)
    steps, done, ok = lease.plan(sides, n=25, budget_s=720, times=times)
    print("\n".join(lease.minute_by_minute(steps)))
    assert ok and steps[-1][1] <= 720 and steps[0][1] - steps[0][0] == 120       # the machine's start charged
    assert all(done[s] >= 25 for s in lease.HEADLINE)
    assert [s[2] for s in steps] == sorted(s[2] for s in steps)                    # call 1, then call 2
    h = fa.headline(lease.rehearsed_rows(done, times), [s for s in sides if done[s] and s not in lease.PEERS])
    for timing in fa.TIMINGS:
        for peer in lease.PEERS:
            ci = h[timing]["ratios"][f"fast94_next/{peer}"]
            assert ci["low"] < ci["ratio"] < ci["high"] and h[timing]["sides"][peer]["n"] == 25
    # a budget it cannot meet is said, and sides beyond the headline are the ones left out
    _, done, ok = lease.plan(sides, n=25, budget_s=600, times=times)
    assert not ok and all(done[s] == 25 for s in lease.HEADLINE)
    assert [s for s in sides if not done[s]] == ["fast94_fastest", "fast94_curriculum"]


def test_the_plan_command_prints_the_carry_lists_and_both_calls(capsys, tmp_path, monkeypatch, suite_times):
    monkeypatch.setattr(lease, "VERSION_PATH", tmp_path / "code-version.json")   # the checkout stays as it was
    assert lease.main(["plan", "--sides", "fast94_next,e1,hiverge", "--runs", "25", "--results", str(suite_times)]) == 0
    out = capsys.readouterr().out
    assert 'call 1: carry [".gpudata/a", "peers", "code-version.json"]' in out
    assert 'call 2: carry [".gpudata/b", "peers", "code-version.json"]' in out
    assert json.loads((tmp_path / "code-version.json").read_text()) == lease.code_version()
    assert "benchmarks/lease.py call2 --out $OUT --data-dir /root/cifar10.npz --sides fast94_next,e1,hiverge " \
           "--runs 25" in out
    assert lease.main(["plan", "--runs", "400", "--results", str(suite_times)]) == 1                       # 400 rounds do not fit: said, exit 1
    assert "does NOT end" in capsys.readouterr().out


def test_bad_flags_are_one_line(capsys):
    for argv in (["call2", "--out", "o"], ["plan", "--runs", "1"], ["call1"]):
        with pytest.raises(SystemExit) as e:
            lease.main(argv)
        assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: call1: --out names the folder that comes back ($OUT)")
    with pytest.raises(SystemExit) as e:
        lease.main(["plan", "--sides", "fast94_later,e2"])
    assert (e.value.code, capsys.readouterr().err) == (2, "error: --sides fast94_later,e2: none of them is here; give "
                                                          "our recipes (cifar10_fast.py --list-recipes) or the peers "
                                                          "(e1, hiverge)\n")


def test_the_calls_flags_give_each_worker_a_command_its_own_parser_takes():
    """What the GPU machine runs, parsed as there (the smoke's own namespace leaves this path out): call 1 on random
    data and call 2 on CIFAR-10 give the adapter its arguments and every worker flags without an empty value."""
    for argv, synthetic in ((["call1", "--out", "o"], True), (["call2", "--out", "o", "--data-dir", "c.npz"], False)):
        args = lease.parse_args(argv)
        adapter = lease.adapter_args(args, sides=["fast94_next", "e1"], runs=2, synthetic=synthetic)
        assert (adapter.smoke, adapter.synthetic, adapter.compile) == (False, synthetic, "max-autotune")
        for side in ("fast94_next", "e1"):
            command = fa.worker_argv(side, adapter)
            worker = fa.parse_args(command[command.index("worker"):])
            assert "" not in command and worker.data_dir == (None if synthetic else "c.npz")


def test_the_cache_goes_back_in_parts_and_comes_back_whole(tmp_path, monkeypatch):
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "fxgraph").mkdir(parents=True)
    out.mkdir()
    blob = torch.randint(0, 256, (3000,), dtype=torch.uint8).numpy().tobytes()      # incompressible
    (cache / "fxgraph" / "a.bin").write_bytes(blob)
    monkeypatch.setattr(lease, "PART_BYTES", 1024)
    parts = lease.pack(cache, out, say=lambda line: None)
    assert len(parts) >= 3 and all(p.stat().st_size <= 1024 for p in parts)
    fresh = tmp_path / "fresh"
    lease.unpack(out, fresh, say=lambda line: None)
    assert (fresh / "fxgraph" / "a.bin").read_bytes() == blob
    monkeypatch.setattr(lease, "MAX_PARTS", 1)
    said = []
    assert lease.pack(cache, out, say=said.append) == [] and "not sent back" in said[0]


def test_the_six_view_accuracy_is_the_recipes_flip_translate_tta_on_the_graded_split():
    import torch_backend as tb
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten())
    images, labels = torch.randn(2600, 3, 8, 8), torch.randint(0, 10, (2600,))
    got = fa.six_view_accuracy(model, images, labels, batch_size=250)
    tta = tb.TTASettings(views="flip_translate")
    _, want = tb.loss_and_accuracy(model, images[fa.FEEDBACK_N:], labels[fa.FEEDBACK_N:], tta=tta)
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.slow       # minutes on a shared 2-core CPU: three workers, two builds each
def test_smoke_runs_both_calls_with_ours_and_both_peers_stand_ins_under_both_timings(tmp_path, capsys):
    assert lease.main(["smoke", "--sides", "fast94_next,e1,hiverge", "--runs", "2", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fast94_curriculum" not in out
    call1 = json.loads((tmp_path / "out1" / "lease_call1.json").read_text())
    assert set(call1["cold_build_s"]) == {"fast94_next", "e1", "hiverge"} and call1["parts"]
    assert "cache: " in out and "carried parts unpacked" in out                 # call 2 met a fresh machine
    rows = [json.loads(line) for line in (tmp_path / "out2" / "rows.jsonl").read_text().splitlines()]
    assert [r["side"] for r in rows] == ["fast94_next", "e1", "hiverge"] * 2    # in turn, each as it ended
    assert all(0 <= r["tta6_acc"] <= 1 and r["fulcrum_s"] > 0 and r["ours_s"] > 0 for r in rows)   # both clocks read
    result = json.loads((tmp_path / "out2" / "lease.json").read_text())
    for timing in fa.TIMINGS:
        assert set(result["headline"][timing]["ratios"]) == {"fast94_next/e1", "fast94_next/hiverge"}
    assert set(result["build_s"]["cold"]) == set(result["build_s"]["warm"]) == {"fast94_next", "e1", "hiverge"}


def test_gpu_checks_run_counts_come_from_its_command_line(monkeypatch):
    import gpu_check
    import suite
    asked = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(suite, "RECORD_DIR", suite.RECORD_STANDIN)
    monkeypatch.setattr(suite, "main", lambda argv, n: asked.append(n) or 0)
    assert gpu_check.main(["--data-dir", "c.npz", "--runs", "5"]) == 0
    assert asked == [{"fast94_next_record": {"fast94_next": 5, "record": 5},
                      "fast94_fastest": dict.fromkeys(suite.FASTEST_SIDES, 5)}]
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--runs", "1"])
    assert e.value.code == 2


@pytest.mark.parametrize("side", ["e1", "hiverge"])
def test_the_peers_own_files_offer_what_the_adapter_drives(side):
    path = fa.PEER_FILES[side]
    if not path.is_file():
        pytest.skip(f"{path} not fetched (peers/ is git-ignored; docs/measuring.md, The lease)")
    saved = torch._dynamo.config.save_config()        # E1's file sets dynamo's limits as it loads
    try:
        module = fa.import_file(path, f"{side}_recipe_checked")
    finally:
        with warnings.catch_warnings():          # keys of its torch's that this one deprecates
            warnings.simplefilter("ignore", FutureWarning)
            torch._dynamo.config.load_config(saved)
    if side == "e1":       # its hooks, its process cache (a second setup() is the charged prepare), the grader's hook
        assert callable(module.setup) and callable(module.train) and module._CACHE == {}
        assert callable(module.Model.eval_forward) and module.CifarLoader.__init__.__code__.co_varnames[:3] == (
            "self", "path", "train")
    else:                  # its main(run, model), its evaluate looked up where main calls it, its source read
        assert module.main.__code__.co_varnames[:2] == ("run", "model") and "evaluate" in module.main.__code__.co_names
        assert module.code == path.read_text()
