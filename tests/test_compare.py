"""benchmarks/compare.py: the comparison a GPU owner runs, on the CPU under the CUDA stand-in with the peers'
stand-ins (tests/peer_standins/), its sides built one at a time, both clocks for every run, a budget that keeps the
finished rows, and a run whose evaluation changed the weights refused."""
import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, synthetic_arrays

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare  # noqa: E402

SIDES = ["fast94", "e1", "hiverge", "airbench94"]      # fast94: ours with nothing compiled in the smoke


def smoke(tmp, *args, env=None, sides=SIDES, runs=2):
    out = tmp / "compare.json"
    proc = subprocess.run([sys.executable, "benchmarks/compare.py", "--smoke", "--sides", ",".join(sides), "--runs",
                           str(runs), "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    rows = [json.loads(line) for line in out.with_name("compare_rows.jsonl").read_text().splitlines()]
    return proc, json.loads(out.read_text()), rows


@pytest.fixture(scope="module")
def smoked(tmp_path_factory):
    return smoke(tmp_path_factory.mktemp("smoke"))


def test_the_smoke_builds_every_side_alone_one_after_another(smoked):
    proc, result, _ = smoked
    assert proc.returncode == 0, proc.stderr[-2000:]
    builds = [result["builds"][s] for s in SIDES]
    assert list(result["builds"]) == SIDES and result["lost"] == {}
    for before, after in zip(builds, builds[1:]):        # each side started building once the one before had built
        assert before["ended"] <= after["started"]
    assert result["builds"]["e1"]["sleeps_skipped"] == 1 and result["builds"]["e1"]["sleeps_skipped_s"] == 60


def test_the_smoke_times_every_run_of_every_side_under_both_clocks(smoked):
    proc, result, rows = smoked
    assert [(r["side"], r["k"]) for r in rows] == [(s, k) for k in range(2) for s in SIDES]     # in turn
    for r in rows:
        assert r["valid"] and not r["weights_changed"] and 0 <= r["tta6_acc"] <= 1
        assert r["ours_s"] > 0 and r["fulcrum_s"] > 0 and r["seed"] == r["k"]
    e1 = [r for r in rows if r["side"] == "e1"]
    assert all(r["ours_s"] == pytest.approx(r["fulcrum_s"] + r["eval6_s"]) for r in e1)   # no evaluation of its own
    assert all(r["construct_s"] >= 0 for r in rows if r["side"] == "airbench94")
    for timing in ("ours_s", "fulcrum_s"):
        part = result["headline"][timing]
        assert {s: part["sides"][s]["n"] for s in SIDES} == dict.fromkeys(SIDES, 2)
        assert sorted(part["ratios"]) == ["fast94/airbench94", "fast94/e1", "fast94/hiverge"]
        ours = [r[timing] for r in rows if r["side"] == "fast94"]
        assert part["sides"]["fast94"]["time"]["mean"] == pytest.approx(sum(ours) / 2)
    assert result["runs"] == 8 and result["invalid"] == 0 and result["smoke"]
    assert "fast94/e1" in proc.stdout and "wrote" in proc.stdout
    assert result["command"] == "python benchmarks/compare.py --smoke --sides fast94,e1,hiverge,airbench94 --runs 2"


def test_the_budget_ends_a_run_in_flight_keeping_every_finished_row_and_the_headline(tmp_path):
    # E1's stand-in hangs in its second run: the budget stops it there, its first run and the record's kept
    proc, result, rows = smoke(tmp_path, "--budget-s", "40", sides=["e1", "hiverge"], runs=3,
                               env={"E1_STANDIN_RUNS_BEFORE_A_HANG": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(r["side"], r["k"]) for r in rows] == [("e1", 0), ("hiverge", 0)]
    assert "budget" in result["lost"]["e1"] and result["runs"] == 2
    assert result["headline"]["ours_s"]["sides"]["hiverge"]["n"] == 1
    assert "the budget ended it" in proc.stdout


def test_a_run_whose_evaluation_changed_the_weights_is_invalid_and_left_out_of_the_headline(tmp_path, monkeypatch):
    monkeypatch.setenv("E1_STANDIN_EVAL_CHANGES_WEIGHTS", "1")
    out = tmp_path / "c.json"
    assert compare.main(["--smoke", "--in-process", "--sides", "e1,hiverge", "--runs", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = [json.loads(line) for line in (tmp_path / "c_rows.jsonl").read_text().splitlines()]
    assert [(r["side"], r["valid"]) for r in rows] == [("e1", False), ("hiverge", True)] * 2
    assert result["invalid"] == 2 and "e1" not in result["headline"]["ours_s"]["sides"]
    assert result["headline"]["ours_s"]["sides"]["hiverge"]["n"] == 2


def test_a_profiled_run_of_each_side_comes_before_the_timed_ones_and_is_not_one_of_them(tmp_path):
    import gzip
    out = tmp_path / "c.json"
    assert compare.main(["--smoke", "--in-process", "--sides", "e1,hiverge", "--runs", "1", "--profile",
                         str(tmp_path / "traces"), "--out", str(out)]) == 0
    for side in ("e1", "hiverge"):
        trace = json.loads(gzip.decompress((tmp_path / "traces" / f"{side}.trace.json.gz").read_bytes()))
        assert trace["traceEvents"]                     # the profiler's events, in Chrome's format
    rows = [json.loads(line) for line in (tmp_path / "c_rows.jsonl").read_text().splitlines()]
    assert [(r["side"], r["seed"]) for r in rows] == [("e1", 0), ("hiverge", 0)]


def test_the_fingerprint_sees_every_parameter_and_buffer_integer_ones_included():
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    before = compare.weights_fingerprint(net)
    assert compare.weights_fingerprint(net) == before
    net[1].num_batches_tracked += 1
    assert compare.weights_fingerprint(net) != before
    net[1].num_batches_tracked -= 1
    with torch.no_grad():
        net[0].weight[0, 0] += 1e-6
    assert compare.weights_fingerprint(net) != before


def test_the_standard_evaluation_is_the_six_views_on_the_graded_split():
    images, labels = torch.randn(2010, 3, 32, 32), torch.randint(0, 10, (2010,))
    seen = []
    forward = lambda v: (seen.append(v.shape[0]), torch.nn.functional.one_hot(labels[2000:], 10).float())[1]
    assert compare.six_view_accuracy(forward, images, labels) == 1.0      # the 10 images after the first 2,000
    assert seen == [10] * 6


def test_build_only_builds_every_side_into_the_cache_folder_and_runs_none(tmp_path):
    out, cache = tmp_path / "b.json", tmp_path / "cc"
    assert compare.main(["--smoke", "--in-process", "--sides", "e1,hiverge", "--build-only", "--cache-dir",
                         str(cache), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["builds"]) == ["e1", "hiverge"] and result["runs"] == 0 and result["build_only"]
    assert result["cache_dir"] == str(cache)


def test_every_side_process_reads_and_writes_the_cache_folder(tmp_path, monkeypatch):
    seen = {}

    class Popen:
        def __init__(self, argv, **kwargs):
            seen.update(argv=argv, env=kwargs["env"])
            raise OSError("not started")
    monkeypatch.setattr(compare.subprocess, "Popen", Popen)
    with pytest.raises(OSError):
        compare.Process("e1", compare.worker_argv("e1", compare.parse_args(["--smoke", "--sides", "e1"])), None,
                        compare.cache_environment(tmp_path))
    assert seen["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    assert seen["env"]["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert seen["argv"][1:5] == ["tests/standin_main.py", "benchmarks/compare.py", "--worker", "e1"]


@pytest.mark.parametrize("side, says", [("e1", "git clone https://github.com/fulcrumresearch/cifar-10-speedrun "
                                              "peers/fulcrum-speedrun"),
                                        ("hiverge", "git clone https://github.com/hiverge/cifar10-speedrun "
                                                   "peers/cifar10-speedrun"),
                                        ("airbench94", "pip install airbench")])
def test_a_missing_peer_stops_before_anything_runs_in_one_line_naming_what_gets_it(side, says, tmp_path,
                                                                                     monkeypatch, capsys):
    peer = compare.PEERS[side]
    monkeypatch.setitem(compare.PEERS, side, compare.Peer(tmp_path / "absent" / peer.path.name, peer.standin,
                                                          peer.get))
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name: None)      # airbench: not installed
    npz = tmp_path / "c.npz"
    npz.write_bytes(b"")
    assert compare.main(["--sides", f"fast94,{side}", "--data-dir", str(npz)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {side}: ") and says in err[0]


@pytest.mark.parametrize("args, says", [
    (["--sides", "fast94,nope", "--data-dir", "."], "--sides: no side nope"),
    (["--sides", "fast94,fast94", "--data-dir", "."], "name each side once"),
    (["--runs", "-1", "--data-dir", "."], "may not be negative"),
    (["--sides", "fast94,e1", "--runs", "fast94=3", "--data-dir", "."], "one for each side (fast94=N,e1=N)"),
    (["--budget-s", "0", "--data-dir", "."], "must be positive"),
    (["--sides", "fast94"], "--data-dir: CIFAR-10 for the timed runs"),
    (["--data-dir", "/no/such/file.npz"], "no such file"),
])
def test_a_bad_flag_is_one_line_and_status_2(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0]


def test_runs_and_seeds_are_one_number_for_every_side_or_one_for_each():
    args = compare.parse_args(["--sides", "fast94,e1", "--runs", "fast94=100,e1=25", "--seed", "7", "--data-dir", "."])
    assert args.runs == {"fast94": 100, "e1": 25} and args.seed == {"fast94": 7, "e1": 7}


def test_each_sides_runs_are_spread_over_the_comparison():
    order, done = [], {"ours": 0, "peer": 0}
    while (side := compare.next_side({"ours": 100, "peer": 25}, done)) is not None:
        order.append(side)
        done[side] += 1
    assert order.count("ours") == 100 and order.count("peer") == 25
    assert order[:10] == ["ours", "ours", "peer", "ours", "ours", "ours", "ours", "peer", "ours", "ours"]
    assert compare.next_side({"a": 2, "b": 2}, {"a": 0, "b": 0}) == "a"


class Fake:
    """A side that builds at once and answers its runs from a list of messages."""

    def __init__(self, side, answers):
        self.side, self.answers, self.stopped = side, list(answers), None

    def built(self, deadline):
        return "BUILT", {"side": self.side, "build_s": 1.0}

    def run(self, seed, deadline):
        kind = self.answers.pop(0)
        return kind, {"side": self.side, "seed": seed, "ours_s": 1.0, "fulcrum_s": 0.9, "tta6_acc": 0.94,
                      "own_acc": 0.94, "valid": True} if kind == "ROW" else None

    def stop(self, now=False):
        self.stopped = now


def test_a_run_in_flight_at_the_deadline_is_lost_and_the_runs_end_there(tmp_path):
    handles = {"a": Fake("a", ["ROW", "ROW"]), "b": Fake("b", ["ROW", "DEADLINE"])}
    rows, lost = [], {}
    args = argparse.Namespace(runs={"a": 3, "b": 3}, seed={"a": 0, "b": 0})
    compare.run_in_turn(handles, args, rows=rows, rows_path=tmp_path / "r.jsonl", deadline=None, lost=lost,
                        say=lambda line: None)
    assert [(r["side"], r["k"]) for r in rows] == [("a", 0), ("b", 0), ("a", 1)]
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 3 and "budget" in lost["b"]


def test_a_side_not_yet_built_at_the_deadline_is_not_started():
    started = []
    start = lambda side: started.append(side) or Fake(side, [])
    handles, builds, lost = compare.built_one_at_a_time(["a", "b"], start, 0.0, say=lambda line: None)
    assert started == [] and handles == {} and set(lost) == {"a", "b"} and "budget" in lost["a"]


def test_the_headline_compares_each_of_ours_with_each_peer_over_the_valid_runs():
    row = lambda side, t, acc, valid=True: {"side": side, "ours_s": t, "fulcrum_s": t - 0.1, "tta6_acc": acc,
                                            "own_acc": acc, "valid": valid}
    rows = [row("fast94_next", 1.0, 0.941), row("fast94_next", 1.2, 0.943), row("e1", 2.0, 0.939),
            row("e1", 2.2, 0.941), row("e1", 9.0, 0.5, valid=False)]
    h = compare.headline(rows, ["fast94_next", "e1"])
    assert h["ours_s"]["sides"]["e1"]["n"] == 2 and h["ours_s"]["sides"]["e1"]["time"]["mean"] == pytest.approx(2.1)
    assert h["ours_s"]["ratios"]["fast94_next/e1"]["ratio"] == pytest.approx(1.1 / 2.1)
    assert h["fulcrum_s"]["ratios"]["fast94_next/e1"]["ratio"] == pytest.approx(1.0 / 2.0)
    # two runs, 94.1% and 94.3%: t = 2 on 1 degree of freedom, whose tail is Cauchy's: 1/2 - atan(2)/pi
    assert h["ours_s"]["sides"]["fast94_next"]["p_6view_above_target"] == pytest.approx(0.5 - math.atan(2) / math.pi)
    ours_alone = compare.headline([row("fast94", 2.0, 0.9), row("fast94", 2.2, 0.9), row("fast94_next", 1.0, 0.9),
                                   row("fast94_next", 1.2, 0.9)], ["fast94", "fast94_next"])
    assert list(ours_alone["ours_s"]["ratios"]) == ["fast94_next/fast94"]       # each over the first


def test_the_peers_read_our_data_as_their_loaders_do(tmp_path):
    arrays = synthetic_arrays(20, 10)
    compare.write_airbench_layout(arrays, tmp_path)
    for split, n in (("train", 20), ("test", 10)):
        d = torch.load(tmp_path / "cifar10" / f"{split}.pt")
        assert d["images"].dtype == torch.uint8 and d["images"].shape == (n, 32, 32, 3)        # NHWC
        assert torch.equal(d["images"], torch.from_numpy(arrays[f"{split}_images"]))
        assert d["labels"].dtype == torch.int64 and d["classes"][:2] == ["airplane", "automobile"]


# ---------------------------------------------------------------------------------------------------
# What the report makes of the comparisons

import report  # noqa: E402


def a_comparison(peer_time, *, code=None, device="NVIDIA H200"):
    side = lambda t: {"n": 3, "time": {"n": 3, "mean": t, "std": 0.01}, "accuracy_6view": {"n": 3, "mean": 0.9401,
                                                                                          "std": 0.001},
                      "p_6view_above_target": 0.4, "accuracy_own": {"n": 3, "mean": 0.9402, "std": 0.001}}
    part = lambda: {"sides": {"fast94_next": side(1.2), "hiverge": side(peer_time)},
                    "ratios": {"fast94_next/hiverge": {"ratio": 1.2 / peer_time, "low": 1.1, "high": 1.3}}}
    return {"piece": "compare", "device_name": device, "command": "python benchmarks/compare.py --sides "
            "fast94_next,hiverge --runs 3 --data-dir c.npz", "headline": {"ours_s": part(), "fulcrum_s": part()},
            **({"code": code} if code else {}), "_file": "results/nvidia-h200/compare_fast94_next_hiverge.json"}


def test_the_comparison_table_names_the_command_or_the_earlier_scripts_record_and_the_commit():
    now = a_comparison(1.0, code={"commit": "0123456789abcdef", "dirty": False})
    before = {**a_comparison(1.1), "command": "python3 benchmarks/gone.py --x", "_file": "results/g/old.json"}
    rows = [line for line in report.t_compare({"compare": [now], "old": [before]}) if line.startswith("| fast94_next")]
    assert "`python benchmarks/compare.py --sides fast94_next,hiverge --runs 3 --data-dir c.npz`" in rows[0]
    assert "| commit 0123456 |" in rows[0] and "| 3 / 3 |" in rows[0] and "1.200 [1.100, 1.300]" in rows[0]
    assert "an earlier script since folded into `benchmarks/compare.py` (its command in results/g/old.json)" in rows[1]
    assert "| commit not recorded |" in rows[1]
    e1 = [line for line in report.t_compare({"compare": [now]}) if line.startswith("| fast94_next / e1")]
    assert len(e1) == 1 and report.COMPARE_COMMAND in e1[0] and "not measured" in e1[0]


def test_the_figure_leads_with_the_fastest_peer_measured_on_the_device():
    slow, fast = a_comparison(1.5), a_comparison(1.0)
    rows = report.figure_rows({"compare": [slow, fast]})
    assert [(r["side"], r["ours"]) for r in rows] == [("fast94_next", True), ("hiverge", False)]
    assert rows[1]["mean"] == 1.0 and rows[0]["ratio"] == "1.200 [1.100, 1.300]" and rows[0]["commit"] == \
        "commit not recorded"
    caption = " ".join(report.t_figure({"compare": [fast]}))
    assert "the fastest peer measured there, the 2-second record (hiverge)" in caption
    assert "commit not recorded" in caption


def test_each_recipe_gets_our_gpu_figure_beside_the_published_one_above_its_definition():
    import cifar10_recipes as cr
    source = (ROOT / "cifar10_recipes.py").read_text()
    results = {"compare": [a_comparison(1.0, code={"commit": "abcdef0123", "dirty": True})]}
    text = report.with_measured(source, results)
    lines = text.split("\n")
    where = cr.definitions(lines)
    assert set(where) == set(cr.RECIPES)
    above = lambda name: lines[where[name] - 1].strip()
    assert above("fast94_next") == ("# measured: 94.02%, 1.20 s (H200, n = 3, commit abcdef0 + local changes); "
                                    "published: 94.01%, 2.015 s (A100, hiverge)")
    assert above("fast94_lowflop") == "# measured: not measured on a GPU; published: none (an idea of ours)"
    assert above("batch512") == "# measured: not measured on a GPU; published: 256 s (V100, Myrtle)"
    assert report.with_measured(text, results) == text                     # written once, rewritten in place
    assert max(len(lines[i - 1]) for i in where.values()) <= 120


def test_the_recipes_lines_are_what_the_committed_results_give_and_list_recipes_shows_them(capsys):
    import cifar10_fast as cf
    import cifar10_recipes as cr
    source = (ROOT / "cifar10_recipes.py").read_text()
    assert report.with_measured(source, report.load_results(ROOT / "results")) == source
    assert cf.main(["--list-recipes"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, line in cr.measured().items():
        assert f"measured: {line}" in out, name
    assert len(cr.measured()) == len(cr.RECIPES)
