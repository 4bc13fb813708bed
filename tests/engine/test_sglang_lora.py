"""SGLangEngine's LoRA adapters (update_adapter) against the fake SGLang server: a CONTRACT TEST, not a test against
SGLang.

SGLang cannot run here (SGLang 0.5 on PyPI is a GPU build; no GPU here), so the adapter routes are played by the fake
of tests/engine/test_sglang_engine.py, which follows sglang 0.5.23's source (its docstring lists the routes, payloads
and error texts read there). The fake is given a real tiny model: it decodes greedily from it with the named adapter
applied by PEFT from the folder the engine wrote, so the logprobs checked here are a real model's under the published
adapter, compared with the trainer-side PEFT model's on the same tokens. What is not checked: SGLang's own LoRA kernels
and its reading of the folder (the fake reads it with PEFT).
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch

from loomrl.agent.gateway import ServerThread
from loomrl.config import SGLangConfig
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams, apply_loaded
from loomrl.engine.sglang import SGLangEngine
from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights, fingerprint_of
from loomrl.weights.handle import Transport, WeightHandle
from tests.engine.test_sglang_engine import FakeSGLang, fake_app

TARGETS = ["q_proj", "v_proj"]
RANK = 4
PROBE = [5, 17, 42, 9, 3]
LORA_ON = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


class Trainer:
    """The trainer's side: the tiny model under PEFT LoRA adapters, B drawn per version (A and B both non-zero)."""

    def __init__(self, base, tmp_path: Path):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        self.peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=8, target_modules=TARGETS))
        self.peft.eval()
        self.peft.peft_config["default"].save_pretrained(str(tmp_path / "cfg"))  # adapter_config.json, as PEFT writes
        self.config = json.loads((tmp_path / "cfg" / "adapter_config.json").read_text())

    def version(self, version: int) -> tuple[dict[str, torch.Tensor], AdapterMeta]:
        """New B values for `version`; the adapter's tensors under PEFT's saved names and its record."""
        from peft import get_peft_model_state_dict

        gen = torch.Generator().manual_seed(100 + version)
        with torch.no_grad():
            for name, p in self.peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        tensors = get_peft_model_state_dict(self.peft, adapter_name="default", save_embedding_layers=False)
        return {n: t.clone() for n, t in tensors.items()}, AdapterMeta(name=adapter_name(version), config=self.config)



