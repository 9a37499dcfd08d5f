"""The command line end to end, on small synthetic data, in a subprocess as a user runs it."""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, ctrl_c_heard, failing_on_call, host_refusal, synthetic_arrays, synthetic_npz


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "cifar10_fast.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def synth_npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 256, 128)


def test_two_runs_print_the_table_and_write_the_json(synth_npz, tmp_path):
    out = tmp_path / "results.json"
    r = run_cli("--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "2", "--width", "0.125",
                "--batch-size", "64", "--runs", "2", "--target", "0.2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "warning: no GPU in use" in r.stderr
    lines = r.stdout.splitlines()
    header = [ln for ln in lines if ln.split()[:2] == ["epoch", "lr"]]
    assert len(header) == 2
    assert header[0].split() == ["epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time",
                                 "total_time"]
    rows = [ln.split() for ln in lines if ln.split() and ln.split()[0] in ("1", "2")]
    assert [row[0] for row in rows] == ["1", "2", "1", "2"] and all(len(row) == 8 for row in rows)
    assert "summary over 2 runs of myrtle24" in r.stdout and "runs reaching 20.00%" in r.stdout

    res = json.loads(out.read_text())
    assert res["recipe"] == "myrtle24" and res["settings"]["epochs"] == 2
    assert res["settings"]["batch_size"] == 64 and res["settings"]["width"] == 0.125
    assert res["environment"]["torch"] and res["environment"]["device"] == "cpu"
    assert [r["seed"] for r in res["runs"]] == [0, 1]
    assert all(len(run["rows"]) == 2 for run in res["runs"])
    # printed numbers are the JSON's numbers
    assert float(rows[1][5]) == pytest.approx(res["runs"][0]["rows"][1]["test_acc"], abs=1e-4)
    s = res["summary"]
    assert s["final_acc"]["n"] == 2 and s["final_acc"]["mean"] == pytest.approx(
        np.mean([run["final_acc"] for run in res["runs"]]))
    assert 0 <= s["fraction_reaching_target"] <= 1
    # the class is written into the images, so even 2 epochs on 256 images learn something
    assert s["final_acc"]["mean"] > 0.2


def test_list_recipes():
    r = run_cli("--list-recipes")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["recipe", "what", "it"] and max(map(len, lines)) <= 100
    names = [ln.split()[0] for ln in lines[1:] if not ln.startswith(" ")]      # a doc's further lines are indented
    assert names[:2] == ["myrtle24", "myrtle10"]
    # our lowest-FLOP attempt, then the resolution curriculum built on it
    assert names[-4:] == ["fast94_next", "fast94_next_lowres", "fast94_lowflop", "fast94_curriculum"]


def test_bad_data_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "bad.npz"
    d = synthetic_arrays(16, 16)
    d["train_images"] = d["train_images"].astype(np.int16)
    np.savez(bad, **d)
    r = run_cli("--data-dir", str(bad), "--device", "cpu")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"error: {bad}: train_images has dtype int16, expected uint8"


def test_unknown_recipe_and_bad_flag(synth_npz):
    r = run_cli("--recipe", "nope", "--data-dir", str(synth_npz))
    assert r.returncode == 2 and "unknown recipe 'nope'; choose from myrtle24" in r.stderr
    r = run_cli("--epochs", "two")
    assert r.returncode == 2 and "--epochs: 'two' is not a whole number" in r.stderr


def test_a_journey_stage_runs_from_the_command_line(synth_npz):
    r = run_cli("--recipe", "whitening", "--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "1",
                "--width", "0.125", "--batch-size", "64")
    assert r.returncode == 0, r.stderr
    assert "recipe whitening on" in r.stdout and "final test accuracy" in r.stdout


def test_out_is_written_after_every_run_so_a_later_failure_keeps_it(synth_npz, tmp_path, monkeypatch):
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "train_run", failing_on_call(cf.train_run, 2))
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError):
        cf.main(["--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "1", "--width", "0.125",
                 "--batch-size", "64", "--runs", "3", "--out", str(out)])
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0]
    assert res["runs"][0]["wall_s"] >= res["runs"][0]["train_time"] and res["summary"]["final_acc"]["n"] == 1


