import io
import json
import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
import core
from core import (Table, Timer, detectable_gap, one_sided_p, one_sided_welch_p, ratio_ci, summarize, write_atomic,
                  write_json)


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


def test_summarize():
    s = summarize([0.93, 0.94, 0.95, None])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.94)
    assert s["std"] == pytest.approx(0.01) and s["min"] == 0.93 and s["max"] == 0.95
    assert summarize([])["mean"] is None
    assert summarize([2.0])["std"] == 0.0


def with_t(t, n):
    """n evenly spaced values whose one-sample t statistic against 0 is t."""
    sd = math.sqrt(sum((i - (n - 1) / 2) ** 2 for i in range(n)) / (n - 1))
    return [i - (n - 1) / 2 + t * sd / math.sqrt(n) for i in range(n)]


def test_one_sided_t_test_against_known_quantiles():
    assert one_sided_p(with_t(2.015048, 6), 0) == pytest.approx(0.05, abs=1e-6)      # t_{0.95, 5}
    assert one_sided_p(with_t(2.228139, 11), 0) == pytest.approx(0.025, abs=1e-6)    # t_{0.975, 10}
    assert one_sided_p(with_t(-2.015048, 6), 0) == pytest.approx(0.95, abs=1e-6)     # the other side
    # five runs with mean 0.9412 and sample std 0.00079: t = 0.0012 / (0.00079 / sqrt 5) = 3.394, 4 d.o.f.
    accs = [0.9402, 0.9407, 0.9412, 0.9417, 0.9422]
    assert one_sided_p(accs, 0.94) == pytest.approx(0.01371, abs=1e-5)
    assert one_sided_p(accs + [None], 0.94) == one_sided_p(accs, 0.94)               # missing runs are dropped
    assert one_sided_p(accs, 0.94) < 0.05 < one_sided_p(accs, 0.9411)
    assert one_sided_p([0.94], 0.94) is None and one_sided_p([0.94, 0.94], 0.9) is None


def test_welchs_two_sample_test_against_its_closed_form_at_two_degrees_of_freedom():
    # means 2 and 0, each variance of the mean 1: t = 2 / sqrt(2), Welch's d.o.f. (1 + 1)² / (1 + 1) = 2,
    # and at 2 d.o.f. P(T > x) = 1/2 - x / (2 sqrt(x² + 2))
    assert one_sided_welch_p([1, 3], [-1, 1]) == pytest.approx(0.5 - math.sqrt(2) / 4, abs=1e-12)
    a, b = [0.9386, 0.9393, 0.9425, 0.9420, 0.9411], [0.9394, 0.9386, 0.9389, 0.9390]
    assert one_sided_welch_p(a, b) + one_sided_welch_p(b, a) == pytest.approx(1)      # the two directions
    assert one_sided_welch_p(a + [None], b) == one_sided_welch_p(a, b)
    assert one_sided_welch_p([0.94], b) is None and one_sided_welch_p([0.94, 0.94], [0.93, 0.93]) is None


@pytest.mark.parametrize("n", [3, 8, 13])
def test_the_detectable_gap_is_found_four_times_in_five_by_simulated_runs(n):
    from scipy.stats import ttest_1samp
    std = 0.0012
    gap = detectable_gap(std, n)
    draws = np.random.default_rng(n).normal(0.94 - gap, std, size=(20000, n))
    found = ttest_1samp(draws, 0.94, axis=1, alternative="less").pvalue < 0.05
    assert found.mean() == pytest.approx(0.8, abs=0.01)        # binomial sd 0.0028
    half = ttest_1samp(draws + gap / 2, 0.94, axis=1, alternative="less").pvalue < 0.05
    assert half.mean() < 0.5                                     # half the gap is missed more often than found
    assert detectable_gap(std, n, power=0.5) < gap < detectable_gap(std, n, power=0.9)
    assert detectable_gap(2 * std, n) == pytest.approx(2 * gap)
    assert detectable_gap(std, 1) is None and detectable_gap(0.0, n) is None


def test_timer_excludes_what_it_is_told_to():
    calls = []
    t = Timer(lambda: calls.append(1))
    a = t()
    b = t(include=False)
    assert t.total == pytest.approx(a)
    assert len(calls) == 3 and b >= 0


