"""The measurement suite and the report: the whole suite end to end on the CPU (--smoke), its JSON layout,
planning within a budget, resuming an interrupted piece, and README's tables against results/."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import imagenet_decoders as idec  # noqa: E402
import report  # noqa: E402
import run_statistics  # noqa: E402
import suite  # noqa: E402


def run_suite(*args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


TORCHRUN_PIECES = {"torchrun_fast94": "cifar10_fast.py --recipe fast94",
                   "torchrun_imagenet_tiny": "imagenet_fast.py train --store STORE --recipe tiny"}
# the default tests run every piece but these two, the smoke pass's longest launches: -m slow runs them, and
# test_two_nodes, test_torchrun and the stand-in's torchrun tests launch torchrun in the default run
SMOKE_PIECES = [pc.name for pc in suite.pieces() if pc.name not in TORCHRUN_PIECES]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    r = run_suite("--smoke", "--results", folder, "--pieces", ",".join(SMOKE_PIECES))
    assert r.returncode == 0, r.stdout + r.stderr
    return folder, r.stdout


def test_smoke_runs_every_piece(smoke):
    folder, out = smoke
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == SMOKE_PIECES          # one line per piece, in tier order
    by_name = dict(line.split(": ", 1) for line in lines[1:])
    assert by_name["fast94"].startswith("complete") and "airbench94 2/2" in by_name["fast94"]   # its stand-in
    assert "record 2/2" in by_name["fast94_next_record"]
    (device,) = folder.iterdir()
    assert sorted(p.stem for p in device.glob("*.json")) == sorted(SMOKE_PIECES)
    # a side that is a recipe and its flags, run with them
    side = json.loads((device / "cpu_accuracy.json").read_text())["sides"]["fast94_next_lowres --epochs 7.89"]
    assert side["command"].startswith("python cifar10_fast.py --recipe fast94_next_lowres --epochs 7.89 --runs 1")
    assert [run["seed"] for run in side["runs"]] == [0]


@pytest.mark.slow
def test_the_torchrun_pieces_train_under_torchrun_as_the_plain_command_does_run_for_run(tmp_path):
    """The torchrun pieces, whole, over gloo: the suite's own store, commands and parsing as a GPU runs them;
    one rank under torchrun trains as the plain command does, run for run."""
    r = run_suite("--smoke", "--results", tmp_path, "--pieces", ",".join(TORCHRUN_PIECES))
    assert r.returncode == 0, r.stdout + r.stderr
    by_name = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines()[1:])
    (device,) = tmp_path.iterdir()
    for name, what in TORCHRUN_PIECES.items():
        result = json.loads((device / f"{name}.json").read_text())
        assert result["complete"] and by_name[name].startswith("complete"), by_name[name]
        plain, under = result["sides"]["plain"], result["sides"]["torchrun"]
        assert plain["command"].startswith(f"python {what} --runs 2")
        assert under["command"].startswith(f"torchrun --standalone --nproc_per_node=1 {what} --runs 2")
        assert [run["final_acc"] for run in under["runs"]] == [run["final_acc"] for run in plain["runs"]]
        assert [run["seed"] for run in under["runs"]] == [0, 1]


def fake_nvidia_smi(folder, script):
    """A program named nvidia-smi in folder that runs the shell script; its folder, to put first on PATH."""
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
    (folder / "nvidia-smi").chmod(0o755)
    return str(folder)


def test_a_gpus_fingerprint_holds_its_properties_nvidia_smis_clocks_and_rates_measured_at_full_size(tmp_path,
                                                                                                 monkeypatch):
    import torch
    import machine
    from cuda_standin import StandIn
    idle = 'case "$1" in *driver_version*) echo "580.65.06, 345, 1980, 700.00, 2619";; *) echo "1980";; esac'
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, idle)}{os.pathsep}{os.environ['PATH']}")
    asked = []
    monkeypatch.setattr(machine, "measure_rates", lambda device, size, nbytes: asked.append((device, size, nbytes))
                        or {"matmul_tflops": 1.0})
    with StandIn(memory=80 << 30, sms=132):
        fp = machine.fingerprint(torch.device("cuda"), smoke=False)
    assert asked == [(torch.device("cuda"), 8192, 2 ** 30)] and fp["matmul_tflops"] == 1.0
    assert (fp["device_name"], fp["slug"]) == ("NVIDIA stand-in (CPU)", "nvidia-stand-in-cpu")
    assert (fp["sm_count"], fp["memory_gib"], fp["cuda"]) == (132, 80.0, torch.version.cuda)
    assert [fp[k] for k in ("driver", "sm_clock_mhz", "max_sm_clock_mhz", "power_limit_w", "mem_clock_mhz",
                            "sm_clock_after_matmul_mhz")] == ["580.65.06", "345", "1980", "700.00", "2619", "1980"]
    assert "threads" not in fp                                  # a CPU's


@pytest.mark.parametrize("script", ["exit 9", "echo 'NVIDIA-SMI has failed' >&2; exit 9", None])
def test_nvidia_smi_that_fails_prints_nothing_or_is_absent_leaves_its_fields_out(tmp_path, monkeypatch, script):
    import machine
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, script) if script else str(tmp_path))
    assert machine.nvidia_smi("driver_version", "clocks.sm") == {}


def test_every_result_holds_command_runs_statistics_flops_and_the_fingerprint(smoke):
    folder, _ = smoke
    (device,) = folder.iterdir()
    env = json.loads((device / "env.json").read_text())
    fp = env["fingerprint"]
    assert fp["matmul_tflops"] > 0 and fp["copy_gbps"] > 0 and fp["device_name"].startswith("CPU")
    assert env["counted_flops"]["fast94"]["total"] == pytest.approx(0.3592e15, rel=1e-3)   # docs/perf-notes.md
    r = json.loads((device / "fast94.json").read_text())
    assert r["complete"] and r["fingerprint"] == fp and r["smoke"]
    side = r["sides"]["fast94"]
    assert side["command"].startswith("python benchmarks/compare.py --sides fast94,airbench94 "
                                      "--runs fast94=2,airbench94=2")
    assert [run["seed"] for run in side["runs"]] == [0, 1]
    st = side["stats"]
    accs = [run["final_acc"] for run in side["runs"]]
    assert st["n"] == 2 and st["accuracy"]["mean"] == pytest.approx(sum(accs) / 2)
    assert 0 <= st["p_mean_above_target"] <= 1
    assert st["floor_s"] == pytest.approx(st["flops_per_run"] / (fp["matmul_tflops"] * 1e12))
    assert st["tflops_per_s"] == pytest.approx(st["flops_per_run"] / st["time"]["mean"] / 1e12)
    journey = json.loads((device / "journey.json").read_text())
    assert len(journey["sides"]) == 15 and all(len(s["runs"]) == 1 for s in journey["sides"].values())
    assert journey["sides"]["whitening"]["command"].startswith("python cifar10_fast.py --recipe whitening --runs 1")
    ablation = json.loads((device / "ablation.json").read_text())
    assert list(ablation["sides"]) == list(suite.ABLATIONS) and all(len(s["runs"]) == 1
                                                                    for s in ablation["sides"].values())
    assert ablation["sides"]["no TTA"]["command"].startswith("python cifar10_fast.py --recipe fast94 --tta none "
                                                             "--runs 1")
    rows = json.loads((device / "imagenet_throughput.json").read_text())["rows"]
    assert rows[0]["res"] == 32 and rows[0]["ceiling"] > 0


def test_the_report_shows_the_results_figures(smoke):
    folder, _ = smoke
    results = report.load_results(folder, smoke=True)
    assert report.load_results(folder) == {}                        # smoke results never reach README
    text = report.render((ROOT / "README.md").read_text(), results)
    r = results["fast94"][0]
    st = r["sides"]["fast94"]["stats"]
    row = next(line for line in text.splitlines() if line.startswith("| fast94 | CPU"))
    assert f"{100 * st['accuracy']['mean']:.2f}% ± {100 * st['accuracy']['std']:.2f}" in row
    assert f"{st['time']['mean']:.2f} s" in row and "| 2 |" in row
    journey = report.render((ROOT / "docs" / "cifar10.md").read_text(), results)
    stage = next(line for line in journey.splitlines() if line.startswith("| `ghost_bn` |"))
    assert "(n=1, CPU" in stage and "| 46 s |" in stage                # ours beside the published V100 time
    assert "±" not in stage                                             # one run has no spread


def test_readme_and_perf_notes_tables_are_what_the_committed_results_give():
    assert report.main(["--check"]) == 0


def test_without_results_every_table_says_not_measured(tmp_path):
    for doc in report.DOCS:
        text = report.render((ROOT / doc).read_text(), {})
        for m in report.MARK.finditer(text):
            if m.group(2) not in ("outcomes", "scaling", "scaling_recipes", "flops"):   # models' and counts' tables
                assert "not measured" in m.group(3), (doc, m.group(2))


def test_an_interrupted_piece_goes_on_from_its_finished_runs(tmp_path):
    r = run_suite("--smoke", "--results", tmp_path, "--pieces", "myrtle24")
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("*/myrtle24.json")
    res = json.loads(path.read_text())
    first = res["sides"]["myrtle24"]["runs"][0]
    res["sides"]["myrtle24"]["runs"] = [first]           # as if the call had been killed after one run
    res["complete"] = False
    path.write_text(json.dumps(res))
    r = run_suite("--smoke", "--results", tmp_path, "--pieces", "myrtle24")
    assert r.returncode == 0, r.stderr
    res = json.loads(path.read_text())
    assert res["complete"] and [run["seed"] for run in res["sides"]["myrtle24"]["runs"]] == [0, 1]
    assert res["sides"]["myrtle24"]["runs"][0] == first
    assert " --runs 1 --seed 1 " in res["chunks"][-1]["argv"] and res["chunks"][-1]["runs_added"] == 1
    r = run_suite("--smoke", "--results", tmp_path, "--pieces", "myrtle24")
    assert "myrtle24: already complete" in r.stdout


def fake_result(walls, n_wanted, setup=None):
    runs = [{"seed": i, "final_acc": 0.94, "time": w, "wall_s": w} for i, w in enumerate(walls)]
    return {"sides": {"fast94": {"name": "fast94", "n_wanted": n_wanted, "runs": runs},
                      "airbench94": {"name": "airbench94", "n_wanted": n_wanted // 4, "runs": []}},
            "chunks": [{"setup_s": setup}] if setup else []}


def test_a_budget_runs_only_what_fits():
    piece = next(pc for pc in suite.pieces() if pc.name == "fast94")     # fast94 beside airbench94
    result = fake_result([4.0] * 10, 100, setup=60)            # 90 + 25 runs of about 4 s left, 60 s to start
    want, est, rest = suite.plan(piece, result, fp={}, flops={}, left_s=None)
    assert want == {"fast94": 90, "airbench94": 25} and rest == pytest.approx(60 + 115 * 4.0)
    want, est, rest = suite.plan(piece, result, fp={}, flops={}, left_s=60 + 23 * 4.0)
    assert want == {"fast94": 18, "airbench94": 5} and est <= 60 + 23 * 4.0     # in proportion, within the budget
    want, _, _ = suite.plan(piece, result, fp={}, flops={}, left_s=62.0)
    assert want == {}                                           # not even one run fits: nothing starts
    # no history: the estimate comes from the counted FLOPs over the measured matmul rate
    empty = fake_result([], 100)
    flops = {"fast94": {"train": 0.34e15, "final_eval": 0.014e15}}
    per = suite.per_run_s(piece, "fast94", empty, fp={"matmul_tflops": 800.0}, flops=flops)
    assert per == pytest.approx((0.34e15 + 10 * 0.014e15) / (800e12 * suite.ASSUMED_EFFICIENCY))


def test_the_deadline_stops_a_running_command(tmp_path):
    # the command would write its pid, then a file two minutes later: stopped at the deadline, it never writes it
    polls, pid, late = [], tmp_path / "pid", tmp_path / "late"
    script = (f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); time.sleep(120); "
              f"open({str(late)!r}, 'w')")
    rc = suite.launch(["python", "-c", script], tmp_path / "log", deadline=time.time() + 3, in_process=False,
                      on_poll=lambda: polls.append(1))
    assert rc is None and polls and not late.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid.read_text()), 0)                       # the command's process is gone


def test_bad_arguments_are_one_line():
    r = run_suite("--tiers", "9")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: unknown tiers ['9']")
    r = run_suite("--pieces", "nope", "--smoke")
    assert r.returncode == 2 and "unknown pieces ['nope'] (see --list)" in r.stderr
    r = run_suite("--list")
    assert r.returncode == 0 and [line.split()[:3] for line in r.stdout.splitlines()[1:3]] == [
        ["tier", "1", "fast94_next_record"], ["tier", "1", "fast94"]]          # beside the record first


def test_the_torchrun_pieces_run_the_same_command_with_and_without_torchrun():
    ctx = {"out": "o.json", "device": None, "smoke": False, "data": "/d/c.npz", "store": "/s"}
    piece = next(pc for pc in suite.pieces() if pc.name == "torchrun_fast94")
    plain = suite.chunk_for(piece, {"plain": 10}, {}, ctx).argv
    tr = suite.chunk_for(piece, {"torchrun": 4}, {"torchrun": 6}, ctx).argv
    assert plain == ["python", "cifar10_fast.py", "--recipe", "fast94", "--runs", "10", "--data-dir", "/d/c.npz",
                     "--out", "o.json"]
    assert tr == ["torchrun", "--standalone", "--nproc_per_node=1", "cifar10_fast.py", "--recipe", "fast94", "--runs",
                  "4", "--seed", "6", "--data-dir", "/d/c.npz", "--out", "o.json"]
    piece = next(pc for pc in suite.pieces() if pc.name == "torchrun_imagenet_tiny")
    assert suite.chunk_for(piece, {"torchrun": 3}, {}, ctx).argv[3:7] == ["imagenet_fast.py", "train", "--store", "/s"]


def test_the_flops_table_counts_one_plain_forward_pass_whatever_the_test_time_augmentation():
    # fast94_next evaluates all six views on only a quarter of the test images: its network and resolution are
    # fast94's, so one plain forward pass costs the same, and its final evaluation a quarter of the extra views
    flops = suite.counted_flops(["fast94", "fast94_next", "faster_bn"])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in report.t_flops({"env": [{"counted_flops": flops}]})[2:]}
    assert set(rows) == {"fast94", "fast94_next"}         # a journey stage (faster_bn) is not a speed recipe
    assert rows["fast94_next"][2] == rows["fast94"][2] == "0.2363"
    plain = flops["fast94"]["per_test_image"] / 6
    assert flops["fast94_next"]["final_eval"] == pytest.approx(10000 * plain * (1 + 0.25 * 5))
    assert rows["fast94_next"][5] == f"{10000 * plain * 2.25 / 1e12:.3f} (6 views on 25% of the images)"
    assert rows["fast94"][5].endswith("(6 views)")


def processes_with(*texts):
    """The pids of running processes whose command line holds every one of texts."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().decode(errors="replace")
            if all(text in line for text in texts):
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def stopped_suite(tmp_path, *args, started):
    """Starts the suite, sends it SIGTERM once started(its stdout so far) is true, and returns (exit status, stdout,
    stderr)."""
    log = tmp_path / "suite.out"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "suite.py"), *map(str, args)], cwd=ROOT,
                                stdout=f, stderr=subprocess.PIPE, text=True)
        while proc.poll() is None and not started(log.read_text()):
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    return proc.returncode, log.read_text(), err


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads running processes from /proc")
def test_sigterm_ends_the_suite_in_process_keeping_what_finished(tmp_path):
    rc, out, err = stopped_suite(tmp_path, "--smoke", "--results", tmp_path / "r", started=lambda o: "\nfast94: " in o)
    assert rc == 143, out + err
    # the piece after fast94 (tier 1's last), the first of tier 2, was running
    assert out.strip().splitlines()[-1].startswith("stopped by SIGTERM in fast94_lowflop; the finished runs are kept "
                                                   "in ")
    assert "fast94_muon:" not in out and "journey:" not in out                  # no piece after the signal
    (device,) = (tmp_path / "r").iterdir()
    assert json.loads((device / "fast94.json").read_text())["complete"]
    assert not (device / "fast94_muon.json").exists()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads running processes from /proc")
