"""The bias measure of benchmark B9 (benchmarks/window_sampler.py batch_bias)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from window_sampler import batch_bias  # noqa: E402


def test_batch_bias():
    b = batch_bias([1, 0, 0, 0], [1, 0, 1, 0, 0, 1, 0, 0, 0, 0])
    assert b.batch_mean == 0.25 and b.population_mean == 0.3
    assert b.difference == pytest.approx(-0.05) and b.ratio == pytest.approx(0.25 / 0.3)
    assert (b.n_batch, b.n_population) == (4, 10)
    assert batch_bias([True, False], [True, False]).ratio == 1.0
    assert batch_bias([0, 0], [0]).ratio == 1.0
    assert batch_bias([1], [0]).ratio == math.inf
    assert batch_bias([3.0, 1.0], [2.0]).difference == 0.0  # a numeric attribute: means
    with pytest.raises(ValueError, match="non-empty"):
        batch_bias([], [1])
    with pytest.raises(ValueError, match="non-empty"):
        batch_bias([1], [])
