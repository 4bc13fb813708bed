"""The torch engine against transformers: greedy tokens, logprobs, shared-prefix batching, versions."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_checks import forward_logits, greedy_reference, token_logprobs

from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.torch_engine import TorchEngine


@pytest.fixture
def engine(tiny_model, tokenizer):
    eng = TorchEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, batch_wait_ms=20)
    yield eng
    eng.close()


def _run(engine, prompts, **sampling):
    async def go():
        return await asyncio.gather(*[
            engine.generate(GenerationRequest(prompt_ids=p, sampling=SamplingParams(**sampling))) for p in prompts
        ])

    return asyncio.run(go())


def _prompts(tokenizer):
    shared = tokenizer.encode("You are a calculator. Question:")
    return [shared + tokenizer.encode(" what is 2 + 2?"), shared + tokenizer.encode(" 7 * 8"),
            tokenizer.encode("unrelated short"), shared + tokenizer.encode(" a much longer question about apples")]


def test_greedy_matches_transformers_generate(engine, tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    results = _run(engine, prompts, temperature=0.0, max_tokens=12)
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_reference(tiny_model, tokenizer, p, 12)[: len(r.token_ids)]
        assert r.finish_reason in ("stop", "length")


def test_logprobs_match_a_full_forward_pass(engine, tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    for temperature in (0.0, 0.7):
        results = _run(engine, prompts, temperature=temperature, max_tokens=10)
        for p, r in zip(prompts, results):
            ref = token_logprobs(forward_logits(tiny_model, p, r.token_ids, temperature), r.token_ids)
            assert torch.allclose(ref, torch.tensor(r.logprobs), atol=1e-4)


def test_shared_prefix_batch_equals_one_by_one(engine, tokenizer):
    prompts = _prompts(tokenizer)
    batched = _run(engine, prompts, temperature=0.0, max_tokens=10)
    alone = [_run(engine, [p], temperature=0.0, max_tokens=10)[0] for p in prompts]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


def test_prefix_is_shared_when_all_prompts_share_it(engine, tokenizer):
    shared = tokenizer.encode("A long shared system prompt with several words in it.")
    prompts = [shared + tokenizer.encode(f" q{i}") for i in range(4)]
    _run(engine, prompts, temperature=0.0, max_tokens=2)
    assert engine.stats.prefill_tokens < engine.stats.prompt_tokens


def test_top_k_one_is_greedy_and_stop_tokens_end_generation(engine, tokenizer):
    prompts = _prompts(tokenizer)
    greedy = _run(engine, prompts, temperature=0.0, max_tokens=8)
    topk1 = _run(engine, prompts, temperature=1.0, top_k=1, max_tokens=8)
    assert [r.token_ids for r in greedy] == [r.token_ids for r in topk1]
    stop_at = greedy[0].token_ids[2]
    stopped = _run(engine, [prompts[0]], temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])[0]
    assert stopped.token_ids[-1] == stop_at and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) <= 3


def test_weight_update_switches_version_between_batches(tokenizer):
    from loomrl.config import ModelConfig
    from loomrl.model.loader import build_tiny_model

    tiny_model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)  # private copy
    engine = TorchEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    p = _prompts(tokenizer)[0]
    first = _run(engine, [p], temperature=0.0, max_tokens=4)[0]
    assert set(first.versions) == {0}
    new = {k: v.clone() + 0.01 for k, v in tiny_model.state_dict().items() if k.endswith("mlp.down_proj.weight")}
    engine.update_weights(new, 3)
    second = _run(engine, [p], temperature=0.0, max_tokens=4)[0]
    assert set(second.versions) == {3} and engine.version == 3
    got = dict(tiny_model.state_dict())
    assert all(torch.equal(got[k], v) for k, v in new.items())
    engine.close()
