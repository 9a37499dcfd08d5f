"""benchmarks/lease.py and benchmarks/fulcrum_adapter.py: the lease's plan rehearsed on a charged clock, what each
call carries and brings back, the graphs kept for the next lease, the standard 6-view evaluation, the headline under
both timings, and both calls run tiny on the CPU with the peers' stand-ins (tests/peer_standins/)."""
import json
import re
import shutil
import sys
import warnings

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fulcrum_adapter as fa  # noqa: E402
import compile_carry  # noqa: E402
import lease  # noqa: E402
import lease_plan as lp  # noqa: E402
import suite  # noqa: E402

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
    found = lp.measured_times(suite_times)
    assert found["run_s"]["fast94_next"] == pytest.approx(1.1412, abs=1e-4)      # fast94_next.json, 91 runs
    assert found["cold_s"]["fast94_next"] == pytest.approx(164.0, abs=0.1)        # its first, cold, start
    assert found["warm_s"]["fast94_next"] == pytest.approx(46.3, abs=0.1)         # a later start, the cache filled
    times, source = lp.times_for(["fast94_next", "e1"], suite_times)
    assert times["run_s"] == {"fast94_next": found["run_s"]["fast94_next"], "e1": lp.ASSUMED["run_s"]["e1"]}
    assert source["run_s e1"] == "assumed" and source["run_s fast94_next"].startswith("measured")


def test_an_earlier_leases_own_figures_come_first(suite_times):
    tmp_path = suite_times
    (tmp_path / "lease.json").write_text(json.dumps({"sides": ["fast94_next", "e1"], "wall_s": {"e1": 1.9, "fast94_next": 1.2},
                                                     "build_s": {"cold": {"e1": 99.0}, "warm": {"e1": 33.0}}}))
    (tmp_path / lease.COLD).write_text(json.dumps({"call": 1, "sides": ["e1"], "build_s": {}}))   # call 1's record
    found = lp.measured_times(tmp_path)
    assert found["run_s"]["e1"] == 1.9 and found["run_s"]["fast94_next"] == 1.2
    assert found["cold_s"] == {"fast94_next": pytest.approx(164.0, abs=0.1), "e1": 99.0}
    assert found["warm_s"]["e1"] == 33.0


def test_the_rehearsal_brings_the_headline_home_inside_12_minutes_once_every_sides_graphs_are_carried(suite_times):
    sides = ["fast94_next", "fast94_fastest", "fast94_curriculum", "e1", "hiverge"]
    times, _ = lp.times_for(sides, suite_times)
    whole = {s: {"complete": True, "compiled_s": 0.0} for s in sides}
    plan = lp.plan(sides, n=25, budget_s=720, times=times, carried=whole)
    steps = plan.steps
    print("\n".join(lp.minute_by_minute(steps)))
    assert plan.ends and plan.calls == ("build", "run") and steps[-1].end <= 720
    assert steps[0].end - steps[0].start == 120                                    # the machine's start charged
    assert all(plan.runs[s] >= 25 for s in lp.HEADLINE)
    assert [s.call for s in steps] == sorted(s.call for s in steps)                # call 1, then call 2
    h = fa.headline(lp.rehearsed_rows(plan.runs, times), [s for s in sides if plan.runs[s] and s not in lp.PEERS])
    for timing in fa.TIMINGS:
        for peer in lp.PEERS:
            ci = h[timing]["ratios"][f"fast94_next/{peer}"]
            assert ci["low"] < ci["ratio"] < ci["high"] and h[timing]["sides"][peer]["n"] == 25
    # a budget that holds the headline alone: the sides beyond it are the ones left out; one that does not: said
    fewer = lp.plan(sides, n=25, budget_s=steps[-1].end - 30, times=times, carried=whole)
    assert fewer.ends and [s for s in sides if not fewer.runs[s]] == ["fast94_fastest", "fast94_curriculum"]
    assert not lp.plan(sides, n=25, budget_s=300, times=times, carried=whole).ends