def test_sigterm_ends_the_suite_and_its_running_command(tmp_path):
    npz = tmp_path / "mine.npz"
    suite.synthetic_npz(npz)
    rc, out, err = stopped_suite(tmp_path, "--smoke", "--no-in-process", "--results", tmp_path / "r", "--data-dir",
                                 npz, "--pieces", "myrtle24,myrtle10",
                                 started=lambda o: processes_with("cifar10_fast.py", str(npz)))
    assert rc == 143, out + err
    assert "myrtle10:" not in out and "stopped by SIGTERM in myrtle24" in out
    for _ in range(100):                        # the piece's command is stopped with the suite
        if not processes_with("cifar10_fast.py", str(npz)):
            break
        time.sleep(0.1)
    assert processes_with("cifar10_fast.py", str(npz)) == []


def test_a_run_that_compiled_inside_its_clock_is_flagged_in_the_line_and_the_tables():
    runs = [{"seed": 0, "final_acc": 0.94, "time": 3.0, "recompiles": 2}, {"seed": 1, "final_acc": 0.95, "time": 2.0,
                                                                          "recompiles": 0}]
    st = suite.side_stats(runs, 0.94, None, None)
    assert st["recompiled_runs"] == 1
    result = {"kind": "cifar", "sides": {"fast94": {"name": "fast94", "n_wanted": 2, "runs": runs, "stats": st}}}
    assert "COMPILED INSIDE THE CLOCK in 1 runs" in suite.describe(result)
    assert report.timed(st) == "2.50 s ± 0.71 (compiled inside the clock in 1 run)"
    assert report.timed(suite.side_stats(runs[1:], 0.94, None, None)) == "2.00 s"          # one run: no spread


