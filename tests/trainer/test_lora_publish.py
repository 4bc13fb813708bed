"""Adapter-only publishing (trainer.lora publish=adapter): the trainer sends the LoRA adapter's tensors alone
(trainer/adapter_publish.py), the handle names the adapter, and the built-in engine merges it onto its base weights
(engine/builtin/adapter.py), confirmed by the weight fingerprint.

Tiny float32 Llama and Qwen2 models from a config, their matrices redrawn at std 0.2 (a wrong merge moves logprobs
visibly), every adapter's B drawn non-zero; real publishers (queue, shm), the real engine and the real fingerprint check.
The dropped-adapter case replaces the engine's merge with a no-op (a test double: nothing real drops an adapter on
purpose); everything else is real.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_lora_models import spread_tiny

from loomrl.config import ModelConfig, TrainerConfig, load_config
from loomrl.config.base import ConfigError
from loomrl.config.trainer import LoraConfig
from loomrl.engine.base import GenerationRequest, SamplingParams, apply_loaded
from loomrl.engine.builtin.adapter import AdapterMerge
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.model.adapter import ADAPTER
from loomrl.trainer.adapter_publish import AdapterSource
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample
from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights
from loomrl.weights.transports import load_weights, make_publisher

LORA = LoraConfig(rank=4, alpha=8)
PROBE = [5, 17, 33, 2, 91, 40, 7, 12]
ATOL = 2e-4  # the engine's own kernels (fused, packed projections) against the trainer's HF forward, float32


def _tiny(tokenizer, arch: str):
    return spread_tiny(len(tokenizer), tokenizer.eos_token_id, arch)


def _trained(tokenizer, arch: str) -> Trainer:
    """A LoRA trainer on the tiny base, its Bs drawn non-zero, after one step (A and B both moved)."""
    trainer = Trainer(_tiny(tokenizer, arch), TrainerConfig(lora=LORA, lr=1e-2))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in trainer.lora.layers.values():
            b = layer.lora_B[ADAPTER].weight
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    ids = PROBE + [3, 9, 27, 81]
    mask = [0] * len(PROBE) + [1] * 4
    sample = TrainingSample(trajectory_id="t", group_id="g", token_ids=ids, loss_mask=mask,
                            behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids), advantages=mask)
    at = iter(token_logprobs(trainer.model, [sample], with_grad=False)[0].tolist())  # one per loss-masked token
    sample.behaviour_logprobs = [next(at) if m else 0.0 for m in mask]
    trainer.train_step([sample])
    return trainer


def _greedy(engine: BuiltinEngine) -> tuple[list[int], list[float]]:
    request = GenerationRequest(prompt_ids=PROBE, sampling=SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True))
    out = asyncio.run(engine.generate(request))
    return out.token_ids, out.logprobs


def _trainer_logprobs(trainer: Trainer, tokens: list[int]) -> torch.Tensor:
    """The trainer's forward under the adapter: logprobs of `tokens` after PROBE."""
    ids = PROBE + tokens
    sample = TrainingSample(trajectory_id="p", group_id="p", token_ids=ids, loss_mask=[0] * len(PROBE) + [1] * len(tokens),
                            behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids), advantages=[0.0] * len(ids))
    return token_logprobs(trainer.model, [sample], with_grad=False)[0]  # one per loss-masked token


def _engine(tokenizer, arch: str) -> BuiltinEngine:
    return BuiltinEngine(_tiny(tokenizer, arch), eos_token_id=tokenizer.eos_token_id, prefix_cache=False)


