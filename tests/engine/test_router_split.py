"""The router's prefill/decode split and divided rollout (engine/split.py) over built-in instances sharing a K/V pool:
greedy outputs equal to one bare engine's with either or both on, seeded sampling reproducible and distributed as
without them, the decode side really fetching from the pool, chunks moving between instances, a chunk's instance
killed mid-generation losing nothing, K/V of old weights never used across an update between chunks; and request
priorities (Seer's, agent/priorities.py) reaching each instance's admission queue in order. Every engine is a real
BuiltinEngine over the tiny random model; an instance is killed by closing it."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter

import pytest
import torch

from loomrl.config import EngineConfig, EngineSetup, ModelConfig
from loomrl.engine.base import GenerationRequest, SamplingParams, generate_resuming
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.factory import make_engine

POOL = 64 << 20


def _setup(instances: int = 3, prefill: int = 1, chunk: int | None = None, router: str = "affinity",
           min_prompt: int = 16) -> EngineSetup:
    return EngineSetup(engine=EngineConfig(instances=instances, router=router, kv_pool_bytes=POOL,
                                           prefill_instances=prefill, chunk_tokens=chunk,
                                           pd_min_prompt_tokens=min_prompt),
                       model=ModelConfig(kind="tiny"), seed=0, context_tokens=4096, interrupt_on_update=False, cpus=1)


def _prompts(tokenizer, n: int = 4) -> list[list[int]]:
    """Prompts of 50-70 tokens, each with a first token of its own (no prefix shared between them)."""
    body = tokenizer.encode("You are a careful calculator. Use the tool, then answer the question asked. Question:" * 2)
    asks = (" what is 2 + 2?", " 7 * 8", " apples and pears", " 12 / 4", " the sum of 3 and 9", " 100 - 1")
    return [[2000 + i] + body + tokenizer.encode(asks[i % len(asks)]) for i in range(n)]


def _req(prompt, program="", **sampling):
    return GenerationRequest(prompt_ids=list(prompt), program_id=program, sampling=SamplingParams(**sampling))


def _all(engine, requests):
    async def go():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    return asyncio.run(go())


def _each(engine, requests):
    async def go():
        return [await engine.generate(r) for r in requests]

    return asyncio.run(go())


@pytest.fixture
def bare(tiny_model, tokenizer):
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    yield eng
    eng.close()


def _chi2_p(table: list[list[int]]) -> float:
    """p-value of Pearson's chi-square test that the rows of a contingency table share one distribution."""
    rows, cols = [sum(r) for r in table], [sum(c) for c in zip(*table)]
    total = sum(rows)
    stat = sum((table[i][j] - rows[i] * cols[j] / total) ** 2 / (rows[i] * cols[j] / total)
               for i in range(len(table)) for j in range(len(cols)) if cols[j])
    df = (len(table) - 1) * (sum(1 for c in cols if c) - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _table(arms: list[Counter], min_count: int = 10) -> list[list[int]]:
    """The arms' counts of each outcome; outcomes seen fewer than min_count times in all pooled into one cell."""
    pooled = sum(arms, Counter())
    keep = [k for k, n in pooled.items() if n >= min_count]
    return [[c[k] for k in keep] + [sum(n for k, n in c.items() if k not in keep)] for c in arms]


@pytest.mark.parametrize(("prefill", "chunk"), [(1, None), (0, 4), (1, 4)], ids=["pd", "chunks", "pd+chunks"])
def test_greedy_outputs_equal_one_bare_engines(tiny_model, tokenizer, bare, prefill, chunk):
    router = make_engine(_setup(3, prefill, chunk), tiny_model, tokenizer, 0)
    try:
        reqs = [_req(p, program=f"p{i}", temperature=0.0, max_tokens=18, ignore_eos=True)
                for i, p in enumerate(_prompts(tokenizer, 6))]
        assert [r.token_ids for r in _all(router, reqs)] == [r.token_ids for r in _all(bare, reqs)]
        split = router.split.metrics
        assert split.pd_prefills == (6 if prefill else 0)
        assert split.chunks == (6 * 4 if chunk else 0)  # 18 tokens in chunks of 4: five each, four of them later
        if prefill:  # nothing decoded on the prefill instance: every request's tokens came from the others
            assert router.instances[0].metrics.generated_tokens == split.pd_discarded_tokens == 6
    finally:
        router.close()


def _seeded(prompt, seeds):
    return [_req(prompt, program=f"s{s}", temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, seed=s)
            for s in seeds]


def _split_run(tiny_model, tokenizer, requests) -> tuple[list[list[int]], int]:
    """Token ids through a fresh router with PD and chunks of 2 (max_tokens 4: two chunks), and the pool's tokens
    served."""
    router = make_engine(_setup(3, 1, 2), tiny_model, tokenizer, 0)
    try:
        return [r.token_ids for r in _all(router, requests)], router.instances[0].kv_pool.metrics.tokens_served
    finally:
        router.close()


def test_seeded_sampling_with_the_split_reproduces_run_to_run_and_the_undivided_tokens(tiny_model, tokenizer, bare):
    """Every chunk samples with the request's seed, and the built-in engine draws the token at position p with the
    seed's uniform at p: divided across instances, a request samples what one undivided engine does."""
    requests = _seeded(_prompts(tokenizer, 1)[0], range(24))
    first, served = _split_run(tiny_model, tokenizer, requests)
    assert served > 0 and _split_run(tiny_model, tokenizer, requests)[0] == first
    assert len({tuple(t) for t in first}) > 1  # sampled, not one sequence
    assert first == [r.token_ids for r in _all(bare, requests)]


@pytest.mark.slow
def test_seeded_sampling_with_the_split_is_distributed_as_without_it(tiny_model, tokenizer, bare):
    """PD and chunks of 2 (max_tokens 4) over 400 seeds against one bare engine over 400 other seeds: the first token
    (sampled on a decode instance from fetched K/V) and the third (the first of a later chunk) are distributed alike: Pearson's chi-square test of homogeneity, each at p > 0.001 (a false failure in
    1,000 per position; top_k 4 keeps each position's outcomes few, so a shift of 0.1 in one token's probability is
    about 3 standard errors). About a minute here: the bare engine alone takes ~15 s for 400 requests."""
    prompt = _prompts(tokenizer, 1)[0]
    on, _ = _split_run(tiny_model, tokenizer, _seeded(prompt, range(400)))
    off = [r.token_ids for r in _all(bare, _seeded(prompt, range(10_000, 10_400)))]
    for pos in (0, 2):
        table = _table([Counter(t[pos] for t in on), Counter(t[pos] for t in off)])
        assert len(table[0]) >= 3, table  # outcomes enough for the test to see a shift
        assert _chi2_p(table) > 0.001, (pos, table)


def test_the_decode_instance_fetches_the_prompt_the_prefill_instance_computed(tiny_model, tokenizer, bare):
    router = make_engine(_setup(2, 1), tiny_model, tokenizer, 0)
    prompts = _prompts(tokenizer, 4)
    try:
        reqs = [_req(p, program=f"p{i}", temperature=0.0, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
        assert [r.token_ids for r in _each(router, reqs)] == [r.token_ids for r in _each(bare, reqs)]
        prefill, decode = router.instances
        pool = prefill.kv_pool.metrics
        assert prefill.metrics.prefill_tokens == sum(map(len, prompts))  # no shared prefix: all of each computed
        assert decode.metrics.prefill_tokens == len(prompts)  # only each prompt's last token
        assert pool.tokens_served == sum(len(p) - 1 for p in prompts)
        counts = router.counters().counts
        assert counts["router_pd_prefills"] == 4 and counts["router_pd_fetched_tokens"] == pool.tokens_served
        assert counts["router_placed_pd_prefill"] == 4 and counts["router_pd_discarded_tokens"] == 4
        _each(router, [_req(prompts[0][:10], temperature=0.0, max_tokens=2)])  # short: straight to decode
        assert router.split.metrics.pd_skipped == 1 and router.split.metrics.pd_prefills == 4
    finally:
        router.close()


def test_a_failed_prefill_costs_only_the_recompute(tiny_model, tokenizer, bare):
    router = make_engine(_setup(2, 1), tiny_model, tokenizer, 0)
    try:
        router.instances[0].close()  # the prefill instance is gone: decode computes the whole prompt
        reqs = [_req(p, temperature=0.0, max_tokens=6) for p in _prompts(tokenizer, 2)]
        assert [r.token_ids for r in _each(router, reqs)] == [r.token_ids for r in _each(bare, reqs)]
        assert router.split.metrics.pd_prefill_failed == 2 and router.split.metrics.pd_prefills == 0
        assert router.instances[1].metrics.prefill_tokens == sum(len(r.prompt_ids) for r in reqs)
    finally:
        router.instances[1].close()


def test_chunks_move_to_the_least_loaded_instance_and_fetch_instead_of_prefilling(tiny_model, tokenizer, bare):
    router = make_engine(_setup(3, 0, 4, router="round_robin"), tiny_model, tokenizer, 0)
    prompts = _prompts(tokenizer, 6)
    try:
        # round robin puts the two long requests on instance 0: once the short ones end, instance 0 is the busiest
        lengths = [32 if i % 3 == 0 else 8 for i in range(6)]
        reqs = [_req(p, program=f"p{i}", temperature=0.0, max_tokens=n, ignore_eos=True)
                for i, (p, n) in enumerate(zip(prompts, lengths))]
        assert [r.token_ids for r in _all(router, reqs)] == [r.token_ids for r in _all(bare, reqs)]
        m = router.split.metrics
        assert m.divided == 6 and m.chunks == sum(n // 4 - 1 for n in lengths)
        assert m.chunks_moved > 0  # a long request's later chunk ran on another instance than the one before it
        # nothing prefilled twice: each prompt once, and each later chunk only its last token (the rest from a cache)
        assert sum(e.metrics.prefill_tokens for e in router.instances) == sum(map(len, prompts)) + m.chunks
        assert router.instances[0].kv_pool.metrics.tokens_served > 0
    finally:
        router.close()


def test_a_chunks_instance_killed_mid_generation_loses_nothing(tiny_model, tokenizer):
    """Seeded, chunks of 16 of 64 tokens over 1 prefill + 2 decode instances: the decode instance running a later chunk
    is closed while it decodes; the chunk runs again on the other, and the result equals an undisturbed run's."""
    prompt = _prompts(tokenizer, 1)[0]
    req = _req(prompt, program="p", temperature=0.9, seed=11, max_tokens=64, ignore_eos=True)
    calm = make_engine(_setup(3, 1, 16), tiny_model, tokenizer, 0)
    try:
        expected = _each(calm, [req])[0]
    finally:
        calm.close()
    router = make_engine(_setup(3, 1, 16), tiny_model, tokenizer, 0)
    try:
        async def kill_a_later_chunk():
            task = asyncio.ensure_future(router.generate(req))
            victim = None
            for _ in range(20_000):
                if router.placement.placements.get("chunk", 0) >= 1:
                    busy = [i for i in (1, 2) if router.placer.loads[i].inflight]
                    if busy and router.instances[busy[0]].metrics.generated_tokens >= 16 + 2:
                        victim = busy[0]
                        break
                await asyncio.sleep(0.0005)
            assert victim is not None
            await asyncio.to_thread(router.instances[victim].close)
            return await task, victim

        result, victim = asyncio.run(kill_a_later_chunk())
        assert result.token_ids == expected.token_ids and len(result.token_ids) == 64
        assert result.versions == [0] * 64 and len(result.logprobs) == 64
        assert router.placement.retried == 1 and router.placement.retry_failed == 0
        # exactly once: the prefill and four chunks finished, the killed chunk nowhere
        assert sum(e.metrics.finished for e in router.instances) == 1 + 4
    finally:
        for e in router.instances:
            e.close()


def test_old_weights_kv_is_never_used_across_an_update_between_chunks(tiny_model, tokenizer):
    """Greedy, chunks of 8 of 16: the weights change between the two chunks (a spy on Router.attempt loads them when the
    first chunk returns); the second chunk's tokens are those the new weights give from the first chunk's output,
    computed from scratch, and the pool serves it nothing (its entry of the old version was dropped)."""
    model = copy.deepcopy(tiny_model)
    router = make_engine(_setup(2, 0, 8), model, tokenizer, 0)
    prompt = _prompts(tokenizer, 1)[0]
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    real = router.attempt
    served_before_second: list[int] = []

    async def spy(request, choose=None):
        out = await real(request, choose)
        if not served_before_second:  # the first chunk is back: load version 1 on every instance
            router.update_weights(new, 1)
            served_before_second.append(router.instances[0].kv_pool.metrics.tokens_served)
        return out

    router.attempt = spy
    old_ref = BuiltinEngine(copy.deepcopy(tiny_model), eos_token_id=tokenizer.eos_token_id)
    new_ref = BuiltinEngine(copy.deepcopy(tiny_model), eos_token_id=tokenizer.eos_token_id)
    new_ref.update_weights(new, 1)
    try:
        result = _each(router, [_req(prompt, temperature=0.0, max_tokens=16, ignore_eos=True)])[0]
        first = _each(old_ref, [_req(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)])[0].token_ids
        second = _each(new_ref, [_req(prompt + first, temperature=0.0, max_tokens=8, ignore_eos=True)])[0].token_ids
        assert result.token_ids == first + second and result.versions == [0] * 8 + [1] * 8
        pool = router.instances[0].kv_pool.metrics
        assert pool.version_drops >= 1 and pool.tokens_served == served_before_second[0]  # nothing served after
        assert router.split.metrics.chunks == 1
    finally:
        for e in (router, old_ref, new_ref):
            e.close()


def test_an_interrupted_chunk_resumes_as_an_undivided_request_does(tiny_model, tokenizer, bare):
    """A weight update's interrupt (Router.interrupt, weights unchanged: update_weights(None, 1)) during a later chunk:
    the divided request ends "interrupted" with every token so far, and generate_resuming finishes it; greedy, so the
    whole equals one bare engine's, the tokens after the update tagged version 1."""
    model = copy.deepcopy(tiny_model)
    router = make_engine(_setup(3, 1, 8), model, tokenizer, 0)
    prompt = _prompts(tokenizer, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    try:
        async def interrupt_a_later_chunk():
            task = asyncio.ensure_future(generate_resuming(router, prompt, params, program_id="p"))
            while router.placement.placements.get("chunk", 0) < 2:
                await asyncio.sleep(0.0005)
            router.interrupt()
            await asyncio.to_thread(router.update_weights, None, 1)
            return await task

        result, resumed = asyncio.run(interrupt_a_later_chunk())
        assert resumed >= 1 and result.finish_reason == "length"
        assert result.token_ids == _each(bare, [_req(prompt, temperature=0.0, max_tokens=48, ignore_eos=True)])[0].token_ids
        assert result.versions[0] == 0 and result.versions[-1] == 1 and result.versions == sorted(result.versions)
    finally:
        router.close()


def test_the_config_refuses_a_split_it_cannot_run():
    def cfg(**kw):
        base = {"instances": 3, "kv_pool_bytes": POOL}
        return EngineConfig(**(base | kw))

    with pytest.raises(ValueError, match="engine.prefill_instances=3 must be below engine.instances=3"):
        cfg(prefill_instances=3)
    with pytest.raises(ValueError, match="engine.prefill_instances needs .* engine.kv_pool_bytes > 0"):
        cfg(prefill_instances=1, kv_pool_bytes=0)
    with pytest.raises(ValueError, match="engine.chunk_tokens needs .* kv_pool_bytes 0"):
        cfg(chunk_tokens=8, kv_pool_bytes=0)
    with pytest.raises(ValueError, match="engine.chunk_tokens needs .* prefix_cache False"):
        cfg(chunk_tokens=8, prefix_cache=False)
    with pytest.raises(ValueError, match="engine.chunk_tokens needs .* instances 1"):
        cfg(chunk_tokens=8, instances=1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        cfg(chunk_tokens=0)
    assert cfg(prefill_instances=2, chunk_tokens=8).pd_min_prompt_tokens == 64
