"""Mixture-of-experts models in the built-in engine: tiny Qwen3-MoE, Mixtral and OLMoE shapes compute what
transformers computes, and the routed experts the engine records for every token equal transformers' own routing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engine_checks import greedy_reference

from loomrl.config import ModelConfig, TinyModelConfig
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.runner import Chunk, ModelRunner, SequenceKV
from loomrl.model.loader import build_tiny_model

ARCHS = ["qwen3_moe", "mixtral", "olmoe"]


def _moe_model(tokenizer, arch: str, **tiny):
    # init_std 0.1: a peaked router (at 0.02 the experts' probabilities are near ties, which tests little)
    cfg = ModelConfig(kind="tiny", tiny=TinyModelConfig(arch=arch, init_std=0.1, seed=5, num_experts=4,
                                                        num_experts_per_tok=2, **tiny))
    return build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id).eval()


def _prompts(tokenizer) -> list[list[int]]:
    system = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question:")
    return [system + tokenizer.encode(" what is 2 + 2?"), system + tokenizer.encode(" 7 * 8"),
            tokenizer.encode("unrelated short")]


def _run(engine, prompts, **sampling):
    async def go():
        return await asyncio.gather(*[
            engine.generate(GenerationRequest(prompt_ids=p, sampling=SamplingParams(**sampling), program_id=f"p{i}"))
            for i, p in enumerate(prompts)])

    return asyncio.run(go())


def hf_routing(model, ids: list[int]) -> torch.Tensor:
    """transformers' own top-k expert ids of every token of `ids`, per MoE layer: [tokens, layers, top_k], read from
    each router's output (its third value: the indices its experts are run with) by forward hooks."""
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "experts")]  # MoE layers only
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_shapes_match_transformers_forward_and_greedy_generate(tokenizer, arch):
    """The runner's logits over a chunked prefill and a decode token equal a dense HF forward; the engine's greedy
    outputs, batched, equal HF's generate. Before MoE support: the config refused the arch (and ModelRunner raised
    UnsupportedModel for an MLP without gate_proj)."""
    model = _moe_model(tokenizer, arch)
    runner = ModelRunner(model)
    a = tokenizer.encode("hello there my friend how are you today, said the calculator")
    kv = runner.new_kv(4)
    first = runner.forward([Chunk(kv, a[:7])])
    second = runner.forward([Chunk(kv, a[7:-1])])
    third = runner.forward([Chunk(kv, a[-1:])])
    with torch.no_grad():
        ref = model(torch.tensor([a])).logits[0]
    for got, want in ((first[0], ref[6]), (second[0], ref[-2]), (third[0], ref[-1])):
        assert torch.allclose(got, want, atol=1e-4)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        prompts = _prompts(tokenizer)
        for p, r in zip(prompts, _run(eng, prompts, temperature=0.0, max_tokens=10)):
            assert r.token_ids == greedy_reference(model, tokenizer, p, 10)[: len(r.token_ids)]
            assert r.routed_experts is None  # not asked for
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_experts_equal_transformers_routing_prefix_cache_hits_included(tokenizer, arch):
    """Every position of prompt + output but the last token: the engine's recorded experts equal HF's router's top-k,
    greedy and sampled, for prompts whose shared system prefix came from the prefix cache (computed by an earlier
    request) and for a program's next turn that reuses its previous turn's K/V. The record is uint8, 4 bytes a token
    (2 MoE layers x top-2 x 1 byte)."""
    model = _moe_model(tokenizer, arch)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, return_routed_experts=True)
    try:
        prompts = _prompts(tokenizer)
        results = _run(eng, prompts[:1], temperature=0.0, max_tokens=8)  # fills the cache with the system prompt
        results += _run(eng, prompts[1:], temperature=0.0, max_tokens=8)
        results += _run(eng, prompts, temperature=0.9, max_tokens=8, seed=3)
        assert eng.metrics.reused_tokens > 0  # some prompts' experts came with cached K/V
        turn2 = prompts[0] + results[0].token_ids + tokenizer.encode(" and then?")
        reused = eng.metrics.reused_tokens
        results += _run(eng, [turn2], temperature=0.0, max_tokens=6)  # program p0's next turn
        assert eng.metrics.reused_tokens - reused >= len(prompts[0])
        for prompt, r in zip([*prompts, *prompts, turn2], results):
            rec = r.routed_experts
            assert rec is not None and rec.dtype == "uint8" and rec.layers == (0, 1) and rec.top_k == 2
            assert rec.bytes_per_token == 4 and len(rec.data) == 4 * rec.tokens
            seq = prompt + r.token_ids
            assert rec.tokens == len(seq) - 1
            assert torch.equal(rec.tensor(), hf_routing(model, seq[:-1]))
    finally:
        eng.close()


