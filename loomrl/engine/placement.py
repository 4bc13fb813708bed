"""Where the router sends a request: the router-side prefix index of each instance, its load, and the placement policies
(round_robin, least_loaded, affinity) over them.

The prefix index is the router's estimate of what an instance's prefix cache holds: the token prefixes it sent there
(each prompt when sent, prompt + output once finished), in blocks of BLOCK tokens keyed by a chained hash, at most the
instance's K/V budget of them (least recently used dropped first, as the engine's own cache drops). It is an estimate:
the engine may have evicted a prefix the index still lists, a hash collision may list one it never held, and a partial
last block is never counted. None of that can change an output (the engine matches its own cache token by token); it
only makes a placement worse. Every entry belongs to one weight version: the router empties the index at each update,
so no placement is ever made on the K/V of older weights.

The affinity cost of placing a prompt of P tokens on instance i, in seconds:
    queue_i     = in flight at i / i's measured rate (requests finished per second while it had work: Little's law)
    recompute_i = (P - prefix i holds by the index) / the measured prefill rate (prompt tokens per second)
    fetch_i     = a seam for fetching the missing prefix's K/V from a shared pool (KVFetch; kv_pool.py PoolFetch, engine.kv_pool_bytes): where
                  it is offered and cheaper, it replaces recompute_i.
A program's turns go to the instance that ran its last turn, and a GRPO group's siblings to the instance of the first
one, unless that instance has more than `imbalance` requests in flight above the least loaded one (overloaded); then,
and for a request with no home, the cost decides.

`least_loaded` also serves the prefill/decode split and divided rollout (split.py), which place some requests by load
whatever the policy, among the instances of one role.

What it is not: the router (router.py runs the requests, fans out weights, retries on a fault); a K/V pool (kv_pool.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from loomrl.engine.base import GenerationRequest

Policy = Literal["round_robin", "least_loaded", "affinity"]
BLOCK = 16  # tokens per index entry: the granularity of the router's prefix estimate
PRIOR_REQUESTS_PER_S = 1.0  # an instance's rate before it has finished MIN_FINISHED requests
PRIOR_PREFILL_TOKENS_PER_S = 2000.0  # the prefill rate before the instances have measured one
MIN_FINISHED = 3
MAX_HOMES = 65536  # programs and groups remembered (least recently placed forgotten first)


def block_hashes(tokens: list[int]) -> list[int]:
    """One chained hash per full block of `tokens`: equal hashes at block k mean (up to a collision) equal first
    (k + 1) * BLOCK tokens."""
    out, h = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start:start + BLOCK])))
        out.append(h)
    return out


class PrefixIndex:
    """The token prefixes the router sent to one instance, under the current weight version."""

    def __init__(self, capacity_tokens: int):
        self.capacity = max(1, capacity_tokens // BLOCK)  # blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def held(self, tokens: list[int]) -> int:
        """Tokens of the longest block-aligned prefix of `tokens` the instance likely holds."""
        n = 0
        for h in block_hashes(tokens):
            if h not in self.blocks:
                break
            n += 1
        return n * BLOCK

    def add(self, tokens: list[int]) -> None:
        for h in block_hashes(tokens):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


@dataclass(slots=True, kw_only=True)
class InstanceLoad:
    """One instance's load as the router sees it: requests in flight, and its rate measured over the time it had any."""

    inflight: int = 0
    finished: int = 0
    busy_s: float = 0.0  # wall seconds with at least one request in flight (closed intervals)
    busy_since: float | None = None
    faulted_until: float = 0.0  # monotonic time before which new requests avoid it (it just faulted)
    retired: bool = False  # it failed a weight update others passed: never placed on again (router.py)
    clock: Callable[[], float] = time.monotonic  # planning/cluster_sim.py passes its simulated clock

    def start(self) -> None:
        if self.inflight == 0:
            self.busy_since = self.clock()
        self.inflight += 1

    def end(self, finished: bool) -> None:
        self.inflight -= 1
        self.finished += finished
        if self.inflight == 0 and self.busy_since is not None:
            self.busy_s += self.clock() - self.busy_since
            self.busy_since = None

    def rate(self) -> float:
        """Requests finished per busy second (the prior until it has finished a few)."""
        busy = self.busy_s + (self.clock() - self.busy_since if self.busy_since is not None else 0.0)
        if self.finished < MIN_FINISHED or busy <= 0:
            return PRIOR_REQUESTS_PER_S
        return self.finished / busy


class KVFetch(Protocol):
    """The seam for a shared K/V pool (kv_pool.py PoolFetch): the seconds to fetch the K/V of `tokens`[held:] into an instance
    holding their first `held`, or None where the pool does not have them."""

    def fetch_s(self, tokens: list[int], held: int) -> float | None: ...


