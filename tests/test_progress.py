"""What a run prints as it goes (progress.py): tables a row at a time, an epoch's progress bar."""
import io

import pytest

import progress
from progress import Progress, Table


def test_table_prints_header_once_and_each_row_as_it_arrives():
    out = io.StringIO()
    t = Table(["epoch", "acc"], width=6, file=out, formats={"acc": ".2f"})
    t.append({"epoch": 1, "acc": 0.5})
    assert out.getvalue().splitlines() == ["epoch   acc", "    1  0.50"]
    t.append({"epoch": 2, "acc": 0.75})
    assert out.getvalue().splitlines()[-1] == "    2  0.75"
    assert len(t.rows) == 2


def test_a_table_keeps_a_number_to_its_column_and_widens_it_for_a_long_text():
    out = io.StringIO()
    t = Table(["epoch", "loss", "time"], width=8, file=out, formats={"loss": ".4f"})
    t.append({"epoch": 1, "loss": 123456.7, "time": "3 s"})
    t.append({"epoch": 2, "loss": 1.5, "time": "a long time"})
    assert out.getvalue().splitlines() == ["  epoch    loss    time", "      1  123457     3 s",
                                           "      2  1.5000 a long time"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_tqdms_bar_and_a_short_epoch_shows_nothing():
    term = Terminal()
    bar = Progress(4, "epoch 1", after_s=0.0, file=term)
    for _ in range(3):
        bar.update()
    drawn = term.getvalue()
    assert drawn.startswith("\repoch 1:  25%|##5       | 1/4 ") and bar.bar.n == 3     # tqdm redraws at its pace
    bar.close()
    assert term.getvalue()[len(drawn):].replace(" ", "") == "\r\r"      # the bar's line cleared: nothing left
    quiet = Terminal()
    short = Progress(4, "epoch 1", after_s=1e9, file=quiet)
    for _ in range(4):
        short.update()
    short.close()
    assert short.bar is None and quiet.getvalue() == ""


def test_with_progress_counts_each_step_once_its_body_ran_and_closes_the_bar_at_a_break_or_an_error(monkeypatch):
    events = []

    class Recorded:
        def __init__(self, total, desc, after_s, file, *, on):
            events.append(("open", total, desc, on))

        def update(self):
            events.append("update")

        def close(self):
            events.append("close")
    monkeypatch.setattr(progress, "Progress", Recorded)
    for step in progress.with_progress(range(10), 10, "epoch 1"):
        events.append(step)
        if step == 2:
            break
    assert events == [("open", 10, "epoch 1", True), 0, "update", 1, "update", 2, "close"]   # step 2 unfinished
    events.clear()
    with pytest.raises(KeyboardInterrupt):
        for step in progress.with_progress(range(3), 3, "epoch 2", on=False):
            raise KeyboardInterrupt
    assert events == [("open", 3, "epoch 2", False), "close"]