def test_imagenets_check_follows_the_headline_only_where_the_time_left_holds_it(suite_times, tmp_path):
    sides = ["fast94_next", "e1", "hiverge"]
    times, _ = lp.times_for(sides, suite_times)
    whole = {s: {"complete": True, "compiled_s": 0.0} for s in sides}
    alone = lp.plan(sides, n=25, budget_s=720, times=times, carried=whole)
    check = sum(seconds for _, seconds, _, _ in lp.imagenet_parts(3, times))
    assert alone.steps[-1].end + check > 720                                       # today's 12 minutes: no room
    assert lp.plan(sides, n=25, budget_s=720, times=times, carried=whole, imagenet=True) == alone
    roomy = lp.plan(sides, n=25, budget_s=alone.steps[-1].end + check, times=times, carried=whole, imagenet=True)
    assert roomy.ends and roomy.calls == ("build", "run", "imagenet") and roomy.runs == alone.runs
    assert roomy.steps[:len(alone.steps)] == alone.steps and roomy.steps[-1].what.startswith("ImageNet's GPU check")
    # measured whole on this kind: wanted no more; a smoke's or a cut-off run's result is not that
    assert not lp.imagenet_measured(tmp_path)
    for smoke, rows, measured in ((True, [], False), (False, [{"check": "sync", "skipped": "not begun"}], False),
                                  (False, [{"check": "sync", "host_waits": 0}], True)):
        (tmp_path / lp.IMAGENET_RESULT).write_text(json.dumps({"smoke": smoke, "rows": rows}))
        assert lp.imagenet_measured(tmp_path) is measured


def test_a_headline_side_no_lease_can_build_in_time_compiles_alone_after_imagenets_check(suite_times):
    """E1's cold build, longer than a lease: the compile shape. ImageNet's check first, where wanted, then E1 alone
    until the device time left; nothing timed. The next lease charges E1's cold build less what was compiled, and
    times the headline once that fits."""
    sides = ["fast94_next", "e1", "hiverge"]
    times, _ = lp.times_for(sides, suite_times)
    plan = lp.plan(sides, n=25, budget_s=720, times=times, imagenet=True)          # nothing carried
    assert (plan.shape, plan.calls, plan.built, plan.ends) == ("compile", ("imagenet", "build"), ["e1"], False)
    assert plan.runs == {"fast94_next": 0, "e1": 0, "hiverge": 0}
    assert 0 < plan.deadline < lp.CALL1_BUDGET_S and plan.steps[-1].end == pytest.approx(720)
    assert [s.call for s in plan.steps] == [1, 1, 1, 1, 2, 2, 2] and plan.steps[3].what.startswith("ImageNet's")
    build = plan.steps[-1]
    assert build.end - build.start == pytest.approx(plan.deadline + fa.TERM_GRACE_S) and "e1 built alone" in build.what
    assert lp.ends_in_time(plan.steps, 720)
    # ImageNet's check measured: E1 alone for the whole of a build call
    compiling = lp.plan(sides, n=25, budget_s=720, times=times)
    assert compiling.calls == ("build",) and compiling.deadline == lp.CALL1_BUDGET_S
    # the next lease: E1's graphs carried partly, charged its cold build less the seconds already compiled
    partial = {"e1": {"complete": False, "compiled_s": plan.deadline}}
    charged = lp.charged_builds(sides, times, partial)
    assert charged["e1"] == pytest.approx(times["cold_s"]["e1"] - plan.deadline)
    assert charged["hiverge"] == times["cold_s"]["hiverge"]
    assert lp.charged_builds(["e1"], times, {"e1": {"complete": False, "compiled_s": 1e6}}) == {
        "e1": times["warm_s"]["e1"]}                   # never below a warm build
    after = lp.plan(sides, n=25, budget_s=720, times=times, carried={"e1": {"complete": False, "compiled_s": 540.0}})
    assert after.shape == "headline" and after.ends and after.runs == dict.fromkeys(sides, 25)


