"""Length-aware rollout scheduling (Seer) as a dispatcher over an Engine: benchmark B2's tool
(benchmarks/long_tail.py), kept here because no runtime path uses it; the training runtime orders its
agent programs with loomrl/agent/priorities.py.

A GRPO rollout is a set of groups (G requests sharing one prompt) whose output lengths are long-tailed;
how requests are fed to a batch of `concurrency` slots decides how long the slowest ones keep the batch
(and the trainer waiting for it) half empty. `RolloutDispatcher` keeps at most `concurrency` requests
in flight on one engine and orders them by one of three policies:

- "barrier": the classic synchronous batch. `concurrency` requests in arrival order are dispatched
  together and the next batch only when every one of them is done; the batch idles while its longest
  request finishes (a multiple of the group size keeps groups whole within a batch).
- "refill": continuous refill in arrival order; a slot freed by a finished request is given at once to
  the next waiting one.
- "seer": Seer's context-aware scheduling (Qin et al. 2025, "Seer: Online Context Learning for Fast
  Synchronous LLM Reinforcement Learning"). Siblings' lengths are strongly correlated, so one request
  per group (the first sibling) goes ahead as a *speculative* probe: every waiting probe is dispatched
  before any non-probe. Probes are ordered shortest-first: by `RolloutGroup.prior_length` when the
  caller has one (e.g. last epoch's lengths for this prompt; groups without a prior first, since they
  need a probe most), then by tokens generated so far (divided rollout: a probe that has already
  returned a chunk yields to ones that have not), then in arrival order. With no priors this is arrival
  order. Once a sibling has finished, the group's estimated length is the longest output any of its
  siblings has (finished or, with divided rollout, partial); until then it is `prior_length`, else
  conservatively the group's largest token budget, so an unprobed group counts as long (its siblings
  are not held back waiting for the probe, which would itself make a tail). The remaining siblings are dispatched longest-estimate-first: groups known to be short are kept
  for the end of the rollout, where they fill the slots the long ones leave, instead of the long ones
  starting late and forming the tail.

Divided rollout (`chunk_tokens`, for "refill" and "seer"): a request is dispatched with at most
`chunk_tokens` new tokens. When it comes back with finish_reason "length" before its own budget is
spent it is resubmitted as prompt + tokens so far with the remaining budget and queued again, so a long
request gives its slot back between chunks. Under "refill" it rejoins at the back of the queue (round
robin); under "seer" by its priority. Seer uses this to move long requests between engine instances
and balance their KV memory; this dispatcher drives one engine, so here it only changes the order in
which requests hold the slots (a multi-instance dispatcher would pick the least-loaded instance per
chunk). The same program id is used for every chunk, so an engine with a prefix cache (BuiltinEngine)
serves the continuation's prompt from the K/V it kept. A request ended by `interrupt()` (finish_reason
"interrupted", e.g. for a weight update) is continued the same way under every policy: partial
rollout. Token ids, logprobs and versions of the chunks are concatenated as they came.

Stop strings are checked by the engine within a chunk only (a string spanning a chunk boundary is
missed); stop token ids are unaffected.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from loomrl.engine.base import Engine, GenerationRequest, GenerationResult, SamplingParams

Policy = Literal["barrier", "refill", "seer"]
POLICIES: tuple[str, ...] = ("barrier", "refill", "seer")


@dataclass(slots=True, kw_only=True)
class RolloutGroup:
    """G requests sharing one prompt; one SamplingParams per sibling (their max_tokens are the budgets)."""

    prompt_ids: list[int]
    samplings: list[SamplingParams]
    group_id: str = ""  # program ids are f"{group_id}/{sibling}"; defaults to the group's index
    prior_length: float | None = None  # a length estimate known before the rollout (optional)


@dataclass(slots=True, frozen=True)
class Dispatch:
    """One submission to the engine (a whole request, or one chunk of it)."""

    at: float  # seconds since the rollout started
    group: int
    index: int  # sibling index within the group
    chunk: int  # 0 for the first submission of the request
    speculative: bool  # a group's probe, dispatched before its group's length is known
    max_tokens: int


@dataclass(slots=True)
class RequestOutcome:
    group: int
    index: int
    result: GenerationResult  # the chunks' tokens, logprobs and versions concatenated
    dispatched_at: float  # first dispatch, seconds since the rollout started
    finished_at: float
    chunks: int  # engine submissions it took


@dataclass(slots=True)
class ScheduleReport:
    policy: str
    concurrency: int
    chunk_tokens: int | None
    outcomes: list[list[RequestOutcome]]  # [group][sibling]
    group_finished_at: list[float]  # when each group's last sibling finished
    dispatches: list[Dispatch]  # in dispatch order
    max_in_flight: int
    wall_s: float

    def finish_times(self) -> list[float]:
        return sorted(o.finished_at for group in self.outcomes for o in group)

    def tail_latency(self, done_fraction: float = 0.9) -> float:
        """Seconds from when `done_fraction` of the requests had finished to when the last one did
        (0.9: the time the last 10% of requests keep the rollout going)."""
        times = self.finish_times()
        if not times:
            return 0.0
        k = max(1, math.ceil(len(times) * done_fraction - 1e-9))  # the request that completes the fraction
        return times[-1] - times[k - 1]

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.result.token_ids) for group in self.outcomes for o in group)


@dataclass(eq=False)
class _Request:
    group: int
    index: int
    arrival: int  # position in the input (group-major), the order "refill" and "barrier" follow
    prompt_ids: list[int]
    sampling: SamplingParams
    program_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    chunks: int = 0
    dispatched_at: float | None = None
    finished_at: float = 0.0
    finish_reason: str = ""

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.tokens)


@dataclass(eq=False)
class _Group:
    requests: list[_Request]
    prior_length: float | None
    finished: int = 0
    finished_at: float = 0.0

    def estimate(self) -> float:
        """Seer's group length estimate: the longest output of any sibling once one has finished
        (partial outputs are lower bounds, so they count too); before that, conservative."""
        if self.finished:
            return max(len(r.tokens) for r in self.requests)
        if self.prior_length is not None:
            return self.prior_length
        return max(r.sampling.max_tokens for r in self.requests)


def _chunk_seed(seed: int | None, chunk: int) -> int | None:
    """A distinct seed per chunk: reusing the request's seed would replay the same uniforms from the
    start of every chunk (correlated samples across a long request)."""
    if seed is None or chunk == 0:
        return seed
    return (seed * 1_000_003 + chunk) % (1 << 62)


class RolloutDispatcher:
    """Runs GRPO groups on `engine` with at most `concurrency` requests in flight (see module doc)."""

    def __init__(self, engine: Engine, *, concurrency: int, policy: Policy = "seer",
                 chunk_tokens: int | None = None, release: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1 (or None: no divided rollout)")
        if chunk_tokens is not None and policy == "barrier":
            raise ValueError("divided rollout (chunk_tokens) applies to 'refill' and 'seer', not 'barrier'")
        self.engine = engine
        self.concurrency = concurrency
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.release = release  # each request is a whole program here: drop its cached K/V when done

    # -- ordering ---------------------------------------------------------------------------------
    def _is_speculative(self, r: _Request, groups: list[_Group]) -> bool:
        return r.index == 0 and not groups[r.group].finished

    def _seer_key(self, r: _Request, groups: list[_Group], estimates: list[float]) -> tuple:
        g = groups[r.group]
        if self._is_speculative(r, groups):
            prior = -1.0 if g.prior_length is None else g.prior_length  # no prior: probe it first
            return (0, prior, len(r.tokens), r.arrival)
        return (1, -estimates[r.group], r.arrival)

    def _take(self, waiting: deque[_Request], in_flight: int, groups: list[_Group]) -> list[_Request]:
        """The requests to dispatch now, in dispatch order."""
        if self.policy == "barrier":
            if in_flight:  # the whole batch must finish first
                return []
            n = min(self.concurrency, len(waiting))
            return [waiting.popleft() for _ in range(n)]
        free = self.concurrency - in_flight
        if self.policy == "refill":
            return [waiting.popleft() for _ in range(min(free, len(waiting)))]
        taken = []
        estimates = [g.estimate() for g in groups]  # fixed until the next answer arrives
        for _ in range(min(free, len(waiting))):
            # Keys change as siblings finish, so no heap: a scan per pick, O(waiting), ~1 ms with
            # 6400 waiting; a few seconds over a whole rollout of that size, small beside generation.
            best = min(waiting, key=lambda r: self._seer_key(r, groups, estimates))
            waiting.remove(best)
            taken.append(best)
        return taken

    # -- one request ------------------------------------------------------------------------------
    def _submission(self, r: _Request) -> GenerationRequest:
        budget = r.remaining if self.chunk_tokens is None else min(r.remaining, self.chunk_tokens)
        sampling = replace(r.sampling, max_tokens=budget, seed=_chunk_seed(r.sampling.seed, r.chunks))
        return GenerationRequest(prompt_ids=r.prompt_ids + r.tokens, sampling=sampling, program_id=r.program_id)

    @staticmethod
    def _absorb(r: _Request, result: GenerationResult) -> bool:
        """Append a chunk's output; True when the request is complete."""
        r.tokens += result.token_ids
        r.logprobs += result.logprobs
        r.versions += result.versions
        r.chunks += 1
        r.finish_reason = result.finish_reason
        if result.finish_reason in ("length", "interrupted") and r.remaining > 0:
            return False  # a chunk ended (or an interrupt cut it): continue from here
        if r.remaining <= 0:
            r.finish_reason = "length"
        return True

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, groups: Sequence[RolloutGroup]) -> ScheduleReport:
        st = _RunState(start=time.perf_counter(), groups=_group_states(groups))
        for g in st.groups:
            st.waiting.extend(g.requests)
        try:
            while st.waiting or st.in_flight:
                for r in self._take(st.waiting, len(st.in_flight), st.groups):
                    self._dispatch(r, st)
                st.max_in_flight = max(st.max_in_flight, len(st.in_flight))
                done, _ = await asyncio.wait(st.in_flight, return_when=asyncio.FIRST_COMPLETED)
                self._collect(done, st)
        except BaseException:
            for fut in st.in_flight:
                fut.cancel()
            await asyncio.gather(*st.in_flight, return_exceptions=True)
            raise
        return self._report(st)

    def _dispatch(self, r: _Request, st: _RunState) -> None:
        now = st.now()
        if r.dispatched_at is None:
            r.dispatched_at = now
        sub = self._submission(r)
        speculative = self.policy == "seer" and self._is_speculative(r, st.groups)
        st.dispatches.append(Dispatch(at=now, group=r.group, index=r.index, chunk=r.chunks, speculative=speculative,
                                      max_tokens=sub.sampling.max_tokens))
        st.in_flight[asyncio.ensure_future(self.engine.generate(sub))] = r

    def _collect(self, done: set[asyncio.Future], st: _RunState) -> None:
        """Take in the engine's answers that arrived together (before refilling, so that the next
        picks see every estimate they updated)."""
        now = st.now()
        again: list[_Request] = []
        for fut in done:
            r = st.in_flight.pop(fut)
            if not self._absorb(r, fut.result()):
                again.append(r)
                continue
            r.finished_at = now
            g = st.groups[r.group]
            g.finished += 1
            g.finished_at = now
            if self.release:
                self.engine.release(r.program_id)
        again.sort(key=lambda r: r.arrival)  # `done` is a set: keep requeues deterministic
        if self.policy == "barrier":  # an interrupted request goes on first in the next batch
            st.waiting.extendleft(reversed(again))
        else:  # refill: round robin, the chunk yields its slot; seer re-sorts the queue anyway
            st.waiting.extend(again)

    def _report(self, st: _RunState) -> ScheduleReport:
        def outcome(r: _Request) -> RequestOutcome:
            result = GenerationResult(token_ids=r.tokens, logprobs=r.logprobs, versions=r.versions,
                                      finish_reason=r.finish_reason)
            return RequestOutcome(group=r.group, index=r.index, result=result, dispatched_at=r.dispatched_at or 0.0,
                                  finished_at=r.finished_at, chunks=r.chunks)

        return ScheduleReport(policy=self.policy, concurrency=self.concurrency, chunk_tokens=self.chunk_tokens,
                              outcomes=[[outcome(r) for r in g.requests] for g in st.groups],
                              group_finished_at=[g.finished_at for g in st.groups], dispatches=st.dispatches,
                              max_in_flight=st.max_in_flight, wall_s=st.now())


@dataclass(eq=False)
class _RunState:
    start: float
    groups: list[_Group]
    waiting: deque[_Request] = field(default_factory=deque)
    in_flight: dict[asyncio.Future, _Request] = field(default_factory=dict)
    dispatches: list[Dispatch] = field(default_factory=list)
    max_in_flight: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.start


def _group_states(groups: Sequence[RolloutGroup]) -> list[_Group]:
    states: list[_Group] = []
    arrival = 0
    for gi, spec in enumerate(groups):
        if not spec.samplings:
            raise ValueError(f"group {gi} has no requests")
        if any(sp.max_tokens < 1 for sp in spec.samplings):
            raise ValueError(f"group {gi}: every request needs max_tokens >= 1")
        gid = spec.group_id or str(gi)
        reqs = []
        for si, sp in enumerate(spec.samplings):
            reqs.append(_Request(group=gi, index=si, arrival=arrival, prompt_ids=list(spec.prompt_ids), sampling=sp,
                                 program_id=f"{gid}/{si}"))
            arrival += 1
        states.append(_Group(requests=reqs, prior_length=spec.prior_length))
    return states