@dataclass(slots=True, kw_only=True)
class Choice:
    instance: int
    # round_robin, least_loaded, program, group, prefix (the cost, with a prefix held), load (no prefix); split.py's
    # pd_prefill (a prompt's prefill instance) and chunk (a divided rollout's later chunk)
    reason: str
    expected: int  # prompt tokens the chosen instance likely holds (the index's estimate)


@dataclass(slots=True, kw_only=True)
class Placer:
    """The placement policy over the instances' indexes and loads; the router calls `choose` under its lock."""

    policy: Policy
    indexes: list[PrefixIndex]
    loads: list[InstanceLoad]
    imbalance: int = 8  # in-flight requests above the least loaded instance beyond which a home is overloaded
    fetch: KVFetch | None = None
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S  # the router refreshes it from the instances' metrics
    programs: OrderedDict[str, int] = field(default_factory=OrderedDict)  # program -> the instance of its last turn
    groups: OrderedDict[str, int] = field(default_factory=OrderedDict)  # group -> the instance of its first member
    turn: int = 0  # round_robin's next instance

    def choose(self, request: GenerationRequest, exclude: frozenset[int] = frozenset()) -> Choice:
        """The instance for `request`, never one in `exclude` (an instance that failed it); instances that faulted
        recently are avoided while others remain."""
        healthy = self._healthy(exclude)
        prompt = request.prompt_ids
        if self.policy == "round_robin":
            pick = min(healthy, key=lambda i: (i - self.turn) % len(self.loads))
            self.turn = (pick + 1) % len(self.loads)
            return Choice(instance=pick, reason="round_robin", expected=self.indexes[pick].held(prompt))
        if self.policy == "least_loaded":
            return self.least_loaded(request, exclude)
        least = min(self.loads[i].inflight for i in healthy)
        for key, homes, reason in ((request.program_id, self.programs, "program"),
                                   (request.group_id, self.groups, "group")):
            home = homes.get(key) if key else None
            if home in healthy and self.loads[home].inflight - least <= self.imbalance:
                return Choice(instance=home, reason=reason, expected=self.indexes[home].held(prompt))
        costs = [(self.cost(i, prompt), i) for i in healthy]
        (_, held), pick = min(costs)
        return Choice(instance=pick, reason="prefix" if held else "load", expected=held)

    def least_loaded(self, request: GenerationRequest, exclude: frozenset[int] = frozenset(),
                     reason: str = "least_loaded", prefer: int | None = None) -> Choice:
        """The instance with the fewest requests in flight (`prefer`, then the lowest index, among equals), whatever
        the policy: the prefill/decode split's prefill instances and divided rollout's later chunks (split.py, which
        prefers the instance of the chunk before: its prefix cache holds the K/V) are placed so."""
        pick = min(self._healthy(exclude), key=lambda i: (self.loads[i].inflight, i != prefer, i))
        return Choice(instance=pick, reason=reason, expected=self.indexes[pick].held(request.prompt_ids))

    def _healthy(self, exclude: frozenset[int]) -> list[int]:
        """The instances not in `exclude`, less those that faulted recently while any other remains; ValueError when
        every instance is excluded."""
        now = time.monotonic()
        allowed = [i for i in range(len(self.loads)) if i not in exclude and not self.loads[i].retired]
        if not allowed:
            raise ValueError("Placer.choose: every instance is excluded or retired")
        return [i for i in allowed if self.loads[i].faulted_until <= now] or allowed

    def cost(self, i: int, prompt: list[int]) -> tuple[float, int]:
        """(seconds, prefix tokens held): queue + the cheaper of recomputing and fetching what i lacks."""
        held = self.indexes[i].held(prompt)
        queue = self.loads[i].inflight / self.loads[i].rate()
        missing = (len(prompt) - held) / self.prefill_tokens_per_s
        fetched = self.fetch.fetch_s(prompt, held) if self.fetch is not None else None
        return queue + (missing if fetched is None else min(missing, fetched)), held

    def placed(self, request: GenerationRequest, instance: int) -> None:
        """Remember the homes: the program's (its next turn follows its K/V) and the group's (its first member's)."""
        if request.program_id:
            remember(self.programs, request.program_id, instance)
        if request.group_id and request.group_id not in self.groups:
            remember(self.groups, request.group_id, instance)

    def forget(self) -> None:
        """A new weight version: every home's K/V is gone, and so is every index entry."""
        self.programs.clear()
        self.groups.clear()
        for index in self.indexes:
            index.clear()


def remember(homes: OrderedDict[str, int], key: str, instance: int) -> None:
    homes[key] = instance
    homes.move_to_end(key)
    while len(homes) > MAX_HOMES:
        homes.popitem(last=False)