def test_a_plan_made_mid_lease_charges_no_start_keeps_a_margin_and_drops_imagenet_before_the_build(
        suite_times, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(lp, "VERSION_PATH", tmp_path / "code-version.json")
    monkeypatch.setattr(lp, "CARRIED", tmp_path / ".lease-cache")
    sides = ["fast94_next", "e1", "hiverge"]
    times, _ = lp.times_for(sides, suite_times)
    warm = lp.held(times)
    fresh, mid = (lp.plan(sides, n=25, budget_s=720, times=t, imagenet=True) for t in (times, warm))
    assert fresh.steps[0].what == "machine start" and mid.steps[0].what.startswith("between the calls")
    assert mid.deadline - fresh.deadline == pytest.approx(times["start_s"] - times["gap_s"])   # the start, given on
    # too little left for the check and a build call's minute: the build alone; too little for that: nothing fits
    check = sum(seconds for _, seconds, _, _ in lp.imagenet_parts(1, warm))
    short = lp.plan(sides, n=25, budget_s=check + 60, times=warm, imagenet=True)
    assert short.calls == ("build",) and short.deadline >= lp.MIN_BUILD_S
    base = ["plan", "--sides", "fast94_next,e1,hiverge", "--results", str(suite_times)]
    assert lease.main([*base, "--left-s", "30"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("mid-lease: 30 s of device time left, 60 s kept back, the machine held (no start charged)")
    assert "nothing fits: the build call would get 0 s, under the 60 s a build call is worth" in out
    for argv in ([*base, "--left-s", "300", "--budget-s", "200"], ["call1", "--out", "o", "--left-s", "300"],
                 [*base, "--left-s", "0"]):
        with pytest.raises(SystemExit) as e:
            lease.main(argv)
        assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(
            "plan's alone, positive, and instead of --budget-s (it sets the budget)")


def test_the_plan_command_sizes_each_calls_carry_and_prints_every_command(capsys, tmp_path, monkeypatch,
                                                                         suite_times):
    monkeypatch.setattr(lp, "VERSION_PATH", tmp_path / "code-version.json")     # the checkout stays as it was
    monkeypatch.setattr(lp, "CARRIED", tmp_path / ".lease-cache")
    monkeypatch.setattr(lp, "WHEELS", tmp_path / ".whl")
    (tmp_path / ".whl").mkdir()
    plan = ["plan", "--sides", "fast94_next,e1,hiverge", "--runs", "25", "--results", str(suite_times)]
    assert lease.main(plan) == 1
    out = capsys.readouterr().out
    assert "does NOT end" in out and "this lease yields ImageNet's GPU check and e1's graphs (keep them)" in out
    assert "call 1 (imagenet): .whl/ lacks nvidia_nvimgcodec_cu13, nvidia_nvjpeg, simplejpeg: fetch them" in out
    assert "python3 benchmarks/imagenet_gpu_check.py --out $OUT/imagenet_gpu_check.json --budget-s 210 " in out
    assert 'call 2 (build): carry ["peers", "code-version.json"]: ' in out and "carried graphs " \
        "(.lease-cache/nvidia-h200): none: every build cold" in out
    assert "benchmarks/lease.py call1 --out $OUT --sides e1 --carried .lease-cache/nvidia-h200 --budget-s 180 " in out
    # the check's own parser takes the command the ImageNet call runs
    import imagenet_gpu_check
    line = next(x for x in out.splitlines() if x.startswith("call 1 (imagenet): timeout_s "))
    argv = line.split("benchmarks/imagenet_gpu_check.py ", 1)[1].split(" 2>&1")[0].split()
    check = imagenet_gpu_check.parse_args(argv)
    assert (check.out, check.budget_s, check.smoke) == ("$OUT/imagenet_gpu_check.json", 210.0, False)
    assert line.startswith("call 1 (imagenet): timeout_s 370; ")              # the check, its install and 30 s
    for side in ("fast94_next", "e1", "hiverge"):               # every side's graphs kept whole: the headline ends
        compile_carry.write_parts(b"graphs", tmp_path / ".lease-cache" / "nvidia-h200", side)
    assert lease.main(plan) == 0
    out = capsys.readouterr().out
    assert "ImageNet's GPU check (6.2 min charged) does not fit after the headline: a later lease's" in out
    assert 'call 1 (build): carry [".gpudata/a", "peers", "code-version.json", ".lease-cache/nvidia-h200"]: ' in out
    assert 'call 2 (run): carry [".gpudata/b", "peers", "code-version.json"]: ' in out and "MiB with the tree, " \
        "inside the 64 MiB a call carries" in out
    assert json.loads((tmp_path / "code-version.json").read_text()) == lp.code_version()
    assert "mkdir -p /root/c10 && cp .gpudata/a/* /root/c10/ && PYTHONUNBUFFERED=1 python3 benchmarks/lease.py call1 " \
           "--out $OUT --sides fast94_next,e1,hiverge --carried .lease-cache/nvidia-h200 --budget-s " in out
    assert "benchmarks/lease.py call2 --out $OUT --data-dir /root/cifar10.npz --sides fast94_next,e1,hiverge " \
           "--runs 25" in out
    for name in ("nvidia_nvimgcodec_cu13-0.9.0.20-py3-none-manylinux_2_28_x86_64.whl", "simplejpeg-1.9.0-cp312.whl",
                 "nvidia_nvjpeg-13.3.2.43-py3-none-manylinux2014_x86_64.whl"):
        (tmp_path / ".whl" / name).write_bytes(b"w")
    assert lease.main([*plan, "--budget-s", "1200"]) == 0          # room for the check after the headline
    out = capsys.readouterr().out
    assert 'call 3 (imagenet): carry [".whl", "code-version.json"]: ' in out and "lacks" not in out
    assert lease.main(["plan", "--runs", "400", "--results", str(suite_times)]) == 1   # 400 rounds do not fit: said
    assert "does NOT end" in capsys.readouterr().out
    monkeypatch.setattr(lp, "CARRY_LIMIT", 1 << 20)             # a carry over the run tool's limit fails the plan
    assert lease.main(plan) == 1
    assert "OVER the 1 MiB a call carries" in capsys.readouterr().out


def test_prepare_lays_the_data_out_for_the_two_calls_and_keeps_it_out_of_git(tmp_path, capsys):
    parts, project = tmp_path / "parts", tmp_path / "project"
    parts.mkdir()
    (project / ".git" / "info").mkdir(parents=True)
    (project / ".git" / "info" / "exclude").write_text("# git ls-files --others --exclude-from=.git/info/exclude")
    names = ["cifar10_train_part1of2.npz", "cifar10_train_part2of2.npz", "cifar10_test.npz", "decode_cifar10_parts.py"]
    for k, name in enumerate(names):
        (parts / name).write_bytes(bytes(k + 1))
    for _ in range(2):                                           # again: the same layout, the exclude line once
        assert lease.prepare(parts, project / ".gpudata") == {"a": 1, "b": 2 + 3 + 4}
    assert sorted(p.name for p in (project / ".gpudata" / "b").iterdir()) == sorted(names[1:])
    assert (project / ".git" / "info" / "exclude").read_text().splitlines()[-1:] == ["/.gpudata/"]
    assert (project / ".git" / "info" / "exclude").read_text().count("/.gpudata/") == 1
    (parts / names[2]).unlink()
    with pytest.raises(FileNotFoundError, match="no cifar10_test.npz"):
        lease.prepare(parts, project / ".gpudata")


def test_call_1s_graphs_are_trimmed_to_what_comes_back_and_kept_for_the_next_lease(tmp_path, monkeypatch):
    out, carried = tmp_path / "out", tmp_path / ".lease-cache"
    monkeypatch.setattr(lp, "CARRIED", carried)
    monkeypatch.setattr(compile_carry, "PART_BYTES", 100)
    compile_carry.write_parts(b"e" * 250, out, "e1")                # 3 parts
    compile_carry.write_parts(b"h" * 150, out, "hiverge")           # 2 parts
    compile_carry.write_parts(b"f" * 50, out, "fast94_next")        # 1 part: 6 beside call 1's 3 own files
    said = []
    assert lease.returnable(out, ["e1", "hiverge", "fast94_next"], say=said.append) == ["e1", "hiverge"]
    assert said == ["fast94_next: its graphs (50 B in 1 parts) exceed what comes back: not sent"]
    assert set(compile_carry.carried(out)) == {"e1", "hiverge"}
    # call 1's record: hiverge built (its graphs whole), E1 stopped at the deadline (partly), E1 carried in already
    (out / lease.COLD).write_text(json.dumps({"build_s": {"hiverge": 250.0}, "lost": {"e1": "deadline"},
                                              "budget_s": 374.0, "carried": ["e1"]}))
    (carried / "nvidia-h200").mkdir(parents=True)
    (carried / "nvidia-h200" / lease.GRAPHS).write_text(json.dumps({"e1": {"complete": False, "compiled_s": 300.0}}))
    assert set(lease.keep(out, "nvidia-h200", say=said.append)) == {"e1", "hiverge"}
    assert lp.carried_graphs(carried / "nvidia-h200") == {"e1": {"complete": False, "compiled_s": 674.0},
                                                            "hiverge": {"complete": True, "compiled_s": 250.0}}
    assert b"".join(p.read_bytes() for p in compile_carry.part_paths(carried / "nvidia-h200", "e1")) == b"e" * 250
    assert lease.keep(tmp_path / "absent", "nvidia-h200", say=said.append) == {}
    assert said[-1].endswith("absent: no compiled parts (<side>.compiled.NN) to keep")


def test_keep_puts_each_calls_results_and_logs_in_the_kinds_results_and_refuses_a_smokes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lp, "CARRIED", tmp_path / ".lease-cache")
    results = tmp_path / "results" / "nvidia-h200"
    calls = {"build": {lease.COLD: "{}", "call1.log": "built", "workers.log": "w1"},
             "run": {"lease.json": json.dumps({"device_name": "NVIDIA H200"}), "rows.jsonl": "{}\n",
                     "call2.log": "ran", "workers.log": "w2"},
             "imagenet": {lp.IMAGENET_RESULT: json.dumps({"smoke": False, "rows": []}), "imagenet.log": "checked"}}
    for job, files in calls.items():
        folder = tmp_path / job
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
        assert lease.main(["keep", str(folder), "--results", str(results)]) == 0
    assert sorted(p.name for p in results.iterdir()) == sorted([
        "lease_call1.json", "lease_call1.log", "lease_call1_workers.log", "lease.json", "lease_rows.jsonl",
        "lease_call2.log", "lease_call2_workers.log", "imagenet_gpu_check.json", "lease_imagenet.log"])
    assert (results / "lease_call2_workers.log").read_text() == "w2"
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    (smoke / "lease.json").write_text(json.dumps({"device_name": "CPU (smoke)"}))
    capsys.readouterr()
    assert lease.main(["keep", str(smoke), "--results", str(tmp_path / "other")]) == 1
    assert f"{smoke}: a smoke's files, not results: none kept in {tmp_path / 'other'}" in capsys.readouterr().out
    assert not (tmp_path / "other").exists()


def test_bad_flags_are_one_line(capsys):
    for argv in (["call2", "--out", "o"], ["plan", "--runs", "1"], ["call1"]):
        with pytest.raises(SystemExit) as e:
            lease.main(argv)
        assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: call1: --out names the folder that comes back ($OUT)")
    for argv, line in ((["keep"], "error: keep: FOLDER: not a folder; name the one a call's files came back to"),
                       (["plan", "x"], "error: plan: takes no folder (x); only keep does")):
        with pytest.raises(SystemExit) as e:
            lease.main(argv)
        assert (e.value.code, capsys.readouterr().err.strip().splitlines()[-1]) == (2, line)
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
        graphs = {"cache_in": ".lease-cache/nvidia-h200", "cache_out": "o"} if synthetic else {}
        adapter = lease.adapter_args(args, sides=["fast94_next", "e1"], runs=2, synthetic=synthetic, **graphs)
        assert (adapter.smoke, adapter.synthetic, adapter.compile) == (False, synthetic, "max-autotune")
        for side in ("fast94_next", "e1"):
            command = fa.worker_argv(side, adapter)
            worker = fa.parse_args(command[command.index("worker"):])
            assert "" not in command and worker.data_dir == (None if synthetic else "c.npz")
            assert (worker.cache_in, worker.cache_out) == (graphs.get("cache_in"), graphs.get("cache_out"))


def test_a_worker_still_building_at_the_deadline_is_asked_to_stop_and_given_time_to_save(tmp_path, monkeypatch):
    """compare's deadline: SIGTERM first (compile_carry.saved_on_sigterm saves there), SIGKILL only after the grace."""
    marker = tmp_path / "saved"
    program = ("import os, pathlib, signal, sys, time\n"
               "def stop(*_):\n    time.sleep(0.5)\n    pathlib.Path(sys.argv[1]).write_text('saved')\n    os._exit(3)\n"
               "signal.signal(signal.SIGTERM, stop)\nwhile True:\n    time.sleep(1)\n")
    monkeypatch.setattr(fa, "worker_argv", lambda side, args: [sys.executable, "-c", program, str(marker)])
    args = fa.parse_args(["compare", "--sides", "e1", "--runs", "0", "--synthetic", "--budget-s", "3"])
    said = []
    rows, builds, lost = fa.compare(args, say=said.append)
    assert (rows, builds, lost, said) == ([], {}, {"e1": "deadline"}, ["e1: not built: deadline"])
    assert marker.read_text() == "saved"


@pytest.mark.slow       # a minute or two on a 2-core CPU: our recipe compiled twice
def test_call_1s_graphs_kept_make_the_next_call_1s_build_warm(tmp_path, monkeypatch, capsys):
    """The carry's whole path as the GPU machine takes it, ours compiled on the CPU (the peers' stand-ins compile
    nothing): call 1 sends its graphs back, keep stores them, a call 1 on a fresh cache loads them and compiles none."""
    compiled = fa.parse_args
    monkeypatch.setattr(fa, "parse_args", lambda argv: compiled(argv + ["--compile", "default"]))
    monkeypatch.setattr(lp, "CARRIED", tmp_path / ".lease-cache")
    said = []
    for k, carried in enumerate((None, tmp_path / ".lease-cache" / "cpu")):
        out, cache = tmp_path / f"out{k}", tmp_path / f"cache{k}"
        out.mkdir()
        args = lease.parse_args(["call1", "--out", str(out), "--sides", "fast94_next,e1", "--budget-s", "900"])
        args.smoke, args.cache, args.carried = True, cache, carried
        with suite.environment_of(suite.cache_environment(cache)):
            assert lease.call1(args, say=said.append) == 0
        if k == 0:
            assert set(compile_carry.carried(out)) == {"fast94_next"}             # the stand-in compiles nothing
            assert set(lease.keep(out, "cpu", say=said.append)) == {"fast94_next"}
    first, second = [line for line in said if line.startswith("fast94_next: built in")]
    assert "carried artifacts" not in first and re.search(r"from the cache, [1-9]\d* compiled$", first)
    assert re.search(r", [1-9]\d* carried artifacts loaded first; graphs: [1-9]\d* from the cache, 0 compiled$", second)


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
    assert set(call1["build_s"]) == {"fast94_next", "e1", "hiverge"} and call1["lost"] == {}
    assert "carried graphs: none" in out and call1["returned"] == {}          # nothing compiled on the CPU's smoke
    rows = [json.loads(line) for line in (tmp_path / "out2" / "rows.jsonl").read_text().splitlines()]
    assert [r["side"] for r in rows] == ["fast94_next", "e1", "hiverge"] * 2    # in turn, each as it ended
    assert all(0 <= r["tta6_acc"] <= 1 and r["fulcrum_s"] > 0 and r["ours_s"] > 0 for r in rows)   # both clocks read
    result = json.loads((tmp_path / "out2" / "lease.json").read_text())
    for timing in fa.TIMINGS:
        assert set(result["headline"][timing]["ratios"]) == {"fast94_next/e1", "fast94_next/hiverge"}
    assert set(result["build_s"]["cold"]) == set(result["build_s"]["warm"]) == {"fast94_next", "e1", "hiverge"}
    assert result["command"].startswith("python3 benchmarks/lease.py smoke") and result["device_name"] == "CPU (smoke)"


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
