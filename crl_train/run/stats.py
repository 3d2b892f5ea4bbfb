"""Confidence intervals for evaluations and experiment reports (scipy.stats does the statistics).

* success rates: the **Wilson** score interval (``scipy.stats.binomtest(...).proportion_ci``),
  which stays inside [0, 1] and behaves at 0/n and n/n, unlike the normal approximation;
* success rates over episodes that share tasks (an evaluation plays each held-out task a group of
  times): the Wilson interval at the **effective** number of episodes, n / design effect
  (Kish), with the intra-task correlation from a one-way ANOVA. Episodes of one task mostly agree,
  so 8 tasks × 8 episodes can carry little more than 8 episodes' worth of evidence;
* means (actions per episode, final success over seeds): the **Student t** interval;
* paired differences (a method minus ``grpo`` over the same seeds): the t interval of the
  per-seed differences;
* a difference of two independent success rates (with − without experience in one run):
  **Newcombe's** hybrid score interval, built from the two rates' Wilson bounds;
* ratios of two means (internalisation = success without experience / with): a **percentile
  bootstrap** (``scipy.stats.bootstrap``, seeded, so a report is reproducible).

>>> wilson(8, 10).rounded()
(0.8, 0.4902, 0.9433)
>>> mean_t([1.0, 2.0, 3.0, 4.0]).rounded()
(2.5, 0.4457, 4.5543)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

LEVEL = 0.95
"""Confidence level of every interval in this project's reports."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with its interval (None where it is undefined, e.g. a mean of nothing)."""

    value: float | None
    low: float | None
    high: float | None
    n: int
    method: str

    def rounded(self, digits: int = 4) -> tuple[float | None, float | None, float | None]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, digits)

        return r(self.value), r(self.low), r(self.high)

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {
            "value": self.value,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "method": self.method,
        }

    def text(self, digits: int = 3) -> str:
        """``0.625 [0.306, 0.863]`` (or ``n/a``)."""
        if self.value is None:
            return "n/a"
        if self.low is None or self.high is None:
            return f"{self.value:.{digits}f}"
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def wilson(successes: int, n: int, level: float = LEVEL) -> Interval:
    """Wilson score interval of a success rate ``successes / n``."""
    if n <= 0:
        return Interval(None, None, None, 0, "wilson")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson: successes must be in [0, n={n}], got {successes}")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(
        confidence_level=level, method="wilson"
    )
    return Interval(successes / n, float(ci.low), float(ci.high), n, "wilson")


def _wilson_score(p: float, n: float, level: float) -> tuple[float, float]:
    """The Wilson score bounds of a rate ``p`` measured on ``n`` (possibly fractional) trials."""
    z = float(stats.norm.ppf(0.5 + level / 2.0))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def design_effect(outcomes_by_task: Sequence[Sequence[float]]) -> float:
    """Kish's design effect 1 + (m̄ − 1)·ρ of episodes grouped by task (m̄: mean episodes a task).

    ρ, the intra-task correlation, is the one-way ANOVA estimate (MSB − MSW) / (MSB + (m₀ − 1)·MSW),
    clipped to [0, 1]. Where it cannot be estimated (one task, or every episode alike) it is taken
    as 1: the tasks are then the only independent units.

    >>> design_effect([[1, 1], [0, 0]])  # each task all-or-nothing: ρ = 1, two tasks' worth
    2.0
    >>> design_effect([[1, 0], [1, 0]])  # tasks alike: ρ < 0 → 0, every episode counts
    1.0
    """
    groups = [np.asarray(g, dtype=np.float64) for g in outcomes_by_task if len(g)]
    k = len(groups)
    sizes = np.array([g.size for g in groups], dtype=np.float64)
    n = float(sizes.sum())
    if k == 0:
        return 1.0
    m_bar = n / k
    if m_bar == 1.0:
        return 1.0
    mean = float(np.concatenate(groups).mean())
    ss_between = float(sum(g.size * (g.mean() - mean) ** 2 for g in groups))
    ss_within = float(sum(((g - g.mean()) ** 2).sum() for g in groups))
    if k == 1 or ss_between + ss_within == 0.0:
        rho = 1.0
    else:
        ms_between = ss_between / (k - 1)
        ms_within = ss_within / (n - k)
        m0 = (n - float((sizes**2).sum()) / n) / (k - 1)
        rho = min(1.0, max(0.0, (ms_between - ms_within) / (ms_between + (m0 - 1.0) * ms_within)))
    return 1.0 + (m_bar - 1.0) * rho


