"""The statistics of several runs: summarize's n, mean and spread; one-sided t-tests against a target (one_sided_p)
and between two samples (one_sided_welch_p); the gap a test of n runs finds (detectable_gap); a ratio of means with
its confidence interval (ratio_ci); and a summary's lines (summarize_runs, print_summary). scipy is imported where a
test needs it; nothing here imports torch.
"""
import math


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
