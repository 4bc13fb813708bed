"""The statistics of a comparison: each arm's mean and standard error over its seeds, the paired difference of each
arm from the baseline (seed by seed) with its t interval, and the decision against the margin.

Decision, for an arm against the baseline with interval [low, high] of their mean paired difference (higher is
better: a success rate):
- equivalent: the whole interval within (-margin, +margin) (two one-sided tests, each at half the interval's alpha:
  conservative, where the textbook TOST uses a 1 - 2 alpha interval);
- better / worse: the interval above / below 0 and not within the margin;
- undecided: anything else; more seeds would be needed, which the plan decides in advance (plan.py).
Paired by seed, an arm and the baseline share tasks and sampling noise (common random numbers: seeds.py), so the
spread of their differences is what decides, not the spread between runs. A success rate over n tasks moves in steps
of 1/n, and common random numbers often make every difference the same step: a sample spread of 0 would give a
certain decision from two seeds, so the spread is taken as at least the metric's resolution (`resolution`, 1/n).

What it is not: the plan (plan.py) or the runs (runner.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats

EQUIVALENT, BETTER, WORSE, UNDECIDED = "equivalent", "better", "worse", "undecided"


@dataclass(frozen=True)
class ArmSummary:
    name: str
    n: int
    mean: float
    stderr: float


@dataclass(frozen=True)
class Difference:
    """An arm's mean paired difference from the baseline, its standard error and interval, and the decision."""

    arm: str
    baseline: str
    n: int
    mean: float
    stderr: float
    low: float
    high: float
    confidence: float
    decision: str


def _stderr(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def summarize(name: str, values: list[float]) -> ArmSummary:
    return ArmSummary(name=name, n=len(values), mean=sum(values) / len(values) if values else math.nan,
                      stderr=_stderr(values))


def decide(low: float, high: float, margin: float) -> str:
    if -margin < low and high < margin:
        return EQUIVALENT
    if low > 0:
        return BETTER
    if high < 0:
        return WORSE
    return UNDECIDED


def difference(arm: str, baseline: str, values: list[float], base_values: list[float], *, confidence: float,
               margin: float, resolution: float = 0.0) -> Difference:
    """`values[i]` and `base_values[i]` come from the same seed; `resolution`: the smallest step the metric moves in
    (1/n for a success rate over n tasks), the least spread of a difference."""
    if len(values) != len(base_values):
        raise ValueError(f"paired values of unequal length: {len(values)} and {len(base_values)}")
    diffs = [a - b for a, b in zip(values, base_values)]
    n = len(diffs)
    mean, se = sum(diffs) / n, max(_stderr(diffs), resolution / math.sqrt(n))
    if n < 2:
        return Difference(arm, baseline, n, mean, se, -math.inf, math.inf, confidence, UNDECIDED)
    half = float(stats.t.ppf(1 - (1 - confidence) / 2, n - 1)) * se
    return Difference(arm, baseline, n, mean, se, mean - half, mean + half, confidence,
                      decide(mean - half, mean + half, margin))


def seeds_needed(sd: float, effect: float, *, confidence: float = 0.95, power: float = 0.8) -> int:
    """Seeds a paired design needs so that a true difference `effect` puts its interval above 0 with probability
    `power`, when single differences spread with standard deviation `sd` (the t test's power, from the noncentral t;
    at least 2)."""
    if sd <= 0:
        return 2
    for n in range(2, 100_000):
        crit = stats.t.ppf(1 - (1 - confidence) / 2, n - 1)
        if 1 - stats.nct.cdf(crit, n - 1, effect / (sd / math.sqrt(n))) >= power:
            return n
    return 100_000
