"""Binomial confidence bounds the harness seals: the Wilson score interval (Wilson 1927).

Pure float64 arithmetic on whole counts (``statistics.NormalDist`` for the normal quantile,
``math.sqrt``, both correctly rounded or fixed-order), so a bound derived from the same counts is
the same float on every machine, and a sealed bound can be re-derived and compared exactly.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal


def _checked_counts(successes: int, trials: int) -> None:
    for name, value in (("successes", successes), ("trials", trials)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}: found {type(value).__name__}, expected a whole count")
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"counts: found {successes} of {trials}, expected 0 <= successes <= trials and trials >= 1")


def normal_quantile(confidence: float, sides: Literal[1, 2]) -> float:
    """z such that a ``sides``-sided normal interval at ``confidence`` ends at z (1.959963984540054
    for two-sided 95 %, 1.6448536269514722 for one-sided 95 %)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: found {confidence!r}, expected a number in (0, 1)")
    tail = (1.0 - confidence) / sides
    return NormalDist().inv_cdf(1.0 - tail)


def wilson_interval(successes: int, trials: int, *, confidence: float = 0.95,
                    sides: Literal[1, 2] = 2) -> tuple[float, float]:
    """(lower, upper) Wilson score bounds on the rate ``successes / trials``: a two-sided interval at
    ``confidence`` (``sides=2``), or each end as a one-sided bound at ``confidence`` (``sides=1``)."""
    _checked_counts(successes, trials)
    z = normal_quantile(confidence, sides)
    rate = successes / trials
    z2 = z * z
    denominator = 1.0 + z2 / trials
    centre = (rate + z2 / (2.0 * trials)) / denominator
    half_width = z * math.sqrt(rate * (1.0 - rate) / trials + z2 / (4.0 * trials * trials)) / denominator
    return max(0.0, centre - half_width), min(1.0, centre + half_width)
