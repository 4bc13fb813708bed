"""trainer.router_replay against the engine (config/run.py _routed_experts_recorded): the built-in engine records each
token's routed experts, and so do loomrl's vLLM engines (vLLM 0.32's enable_return_routed_experts, on a GPU: the CPU is
refused when the engine starts, engine/vllm/args.py, since the config cannot know where vLLM runs); SGLang is refused
in one line that names what its adapter lacks, so a replay run never starts on an engine whose records would not reach
the trainer."""

from __future__ import annotations

import pytest

from loomrl.config import ConfigError, load_config

MOE = ["model.kind=tiny", "model.tiny.arch=qwen3_moe", "trainer.router_replay=true", "runtime.mode=async"]


def test_replay_runs_on_the_builtin_engine():
    assert load_config(None, MOE).engine_setup().routed_experts is True


@pytest.mark.parametrize("server", [[], ["engine.vllm.base_url=http://localhost:8000"]])
def test_replay_with_vllm_loads_and_asks_the_engine_for_routed_experts(server):
    """In process and over HTTP (the server's option is checked when the adapter connects: engine/vllm/http.py). Before:
    refused ('loomrl's vLLM adapters do not pass them to the trainer yet')."""
    cfg = load_config(None, [*MOE, "engine.kind=vllm", *server])
    assert cfg.engine_setup().routed_experts is True


def test_replay_with_vllm_in_process_needs_the_prefix_cache():
    """vLLM keeps routed experts by prefix-cache block and refuses the option without it: refused at load instead."""
    with pytest.raises(ConfigError, match="needs engine.prefix_cache"):
        load_config(None, [*MOE, "engine.kind=vllm", "engine.prefix_cache=false"])


def test_replay_with_sglang_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError, match="trainer.router_replay needs engine.kind=builtin or vllm") as err:
        load_config(None, [*MOE, "engine.kind=sglang", "engine.sglang.base_url=http://localhost:30000"])
    for name in ["return_routed_experts", "--enable-return-routed-experts"]:
        assert name in str(err.value)
