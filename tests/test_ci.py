"""CI runs as a new user would: README's set-up command in a fresh virtual environment, then README's test command."""
import re

from conftest import ROOT


def readme_commands():
    """The commands of README's Set up block, without their comments."""
    block = re.search(r"## Set up\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def ci_commands():
    return [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.split("#")[0].strip()]


def test_ci_runs_readmes_set_up_and_test_commands_in_a_fresh_environment_outside_the_checkout():
    setup, test = readme_commands()
    ci = ci_commands()
    venv = ci.index('python3 -m venv "$venv"')
    assert 'venv=$(mktemp -d "${TMPDIR:-/tmp}/ci-venv.XXXXXX")' in ci[:venv]      # new each run, not in the checkout
    assert ci[venv + 1] == 'source "$venv/bin/activate"'
    installs = [c for c in ci if "pip install" in c]
    assert len(installs) == 1 and installs[0].replace(" -q --disable-pip-version-check", "").replace(
        "python -m pip", "pip") == setup
    assert ci[-1] == test and ci.index(installs[0]) > venv
