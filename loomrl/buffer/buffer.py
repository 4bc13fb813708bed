"""Buffer: scored GRPO groups waiting to be trained, taken by a sampler, with bounded staleness.

Staleness of a group at consumption = trainer version - the oldest policy version of any token in
it. Groups staler than `max_policy_lag` are dropped when taken and counted (never silently).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from loomrl.buffer.samplers import make_sampler
from loomrl.types import Trajectory


def group_min_version(group: list[Trajectory]) -> int:
    return min((t.metadata.policy_version_min for t in group if t.metadata.policy_version_min >= 0), default=-1)


class Buffer:
    """Finished groups waiting to be trained; which ones a step takes is the sampler's choice
    (loomrl/buffer/samplers.py: fifo, oldest_first, freshest_first, window). A group's submission
    index is its position in the run's data order (positions are launched in increasing order)."""

    def __init__(self, max_policy_lag: int, sampler: str = "fifo", window: int | float | None = None):
        self.max_policy_lag = max_policy_lag
        self._make = lambda: make_sampler(sampler, window)
        self._sampler = self._make()
        self._last_submitted = -1
        self._arrived: dict[int, float] = {}  # when each waiting group arrived (backpressure metrics)
        self._groups: dict[int, list[Trajectory]] = {}
        self.dropped: Counter[str] = Counter()
        self.last_waits: list[float] = []  # seconds the groups of the last take() waited

    def __len__(self) -> int:
        return len(self._groups)

    def takeable(self) -> int:
        """How many groups a take() could return now (the window may hold finished ones back)."""
        return self._sampler.takeable()

    def put(self, group: list[Trajectory], position: int | None = None, skip: Callable[[int], bool] | None = None) -> None:
        """A finished group at `position` (default: its trajectories' position, else the next one).
        Positions up to its own count as launched, except those `skip` names (already received
        before a resume: they will never come again)."""
        if position is None:
            position = next((t.position for t in group if t.position >= 0), self._last_submitted + 1)
        if position in self._groups:
            raise ValueError(f"buffer: the group at position {position} is already waiting")
        for p in range(self._last_submitted + 1, position + 1):
            if p == position or skip is None or not skip(p):
                self._sampler.submitted(p)
        self._last_submitted = max(self._last_submitted, position)
        self._sampler.finished(position, group)
        self._groups[position] = group
        self._arrived[position] = time.monotonic()

    def take(self, n_groups: int, version: int) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
        """Up to `n_groups` fresh-enough groups, in the sampler's order, and the stale ones dropped
        on the way (counted)."""
        taken, stale = [], []
        self.last_waits = []
        now = time.monotonic()
        while len(taken) < n_groups:
            picked = self._sampler.take(1)
            if not picked:
                break
            position, group = picked[0]
            del self._groups[position]
            self.last_waits.append(now - self._arrived.pop(position))
            lowest = group_min_version(group)
            if lowest >= 0 and version - lowest > self.max_policy_lag:
                stale.append(group)
                self.dropped["stale"] += 1
            else:
                taken.append(group)
        return taken, stale

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [self._groups[p] for p in sorted(self._groups)], "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any], skip: Callable[[int], bool] | None = None) -> None:
        self._sampler, self._last_submitted = self._make(), -1
        self._groups, self._arrived = {}, {}
        for group in state["groups"]:
            self.put(group, skip=skip)
        self.dropped = Counter(state["dropped"])
