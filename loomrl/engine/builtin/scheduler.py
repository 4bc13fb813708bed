"""The built-in engine's scheduler: which sequences run in the next step and what each contributes.

A KV budget (tokens) bounds what running sequences and the prefix cache hold together: admission waits for room, the
prefix cache gives up entries first (those of a program the ProgramTable pauses, programs.py, else the least recently
used), and when running sequences outgrow the budget the most recently admitted one is preempted (its KV dropped; it
requeues with its sampled tokens and is recomputed later, its result unchanged). A shared K/V pool (engine/kv_pool.py),
when the engine has one, may hand an admitted turn more of its prompt than the prefix cache holds. Under a program policy
(engine.program_policy other than lru) admission reserves each turn's whole output, so preemption is left for what the
reservation could not foresee. A step's batch mixes the decode tokens of all running sequences with prefill chunks of
newly admitted ones, within max_prefill_tokens. With speculation (a GroupDrafter and a DraftPolicy), a decoding
sequence's chunk is its last token followed by the draft tokens the policy lets it verify. The engine calls
`schedule()` under its lock; nothing here runs the model.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from loomrl.engine.base import EngineMetrics, GenerationRequest
from loomrl.engine.builtin.drafter import GroupDrafter
from loomrl.engine.builtin.prefix_cache import PrefixCache
from loomrl.engine.builtin.programs import ProgramTable, held_tokens
from loomrl.engine.builtin.runner import Chunk, ModelRunner, SequenceKV
from loomrl.engine.builtin.speculation import Acceptance, DraftPolicy
from loomrl.tokens import common_prefix_len


@dataclass(eq=False)
class Seq:
    request: GenerationRequest
    future: concurrent.futures.Future
    prompt: list[int]  # what must be in the KV before sampling (grows on preemption)
    seed: int  # its sampling stream (seeds.py uniform_at): the request's seed, else one the engine drew for it
    kv: SequenceKV | None = None
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    admitted_at: int = 0
    queued_at: float = field(default_factory=time.monotonic)  # when it was submitted (its admission wait)
    uid: int = 0  # the scheduler's number for it (the drafter's key)
    acceptance: Acceptance = field(default_factory=Acceptance)

    @property
    def group(self) -> str:
        """Whose tokens its drafts come from: its GRPO group, else its program, else itself."""
        return self.request.group_id or self.request.program_id or f"seq-{self.uid}"

    @property
    def position(self) -> int:
        """The sequence position of the next token it samples (its request's prompt, then its output)."""
        return len(self.request.prompt_ids) + len(self.out_tokens)

    def kv_tokens(self) -> list[int]:
        """Token ids in KV order: the (possibly re-prefilled) prompt, then tokens sampled since."""
        return self.prompt + self.out_tokens[len(self.prompt) - len(self.request.prompt_ids) :]

    def pending_prompt(self) -> list[int]:
        return self.prompt[self.kv.length :] if self.kv is not None else self.prompt


@dataclass(slots=True)
class Sample:
    """A sequence that samples from this step: its chunk returns 1 + len(draft) rows of logits."""

    seq: Seq
    draft: list[int]
    decoding: bool  # False: its prompt's last chunk (it samples its first token)


@dataclass(slots=True)
class Batch:
    """One step's work: the chunks to run, and the sequences that sample from it in chunk order (a chunk that
    finishes no prompt and decodes nothing returns no logits)."""

    running: list[Seq]
    chunks: list[Chunk]
    samples: list[Sample]
    prefill_tokens: int = 0
    draft_s: float = 0.0  # seconds spent drafting


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PrefixCache | None, metrics: EngineMetrics, *,
                 kv_budget: int, max_running: int, max_prefill_tokens: int,
                 drafter: GroupDrafter | None = None, policy: DraftPolicy | None = None, max_draft: int = 0,
                 programs: ProgramTable | None = None):
        self.runner, self.cache, self.metrics = runner, cache, metrics
        self.programs = programs if programs is not None else ProgramTable()
        self.drafter, self.policy, self.max_draft = drafter, policy, max_draft
        self._uids = itertools.count(1)
        self.kv_budget, self.max_running, self.max_prefill_tokens = kv_budget, max_running, max_prefill_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._queue_at = time.monotonic()  # when queue_s was last brought up to date

    def _count_queue(self) -> None:
        """Add the waiting requests times the seconds since the last count to metrics.queue_s (the queue depth's time
        integral). Called before every change to `waiting` and at every schedule, so a reading lags by one step at
        most: a queue that waits unchanged through a long step is counted when the next one is scheduled."""
        now = time.monotonic()
        self.metrics.add_queue(len(self.waiting) * (now - self._queue_at))
        self._queue_at = now

    def add(self, seq: Seq) -> None:
        """Queue after every waiting request of the same or a lower priority (FIFO among equals)."""
        self._count_queue()
        seq.uid = next(self._uids)
        at = len(self.waiting)
        while at and self.waiting[at - 1].request.priority > seq.request.priority:
            at -= 1
        self.waiting.insert(at, seq)

    def drain(self) -> list[Seq]:
        """Every sequence in flight, running and waiting, removed from the scheduler."""
        self._count_queue()
        out = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        return out

    def schedule(self) -> Batch:
        self._count_queue()  # _admit and _preempt_if_needed change `waiting` at this instant
        self._admit()
        self._preempt_if_needed()
        chunks, samples, budget = [], [], self.max_prefill_tokens
        decoding: list[Seq] = []
        for seq in self.running:
            if seq.kv is None:  # admission gives every running sequence its K/V; _release takes it back
                raise RuntimeError(f"Scheduler.schedule: a running sequence (program {seq.request.program_id!r}) "
                                   "has no K/V")
            pending = seq.pending_prompt()
            if pending:  # still prefilling: a chunk of its prompt, up to the next multiple of max_prefill_tokens
                # Cut at fixed positions, never where this step's budget happens to run out: where a prompt is cut
                # changes its K/V's bits, and what else is prefilling must not (docs/reproducibility.md). A piece
                # that does not fit waits for the next step, which it fits whole (a piece is at most the budget).
                assert seq.kv is not None
                part = pending[: self.max_prefill_tokens - seq.kv.length % self.max_prefill_tokens]
                if len(part) > budget:
                    continue
                budget -= len(part)
                done = len(part) == len(pending)
                chunks.append(Chunk(seq.kv, part, logits=1 if done else 0))
                if done:
                    samples.append(Sample(seq, [], decoding=False))
            else:
                decoding.append(seq)
        for seq in decoding:  # the last sampled token; add_drafts may append drafts to verify
            assert seq.kv is not None  # checked above
            chunks.append(Chunk(seq.kv, [seq.out_tokens[-1]]))
            samples.append(Sample(seq, [], decoding=True))
        return Batch(list(self.running), chunks, samples, prefill_tokens=self.max_prefill_tokens - budget)

    def add_drafts(self, batch: Batch) -> None:
        """Give the batch's decoding sequences their drafts (speculation). Called by the engine's thread outside its
        lock: it reads only the sequences' own tokens, which that thread alone changes, and the drafter, which only it
        uses; a request arriving meanwhile does not wait for it."""
        if self.drafter is None:
            return
        t0 = time.perf_counter()
        n = sum(s.decoding for s in batch.samples)  # decoding sequences come last, in chunks and samples alike
        decoding = list(zip(batch.chunks[len(batch.chunks) - n :], batch.samples[len(batch.samples) - n :]))
        drafts = self._drafts([s.seq for _, s in decoding], emitted=len(batch.samples),
                              tokens=sum(len(c.tokens) for c in batch.chunks))
        for (chunk, sample), draft in zip(decoding, drafts):
            chunk.tokens.extend(draft)
            chunk.logits = 1 + len(draft)
            sample.draft = draft
        batch.draft_s = time.perf_counter() - t0

    def _drafts(self, decoding: list[Seq], emitted: int, tokens: int) -> list[list[int]]:
        """Each decoding sequence's draft tokens for this step ([] without speculation)."""
        if self.drafter is None or self.policy is None or not decoding or not self.policy.worth_drafting(
                emitted, tokens, max(self.policy.rate(s.acceptance) for s in decoding)):
            return [[] for _ in decoding]
        proposals = []
        for seq in decoding:
            if not self.drafter.knows(seq.uid):  # first decode step, or its group was dropped (new weights)
                self.drafter.join(seq.uid, seq.group, list(seq.request.prompt_ids), seq.out_tokens)
            # at most max_tokens in all: the last emitted token is drawn after the drafts
            room = seq.request.sampling.max_tokens - len(seq.out_tokens) - 1
            proposals.append(self.drafter.draft(seq.uid, min(self.max_draft, room)))
        rates = [self.policy.rate(s.acceptance) for s in decoding]
        take = self.policy.allocate(emitted, tokens, [(len(p), r) for p, r in zip(proposals, rates)])
        return [p[:k] for p, k in zip(proposals, take)]

    def retire(self, seq: Seq) -> None:
        """A sequence leaves the batch: its pool slot is freed; K/V the prefix cache may hold (its
        prompt is inserted once prefilled) is first copied out of the pool."""
        if self.drafter is not None:
            self.drafter.leave(seq.uid)
        if seq.kv is not None:
            if self.cache is not None:
                seq.kv.detach()
            else:
                seq.kv.free()
        seq.kv = None

    # -- memory -------------------------------------------------------------------------------------
    def _held(self) -> dict[int, SequenceKV]:
        held: dict[int, SequenceKV] = {id(s.kv): s.kv for s in self.running if s.kv is not None}
        if self.cache is not None:
            held.update(self.cache.held())
        return held

    def _held_tokens(self) -> int:
        return sum(kv.length for kv in self._held().values())

    def _evict(self, room: int) -> bool:
        """Free cached K/V toward `room` tokens: pause the acting program the program policy picks, else drop the least
        recently used entry. False when the cache holds nothing more to drop."""
        if self.cache is None:
            return False
        victim = self.programs.victim(held_tokens(self._held().values()), room)
        if victim is not None and self.cache.release(victim):
            self.programs.paused(victim)
            return True
        return self.cache.evict_lru()

    def _growth(self) -> int:
        """Tokens the running turns will still add to their K/V at most (what program policies reserve)."""
        return sum(max(0, len(s.request.prompt_ids) + s.request.sampling.max_tokens - (s.kv.length if s.kv else 0))
                   for s in self.running)

    def _make_room(self, need: int) -> bool:
        """Evict cached entries until `need` more tokens fit in the budget (beside the running turns' growth, under a
        program policy: it pauses acting programs up front rather than preempt a running turn later)."""
        reserved = self._growth() if self.programs.reserves_turns else 0
        while (over := self._held_tokens() + reserved + need - self.kv_budget) > 0:
            if not self._evict(over):
                return False
        return True

    def _admit(self) -> None:
        """Move waiting requests into the running batch while the budget allows.

        A request whose prompt shares a long prefix with one admitted in this same round waits one
        step: by then that prefix is in the cache and it is copied instead of computed again (GRPO
        siblings, requests sharing a system prompt)."""
        admitted: list[Seq] = []
        deferred: list[Seq] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            hit, donor = (0, None)
            if self.cache is not None:
                hit, donor = self.cache.match(seq.prompt[:-1])  # the last token must be computed
                program = self.programs.get(seq.request.program_id)
                # a shared KV pool may hold more than the cache: asked for every turn when there is one (a turn moved
                # from another instance, an entry this cache evicted), else only for a paused program's restore
                if self.programs.pool is not None or (program is not None and program.paused):
                    fetched, kv = self.programs.fetch(seq.request.program_id, seq.prompt[:-1], hit)
                    if fetched > hit and kv is not None:
                        hit, donor = fetched, kv
                # what a sibling admitted now would leave in the cache: all but its prompt's last token at most
                shared = min(max((common_prefix_len(seq.prompt, a.prompt) for a in admitted), default=0),
                             len(seq.prompt) - 1)
                if shared > hit and shared >= 8 and shared >= len(seq.prompt) // 4:
                    deferred.append(seq)
                    continue
            own = self._own_prefix(seq, hit, donor)
            if not self._make_room(self._need(seq, own)) and self.running:
                self.waiting.appendleft(seq)
                break  # wait for running sequences to finish
            seq.kv = self.runner.new_kv(len(seq.prompt) + seq.request.sampling.max_tokens)
            seq.kv.owner = seq.request.program_id
            if hit and donor is not None:
                seq.kv.copy_prefix(donor, hit)
            if own and self.cache is not None:  # the turn took its program's cached K/V over; its prompt's entry
                self.cache.release(seq.request.program_id)  # returns once prefilled
            self.programs.admitted(seq.request, len(seq.prompt), hit, time.monotonic() - seq.queued_at)
            self.metrics.prompt_tokens += len(seq.prompt)
            self.metrics.reused_tokens += hit
            self.metrics.prefill_tokens += len(seq.prompt) - hit
            seq.admitted_at = self.metrics.steps
            self.running.append(seq)
            admitted.append(seq)
        self.waiting.extendleft(reversed(deferred))

    def _own_prefix(self, seq: Seq, hit: int, donor: SequenceKV | None) -> int:
        """Under a program policy, the cached prefix a program's turn takes over from its own last turn (its entries
        are dropped once copied: the copy in the running turn replaces them), else 0 (lru copies, as before)."""
        pid = seq.request.program_id
        if not (self.programs.reserves_turns and pid and donor is not None and donor.owner == pid):
            return 0
        return hit

    def _need(self, seq: Seq, own: int) -> int:
        """Tokens of K/V admitting `seq` adds: its prompt (less what it takes over from its own cache entries) and,
        under a program policy, its whole output, reserved up front."""
        if not self.programs.reserves_turns:
            return len(seq.prompt)
        return len(seq.prompt) - own + seq.request.sampling.max_tokens - len(seq.out_tokens)

    def _preempt_if_needed(self) -> None:
        while (over := self._held_tokens() - self.kv_budget) > 0 and len(self.running) > 1:
            if self._evict(over):
                continue
            victim = max(self.running, key=lambda s: s.admitted_at)
            self.running.remove(victim)
            # Recompute later: the sampled tokens become part of the prompt to re-prefill.
            victim.prompt = list(victim.request.prompt_ids) + victim.out_tokens
            self.retire(victim)
            self.waiting.appendleft(victim)
            self.metrics.preemptions += 1
