"""Runners whose models share weight tensors share the fused and packed linears derived from them, and an update of
one engine's weights never changes what another serves (loomrl/engine/builtin/linears.py). Tiny random models built
from a config, real PEFT adapters, the real engine; references are transformers' forward passes."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_checks import greedy_reference, run_requests

from loomrl.config import ModelConfig
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.runner import Chunk, ModelRunner
from loomrl.model.adapter import merge_adapter, shared_adapter_model
from loomrl.model.loader import build_tiny_model
from loomrl.weights.adapter import AdapterMeta, adapter_name

TARGETS = ["q_proj", "v_proj"]


def _model(tokenizer, seed: int = 0):
    cfg = ModelConfig(kind="tiny", tiny={"seed": seed, "tie_word_embeddings": False})
    return build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id)


def _sharing_linears(model):
    """A copy of `model` whose every nn.Linear weight and bias IS `model`'s (the same tensors); the rest its own."""
    shared = [t for m in model.modules() if isinstance(m, torch.nn.Linear) for t in m.parameters()]
    return copy.deepcopy(model, {id(t): t for t in shared})


def _adapter(base, folder, seed: int):
    from peft import LoraConfig, get_peft_model

    from loomrl.model.adapter import quiet_peft

    with torch.random.fork_rng(), quiet_peft():
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS,
                                                               init_lora_weights=False))
        peft.save_pretrained(str(folder))
    return folder


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The runner's logits of every position of `prompt` ([len, V])."""
    return runner.forward([Chunk(runner.new_kv(len(prompt)), prompt, logits=len(prompt))])


def _reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def test_adapter_runners_share_the_linears_of_untargeted_weights_only(tokenizer, tmp_path):
    """Two adapters (LoRA on q and v) over one base, as `loomrl serve --adapter` builds them: every runner's o, gate/up,
    down and LM head are one object; each qkv is its own (q and v differ); each computes its PEFT-merged model."""
    base = _model(tokenizer)
    folders = [_adapter(base, tmp_path / f"a{s}", s) for s in (1, 2)]
    runners = [ModelRunner(base, share_linears=True),
               *(ModelRunner(shared_adapter_model(base, f), share_linears=True) for f in folders)]
    r0, r1, r2 = runners
    for i in range(len(r0.layers)):
        for name in ("o", "gate_up", "down"):
            assert getattr(r1.layers[i], name) is getattr(r0.layers[i], name) is getattr(r2.layers[i], name), name
        assert r1.layers[i].qkv is not r0.layers[i].qkv and r1.layers[i].qkv is not r2.layers[i].qkv
    assert r1.head is r0.head is r2.head
    prompt = tokenizer.encode("The capital of France is")
    for runner, ref in zip(runners, (base, *(merge_adapter(copy.deepcopy(base), f) for f in folders))):
        assert torch.allclose(_logits(runner, prompt), _reference(ref, prompt), atol=1e-4)


def test_an_update_of_shared_weights_rebuilds_the_updated_engines_linears_and_leaves_the_other_serving(tokenizer):
    """Engines A and B over models sharing every linear's tensors share their packed linears; A loads new linear
    weights (update_weights writes them into the shared tensors, in place): A serves the new weights (no stale packed
    copy), B still serves exactly what it served (its packed copies were never written)."""
    model_a = _model(tokenizer)
    model_b, before = _sharing_linears(model_a), copy.deepcopy(model_a)
    new = {n: t for n, t in _model(tokenizer, seed=5).state_dict().items()
           if n.endswith("proj.weight") or n == "lm_head.weight"}
    prompts = [tokenizer.encode("hello there my friend"), tokenizer.encode("count: 1 2 3")]
    a, b = (BuiltinEngine(m, eos_token_id=tokenizer.eos_token_id, share_linears=True) for m in (model_a, model_b))
    try:
        assert a.runner.layers[0].o is b.runner.layers[0].o and a.runner.head is b.runner.head
        served = [r.token_ids for r in run_requests(b, prompts, temperature=0.0, max_tokens=8)]
        a.update_weights(new, 1)
        assert a.runner.layers[0].o is not b.runner.layers[0].o and a.runner.head is not b.runner.head
        after = copy.deepcopy(before)
        after.load_state_dict(new, strict=False)
        for p, r in zip(prompts, run_requests(a, prompts, temperature=0.0, max_tokens=8)):
            assert r.token_ids == greedy_reference(after, tokenizer, p, 8)[: len(r.token_ids)]
        again = [r.token_ids for r in run_requests(b, prompts, temperature=0.0, max_tokens=8)]
        assert again == served == [greedy_reference(before, tokenizer, p, 8)[: len(s)] for p, s in zip(prompts, served)]
    finally:
        a.close()
        b.close()


