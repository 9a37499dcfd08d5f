"""benchmarks/compile_carry.py: what one process compiled, saved as parts (whole, or as a SIGTERM stops its build) and
loaded into another process with empty caches, which then finds its graphs compiled (inductor's own counters)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compile_carry  # noqa: E402

# A process that compiles two small graphs (a function and its gradient), then either saves them or, told "block",
# waits inside saved_on_sigterm as a build in flight does; a second run loads the parts first and reports inductor's
# cache counters.
PROGRAM = """
import json, sys, threading, torch
sys.path.insert(0, sys.argv[1])
import compile_carry
from torch._dynamo.utils import counters
mode, folder = sys.argv[2], sys.argv[3]
loaded = compile_carry.load("side", folder) if mode == "load" else None
f = torch.compile(lambda x: (x.sin() * 2 + x.cos()).sum())
x = torch.randn(64, requires_grad=True)
f(x).backward()
if mode == "block":
    with compile_carry.saved_on_sigterm("side", folder):
        print("compiled", flush=True)
        threading.Event().wait()
if mode == "save":
    compile_carry.save("side", folder)
print(json.dumps({"loaded": loaded, "inductor": dict(counters["inductor"])}), flush=True)
"""


def run_program(mode, folder, cache):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", PROGRAM, str(ROOT / "benchmarks"), mode, str(folder)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_build_stopped_by_sigterm_keeps_its_graphs_and_a_fresh_process_finds_them_compiled(tmp_path):
    carried = tmp_path / "carried"
    stopped = run_program("block", carried, tmp_path / "cache1")
    assert stopped.stdout.readline().strip() == "compiled", stopped.stderr.read()
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == compile_carry.TERMINATED
    assert [p.name for p in compile_carry.part_paths(carried, "side")] == ["side.compiled.00"]
    fresh = run_program("load", carried, tmp_path / "cache2")           # empty caches of its own
    out, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["loaded"] >= 2                                         # the forward and backward graphs at least
    assert report["inductor"].get("fxgraph_cache_hit", 0) >= 2 and not report["inductor"].get("fxgraph_cache_miss")


def test_parts_split_at_part_bytes_join_whole_and_replace_a_sides_earlier_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_carry, "PART_BYTES", 1000)
    data = os.urandom(2500)
    paths = compile_carry.write_parts(data, tmp_path, "e1")
    assert [p.name for p in paths] == ["e1.compiled.00", "e1.compiled.01", "e1.compiled.02"]
    assert b"".join(p.read_bytes() for p in compile_carry.part_paths(tmp_path, "e1")) == data
    compile_carry.write_parts(data[:10], tmp_path, "e1")               # fewer parts: none of the old ones stays
    compile_carry.write_parts(b"x" * 5, tmp_path, "fast94_next")
    assert compile_carry.carried(tmp_path) == {"e1": 10, "fast94_next": 5}
    assert compile_carry.carried(tmp_path / "absent") == {} and compile_carry.carried(None) == {}
    assert not list(tmp_path.glob("*.tmp"))


def test_nothing_carried_loads_nothing_and_a_process_that_compiled_nothing_saves_nothing(tmp_path):
    assert compile_carry.load("e1", tmp_path) is None and compile_carry.load("e1", None) is None
    program = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import compile_carry; "
               f"print(compile_carry.save('e1', {str(tmp_path)!r}))")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "[]\n") and not list(tmp_path.iterdir())


def test_carried_parts_that_cannot_be_read_give_a_cold_build_in_a_line(tmp_path, capsys):
    compile_carry.write_parts(b"not gzip", tmp_path, "e1")
    assert compile_carry.load("e1", tmp_path) is None
    assert capsys.readouterr().err.startswith("e1: carried graphs not loaded (BadGzipFile: ")
