"""Programs under a KV budget: the built-in engine's table of agent programs and the policy that pauses them.

A program is an agent's multi-turn session, known to the engine by the `program_id` (and `group_id`) of its requests,
white-box agent loop and black-box gateway alike. Its phase is `reasoning` while a request of it is in flight and
`acting` from the moment its last request finished (it waits on a tool) until its next request or
`release(program_id)`. An acting program's K/V stays in the prefix cache for its next turn; when the KV budget needs
room, the scheduler asks `victim` which acting program to PAUSE (all its cached entries dropped at once), and the
program's next turn RESTORES it: its prefix is recomputed, or fetched from a shared K/V pool when the engine has one
(`fetch`; engine/kv_pool.py, engine.kv_pool_bytes). Tokens are exact: each SequenceKV records the program it was
computed for (`held_tokens`).

Under a program policy (not `lru`) the scheduler also treats K/V as the program's: admission reserves a turn's whole
output (max_tokens) up front, pausing acting programs for it, so a running turn is not preempted as it grows (lru
admits on the prompt alone and preempts the newest running turn, recomputed whole, when the turns outgrow the budget);
and a program's turn takes over its own cached prefix (its entries are dropped once copied into the running turn), so
a returning program does not need room for its prefix twice.

Policies (engine.program_policy):
- `lru`: request-level, today's behaviour: the prefix cache drops its least recently used entry, whatever program it
  belongs to; under cyclic multi-turn traffic often the entry about to be used again (LRU's thrashing).
- `smallest_first`: ThunderAgent's public policy: the acting program holding the fewest tokens. Large programs keep
  their K/V; small ones are paused again and again, and many pauses are needed to free a given room.
- `longest_wait`: the acting program expected to stay away longest (its mean past tool wait minus the time it has
  waited so far; programs not seen returning yet take the table's mean), weighted by the share of what it holds that
  the room needed uses (min(room, held) / held): every token paused is recomputed on its return, so pausing a large
  program for a small room wastes recompute (the reason smallest_first does well on recompute). A program paused
  `max_pauses_in_row` turns in a row is not paused by the policy again until one of its turns finds its K/V; when
  only such programs are left, the cache's LRU decides, as today.

What this is not: the KV pool (engine/kv_pool.py; this table only asks it), a router, or a preemptor of running
sequences (scheduler.py preempts those). Recompute a weight update causes (the prefix cache is cleared: its K/V came
from old weights) is every policy's cost and is not counted as a restore's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from loomrl.engine.base import GenerationRequest
from loomrl.engine.builtin.runner import SequenceKV
from loomrl.engine.readings import Counters

if TYPE_CHECKING:
    from loomrl.engine.kv_pool import SharedKVPool

ProgramPolicy = Literal["lru", "smallest_first", "longest_wait"]
_WAIT_EMA = 0.5  # weight of the newest tool wait in a program's mean
# Programs kept at most: a client that never releases (`loomrl serve` names each HTTP request a program) would grow the
# table for ever; past this the longest-idle acting quarter is forgotten (only their wait statistics are lost).
MAX_PROGRAMS = 65536


class Phase(StrEnum):
    REASONING = "reasoning"  # a request of it is in flight
    ACTING = "acting"  # between turns: its agent works (a tool call); its K/V waits in the prefix cache


@dataclass(slots=True, kw_only=True)
class Program:
    program_id: str
    group_id: str
    phase: Phase = Phase.REASONING
    in_flight: int = 0
    last_active: float = 0.0  # the table's clock at its last request or finish
    acting_since: float = 0.0
    mean_wait_s: float | None = None  # its tool waits so far (an average weighted to the newest)
    prefix_tokens: int = 0  # tokens its last turn left in K/V: the cached prefix its next turn expects
    paused: bool = False  # its K/V was dropped by the policy; its next turn restores it
    pauses_in_row: int = 0  # policy pauses since one of its turns last found its K/V


@dataclass(slots=True)
class ProgramMetrics:
    """Counters since the engine started. `restored` and `recomputed_tokens` count every turn whose expected prefix
    was (partly) gone, whichever policy dropped it (the cache's LRU too); `paused` counts the policy's pauses."""

    paused: int = 0
    restored: int = 0
    recomputed_tokens: int = 0  # prefix tokens a restoring turn computed again
    max_wait_s: float = 0.0  # longest a turn waited for admission to the running batch
    max_restore_wait_s: float = 0.0  # ... among turns that restored a program
    max_pauses_in_row: int = 0

    def counters(self) -> Counters:
        """As step metrics (engine/readings.py): engine/programs_paused, _restored, _recomputed_tokens (changes), and
        engine/programs_max_wait_s, _max_restore_wait_s, _max_pauses_in_row (since the engine started)."""
        return Counters(counts={"programs_paused": self.paused, "programs_restored": self.restored,
                                "programs_recomputed_tokens": self.recomputed_tokens},
                        peaks={"programs_max_wait_s": self.max_wait_s,
                               "programs_max_restore_wait_s": self.max_restore_wait_s,
                               "programs_max_pauses_in_row": self.max_pauses_in_row})


class ProgramTable:
    """Per program id: phase, group, exact K/V tokens held, last activity; picks the program to pause."""

    def __init__(self, policy: ProgramPolicy = "lru", *, max_pauses_in_row: int = 2,
                 clock: Callable[[], float] = time.monotonic, pool: SharedKVPool | None = None,
                 version: Callable[[], int] = lambda: 0):
        if max_pauses_in_row < 1:
            raise ValueError(f"max_pauses_in_row must be at least 1, got {max_pauses_in_row}")
        self.policy, self.max_pauses_in_row, self.clock = policy, max_pauses_in_row, clock
        self.pool, self.version = pool, version  # version: the engine's weight version now (the pool serves only it)
        self.programs: dict[str, Program] = {}
        self.metrics = ProgramMetrics()
        self._mean_wait_s: float | None = None  # over all programs: the guess for one not seen returning yet

    @property
    def reserves_turns(self) -> bool:
        """Whether the scheduler treats K/V as the programs' (any policy but lru): a turn's whole output reserved at
        admission, a program's own cached prefix taken over (see the module's docstring)."""
        return self.policy != "lru"

    def get(self, program_id: str) -> Program | None:
        return self.programs.get(program_id)

    # -- lifecycle (the engine calls these under its lock) ---------------------------------------------
    def started(self, request: GenerationRequest) -> None:
        """A request of the program arrived: it reasons (an acting one's tool wait ends here)."""
        if not request.program_id:
            return
        now = self.clock()
        p = self.programs.get(request.program_id)
        if p is None:
            if len(self.programs) >= MAX_PROGRAMS:
                self._forget_idle()
            p = self.programs[request.program_id] = Program(program_id=request.program_id, group_id=request.group_id)
        elif p.phase is Phase.ACTING:
            wait = now - p.acting_since
            p.mean_wait_s = wait if p.mean_wait_s is None else (1 - _WAIT_EMA) * p.mean_wait_s + _WAIT_EMA * wait
            self._mean_wait_s = wait if self._mean_wait_s is None else 0.9 * self._mean_wait_s + 0.1 * wait
        p.phase, p.last_active = Phase.REASONING, now
        p.in_flight += 1

    def admitted(self, request: GenerationRequest, prompt_tokens: int, hit: int, waited_s: float) -> None:
        """A request joined the running batch with `hit` prompt tokens from the cache after `waited_s` queued."""
        m = self.metrics
        m.max_wait_s = max(m.max_wait_s, waited_s)
        p = self.programs.get(request.program_id)
        if p is None:
            return
        lost = max(0, min(p.prefix_tokens, prompt_tokens - 1) - hit)  # the last prompt token is computed anyway
        if lost:
            m.restored += 1
            m.recomputed_tokens += lost
            m.max_restore_wait_s = max(m.max_restore_wait_s, waited_s)
        if not p.paused:
            p.pauses_in_row = 0
        p.paused = False
        p.prefix_tokens = 0  # until this turn finishes

    def finished(self, program_id: str, kv_tokens: int) -> None:
        """A request ended with `kv_tokens` tokens of K/V kept for the next turn: the program acts once none is left."""
        p = self.programs.get(program_id)
        if p is None:
            return
        p.in_flight = max(0, p.in_flight - 1)
        p.prefix_tokens = max(p.prefix_tokens, kv_tokens)
        p.last_active = self.clock()
        if p.in_flight == 0:
            p.phase, p.acting_since = Phase.ACTING, p.last_active

    def _forget_idle(self) -> None:
        acting = sorted((p for p in self.programs.values() if p.phase is Phase.ACTING), key=lambda p: p.last_active)
        for p in acting[: max(1, len(self.programs) // 4)]:
            del self.programs[p.program_id]

    def released(self, program_id: str) -> None:
        self.programs.pop(program_id, None)

    def cleared(self) -> None:
        """Every cached K/V was dropped (new weights, a failed step): no turn expects a cached prefix any more."""
        for p in self.programs.values():
            p.prefix_tokens = 0

    # -- pausing ------------------------------------------------------------------------------------------
    def victim(self, held: dict[str, int], room: int) -> str | None:
        """The acting program to pause (`held`: tokens each holds; `room`: tokens to free); None: let the cache's LRU
        choose (policy lru, or no acting program holds K/V that the policy may pause)."""
        if self.policy == "lru":
            return None
        cands = [p for p in self.programs.values()
                 if p.phase is Phase.ACTING and not p.paused and held.get(p.program_id, 0) > 0]
        if self.policy == "smallest_first":
            smallest = min(cands, key=lambda p: held[p.program_id], default=None)
            return smallest.program_id if smallest is not None else None
        cands = [p for p in cands if p.pauses_in_row < self.max_pauses_in_row]
        if not cands:
            return None
        now = self.clock()

        def score(p: Program) -> tuple[float, int]:
            expected = p.mean_wait_s if p.mean_wait_s is not None else (self._mean_wait_s or 0.0)
            remaining, h = expected - (now - p.acting_since), held[p.program_id]
            used = min(max(room, 1), h) / h  # of what pausing it frees, the share the room needs
            return (remaining * used if remaining > 0 else remaining / used), -h

        return max(cands, key=score).program_id

    def paused(self, program_id: str) -> None:
        """The policy's victim: its cached entries were dropped."""
        p = self.programs[program_id]
        p.paused = True
        p.pauses_in_row += 1
        self.metrics.paused += 1
        self.metrics.max_pauses_in_row = max(self.metrics.max_pauses_in_row, p.pauses_in_row)

    def fetch(self, program_id: str, tokens: list[int], held: int = 0) -> tuple[int, SequenceKV | None]:
        """How many leading `tokens` (more than the `held` the prefix cache gave) the shared KV pool hands back for a
        turn of `program_id`, and the K/V holding them (read only); (0, None) without a pool: a restore recomputes.
        The scheduler asks for every turn when there is a pool, for a paused program's restore otherwise."""
        if self.pool is None:
            return 0, None
        return self.pool.get(tokens, self.version(), held)


def held_tokens(kvs: Iterable[SequenceKV]) -> dict[str, int]:
    """Tokens of K/V each program holds, from the distinct K/V objects kept alive (by the cache and running sequences),
    each counted for the program it was computed for."""
    out: dict[str, int] = {}
    for kv in {id(kv): kv for kv in kvs}.values():
        out[kv.owner] = out.get(kv.owner, 0) + kv.length
    return out
