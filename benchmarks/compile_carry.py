"""torch.compile's work carried from one GPU lease to the next: what a process compiled, in the library's own portable
form (torch.compiler.save_cache_artifacts: each compiled graph, its code holding the kernels autotuning chose), gzip'd into
<side>.compiled.NN parts of at most PART_BYTES (the run tool brings back files of at most 16 MiB), and loaded into a
fresh machine's caches before that side's next build, which then finds every graph compiled (a warm build).
A build stopped at a call's deadline keeps what it finished: saved_on_sigterm() saves on SIGTERM, then exits.
"""
import contextlib
import gzip
import os
import signal
import sys
from pathlib import Path

PART_BYTES = 15 << 20
SUFFIX = ".compiled."
TERMINATED = 3              # a worker's exit status after saving on SIGTERM


def part_paths(folder, side):
    """The side's parts in folder, in order."""
    return sorted(Path(folder).glob(f"{side}{SUFFIX}[0-9][0-9]"))


def carried(folder):
    """{side: bytes of its parts} of every side with parts in folder ({} where there is no folder)."""
    found = {}
    for path in sorted(Path(folder).glob(f"*{SUFFIX}[0-9][0-9]")) if folder and Path(folder).is_dir() else ():
        side = path.name[:-len(SUFFIX) - 2]
        found[side] = found.get(side, 0) + path.stat().st_size
    return found


def write_parts(data, folder, side):
    """data as the side's parts in folder, its earlier parts replaced; the new paths."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for old in part_paths(folder, side):
        old.unlink()
    paths = []
    for k in range(0, max(len(data), 1), PART_BYTES):
        path = Path(folder) / f"{side}{SUFFIX}{len(paths):02d}"
        path.with_suffix(".tmp").write_bytes(data[k:k + PART_BYTES])
        path.with_suffix(".tmp").replace(path)          # a part is whole or absent, whenever the process stops
        paths.append(path)
    return paths


def save(side, folder):
    """What this process compiled, as the side's parts in folder; [] where it compiled nothing or saving failed
    (said on stderr: the side runs all the same, its next build cold)."""
    import torch
    try:
        saved = torch.compiler.save_cache_artifacts()
        return write_parts(gzip.compress(saved[0], compresslevel=6), folder, side) if saved and saved[0] else []
    except Exception as e:
        print(f"{side}: compiled graphs not saved ({type(e).__name__}: {e})", file=sys.stderr)
        return []


def load(side, folder):
    """The side's carried parts loaded into this process's compile caches: the number of artifacts; None where none
    was carried or they could not be loaded (said on stderr: a cold build)."""
    import torch
    paths = part_paths(folder, side) if folder else []
    if not paths:
        return None
    try:
        info = torch.compiler.load_cache_artifacts(gzip.decompress(b"".join(p.read_bytes() for p in paths)))
    except Exception as e:          # a part missing or cut short, another torch's artifacts
        print(f"{side}: carried graphs not loaded ({type(e).__name__}: {e}); its build is cold", file=sys.stderr)
        return None
    return sum(len(keys) for keys in info.artifacts.values()) if info else 0


def graph_counts():
    """{"hit", "miss"}: the graphs this process found in inductor's cache and those it compiled ({} before torch
    compiled anything)."""
    if "torch" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters
    got = counters["inductor"]
    return {"hit": got["fxgraph_cache_hit"], "miss": got["fxgraph_cache_miss"]} if got else {}


@contextlib.contextmanager
def saved_on_sigterm(side, folder):
    """Inside: SIGTERM saves what the process has compiled so far, then ends it with status TERMINATED (a build
    stopped at a deadline keeps its finished graphs for the next lease)."""
    def stop(signum, frame):
        try:
            if folder:
                save(side, folder)
        finally:                    # saved or not, the process ends as SIGTERM asked
            os._exit(TERMINATED)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
