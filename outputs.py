"""What a run writes, and where: an output path checked before the run (check_output, not_a_file, writable_folder)
and written by one run at a time (output_lock), a folder left as it was by work that failed (made_folder), and files
written whole (write_atomic), JSON records among them, each carrying the code's version (write_json, write_result),
and a run's profile (profiled). Nothing here imports torch until a run is profiled.
"""
import contextlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

from core import DataError, UsageError
from versions import code_version


@contextlib.contextmanager
def made_folder(folder):
    """Creates folder (and its missing parents) for the work inside; if the work fails, removes what it created
    that is still empty, so a failed run leaves no empty folders behind."""
    from pathlib import Path
    folder, top = Path(folder), Path(folder)
    while not top.parent.exists():
        top = top.parent
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        if created:
            for d in (folder, *folder.parents):
                if d == top.parent or any(d.iterdir()):
                    break
                d.rmdir()
        raise


def writable_folder(folder, what, remedy, *, prefix="tmp"):
    """Raises DataError (one line: the folder, why `what` cannot be written there, `remedy`) unless folder is, or
    can be made, a folder this process can write a file in (one named prefix..., tried); leaves nothing it made."""
    from pathlib import Path
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{folder}: is a file, not a folder; {remedy}")
    made = []
    try:
        for d in [*reversed(folder.parents), folder]:
            if not d.exists():
                d.mkdir()
                made.append(d)
        fd, tried = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
        try:        # a byte, not an empty file: an empty file is made even on a full disk
            os.write(fd, b"\n")
        finally:
            os.close(fd)
            os.remove(tried)
    except OSError as e:
        raise DataError(f"{folder}: cannot write {what} there ({e.strerror or e}); {remedy}") from None
    finally:
        for d in reversed(made):          # made only to be tried
            d.rmdir()


def not_a_file(path):
    """What is at path (a link followed) when it is not a regular file: "a folder", "a character device", "a fifo",
    ...; None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except OSError:         # nothing there (or nothing this process may see): a new file
        return None
    kinds = ((stat.S_ISREG, None), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def check_output(path, flag):
    """Raises UsageError unless a file can be written at path: a regular file or none (not a folder, a device, a
    fifo or a socket), and write_atomic's temporary file written
    (and removed) in its folder, made for the trial where missing. Checked before training, so that a mistyped path
    costs nothing and a finished run is never lost to its file."""
    if path is None:
        return
    p = os.path.abspath(os.fspath(path))
    kind = not_a_file(p)
    if kind == "a folder":
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    if os.fspath(path).endswith(("/", os.sep)):            # abspath drops the slash: a folder meant, and none there
        raise UsageError(f"{flag} {path}: names a folder (a trailing /), and there is none; give a file name")
    if kind:
        raise UsageError(f"{flag} {path}: is {kind}, not a regular file; give a new file's name or a file's")
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {parent}")
    try:        # permissions are not the whole story (root in /proc, a read-only mount): write_atomic's file, tried
        writable_folder(os.path.dirname(p), f"{flag}'s file", "give a path in a folder you can write in",
                        prefix="." + os.path.basename(p) + ".")
    except DataError as e:
        raise UsageError(f"{flag} {path}: {e}") from None


class OutputLocked(UsageError):
    """Another process holds the lock of the file this one would write (output_lock)."""


@contextlib.contextmanager
def output_lock(path, flag):
    """While inside, this process alone writes `path`: an exclusive lock (flock) on a file beside it, .NAME.lock,
    holding this process's id and removed on leaving; a second process asking for it raises OutputLocked (one line,
    naming the holder). None locks nothing."""
    if path is None:
        yield
        return
    import fcntl
    folder = os.path.dirname(os.path.abspath(path))
    lock = os.path.join(folder, "." + os.path.basename(os.fspath(path)) + ".lock")
    made = [d for d in [folder, *map(str, Path(folder).parents)] if not os.path.exists(d)]
    os.makedirs(folder, exist_ok=True)       # as write_atomic would; removed again below if still empty
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise OutputLocked(f"{flag} {path}: another run is writing it (process {holder or 'unknown'}); give "
                               f"another {flag}, or wait for that run to end") from None
        try:                # the file locked is still the one at its name (not one its last holder removed)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        with contextlib.suppress(OSError):      # the id is for the refusal's line; a full disk may refuse it
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.remove(lock)           # before the lock is let go: the next writer makes a file of its own
        os.close(fd)
        for d in made:
            with contextlib.suppress(OSError):      # not empty: the results are in it
                os.rmdir(d)


def default_file_mode():
    """The mode open() gives a new file: 0666 less the umask (os.umask can only be read by setting it)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path, write):
    """Call write(tmp_path), then rename onto path, so readers never see a half-written file. The file gets the
    permissions open() would give it (mkstemp's temporary file is private to its owner). Never onto what is not a
    regular file (a device, a fifo): a DataError of one line, before and after the write."""
    path = os.fspath(path)
    refuse_special(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_file_mode())
        refuse_special(path)          # made while the file was written
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def refuse_special(path):
    kind = not_a_file(path)
    if kind:
        raise DataError(f"{path}: is {kind}, not a regular file; nothing written there")


