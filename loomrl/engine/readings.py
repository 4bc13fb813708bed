"""Engine readings: an engine's counters at one moment, and a step's engine metrics from the changes between two.

An engine's counters (base.py EngineMetrics) only grow, so a reading can be taken in any process (the local backend's,
an engine actor's, a rollout actor's) and sent anywhere; a step's values are the changes between two readings of the
same engine, which is what lets the Ray backend pool several engines. Each reading carries `up_s`, the seconds since
its engine started by that engine's own clock, so rates are over each engine's own interval and need no clock shared
between machines.
What it is not: a collector (the backends decide when to read: runtime/local.py, runtime/ray_backend.py), or a
measurement (the engines measure: engine/builtin/scheduler.py, engine/vllm/engine.py).
"""

from __future__ import annotations

import dataclasses
import time

from loomrl.engine.base import EngineMetrics

Reading = dict[str, float | None]  # EngineMetrics' counters (None: not measured by that engine) and up_s


def read_engine(metrics: EngineMetrics) -> Reading:
    """The counters now, with up_s. Taken in the engine's process (its clock is the one `started` is of)."""
    out: Reading = dataclasses.asdict(metrics)
    del out["started"]
    out["up_s"] = time.monotonic() - metrics.started
    return out


def counter_changes(last: Reading | None, now: Reading) -> Reading:
    """Each counter's change from `last` to `now` (None where the engine does not measure it). An engine that was
    restarted since (its up_s went back) counts from 0 again: its whole reading is the change."""
    if last is None or (now["up_s"] or 0.0) < (last["up_s"] or 0.0):
        last = {}
    return {k: None if v is None else v - (last.get(k) or 0) for k, v in now.items()}


def engine_step_metrics(changes: list[Reading]) -> dict[str, float]:
    """A step's engine metrics from each engine's counter changes (counter_changes) since the last step: every counter
    summed over the engines (engine/<counter>), and the pool's rates, each from the engines that measure what it needs
    and left out where none does (never a made-up 0):
    - engine/busy_frac: the share of the step's wall time the engines computed (busy_s over up_s, pooled);
    - engine/queue_depth: requests waiting for admission to a running batch, the step's time-weighted mean, summed
      over the engines (queue_s over up_s, each engine's);
    - engine/prefix_hit_rate: the share of the step's prompt tokens served from a prefix cache;
    - engine/acceptance: the share of draft tokens accepted (speculation; left out of a step that drafted none);
    - engine/tokens_per_seq_step: tokens a decoding sequence emitted per engine step (1 without speculation)."""
    out: dict[str, float] = {}
    if not changes:
        return out
    for name in changes[0]:
        if name in ("up_s", "reused_tokens"):  # reused_tokens: as prefix_hit_rate
            continue
        values = [v for c in changes if (v := c.get(name)) is not None]
        if values:
            out[f"engine/{name}"] = sum(values)
    timed = [(c, up) for c in changes if (up := c["up_s"] or 0.0) > 0]
    busy = [(b, up) for c, up in timed if (b := c.get("busy_s")) is not None]
    if busy:
        # capped: an engine that adds busy time when a request ends (vLLM over HTTP) can credit a step with time that
        # began in the step before
        out["engine/busy_frac"] = min(1.0, sum(b for b, _ in busy) / sum(u for _, u in busy))
    queue = [q / up for c, up in timed if (q := c.get("queue_s")) is not None]
    if queue:
        out["engine/queue_depth"] = sum(queue)
    drafted = [d for c in changes if (d := c.get("draft_tokens")) is not None]
    if drafted and sum(drafted):
        out["engine/acceptance"] = sum(c.get("accepted_tokens") or 0 for c in changes) / sum(drafted)
    seq_steps = sum(c.get("decode_seq_steps") or 0 for c in changes)
    if seq_steps:
        out["engine/tokens_per_seq_step"] = sum(c.get("decode_seq_tokens") or 0 for c in changes) / seq_steps
    prompt = sum(c.get("prompt_tokens") or 0 for c in changes)
    reused = [r for c in changes if (r := c.get("reused_tokens")) is not None]
    if prompt and reused:
        out["engine/prefix_hit_rate"] = sum(reused) / prompt
    return out


class EngineDelta:
    """One engine's step metrics since the last call, read in this process (the local backend's engine)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self.last = read_engine(metrics)

    def take(self) -> dict[str, float]:
        now = read_engine(self.metrics)
        changes, self.last = counter_changes(self.last, now), now
        return engine_step_metrics([changes])
