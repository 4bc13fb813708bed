"""MetricsLogger: the fan-out that sends each metric record to every sink a run has (`open_metrics`).

Sinks (sink.MetricSink): metrics.jsonl always (jsonl.py: the run's own record, read by `read_metrics`), and as
`metrics:` says (loomrl/config/metrics.py) TensorBoard (on by default), Prometheus and W&B. A sink that cannot start stops the run
before it trains (SinkError: what the recipe asked for is not there). One that fails while the run goes on (W&B
raises, a disk fills) is warned about once; the run and the other sinks go on, and it is tried again with the next
record, so that one bad moment does not cost it the rest of the run. Its failures are counted and said at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loomrl.config.metrics import MetricsConfig
from loomrl.metrics.jsonl import JsonlSink, read_metrics
from loomrl.metrics.sink import MetricSink, Values

log = logging.getLogger("loomrl")

__all__ = ["MetricsLogger", "open_metrics", "read_metrics"]


class MetricsLogger:
    def __init__(self, sinks: Sequence[MetricSink]):
        self.sinks = list(sinks)
        self.failures: dict[str, int] = {}  # sink name -> calls that raised

    def log(self, step: int, values: Values, kind: str = "train") -> None:
        for sink in self.sinks:
            self._guarded(sink, lambda s: s.log(step, kind, values))

    def rollback(self, step: int, reason: str) -> None:
        """The run continues from the checkpoint of `step`: train records of later steps logged so far
        were undone (read_metrics drops them)."""
        self.log(step, {"reason": reason}, kind="rollback")

    def close(self) -> None:
        for sink in self.sinks:
            self._guarded(sink, lambda s: s.close())
        for name, n in self.failures.items():
            log.warning("metrics: %s failed %d time(s) in this run; its records are incomplete (metrics.jsonl "
                        "has them all)", name, n)

    def _guarded(self, sink: MetricSink, call: Callable[[MetricSink], None]) -> None:
        try:
            call(sink)
        except Exception:  # noqa: BLE001 - a dashboard's failure is not the run's
            n = self.failures[sink.name] = self.failures.get(sink.name, 0) + 1
            if n == 1:
                log.warning("metrics: %s failed; the run and the other sinks go on (further failures are "
                            "counted, not shown)", sink.name, exc_info=True)


def open_metrics(run_dir: Path, config: MetricsConfig, *, run_name: str = "run",
                 run_config: Mapping[str, Any] | None = None) -> MetricsLogger:
    """The sinks `config` asks for, opened (SinkError if one cannot start: those opened so far are closed)."""
    sinks: list[MetricSink] = []
    try:
        sinks.append(JsonlSink(run_dir))
        if config.tensorboard:
            from loomrl.metrics.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(run_dir))
        if config.prometheus is not None:
            from loomrl.metrics.prometheus import PrometheusSink

            sinks.append(PrometheusSink(config.prometheus, run_name))
        if config.wandb is not None and config.wandb.mode != "disabled":  # disabled: wandb need not be installed
            from loomrl.metrics.wandb import WandbSink

            sinks.append(WandbSink(config.wandb, run_dir, run_name, run_config or {}))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return MetricsLogger(sinks)