def _logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """`model`'s logprobs of `tokens` after `prompt` (one teacher-forced forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def served():
    holder: dict[str, FakeSGLang] = {"fake": FakeSGLang()}

    class Proxy:  # the app reads the current test's FakeSGLang
        def __getattr__(self, name):
            return getattr(holder["fake"], name)

        def __setattr__(self, name, value):
            setattr(holder["fake"], name, value)

    server = ServerThread(fake_app(Proxy()))
    yield server, holder
    server.stop()


@pytest.fixture
def fake(served, tiny_model) -> FakeSGLang:
    fake = served[1]["fake"] = FakeSGLang()
    fake.model = tiny_model
    fake.server_args.update(LORA_ON)
    return fake


def _engine(served, tmp_path: Path, **kw) -> SGLangEngine:
    return SGLangEngine(SGLangConfig(base_url=served[0].url, retries=0, context_length=4096, **kw))


@pytest.fixture
def engine(served, fake, tmp_path):
    eng = _engine(served, tmp_path, weights_dir=str(tmp_path / "weights"))
    yield eng
    eng.close()


def _generate(engine: SGLangEngine, prompt: list[int], n: int = 6):
    return asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=n))))


def _handle(version: int, meta: AdapterMeta, tensors: dict[str, torch.Tensor]) -> WeightHandle:
    return WeightHandle(transport=Transport.QUEUE, version=version, nbytes=0, adapter=meta,
                        fingerprint=fingerprint_of(tensors))


def test_a_published_adapter_gives_the_trainers_logprobs_and_each_version_a_fresh_name(engine, fake, tiny_model,
                                                                                       tmp_path, caplog):
    """Version 1's adapter loads under loomrl-v1 from its folder, every /generate names it, and the tokens the engine
    returns carry the trainer's own logprobs (the PEFT model the tensors came from), which differ from the base
    model's; version 2 loads under loomrl-v2, then loomrl-v1 is unloaded and its folder removed. The fingerprint
    checks the server's adapter list and says, in the log, that the tensors themselves are not read back."""
    trainer = Trainer(tiny_model, tmp_path)
    base = _generate(engine, PROBE)
    assert "lora_path" not in fake.bodies["/generate"][-1]
    for version in (1, 2):
        tensors, meta = trainer.version(version)
        handle = _handle(version, meta, tensors)
        apply_loaded(engine, tensors, handle)  # the runtime's dispatch: an adapter's handle -> update_adapter
        with caplog.at_level("WARNING"):
            assert confirm_weights(engine, "sglang", version, handle.fingerprint) == 0
        assert f"names {meta.name}, loaded from" in caplog.text and "reads no LoRA adapter's tensors back" in caplog.text
        out = _generate(engine, PROBE)
        assert fake.bodies["/generate"][-1]["lora_path"] == meta.name == f"loomrl-v{version}"
        assert fake.lora_requests[-1] == meta.name
        assert out.versions == [version] * len(out.token_ids)
        assert out.logprobs == pytest.approx(_logprobs(trainer.peft, PROBE, out.token_ids), abs=1e-4)
        base_lps = _logprobs(tiny_model, PROBE, out.token_ids)  # the adapter changes them
        assert max(abs(a - b) for a, b in zip(out.logprobs, base_lps)) > 1e-2
    assert out.token_ids != base.token_ids or out.logprobs != base.logprobs
    loads = fake.bodies["/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["loomrl-v1", "loomrl-v2"]
    assert loads[1]["lora_path"] == str(tmp_path / "weights" / "adapters" / "loomrl-v2")
    assert fake.bodies["/unload_lora_adapter"] == [{"lora_name": "loomrl-v1"}]
    assert fake.calls[-6:] == ["/pause_generation", "/load_lora_adapter", "/unload_lora_adapter",
                               "/continue_generation", "/v1/models", "/generate"]
    assert list(fake.adapters) == ["loomrl-v2"]
    assert sorted(p.name for p in (tmp_path / "weights" / "adapters").iterdir()) == ["loomrl-v2"]


def test_a_load_the_server_refuses_is_an_engine_fault_with_its_message(served, fake, tiny_model, tmp_path):
    """A name the server holds already (e.g. preloaded by --lora-paths) and a folder the server cannot see: the
    update raises with SGLang's own message, the engine keeps its version, the server is not left paused."""
    tensors, meta = Trainer(tiny_model, tmp_path).version(1)
    eng = _engine(served, tmp_path, weights_dir=str(tmp_path / "w"), server_weights_dir="/not/on/the/server")
    try:
        with pytest.raises(EngineFault, match=r"did not load version 1's adapter loomrl-v1 from "
                                              r"/not/on/the/server/adapters/loomrl-v1: .*answered 400: .*Repo id must "
                                              r"be in the form"):
            eng.update_adapter(tensors, meta, 1)
        assert eng.version == 0 and not fake.paused
    finally:
        eng.close()
    fake.adapters["loomrl-v1"] = "/models/preloaded"
    eng = _engine(served, tmp_path)  # no weights_dir: a temporary folder on this machine, removed at close
    try:
        with pytest.raises(EngineFault, match="Failed to load LoRA adapter loomrl-v1 because it is already loaded"):
            eng.update_adapter(tensors, meta, 1)
        assert eng.version == 0 and not fake.paused
        folder = Path(fake.bodies["/load_lora_adapter"][-1]["lora_path"])
        assert (folder / "adapter_model.safetensors").is_file()
    finally:
        eng.close()
    assert not folder.parent.exists()


@pytest.mark.parametrize("args, why", [
    ({"enable_lora": False}, "runs without --enable-lora"),
    ({"max_lora_rank": 2}, "has --max-lora-rank 2, below the adapter's rank 4"),
    ({"lora_target_modules": ["o_proj", "down_proj"]}, "has --lora-target-modules ['down_proj', 'o_proj'], without "
                                                       "all of the adapter's ['q_proj', 'v_proj']"),
])
def test_a_server_that_cannot_load_the_adapter_is_refused_before_anything_is_sent(served, fake, tiny_model, tmp_path,
                                                                                  args, why):
    """The server's LoRA flags, as /server_info reported them at connect, checked before the first load: one line
    naming the server, what it lacks and the flags to restart it with."""
    fake.server_args.update(args)
    tensors, meta = Trainer(tiny_model, tmp_path).version(1)
    engine = _engine(served, tmp_path, weights_dir=str(tmp_path / "weights"))
    try:
        with pytest.raises(EngineFault) as err:
            engine.update_adapter(tensors, meta, 1)
    finally:
        engine.close()
    assert str(err.value) == (f"trainer.lora.publish=adapter: the SGLang server at {engine.base_url} {why}; restart it "
                              "with --enable-lora --max-lora-rank 4 --lora-target-modules q_proj v_proj "
                              "--lora-strict-loading (or publish merged weights: trainer.lora.publish=merged)")
    assert fake.calls == ["/server_info"]


def test_a_dropped_or_stale_adapter_stops_the_run_naming_the_engine(engine, fake, tiny_model, tmp_path):
    """The server answered the load but does not list the adapter (dropped), lists only the previous version's
    (stale), or lists the name loaded from another folder: confirm_weights raises WeightMismatch naming the engine's
    server and the version. An adapter name that is not its version's is refused up front."""
    trainer = Trainer(tiny_model, tmp_path)
    t1, m1 = trainer.version(1)
    t2, m2 = trainer.version(2)
    with pytest.raises(EngineFault, match="published as version 2, whose name is 'loomrl-v2'"):
        engine.update_adapter(t1, m1, 2)
    fake.forget_loads = True  # dropped: answered success, never registered
    engine.update_adapter(t1, m1, 1)
    with pytest.raises(WeightMismatch) as err:
        confirm_weights(engine, "sglang", 1, fingerprint_of(t1))
    assert str(err.value) == (f"weight sync: the SGLang engine at {engine.base_url} does not serve version 1's LoRA "
                              "adapter loomrl-v1 (GET /v1/models: it lists no adapter): the adapter did not load, was "
                              "dropped, or is an older version's")
    fake.forget_loads = False
    fake.ever_loaded.clear()
    engine.update_adapter(t1, m1, 1)
    v1_path = fake.adapters["loomrl-v1"]
    engine.update_adapter(t2, m2, 2)
    confirm_weights(engine, "sglang", 2, fingerprint_of(t2))
    fake.adapters = {"loomrl-v1": v1_path}  # stale: the server serves the previous version's adapter only
    with pytest.raises(WeightMismatch, match=r"does not serve version 2's LoRA adapter loomrl-v2 \(GET /v1/models: it "
                                             r"lists \['loomrl-v1'\]\)"):
        confirm_weights(engine, "sglang", 2, fingerprint_of(t2))
    fake.adapters = {"loomrl-v2": "/somewhere/else"}  # the right name from another folder
    with pytest.raises(WeightMismatch, match="it lists loomrl-v2 loaded from /somewhere/else, not "):
        confirm_weights(engine, "sglang", 2, fingerprint_of(t2))
