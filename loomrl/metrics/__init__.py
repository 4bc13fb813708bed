"""Metric sinks: metrics.jsonl and TensorBoard event files in the run folder."""

from loomrl.metrics.logger import MetricsLogger

__all__ = ["MetricsLogger"]
