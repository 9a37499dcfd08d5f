"""What a run prints as it goes: an epoch's steps (Progress, with_progress), a long phase's heartbeat (Heartbeat), the
bars a Ctrl-C left open closed (close_progress), tables printed a row at a time (Table, with fit for a number's
column), and a run's record of its epochs: their clock and rows (EpochClock) and the table both scripts print of them
(epoch_table). Nothing here imports torch at import time.
"""
import io
import math
import sys
import time


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


def close_progress():
    """Closes every progress bar left open (by a Ctrl-C inside an epoch), so that the next line starts on a line of
    its own."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()


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


def epoch_table(columns, file=None, *, on=True, title=None):
    """The per-epoch table both scripts print (progress.Table; with on false, nowhere), under its title (printed at
    once) where there is one: accuracies and losses to 4 decimals, times to 2, each column as wide as its name or its
    numbers, under 100 characters for either script's columns."""
    file = file if on else io.StringIO()
    if title:
        print(title, file=file or sys.stdout, flush=True)
    return Table(columns, width=7, file=file, formats={"epoch_time": ".2f", "total_time": ".2f"},
                 widths={"epoch": 6, "res": 4, "batch": 6, "lr": 8, "decode": 11})


class EpochClock:
    """A run's clock (`timer`: devices.timer, started once the network is built) and its table's rows, epoch by epoch
    (each printed to `table` where given), with o.target and o.eval_every: stop() ends an epoch's training on the
    clock, evaluated() its evaluation off it (the last one's time is the run's final_eval_time), rows_read() reads the
    clock where the host waits anyway, resume() leaves what the host did with the rows off the clock. Nothing waits
    for the device before a read."""

    def __init__(self, timer, o, *, columns, accuracy, reads_every_epoch=False, table=None):
        self.clock, self.columns, self.eval_every, self.table = timer, columns, o.eval_every, table
        self.accuracy, self.target, self.reads_every_epoch = accuracy, o.target, reads_every_epoch
        self.rows, self.time_to_target, self.final_eval_time = [], None, 0.0
        self.pending, self.host_has_read = [], False

    def continue_from(self, progress):
        """A resumed run's rows, training time and time to target (as a checkpoint's progress records them)."""
        self.rows, self.clock.total, self.time_to_target = (progress[k] for k in ("rows", "train_time",
                                                                                   "time_to_target"))

    def stop(self, sums, seen, **columns):
        """The epoch's training ends on the clock (a mark, not waited for): its columns, and its summed loss and
        correct predictions (a tensor [loss, correct] on the device, read later) over `seen` images."""
        self.pending.append({**columns, "sums": sums, "seen": seen, "mark": self.clock.mark()})

    def evaluates(self, epoch, *, last):
        """Whether epoch (from 0) ends with an evaluation: the last, and every eval_every-th (0: the last alone)."""
        return last or bool(self.eval_every and (epoch + 1) % self.eval_every == 0)

    def evaluated(self, **metrics):
        """The epoch's evaluation ends, its columns `metrics`: its time off the clock."""
        self.pending[-1].update(metrics, eval_mark=self.clock.mark(include=False))

    def rows_read(self):
        """The rows of the epochs stopped since the last reading (added to self.rows), their times and sums read in
        one wait and one copy; none while the clock reads later (devices.EventTimer) and no evaluation has waited
        for the device, unless it reads every epoch."""
        if not self.pending or not (self.reads_every_epoch or "eval_mark" in self.pending[-1]
                                    or not self.clock.reads_later):
            return []
        import torch        # here: progress.py imports no torch until a run reads its clock
        readings, sums = self.clock.read(), torch.stack([p["sums"] for p in self.pending]).tolist()
        rows = []
        for p, (loss, correct) in zip(self.pending, sums):
            row = {**p, "train_loss": loss / p["seen"], "train_acc": correct / p["seen"],
                   "epoch_time": readings[p["mark"]][0], "total_time": readings[p["mark"]][1]}
            rows.append({c: row.get(c) for c in self.columns})
            if "eval_mark" in p:
                self.final_eval_time = readings[p["eval_mark"]][0]
                if self.time_to_target is None and row[self.accuracy] >= self.target:
                    self.time_to_target = row["total_time"]
        self.rows += rows
        if self.table:
            for row in rows:
                self.table.append(row)
        self.pending, self.host_has_read = [], True
        return rows

    def resume(self):
        """The clock runs on, the host's reading and printing since rows_read off it (nothing when none were read)."""
        if self.host_has_read:
            self.clock.mark(include=False)
            self.host_has_read = False

    @property
    def train_time(self):
        return self.clock.total

    def times(self):
        """{"train_time", "final_eval_time", "time" (the two together), "time_to_target"} of the run so far."""
        return {"train_time": self.clock.total, "final_eval_time": self.final_eval_time,
                "time": self.clock.total + self.final_eval_time, "time_to_target": self.time_to_target}
