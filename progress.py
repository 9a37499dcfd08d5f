"""What a run prints as it goes: an epoch's steps (Progress, with_progress), a long phase's heartbeat (Heartbeat), the
bars a Ctrl-C left open closed (close_progress), and tables printed a row at a time (Table, with fit for a number's
column). Nothing here imports torch.
"""
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