def clustered_wilson(outcomes_by_task: Sequence[Sequence[float]], level: float = LEVEL) -> Interval:
    """Success rate of 0/1 outcomes grouped by task, Wilson interval at n / ``design_effect``.

    One episode a task gives plain ``wilson``; ``n`` is the number of episodes.
    """
    flat = [float(x) for g in outcomes_by_task for x in g]
    if not flat:
        return Interval(None, None, None, 0, "wilson, design effect")
    if any(x not in (0.0, 1.0) for x in flat):
        raise ValueError("clustered_wilson: outcomes must be 0 or 1")
    p = sum(flat) / len(flat)
    low, high = _wilson_score(p, len(flat) / design_effect(outcomes_by_task), level)
    return Interval(p, low, high, len(flat), "wilson, design effect")


def newcombe_difference(a: Interval, b: Interval) -> Interval:
    """``a − b`` of two independent rates, from their (Wilson) intervals (Newcombe 1998, method 10):
    low = d − √((a − a_low)² + (b_high − b)²), high = d + √((a_high − a)² + (b − b_low)²).

    >>> newcombe_difference(Interval(0.5, 0.3, 0.7, 20, "wilson"),
    ...                     Interval(0.2, 0.1, 0.4, 20, "wilson")).rounded()
    (0.3, 0.0172, 0.5236)
    """
    if None in (a.value, a.low, a.high, b.value, b.low, b.high):
        return Interval(None, None, None, min(a.n, b.n), "newcombe")
    av, al, ah, bv, bl, bh = (float(x) for x in (a.value, a.low, a.high, b.value, b.low, b.high))  # type: ignore[arg-type]
    d = av - bv
    low = d - float(np.hypot(av - al, bh - bv))
    high = d + float(np.hypot(ah - av, bv - bl))
    return Interval(d, max(-1.0, low), min(1.0, high), min(a.n, b.n), "newcombe")


def mean_t(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Student t interval of a mean; one value gives the value without an interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(None, None, None, 0, "t")
    mean = float(x.mean())
    if x.size == 1 or float(x.std()) == 0.0:
        return Interval(
            mean, mean if x.size > 1 else None, mean if x.size > 1 else None, int(x.size), "t"
        )
    low, high = stats.t.interval(level, x.size - 1, loc=mean, scale=stats.sem(x))
    return Interval(mean, float(low), float(high), int(x.size), "t")


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of ``a[i] − b[i]`` (the same seeds) with its t interval."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} values against {len(b)}: pair them by seed")
    interval = mean_t([x - y for x, y in zip(a, b, strict=True)], level)
    return Interval(interval.value, interval.low, interval.high, interval.n, "paired t")


def ratio_of_means(
    numerator: Sequence[float],
    denominator: Sequence[float],
    level: float = LEVEL,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """mean(numerator) / mean(denominator) of two independent samples, percentile
    bootstrap interval.

    Undefined (None) when the denominator's mean is 0; resamples whose denominator is 0 are left
    out. A sample of one value gives the ratio without an interval.
    """
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    n = int(min(num.size, den.size))
    if num.size == 0 or den.size == 0 or float(den.mean()) == 0.0:
        return Interval(None, None, None, n, "bootstrap")
    value = float(num.mean() / den.mean())
    if num.size < 2 or den.size < 2:  # one task in a mode: nothing to resample
        return Interval(value, None, None, n, "bootstrap")
    if np.all(num == num[0]) and np.all(den == den[0]):
        return Interval(value, value, value, n, "bootstrap")

    def ratio(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        d = y.mean(axis=axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(d > 0, x.mean(axis=axis) / np.where(d > 0, d, 1.0), np.nan)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap(
            (num, den),
            ratio,
            vectorized=True,
            paired=False,
            confidence_level=level,
            n_resamples=n_resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    # the percentiles of the resampled ratios that are defined (scipy's own would be NaN as soon
    # as one resample drew a zero denominator)
    dist = res.bootstrap_distribution
    dist = dist[np.isfinite(dist)]
    if dist.size == 0:
        return Interval(value, None, None, n, "bootstrap")
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(dist, [alpha, 1.0 - alpha])
    return Interval(value, float(low), float(high), n, "bootstrap")
