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
- ``ready()``: how many groups ``take`` would return now if ``n`` were unbounded (O(1));
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

Costs: ``submitted``, ``finished``, ``ready`` and ``len`` O(1) amortised; ``take(n)`` O(n log m) for m
groups waiting (heaps), plus O(1) amortised per group the window passes.

``batch_bias`` compares an attribute's mean in the consumed batches with its mean in the submitted
population (e.g. the share of long/hard tasks: a sampler that prefers what finishes first trains on
fewer of them early on).
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

G = TypeVar("G")

SAMPLERS = ("fifo", "oldest_first", "freshest_first", "window")


class Sampler(Protocol[G]):
    """Decides which finished groups a training batch takes. See the module docstring."""

    name: str

    def submitted(self, index: int) -> None: ...

    def finished(self, index: int, group: G) -> None: ...

    def take(self, n: int) -> list[tuple[int, G]]: ...

    def ready(self) -> int: ...

    def __len__(self) -> int: ...


class _Base(Generic[G]):
    """Bookkeeping shared by all samplers: launch order, finished-once, take() argument checks."""

    name = "base"

    def __init__(self) -> None:
        self._last_index: int | None = None
        self._running: dict[int, int] = {}  # index -> rank, submitted and not finished
        self._n_submitted = 0
        self._waiting = 0  # finished, not taken

    def __len__(self) -> int:
        return self._waiting

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} waiting={self._waiting} ready={self.ready()}>"

    def submitted(self, index: int) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"submission index must be a non-negative int, got {index!r}")
        if self._last_index is not None and index <= self._last_index:
            raise ValueError(f"submission indices must increase: got {index} after {self._last_index}")
        self._last_index = index
        self._running[index] = self._n_submitted
        self._n_submitted += 1
        self._on_submitted(index, self._running[index])

    def finished(self, index: int, group: G) -> None:
        rank = self._running.pop(index, None)
        if rank is None:
            raise ValueError(f"group {index} finished but was never submitted, or finished twice")
        self._waiting += 1
        self._on_finished(index, rank, group)

    def take(self, n: int) -> list[tuple[int, G]]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"take(n) needs a non-negative int, got {n!r}")
        out = self._take(n)
        self._waiting -= len(out)
        return out

    # -- per sampler ------------------------------------------------------------------------------
    def _on_submitted(self, index: int, rank: int) -> None:
        pass

    def _on_finished(self, index: int, rank: int, group: G) -> None:
        raise NotImplementedError

    def _take(self, n: int) -> list[tuple[int, G]]:
        raise NotImplementedError

    def ready(self) -> int:
        raise NotImplementedError


class FifoSampler(_Base[G]):
    """Completion order (first finished, first taken)."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[int, G]] = deque()

    def _on_finished(self, index: int, rank: int, group: G) -> None:
        self._queue.append((index, group))

    def _take(self, n: int) -> list[tuple[int, G]]:
        return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

    def ready(self) -> int:
        return len(self._queue)


class OrderSampler(_Base[G]):
    """Among finished groups, the lowest submission index first (oldest_first), or the highest: the
    newest launch, hence the newest policy (freshest_first); never waits for unfinished ones."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._sign = -1 if name == "freshest_first" else 1
        self._heap: list[tuple[int, int, G]] = []  # (sign * index, index, group); indices are unique

    def _on_finished(self, index: int, rank: int, group: G) -> None:
        heapq.heappush(self._heap, (self._sign * index, index, group))

    def _take(self, n: int) -> list[tuple[int, G]]:
        return [heapq.heappop(self._heap)[1:] for _ in range(min(n, len(self._heap)))]

    def ready(self) -> int:
        return len(self._heap)