def test_an_adapter_merged_into_shared_weights_rebuilds_only_the_targeted_linears(tokenizer):
    """update_adapter on engine A (LoRA on q and v) over a model sharing every linear with B's: A's qkv is rebuilt,
    its o, gate/up, down and head stay the ones B holds; A computes base + the merged delta."""
    model_a = _model(tokenizer)
    model_b = _sharing_linears(model_a)
    a, b = (BuiltinEngine(m, eos_token_id=tokenizer.eos_token_id, share_linears=True) for m in (model_a, model_b))
    try:
        gen = torch.Generator().manual_seed(3)
        weights = {}
        for i, layer in enumerate(model_a.model.layers):
            for proj in TARGETS:
                lin = getattr(layer.self_attn, proj)
                prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
                weights[f"{prefix}.lora_A.weight"] = torch.randn(4, lin.in_features, generator=gen) * 0.1
                weights[f"{prefix}.lora_B.weight"] = torch.randn(lin.out_features, 4, generator=gen) * 0.1
        merged = copy.deepcopy(model_a)
        with torch.no_grad():
            for name, param in merged.named_parameters():
                key = f"base_model.model.{name.removesuffix('.weight')}"
                if f"{key}.lora_A.weight" in weights:
                    param += 4.0 * weights[f"{key}.lora_B.weight"] @ weights[f"{key}.lora_A.weight"]
        meta = AdapterMeta(name=adapter_name(1), config={"r": 4, "lora_alpha": 16, "target_modules": TARGETS})
        a.update_adapter(weights, meta, 1)
        for la, lb in zip(a.runner.layers, b.runner.layers):
            assert la.qkv is not lb.qkv and la.o is lb.o and la.gate_up is lb.gate_up and la.down is lb.down
        assert a.runner.head is b.runner.head
        prompt = tokenizer.encode("The capital of France is")
        assert torch.allclose(_logits(a.runner, prompt), _reference(merged, prompt), atol=1e-4)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("write", ["copy_", "data"])
def test_a_write_the_version_counter_misses_is_not_served_stale(tokenizer, write):
    """A write through `.data` leaves the tensor's _version as it was (as a fused AdamW step does): refresh still
    rebuilds what it changed (the stamp), and keeps what it did not."""
    model = _model(tokenizer)
    runner = ModelRunner(model, share_linears=True)
    o0, qkv0 = runner.layers[0].o, runner.layers[0].qkv
    weight = model.model.layers[0].self_attn.o_proj.weight
    version = weight._version
    with torch.no_grad():
        target = weight.data if write == "data" else weight
        target.copy_(torch.randn_like(weight))
    assert (weight._version == version) == (write == "data")
    runner.refresh()
    assert runner.layers[0].o is not o0 and runner.layers[0].qkv is qkv0
    prompt = tokenizer.encode("hello there my friend")
    assert torch.allclose(_logits(runner, prompt), _reference(model, prompt), atol=1e-4)


def test_runners_share_nothing_unless_asked(tokenizer):
    """A training run's engine never shares (nor stamps): two runners over one model, made without share_linears, each
    build their own linears; with it, they share them."""
    model = _model(tokenizer)
    plain = [ModelRunner(model) for _ in range(2)]
    assert plain[0].layers[0].o is not plain[1].layers[0].o and plain[0].head is not plain[1].head
    shared = [ModelRunner(model, share_linears=True) for _ in range(2)]
    assert shared[0].layers[0].o is shared[1].layers[0].o and shared[0].head is shared[1].head
