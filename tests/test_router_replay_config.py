"""trainer.router_replay against the engine (config/run.py _routed_experts_recorded): the built-in engine records each
token's routed experts; vLLM and SGLang are refused in one line that names what each lacks, so a replay run never
starts on an engine whose records would not reach the trainer."""

from __future__ import annotations

import pytest

from loomrl.config import ConfigError, load_config

MOE = ["model.kind=tiny", "model.tiny.arch=qwen3_moe", "trainer.router_replay=true", "runtime.mode=async"]


def test_replay_runs_on_the_builtin_engine():
    assert load_config(None, MOE).engine_setup().routed_experts is True


@pytest.mark.parametrize(("kind", "names"), [
    ("vllm", ["enable_return_routed_experts", "CompletionOutput.routed_experts", "Triton"]),
    ("sglang", ["return_routed_experts", "--enable-return-routed-experts"]),
])
def test_replay_with_another_engine_is_refused_naming_what_is_missing(kind, names):
    """Before: one message for both ('does not record the routed experts for loomrl yet'), which hid that vLLM 0.32
    and SGLang do return them and that loomrl's adapters are what lack."""
    extra = ["engine.sglang.base_url=http://localhost:30000"] if kind == "sglang" else []
    with pytest.raises(ConfigError, match="trainer.router_replay needs engine.kind=builtin") as err:
        load_config(None, [*MOE, f"engine.kind={kind}", *extra])
    for name in names:
        assert name in str(err.value)