def test_running_out_of_memory_is_one_line_that_keeps_the_finished_runs(synth_npz, tmp_path, monkeypatch, capsys):
    """The host's allocator refuses in run 2: the line says where and what is kept, the JSON keeps run 1."""
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "train_run", failing_on_call(cf.train_run, 2, fail=host_refusal))
    out = tmp_path / "r.json"
    rc = cf.main(["--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "1", "--width", "0.125",
                  "--batch-size", "64", "--runs", "3", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (rc, err[-1]) == (1, f"error: out of memory on cpu (asked for 4.0 EiB more) in epoch 1 of run 2; 1 finished "
                                f"run kept in {out}; a smaller --batch-size or --width needs less")
    assert not any("Traceback" in line for line in err)
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0]


def interrupted(args, after, sig=signal.SIGINT, *, script="cifar10_fast.py"):
    """Runs script (cifar10_fast.py) with args, presses Ctrl-C (SIGINT, or sends `sig`) once `after` matches a line of
    its stdout; (exit status, stdout, stderr)."""
    # unbuffered: the line arrives when printed, not when a full pipe buffer is flushed (on a quiet machine, after
    # the run it announces has ended)
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=ctrl_c_heard)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(after, line):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + out, err


def test_ctrl_c_is_one_line_and_keeps_the_finished_runs(synth_npz, tmp_path):
    out = tmp_path / "r.json"
    rc, stdout, err = interrupted(["--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "20", "--width",
                                   "0.0625", "--batch-size", "64", "--runs", "3", "--out", str(out)],
                                  after=r"run 2/3")
    assert rc == 130, err
    assert "Traceback" not in err
    assert re.fullmatch(rf"interrupted in epoch \d+ of run 2; 1 finished run kept in {re.escape(str(out))}",
                        err.strip().splitlines()[-1]), err
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0]


def test_sigterm_is_met_as_ctrl_c_is_one_line_exit_143_and_the_finished_runs_kept(synth_npz, tmp_path):
    """SIGTERM, how SLURM, docker and CI stop a job."""
    out = tmp_path / "r.json"
    rc, stdout, err = interrupted(["--data-dir", str(synth_npz), "--device", "cpu", "--epochs", "20", "--width",
                                   "0.0625", "--batch-size", "64", "--runs", "3", "--out", str(out)],
                                  after=r"run 2/3", sig=signal.SIGTERM)
    assert rc == 143 and "Traceback" not in err, err
    assert re.fullmatch(rf"terminated \(SIGTERM\) in epoch \d+ of run 2; 1 finished run kept in {re.escape(str(out))}",
                        err.strip().splitlines()[-1]), err
    res = json.loads(out.read_text())
    assert not res["complete"] and [r["seed"] for r in res["runs"]] == [0]
    assert sorted(os.listdir(tmp_path)) == ["r.json"]                   # its lock let go


TWO_RUNS = ["--device", "cpu", "--epochs", "1", "--width", "0.0625", "--batch-size", "64", "--runs", "2", "--quiet"]


