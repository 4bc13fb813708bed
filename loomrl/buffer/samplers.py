"""Batch samplers: which FINISHED groups a training batch takes, and in which order.

The unit is a GRPO group (in practice ``list[Trajectory]``; the samplers never look inside it),
identified by its submission index: the position in the run's data order at which the group was
launched. Indices must be submitted in strictly increasing order (gaps are allowed: a resumed run
skips the positions it already received). Submission *rank* is the count of groups submitted
before this one, so the window below is over launches, not over raw index values.

Protocol, shared by every sampler:

- ``submitted(index)``: the group was launched (call in launch order);
- ``finished(index, group)``: its rollouts are done and scored; it may now be taken;
- ``take(n)``: up to ``n`` ``(index, group)`` pairs, removed from the sampler. ``take(n)`` is the
  same as ``n`` calls of ``take(1)``: a window may advance in the middle of a batch;
- ``ready()``: how many groups ``take`` would return now if ``n`` were unbounded;
- ``len(sampler)``: finished groups not yet taken (some may not be ready: they wait for the window).

Samplers (``make_sampler(name, window=None)``):

- ``"fifo"``: completion order, what ``Buffer`` does today (greedy first-finished);
- ``"oldest_first"``: among finished groups, the lowest submission index first; never waits for an
  unfinished group;
- ``"freshest_first"``: among finished groups, the highest submission index first (the latest
  launched, hence the newest policy version at launch: versions are non-decreasing in launch order);
- ``"window"`` (Forge's sliding window, width ``W``): the window covers the W submissions starting at
  the oldest group not yet taken (the head). Any finished group inside it may be taken, in completion
  order; the window advances only when the head has been taken. ``W=1`` is strict submission order,
  ``W=math.inf`` is greedy first-finished (the same order as ``"fifo"``).

Guarantees of ``"window"`` with width W (tested in tests/buffer/test_samplers.py):

1. bounded overtaking: a group is taken only after every group submitted W or more places before it
   has been taken. Equivalently, at most W-1 later-submitted groups are taken before any group.
2. no starvation: the head is always inside the window, so once it finishes it is ready; a slow group
   delays at most W-1 others and cannot be overtaken forever.
3. exactly once: every finished group is taken exactly once, provided the groups submitted before it
   finish too. ``ready()`` is exact: with ``f`` the oldest unfinished submission, the ready groups are
   the finished, not yet taken ones of rank < f + W.

Costs: ``submitted``, ``finished`` and ``len`` O(1); ``ready`` O(m) and ``take(n)`` O(n x m) for m
groups submitted and not yet taken, as each pick scans them. The admission limit keeps m to tens, at
most a few hundred, so a scan is microseconds next to a trainer step: incremental heaps buy nothing.
"""

from __future__ import annotations

import math
import numbers
from typing import Generic, Protocol, TypeVar

G = TypeVar("G")

SAMPLERS = ("fifo", "oldest_first", "freshest_first", "window")


class Sampler(Protocol[G]):
    """Decides which finished groups a training batch takes. See the module docstring."""

    name: str

    def submitted(self, index: int) -> None: ...
    def finished(self, index: int, group: G) -> None: ...
    def take(self, n: int) -> list[tuple[int, G]]: ...
    def takeable(self) -> int: ...
    def __len__(self) -> int: ...


class RuleSampler(Generic[G]):
    """Every sampler: take the lowest priority among the waiting groups of rank < head + window.

    `_running`: submitted, unfinished index -> rank r; `_waiting`: finished, not-taken rank ->
    (priority, index, group), the priority being the completion number (fifo, window), r (oldest_first:
    indices increase with rank) or -r (freshest_first), unique, so groups are never compared.
    head = the oldest rank not taken; window is math.inf for every sampler but "window"."""

    def __init__(self, name: str, window: int | float = math.inf) -> None:
        self.name = name
        self.window = window
        self._last_index: int | None = None
        self._n_submitted = 0
        self._n_finished = 0  # the completion counter: fifo's and the window's order
        self._running: dict[int, int] = {}
        self._waiting: dict[int, tuple[int, int, G]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} waiting={len(self)} takeable={self.takeable()}>"

    def submitted(self, index: int) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"submission index must be a non-negative int, got {index!r}")
        if self._last_index is not None and index <= self._last_index:
            raise ValueError(f"submission indices must increase: got {index} after {self._last_index}")
        self._last_index = index
        self._running[index] = self._n_submitted
        self._n_submitted += 1

    def finished(self, index: int, group: G) -> None:
        rank = self._running.pop(index, None)
        if rank is None:
            raise ValueError(f"group {index} finished but was never submitted, or finished twice")
        priority = {"oldest_first": rank, "freshest_first": -rank}.get(self.name, self._n_finished)
        self._n_finished += 1
        self._waiting[rank] = (priority, index, group)

    def take(self, n: int) -> list[tuple[int, G]]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"take(n) needs a non-negative int, got {n!r}")
        out: list[tuple[int, G]] = []
        while len(out) < n:
            # The head is recomputed after every pick: taking it moves the window mid-batch.
            head = min([*self._running.values(), *self._waiting, self._n_submitted])
            inside = [(priority, rank) for rank, (priority, _, _) in self._waiting.items() if rank < head + self.window]
            if not inside:
                break
            _, index, group = self._waiting.pop(min(inside)[1])
            out.append((index, group))
        return out

    def takeable(self) -> int:
        # take() can move the head up to the oldest unfinished rank (the frontier), never past it.
        frontier = min(self._running.values(), default=self._n_submitted)
        return sum(rank < frontier + self.window for rank in self._waiting)


class FifoSampler(RuleSampler[G]):
    """Completion order (first finished, first taken)."""

    def __init__(self) -> None:
        super().__init__("fifo")


class WindowSampler(RuleSampler[G]):
    """Forge's sliding window of width W over submission order (see the module docstring)."""

    def __init__(self, window: int | float) -> None:
        infinite = isinstance(window, float) and math.isinf(window) and window > 0
        if not infinite and (isinstance(window, bool) or not isinstance(window, numbers.Integral)):
            raise ValueError(f"window must be an int >= 1 or math.inf, got {window!r}")
        if not infinite and window < 1:
            raise ValueError(f"window must be >= 1 (1 = strict submission order), got {window!r}")
        super().__init__("window", math.inf if infinite else int(window))


def make_sampler(name: str, window: int | float | None = None) -> Sampler:
    """A sampler by name: "fifo", "oldest_first", "freshest_first" or "window" (needs `window`:
    an int >= 1, or math.inf for greedy first-finished)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    if name == "window":
        if window is None:
            raise ValueError("the 'window' sampler needs window=W (an int >= 1, or math.inf for greedy first-finished)")
        return WindowSampler(window)
    if window is not None:
        raise ValueError(f"window={window!r} only applies to the 'window' sampler, not {name!r}")
    return FifoSampler() if name == "fifo" else RuleSampler(name)
