"""Framework-free helpers: timers, progress and result tables, the torus's grid,
the statistics and printed summary of several runs, the command-line parser with one-line errors, the data and
usage errors the scripts report, atomic files, the check of an output path, and children that die with their parent.

Nothing here imports torch (but first_to_say, under torchrun), so it can be read and tested on its own.
"""
import argparse
import contextlib
import json
import math
import os
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path


class Timer:
    """Wall-clock timer that synchronises the device before every reading: timer() returns the seconds since the
    previous call and adds them to timer.total unless include=False (work that must not count, such as evaluation)."""

    def __init__(self, synchronize=None):
        self.synchronize = synchronize or (lambda: None)
        self.synchronize()
        self.last = time.perf_counter()
        self.total = 0.0

    def __call__(self, include=True):
        self.synchronize()
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        if include:
            self.total += dt
        return dt


def square_grid(world):
    """rows x cols = world with rows <= cols as close as possible (32 x 32 for 1,024): the 2D torus's grid."""
    rows = max(r for r in range(1, math.isqrt(world) + 1) if world % r == 0)
    return rows, world // rows


class Progress:
    """The steps of one epoch on stderr once the epoch's projected time passes after_s seconds: tqdm's bar on a
    terminal, elsewhere a line in tqdm's format at most every `every_s` seconds. It counts steps on the host, never
    waiting on the device; with on=False, nothing."""
    every_s = 30.0

    def __init__(self, total, desc, after_s=5.0, file=None, *, on=True):
        self.file = file or sys.stderr
        self.total, self.desc, self.after_s, self.n, self.on = total, desc, after_s, 0, on
        self.bar = None
        self.start = self.last = time.perf_counter()

    def update(self):
        if not self.on:
            return
        self.n += 1
        now = time.perf_counter()
        if self.bar is None and (now - self.start) / self.n * self.total <= self.after_s:
            return
        from tqdm import tqdm
        if self.bar is None and self.file.isatty():
            self.bar = tqdm(total=self.total, initial=self.n, desc=self.desc, file=self.file, leave=False, unit="step")
        if self.bar is not None:
            self.bar.update(self.n - self.bar.n)
        elif now - self.last >= self.every_s or self.last == self.start:
            self.last = now
            print(tqdm.format_meter(self.n, self.total, now - self.start, prefix=self.desc, ascii=True, unit="step"),
                  file=self.file, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def with_progress(items, total, desc, after_s=5.0, *, on=True, file=None):
    """The items of `items`, each as it comes, counted by a Progress of `total` steps once the loop's body has run,
    the bar closed when the loop ends: after its last item, at a break or on an error."""
    bar = Progress(total, desc, after_s, file, on=on)
    try:
        for item in items:
            yield item
            bar.update()
    finally:
        bar.close()


class Heartbeat:
    """A phase's progress on stderr, once it turns out long: after `after_s` seconds a line `what: 3 s so far`, another
    every `every_s`, and at the end `what: done in 152 s`; nothing at all for a phase shorter than after_s (or with
    on=False). A thread of its own, so it speaks while the phase blocks (torch.compile, a decomposition)."""
    after_s, every_s = 5.0, 30.0

    def __init__(self, what, *, on=True, file=None):
        self.what, self.on, self.file = what, on, file or sys.stderr
        self.spoke, self.done = False, None

    def __enter__(self):
        import threading
        self.start, self.done = time.perf_counter(), threading.Event()
        if self.on:
            threading.Thread(target=self.beat, daemon=True).start()
        return self

    def beat(self):
        wait = self.after_s
        while not self.done.wait(wait):
            self.spoke = True
            print(f"{self.what}: {time.perf_counter() - self.start:.0f} s so far", file=self.file, flush=True)
            wait = self.every_s

    def __exit__(self, *exc):
        self.done.set()
        if self.spoke and exc[0] is None:
            print(f"{self.what}: done in {time.perf_counter() - self.start:.0f} s", file=self.file, flush=True)


class Table:
    """Prints one row per call as soon as it arrives, header first, right-aligned columns at least `width` wide (the
    space before it included; widths[c] for column c): a number keeps to its column (fit()), a text too long widens
    it from that row, so neighbours never run together."""

    def __init__(self, columns, width=10, file=None, formats=None, widths=None):
        self.columns = list(columns)
        self.widths = {c: max((widths or {}).get(c, width), len(c) + 1) for c in self.columns}
        self.file = file or sys.stdout
        self.formats = formats or {}
        self.rows = []

    def _fmt(self, key, value):
        if value is None:           # not measured in this row (an epoch not evaluated)
            value = "-"
        elif isinstance(value, float):
            value = fit(value, self.widths[key] - 1, self.formats.get(key, ".4f"))
        self.widths[key] = max(self.widths[key], len(str(value)) + 1)
        return str(value).rjust(self.widths[key])

    def append(self, row):
        if not self.rows:       # [1:]: the first column needs no space before it
            print("".join(c.rjust(self.widths[c]) for c in self.columns)[1:], file=self.file, flush=True)
        self.rows.append(dict(row))
        print("".join(self._fmt(c, row.get(c, "")) for c in self.columns)[1:], file=self.file, flush=True)


def fit(value, width, spec=".4f"):
    """value as `spec` formats it (a fixed-point spec with fewer decimals where needed) in at most width characters,
    showing a digit other than 0 of a value not 0; else in scientific notation, with as many digits as fit."""
    decimals = int(spec[1:-1]) if spec.startswith(".") and spec.endswith("f") else None
    for spec in [f".{d}f" for d in range(decimals, -1, -1)] if decimals is not None else [spec]:
        text = format(value, spec)
        if len(text) <= width and (value == 0 or not math.isfinite(value) or float(text) != 0):
            return text
    for digits in range(max(width - 6, 0), 0, -1):
        text = f"{value:.{digits}e}"
        if len(text) <= width:
            return text
    return f"{value:.0e}"


def close_progress():
    """Closes every progress bar left open (by a Ctrl-C inside an epoch), so that the next line starts on a line of
    its own."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()


def summarize(values):
    """n, mean, sample std (ddof=1), min and max of a list of numbers (None entries are dropped)."""
    xs = [float(x) for x in values if x is not None]
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "min": min(xs), "max": max(xs)}


def one_sided_p(values, target):
    """One-sample, one-sided t-test of the mean against target: the probability of a sample mean at
    least this high if the true mean were exactly target. Small p: the true mean exceeds target.
    None for fewer than two values or none different from the others (no t statistic)."""
    s = summarize(values)
    if s["n"] < 2 or s["std"] == 0:
        return None
    from scipy.stats import ttest_1samp     # here: scipy.stats takes a second to import, which only summaries need
    return float(ttest_1samp([float(x) for x in values if x is not None], target, alternative="greater").pvalue)


def one_sided_welch_p(values, others):
    """Welch's two-sample, one-sided t-test: the probability of mean(values) - mean(others) at least this large if
    the two true means were equal. None where either side has fewer than two values or both have no spread."""
    xs, ys = ([float(v) for v in vs if v is not None] for vs in (values, others))
    if len(xs) < 2 or len(ys) < 2 or summarize(xs)["std"] == summarize(ys)["std"] == 0:
        return None
    from scipy.stats import ttest_ind
    return float(ttest_ind(xs, ys, equal_var=False, alternative="greater").pvalue)


def detectable_gap(std, n, *, alpha=0.05, power=0.8):
    """The smallest gap between a true mean and the target that one_sided_p of n runs of this std finds (p < alpha)
    with probability `power`: d = nc·std/√n, where P(T'(n - 1, nc) > t(1 - alpha, n - 1)) = power, T' noncentral t.
    None for fewer than two runs or no spread."""
    if n < 2 or not std:
        return None
    from scipy.optimize import brentq
    from scipy.stats import nct, t
    critical = t.ppf(1 - alpha, n - 1)
    nc = brentq(lambda nc: nct.sf(critical, n - 1, nc) - power, 0.0, 100.0)
    return nc * std / math.sqrt(n)


def fmt_stats(name, s, scale=1.0, unit=""):
    """One line of summarize()'s statistics: name: mean, std, min, max (n)."""
    if not s["n"]:
        return f"{name}: none"
    return (f"{name}: mean {s['mean'] * scale:.4f}{unit}  std {s['std'] * scale:.4f}{unit}  "
            f"min {s['min'] * scale:.4f}{unit}  max {s['max'] * scale:.4f}{unit}  (n={s['n']})")


def summarize_runs(runs, target, keys, accuracy):
    """The summary of several runs' results: summarize() of each of `keys`, the one-sided t-test of the mean of
    `accuracy` against target, and the fraction of the runs that reached target (a time_to_target)."""
    s = {k: summarize([r[k] for r in runs]) for k in keys}
    s["p_mean_above_target"] = one_sided_p([r[accuracy] for r in runs], target)
    s["fraction_reaching_target"] = sum(r["time_to_target"] is not None for r in runs) / len(runs)
    return s


def print_summary(name, s, target, labels):
    """Prints a summarize_runs() summary: a line for each key of labels ({key: (name, unit)}, the accuracy
    first: the t-test follows it), the fraction reaching target, and the FLOPs if the summary has them."""
    lines = [fmt_stats(label, s[k], unit=unit) for k, (label, unit) in labels.items()]
    if s["p_mean_above_target"] is not None:
        lines.insert(1, f"one-sided t-test, mean accuracy > {target:.2%}: p = {s['p_mean_above_target']:.3g}")
    print(f"\nsummary over {s[next(iter(labels))]['n']} runs of {name}")
    print("\n".join(lines))
    print(f"runs reaching {target:.2%}: {s['fraction_reaching_target']:.0%}")
    if "flops_per_run" in s:
        print(f"FLOPs per run {s['flops_per_run'] / 1e12:.3f} T; achieved {s['tflops_per_s']:.2f} TFLOP/s")


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (`error: argument --tta: ...`, say_error's) and exit status 2; a flag
    given an empty value (`--device ""`, an unset shell variable) is refused, never read as its default."""

    def _get_value(self, action, arg_string):
        # argparse's one place where each given string becomes a value; a typed flag (a recipe's list, where an empty
        # word is an empty list) reads "" its own way
        if arg_string == "" and action.option_strings and action.type in (None, str, Path):
            self.error(f"{action.option_strings[-1]} '': empty; give a value"
                       + (", or leave the flag out for its default" if action.default is not None else ""))
        return super()._get_value(action, arg_string)

    def error(self, message):
        say_error(message)
        self.exit(2)


def say_error(error, *, each_node=False):
    """Prints a usage or data error's one line, `error: ...`: under torchrun once in the job, by the first process to
    meet it (first_to_say; each_node: once on each node, for what each node reads of its own, its data), at the
    workers' first start only; else on rank 0. Every process then exits with the same status (2, or 1 for data)
    unless torchrun stops it first; a restart torchrun was asked for meets the same error and says nothing; torchrun
    returns 1, its status whenever a worker fails (its report lists each worker's)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        say = torchrun_attempt() == 0 and first_to_say(f"error/{os.environ['GROUP_RANK'] if each_node else 'all'}")
    else:           # one process, or another launcher's ranks: rank 0 (each_node: each node's first)
        say = os.environ.get("LOCAL_RANK" if each_node else "RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    if say:
        print(f"error: {error}", file=sys.stderr, flush=True)


def torchrun_attempt():
    """How many times torchrun has restarted this job's workers (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def first_to_say(what):
    """Whether this process is the first of its torchrun job's attempt to count `what`, in the store at MASTER_ADDR:
    MASTER_PORT (torchrun's agent's, which outlives its workers and serves them before their process group exists);
    True too where that store cannot be reached within seconds (its machine gone), so that a line is said at least
    once. Imports torch, which torchrun's workers have."""
    import datetime
    from torch.distributed import DistError, TCPStore
    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=5))
        key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{torchrun_attempt()}/{what}"
        return store.add(key, 1) == 1
    except (KeyError, ValueError, RuntimeError, DistError):
        return True


def exit_now(status):
    """Ends this process at once with `status`, its output flushed and nothing more run: after Ctrl-C, whose line is
    printed and whose files are written, Python's finalisation of torch.compile's state holds the exit for seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def torchvision_mismatch():
    """One line when the installed torchvision was built for another torch than the installed one (it then fails on
    import, "operator torchvision::nms does not exist"), from the packages' metadata alone (the torch it requires);
    None when they match, or when either is missing."""
    import re
    from importlib import metadata
    try:
        torch_version, vision_version = metadata.version("torch"), metadata.version("torchvision")
        wanted = [re.sub(r"[\s()]", "", r)[len("torch"):] for r in metadata.requires("torchvision") or ()
                  if re.fullmatch(r"torch\s*\(?\s*[=<>!~].*", r)]
    except metadata.PackageNotFoundError:
        return None
    given = lambda v: tuple(int(n) for n in re.findall(r"\d+", v.split("+")[0])[:3])
    release = lambda v: given(v) + (0,) * (3 - len(given(v)))          # 2.5 is 2.5.0
    have = release(torch_version)
    broken = {"==": lambda v: have[:len(given(v))] != given(v), ">=": lambda v: have < release(v),     # ==2.11.* too
              "<=": lambda v: have > release(v), ">": lambda v: have <= release(v), "<": lambda v: have >= release(v)}
    requirement = ",".join(wanted)
    for condition in requirement.split(",") if wanted else ():
        op = next((op for op in broken if condition.startswith(op)), None)
        if op and broken[op](condition[len(op):]):
            return (f"torchvision {vision_version} requires torch{requirement}, but torch {torch_version} is "
                    "installed: the two do not work together (importing torchvision fails); install a matching pair: "
                    "pip uninstall -y torchvision && pip install -r requirements.txt")
    return None


class DataError(Exception):
    """Bad or missing data: the message names the file and what is wrong."""


class UsageError(ValueError):
    """A bad flag or argument: the message names it, says what is wrong and what is allowed (exit status 2)."""


def die_with_parent(parent, ignore_interrupt=False):
    """In a child process: end when the process `parent` ends, even by SIGKILL (Linux's PR_SET_PDEATHSIG; elsewhere a
    thread that watches its pid); its pid is read by the parent, since the child's parent may by then be another.
    ignore_interrupt: Ctrl-C and SIGTERM (sent to a process group by `timeout` and SLURM) are the parent's to handle."""
    if ignore_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)        # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:            # the parent ended before the line above took effect
        os._exit(1)


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


def ratio_ci(a, b, level=0.95):
    """mean(a) / mean(b) with a `level` confidence interval, from the standard error of the log of the
    ratio (delta method: var ≈ s_a²/(n_a m_a²) + s_b²/(n_b m_b²)) and Welch's degrees of freedom.
    None when either sample has fewer than 2 values or a mean is not positive."""
    from scipy import stats
    sa, sb = summarize(a), summarize(b)
    if sa["n"] < 2 or sb["n"] < 2 or sa["mean"] <= 0 or sb["mean"] <= 0:
        return None
    va, vb = (s["std"] ** 2 / (s["n"] * s["mean"] ** 2) for s in (sa, sb))
    ratio = sa["mean"] / sb["mean"]
    if va + vb == 0:
        return {"ratio": ratio, "low": ratio, "high": ratio, "level": level}
    df = (va + vb) ** 2 / (va ** 2 / (sa["n"] - 1) + vb ** 2 / (sb["n"] - 1))
    half = float(stats.t.ppf((1 + level) / 2, df)) * math.sqrt(va + vb)
    return {"ratio": ratio, "low": ratio * math.exp(-half), "high": ratio * math.exp(half), "level": level}


CODE_VERSION_FILE = "code-version.json"     # beside this file, in a copy of the tree that has no .git (a GPU machine)


def code_version(root=os.path.dirname(os.path.abspath(__file__))):
    """{"commit", "dirty"} of the code at root: git's HEAD and whether tracked files differ from it; in a copy without
    .git, the CODE_VERSION_FILE written where it was copied from; {"commit": None, ...} where neither tells."""
    import subprocess
    git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(root, CODE_VERSION_FILE)) as f:
            return {**json.load(f), "from": CODE_VERSION_FILE}
    except (OSError, ValueError):
        return {"commit": None, "dirty": None, "why": "neither a git checkout nor a " + CODE_VERSION_FILE}