def read_first_line_then_close(args, env=None, *, script="cifar10_fast.py"):
    """Runs script (cifar10_fast.py) with args as `| head -1` would: its first line of stdout read, the pipe then
    closed; (exit status, that line, stderr's lines but the CPU's warning)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    return proc.returncode, first, [line for line in err.splitlines() if not line.startswith("warning: no GPU")]


def test_a_pipe_closed_early_keeps_the_runs_going_into_out_quietly(synth_npz, tmp_path):
    out = tmp_path / "r.json"
    rc, first, err = read_first_line_then_close(["--data-dir", str(synth_npz), *TWO_RUNS, "--out", str(out)])
    assert (rc, err) == (0, []) and first.startswith("recipe myrtle24 on ")
    res = json.loads(out.read_text())
    assert res["complete"] and [r["seed"] for r in res["runs"]] == [0, 1]


def test_a_pipe_closed_early_without_out_stops_quietly_as_sigpipe_would(synth_npz):
    rc, first, err = read_first_line_then_close(["--data-dir", str(synth_npz), *TWO_RUNS])
    assert (rc, err) == (141, []) and first.startswith("recipe myrtle24 on ")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose every write fails")
def test_stdout_on_a_full_device_is_one_line_and_the_runs_still_reach_out(synth_npz, tmp_path):
    out = tmp_path / "r.json"
    with open("/dev/full", "w") as full:
        for flags, status, line in (
                ([], 1, "error: stdout: cannot write (No space left on device); stopped"),
                (["--out", str(out)], 0, "warning: stdout: cannot write (No space left on device); the rest of the "
                                         f"output is dropped, the results still go to {out}")):
            r = subprocess.run([sys.executable, str(ROOT / "cifar10_fast.py"), "--data-dir", str(synth_npz),
                                *TWO_RUNS, *flags], cwd=ROOT, text=True, stdout=full, stderr=subprocess.PIPE,
                               timeout=600)
            err = [e for e in r.stderr.splitlines() if not e.startswith("warning: no GPU")]
            assert (r.returncode, err) == (status, [line]), r.stderr
    assert [r["seed"] for r in json.loads(out.read_text())["runs"]] == [0, 1]


def test_a_second_run_writing_the_same_out_is_refused_in_one_line_and_the_first_keeps_it(synth_npz, tmp_path,
                                                                                         capsys):
    import cifar10_fast as cf
    import outputs
    out = tmp_path / "r.json"
    args = ["--data-dir", str(synth_npz), *TWO_RUNS, "--runs", "1", "--out", str(out)]
    with outputs.output_lock(out, "--out"):           # the first run, still writing
        assert cf.main(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: no GPU")]
        assert err == [f"error: --out {out}: another run is writing it (process {os.getpid()}); give another --out, "
                       "or wait for that run to end"]
        assert not out.exists()
    assert cf.main(args) == 0 and sorted(os.listdir(tmp_path)) == ["r.json"]     # once it ends; no lock left


def test_a_ghost_batch_that_does_not_divide_the_batch_is_refused_before_loading(tmp_path):
    r = run_cli("--bn-ghost-batch", "7", "--data-dir", str(tmp_path / "absent.npz"), "--device", "cpu")
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [
        "error: --bn-ghost-batch 7: must divide --batch-size 512 into whole groups (0: the whole batch's statistics)"])


def printed_recipe(script, args, capsys):
    """The tokens of the command --print-recipe prints (its first line, the recipe's name and what it is, left out)."""
    import shlex
    assert script.main([*args, "--print-recipe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ")
    return [t for t in shlex.split("\n".join(lines[1:])) if t != "\n"]


@pytest.mark.parametrize("script, prefix, other", [("cifar10_fast", [], "fast94_next"),
                                                    ("imagenet_fast", ["train"], "tiny")])
def test_print_recipe_prints_the_flags_that_rebuild_every_recipe(script, prefix, other, capsys):
    """Every recipe, as printed, rebuilds itself from its own name and, but for a phase table's recipe (whose table
    sets what its flags cannot), from another recipe's: the printed flags hold every setting, exactly."""
    import settings
    module = __import__(script)
    for name, r in module.RECIPES.items():
        tokens = printed_recipe(module, [*prefix, "--recipe", name], capsys)
        assert tokens[:2 + len(prefix)] == ["python", f"{script}.py", *prefix]
        args, changes = module.parse_args(tokens[2:])
        assert settings.flat(module.recipe(args.recipe, **changes)) == settings.flat(module.recipe(name)), name
        if script == "cifar10_fast" or not r.schedule.phases:
            args, changes = module.parse_args([*prefix, "--recipe", other, *tokens[4 + len(prefix):]])
            assert settings.flat(module.recipe(other, **changes)) == settings.flat(module.recipe(name)), name


def test_print_recipe_prints_the_flags_given_too(capsys):
    import cifar10_fast as cf
    tokens = printed_recipe(cf, ["--recipe", "fast94", "--epochs", "5", "--lookahead-momentum", "0"], capsys)
    assert tokens[tokens.index("--epochs") + 1] == "5" and tokens[tokens.index("--lookahead-momentum") + 1] == "0"
    assert "--lookahead-every" not in tokens