def test_write_json_is_atomic_on_failure(tmp_path):
    p = tmp_path / "r.json"
    write_json(p, {"a": 1})
    written = json.loads(p.read_text())
    assert written["a"] == 1 and set(written) == {"a", "code"}

    def broken(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        write_atomic(p, broken)
    assert json.loads(p.read_text()) == written         # old file untouched
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]   # no temporary left


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_permissions_open_gives(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == mode


def test_ratio_ci_covers_the_true_ratio_95_percent_of_the_time():
    import numpy as np
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(1000):
        a, b = rng.normal(3.0, 0.1, 25), rng.normal(4.0, 0.2, 10)      # true ratio 0.75
        r = ratio_ci(a, b)
        assert r["low"] < r["ratio"] < r["high"]
        hits += r["low"] <= 0.75 <= r["high"]
    assert 0.93 <= hits / 1000 <= 0.97
    assert ratio_ci([1.0], [1.0, 2.0]) is None
    assert ratio_ci([2.0, 2.0], [1.0, 1.0]) == {"ratio": 2.0, "low": 2.0, "high": 2.0, "level": 0.95}


def test_the_framework_free_files_import_no_torch():
    code = "import sys, core, scaling, schedules, imagenet_store; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"


def test_a_recipe_once_built_cannot_change_and_every_setting_has_a_flag_of_its_own():
    import dataclasses
    import cifar10_fast as cf
    import imagenet_fast as inf
    import settings
    r = cf.recipe("fast94")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.epochs = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.whitening.eps = 1.0
    for script in (cf, inf):
        names = [leaf.name for leaf in settings.leaves(script.Recipe)]
        assert len(names) == len(set(names))                  # one flag, one setting
        for name in script.RECIPES:
            settings.check(script.recipe(name))


def test_a_recipe_is_checked_whole_when_made_and_its_changes_are_made_together():
    import dataclasses
    import cifar10_fast as cf
    import training
    from core import UsageError
    with pytest.raises(UsageError, match=r"^--whiten-eps -1: must not be negative$"):
        dataclasses.replace(cf.FAST94, whitening=dataclasses.replace(cf.FAST94.whitening, eps=-1.0))
    with pytest.raises(UsageError, match=r"^--ema-momentum and --lookahead-momentum: one weight average at a time"):
        dataclasses.replace(cf.MYRTLE10, lookahead=training.LookaheadSettings())
    # each change alone would make a recipe refused: two rates for three knots, two weight averages
    assert cf.recipe("myrtle24", lr_knots=(0, 1), lr_values=(0.4, 0.0)).lr.values == (0.4, 0.0)
    r = cf.recipe("fast94", ema_momentum=0.99, lookahead_momentum=0)
    assert r.ema.momentum == 0.99 and r.lookahead is None


def test_no_function_is_longer_than_80_lines_and_none_but_a_constructor_takes_more_than_8_parameters():
    """The recipe reads top to bottom when every function can be read at once."""
    import ast
    big = []
    for path in sorted(ROOT.glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                length = node.end_lineno - min([d.lineno for d in node.decorator_list] + [node.lineno]) + 1
                if length > 80 or (len(params) > 8 and node.name != "__init__"):
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines, "
                               f"{len(params)} parameters)")
    assert big == []


def test_no_public_function_takes_more_than_four_positional_parameters():
    """Beyond the first few, arguments are keyword-only, so that one in the wrong place cannot pass silently."""
    import ast
    crowded = []
    for path in sorted(ROOT.glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > 4:
                    crowded.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert crowded == []


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_tqdms_bar_and_a_short_epoch_shows_nothing():
    from core import Progress
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
    import core
    events = []

    class Recorded:
        def __init__(self, total, desc, after_s, file, *, on):
            events.append(("open", total, desc, on))

        def update(self):
            events.append("update")

        def close(self):
            events.append("close")
    monkeypatch.setattr(core, "Progress", Recorded)
    for step in core.with_progress(range(10), 10, "epoch 1"):
        events.append(step)
        if step == 2:
            break
    assert events == [("open", 10, "epoch 1", True), 0, "update", 1, "update", 2, "close"]   # step 2 unfinished
    events.clear()
    with pytest.raises(KeyboardInterrupt):
        for step in core.with_progress(range(3), 3, "epoch 2", on=False):
            raise KeyboardInterrupt
    assert events == [("open", 3, "epoch 2", False), "close"]


def test_a_result_records_the_commit_and_whether_the_tree_differs_from_it(tmp_path):
    import subprocess
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert core.code_version(str(tmp_path)) == {"commit": head, "dirty": False}
    (tmp_path / "new.txt").write_text("untracked files leave the tree clean\n")
    assert core.code_version(str(tmp_path))["dirty"] is False
    (tmp_path / "f.py").write_text("a = 2\n")
    assert core.code_version(str(tmp_path)) == {"commit": head, "dirty": True}


def test_a_copied_tree_without_git_reads_the_version_written_where_it_was_copied_from(tmp_path):
    assert core.code_version(str(tmp_path))["commit"] is None
    (tmp_path / core.CODE_VERSION_FILE).write_text(json.dumps({"commit": "abc", "dirty": True}))
    assert core.code_version(str(tmp_path)) == {"commit": "abc", "dirty": True, "from": core.CODE_VERSION_FILE}
    write_json(tmp_path / "r.json", {"a": 1})
    assert json.loads((tmp_path / "r.json").read_text())["code"]["commit"] == core.code_version()["commit"]
