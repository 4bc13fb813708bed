"""One simulated GPU engine instance of the cluster simulation (planning/cluster_sim.py): continuous batching under a
K/V budget in tokens, with the built-in engine's own ProgramTable (engine/builtin/programs.py) deciding which program
to pause; only time and the K/V tensors are simulated.

The memory rules are the built-in scheduler's (engine/builtin/scheduler.py), restated over token counts because that
scheduler holds real tensors:
- held K/V = the cached entries (one per program: its last finished turn's prompt + output less its last token, in
  whole blocks as a block cache keeps them) + each running turn's prompt and the tokens it has decoded so far;
- admission, FIFO up to max_batch: a turn needs its prompt (under a program policy less the program's own cached
  prefix, which the turn takes over, plus its whole output reserved up front); the pool is asked once room is made
  (the scheduler asks it first, at every try: the same tokens, without a lookup per blocked step); room is made by
  pausing the acting program the table's `victim` names (its entry dropped, `ProgramTable.paused`), else by dropping
  the least recently used entry; a turn that still does not fit waits, head of line, unless nothing runs;
- before each step, while the running turns outgrow the budget (lru reserves nothing), entries are dropped as above,
  else the most recently admitted turn is preempted: its K/V becomes its program's cached entry and it requeues at the
  head with its decoded tokens as prompt (recomputed unless that entry survives);
- the table sees what the engine tells it: `started` on arrival, `admitted` with the hit (cache, plus the pool through
  `ProgramTable.fetch`) and the wait, `finished` with the K/V kept, `released` after a program's last turn.

A prefix is found by block hashes (placement.block_hashes's chain, extended per program: `extend_hashes`), counted per
entry and running prompt. Not modelled: a radix tree's sharing of one K/V between entries (each program's entry is
its own copy, as the built-in engine copies a donor's prefix), chunked prefill, the scheduler's one-step deferral of
siblings (a sibling admitted in the same step finds the prompt at once).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loomrl.engine.base import GenerationRequest
from loomrl.engine.builtin.programs import ProgramTable
from loomrl.engine.placement import BLOCK


def extend_hashes(hashes: list[int], tokens: list[int]) -> list[int]:
    """placement.block_hashes(tokens), given the hashes of a prefix of `tokens` (only the new full blocks are hashed)."""
    out, h = list(hashes), (hashes[-1] if hashes else 0)
    for start in range(len(hashes) * BLOCK, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start:start + BLOCK])))
        out.append(h)
    return out


def usable(held: int, prompt_len: int) -> int:
    """Of `held` prompt tokens cached, those a block cache serves: never the last prompt token, whole blocks only."""
    return min(held, prompt_len - 1) // BLOCK * BLOCK


@dataclass(slots=True, kw_only=True)
class SimTurn:
    """One request of a program on its instance."""

    program: int
    request: GenerationRequest  # prompt_ids: the turn's prompt as sent
    output: list[int]  # the tokens it will decode
    steps_left: int
    queued_at: float
    prompt: list[int] = field(default_factory=list)  # what must be in K/V before sampling (grows on preemption)
    hashes: list[int] = field(default_factory=list)  # block hashes of `prompt`
    reused: int = 0  # of its last admission: tokens from the instance's cache
    fetched: int = 0  # ... from the shared pool

    @property
    def pid(self) -> str:
        return self.request.program_id

    @property
    def kv_len(self) -> int:
        """Tokens of K/V it holds while running: its first prompt and what it decoded (a re-prefilled prompt too)."""
        return len(self.request.prompt_ids) + len(self.output) - self.steps_left

    @property
    def full_len(self) -> int:
        """... once its whole output is decoded (what a program policy reserves)."""
        return len(self.request.prompt_ids) + len(self.output)


@dataclass(slots=True)
class KVCounters:
    """One instance's K/V events (the table's own metrics count its pauses and restores)."""

    preemptions: int = 0
    restores_pool: int = 0  # turns whose lost prefix the pool served whole
    restores_recompute: int = 0  # turns that recomputed some of their lost prefix (the table's `restored`)
    max_held: int = 0  # the most K/V held at a step's start
    over_budget: int = 0  # step starts with more held than the budget while more than one turn ran


class SimInstance:
    """Waiting and running turns and their K/V under `budget` tokens, paused by `table`'s policy."""

    def __init__(self, *, budget: int, table: ProgramTable, max_batch: int):
        self.budget, self.table, self.max_batch = budget, table, max_batch
        self.waiting: deque[SimTurn] = deque()
        self.running: list[SimTurn] = []
        self.entries: OrderedDict[str, list[int]] = OrderedDict()  # program -> its cached blocks' hashes, LRU first
        self.refs: dict[int, int] = {}  # block hash -> entries and running prompts holding it
        self.entry_tokens = 0
        self.run_tokens = 0  # the running turns' K/V
        self.run_full = 0  # ... with every turn's whole output (what a program policy reserves)
        self.counters = KVCounters()

    # -- what the instance holds -----------------------------------------------------------------------------
    def held(self) -> int:
        return self.entry_tokens + self.run_tokens

    def cached(self, hashes: list[int]) -> int:
        """Tokens of the longest whole-block prefix held (by an entry or a running prompt)."""
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n * BLOCK

    def _count(self, hashes: list[int], by: int) -> None:
        for h in hashes:
            left = self.refs.get(h, 0) + by
            if left:
                self.refs[h] = left
            else:
                del self.refs[h]

    def set_entry(self, pid: str, hashes: list[int]) -> None:
        self.drop_entry(pid)
        self.entries[pid] = hashes
        self._count(hashes, 1)
        self.entry_tokens += len(hashes) * BLOCK

    def drop_entry(self, pid: str) -> bool:
        hashes = self.entries.pop(pid, None)
        if hashes is None:
            return False
        self._count(hashes, -1)
        self.entry_tokens -= len(hashes) * BLOCK
        return True

    def release(self, pid: str) -> None:
        """The program ended (the engine's `release`): its record and cached K/V go."""
        self.table.released(pid)
        self.drop_entry(pid)

    # -- making room: the table's victim, else least recently used --------------------------------------------
    def _evict(self, room: int) -> bool:
        held = {pid: len(h) * BLOCK for pid, h in self.entries.items() if h}
        victim = self.table.victim(held, room)
        if victim is not None and self.drop_entry(victim):
            self.table.paused(victim)
            return True
        if not self.entries:
            return False
        self.drop_entry(next(iter(self.entries)))
        return True

    def make_room(self, need: int) -> bool:
        """Drop cached K/V until `need` more tokens fit (beside the running turns' whole outputs under a program
        policy); False when nothing is left to drop."""
        while (over := (self.entry_tokens + (self.run_full if self.table.reserves_turns else self.run_tokens)
                        + need - self.budget)) > 0:
            if not self._evict(over):
                return False
        return True

    # -- a step's admissions and preemptions ----------------------------------------------------------------
    def admit(self, turn: SimTurn) -> None:
        """`turn` joins the batch with the prompt tokens it found (`reused` from this cache, `fetched` from the pool;
        the caller made room)."""
        self.waiting.popleft()
        if self.own_prefix(turn, turn.reused):  # the turn takes its program's cached K/V over: the entry's copy goes
            self.drop_entry(turn.pid)
        elif turn.pid in self.entries:
            self.entries.move_to_end(turn.pid)
        self.running.append(turn)
        self._count(turn.hashes, 1)
        self.run_tokens += turn.kv_len
        self.run_full += turn.full_len

    def own_prefix(self, turn: SimTurn, hit: int) -> int:
        """Under a program policy, the `hit` tokens when its program's own entry holds them (scheduler._own_prefix),
        else 0."""
        entry = self.entries.get(turn.pid)
        k = hit // BLOCK
        if not (self.table.reserves_turns and hit and entry is not None and len(entry) >= k):
            return 0
        return hit if entry[:k] == turn.hashes[:k] else 0

    def need(self, turn: SimTurn, hit: int) -> int:
        """Tokens admitting `turn` adds (scheduler._need): its prompt; under a program policy less its own cached
        prefix, taken over, and with its whole output reserved."""
        if not self.table.reserves_turns:
            return len(turn.prompt)
        return len(turn.prompt) - self.own_prefix(turn, hit) + turn.steps_left

    def preempt_if_needed(self) -> None:
        """Before a step: drop cached K/V while over the budget, then preempt the most recently admitted turn while
        more than one runs (one turn alone over the budget runs: nothing else is left to take from)."""
        while (over := self.held() - self.budget) > 0:
            if self._evict(over):
                continue
            if len(self.running) <= 1:
                break
            victim = self.running.pop()  # the most recently admitted
            self._leave(victim)
            # its K/V stays cached (the engine detaches it); it requeues to recompute what the cache no longer holds
            victim.prompt = victim.request.prompt_ids + victim.output[: len(victim.output) - victim.steps_left]
            victim.hashes = extend_hashes(victim.hashes, victim.prompt)
            self.set_entry(victim.pid, victim.hashes)
            self.waiting.appendleft(victim)
            self.counters.preemptions += 1
        c = self.counters
        c.max_held = max(c.max_held, self.held())
        if self.held() > self.budget and len(self.running) > 1:
            c.over_budget += 1

    def steps_ahead(self) -> int:
        """Decode steps that may run back to back with nothing to admit: up to the first running turn's finish, and
        no step starting over the budget (each adds a token per running turn)."""
        first = min(t.steps_left for t in self.running)
        room = self.budget - self.held()
        return max(1, min(first, room // len(self.running) + 1)) if room >= 0 else 1

    def _leave(self, turn: SimTurn) -> None:
        self._count(turn.hashes, -1)
        self.run_tokens -= turn.kv_len
        self.run_full -= turn.full_len

    # -- a step's end -----------------------------------------------------------------------------------------
    def decode(self, steps: int = 1) -> list[SimTurn]:
        """Every running turn decodes `steps` tokens (steps_ahead at most); those done leave (their K/V kept by the
        caller's `set_entry`)."""
        c = self.counters
        c.max_held = max(c.max_held, self.held() + (steps - 1) * len(self.running))  # at the last step's start
        still, done = [], []
        for turn in self.running:
            turn.steps_left -= steps
            self.run_tokens += steps
            (still if turn.steps_left else done).append(turn)
        for turn in done:
            self._leave(turn)
        self.running = still
        return done
