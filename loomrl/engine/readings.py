"""Engine readings: an engine's counters at one moment, and a step's engine metrics from the changes between two.

An engine's counters (base.py EngineMetrics) only grow, so a reading can be taken in any process (the local backend's,
an engine actor's, a rollout actor's) and sent anywhere; a step's values are the changes between two readings of the
same engine, which is what lets the Ray backend pool several engines. Each reading carries `up_s`, the seconds since
its engine started by that engine's own clock, so rates are over each engine's own interval and need no clock shared
between machines.
An engine that keeps counters beyond EngineMetrics (the built-in engine's program table and K/V pool, a router's
placements) says so by subclassing KeepsCounters; its reading (reading_of, EngineDelta.of) carries them too, and each
becomes a step metric engine/<name> of its own. An engine without them adds no such key (never a made-up 0).
What it is not: a collector (the backends decide when to read: runtime/local.py, runtime/ray_backend.py), or a
measurement (the engines measure: engine/builtin/scheduler.py, engine/vllm/engine.py).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from loomrl.engine.base import Engine, EngineMetrics

Reading = dict[str, float | None]  # EngineMetrics' counters (None: not measured by that engine), more counters, up_s
PEAK = "peak:"  # a Reading's key prefix for a maximum since the start (Counters.peaks): not a counter to difference


@dataclass(slots=True, kw_only=True)
class Counters:
    """Counters an engine keeps beyond EngineMetrics, since it started, by step metric name (engine/<name>)."""

    counts: dict[str, float] = field(default_factory=dict)  # only grow: a step reports the change, summed over engines
    peaks: dict[str, float] = field(default_factory=dict)  # maxima since the start: a step reports the largest
    # the counts of a part several engines share (the router's instances' one K/V pool), by id(part): counted once
    shared: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, other: Counters) -> None:
        """Another engine's counters into these (a router over its instances): counts summed, peaks maxed."""
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        for k, v in other.peaks.items():
            self.peaks[k] = max(self.peaks.get(k, v), v)
        self.shared.update(other.shared)

    def flat(self) -> dict[str, float]:
        """The Reading's keys: counts with each shared part's added once, peaks under PEAK."""
        out = dict(self.counts)
        for part in self.shared.values():
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        out.update({PEAK + k: v for k, v in self.peaks.items()})
        return out


class KeepsCounters(ABC):
    """An engine with counters beyond EngineMetrics (engine/builtin/engine.py, engine/router.py)."""

    @abstractmethod
    def counters(self) -> Counters:
        """Its counters now; callable from any thread of its process."""


def read_engine(metrics: EngineMetrics, counters: Counters | None = None) -> Reading:
    """The counters now (and `counters`, an engine's KeepsCounters), with up_s. Taken in the engine's process (its
    clock is the one `started` is of)."""
    out: Reading = dataclasses.asdict(metrics)
    del out["started"]
    if counters is not None:
        out.update(counters.flat())
    out["up_s"] = time.monotonic() - metrics.started
    return out


def counters_of(engine: Engine) -> Callable[[], Counters] | None:
    """The engine's KeepsCounters.counters, or None for an engine that keeps none."""
    return engine.counters if isinstance(engine, KeepsCounters) else None


def reading_of(engine: Engine) -> Reading:
    """read_engine of the engine's metrics and of the counters it keeps beyond them."""
    more = counters_of(engine)
    return read_engine(engine.metrics, more() if more is not None else None)


def counter_changes(last: Reading | None, now: Reading) -> Reading:
    """Each counter's change from `last` to `now` (None where the engine does not measure it); a peak (PEAK) is kept as
    it is. An engine that was restarted since (its up_s went back) counts from 0 again: its whole reading is the
    change."""
    if last is None or (now["up_s"] or 0.0) < (last["up_s"] or 0.0):
        last = {}
    return {k: v if v is None or k.startswith(PEAK) else v - (last.get(k) or 0) for k, v in now.items()}


def engine_step_metrics(changes: list[Reading]) -> dict[str, float]:
    """A step's engine metrics from each engine's counter changes (counter_changes) since the last step: every counter
    summed over the engines (engine/<counter>), and the pool's rates, each from the engines that measure what it needs
    and left out where none does (never a made-up 0):
    - engine/busy_frac: the share of the step's wall time the engines computed (busy_s over up_s, pooled);
    - engine/queue_depth: requests waiting for admission to a running batch, the step's time-weighted mean, summed
      over the engines (queue_s over up_s, each engine's);
    - engine/prefix_hit_rate: the share of the step's prompt tokens served from a prefix cache;
    - engine/acceptance: the share of draft tokens accepted (speculation; left out of a step that drafted none);
    - engine/tokens_per_seq_step: tokens a decoding sequence emitted per engine step (1 without speculation).
    An engine's further counters (KeepsCounters) are summed as engine/<name> over the engines that keep them; a peak
    (the longest wait since the start) is the largest over them."""
    out: dict[str, float] = {}
    if not changes:
        return out
    names = dict.fromkeys(k for c in changes for k in c)  # a union: engines of several kinds keep different ones
    for name in names:
        if name in ("up_s", "reused_tokens"):  # reused_tokens: as prefix_hit_rate
            continue
        values = [v for c in changes if (v := c.get(name)) is not None]
        if values and name.startswith(PEAK):
            out[f"engine/{name.removeprefix(PEAK)}"] = max(values)
        elif values:
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

    def __init__(self, metrics: EngineMetrics, counters: Callable[[], Counters] | None = None):
        self.metrics, self.counters = metrics, counters
        self.last = self._read()

    @classmethod
    def of(cls, engine: Engine) -> EngineDelta:
        """The engine's metrics and the counters it keeps beyond them (KeepsCounters)."""
        return cls(engine.metrics, counters_of(engine))

    def _read(self) -> Reading:
        return read_engine(self.metrics, self.counters() if self.counters is not None else None)

    def take(self) -> dict[str, float]:
        now = self._read()
        changes, self.last = counter_changes(self.last, now), now
        return engine_step_metrics([changes])