def test_dense_models_record_none_and_a_prefix_without_routing_reads_unknown(tiny_model, tokenizer):
    """A dense model asked for routing records None. An MoE sequence whose prefix came from a donor that keeps no
    routing (a shared K/V pool's entry) marks those rows unknown (the dtype's max; -1 in tensor()), and the rows it
    computed itself equal HF's routing."""
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, return_routed_experts=True)
    try:
        assert _run(eng, _prompts(tokenizer)[:1], temperature=0.0, max_tokens=4)[0].routed_experts is None
    finally:
        eng.close()
    model = _moe_model(tokenizer, "qwen3_moe")
    runner = ModelRunner(model, record_experts=True)
    ids = _prompts(tokenizer)[0]
    source = runner.new_kv(4)
    runner.forward([Chunk(source, ids)])
    donor = SequenceKV(runner.n_layers, runner.n_kv_heads, runner.head_dim, len(ids), runner.dtype)  # K/V only
    donor.copy_prefix(source, len(ids))
    kv = runner.new_kv(4)
    kv.copy_prefix(donor, 10)
    runner.forward([Chunk(kv, ids[10:])])
    rec = runner.routed_experts(kv, len(ids))
    assert rec is not None and rec.tokens == len(ids)
    assert (rec.array()[:10] == np.iinfo(np.uint8).max).all() and (rec.tensor()[:10] == -1).all()
    assert torch.equal(rec.tensor()[10:], hf_routing(model, ids)[10:])


def test_routing_survives_preemption_and_sparse_layers_only_are_recorded(tokenizer):
    """Under a KV budget that preempts (sequences re-prefilled from prompt + sampled tokens), greedy outputs and their
    recorded experts still equal HF's; a Qwen3-MoE with a dense layer (mlp_only_layers) records its MoE layer only."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    model = _moe_model(tokenizer, "qwen3_moe", num_hidden_layers=3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        dense = Qwen3MoeMLP(model.config, intermediate_size=model.config.intermediate_size)
        for p in dense.parameters():
            torch.nn.init.normal_(p, std=0.1)
    model.model.layers[1].mlp = dense
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=70, return_routed_experts=True)
    try:
        prompts = _prompts(tokenizer)
        results = _run(eng, prompts, temperature=0.0, max_tokens=16)
        assert eng.metrics.preemptions > 0
        for p, r in zip(prompts, results):
            assert r.token_ids == greedy_reference(model, tokenizer, p, 16)[: len(r.token_ids)]
            rec = r.routed_experts
            assert rec is not None and rec.layers == (0, 2) and rec.tokens == len(p) + len(r.token_ids) - 1
            assert torch.equal(rec.tensor(), hf_routing(model, (p + r.token_ids)[:-1]))
    finally:
        eng.close()


def test_routing_with_speculative_decoding_drops_rejected_drafts_experts(tokenizer):
    """Grouped speculation (siblings' tokens as drafts, some rejected: sampled siblings differ): the record of each
    sequence equals HF's routing of what it kept, never a rejected draft's."""
    from loomrl.config.engine import SpeculationConfig

    model = _moe_model(tokenizer, "mixtral")
    with torch.no_grad():  # peaked next-token distributions: sampled siblings agree often, not always
        model.model.norm.weight.mul_(20.0)
    eng = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, speculation=SpeculationConfig(enabled=True),
                        return_routed_experts=True)
    prompts = [tokenizer.encode(f"Question {i}: what is {i} plus {2 * i}? Answer:") for i in range(2)]
    requests = [GenerationRequest(prompt_ids=p, group_id=f"g{i}", program_id=f"g{i}-{j}",
                                  sampling=SamplingParams(temperature=0.7, max_tokens=24, seed=j, ignore_eos=True))
                for i, p in enumerate(prompts) for j in range(4)]

    async def go():
        return await asyncio.gather(*[eng.generate(r) for r in requests])

    try:
        results = asyncio.run(go())
        assert eng.metrics.draft_tokens and eng.metrics.accepted_tokens < eng.metrics.draft_tokens  # some rejected
    finally:
        eng.close()
    for req, r in zip(requests, results):
        seq = req.prompt_ids + r.token_ids
        assert r.routed_experts is not None and r.routed_experts.tokens == len(seq) - 1
        assert torch.equal(r.routed_experts.tensor(), hf_routing(model, seq[:-1]))
