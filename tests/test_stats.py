"""The report's intervals against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from crl_train.run.stats import (
    Interval,
    clustered_wilson,
    design_effect,
    mean_t,
    newcombe_difference,
    paired_difference,
    ratio_of_means,
    wilson,
)

Z = 1.959963984540054  # the 97.5 % normal quantile


def _wilson_by_hand(k: float, n: float) -> tuple[float, float]:
    """The score formula; ``k`` and ``n`` may be fractional (an effective number of trials)."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return centre - half, centre + half


@pytest.mark.parametrize(("k", "n"), [(8, 10), (0, 10), (10, 10), (3, 16), (1, 1)])
def test_wilson_matches_the_score_formula(k: int, n: int) -> None:
    iv = wilson(k, n)
    low, high = _wilson_by_hand(k, n)
    assert iv.value == pytest.approx(k / n)
    assert iv.low == pytest.approx(max(0.0, low), abs=1e-9) and iv.high == pytest.approx(min(1.0, high), abs=1e-9)
    assert 0.0 <= iv.low <= iv.value <= iv.high <= 1.0  # type: ignore[operator]


def test_wilson_8_of_10_by_hand() -> None:
    # centre = (0.8 + 1.92073/10) / (1 + 3.84146/10) = 0.71674; half = 1.95996·√(0.016 + 0.0096037)/1.38415 = 0.22658
    assert wilson(8, 10).rounded() == (0.8, 0.4902, 0.9433)
    assert wilson(0, 0).value is None
    with pytest.raises(ValueError, match="successes"):
        wilson(11, 10)


def test_t_interval_by_hand() -> None:
    # [1, 2, 3, 4]: mean 2.5, s = 1.29099, se = 0.645497, t(0.975, 3) = 3.182446 → ±2.054260
    assert mean_t([1.0, 2.0, 3.0, 4.0]).rounded() == (2.5, 0.4457, 4.5543)
    assert mean_t([]).value is None
    one = mean_t([3.0])
    assert (one.value, one.low, one.high) == (3.0, None, None)  # one seed: no interval


def test_paired_difference_is_the_t_interval_of_the_differences() -> None:
    # a − b = [0.1, 0.2, 0.3]: mean 0.2, s = 0.1, se = 0.057735, t(0.975, 2) = 4.302653 → ±0.248414
    iv = paired_difference([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    assert iv.rounded() == (0.2, -0.0484, 0.4484) and iv.method == "paired t"
    with pytest.raises(ValueError, match="pair"):
        paired_difference([0.1], [0.1, 0.2])


def test_ratio_of_means_bootstrap() -> None:
    constant = ratio_of_means([0.5, 0.5], [1.0, 1.0])
    assert constant.rounded() == (0.5, 0.5, 0.5)
    assert ratio_of_means([1.0], [0.0]).value is None  # undefined: nothing succeeded with experience
    one_task = ratio_of_means([1.0], [0.5, 1.0])  # a mode with a single held-out task: no resampling
    assert (one_task.value, one_task.low, one_task.high) == (pytest.approx(1 / 0.75), None, None)
    iv = ratio_of_means([1, 1, 0, 1, 1, 0, 1, 1], [1, 0, 0, 1, 1, 1, 1, 1])
    assert iv.value == pytest.approx(1.0)  # 6/8 over 6/8
    assert iv.low is not None and iv.high is not None and iv.low < 1.0 < iv.high
    assert ratio_of_means([1, 1, 0, 1, 1, 0, 1, 1], [1, 0, 0, 1, 1, 1, 1, 1]) == iv  # seeded: reproducible


def test_design_effect_by_hand() -> None:
    assert design_effect([[1, 1], [0, 0]]) == 2.0  # all-or-nothing tasks: ρ = 1, m = 2
    assert design_effect([[1, 0], [1, 0]]) == 1.0  # ρ = (0 − 0.5) / (0 + 0.5) = −1, clipped to 0
    assert design_effect([[1], [0], [1]]) == 1.0  # one episode a task
    assert design_effect([[1, 1], [1, 1]]) == 2.0  # no variance at all: only the tasks count
    assert design_effect([[1, 0, 1]]) == 3.0  # one task: it is the only unit
    # p_i = 0.75, 0, 1; p = 7/12; SSB = 4·(1/36 + 49/144 + 25/144) = 2.1667, MSB = 1.0833;
    # SSW = 4·0.75·0.25 = 0.75, MSW = 0.75/9 = 0.08333; m0 = (12 − 48/12)/2 = 4;
    # ρ = (1.0833 − 0.08333) / (1.0833 + 3·0.08333) = 0.75 → 1 + 3·0.75 = 3.25
    assert design_effect([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]) == pytest.approx(3.25)


def test_clustered_wilson_is_wilson_at_the_effective_n() -> None:
    # where the effective n is whole it is scipy's Wilson on the tasks' worth of counts
    assert clustered_wilson([[1, 1], [0, 0]]).rounded() == wilson(1, 2).rounded()
    assert clustered_wilson([[1, 0], [1, 0]]).rounded() == wilson(2, 4).rounded()
    assert clustered_wilson([[1, 1], [1, 1]]).rounded() == wilson(2, 2).rounded()
    # fractional n: 7/12 at n = 12 / 3.25 = 3.6923, the score formula by hand
    iv = clustered_wilson([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    low, high = _wilson_by_hand(7 / 3.25, 12 / 3.25)
    assert (iv.value, iv.n) == (pytest.approx(7 / 12), 12)
    assert iv.low == pytest.approx(low) and iv.high == pytest.approx(high)
    # the same 7 of 12 as independent episodes gives a narrower interval
    assert iv.high - iv.low > wilson(7, 12).high - wilson(7, 12).low  # type: ignore[operator]
    assert clustered_wilson([]).value is None
    with pytest.raises(ValueError, match="0 or 1"):
        clustered_wilson([[0.5]])


def test_newcombe_difference_by_hand() -> None:
    # d = 0.5 − 0.2; low = 0.3 − √(0.2² + 0.2²) = 0.01716; high = 0.3 + √(0.2² + 0.1²) = 0.52361
    a, b = Interval(0.5, 0.3, 0.7, 20, "wilson"), Interval(0.2, 0.1, 0.4, 20, "wilson")
    assert newcombe_difference(a, b).rounded() == (0.3, 0.0172, 0.5236)
    # swapped, the interval is mirrored
    assert newcombe_difference(b, a).rounded() == (-0.3, -0.5236, -0.0172)
    assert newcombe_difference(a, Interval(None, None, None, 0, "wilson")).value is None
