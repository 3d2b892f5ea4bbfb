"""Confidence intervals for evaluations and experiment reports (scipy.stats does the statistics).

* success rates: the **Wilson** score interval (``scipy.stats.binomtest(...).proportion_ci``),
  which stays inside [0, 1] and behaves at 0/n and n/n, unlike the normal approximation;
* means (actions per episode, final success over seeds): the **Student t** interval;
* paired differences (a method minus ``grpo`` over the same seeds): the t interval of the
  per-seed differences;
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
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n, "method": self.method}

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
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return Interval(successes / n, float(ci.low), float(ci.high), n, "wilson")


def mean_t(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Student t interval of a mean; one value gives the value without an interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(None, None, None, 0, "t")
    mean = float(x.mean())
    if x.size == 1 or float(x.std()) == 0.0:
        return Interval(mean, mean if x.size > 1 else None, mean if x.size > 1 else None, int(x.size), "t")
    low, high = stats.t.interval(level, x.size - 1, loc=mean, scale=stats.sem(x))
    return Interval(mean, float(low), float(high), int(x.size), "t")


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of ``a[i] − b[i]`` (the same seeds) with its t interval."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} values against {len(b)}: pair them by seed")
    interval = mean_t([x - y for x, y in zip(a, b, strict=True)], level)
    return Interval(interval.value, interval.low, interval.high, interval.n, "paired t")


def ratio_of_means(numerator: Sequence[float], denominator: Sequence[float], level: float = LEVEL, *,
                   n_resamples: int = 2000, seed: int = 0) -> Interval:
    """mean(numerator) / mean(denominator) of two independent samples, percentile bootstrap interval.

    Undefined (None) when the denominator's mean is 0; resamples whose denominator is 0 are left out.
    """
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    n = int(min(num.size, den.size))
    if num.size == 0 or den.size == 0 or float(den.mean()) == 0.0:
        return Interval(None, None, None, n, "bootstrap")
    value = float(num.mean() / den.mean())
    if np.all(num == num[0]) and np.all(den == den[0]):
        return Interval(value, value, value, n, "bootstrap")

    def ratio(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        d = y.mean(axis=axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(d > 0, x.mean(axis=axis) / np.where(d > 0, d, 1.0), np.nan)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap((num, den), ratio, vectorized=True, paired=False, confidence_level=level,
                              n_resamples=n_resamples, method="percentile", rng=np.random.default_rng(seed))
    # the percentiles of the resampled ratios that are defined (scipy's own would be NaN as soon as one
    # resample drew a zero denominator)
    dist = res.bootstrap_distribution
    dist = dist[np.isfinite(dist)]
    if dist.size == 0:
        return Interval(value, None, None, n, "bootstrap")
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(dist, [alpha, 1.0 - alpha])
    return Interval(value, float(low), float(high), n, "bootstrap")
