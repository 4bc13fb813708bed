"""VLLMEngine: the Engine protocol over vLLM's in-process AsyncLLM (`engine.kind: vllm`), token ids in and out.

What it is: an AsyncLLM started in this process on the run's model folder (its EngineCore and workers in child
processes), driven from one loop thread of its own, so that `generate` may be awaited from any event loop and the
control calls come from any thread. Its contract (tokens, logprobs, priority, versions, interrupt, updates, sleep and
wake, fingerprints, metrics) and the vLLM settings that give it are in docs/engines.md, 'The vLLM engine's contract'.
What it is not: a client of an external vLLM server (engine/vllm/http.py) or Ray actors of its own (engine/actor.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, NoReturn

import torch

from loomrl.config import ConfigError, SpeculationConfig, VLLMConfig
from loomrl.devices import dtype_named
from loomrl.engine.adapter import Lifecycle, LoopThread, wait_control
from loomrl.engine.base import EngineFault, EngineMetrics, GenerationRequest, GenerationResult, StreamsBuckets
from loomrl.engine.bucket_feed import BucketFeed
from loomrl.engine.vllm.args import SPECULATION_ON_CPU, SPECULATION_ON_CPU_WHY, engine_args
from loomrl.engine.vllm.contract import on_cpu
from loomrl.engine.vllm.control import Control
from loomrl.engine.vllm.lora import LoopAdapters, adapter_fingerprint
from loomrl.engine.vllm.memory import KVCachePlan, Watch
from loomrl.engine.vllm.served import ServedModel, served_fingerprint
from loomrl.engine.vllm.start import START_TIMEOUT_S, import_vllm, start_error, start_llm
from loomrl.engine.vllm.stats import queue_logger
from loomrl.engine.vllm.translate import ExpertLayout, finish_reason, routed_experts, sampling_params, token_versions
from loomrl.engine.vllm.updates import Stream, checked_names, handle_update, tensor_updates
from loomrl.engine.vllm.weights import checked_weights
from loomrl.weights.adapter import AdapterMeta, is_adapter_tensor
from loomrl.weights.bucket import BucketRef
from loomrl.weights.fingerprint import Fingerprint
from loomrl.weights.handle import Transport, WeightHandle

log = logging.getLogger(__name__)


class VLLMEngine(StreamsBuckets):
    """Engine protocol implementation over AsyncLLM; generate is awaited from asyncio, the rest is thread-safe."""

    opens = frozenset({Transport.SHM, Transport.CUDA_IPC, Transport.BROADCAST})  # read in vLLM's worker (update_from)

    def __init__(self, cfg: VLLMConfig, model: ServedModel, *, dtype: str, seed: int = 0,
                 max_num_seqs: int | None = None, prefix_cache: bool = True, version: int = 0, sleep_mode: bool = False,
                 context_tokens: int | None = None, speculation: SpeculationConfig | None = None,
                 lora_rank: int | None = None, lora_targets: list[str] | None = None,
                 routed_experts: ExpertLayout | None = None):
        """`sleep_mode` (engine.sleep_while_training): vLLM's enable_sleep_mode on CUDA, and sleep may discard the
        weights (control.sleep_level); `context_tokens` (agent.max_context_tokens) sizes the K/V cache on the CPU.
        `lora_rank` (trainer.lora.rank where publish=adapter): vLLM serves adapters of that rank (update_adapter), on
        the modules `lora_targets` names.
        `routed_experts` (trainer.router_replay): the model's MoE layers (translate.py recorded_layout), whose routed
        experts vLLM records (enable_return_routed_experts, CUDA only) and each result carries.
        Raises ConfigError when that cannot fit this machine, ModelLoadError (one line) when vLLM cannot run it."""
        try:
            import_vllm()
            if speculation is not None and speculation.enabled and on_cpu():
                raise ConfigError(SPECULATION_ON_CPU)
        except BaseException:
            if model.owned:
                shutil.rmtree(model.folder, ignore_errors=True)
            raise
        self.cfg, self.model = cfg, model
        self.metrics = EngineMetrics(busy_s=0.0, queue_s=0.0)
        self._life = Lifecycle(self.metrics, version)
        args = engine_args(cfg, model=str(model.folder), dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                           prefix_cache=prefix_cache, sleep_mode=sleep_mode, cuda=torch.cuda.is_available(),
                           speculation=speculation, lora_rank=lora_rank, lora_targets=lora_targets,
                           routed_experts=routed_experts is not None)
        if "speculative_config" in args:  # counted from vLLM's per-step SpecDecodingStats (stats.py)
            self.metrics.draft_tokens = self.metrics.accepted_tokens = 0
            if on_cpu():
                log.warning("engine.vllm.engine_args.speculative_config on the CPU: %s", SPECULATION_ON_CPU_WHY)
        self._dtype = dtype_named(dtype)
        self._experts = routed_experts
        self._tasks: set[asyncio.Task] = set()  # the generate calls in flight (on the loop)
        self._stream: Stream | None = None  # a version streamed a bucket at a time (open_buckets)
        # A test-only seam (worker.py InlineUpdate.skip): names vLLM's worker receives but does not load, a load that
        # misses, so that the fingerprint check is proved to catch one. Empty in runs.
        self.skip_loading: frozenset[str] = frozenset()
        # Test-only too (False in runs): update_adapter writes the folder and tags the version but never hands the
        # adapter to vLLM, a dropped adapter, which the adapter fingerprint must catch
        self.drop_adapters = False
        self.updates_follow_wake = sleep_mode  # the colocated run's promise (control.sleep_level); tests may change it
        # the workers write the first error they log here (worker.py); _death reads it
        self._scratch = Path(tempfile.mkdtemp(prefix="loomrl-vllm-"))
        # by version, on the loop once loaded; enable_lora: the run's (lora_rank) or the user's engine_args
        self._adapters = LoopAdapters(self._scratch / "adapters", enabled=bool(args.get("enable_lora")))
        self._loop = LoopThread("loomrl-vllm-loop")
        if cfg.cpu_reserved_cores is not None:  # read by vLLM's CPU worker when it starts (inherited by children)
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(cfg.cpu_reserved_cores)
        try:
            started = self._loop.run(start_llm(args, cfg, model_name=model.name, version=version,
                                               failure_file=self._scratch / "worker-failure",
                                               context_tokens=context_tokens,
                                               stat_logger=queue_logger(self.metrics, self._life.lock)),
                                     START_TIMEOUT_S)
        except BaseException as err:
            self._loop.stop()
            error = start_error(err, self._scratch / "worker-failure", model.name)
            self._remove_files()
            if error is err:
                raise
            raise error from err
        self.kv_budget: int = started.kv_budget
        self.kv_cache: KVCachePlan | None = started.kv_cache  # on the CPU: the K/V cache asked of vLLM, per worker
        self.kv_cache_tokens = started.kv_cache_tokens  # the K/V slots vLLM made (all its blocks)
        self._watch: Watch = started.watch
        self._control = Control(started.llm, self._life, cfg)
        self.control_calls = self._control.calls  # the calls made into vLLM, newest last (tests read them)
        # import_vllm's first import leaves this frame referenced until exit (start.py): no AsyncLLM may stay in it
        del started

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._life.version

    @property
    def llm(self) -> Any:
        """The AsyncLLM (instrumentation only: scripts/gpu_smoke.py reads its config); None once closed."""
        return self._control.llm

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with self._life.lock:  # checked under the lock: a close cannot slip in between
            self._life.admit(request)
            fut = self._loop.submit(self._generate(request))
        return await asyncio.wrap_future(fut)  # a cancelled caller cancels the task, which aborts the vLLM request

    def update_weights(self, weights: dict | None, version: int) -> None:
        """Load `weights` (cast to the engine's dtype) between two steps and tag later tokens `version`; returns once
        they serve (docs/engines.md)."""
        self._life.check_open("update_weights")
        if weights is None:
            raise EngineFault("update_weights(None): in-place updates need a model shared with the trainer; vLLM holds "
                              "its own copy (engine.kind=vllm needs runtime.mode=async)")
        named = checked_weights(weights, self.model.shapes, self.model.aliases, self._life.broken)
        whole = self._control.whole([n for n, _ in named], self.model.shapes)
        updates = tensor_updates(named, self._dtype, self.cfg.weight_bucket_bytes, sorted(self.skip_loading))
        self._call(self._control.load(updates, version, whole), f"update_weights: version {version}")

    def update_from(self, handle: WeightHandle) -> None:
        """update_weights for a handle vLLM's worker reads itself (`opens`), checked here first."""
        self._life.check_open("update_weights")
        update = handle_update(handle, self.model, self._life.broken, self.opens)
        whole = self._control.whole(update["names"], self.model.shapes)
        updates = [{**update, "skip": sorted(self.skip_loading)}]
        self._call(self._control.load(updates, handle.version, whole), f"update_weights: version {handle.version}")

    def update_adapter(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> None:
        """Serve LoRA adapter `adapter` (its tensors `weights`, PEFT's names) from a folder in the scratch folder, as
        vLLM adapter `adapter.name` (AsyncLLM.add_lora, vllm/v1/engine/async_llm.py:1189); requests admitted from
        now on carry it and their tokens are `version`'s. Older adapters no request uses are removed (engine/vllm/
        lora.py)."""
        self._life.check_open("update_adapter")
        served = self._adapters.write(weights, adapter, version)
        self._call(self._adapters.add(self._control.llm, served, self._control.load_adapter, drop=self.drop_adapters),
                   f"update_adapter: {adapter.name}")

    def open_buckets(self, version: int, shapes: dict[str, list[int]]) -> None:
        self._life.check_open("update_weights")
        if self._stream is not None:
            raise EngineFault(f"open_buckets: version {version} while a streamed update is still open")
        names = checked_names(shapes, self.model, self._life.broken)
        whole = self._control.whole(names, self.model.shapes)
        feed = BucketFeed(self.cfg.update_timeout_s)
        future = self._loop.submit(self._control.load(feed, version, whole, wake_cache=False))
        self._stream = Stream(feed=feed, names=frozenset(names), future=future)

    def load_bucket(self, ref: BucketRef) -> None:
        if self._stream is None:
            raise EngineFault(f"load_bucket: bucket {ref.seq} without open_buckets")
        self._stream.put(ref, sorted(self.skip_loading))

    def close_buckets(self, failed: str = "") -> None:
        if self._stream is None:
            raise EngineFault("close_buckets without open_buckets")
        stream, self._stream = self._stream, None
        stream.feed.end(failed)
        self._wait(stream.future, "update_weights: a streamed version")

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint of vLLM's loaded weights, read in its worker (served.py served_fingerprint); of an adapter's
        tensors (expected names them), that of the adapter the current version's requests carry (lora.py)."""
        self._life.check_open("weight_fingerprint")
        if any(is_adapter_tensor(n) for n in expected.sums):
            return adapter_fingerprint(expected, self._adapters.serving(self.version), self._rpc)
        return served_fingerprint(expected, self.version, self.model.shapes, self._rpc)

    def interrupt(self) -> None:
        """Abort every in-flight request (they end "interrupted" with their partial output) and resume at once."""
        if not self._life.closed:
            self._loop.submit(self._control.interrupt())

    def release(self, program_id: str) -> None:
        """Nothing to do: vLLM's prefix cache is keyed by token blocks, not programs, and evicts on its own."""

    def sleep(self) -> None:
        """vLLM's sleep(level, mode=abort): in-flight requests end "interrupted", new ones wait (docs/engines.md)."""
        self._life.check_open("sleep")
        self._call(self._control.sleep(self.updates_follow_wake), "sleep")

    def wake(self) -> None:
        """The weights' memory back; requests wait until the next update has loaded (docs/engines.md)."""
        self._life.check_open("wake")
        self._call(self._control.wake(), "wake")

    def close(self) -> None:
        """Stop: in-flight requests fail with EngineFault, vLLM's processes end (about 5 s), the loop thread stops."""
        if not self._life.close():
            return
        try:
            self._loop.run(self._control.shutdown(self._tasks), 120.0)
        except Exception as err:  # noqa: BLE001 - closing goes on whatever vLLM says
            log.warning("vLLM shutdown: %s: %s", type(err).__name__, err)
        self._loop.stop()
        self._remove_files()

    def _remove_files(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)
        if self.model.owned:
            shutil.rmtree(self.model.folder, ignore_errors=True)

    # -- one request, on the loop -----------------------------------------------------------------
    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        task = asyncio.current_task()
        if task is None:  # a coroutine awaited on the loop runs in a task
            raise RuntimeError("VLLMEngine._generate: not running in an asyncio task")
        with self._life.running() as ticket:  # admitted by generate, on the caller's thread
            self._tasks.add(task)
            adapter, lora = self._adapters.acquire(ticket.version)  # its version's, kept while it runs (lora.py)
            try:
                final, ids, logprobs = await self._outputs(request, lora)
                return self._result(request, final, ids, logprobs, ticket.version,
                                    interrupted=self._life.interrupted(ticket), adapter=adapter is not None)
            except EngineFault:
                raise
            except Exception as err:
                self._request_failed(err)
            finally:
                self._adapters.release(adapter)
                self._tasks.discard(task)

    async def _outputs(self, request: GenerationRequest, lora: Any) -> tuple[Any, list[int], list[float]]:
        """vLLM's last output for `request` (finish reason, versions, cache hits) and the token ids and logprobs of
        all its deltas; `lora`: the LoRARequest of its version's adapter, None for the base model."""
        from vllm.inputs import TokensPrompt

        ids: list[int] = []
        logprobs: list[float] = []
        final = None
        async for out in self._control.llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                                    sampling_params(request.sampling), f"loomrl-{uuid.uuid4().hex}",
                                                    lora_request=lora, priority=request.priority):
            new = list(out.outputs[0].token_ids)
            ids += new
            logprobs += [d[t].logprob for d, t in zip(out.outputs[0].logprobs or [], new)]
            with self._life.lock:
                self.metrics.generated_tokens += len(new)
            self._life.tick()
            final = out
        if final is None:
            raise EngineFault("vLLM ended the request without an output")
        return final, ids, logprobs

    def _request_failed(self, err: Exception) -> NoReturn:
        if self._life.closed:
            raise EngineFault("the engine was closed during the request") from None
        from vllm.exceptions import VLLMClientError

        if not isinstance(err, VLLMClientError | ValueError | TypeError):  # not the request's fault
            with self._life.lock:
                self.metrics.faults += 1
        raise EngineFault(f"vLLM failed the request: {self._death() or f'{type(err).__name__}: {err}'}") from err

    def _result(self, request: GenerationRequest, final: Any, ids: list[int], logprobs: list[float], version: int, *,
                interrupted: bool, adapter: bool = False) -> GenerationResult:
        """The whole output from the accumulated deltas and the last one (finish reason, versions, cache hits). Under
        an adapter every token is `version`'s: the request carried that version's adapter throughout, and vLLM's
        weight-version spans label the base weights only. The routed experts come on the last output only (vLLM's
        output_processor.py:466), [prompt + output - 1, decoder layers, top_k]: translate.py routed_experts."""
        c = final.outputs[0]
        if len(logprobs) != len(ids):
            raise EngineFault(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
        finish = finish_reason(c.finish_reason, c.stop_reason, closed=self._life.closed, interrupted=interrupted)
        experts = routed_experts(c.routed_experts, tokens=len(request.prompt_ids) + len(ids), layout=self._experts,
                                 interrupted=finish == "interrupted")
        cached = int(final.num_cached_tokens or 0)
        with self._life.lock:
            m = self.metrics
            m.finished += 1
            m.prompt_tokens += len(request.prompt_ids)
            m.reused_tokens += cached
            m.prefill_tokens += len(request.prompt_ids) - cached
            m.interrupts += finish == "interrupted"
            m.preemptions += getattr(final.metrics, "num_preemptions", 0) or 0
        spans = None if adapter else c.weight_versions
        return GenerationResult(token_ids=ids, logprobs=logprobs, versions=token_versions(spans, len(ids), version),
                                finish_reason=finish, routed_experts=experts)

    # -- the loop thread --------------------------------------------------------------------------
    def _rpc(self, method: str, *args: Any) -> Any:
        """`method` of worker.py's WorkerExtension on tensor-parallel rank 0's worker."""
        return self._loop.run(self._control.llm.collective_rpc(method, args=args), self.cfg.update_timeout_s)[0]

    def _call(self, coro: Any, what: str) -> None:
        self._wait(self._loop.submit(coro), what)

    def _wait(self, future: concurrent.futures.Future, what: str) -> None:
        """The wait for a control call running on the loop: whatever vLLM raises becomes an EngineFault, which says how
        vLLM's worker died when it did; the wait looks for a dead worker every second, since a worker that dies while
        the engine core hands a control call to its executor leaves the call unanswered (seen in CI: 600 s)."""
        wait_control(future, what, self.cfg.update_timeout_s, death=self._death, failed=self._failed)

    def _failed(self, err: Exception, what: str) -> NoReturn:
        """Raise what a failed control call means: vLLM's death when it died, else its error as an EngineFault."""
        death = self._death()
        if death is not None:
            raise EngineFault(f"{what}: {death}") from err
        self._watch.forget()  # an error the engine lives through: not the cause of a later death
        if isinstance(err, EngineFault):
            raise err
        raise EngineFault(f"{what}: vLLM: {type(err).__name__}: {err}") from err

    def _death(self) -> str | None:
        """Why vLLM is gone (engine/vllm/memory.py: a killed worker, with its memory), None while it lives."""
        llm = self._control.llm
        return None if llm is None else self._watch.death(llm.errored)