def write_json(path, obj):
    """Writes obj as JSON, atomically; a dict also records the code that wrote it ("code": code_version())."""
    if isinstance(obj, dict) and "code" not in obj:
        obj = {**obj, "code": code_version()}

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
    write_atomic(path, write)


def write_result(path, record, flag="--out"):
    """Writes a run's record as JSON at path; where that fails (a full disk, a file made a device meanwhile), prints
    the record whole on stdout (one line of JSON) and raises DataError of one line that says so."""
    try:
        write_json(path, record)
    except (OSError, DataError) as e:
        print(json.dumps(record), flush=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DataError(f"{flag} {path}: not written ({why}); the result is printed in full above, on stdout, as "
                        "one line of JSON") from None


@contextlib.contextmanager
def profiled(path, device, *, rows=12, file=None):
    """A run's record of its kernels: while inside, torch.profiler records the CPU's operators and, on a CUDA GPU, its
    kernels; then the trace is written to path (Chrome's JSON, for Perfetto or chrome://tracing) and its top kernels by
    time printed on file (stderr). path None: nothing recorded. It yields path."""
    if path is None:
        yield None
        return
    import devices      # here: outputs.py imports no torch unless a run is profiled
    from torch.profiler import ProfilerActivity, profile
    on_gpu = str(device).startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * on_gpu]) as prof:
        yield path
        devices.synchronize(device)
    write_atomic(path, prof.export_chrome_trace)
    print(f"wrote a trace of the run to {path}\n" + top_kernels(prof, rows), file=file or sys.stderr, flush=True)


def top_kernels(prof, rows=12):
    """A table of the events of torch.profiler's `prof` that took the most time: the GPU's kernels (their time on
    it) where any were recorded, else the CPU's operators (their own time), with their calls and share of the total."""
    from torch.autograd import DeviceType
    events = prof.key_averages()
    chosen = [e for e in events if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    time, what = (lambda e: e.self_device_time_total), "kernels by their time on the GPU"
    if not chosen:
        chosen = [e for e in events if e.self_cpu_time_total > 0]
        time, what = (lambda e: e.self_cpu_time_total), "operators by their own time on the CPU (no GPU kernels)"
    total = sum(time(e) for e in chosen)
    top = sorted(chosen, key=time, reverse=True)[:rows]
    lines = [f"top {len(top)} {what}, of {total / 1e3:.1f} ms in all:", f"{'ms':>9} {'share':>6} {'calls':>6}  name"]
    return "\n".join(lines + [f"{time(e) / 1e3:9.3f} {time(e) / total:6.1%} {e.count:6d}  {e.key[:100]}" for e in top])