@pytest.mark.parametrize(("arch", "transport"), [("llama", "queue"), ("qwen2", "shm")])
def test_a_published_adapter_serves_what_the_trainer_computes(tokenizer, arch, transport):
    """(a) and (c): only the adapter's tensors travel (the handle's bytes are theirs), the handle names the adapter
    of its version, the engine merges it and passes the fingerprint check, and its greedy logprobs on a probe equal
    the trainer's forward under the adapter and those of an engine given the merged weights."""
    trainer = _trained(tokenizer, arch)
    publisher = make_publisher(transport, keep=1)
    try:
        handle = publisher.publish(AdapterSource(trainer.lora, 1, None, 1 << 12), 1)
        loaded = load_weights(handle)
    finally:
        publisher.close()
    adapter_params = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert handle.adapter is not None and handle.adapter.name == adapter_name(1) == "loomrl-v1"
    assert handle.adapter.rank == LORA.rank and handle.adapter.scale == LORA.alpha / LORA.rank
    assert handle.nbytes == sum(p.numel() * p.element_size() for p in adapter_params.values())
    assert len(loaded.weights) == len(adapter_params) and all("lora_" in n for n in loaded.weights)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in loaded.weights

    engine, merged = _engine(tokenizer, arch), _engine(tokenizer, arch)
    try:
        apply_loaded(engine, loaded.weights, handle)
        assert confirm_weights(engine, "builtin", 1, handle.fingerprint) == len(adapter_params)
        merged.update_weights({n: t for b in trainer.lora.merged_source(None, 1 << 20).buckets() for n, t in b}, 1)
        tokens, got = _greedy(engine)
        want = _trainer_logprobs(trainer, tokens)
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=ATOL)
        assert _greedy(merged)[0] == tokens
        torch.testing.assert_close(torch.tensor(_greedy(merged)[1]), torch.tensor(got), rtol=0, atol=ATOL)
        # a second version merges onto the base, not onto the first merge
        trainer.lora.parameters()[0].data.add_(0.05)
        second = AdapterSource(trainer.lora, 2, None, 1 << 20)
        engine.update_adapter({n: t.clone() for b in second.buckets() for n, t in b}, second.adapter, 2)
        tokens2, got2 = _greedy(engine)
        torch.testing.assert_close(torch.tensor(got2), _trainer_logprobs(trainer, tokens2), rtol=0, atol=ATOL)
    finally:
        engine.close()
        merged.close()


def _published(trainer: Trainer, version: int):
    publisher = make_publisher("queue", keep=1)
    handle = publisher.publish(AdapterSource(trainer.lora, version, None, 1 << 20), version)
    return handle, load_weights(handle).weights


def test_a_dropped_or_stale_adapter_stops_the_run_naming_the_engine(tokenizer, monkeypatch):
    """(b): an adapter the engine never merged, and one of an older version still served (under its own name or
    under the new one), each raise WeightMismatch naming the engine through confirm_weights."""
    trainer = _trained(tokenizer, "llama")
    h1, w1 = _published(trainer, 1)
    trainer.lora.parameters()[0].data.add_(0.05)
    h2, w2 = _published(trainer, 2)
    engine = _engine(tokenizer, "llama")
    try:
        apply_loaded(engine, w1, h1)
        assert confirm_weights(engine, "builtin", 1, h1.fingerprint) > 0
        # stale: version 1's adapter still served while the engine is told version 2
        engine.update_adapter(w1, h1.adapter, 2)
        with pytest.raises(WeightMismatch, match=r"engine builtin did not load version 2 as published: \d+ of \d+ "
                                                 r"fingerprinted tensors differ .*the engine has no such tensor"):
            confirm_weights(engine, "builtin", 2, h2.fingerprint)
        # stale tensors under the new name: their sums differ
        engine.update_adapter(w1, h2.adapter, 2)
        with pytest.raises(WeightMismatch, match="engine builtin did not load version 2 as published: 1 of"):
            confirm_weights(engine, "builtin", 2, h2.fingerprint)
        # dropped: the merge never happens (the engine keeps version 1's adapter, and says version 3)
        monkeypatch.setattr(AdapterMerge, "apply", lambda self, weights, adapter: None)
        engine.update_adapter(w2, AdapterMeta(name=adapter_name(3), config=h2.adapter.config), 3)
        with pytest.raises(WeightMismatch, match="engine builtin did not load version 3"):
            confirm_weights(engine, "builtin", 3, h2.fingerprint)
    finally:
        engine.close()


def test_a_merge_that_did_not_reach_the_weights_is_caught(tokenizer):
    """The fingerprint also recomputes a sample of each merged linear's rows from the base and the adapter: a served
    weight changed after the merge (a merge that did not reach it) leaves that module's tensors out."""
    trainer = _trained(tokenizer, "llama")
    h1, w1 = _published(trainer, 1)
    engine = _engine(tokenizer, "llama")
    try:
        apply_loaded(engine, w1, h1)
        with torch.no_grad():
            engine.model.model.layers[1].mlp.down_proj.weight.copy_(engine.adapters.base["model.layers.1.mlp."
                                                                                         "down_proj.weight"])
        with pytest.raises(WeightMismatch, match=r"2 of \d+ fingerprinted tensors differ \(base_model.model.model."
                                                 r"layers.1.mlp.down_proj.lora_A.weight"):
            confirm_weights(engine, "builtin", 1, h1.fingerprint)
    finally:
        engine.close()


