"""Metric sinks: metrics.jsonl always; TensorBoard, Prometheus and W&B as the `metrics:` section says."""

from loomrl.metrics.logger import MetricsLogger, open_metrics, read_metrics

__all__ = ["MetricsLogger", "open_metrics", "read_metrics"]
