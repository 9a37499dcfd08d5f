"""The statistics of several runs (run_statistics.py), each against a closed form, a known quantile or a simulation."""
import math

import numpy as np
import pytest

from run_statistics import detectable_gap, one_sided_p, one_sided_welch_p, ratio_ci, summarize


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
