"""Shared helpers for benchmarks: machine description, result printing, and the checks that keep a printed figure
honest (a ratio against its analytic bound, a division by a measured figure)."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
from typing import Any


def machine() -> str:
    cpus = os.cpu_count()
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    return f"{platform.machine()} {cpus} cpus, torch threads {threads}, python {platform.python_version()}"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def report(result: dict[str, Any], as_json: bool) -> None:
    """Human-readable lines, then (with --json) one JSON object as the last line."""
    for key, value in result.items():
        if key in ("arms", "details"):
            continue
        print(f"{key}: {value}")
    if "details" in result:
        for line in result["details"]:
            print(line)
    if as_json:
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


# A measured ratio may exceed its analytic bound by this share from timing noise alone (a shared 2-core machine, medians
# of a few runs); beyond it the bound, or the measurement, is wrong and the benchmark must not print an efficiency.
BOUND_TOLERANCE = 0.10
# --quick runs each benchmark at the smallest size that exercises its code path: a few requests, one repeat, timings of
# a second or less. On a shared machine those are noise (measured at load 14 on 2 cores: tree_training's low_sharing
# ratio 4.7 against its bound 1.78, prefix_cache's multiturn 1.33x its bound), so --quick does not check a timed ratio
# against its bound; it still refuses every division by an unmeasured figure (a zero hit rate, a zero time), and counts
# and simulations (judge_cost, window_sampler) keep the strict check. Its figures are a smoke test, never a result.
QUICK_BOUND_TOLERANCE = math.inf
QUICK_NOTE = "quick mode: smoke-test sizes, figures not results (a timed ratio is not checked against its bound)"


def bound_tolerance(quick: bool) -> float:
    """The tolerance `efficiency` allows a timed ratio: none checked in --quick mode (QUICK_BOUND_TOLERANCE), else
    BOUND_TOLERANCE."""
    return QUICK_BOUND_TOLERANCE if quick else BOUND_TOLERANCE


def divide(numerator: float, denominator: float, what: str) -> float:
    """numerator / denominator; exits with one line naming `what` when either is non-finite or the divisor is 0 (a
    figure that was not measured must not turn into an infinite or zero ratio)."""
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator == 0:
        raise SystemExit(f"benchmark error: {what}: cannot divide {numerator!r} by {denominator!r}")
    return numerator / denominator


def efficiency(ratio: float, bound: float, what: str, tolerance: float = BOUND_TOLERANCE) -> float:
    """ratio / bound, after checking both are finite and positive and that the bound holds: a ratio above its bound by
    more than `tolerance` (a share of the bound) exits with one line, since then the bound was measured wrong."""
    if not (math.isfinite(ratio) and math.isfinite(bound)) or bound <= 0 or ratio <= 0:
        raise SystemExit(f"benchmark error: {what}: ratio {ratio!r} and bound {bound!r} must be finite and positive")
    if ratio > bound * (1 + tolerance):
        raise SystemExit(f"benchmark error: {what}: measured ratio {ratio:.3f} is above its bound {bound:.3f} by more "
                         f"than the {tolerance:.0%} allowed for noise: the bound is wrong")
    return ratio / bound