class WindowSampler(_Base[G]):
    """Forge's sliding window of width W over submission order (see the module docstring).

    State, by submission rank r: `_head` = oldest rank not taken, the window is [head, head + W);
    `_eligible` is a heap, in completion order, of the finished, not-taken groups inside it; `_outside`
    holds the finished groups beyond it, by rank, until the head moves; `_taken` the ranks taken above
    the head. For ready(): `_frontier` = the oldest unfinished rank (the number submitted if none),
    `_ahead` the finished ranks >= frontier, and `_ready` = #finished, not taken, rank < frontier + W.
    """

    name = "window"

    def __init__(self, window: int | float) -> None:
        super().__init__()
        self.window = _check_window(window)
        self._inf = math.isinf(self.window)
        self._seq = 0  # completion counter: the order inside the window
        self._eligible: list[tuple[int, int, int, G]] = []  # (seq, rank, index, group)
        self._outside: dict[int, tuple[int, int, G]] = {}  # rank -> (seq, index, group)
        self._head = 0
        self._taken: set[int] = set()
        self._frontier = 0
        self._ahead: set[int] = set()
        self._ready = 0

    def _on_finished(self, index: int, rank: int, group: G) -> None:
        seq, self._seq = self._seq, self._seq + 1
        if self._inf:
            heapq.heappush(self._eligible, (seq, rank, index, group))
            return
        if rank < self._head + self.window:
            heapq.heappush(self._eligible, (seq, rank, index, group))
        else:
            self._outside[rank] = (seq, index, group)
        if rank < self._frontier + self.window:
            self._ready += 1
        self._ahead.add(rank)
        while self._frontier in self._ahead:  # each step brings rank frontier + W into the ready region;
            self._ahead.discard(self._frontier)  # it cannot have been taken (taken ranks < head + W)
            self._frontier += 1
            self._ready += (self._frontier + self.window - 1) in self._ahead

    def _take(self, n: int) -> list[tuple[int, G]]:
        out: list[tuple[int, G]] = []
        while self._eligible and len(out) < n:
            _, rank, index, group = heapq.heappop(self._eligible)
            out.append((index, group))
            if not self._inf:
                self._ready -= 1
                self._taken.add(rank)
                if rank == self._head:
                    self._advance()
        return out

    def _advance(self) -> None:
        """The head was taken: move it past every taken rank; groups now inside become eligible."""
        old_end = self._head + self.window
        while self._head in self._taken:
            self._taken.discard(self._head)
            self._head += 1
        for rank in range(old_end, min(self._head + self.window, self._n_submitted)):
            entry = self._outside.pop(rank, None)
            if entry is not None:
                seq, index, group = entry
                heapq.heappush(self._eligible, (seq, rank, index, group))

    def ready(self) -> int:
        return len(self._eligible) if self._inf else self._ready


def _check_window(window) -> int | float:
    if isinstance(window, float) and math.isinf(window) and window > 0:
        return math.inf
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise ValueError(f"window must be an int >= 1 or math.inf, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (1 = strict submission order), got {window!r}")
    return int(window)


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
    return FifoSampler() if name == "fifo" else OrderSampler(name)


@dataclass(frozen=True, slots=True)
class Bias:
    """An attribute's mean in the consumed batches vs in the population.

    With 0/1 attributes (e.g. 1 = hard task) the means are shares. difference = batch - population
    (0 = unbiased; < 0: the batches under-represent the attribute); ratio = batch / population
    (1 = unbiased; 1.0 when both are 0, inf when only the population's is 0)."""

    batch_mean: float
    population_mean: float
    difference: float
    ratio: float
    n_batch: int
    n_population: int


def batch_bias(batch_attrs, population_attrs) -> Bias:
    """Bias of the consumed groups' attribute (iterable of numbers or bools, one per group taken)
    against the submitted population's (one per group submitted). Raises ValueError if either is empty."""
    batch = [float(x) for x in batch_attrs]
    population = [float(x) for x in population_attrs]
    if not batch or not population:
        raise ValueError(f"batch_bias needs non-empty inputs (got {len(batch)} batch, {len(population)} population)")
    b, p = sum(batch) / len(batch), sum(population) / len(population)
    ratio = b / p if p != 0 else (1.0 if b == 0 else math.inf)
    return Bias(batch_mean=b, population_mean=p, difference=b - p, ratio=ratio, n_batch=len(batch),
                n_population=len(population))
