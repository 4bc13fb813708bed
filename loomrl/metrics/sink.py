"""MetricSink: where a run's metric records go (metrics.jsonl, TensorBoard, Prometheus, W&B), and the naming rule
they share.

A record is a step, a kind (`train`, `eval_before`, `eval_after`, `rollback`) and its values. The values are numbers
except a few strings (a rollback's `reason`): metrics.jsonl keeps them all, the other sinks only the finite numbers
(`numeric`). A sink is opened by its own module from its config; the fan-out (logger.py) calls it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

Value = float | int | str
Values = Mapping[str, Value]


class SinkError(RuntimeError):
    """A sink cannot start; the message names its config field (`metrics.wandb`) and what to do."""


class MetricSink(Protocol):
    name: str  # how errors name it: `metrics.wandb`

    def log(self, step: int, kind: str, metrics: Values) -> None:
        """Record one step's values of one kind."""

    def close(self) -> None:
        """Flush and release what the sink holds; called once, at the end of the run."""


def metric_name(key: str, kind: str) -> str:
    """A value's name in the dashboards: its own namespace (`train/loss`, `eval/success`), or, without one, its
    record's kind (`groups` of a train record: `train/groups`). So held-out success before and after training is one
    curve, `eval/success`, at step 0 and the last step."""
    return key if "/" in key else f"{kind}/{key}"


def numeric(kind: str, metrics: Values) -> dict[str, float]:
    """The finite numbers of a record by their dashboard names (bools, strings, NaN and inf left out)."""
    return {metric_name(k, kind): float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
