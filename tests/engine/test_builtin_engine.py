"""The built-in continuous-batching engine against transformers, with and without its prefix cache,
under preemption, across weight updates and interrupts."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from engine_checks import forward_logits, greedy_reference, token_logprobs

from loomrl.config import ModelConfig
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.prefix_cache import PrefixCache
from loomrl.engine.builtin.runner import Chunk, ModelRunner
from loomrl.engine.builtin.sampling import filter_logits
from loomrl.model.loader import build_tiny_model


def _prompts(tokenizer):
    system = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question:")
    return [system + tokenizer.encode(" what is 2 + 2?"), system + tokenizer.encode(" 7 * 8"),
            tokenizer.encode("unrelated short"), system + tokenizer.encode(" a much longer question about apples"),
            system + tokenizer.encode(" what is 2 + 2?")]


def _run(engine, prompts, program_ids=None, **sampling):
    async def go():
        return await asyncio.gather(*[
            engine.generate(GenerationRequest(prompt_ids=p, sampling=SamplingParams(**sampling),
                                              program_id=(program_ids or {}).get(i, f"p{i}")))
            for i, p in enumerate(prompts)
        ])

    return asyncio.run(go())


@pytest.fixture
def engine(tiny_model, tokenizer):
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    yield eng
    eng.close()


def test_runner_matches_a_dense_forward(tiny_model, tokenizer):
    runner = ModelRunner(tiny_model)
    a, b = tokenizer.encode("hello there my friend how are you"), tokenizer.encode("short")
    kv_a, kv_b = runner.new_kv(4), runner.new_kv(4)
    first = runner.forward([Chunk(kv_a, a[:4]), Chunk(kv_b, b)])  # prefill chunks of two sequences
    second = runner.forward([Chunk(kv_a, a[4:]), Chunk(kv_b, [7])])  # rest of a, one decode token of b
    with torch.no_grad():
        ref_a = tiny_model(torch.tensor([a])).logits[0]
        ref_b = tiny_model(torch.tensor([b + [7]])).logits[0]
    assert torch.allclose(first[0], ref_a[3], atol=1e-4) and torch.allclose(second[0], ref_a[-1], atol=1e-4)
    assert torch.allclose(first[1], ref_b[len(b) - 1], atol=1e-4) and torch.allclose(second[1], ref_b[-1], atol=1e-4)


def test_greedy_matches_transformers_and_logprobs_match_forward(engine, tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    results = _run(engine, prompts, temperature=0.0, max_tokens=12)
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_reference(tiny_model, tokenizer, p, 12)[: len(r.token_ids)]
    sampled = _run(engine, prompts, temperature=0.8, top_p=0.9, max_tokens=10, seed=1)
    for p, r in zip(prompts, sampled):
        logits = forward_logits(tiny_model, p, r.token_ids, 0.8)
        # top-p renormalises over the kept tokens, so compare against the filtered distribution
        rows = len(logits)
        filtered = filter_logits(logits, torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.9))
        kept = token_logprobs(filtered, r.token_ids)
        assert torch.allclose(kept, torch.tensor(r.logprobs), atol=1e-4)
        assert (token_logprobs(logits, r.token_ids) <= kept + 1e-6).all()


def test_prefix_cache_on_and_off_give_identical_outputs(tiny_model, tokenizer):
    prompts = _prompts(tokenizer) * 2
    on = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, prefix_cache=True)
    off = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, prefix_cache=False)
    try:
        a = _run(on, prompts, temperature=0.0, max_tokens=10)
        b = _run(off, prompts, temperature=0.0, max_tokens=10)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert on.metrics.reused_tokens > 0 and off.metrics.reused_tokens == 0
        assert on.metrics.prefill_tokens < off.metrics.prefill_tokens
        # Seeded sampling is reproducible and independent of batching and caching.
        s1 = _run(on, prompts, temperature=1.0, max_tokens=6, seed=3)
        s2 = _run(off, prompts, temperature=1.0, max_tokens=6, seed=3)
        assert [r.token_ids for r in s1] == [r.token_ids for r in s2]
    finally:
        on.close()
        off.close()


def test_top_k_one_is_greedy_and_stop_tokens_end_generation_and_are_kept(engine, tokenizer):
    prompts = _prompts(tokenizer)
    greedy = _run(engine, prompts, temperature=0.0, max_tokens=8)
    topk1 = _run(engine, prompts, temperature=1.0, top_k=1, max_tokens=8)
    assert [r.token_ids for r in greedy] == [r.token_ids for r in topk1]
    stop_at = greedy[0].token_ids[2]
    stopped = _run(engine, [prompts[0]], temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])[0]
    assert stopped.token_ids[-1] == stop_at and stopped.finish_reason == "stop"  # the stop token is kept
    assert stopped.token_ids == greedy[0].token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) <= 3


def test_multi_turn_program_reuses_its_previous_turn(engine, tokenizer):
    p = _prompts(tokenizer)[0]
    first = _run(engine, [p], program_ids={0: "prog"}, temperature=0.0, max_tokens=6)[0]
    before = engine.metrics.reused_tokens
    turn2 = p + first.token_ids + tokenizer.encode(" Result: 4. Now answer.")
    _run(engine, [turn2], program_ids={0: "prog"}, temperature=0.0, max_tokens=4)
    assert engine.metrics.reused_tokens - before >= len(p) + len(first.token_ids) - 1
    engine.release("prog")
    assert all(n.entry_program != "prog" for n in engine.cache._entries())


def test_preemption_under_a_small_kv_budget_keeps_outputs(tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    roomy = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    tight = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=70)
    try:
        a = _run(roomy, prompts, temperature=0.0, max_tokens=16)
        b = _run(tight, prompts, temperature=0.0, max_tokens=16)
        assert tight.metrics.preemptions > 0
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    finally:
        roomy.close()
        tight.close()


def test_weight_update_mid_run_switches_version_at_a_step_boundary(tokenizer):
    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        fut = eng.submit(GenerationRequest(prompt_ids=_prompts(tokenizer)[0],
                                           sampling=SamplingParams(temperature=0.0, max_tokens=400,
                                                                   stop_token_ids=[-1])))
        while eng.metrics.generated_tokens < 5:
            time.sleep(0.001)
        new = {k: v + 0.01 for k, v in model.state_dict().items() if k.endswith("down_proj.weight")}
        eng.update_weights(new, 7)
        result = fut.result(timeout=60)
        versions = result.versions
        switch = versions.index(7)
        assert switch >= 5 and set(versions[:switch]) == {0} and set(versions[switch:]) == {7}
    finally:
        eng.close()


def test_interrupt_then_resume_gives_a_complete_versioned_result(tokenizer):
    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        prompt = _prompts(tokenizer)[3]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[-1])
        fut = eng.submit(GenerationRequest(prompt_ids=prompt, sampling=params))
        while eng.metrics.generated_tokens < 4:
            time.sleep(0.001)
        eng.interrupt()
        partial = fut.result(timeout=60)
        assert partial.finish_reason == "interrupted" and 4 <= len(partial.token_ids) < 40
        eng.update_weights({k: v * 1.0 for k, v in model.state_dict().items()}, 1)
        left = SamplingParams(temperature=0.0, max_tokens=40 - len(partial.token_ids), stop_token_ids=[-1])
        rest = eng.submit(GenerationRequest(prompt_ids=prompt + partial.token_ids, sampling=left)).result(timeout=60)
        tokens = partial.token_ids + rest.token_ids
        versions = partial.versions + rest.versions
        assert len(tokens) == 40 or rest.finish_reason == "stop"
        assert set(partial.versions) == {0} and set(rest.versions) == {1} and len(versions) == len(tokens)
        whole = eng.submit(GenerationRequest(prompt_ids=prompt, sampling=params)).result(timeout=60)
        assert whole.token_ids == tokens  # same weights values, so resuming changed nothing
    finally:
        eng.close()


def test_radix_tree_match_insert_evict_release():
    from loomrl.engine.builtin.runner import SequenceKV

    def kv(n):
        s = SequenceKV(1, 1, 2, n, torch.float32)
        s.length = n
        return s

    cache = PrefixCache()
    a, b = kv(6), kv(5)
    cache.insert([1, 2, 3, 4, 5, 6], a, "pa")
    cache.insert([1, 2, 3, 9, 9], b, "pb")
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == (6, a)
    n, donor = cache.match([1, 2, 3, 9])
    assert n == 4 and donor is b
    n, donor = cache.match([1, 2, 7])
    assert n == 2 and donor in (a, b)
    assert cache.match([5, 5]) == (0, None)
    assert len(cache) == 2 and cache.release("pa") == 1
    assert cache.match([1, 2, 3, 4, 5]) == (3, b)  # only pb's path is left
    assert cache.evict_lru() and len(cache) == 0 and cache.match([1, 2, 3])[0] == 0
    assert not cache.evict_lru()


def test_call_runs_on_the_engine_thread_between_steps(engine):
    import threading

    assert engine.call(lambda: threading.current_thread().name).result(timeout=10) == "loomrl-builtin-engine"

    def boom():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        engine.call(boom).result(timeout=10)


def test_sampling_follows_the_filtered_distribution():
    from loomrl.engine.builtin.sampling import sample_tokens

    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]]).repeat(n, 1)
    params = [SamplingParams(temperature=0.7, top_k=4)] * n
    tokens, logprobs = sample_tokens(logits, params, torch.rand(n, generator=torch.Generator().manual_seed(0)))
    expected = torch.softmax(filter_logits(logits[:1] / 0.7, torch.tensor([4]), torch.tensor([1.0])), dim=-1)[0]
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert freq[3] == 0 and freq[4] == 0  # outside the top 4, and -inf
    assert torch.allclose(freq, expected, atol=0.015)
    assert torch.allclose(logprobs, expected.log()[tokens])
    # The ends of [0, 1) never select a zero-probability token.
    edge = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]]).repeat(2, 1)
    tokens, _ = sample_tokens(edge, [SamplingParams(temperature=1.0)] * 2, torch.tensor([0.0, 1.0 - 2**-24]))
    assert tokens.tolist() == [1, 3]
    greedy, lp = sample_tokens(edge[:1], [SamplingParams(temperature=0.0)], torch.tensor([0.5]))
    assert greedy.item() == 3 and abs(lp.item() - torch.log_softmax(edge[0], -1)[3].item()) < 1e-6


def test_generation_interrupted_by_a_weight_update_resumes_under_the_new_weights(tiny_model, tokenizer):
    """AReaL's interruptible rollout, as the agent loop and the gateway use it: the turn completes,
    its first tokens carry the old version and the rest the new one, in order."""
    from loomrl.engine.base import generate_resuming

    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=5)

        async def go():
            task = asyncio.ensure_future(generate_resuming(eng, tokenizer.encode("one two three"), params, "p"))
            while eng.metrics.generated_tokens < 10:
                await asyncio.sleep(0.005)
            eng.interrupt()
            eng.update_weights({k: v * 1.0 for k, v in tiny_model.state_dict().items()}, 1)
            return await task

        result, resumed = asyncio.run(go())
        assert resumed == 1 and len(result.token_ids) == 60 and result.finish_reason == "length"
        assert len(result.logprobs) == len(result.versions) == 60
        first_new = result.versions.index(1)
        assert 10 <= first_new < 60 and set(result.versions[:first_new]) == {0} and set(result.versions[first_new:]) == {1}
    finally:
        eng.close()


def test_resuming_gives_up_on_an_engine_that_interrupts_without_making_progress():
    """The resume loop is bounded: an engine that answers every request "interrupted" with no token
    (a stand-in: the built-in engine samples a token in the step that admits a request, so it cannot
    be made to do this) fails the generation with EngineFault instead of spinning forever."""
    from loomrl.engine.base import MAX_IDLE_RESUMES, EngineFault, GenerationResult, generate_resuming

    class Stuck:
        calls = 0

        async def generate(self, request):
            Stuck.calls += 1
            return GenerationResult(token_ids=[], logprobs=[], versions=[], finish_reason="interrupted")

    with pytest.raises(EngineFault, match="without producing a token"):
        asyncio.run(generate_resuming(Stuck(), [1, 2], SamplingParams(max_tokens=8)))
    assert Stuck.calls == MAX_IDLE_RESUMES


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_model, tokenizer):
    """With one running slot, requests queued behind a long one start lowest priority first and, among
    equal priorities, in arrival order (vLLM's convention)."""
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, max_running=1)
    order: list[str] = []

    async def go():
        async def one(name, priority, max_tokens):
            await eng.generate(GenerationRequest(prompt_ids=tokenizer.encode(f"request {name}"), program_id=name,
                                                 priority=priority,
                                                 sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            order.append(name)

        first = asyncio.ensure_future(one("first", 0, 40))  # holds the slot while the others queue
        await asyncio.sleep(0.05)
        rest = [one("late-low", 5, 2), one("a-high", -3, 2), one("b-mid", 0, 2), one("c-mid", 0, 2), one("d-high", -3, 2)]
        await asyncio.gather(first, *rest)

    try:
        asyncio.run(go())
    finally:
        eng.close()
    assert order == ["first", "a-high", "d-high", "b-mid", "c-mid", "late-low"]


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine, tokenizer, monkeypatch):
    """Supervision inside the engine: a forward that raises (here: injected once, standing in for an
    OOM or a kernel error) fails the requests of that step with EngineFault naming the cause; the
    engine resets and the next requests get the same outputs as before the fault."""
    from loomrl.engine.base import EngineFault

    prompts = _prompts(tokenizer)[:2]
    before = [r.token_ids for r in _run(engine, prompts, temperature=0.0, max_tokens=6)]
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("injected")
        return real(chunks)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(EngineFault, match="MemoryError: injected"):
        _run(engine, prompts, program_ids={0: "x0", 1: "x1"}, temperature=0.0, max_tokens=6)
    assert engine.metrics.faults == 1 and engine._thread.is_alive()
    after = [r.token_ids for r in _run(engine, prompts, program_ids={0: "y0", 1: "y1"}, temperature=0.0, max_tokens=6)]
    assert after == before


def test_a_failed_weight_load_raises_and_the_engine_refuses_requests_until_a_good_one(tokenizer):
    """A weight load that raises leaves the model partly loaded: update_weights raises, requests are
    refused (not served by half-loaded weights) until a later load succeeds."""
    from loomrl.engine.base import EngineFault

    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        good = {k: v.clone() for k, v in model.state_dict().items()}
        prompt = _prompts(tokenizer)[:1]
        before = _run(eng, prompt, temperature=0.0, max_tokens=6)[0].token_ids
        first, second = list(good)[:2]
        # one tensor that fits, one of the wrong shape: load_state_dict copies the first, then raises
        bad = {first: good[first] + 1.0, second: torch.zeros(3, 3)}
        with pytest.raises(EngineFault, match="loading version 1 failed"):
            eng.update_weights(bad, 1)
        assert torch.equal(model.state_dict()[first], good[first] + 1.0)  # partly loaded indeed
        with pytest.raises(EngineFault, match="no valid weights"):
            _run(eng, prompt, temperature=0.0, max_tokens=6)
        assert eng.version == 0
        eng.update_weights(good, 2)
        res = _run(eng, prompt, program_ids={0: "again"}, temperature=0.0, max_tokens=6)[0]
        assert res.token_ids == before and set(res.versions) == {2}
    finally:
        eng.close()
    with pytest.raises(EngineFault, match="closed"):
        _run(eng, prompt, temperature=0.0, max_tokens=6)


@pytest.mark.parametrize("arch, head_dim, tied", [("qwen3", 24, True), ("qwen3", None, False), ("qwen2", None, False)])
def test_other_architectures_match_transformers(tokenizer, arch, head_dim, tied):
    """Qwen3 (per-head q/k RMSNorm before the rotary embedding, a head_dim of its own) and Qwen2 (q/k/v
    biases), tied and separate embeddings: the runner's logits equal a dense forward, greedy output
    equals transformers' generate."""
    from loomrl.config import TinyModelConfig

    cfg = ModelConfig(kind="tiny", tiny=TinyModelConfig(arch=arch, head_dim=head_dim, tie_word_embeddings=tied,
                                                        init_std=0.1, seed=3))
    model = build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id).eval()
    if arch == "qwen2":  # random biases: transformers initialises them to zero, which would test nothing
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.1)
                layer.self_attn.k_proj.bias.normal_(0, 0.1)
    runner = ModelRunner(model)
    a = tokenizer.encode("hello there my friend how are you")
    kv = runner.new_kv(4)
    first = runner.forward([Chunk(kv, a[:5])])
    second = runner.forward([Chunk(kv, a[5:])])
    with torch.no_grad():
        ref = model(torch.tensor([a])).logits[0]
    assert torch.allclose(first[0], ref[4], atol=1e-4) and torch.allclose(second[0], ref[-1], atol=1e-4)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        prompts = _prompts(tokenizer)[:3]
        for p, r in zip(prompts, _run(eng, prompts, temperature=0.0, max_tokens=10)):
            assert r.token_ids == greedy_reference(model, tokenizer, p, 10)[: len(r.token_ids)]
    finally:
        eng.close()


def test_an_unsupported_model_is_refused_naming_the_feature(tokenizer):
    from loomrl.config import TinyModelConfig
    from loomrl.engine.builtin.runner import UnsupportedModel

    model = build_tiny_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(arch="qwen3")), len(tokenizer),
                             tokenizer.eos_token_id)
    model.config.sliding_window = 16
    with pytest.raises(UnsupportedModel, match="sliding-window attention"):
        ModelRunner(model)
