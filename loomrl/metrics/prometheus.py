"""Prometheus (metrics.prometheus): the latest value of each metric as a gauge, served at http://HOST:PORT/metrics for
a Prometheus server to scrape while the run trains.

Gauge names are the metric names made Prometheus-legal under `loomrl_` (`train/loss`: `loomrl_train_loss`), labelled
with the run's name; `loomrl_step{kind=...}` is the step of each kind's latest record. Only the latest values are
served (Prometheus samples them as it scrapes); the history is metrics.jsonl's. The endpoint is the run's own, on
its own registry: an inference server's /metrics (server/app.py) is another process's.
"""

from __future__ import annotations

import logging
import re
import threading

from loomrl.config.metrics import PrometheusConfig
from loomrl.metrics.sink import SinkError, Values, numeric

log = logging.getLogger("loomrl")


def gauge_name(metric: str) -> str:
    """`train/loss` -> `loomrl_train_loss` (Prometheus names: letters, digits, underscores)."""
    return "loomrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class PrometheusSink:
    name = "metrics.prometheus"

    def __init__(self, config: PrometheusConfig, run_name: str):
        from prometheus_client import CollectorRegistry, start_http_server

        self.run_name = run_name
        self._lock = threading.Lock()  # the HTTP thread reads what the driver writes
        self._values: dict[str, float] = {}  # gauge name -> latest value
        self._steps: dict[str, int] = {}  # kind -> step of its latest record
        registry = CollectorRegistry()
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(config.port, config.host, registry=registry)
        except OSError as err:
            raise SinkError(f"metrics.prometheus: cannot serve on {config.host}:{config.port} ({err}); set "
                          "metrics.prometheus.port to a free port (0: any free one)") from None
        self.port = self._server.server_port
        log.info("metrics served for Prometheus at http://%s:%d/metrics", config.host, self.port)

    def log(self, step: int, kind: str, metrics: Values) -> None:
        values = {gauge_name(k): v for k, v in numeric(kind, metrics).items()}
        with self._lock:
            self._values.update(values)
            self._steps[kind] = step

    def collect(self):
        """prometheus_client's Collector interface: the gauges as they are now."""
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            values, steps = dict(self._values), dict(self._steps)
        step = GaugeMetricFamily("loomrl_step", "Step of the latest record of each kind", labels=["run", "kind"])
        for kind, value in steps.items():
            step.add_metric([self.run_name, kind], value)
        yield step
        for name, value in sorted(values.items()):
            gauge = GaugeMetricFamily(name, "loomrl metric (latest value)", labels=["run"])
            gauge.add_metric([self.run_name], value)
            yield gauge

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
