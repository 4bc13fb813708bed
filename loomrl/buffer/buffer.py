"""Buffer: scored GRPO groups waiting to be trained, FIFO, with bounded staleness.

Staleness of a group at consumption = trainer version - the oldest policy version of any token in
it. Groups staler than `max_policy_lag` are dropped when taken and counted (never silently).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from loomrl.types import Trajectory


def group_min_version(group: list[Trajectory]) -> int:
    versions = [t.metadata.policy_version_min for t in group if t.metadata.policy_version_min >= 0]
    return min(versions) if versions else -1


class Buffer:
    def __init__(self, max_policy_lag: int):
        self.max_policy_lag = max_policy_lag
        self._groups: deque[list[Trajectory]] = deque()
        self._arrived: deque[float] = deque()  # when each group arrived (for backpressure metrics)
        self.dropped: Counter[str] = Counter()
        self.last_waits: list[float] = []  # seconds the groups of the last take() waited

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: list[Trajectory]) -> None:
        self._groups.append(group)
        self._arrived.append(time.monotonic())

    def take(self, n_groups: int, version: int) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
        """Up to `n_groups` fresh-enough groups (FIFO) and the stale ones dropped on the way."""
        taken, stale = [], []
        self.last_waits = []
        now = time.monotonic()
        while self._groups and len(taken) < n_groups:
            group = self._groups.popleft()
            self.last_waits.append(now - self._arrived.popleft())
            lowest = group_min_version(group)
            if lowest >= 0 and version - lowest > self.max_policy_lag:
                stale.append(group)
                self.dropped["stale"] += 1
            else:
                taken.append(group)
        return taken, stale

    def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self._groups), "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._groups = deque(state["groups"])
        self._arrived = deque(time.monotonic() for _ in self._groups)
        self.dropped = Counter(state["dropped"])