def test_transports_the_engine_opens_itself_refuse_an_adapter(tmp_path):
    base = [f"output_dir={tmp_path}", "model.kind=tiny", "runtime.mode=async", "trainer.lora.rank=4"]
    with pytest.raises(ConfigError, match=r"runtime.weight_transport=cuda_ipc cannot carry a LoRA adapter"):
        load_config(None, [*base, "runtime.weight_transport=cuda_ipc"])
    with pytest.raises(ConfigError, match=r"runtime.backend=ray sends weights through Ray's object store"):
        load_config(None, [*base, "runtime.backend=ray"])
    assert load_config(None, [*base, "runtime.weight_transport=cuda_ipc", "trainer.lora.publish=merged"])


@pytest.mark.integration
def test_an_async_lora_run_publishes_adapters_to_the_builtin_engine(tmp_path):
    """(d): a short async run (tiny model, trainer.lora, the default publish=adapter, shm): every version reaches the
    engine as an adapter, is confirmed by its fingerprint (every A and B of the adapter), and the step metrics report
    the adapter's bytes and the version the engine serves."""
    from pathlib import Path

    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train

    recipe = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
    cfg = load_config(recipe, [f"output_dir={tmp_path}", "progress=false", "name=lora-adapter",
                               "reward.function=rewards_for_tests:parity_reward", "trainer.lora.rank=4",
                               "trainer.total_steps=2", "eval.n_tasks=0", "checkpoint_every=0",
                               "trainer.group_size=2", "agent.max_turns=1", "sampling.max_tokens=6"])
    assert cfg.trainer.lora is not None and cfg.trainer.lora.publish == "adapter"
    assert train(cfg)["steps"] == 2
    synced = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "weight_sync/bytes" in m]
    assert synced and all("weight_sync/adapter_bytes" in m for m in synced)
    # tiny Llama: 2 layers x 7 linears x (A, B), in float32 (the engine's dtype)
    assert all(m["weight_sync/fingerprinted"] == 28 for m in synced)
    assert all(m["weight_sync/adapter_bytes"] == m["weight_sync/bytes"] < 200_000 for m in synced)
    assert synced[-1]["weight_sync/adapter_version"] >= 1


@pytest.mark.integration
def test_a_resumed_runs_engine_starts_from_the_base_under_adapter_publishing(tmp_path, tokenizer):
    """Resuming from a LoRA checkpoint: with publish=adapter the local engine holds the base (the trainer's first
    version brings the checkpoint's adapter, merged onto it); a merged model there would have it merged twice. With
    publish=merged the engine starts from the checkpoint's merged model, as before."""
    from loomrl.model.loader import load_run_model
    from loomrl.run_folder import CheckpointFolder
    from loomrl.runtime.local import LocalRollouts

    def engine_weights(publish: str) -> dict[str, torch.Tensor]:
        cfg = load_config(None, [f"output_dir={tmp_path}", "name=resume", "model.kind=tiny", "runtime.mode=async",
                                 "trainer.lora.rank=4", f"trainer.lora.publish={publish}", "eval.n_tasks=0"])
        rollouts = LocalRollouts(cfg, ckpt)

        async def started() -> dict[str, torch.Tensor]:
            await rollouts.start()
            try:
                return {n: p.detach().clone() for n, p in rollouts.side().engine.model.named_parameters()}
            finally:
                await rollouts.close()
        return asyncio.run(started())

    base_cfg = ModelConfig(kind="tiny")
    trainer = Trainer(load_run_model(base_cfg, None, trainer=TrainerConfig())[0], TrainerConfig(lora=LORA))
    with torch.no_grad():
        for p in trainer.lora.parameters():
            p.add_(0.05)  # a trained adapter's stand-in (B non-zero)
    ckpt = tmp_path / "resume" / "step_000001"
    trainer.lora.save(CheckpointFolder(ckpt).model)
    base = dict(load_run_model(base_cfg, None)[0].named_parameters())
    on_adapter, on_merged = engine_weights("adapter"), engine_weights("merged")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(torch.equal(t, base[n]) for n, t in on_adapter.items())
    assert not torch.equal(on_merged[name], base[name])
