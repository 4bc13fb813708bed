"""The driver's books: one record per data position (PositionBook) with the admission rule written once, and the
step window (StepWindow), the clock and counters of the step being generated and trained.

A data position p is the p-th group of the run's task stream; its group is consumed at step p // groups_per_step.
A position is dispatched (an attempt, with a serial that says which attempt is live), comes back and is sent to the
trainer, or is lost and retried after a backoff, or is given up. Admission (buffer/admission.py) counts positions
that will deliver a group: ones given up free their place, and the groups the trainer dropped as stale let as many
fresh ones in; nothing is launched past the last step's positions (it would only be cancelled at the end).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

from loomrl.buffer.admission import admits, open_positions


@dataclass(slots=True)
class Position:
    """What the driver knows of one data position since the trainer (re)started."""

    attempts: int = 0
    live: int | None = None  # the serial of its attempt in flight whose result counts (None: none)
    retry_at: float | None = None  # time.monotonic() at which it is dispatched again
    gave_up: str | None = None  # why it is recorded as failed
    sent: list[str] | None = None  # the trajectory ids sent to the trainer


@dataclass(slots=True)
class PositionBook:
    groups_per_step: int
    max_lag: int
    total_steps: int
    records: dict[int, Position] = field(default_factory=dict)
    next_position: int = 0  # the first position never dispatched
    stale: int = 0  # groups the trainer dropped as stale so far
    _order: Iterator[int] = field(default_factory=lambda: iter(()))
    # indexes over `records`, so that the loop's every turn (admission, the next retry) costs what is pending, not
    # the run's length: the positions waiting for a retry, and how many were given up
    _retrying: set[int] = field(default_factory=set)
    _given_up: int = 0

    def __getitem__(self, position: int) -> Position:
        return self.records.setdefault(position, Position())

    # -- admission -----------------------------------------------------------------------------------
    def _delivering(self) -> int:
        """The next position's place among those that will deliver a group (given-up ones free theirs)."""
        return self.next_position - self._given_up

    def admits_next(self, version: int) -> bool:
        """Whether the rule lets the next position be launched while the engines hold `version`."""
        at = self._delivering()
        return (admits(at, version=version, groups_per_step=self.groups_per_step, max_lag=self.max_lag)
                and (at - self.stale) // self.groups_per_step < self.total_steps)

    def open(self, version: int) -> int:
        """How many more positions the rule admits before the next weight update."""
        return open_positions(self._delivering(), version=version, groups_per_step=self.groups_per_step,
                              max_lag=self.max_lag)

    def take_next(self) -> int:
        position, self.next_position = self.next_position, next(self._order)
        return position

    # -- attempts ------------------------------------------------------------------------------------
    def dispatched(self, position: int, serial: int) -> None:
        record = self[position]
        record.attempts += 1
        record.live, record.retry_at = serial, None
        self._retrying.discard(position)

    def is_live(self, position: int, serial: int) -> bool:
        """Whether the attempt `serial` is the position's live one (not superseded by a trainer restart)."""
        record = self.records.get(position)
        return record is not None and record.live == serial

    def attempts(self, position: int) -> int:
        record = self.records.get(position)
        return record.attempts if record is not None and record.attempts else 1

    def lost(self, position: int, *, max_attempts: int, backoff_s: float, why: str) -> bool:
        """The live attempt died: run it again after backoff_s x 2^(k-1) while it has attempts left (True), else
        give it up (False)."""
        record = self[position]
        record.live = None
        if record.attempts < max_attempts:
            record.retry_at = time.monotonic() + backoff_s * 2 ** (record.attempts - 1)
            self._retrying.add(position)
            return True
        self.give_up(position, f"{why} ({record.attempts} attempts)")
        return False

    def arrived(self, position: int) -> None:
        self[position].live = None

    def give_up(self, position: int, why: str) -> None:
        record = self[position]
        self._given_up += record.gave_up is None
        record.gave_up = why

    def sent(self, position: int, ids: list[str]) -> None:
        self[position].sent = ids

    def due(self) -> list[int]:
        """Positions whose retry is due now (their retry time is cleared)."""
        now = time.monotonic()
        out = sorted(p for p in self._retrying if (self.records[p].retry_at or now) <= now)
        for p in out:
            self.records[p].retry_at = None
        self._retrying.difference_update(out)
        return out

    def next_retry_in(self) -> float | None:
        """Seconds until the next retry is due (None: none waits)."""
        times = [t for p in self._retrying if (t := self.records[p].retry_at) is not None]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def given_up(self) -> dict[int, str]:
        return {p: r.gave_up for p, r in self.records.items() if r.gave_up is not None}

    # -- a (re)started trainer -----------------------------------------------------------------------
    def restart(self, received: Container[int]) -> list[list[str]]:
        """The trainer (re)started holding the positions in `received`: every other position runs again, in order from
        the first one it has not received; returns the id lists sent to the trainer that it no longer holds."""
        lost: list[list[str]] = []
        kept: dict[int, Position] = {}
        for p, r in self.records.items():
            if r.sent is None:
                continue
            if p in received:
                kept[p] = Position(sent=r.sent)
            else:
                lost.append(r.sent)
        self.records = kept
        self._retrying, self._given_up = set(), 0
        self._order = (p for p in itertools.count() if p not in received)
        self.next_position = next(self._order)
        return lost


@dataclass(slots=True)
class StepWindow:
    """The clock and counters of one step: from the last step's log to this one's."""

    started: float = field(default_factory=time.perf_counter)
    train_s: float = 0.0
    launched: int = 0  # groups launched
    peak: int = 0  # the most attempts in flight at once
    idle_s: float = 0.0  # seconds with nothing in flight
    idle_since: float | None = None

    def launch(self) -> None:
        self.launched += 1
        if self.idle_since is not None:
            self.idle_s += time.perf_counter() - self.idle_since
            self.idle_since = None

    def in_flight(self, n: int) -> None:
        self.peak = max(self.peak, n)
        if n == 0 and self.idle_since is None:
            self.idle_since = time.perf_counter()

    def close(self, inflight: int) -> dict[str, float]:
        """This step's timings and counters; the window starts over (what is in flight carries into it)."""
        now = time.perf_counter()
        if self.idle_since is not None:
            self.idle_s, self.idle_since = self.idle_s + now - self.idle_since, now
        step_s = now - self.started
        out = {"time/step_s": step_s, "time/train_s": self.train_s, "time/rollout_s": step_s - self.train_s,
               "time/rollout_idle_s": self.idle_s, "admission/launched_groups": self.launched,
               "admission/inflight_groups_max": self.peak, "admission/inflight_groups": inflight}
        self.started, self.train_s, self.launched, self.peak, self.idle_s = now, 0.0, 0, inflight, 0.0
        return out
