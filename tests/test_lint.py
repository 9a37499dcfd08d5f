"""The linter's rules (pyproject.toml's [tool.ruff]) hold over the repository: no line over 120 columns, no unused
import or name, no ambiguous name."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True)
    assert "No module named ruff" not in r.stderr, "ruff is missing: pip install -r requirements.txt"
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
