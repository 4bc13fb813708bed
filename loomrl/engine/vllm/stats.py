"""vLLM's per-step stats read into loomrl's EngineMetrics, for the in-process adapter (engine/vllm/engine.py): the
queue's time integral (queue_s) and, with speculation, the draft tokens verified and accepted.

What it is: a factory of vLLM stat loggers (AsyncLLM's stat_loggers). vLLM calls record() on the adapter's loop with
each step's SchedulerStats; the depth it reports holds until the next one. What it is not: the busy clock (vLLM's stats
give no forward-pass time: engine/adapter.py counts the wall time with a request in flight) or vLLM's own loggers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from loomrl.engine.base import EngineMetrics


def queue_logger(metrics: EngineMetrics, lock: threading.Lock) -> Callable[..., Any]:
    """A stat-logger class adding to `metrics` (under `lock`): queue_s, and draft_tokens / accepted_tokens where
    `metrics` counts them (speculation on)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _QueueLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.at, self.depth = time.monotonic(), 0

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            now = time.monotonic()
            with lock:
                metrics.add_queue(self.depth * (now - self.at))
            self.at = now
            if scheduler_stats is None:
                return
            # waiting, and waiting but held back (blocked, deferred)
            self.depth = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None and metrics.draft_tokens is not None:
                with lock:
                    metrics.draft_tokens += spec.num_draft_tokens
                    metrics.accepted_tokens = (metrics.accepted_tokens or 0) + spec.num_accepted_tokens

        def log_engine_initialized(self) -> None:
            pass

    return _QueueLogger