def test_the_pieces_share_one_compile_cache_under_the_results(tmp_path, monkeypatch):
    """Every command the suite starts (and every piece it runs in its own process) sees the same inductor caches,
    under results/<machine>/, so only the first pays a cold compile; the suite's own environment is left as it was."""
    seen, real = {}, suite.launch

    def launch(argv, log, **kwargs):
        seen.update({k: os.environ.get(k) for k in suite.compile_cache(tmp_path)})
        return real(argv, log, **kwargs)
    monkeypatch.setattr(suite, "launch", launch)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert suite.main(["--smoke", "--pieces", "myrtle24", "--results", str(tmp_path)]) == 0
    (machine,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert seen == {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
                    "TORCHINDUCTOR_CACHE_DIR": str(machine / ".compile-cache")}
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_cpu_accuracy_tier_fills_its_recipes_in_order_one_run_at_a_time():
    """fast94_next to its n first, then fast94, fast94_muon, fast94_next_lowres and its candidate, whatever order an
    earlier result file lists them in; the record recipes and the candidate to fast94_next's n."""
    piece = next(pc for pc in suite.pieces() if pc.name == "cpu_accuracy")
    candidate = "fast94_next_lowres --epochs 7.89"
    assert list(piece.sides) == ["fast94_next", "fast94", "fast94_muon", "fast94_next_lowres", candidate]
    assert piece.sides[candidate] == piece.sides["fast94"] == piece.sides["fast94_muon"] == piece.sides["fast94_next"]
    assert piece.sides["fast94_next"] >= 13 and min(piece.sides.values()) >= 5
    runs = lambda n: [{"seed": i, "final_acc": 0.94, "time": 1.0, "wall_s": 1.0} for i in range(n)]
    sides = lambda done: {s: {"name": s, "n_wanted": piece.sides[s], "runs": runs(done.get(s, 0))}
                          for s in ("fast94_next_lowres", "fast94", "fast94_muon", "fast94_next", candidate)}
    plan = lambda done: suite.plan(piece, {"sides": sides(done), "chunks": []}, fp={}, flops={}, left_s=None)[0]
    assert plan({"fast94_next_lowres": 1}) == {"fast94_next": 1}
    assert plan({"fast94_next": piece.sides["fast94_next"]}) == {"fast94": 1}
    assert plan({"fast94_next": 99, "fast94": 5, "fast94_next_lowres": 5, candidate: 13}) == {"fast94": 1}
    assert plan({"fast94_next": 99, "fast94": 13, "fast94_muon": 5}) == {"fast94_muon": 1}
    assert plan({"fast94_next": 99, "fast94": 13, "fast94_muon": 13}) == {"fast94_next_lowres": 1}
    assert plan({"fast94_next": 99, "fast94": 13, "fast94_muon": 13, "fast94_next_lowres": 5}) == {candidate: 1}
    assert plan({"fast94_next": 99, "fast94": 13, "fast94_muon": 13, "fast94_next_lowres": 5,
                 candidate: 5}) == {candidate: 1}


def test_a_cpu_accuracy_side_runs_its_recipe_with_its_own_flags_and_goes_on_from_its_own_seeds():
    """The side's flags follow the recipe's name, so the piece's and the smoke's settings still win over them."""
    piece = next(pc for pc in suite.pieces() if pc.name == "cpu_accuracy")
    ctx = {"out": "o.json", "device": "cpu", "smoke": False, "data": "c.npz"}
    argv = lambda side, done: suite.chunk_for(piece, {side: 1}, {side: done}, ctx).argv
    assert argv("fast94_next_lowres --epochs 7.89", 2) == [
        "python", "cifar10_fast.py", "--recipe", "fast94_next_lowres", "--epochs", "7.89", "--runs", "1", "--seed",
        "2", "--data-dir", "c.npz", "--eval-every", "0", "--device", "cpu", "--out", "o.json"]
    assert argv("fast94_next_lowres", 0)[:6] == ["python", "cifar10_fast.py", "--recipe", "fast94_next_lowres",
                                                 "--runs", "1"]
    smoke = suite.chunk_for(piece, {"fast94_next_lowres --epochs 7.89": 1}, {}, {**ctx, "smoke": True}).argv
    assert [smoke[i + 1] for i, a in enumerate(smoke) if a == "--epochs"] == ["7.89", "1"]   # argparse keeps the last


def test_the_test_time_sentence_names_the_counts_and_each_failed_test():
    import test_time
    out = "..F\nFAILED tests/test_cli.py::test_a - AssertionError\n1 failed, 480 passed, 1 skipped in 481.27s\n"
    assert test_time.outcome_counts(out.splitlines()[-1]) == {"failed": 1, "passed": 480, "skipped": 1}
    assert test_time.failed_tests(out) == ["tests/test_cli.py::test_a"]
    record = {"command": "python -m pytest", "exit_status": 1, "wall_s": 481.3, "cpu_s": 608.6,
              "counts": {"failed": 1, "passed": 480}, "failed": ["tests/test_cli.py::test_a"],
              "load_average_at_start": 0.39, "fingerprint": {"device_name": "a CPU", "device": "cpu"}}
    [line] = report.t_tests({"test_time": [record]})
    assert "took 481 s wall and 609 CPU s (n = 1; 1 failed, 480 passed; exit status 1)" in line
    assert line.endswith("Failed: `tests/test_cli.py::test_a`.")


def test_the_test_time_sentence_names_the_versions_pytests_header_printed():
    import test_time
    header = ("platform linux -- Python 3.11.7, pytest-9.2.0, pluggy-1.6.0\n"
              "torch 2.14.1+cu130, torchvision 0.29.1+cu130, numpy 2.4.6\nrootdir: /x\n"
              "created: 2/2 workers\n2 workers [887 items]\n")
    versions = test_time.versions(header)
    assert versions == "Python 3.11.7, pytest 9.2.0, torch 2.14.1+cu130, torchvision 0.29.1+cu130 and numpy 2.4.6"
    record = {"command": "python -m pytest", "exit_status": 0, "wall_s": 500, "cpu_s": 600, "counts": {"passed": 9},
              "failed": [], "load_average_at_start": 0.1, "fingerprint": {"device_name": "a CPU", "device": "cpu"},
              "versions": versions, "fresh_environment": True, "workers": test_time.workers(header)}
    [line] = report.t_tests({"test_time": [record]})
    assert "`python -m pytest` on 2 pytest-xdist workers took 500 s wall" in line
    assert line.endswith(f"timed by `python benchmarks/test_time.py` in a fresh virtual environment, with {versions}.")
    assert test_time.versions("no header") is None and test_time.workers("no header") == 1


@pytest.mark.parametrize("accuracies, verdict", [
    ([0.9381], "mean is below 94% here (n = 1: too few runs to say more)."),
    ([0.9381, 0.9412, 0.94, 0.939, 0.9402], "mean is below 94% here, not significantly (p = 0.3 for a mean below 94%"),
    ([0.935, 0.936, 0.934, 0.937, 0.935], "mean is below 94% here, significantly (p = 0.00042 for a mean below 94%"),
    ([0.941, 0.942, 0.9405], "mean is above 94% here, not significantly (p = 0.059 for a mean above 94%, n = 3). "
                             "At this spread, n = 3 finds a true mean 0.23 points or more from 94%"),
    ([0.942, 0.943, 0.9425], "mean is above 94% here, significantly (p = 0.0065 for a mean above 94%, n = 3)."),
    ([0.9392, 0.9408], "mean is 94% here, on neither side (n = 2). At this spread, n = 2 finds a true mean"),
    ([0.94], "mean is 94% here, on neither side (n = 1: too few runs to say more).")])
def test_cpu_accuracy_says_whether_a_mean_below_94_is_significant_by_the_other_side_of_its_t_test(accuracies,
                                                                                                   verdict):
    from run_statistics import one_sided_p
    side = {"runs": [{"seed": i} for i in range(len(accuracies))], "n_wanted": 13, "command": "python x.py",
            "stats": {"accuracy": {"mean": sum(accuracies) / len(accuracies), "std": 0.001, "n": len(accuracies)},
                      "p_mean_above_target": one_sided_p(accuracies, 0.94), "time": {"mean": 1.0}}}
    results = {"cpu_accuracy": [{"fingerprint": {"device_name": "CPU"}, "sides": {"fast94_next": side}}]}
    assert f"`fast94_next`'s {verdict}" in report.t_cpu_accuracy(results)[-1]


@pytest.mark.parametrize("flagged, said", [
    ([0.9406, 0.9412, 0.9409], "0.20 points above `fast94_next_lowres`'s, significantly (p = 0.00037, a one-sided "
                               "Welch t-test, n = 3 and 4)."),
    ([0.9380, 0.9395, 0.9375], "0.06 points below `fast94_next_lowres`'s, not significantly (p = 0.22, a one-sided "
                               "Welch t-test, n = 3 and 4)."),
    ([0.9410], "0.21 points above `fast94_next_lowres`'s (n = 1 and 4: too few runs to say more).")])
def test_cpu_accuracy_sets_a_recipe_with_flags_against_its_own_recipe_by_welchs_test(flagged, said):
    from run_statistics import summarize
    def side(accs):
        return {"runs": [{"seed": i, "final_acc": a} for i, a in enumerate(accs)], "n_wanted": 5, "command": "x",
                "stats": {"accuracy": summarize(accs), "p_mean_above_target": None, "time": {"mean": 1.0}}}
    bare = [0.9388, 0.9392, 0.9386, 0.9390]
    results = {"cpu_accuracy": [{"fingerprint": {"device_name": "CPU"},
                                 "sides": {"fast94_next_lowres": side(bare),
                                           "fast94_next_lowres --epochs 7.89": side(flagged)}}]}
    verdicts = report.t_cpu_accuracy(results)[-1]
    assert verdicts.endswith(f"`fast94_next_lowres --epochs 7.89`'s mean is {said}")
    assert verdicts.count(" points above ") + verdicts.count(" points below ") == 1   # the bare recipe: against none


@pytest.mark.parametrize("p, shown", [(0.17234, "0.17"), (0.0046, "0.0046"), (0.98, "0.98"), (0.99538, "0.9954"),
                                      (0.9990, "0.999"), (0.99996, "> 0.9999"), (3e-5, "< 1e-4"), (None, "–")])
def test_a_p_value_near_1_never_reads_1(p, shown):
    assert report.pval(p) == shown


def test_a_time_has_a_spread_only_over_two_runs_or_more():
    assert report.secs({"n": 1, "mean": 2044.79, "std": 0.0}) == "2044.79 s"
    assert report.secs({"n": 2, "mean": 2.5, "std": 0.5}) == "2.50 s ± 0.50"


@pytest.mark.parametrize("mean, shown", [(0.9399571, "93.996% ± 0.11"), (0.94003, "94.003% ± 0.11"),
                                         (0.94, "94.00% ± 0.11"), (0.9381, "93.81% ± 0.11")])
def test_cpu_accuracy_shows_a_mean_near_94_with_the_digits_that_say_which_side_it_is_on(mean, shown):
    side = {"runs": [{"seed": i} for i in range(7)], "n_wanted": 13, "command": "python x.py",
            "stats": {"accuracy": {"mean": mean, "std": 0.0011, "n": 7}, "p_mean_above_target": 0.5,
                      "time": {"mean": 1.0}}}
    results = {"cpu_accuracy": [{"fingerprint": {"device_name": "CPU"}, "sides": {"fast94_next": side}}]}
    assert f"| {shown} |" in report.t_cpu_accuracy(results)[2]


def test_cpu_layout_benchmark_times_both_layouts_and_the_report_shows_them(tmp_path, capsys):
    import cpu_layout
    out = tmp_path / "cpu" / "cpu_layout.json"
    assert cpu_layout.main(["--recipes", "fast94,myrtle24", "--batch-size", "8", "--repeats", "2", "--eval-batch", "4",
                            "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(row["recipe"], row["layout"]) for row in r["rows"]] == [
        (name, layout) for name in ("fast94", "myrtle24") for layout in ("contiguous", "channels_last")]
    for row in r["rows"]:
        assert row["batch"] == 8 and row["n"] == 2 and [len(v) for v in row["runs"].values()] == [2, 2]
        assert row["step s"] > 0 and row["eval s"] > 0 and 0 < row["batch_norm_error"] < 1e-3
    text = "\n".join(report.t_cpu_layout(report.load_results(tmp_path)))
    assert "| 1 | `fast94` | 8 |" in text and "| `myrtle24` |" in text and "--recipes fast94,myrtle24" in text
    for bad, message in ((["--recipes", "fast94,nope"], "no recipe nope (choose from myrtle24, "),
                         (["--batch-size", "0"], "error: --batch-size 0: must be positive")):
        with pytest.raises(SystemExit):
            cpu_layout.main(bad)
        assert message in capsys.readouterr().err


def test_cpu_accuracy_has_a_row_for_every_recipe_of_the_tier_in_its_order():
    side = lambda n: {"runs": [{"seed": i} for i in range(n)], "n_wanted": 5, "command": f"python x.py --runs {n}",
                      "stats": {"accuracy": {"mean": 0.94, "std": 0.001, "n": n}, "p_mean_above_target": 0.5,
                                "time": {"mean": 1.0}}}
    results = {"cpu_accuracy": [{"fingerprint": {"device_name": "CPU"},
                                 "sides": {"fast94_next": side(13), "fast94": side(2), "fast94_muon": side(3)}}]}
    rows = [line.split(" | ") for line in report.t_cpu_accuracy(results)[2:] if line.startswith("| ")]
    assert [row[0].strip("| ") for row in rows] == list(suite.CPU_ACCURACY)
    assert [row[4] for row in rows] == ["13", "2 (partial, of 5)", "3 (partial, of 5)"] + ["–"] * (len(rows) - 3)
    assert {row[3] for row in rows[:3]} == {"commit not recorded"}


def test_measuring_md_gives_the_cpu_accuracy_tiers_recipes_and_n_as_the_suite_has_them():
    text = " ".join((ROOT / "docs" / "measuring.md").read_text().split())
    assert ", ".join(f"`{name}` {n}" for name, n in suite.CPU_ACCURACY.items()) in text


def test_side_by_side_and_outcomes_show_a_mean_near_its_target_with_the_digits_that_say_which_side_it_is_on():
    def side(mean):
        return {"runs": [{"seed": i} for i in range(25)], "n_wanted": 25, "target": 0.94,
                "stats": {"accuracy": {"mean": mean, "std": 0.0013, "n": 25}, "p_mean_above_target": 0.5,
                          "time": {"mean": 1.5, "std": 0.01}}}
    results = {"fast94": [{"fingerprint": {"device_name": "NVIDIA H200"},
                           "sides": {"fast94": side(0.9399921), "airbench94": side(0.94003)}}]}
    row = next(line for line in report.t_side_by_side(results) if line.startswith("| fast94 / airbench94"))
    assert "| 93.999% ± 0.13 (p 0.5) | 94.003% ± 0.13 (p 0.5) |" in row
    assert "93.999% ± 0.13 (n=25)" in report.outcome(results, "`fast94`")


def test_the_time_ratio_after_the_peers_model_construction_takes_the_peer_runs_that_timed_it():
    ours = [{"seed": i, "final_acc": 0.94, "time": t} for i, t in enumerate([1.5, 1.6, 1.7])]
    theirs = [{"seed": i, "final_acc": 0.94, "time": t, "construct_s": c}
              for i, (t, c) in enumerate([(2.1, 0.1), (2.3, 0.2), (2.0, 0.1)])]
    result = {"kind": "side_by_side", "sides": {
        "fast94": {"name": "fast94", "n_wanted": 3, "target": 0.94, "runs": ours},
        "airbench94": {"name": "airbench94", "n_wanted": 3, "target": 0.94, "runs": theirs}}}
    r = suite.finish(result, {})
    after = run_statistics.ratio_ci([1.5, 1.6, 1.7], [2.0, 2.1, 1.9])
    assert r["time_ratio_after_construction"] == pytest.approx({"of": "fast94", "to": "airbench94", "n_to": 3, **after})
    assert r["time_ratio"]["ratio"] == pytest.approx(1.6 / 2.1333333)          # the clock as it ran, beside it
    del theirs[1]["construct_s"]                    # a run from before its construction was timed apart
    after = run_statistics.ratio_ci([1.5, 1.6, 1.7], [2.0, 1.9])
    assert suite.finish(result, {})["time_ratio_after_construction"] == pytest.approx(
        {"of": "fast94", "to": "airbench94", "n_to": 2, **after})
    del theirs[0]["construct_s"]
    assert suite.finish(result, {})["time_ratio_after_construction"] is None


def test_the_side_by_side_table_gives_the_ratio_after_the_peers_model_construction_where_it_was_timed():
    side = {"runs": [{"seed": 0}, {"seed": 1}], "n_wanted": 2, "target": 0.94,
            "stats": {"accuracy": {"mean": 0.94, "std": 0.001, "n": 2}, "p_mean_above_target": 0.5,
                      "time": {"mean": 1.5, "std": 0.01}}}
    result = {"fingerprint": {"device_name": "NVIDIA H200"}, "sides": {"fast94": side, "airbench94": side},
              "time_ratio": {"ratio": 0.7, "low": 0.69, "high": 0.71}}
    def row(r):
        return next(line for line in report.t_side_by_side({"fast94": [r]}) if line.startswith("| fast94 / airbench94"))
    assert row(result).endswith("| 0.700 [0.690, 0.710] | not measured |")
    timed = {**result, "time_ratio_after_construction": {"ratio": 0.72, "low": 0.715, "high": 0.725, "n_to": 2}}
    assert row(timed).endswith("| 0.700 [0.690, 0.710] | 0.720 [0.715, 0.725] |")
    timed["time_ratio_after_construction"]["n_to"] = 1          # of the peer's 2 runs, 1 timed its construction
    assert row(timed).endswith("| 0.700 [0.690, 0.710] | 0.720 [0.715, 0.725] (the peer's n = 1) |")


def test_an_outcome_says_when_a_change_is_measured_only_inside_its_whole_recipe():
    side = {"runs": [{"seed": i} for i in range(17)], "n_wanted": 100, "target": 0.94,
            "stats": {"accuracy": {"mean": 0.9402, "std": 0.0014, "n": 17}, "p_mean_above_target": 0.24,
                      "time": {"mean": 1.15, "std": 0.03}}}
    results = {"fast94_next": [{"fingerprint": {"device_name": "NVIDIA H200"}, "sides": {"fast94_next": side}}]}
    whole = "NVIDIA H200: 1.15 s ± 0.03, 94.02% ± 0.14 (n=17)"
    block = "\n".join(["| change | prediction | measured by | outcome |", "| --- | --- | --- | --- |",
                       "| `fast94_next`: the record's configuration | p | `fast94_next` | x |",
                       "| `--act silu` | p | `fast94_next` | x |", "| `--muon-x` | p | `fast94_none` | x |",
                       "| `r --epochs 8`: more | p | `cpu:r --epochs 8` | x |",     # a side of its own, named
                       "| `--epochs 8` | p | `cpu:r --epochs 8` | x |"])
    results["cpu"] = [{"fingerprint": {"device_name": "CPU"}, "sides": {"r --epochs 8": side}}]
    rows = report.fill_outcomes(block, results).split("\n")[2:]
    assert rows[0].endswith(f"| {whole} |")
    assert rows[1].endswith(f"| not alone, only in the whole `fast94_next`: {whole} |")
    assert rows[2].endswith("| not measured |")
    cpu = whole.replace("NVIDIA H200", "CPU")
    assert rows[3].endswith(f"| {cpu} |")
    assert rows[4].endswith(f"| not alone, only in the whole `cpu:r --epochs 8`: {cpu} |")


def test_a_piece_not_yet_run_on_a_device_estimates_its_runs_from_the_pieces_that_ran_there(tmp_path):
    fast94, fast94_next = (next(pc for pc in suite.pieces() if pc.name == n) for n in ("fast94", "fast94_next"))
    flops = {"fast94": {"train": 0.34e15, "final_eval": 0.014e15}, "fast94_next": {"train": 0.26e15,
                                                                                   "final_eval": 0.005e15}}
    done = fake_result([1.6] * 8, 100, setup=200.0)
    done["sides"]["airbench94"]["runs"] = [{"seed": 0, "final_acc": 0.94, "time": 2.2}] * 2
    (tmp_path / "fast94.json").write_text(json.dumps({**done, "kind": "side_by_side", "smoke": False}))
    (tmp_path / "cpu_demo.json").write_text(json.dumps({**fake_result([99.0], 4), "kind": "cifar", "smoke": False}))
    elsewhere = suite.measured_elsewhere(tmp_path, fast94_next, flops)
    assert elsewhere["walls"] == pytest.approx({"fast94": 1.6, "airbench94": 2.2})   # not another kind of piece
    assert suite.setup_s(fast94_next, {"chunks": []}, elsewhere) == 200.0              # compiled alike: its start
    empty = {"sides": {"fast94_next": {"name": "fast94_next", "n_wanted": 100, "runs": []},
                       "airbench94": {"name": "airbench94", "n_wanted": 25, "runs": []}}, "chunks": []}
    per = {s: suite.per_run_s(fast94_next, s, empty, fp={"matmul_tflops": 800.0}, flops=flops, elsewhere=elsewhere)
           for s in ("fast94_next", "airbench94")}
    # our recipe at fast94's measured seconds per counted FLOP (10 and 8 epochs, each with an evaluation pass)
    assert per == pytest.approx({"fast94_next": 1.6 * (0.26e15 + 8 * 0.005e15) / (0.34e15 + 10 * 0.014e15),
                                 "airbench94": 2.2})
    plan = lambda known: suite.plan(fast94_next, empty, fp={"matmul_tflops": 800.0}, flops=flops, left_s=480.0,
                                    elsewhere=known)[0]
    assert plan(elsewhere) == {"fast94_next": 100, "airbench94": 25}     # it all fits at the rate the device reached
    assert plan(None) == {"fast94_next": 57, "airbench94": 14}           # at the assumed efficiency, 57% of it
    assert suite.measured_elsewhere(tmp_path, fast94, flops) == {"walls": {}, "s_per_flop": None, "setup_s": None}


def test_the_gpu_chunks_table_lists_every_chunk_run_on_a_gpu_oldest_first_and_no_cpu_chunk():
    chunk = lambda date, setup: {"date": date, "runs_added": 5, "seconds": 300.4, "estimated_s": 350.0,
                                 "setup_s": setup, "argv": "python x.py"}
    gpu = {"device_name": "NVIDIA H200", "device": "cuda"}
    results = {"fast94": [{"fingerprint": gpu, "chunks": [chunk("2026-01-02T00:00:00", 220.2)]},
                          {"fingerprint": {"device_name": "CPU", "device": "cpu"}, "chunks": [chunk("2026", 9.0)]}],
               "fast94_next": [{"fingerprint": gpu, "chunks": [chunk("2026-01-01T00:00:00", None)]}]}
    lines = report.t_gpu_chunks(results)
    assert lines[2:4] == ["| 2026-01-01T00:00:00 | NVIDIA H200 | `fast94_next` | 5 | 300 s | 350 s | – |",
                          "| 2026-01-02T00:00:00 | NVIDIA H200 | `fast94` | 5 | 300 s | 350 s | 220 s |"]
    assert len(lines) == 6 and report.t_gpu_chunks({}) == ["The suite's chunks on a GPU: not measured."]


def test_the_gpu_check_runs_every_check_in_the_smoke_pass(smoke):
    """benchmarks/imagenet_gpu_check.py --smoke, as the suite's tier 4 runs it, under the CUDA stand-in: a row for
    each decoder at each size (nvImageCodec's saying which package it needs where it is not installed), the step alone
    and with each GPU decoder, the training killed and resumed, the race and the host waits."""
    folder, out = smoke
    (device,) = folder.iterdir()
    result = json.loads((device / "imagenet_gpu_check.json").read_text())
    assert result["command"] == "python benchmarks/imagenet_gpu_check.py --smoke"
    rows = result["rows"]
    by = lambda check, **match: [r for r in rows if r["check"] == check and all(r[k] == v for k, v in match.items())]
    assert [r["check"] for r in rows[:2]] == ["images", "prepare"]
    # ImageNet's sizes, tiny: longer sides 36 to 48, landscape three times in five (its expectation 39.9 x 35.7 px)
    assert 36 * 0.75 < rows[0]["mean_height"] < rows[0]["mean_width"] <= 48
    sizes = [24, 32]
    for decoder in ("gpu", "cpu"):
        assert [r["res"] for r in by("decoder", decoder=decoder)] == sizes
        assert all(r["images_per_s"] > 0 for r in by("decoder", decoder=decoder))
    # every batch timed was decoded, and counted by its path: the stand-in's nvJPEG is its software path alone
    timed = (result["config"]["warmup"] + result["config"]["steps"]) * result["config"]["batch_size"]
    for r in by("decoder", decoder="gpu") + by("together", decoder="gpu"):
        assert set(r["decode_counts"]) == {"software"} and r["decode_counts"]["software"] >= timed, r
    assert all(set(r["decode_counts"]) == {"cpu"} and r["decode_counts"]["cpu"] >= timed
               for r in by("decoder", decoder="cpu"))
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError:
        assert {r["error"] for r in by("decoder", decoder="nvimgcodec") + by("together", decoder="nvimgcodec")} == {
            f"--decoder nvimgcodec needs nvImageCodec: pip install {idec.nvimgcodec_package()}"}
    # both networks (each the tiny one here, as rn50_16ep's and rn18_16ep's recipes run it) at each size, alone and fed
    nets = ["rn50_16ep", "rn18_16ep"]
    assert [(r["recipe"], r["res"]) for r in by("step")] == [(n, res) for n in nets for res in sizes]
    assert [(r["recipe"], r["res"]) for r in by("together", decoder="gpu")] == [(n, res) for n in nets for res in sizes]
    assert all(r["images_per_s"] > 0 for r in by("step")) and {r["model"] for r in by("step")} == {"resnet_tiny"}
    assert all(r["of_step_alone"] > 0 for r in by("together", decoder="gpu"))
    # the estimate beside the measured peak (none under the stand-in): the decoder's buffers on top of the step's
    for net in nets:
        for res in sizes:
            (alone,), (fed,) = by("step", recipe=net, res=res), by("together", decoder="gpu", recipe=net, res=res)
            assert alone["peak_memory_bytes"] is None and 0 < alone["estimated_bytes"] < fed["estimated_bytes"]
    (train,) = by("train")
    assert (train["first"]["returncode"], train["resumed"]["returncode"]) == (-signal.SIGKILL, 0)
    assert train["resumed"]["resumed_line"] == "resumed from epoch 1 of ckpt.pt"
    assert by("race", decoder="gpu")[0]["equal"] is True
    assert by("sync")[0]["host_waits"] == 0                     # the training thread never waited


def test_the_imagenet_gpu_table_shows_each_decoder_step_and_pairing_and_a_line_of_the_other_checks():
    gib = 1 << 30
    step = lambda net, model, rate: {"check": "step", "recipe": net, "model": model, "res": 224, "batch": 512,
                                     "images_per_s": rate, "peak_memory_bytes": 20 * gib, "estimated_bytes": 18 * gib}
    result = {"command": "python benchmarks/imagenet_gpu_check.py", "fingerprint": {"device_name": "NVIDIA H200"},
              "rows": [{"check": "images", "images": 25000, "classes": 100, "mean_width": 399.2, "mean_height": 356.6,
                        "seconds": 50.0},
                       {"check": "decoder", "decoder": "nvimgcodec", "res": 160, "batch": 512, "error": "no package"},
                       {"check": "decoder", "decoder": "gpu", "res": 160, "batch": 512, "images_per_s": 9000.4,
                        "decode_counts": {"hardware": 6000, "software": 656}},
                       step("rn50_16ep", "resnet50", 3100.2), step("rn18_16ep", "resnet18", 9900.0),
                       {**step("rn50_16ep", "resnet50", 3000.0), "check": "together", "decoder": "gpu",
                        "of_step_alone": 0.9677, "decode_counts": {"hardware": 6656}},
                       {"check": "train", "first": {"returncode": -9}, "resumed": {
                           "returncode": 0, "resumed_line": "resumed from epoch 1 of ckpt.pt"}},
                       {"check": "race", "decoder": "gpu", "equal": False, "differing": 2},
                       {"check": "race", "decoder": "nvimgcodec", "error": "no package"},
                       {"check": "sync", "skipped": "not begun: 361 s spent of --budget-s 360"}]}
    lines = report.t_imagenet_gpu({"imagenet_gpu_check": [result]})
    assert lines[2:7] == [
        "| NVIDIA H200 | decoder alone | – | 160 | 512 | nvimgcodec | not run: no package | – | – | – |",
        "| NVIDIA H200 | decoder alone | – | 160 | 512 | gpu | 9000 | – | – | hardware 6000, software 656 |",
        "| NVIDIA H200 | step alone | `rn50_16ep` (resnet50) | 224 | 512 | – | 3100 | – | 20.0 GiB (18.0 GiB) | – |",
        "| NVIDIA H200 | step alone | `rn18_16ep` (resnet18) | 224 | 512 | – | 9900 | – | 20.0 GiB (18.0 GiB) | – |",
        "| NVIDIA H200 | decoder feeding the step | `rn50_16ep` (resnet50) | 224 | 512 | gpu | 3000 | 0.968 | "
        "20.0 GiB (18.0 GiB) | hardware 6656 |"]
    assert lines[7:] == [
        "",
        "Command: `python benchmarks/imagenet_gpu_check.py`; 25,000 training JPEGs, mean 399 × 357 px; training "
        "killed (exit -9) and resumed (exit 0: resumed from epoch 1 of ckpt.pt); the same batches quiet and under "
        "load: gpu 2 differing; sync: not begun: 361 s spent of --budget-s 360."]
    empty = report.t_imagenet_gpu({})
    assert len(empty) == 6 and all(row.count("not measured") == 2 for row in empty[2:])


def test_the_gpu_check_begins_no_check_past_its_budget_and_says_so(tmp_path):
    """--budget-s: the images and store are made, every check not begun by then is a row saying it was skipped, and
    the result is written whole."""
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, "benchmarks/imagenet_gpu_check.py", "--smoke", "--budget-s", "0.001", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["check"] for row in rows] == ["images", "prepare", "decoder", "step", "race", "sync", "train"]
    assert all(row["skipped"].startswith("not begun: ") and row["skipped"].endswith(" s spent of --budget-s 0.001")
               for row in rows[2:])
    bad = subprocess.run([sys.executable, "benchmarks/imagenet_gpu_check.py", "--smoke", "--budget-s", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("--budget-s 0: must be positive")


def test_the_gpu_check_is_one_command_whose_rows_are_its_result():
    piece = next(pc for pc in suite.pieces() if pc.name == "imagenet_gpu_check")
    assert piece.tier == "4" and piece.kind in suite.ONE_COMMAND and piece.needs == ("gpu",)
    ctx = {"smoke": False, "out": "o.json"}
    assert suite.one_command_argv(piece, ctx) == ["python", "benchmarks/imagenet_gpu_check.py", "--out", "o.json"]
    assert suite.one_command_argv(piece, {**ctx, "smoke": True}, whole=True) == [
        "python", "benchmarks/imagenet_gpu_check.py", "--smoke"]


def test_the_record_beside_fast94_next_is_one_comparison_its_runs_spread_over_ours():
    piece = next(pc for pc in suite.pieces() if pc.name == "fast94_next_record")
    assert (piece.tier, piece.kind, piece.sides) == ("1", "beside_record", {"fast94_next": 100, "record": 50})
    ours = [{"seed": i, "final_acc": 0.94, "time": 1.1, "wall_s": 1.2} for i in range(4)]
    theirs = [{"seed": k, "final_acc": 0.94, "time": 2.0} for k in (0, 1)]
    result = {"sides": {"fast94_next": {"name": "fast94_next", "n_wanted": 100, "runs": ours},
                        "record": {"name": "record", "n_wanted": 50, "runs": theirs}}, "chunks": [{"setup_s": 100.0}]}
    want, est, rest = suite.plan(piece, result, fp={}, flops={}, left_s=None)
    assert want == {"fast94_next": 96, "record": 48}
    assert rest == pytest.approx(100 + 96 * 1.2 + 48 * 2.0)
    ctx = {"out": "o.json", "device": None, "smoke": False, "data": "c.npz"}
    chunk = suite.chunk_for(piece, {"fast94_next": 13, "record": 25}, {"fast94_next": 4, "record": 2}, ctx)
    assert chunk.argv == ["python", "benchmarks/compare.py", "--sides", "fast94_next,hiverge", "--runs",
                          "fast94_next=13,hiverge=25", "--seed", "fast94_next=4,hiverge=2", "--data-dir", "c.npz",
                          "--compile", "max-autotune", "--out", "o.json", "--rows", "o.json.rows"]
    row = lambda side, seed, valid=True: {"side": side, "seed": seed, "own_acc": 0.94, "ours_s": 1.0 + seed,
                                          "valid": valid}
    out = {"rows": [row("fast94_next", 4), row("hiverge", 2), row("hiverge", 3, valid=False)],
           "builds": {"fast94_next": {"flops_per_run": 2.0}, "hiverge": {}}}
    runs = chunk.parse(out)         # the record's side as the suite names it; a run whose weights changed left out
    assert [r["seed"] for r in runs["record"]] == [2] and runs["record"][0]["time"] == 3.0
    assert runs["fast94_next"][0]["final_acc"] == 0.94 and chunk.flops(out) == {"fast94_next": 2.0}
    alone = suite.chunk_for(piece, {"fast94_next": 3, "record": 0}, {}, ctx).argv
    assert alone[alone.index("--sides") + 1] == "fast94_next"               # the record's side done: ours alone


def test_fast94_lowflop_and_its_ablations_run_in_turn_in_one_command_each_side_its_own_runs_and_ratio():
    piece = next(pc for pc in suite.pieces() if pc.name == "fast94_lowflop")
    assert list(piece.sides) == ["fast94_next", "fast94_lowflop"] and piece.kind == "alternating"
    ctx = {"out": "o.json", "device": None, "smoke": False, "data": "c.npz"}
    chunk = suite.chunk_for(piece, {"fast94_next": 10, "fast94_lowflop": 10}, {"fast94_next": 5}, ctx)
    assert chunk.argv[:8] == ["python", "benchmarks/compare.py", "--sides", "fast94_next,fast94_lowflop",
                              "--runs", "fast94_next=10,fast94_lowflop=10", "--seed", "fast94_next=5,fast94_lowflop=0"]
    out = {"rows": [{"side": "fast94_next", "ours_s": 1.0, "own_acc": 0.94}, {"side": "fast94_lowflop", "ours_s": 0.9,
                                                                              "own_acc": 0.94}],
           "builds": {"fast94_next": {"flops_per_run": 2.0}, "fast94_lowflop": {"flops_per_run": 1.0}}}
    assert {s: [r["time"] for r in runs] for s, runs in chunk.parse(out).items()} == {
        "fast94_next": [1.0], "fast94_lowflop": [0.9]}
    assert chunk.flops(out) == {"fast94_next": 2.0, "fast94_lowflop": 1.0}
    runs = lambda times: [{"seed": i, "final_acc": 0.94, "time": t} for i, t in enumerate(times)]
    result = {"kind": "alternating", "sides": {
        "fast94_next": {"name": "fast94_next", "target": 0.94, "n_wanted": 3, "runs": runs([1.0, 1.1, 1.2])},
        "fast94_lowflop": {"name": "fast94_lowflop", "target": 0.94, "n_wanted": 3, "runs": runs([0.9, 1.0, 1.1])}}}
    ratio = suite.finish(result, {})["time_ratios"]["fast94_lowflop"]
    assert (ratio["of"], ratio["to"]) == ("fast94_lowflop", "fast94_next")
    assert ratio["ratio"] == pytest.approx(1.0 / 1.1)
    assert result["complete"]
