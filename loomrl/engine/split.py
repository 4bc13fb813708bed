"""The router's prefill/decode split and divided rollout (engine.prefill_instances, engine.chunk_tokens), over built-in
instances that share a K/V pool (engine/kv_pool.py): what moves between instances is K/V in the pool, never tokens
recomputed where the pool holds them.

Prefill/decode split (Forge's disaggregation): the first `prefill_instances` instances only prefill, the rest only
decode. A prompt with at least `min_prompt_tokens` tokens that neither the pool nor any decode instance (by the router's
prefix index) holds is first run on the least loaded prefill instance with max_tokens=1, greedy: the engine puts the
finished turn's K/V (the prompt: its one sampled token's K/V is never computed) into the pool, and the token is
discarded (counted: pd_discarded_tokens; its logits came from the prefill's last step, which the decode side then
recomputes for one token). The request itself then runs on a decode instance the router's policy picks, which fetches
the prompt's K/V from the pool and computes only its last token. A prefill that faults or is interrupted, or a pool
that misses (evicted, another weight version), only costs the decode instance the recompute: the result is the same.

Divided rollout (Seer): with chunk_tokens, a request asking for more is sent in chunks of at most chunk_tokens; a chunk
that ends by length continues (prompt + output so far) on the least loaded decode instance (the previous chunk's among
equals: its prefix cache holds the K/V), which otherwise fetches the previous chunk's K/V from the pool (the instance
that ran it put it there on finishing). Token ids, logprobs and versions are
concatenated. Seeds: every chunk samples with the request's seed: the built-in engine draws the token at sequence
position p with the seed's uniform at p (seeds.py uniform_at), so a divided request samples the tokens the undivided
one would (up to float rounding: its logits come from other batches). A request with stop strings is not divided (counted: unsplit_stop): the engine
matches stop strings within one request's output, so one spanning a chunk boundary would be missed. A chunk that ends
"interrupted" (a weight update) returns the whole output so far as interrupted; generate_resuming (engine/base.py)
resumes it as today. A chunk whose instance faults is run once more elsewhere (Router.attempt): the earlier chunks are
kept, and the faulted chunk returned nothing, so no token is lost or returned twice.

Weight versions: the pool serves only the version it was last told (each engine tells it at load) and each engine asks
under its own, so K/V of older weights is never fetched, across an update between chunks included.

What it is not: a placement policy (placement.py), the pool (kv_pool.py), or vLLM/SGLang's PD (their connectors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from loomrl.engine.base import EngineFault, GenerationRequest, GenerationResult, SamplingParams
from loomrl.engine.placement import Choice, Placer

Choose = Callable[[GenerationRequest, frozenset[int]], Choice]


class HoldsPrefixes(Protocol):
    """The K/V pool as the split sees it (kv_pool.SharedKVPool): tokens of the longest prefix held for its version."""

    def held(self, tokens: list[int]) -> int: ...


class Runs(Protocol):
    """The router as the split uses it (router.Router)."""

    placer: Placer

    async def attempt(self, request: GenerationRequest, choose: Choose | None = None) -> tuple[
        int, GenerationResult]: ...

    async def once(self, request: GenerationRequest, choose: Choose) -> tuple[int, GenerationResult]: ...


@dataclass(slots=True, kw_only=True)
class SplitPlan:
    """What to split: engine.prefill_instances, engine.pd_min_prompt_tokens, engine.chunk_tokens, over `pool`."""

    pool: HoldsPrefixes
    prefill_instances: int = 0  # 0: no prefill/decode split
    min_prompt_tokens: int = 64  # prompt tokens to compute below which a request goes straight to decode
    chunk_tokens: int | None = None  # None: no divided rollout


@dataclass(slots=True)
class SplitMetrics:
    """Counters since the router started."""

    pd_prefills: int = 0  # prompts prefilled on a prefill instance before their decode
    pd_prefill_failed: int = 0  # of those tried, prefills that faulted or were interrupted (decode recomputed)
    pd_skipped: int = 0  # requests sent straight to decode: too little of their prompt left to compute
    pd_discarded_tokens: int = 0  # tokens the prefills sampled and threw away (one each)
    # prompt tokens the pool held for a prefilled request, when its decode was sent, beyond what a decode instance
    # held by the router's index: what decode is expected to fetch instead of computing (kv_pool_tokens_served: done)
    pd_fetched_tokens: int = 0
    chunks: int = 0  # later chunks of divided requests (a first chunk is the request's own placement)
    chunks_moved: int = 0  # of those, placed on another instance than the chunk before
    divided: int = 0  # requests divided into chunks
    unsplit_stop: int = 0  # requests not divided because they have stop strings

    def counts(self) -> dict[str, float]:
        """As step metrics (engine/readings.py): engine/router_<counter>, each the step's change."""
        return {f"router_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


class Split:
    """Runs a router's requests with the prefill/decode split and/or divided rollout of `plan`."""

    def __init__(self, router: Runs, plan: SplitPlan):
        n = len(router.placer.loads)
        if not 0 <= plan.prefill_instances < n:
            raise ValueError(f"engine.prefill_instances={plan.prefill_instances} must leave at least one of the "
                             f"{n} engine.instances to decode")
        if plan.chunk_tokens is not None and plan.chunk_tokens < 1:
            raise ValueError(f"engine.chunk_tokens must be at least 1 (or None: no divided rollout), got "
                             f"{plan.chunk_tokens}")
        self.router, self.plan = router, plan
        self.prefill = frozenset(range(plan.prefill_instances))
        self.decode = frozenset(range(plan.prefill_instances, n))
        self.metrics = SplitMetrics()

    # -- placement by role ----------------------------------------------------------------------------------------
    def _on_prefill(self, request: GenerationRequest, exclude: frozenset[int]) -> Choice:
        return self.router.placer.least_loaded(request, exclude | self.decode, "pd_prefill")

    def _on_decode(self, request: GenerationRequest, exclude: frozenset[int]) -> Choice:
        return self.router.placer.choose(request, exclude | self.prefill)

    def _next_chunk(self, last: int) -> Choose:
        """A later chunk's placement: the least loaded decode instance, the last chunk's among equals."""
        return lambda request, exclude: self.router.placer.least_loaded(request, exclude | self.prefill, "chunk", last)

    # -- requests -------------------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.prefill:
            await self._prefill(request)
        sp = request.sampling
        if self.plan.chunk_tokens is None or sp.max_tokens <= self.plan.chunk_tokens:
            return (await self.router.attempt(request, self._on_decode))[1]
        if sp.stop:
            self.metrics.unsplit_stop += 1
            return (await self.router.attempt(request, self._on_decode))[1]
        return await self._divided(request, self.plan.chunk_tokens)

    def _decode_holds(self, prompt: list[int]) -> int:
        """Prompt tokens the decode instance holding most of `prompt` holds, by the router's index."""
        return max(self.router.placer.indexes[i].held(prompt) for i in self.decode)

    async def _prefill(self, request: GenerationRequest) -> None:
        """Put the prompt's K/V into the pool from a prefill instance, where worth it; a failure only costs the decode
        instance its recompute."""
        prompt = request.prompt_ids
        cached = self._decode_holds(prompt)
        # what a decode instance would compute (a request's last token is always computed)
        if len(prompt) - min(max(cached, self.plan.pool.held(prompt)), len(prompt) - 1) < self.plan.min_prompt_tokens:
            self.metrics.pd_skipped += 1
            return
        # no program or group: the prefill instance must not become the program's home or keep K/V under its id
        probe = GenerationRequest(prompt_ids=prompt, priority=request.priority,
                                  sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        try:
            _, result = await self.router.once(probe, self._on_prefill)
        except EngineFault:
            self.metrics.pd_prefill_failed += 1
            return
        self.metrics.pd_discarded_tokens += len(result.token_ids)
        if result.finish_reason == "interrupted":  # its K/V was not put (a weight update): decode recomputes
            self.metrics.pd_prefill_failed += 1
            return
        self.metrics.pd_prefills += 1
        self.metrics.pd_fetched_tokens += max(0, min(self.plan.pool.held(prompt), len(prompt) - 1) - cached)

    async def _divided(self, request: GenerationRequest, chunk: int) -> GenerationResult:
        """`request` in chunks of at most `chunk` tokens, each later one on the least loaded decode instance."""
        self.metrics.divided += 1
        sp = request.sampling
        out = GenerationResult(token_ids=[], logprobs=[], versions=[], finish_reason="")
        last = -1
        for k in range(sp.max_tokens // chunk + 1):  # bounded: every chunk but the last adds `chunk` tokens
            left = sp.max_tokens - len(out.token_ids)
            part = replace(request, prompt_ids=request.prompt_ids + out.token_ids,
                           sampling=replace(sp, max_tokens=min(chunk, left)))
            choose = self._on_decode if k == 0 else self._next_chunk(last)
            i, result = await self.router.attempt(part, choose)
            if k:
                self.metrics.chunks += 1
                self.metrics.chunks_moved += i != last
            last = i
            out.token_ids += result.token_ids
            out.logprobs += result.logprobs
            out.versions += result.versions
            out.finish_reason = result.finish_reason
            if result.finish_reason != "length" or len(out.token_ids) >= sp.max_tokens:
                return out
            if not result.token_ids:
                raise EngineFault(f"router: chunk {k} of a divided request ended by length with no token")
        raise EngineFault(f"router: a divided request of max_tokens {sp.max_tokens} did not end within "
                          f"{sp.max_tokens // chunk + 1} chunks of {chunk}")
