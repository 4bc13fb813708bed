"""The Engine protocol: token ids in; token ids, logprobs and policy versions out.

Names follow vLLM's SamplingParams where they exist (temperature, top_p, top_k, max_tokens,
stop_token_ids) so that a vLLM/SGLang engine can sit behind the same protocol later. The protocol
declares everything the runtime, the gateway and the server call on an engine: nothing is probed for.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from loomrl.seeds import part_seed

if TYPE_CHECKING:
    from torch import Tensor

    from loomrl.routed_experts import RoutedExperts
    from loomrl.weights.adapter import AdapterMeta
    from loomrl.weights.bucket import BucketRef
    from loomrl.weights.fingerprint import Fingerprint
    from loomrl.weights.handle import Transport, WeightHandle


class EngineFault(RuntimeError):
    """The engine failed (not the request): a step or a weight load raised, or its worker is gone.
    The agent loop records the trajectory as engine_error (agent.retry_on may run it again)."""


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (engines with a tokenizer)
    seed: int | None = None  # per-request sampling seed
    ignore_eos: bool = False  # keep generating past the eos token (benchmarks)


@dataclass(slots=True, kw_only=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    program_id: str = ""  # the agent program (trajectory) this call belongs to
    group_id: str = ""  # its GRPO group: siblings answer the same prompt (the built-in engine drafts from them)
    # Waiting requests are admitted lowest first, equal ones in arrival order (vLLM's priority
    # scheduling uses the same convention). Engines without a queue of their own ignore it.
    priority: int = 0


@dataclass(slots=True, kw_only=True)
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]  # one per token, of the distribution actually sampled from
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" (a stop token, included in token_ids) or "length"
    # an MoE model's routed experts of prompt + token_ids (all but the last token), where the engine records them
    # (BuiltinEngine(return_routed_experts=True)); None otherwise and for dense models. Format: routed_experts.py
    routed_experts: RoutedExperts | None = None


@dataclass(slots=True)
class EngineMetrics:
    """An engine's counters since it started (the step metrics report their differences: engine/readings.py). A
    counter an engine cannot measure is None, never 0, and its step metric is left out: the engines that measure
    busy_s and queue_s create the record with them at 0.0."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed
    reused_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    interrupts: int = 0
    faults: int = 0  # steps that raised: their requests failed, the engine reset and served on
    busy_s: float | None = None  # seconds spent computing (the built-in engine: its forward passes and sampling)
    # request-seconds spent waiting for admission to the running batch: the time integral of the queue's depth, so
    # that its change over an interval, divided by the interval, is the interval's mean queue depth (Little's law)
    queue_s: float | None = None
    # decode-only steps (every row one token), summed for `loomrl plan`'s line of step seconds against batch rows
    # (planning/measure.py): steps, rows, rows squared, seconds, rows x seconds. The built-in engine fills them.
    decode_steps: int = 0
    decode_rows: int = 0
    decode_rows_sq: int = 0
    decode_s: float = 0.0
    decode_rows_s: float = 0.0
    # speculative decoding (the built-in engine's engine.speculation): draft tokens verified, those accepted, seconds
    # spent drafting, and decoding sequence-steps with the tokens they emitted (tokens per sequence per step)
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    draft_s: float | None = None
    decode_seq_steps: int | None = None
    decode_seq_tokens: int | None = None
    started: float = field(default_factory=time.monotonic)  # this process's clock when the engine started (up_s)

    def add_decode_step(self, rows: int, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_rows_sq += rows * rows
        self.decode_s += seconds
        self.decode_rows_s += rows * seconds

    def add_busy(self, seconds: float) -> None:
        """Count `seconds` of computing; only an engine that measures busy_s (created it at 0.0) may call this."""
        if self.busy_s is None:
            raise ValueError("EngineMetrics.add_busy: busy_s is not measured (create the record with busy_s=0.0)")
        self.busy_s += seconds

    def add_queue(self, request_seconds: float) -> None:
        """Count `request_seconds` of waiting; only an engine that measures queue_s (created it at 0.0) may."""
        if self.queue_s is None:
            raise ValueError("EngineMetrics.add_queue: queue_s is not measured (create the record with queue_s=0.0)")
        self.queue_s += request_seconds

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine(Protocol):
    """What the agent loop, the gateway, the server and the runtime need from an inference engine."""

    metrics: EngineMetrics
    kv_budget: int  # tokens of K/V it can hold: a longer prompt + max_tokens is refused up front

    @property
    def version(self) -> int: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    opens: frozenset[Transport]  # the weight handles the engine reads itself, where its model lives (update_from)

    def update_weights(self, weights: dict | None, version: int) -> None:
        """Load new weights (None: the weights were changed in place) and tag later tokens `version`. The
        weights may be in another dtype or on another device (the trainer's float32 masters): they are cast
        to the engine model's as they are loaded."""

    def update_adapter(self, weights: dict[str, Tensor], adapter: AdapterMeta, version: int) -> None:
        """Serve LoRA adapter `adapter` (weights/adapter.py: its tensors `weights` under PEFT's names) on the base
        model from now on and tag later tokens `version`: the adapter of the previous version is no longer used by
        any request started after this returns. Its fingerprint (weight_fingerprint) is then of the adapter's tensors
        as the engine applies them."""

    def update_from(self, handle: WeightHandle) -> None:
        """update_weights for a published handle of a transport in `opens`, read by the engine itself (vLLM's
        worker maps a shm segment or CUDA IPC handles: no copy through this process)."""

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint (weights/fingerprint.py) of the weights the engine serves, of the tensors `expected` names,
        each in the dtype it was published in; its `unchecked` says why where some cannot be read (a server that
        does not report its weights). Called after each update (weights/fingerprint.py confirm_weights)."""

    def interrupt(self) -> None:
        """End every in-flight request soon with finish_reason "interrupted" and its partial output
        (generate_resuming resumes it, with a seed of its own: seeds.py part_seed): used when new weights arrive (runtime.interrupt_on_update)."""

    def release(self, program_id: str) -> None:
        """The program has ended; the engine may drop anything it kept for it."""

    def sleep(self) -> None:
        """Give the accelerator memory the engine holds (weights, KV cache) to a trainer on the same GPUs until
        wake() (engine.sleep_while_training): requests in flight end "interrupted" (generate_resuming resumes them
        after wake), new ones wait. Engines with nothing to free (the built-in one) do nothing."""

    def wake(self) -> None:
        """Take the memory back and serve again: at once on the weights held before sleep, or (in-process vLLM;
        SGLang without a CPU backup) once the next update, which the run sends after every wake, has loaded;
        requests wait till then."""

    def close(self) -> None:
        """Stop; requests after this fail with EngineFault."""


class TakesTensors:
    """For engines that open no weight handle: the runtime loads it (weights.transports.load_weights) and passes the
    tensors to update_weights."""

    opens: frozenset[Transport] = frozenset()

    def update_from(self, handle: WeightHandle) -> None:
        raise EngineFault(f"update_from: this engine opens no {handle.transport} handle; pass the tensors "
                          "(weights.transports.load_weights) to update_weights")


def apply_loaded(engine: Engine, weights: dict[str, Tensor], handle: WeightHandle) -> None:
    """Give `engine` the tensors a handle was loaded into: an adapter's (handle.adapter) or full weights."""
    if handle.adapter is not None:
        engine.update_adapter(weights, handle.adapter, handle.version)
    else:
        engine.update_weights(weights, handle.version)


def refuse_request(request: GenerationRequest, *, closed: bool, broken: str | None = None) -> None:
    """What every engine refuses before a request: an empty prompt (ValueError, the request's fault), a closed
    engine, and one without valid weights since a weight update failed (`broken`: why; EngineFault)."""
    if not request.prompt_ids:
        raise ValueError("generate: prompt_ids is empty")
    if closed:
        raise EngineFault("the engine is closed")
    if broken is not None:
        raise EngineFault(f"the engine has no valid weights (the last weight update failed: {broken}); it serves "
                          "again after a successful update_weights")


MAX_IDLE_RESUMES = 100


async def generate_resuming(engine: Engine, prompt_ids: list[int], params: SamplingParams,
                            program_id: str = "", priority: int = 0,
                            group_id: str = "") -> tuple[GenerationResult, int]:
    """Generate; a request interrupted by a weight update (AReaL's interruptible rollout) resumes from its partial
    output, re-prefilled under the new weights. The tokens keep the versions that sampled them, so staleness stays
    exact per token. Returns the whole result and how many times it resumed."""
    out = GenerationResult(token_ids=[], logprobs=[], versions=[], finish_reason="")  # the parts so far, joined
    resumed = idle = 0
    while True:
        result = await engine.generate(GenerationRequest(
            prompt_ids=prompt_ids + out.token_ids, program_id=program_id, group_id=group_id, priority=priority,
            sampling=replace(params, max_tokens=params.max_tokens - len(out.token_ids),
                             seed=part_seed(params.seed, resumed))))
        out.token_ids += result.token_ids
        out.logprobs += result.logprobs
        out.versions += result.versions
        out.finish_reason = result.finish_reason
        # each part's record starts at position 0 of its prompt (the original prompt + the tokens so far): the last
        # part's covers the whole sequence, with the routing of the K/V its tokens were sampled from
        out.routed_experts = result.routed_experts
        if out.finish_reason == "interrupted":
            resumed += 1
            # Each resume normally adds tokens (an interrupt ends a step, not a request's whole life); an
            # engine that keeps interrupting before producing any would make this loop spin forever.
            idle = 0 if result.token_ids else idle + 1
            if idle >= MAX_IDLE_RESUMES:
                raise EngineFault(f"generation was interrupted {idle} times in a row without producing a token; "
                                  "the engine is not making progress")
            if len(out.token_ids) < params.max_tokens:
                continue
            out.finish_reason = "length"
        return out, resumed


class StreamsBuckets(ABC):
    """An engine that loads a version a bucket at a time from a colocated trainer's reused buffer (weights/bucket.py;
    runtime.weight_transport=cuda_ipc on Ray with engine.sleep_while_training): in-process vLLM. The trainer rank on
    the engine's GPU opens the update, hands each bucket (returning once it is loaded: the buffer is then free), and
    closes it; the K/V cache stays asleep (the trainer still holds its state on the GPU) until the run's wake."""

    @abstractmethod
    def open_buckets(self, version: int, shapes: dict[str, list[int]]) -> None:
        """Start loading `version`, whose tensors (all of them, in the buckets to come) have `shapes`: checked against
        the served model first, as update_weights checks them; the weights' memory is taken back if it sleeps."""

    @abstractmethod
    def load_bucket(self, ref: BucketRef) -> None:
        """Load one bucket; returns once it is in (the trainer may overwrite its buffer)."""

    @abstractmethod
    def close_buckets(self, failed: str = "") -> None:
        """The version is complete: the update finishes and the engine serves it once it wakes. `failed`: the trainer
        could not send it all (why): the update fails, and the engine refuses requests until a whole one loads."""
