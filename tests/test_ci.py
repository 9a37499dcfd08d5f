"""CI runs as a new user would: README's set-up command in a fresh virtual environment, then README's test command;
once with the newest torch requirements.txt allows, once with the GPU machines' torch 2.11 on Python 3.12."""
import os
import re
import subprocess

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

# A python that writes what it is asked to LOG: `-m venv DIR` makes DIR a virtual environment whose activate puts a
# copy of it first on PATH, named for the leg; its `-m pytest` fails in the leg named FAIL
STUB_PYTHON = r"""#!/bin/bash
echo "${LEG:-outside} $(basename "$0") $*" >> "$LOG"
if [[ $1 == --version ]]; then echo "Python 3.11.0"; fi
if [[ $1 == -m && $2 == venv ]]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
    echo "export PATH=\"$3/bin:\$PATH\" LEG=$(basename "$3")" > "$3/bin/activate"
fi
if [[ $1 == -m && $2 == pytest && $LEG == "$FAIL" ]]; then exit 1; fi
exit 0
"""


def readme_commands():
    """The commands of README's Set up block, without their comments."""
    block = re.search(r"## Set up\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def run_ci(tmp_path, *, fail="", python312=True):
    """.ci/run with stub pythons (python3, and pyenv's 3.12 where python312) and no pyenv command: (exit status,
    stdout, stderr, the stubs' calls, what it left in its TMPDIR)."""
    stubs, pyenv_root, tmp = tmp_path / "bin", tmp_path / "pyenv", tmp_path / "tmp"
    for folder in (stubs, tmp):
        folder.mkdir()
    pythons = [stubs / "python3"] + [pyenv_root / "versions" / "3.12.1" / "bin" / "python"] * python312
    for path in pythons:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STUB_PYTHON)
        path.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "PYENV_ROOT": str(pyenv_root), "TMPDIR": str(tmp),
           "LOG": str(tmp_path / "log"), "FAIL": fail, "HOME": os.environ.get("HOME", "/")}
    done = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr, (tmp_path / "log").read_text().splitlines(), list(tmp.iterdir())


def test_ci_runs_readmes_set_up_and_test_commands_in_two_fresh_environments_outside_the_checkout(tmp_path):
    status, out, err, calls, left = run_ci(tmp_path)
    assert status == 0 and not left, err                       # the environments are removed after
    setup, test = readme_commands()
    setup = setup.replace("pip install", "python -m pip install -q --disable-pip-version-check")
    venv = re.compile(rf"outside (python3|python) -m venv {re.escape(str(tmp_path / 'tmp'))}/ci-venvs\.\w+/(\w+)$")
    made = [venv.match(c).groups() for c in calls if venv.match(c)]
    assert made == [("python3", "newest"), ("python", "torch211")]      # the second of pyenv's 3.12
    assert [c for c in calls if c.startswith("newest ")] == [f"newest {setup}", f"newest {test}"]
    assert [c for c in calls if c.startswith("torch211 ")] == [f"torch211 {setup} -c .ci/torch211.txt",
                                                               f"torch211 {test}"]


@pytest.mark.parametrize("fail, message, other", [
    ("newest", "ci: failed: leg 1 (requirements.txt)", "torch211 python -m pytest"),
    ("torch211", "ci: failed: leg 2 (torch 2.11)", "newest python -m pytest")])
def test_ci_fails_where_either_leg_fails_and_runs_the_other(tmp_path, fail, message, other):
    status, _, err, calls, _ = run_ci(tmp_path, fail=fail)
    assert status == 1 and err.strip() == message and other in calls


def test_without_pyenvs_python_312_the_torch_211_leg_says_so_and_runs_on_python3(tmp_path):
    status, out, _, calls, _ = run_ci(tmp_path, python312=False)
    assert status == 0
    assert "ci: no Python 3.12 under pyenv's versions: the torch 2.11 leg runs on Python 3.11.0" in out.splitlines()
    assert any(re.match(r"outside python3 -m venv .*/torch211$", c) for c in calls)


def test_the_torch_211_constraints_pin_the_gpu_machines_builds_within_requirements():
    pins = [Requirement(line) for line in (ROOT / ".ci" / "torch211.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert [(p.name, str(p.specifier)) for p in pins] == [("torch", "==2.11.0"), ("torchvision", "==0.26.0")]
    ranges = {r.name: r.specifier for r in (Requirement(line.split("#")[0]) for line in
                                             (ROOT / "requirements.txt").read_text().splitlines()
                                             if line.split("#")[0].strip())}
    assert all(ranges[p.name].contains(next(iter(p.specifier)).version) for p in pins)
