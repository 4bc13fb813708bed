"""BuiltinEngine: continuous batching with a prefix cache, in-place weight updates and interrupts.

Every engine step (one forward pass) mixes the decode tokens of all running sequences with prefill chunks of newly
admitted ones; a request joins at the step after it arrives and leaves at the step it finishes. A step reads schedule ->
run -> postprocess: scheduler.py decides the batch (admission under the KV budget, preemption), the runner computes it,
and postprocessing samples, records and finishes.

Prefix cache: prompts are matched against a radix tree of cached K/V (GRPO siblings share their prompt; a program's next
turn extends its previous one). A finished request's K/V stays cached under its program id until `release(program_id)`
or eviction.

Programs (programs.py): the engine tracks each program id's phase (reasoning while a request of it is in flight,
acting between turns), group and K/V tokens; when the KV budget needs room, engine.program_policy picks the acting
program whose cached K/V is dropped (paused), and its next turn recomputes it (restored). `lru` (the default) leaves the
choice to the prefix cache's least-recently-used order, request by request.

Shared K/V pool (engine/kv_pool.py, engine.kv_pool_bytes; none by default): with one, a finished turn's K/V is also
copied into the pool under the engine's weight version, and every admitted turn asks it for more of its prompt than the
prefix cache holds (a program moved here from another instance, an entry this cache evicted). A turn that was running
across a weight update is not put (its K/V mixes two versions); the pool serves each version only to engines on it.

Weights: `update_weights` is applied between steps, never within one; every token records the version of the weights
that produced it. The prefix cache is cleared then (its K/V came from the old weights); running sequences keep their
K/V, as vLLM's in-flight updates do. `interrupt()` ends every in-flight request at the next step boundary with
finish_reason "interrupted" and its partial output; resubmitting prompt + partial tokens resumes it (re-prefilled under
the current weights). `weight_fingerprint` checksums the model's parameters (weights/fingerprint.py), with which the
runtime confirms each update took effect. `update_adapter` (trainer.lora publish=adapter) merges a LoRA adapter into the
targeted linears on the same path, onto copies of their base weights (adapter.py, which says what its fingerprint is).

Supervision: the engine's worker thread never dies of an error. A step that raises fails the requests in flight
(EngineFault, with the cause) and the engine serves the next ones with its state reset (KV freed, prefix cache cleared).
A weight load that raises leaves the model partly loaded, so `update_weights` raises and the engine refuses requests
until a later load succeeds. A request made after the engine closed, or while its thread is gone, fails at once instead
of waiting for ever.

Logprobs are of the distribution sampled from: softmax(logits / T) after top-k/top-p; for greedy requests (T = 0), of
softmax(logits).

Routed experts (return_routed_experts, off by default; MoE models): each result carries the experts every layer
routed each position of prompt + output to (all but the last token, which is never fed), read from beside the
sequence's K/V: a prefix-cache hit reports the routing its cached K/V was computed with (routed_experts.py).

Speculation (engine.speculation, off by default): a decoding sequence may feed draft tokens from its group's suffix index
(drafter.py) with its last token; the step's forward computes their logits and speculation.py's `verify` emits 1 to
k + 1 tokens with the distribution, logprobs and versions of decoding one token at a time. The K/V of rejected drafts
is dropped by rewinding the sequence's length. The indexes are dropped at every weight update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from loomrl.engine.base import (
    EngineFault,
    EngineMetrics,
    GenerationRequest,
    GenerationResult,
    TakesTensors,
    refuse_request,
)
from loomrl.engine.builtin.adapter import AdapterMerge
from loomrl.engine.builtin.drafter import GroupDrafter
from loomrl.engine.builtin.prefix_cache import PrefixCache
from loomrl.engine.builtin.programs import ProgramPolicy, ProgramTable
from loomrl.engine.builtin.runner import ModelRunner
from loomrl.engine.builtin.scheduler import Batch, Scheduler, Seq
from loomrl.engine.builtin.speculation import DraftPolicy, StepCost, verify
from loomrl.engine.readings import Counters, KeepsCounters
from loomrl.weights.fingerprint import Fingerprint

if TYPE_CHECKING:
    from loomrl.engine.kv_pool import SharedKVPool

log = logging.getLogger("loomrl")

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from loomrl.config.engine import SpeculationConfig
    from loomrl.weights.adapter import AdapterMeta


def deliver(fut: concurrent.futures.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve a caller's future unless the caller has gone (cancelled) meanwhile."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


CLOSE_WAIT_S = 600.0  # close(): for the step or borrowed call in flight, past the first 10 s


class BuiltinEngine(TakesTensors, KeepsCounters):
    """Engine protocol implementation; thread-safe, awaited from asyncio."""

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, kv_budget_tokens: int = 65536,
                 max_running: int = 64, max_prefill_tokens: int = 4096, prefix_cache: bool = True,
                 seed: int = 0, version: int = 0, tokenizer=None, speculation: SpeculationConfig | None = None,
                 program_policy: ProgramPolicy = "lru", max_pauses_in_row: int = 2,
                 kv_pool: SharedKVPool | None = None, return_routed_experts: bool = False,
                 share_linears: bool = False):
        # return_routed_experts (vLLM's enable_return_routed_experts): an MoE model's results carry each token's
        # routed experts (GenerationResult.routed_experts; dense models: None). share_linears: packed linears shared
        # with other sharing engines over the same unchanged tensors (`loomrl serve --adapter`: builtin/linears.py)
        self.runner = ModelRunner(model, record_experts=return_routed_experts, share_linears=share_linears)
        self.model = model
        if not self.runner.batch_invariant():
            log.warning("builtin engine: this model's logits may change with what shares a step on this machine "
                        "(MoE routing, or kernels that round by batch size): a rerun may sample other tokens")
        self.eos_token_id = eos_token_id
        self.cache = PrefixCache() if prefix_cache else None
        self.tokenizer = tokenizer  # only needed for stop strings
        self.metrics = EngineMetrics(busy_s=0.0, queue_s=0.0,  # the scheduler measures the queue
                                     draft_tokens=0, accepted_tokens=0, draft_s=0.0, decode_seq_steps=0,
                                     decode_seq_tokens=0)
        self.kv_budget = kv_budget_tokens  # the protocol's: the server refuses requests that cannot fit
        self.step_cost = StepCost()  # the engine's decode step seconds against tokens: what drafts cost
        self.kv_pool = kv_pool
        if kv_pool is not None:
            kv_pool.new_version(version)
        self._crossed: set[Seq] = set()  # running across a weight update: their K/V mixes versions (never pooled)
        self.programs = ProgramTable(program_policy, max_pauses_in_row=max_pauses_in_row, pool=kv_pool,
                                     version=lambda: self._version)
        self.sched = Scheduler(self.runner, self.cache, self.metrics, kv_budget=kv_budget_tokens,
                               max_running=max_running, max_prefill_tokens=max_prefill_tokens, programs=self.programs)
        self._speculate(speculation)
        self._version = version
        self._seeds = random.Random(seed)  # unseeded requests' seeds, drawn as they arrive
        # (weights, version, the caller's future, the adapter they are: None for full weights)
        self._pending_weights: tuple[dict | None, int, concurrent.futures.Future, AdapterMeta | None] | None = None
        self.adapters = AdapterMerge(dict(model.named_parameters(remove_duplicate=False)))  # update_adapter's merges
        self._broken: str | None = None  # why the last weight load failed (no request is served until one works)
        self._interrupt = False
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="loomrl-builtin-engine", daemon=True)
        self._thread.start()

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def counters(self) -> Counters:
        """Its program table's counters (programs.py ProgramMetrics.counters) and, with a K/V pool, the pool's
        (kv_pool.py; shared: a router over instances that share it counts it once). Read without the engine's lock, as
        its EngineMetrics are: each counter is a whole int, and a weight load holding the lock must not stall the
        caller's event loop."""
        out = self.programs.metrics.counters()
        if self.kv_pool is not None:
            out.shared[id(self.kv_pool)] = self.kv_pool.metrics.counts()
        return out

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await asyncio.wrap_future(self.submit(request))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:  # checked under the lock: a close or a failed load cannot slip in between
            refuse_request(request, closed=self._closed, broken=self._broken)
            if not self._thread.is_alive():
                raise EngineFault("the engine's thread is not running")
            seed = request.sampling.seed
            seq = Seq(request=request, future=fut, prompt=list(request.prompt_ids),
                      seed=self._seeds.getrandbits(62) if seed is None else seed)
            self.sched.add(seq)
            self.programs.started(request)
            self.metrics.requests += 1
            self._cond.notify()
        return fut

    def update_weights(self, weights: dict | None, version: int, timeout_s: float = 600.0) -> None:
        """Load `weights` between two steps; returns once they serve. Raises EngineFault when the load
        failed (the engine then refuses requests until a later load succeeds) or did not happen within
        `timeout_s`. An update superseded by a newer one before it was applied returns as well."""
        self._update(weights, version, None, timeout_s)

    def update_adapter(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int,
                       timeout_s: float = 600.0) -> None:
        """Merge LoRA adapter `adapter` (its tensors `weights`, PEFT's names) onto the base weights between two steps
        (adapter.py AdapterMerge); returns once it serves. Failures and timeouts as update_weights'."""
        self._update(weights, version, adapter, timeout_s)

    def _update(self, weights: dict | None, version: int, adapter: AdapterMeta | None, timeout_s: float) -> None:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed or not self._thread.is_alive():
                raise EngineFault("update_weights: the engine is not running")
            if self._pending_weights is not None:
                deliver(self._pending_weights[2])  # superseded: only the newest version is loaded
            self._pending_weights = (weights, version, fut, adapter)
            self._cond.notify()
        try:
            fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise EngineFault(f"update_weights: version {version} not applied after {timeout_s:.0f}s") from None

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint of the model's parameters (what update_weights loads into), under the lock: no load runs
        meanwhile. A published name the model lacks is left out (it reads as differing: the load never reached it).
        Tied names are each readable (lm_head.weight, the embeddings' alias), as a state dict publishes them. After
        update_adapter, the adapter's tensors as merged, if the adapter merged is this version's (adapter.py)."""
        with self._cond:
            return self.adapters.fingerprint(expected, self._version)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine's thread between two steps (the hybrid trainer borrows it).

        All torch work of a process should run on one OS thread: each thread that runs parallel
        torch ops gets its own OpenMP team, and two teams on two cores slow each other down
        (measured here: the engine runs ~20% slower once another thread has run a matmul)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def set_speculation(self, speculation: SpeculationConfig | None) -> None:
        """Switch speculation on (or off, with None or enabled=False) from the next step; the running sequences go on
        either way (benchmarks/speculative.py compares both on one engine: a second engine's thread would bring a
        second OpenMP team, slower, see `call`)."""
        self.call(lambda: self._speculate(speculation)).result(timeout=60)

    def _speculate(self, speculation: SpeculationConfig | None) -> None:
        if speculation is None or not speculation.enabled:
            self.sched.drafter, self.sched.policy, self.sched.max_draft = None, None, 0
            return
        self.sched.drafter = GroupDrafter(min_match=speculation.min_match, max_match=speculation.max_match,
                                          max_groups=speculation.max_groups,
                                          max_tokens=speculation.max_indexed_tokens)
        self.sched.policy = DraftPolicy(self.step_cost)
        self.sched.max_draft = speculation.max_draft

    @property
    def drafter(self) -> GroupDrafter | None:
        """The group suffix indexes, while speculation is on (the scheduler's)."""
        return self.sched.drafter

    def interrupt(self) -> None:
        """End all in-flight requests at the next step boundary with their partial outputs."""
        with self._cond:
            self._interrupt = True
            self._cond.notify()

    def release(self, program_id: str) -> None:
        if program_id:
            with self._cond:
                self.programs.released(program_id)
                if self.cache is not None:
                    self.cache.release(program_id)

    def sleep(self) -> None:
        """Nothing to free: the built-in engine's model and K/V live in host memory (on a GPU it would keep
        them; engine.sleep_while_training is for engines that can release theirs: vLLM, SGLang)."""

    def wake(self) -> None:
        """Nothing to take back (see sleep)."""

    def close(self) -> None:
        """Stop serving; returns once the engine's thread has ended, after the step or borrowed call in flight (the
        sync trainer's step and its checkpoint write: tens of seconds with a real model on a CPU). Never earlier: the
        thread is a daemon, and one still in torch when the interpreter exits aborts the process (CPython < 3.14 ends
        it with pthread_exit, which unwinds into a noexcept C++ destructor: "terminate called without an active
        exception", exit code 134; CPython gh-87135), cutting a checkpoint write short."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.info("engine: waiting for its step in flight to finish (up to %.0f s more)", CLOSE_WAIT_S)
            self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            raise EngineFault(f"close: the engine's thread is still running {CLOSE_WAIT_S:.0f} s after its step in "
                              "flight was due to end (a borrowed call that does not return?)")

    # -- the step loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                if not self._serve():
                    break
            except BaseException as err:  # noqa: BLE001 - a fault outside a step: reset, keep serving
                self._recover(err)
        pending = [self._pending_weights[2]] if self._pending_weights is not None else []
        for fut in [s.future for s in self.sched.drain()] + [f for _, f in self._calls] + pending:
            deliver(fut, exception=EngineFault("engine closed"))

    def _recover(self, err: BaseException) -> None:
        """Fail everything in flight with the cause and reset the per-request state."""
        fault = err if isinstance(err, EngineFault) else EngineFault(f"engine step failed: {type(err).__name__}: {err}")
        fault.__cause__ = None if fault is err else err
        with self._cond:
            self.metrics.faults += 1  # counted before any caller learns of the fault (it may read the count)
            self._fail_in_flight(fault)

    def _fail_in_flight(self, fault: EngineFault) -> None:
        """Fail every request in flight with `fault`, freeing its K/V, and clear the prefix cache (lock held)."""
        for seq in self.sched.drain():
            try:
                self.sched.retire(seq)
            except Exception:  # noqa: BLE001 - the state that failed may fail again; drop it
                seq.kv = None
            self.programs.finished(seq.request.program_id, 0)
            deliver(seq.future, exception=fault)
        if self.cache is not None:
            self.cache.clear()
        self.programs.cleared()
        self._crossed.clear()

    def _serve(self) -> bool:
        """One pass of the loop: weights, interrupts, borrowed calls, then a step. False once closed."""
        while True:
            with self._cond:
                while not (self._closed or self.sched.waiting or self.sched.running or self._pending_weights
                           or self._interrupt or self._calls):
                    self._cond.wait()
                if self._closed:
                    return False
                self._apply_weights_locked()
                if self._interrupt:
                    self._interrupt = False
                    for seq in self.sched.drain():
                        self.metrics.interrupts += 1
                        self._finish(seq, "interrupted")
                    continue
                calls, self._calls = list(self._calls), deque()
            for fn, fut in calls:
                try:
                    deliver(fut, fn())
                except BaseException as err:  # noqa: BLE001 - the caller gets it
                    deliver(fut, exception=err)
            if not (self.sched.waiting or self.sched.running):
                continue
            # One step: schedule (under the lock) -> run (one forward pass) -> postprocess (cache, sample, finish).
            # A fault: _loop fails the requests in flight and serves on.
            t0 = time.perf_counter()
            with self._cond:
                batch, version = self.sched.schedule(), self._version
            self.sched.add_drafts(batch)  # outside the lock: a submit() meanwhile does not wait for drafting
            done = []
            if batch.chunks:
                logits = self.runner.forward(batch.chunks)
                self.metrics.steps += 1
                done = self._postprocess(batch, logits, version)
                if not batch.prefill_tokens:  # a decode step: its seconds against its rows (tokens, drafts included)
                    rows, seconds = sum(len(c.tokens) for c in batch.chunks), time.perf_counter() - t0
                    self.metrics.add_decode_step(rows, seconds)
                    self.step_cost.add(rows, seconds)
            self.metrics.add_busy(time.perf_counter() - t0)  # counted before a caller hears of its result
            if done:
                with self._cond:
                    for seq, reason in done:
                        if seq in self.sched.running:
                            self.sched.running.remove(seq)
                        self._finish(seq, reason)

    def _apply_weights_locked(self) -> None:
        pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        weights, version, fut, adapter = pending
        try:
            if adapter is not None and weights is not None:
                self.adapters.apply(weights, adapter)
            elif weights is not None:
                with torch.no_grad():  # copies with a cast: the trainer's float32 masters into a bf16 model
                    self.model.load_state_dict(weights, strict=False)
                self.adapters.reset()  # the new weights are the base from now on
            self.runner.refresh()  # re-pack: with weights=None the model was changed in place
        except BaseException as err:  # noqa: BLE001 - the caller gets it; no request runs on these weights
            self._broken = f"{type(err).__name__}: {err}"
            deliver(fut, exception=EngineFault(f"update_weights: loading version {version} failed: {self._broken}"))
            # Their K/V and tokens came from other weights.
            self._fail_in_flight(EngineFault(f"engine weights failed to load: {self._broken}"))
            return
        self._broken = None
        if self.cache is not None:
            self.cache.clear()  # cached K/V was computed by the old weights
        self.programs.cleared()
        if self.drafter is not None:
            self.drafter.drop()  # what siblings sampled from the old weights
        if self.kv_pool is not None:
            self._crossed.update(self.sched.running)
            self.kv_pool.new_version(version)  # the first instance to load it drops the old version's entries
        self._version = version
        deliver(fut)

    # -- one step's postprocessing ------------------------------------------------------------------
    def _postprocess(self, batch: Batch, logits: torch.Tensor, version: int) -> list[tuple[Seq, str]]:
        """Cache new prompts, sample; returns the sequences this step finished, with why (the caller finishes them)."""
        if self.cache is not None:
            with self._cond:  # release() may touch the tree from another thread
                for seq in batch.running:  # newly prefilled prompts serve their siblings from the next step on
                    if seq.kv is not None and seq.kv.length == len(seq.prompt) and not seq.out_tokens:
                        self.cache.insert(seq.prompt, seq.kv, seq.request.program_id)
        if not batch.samples:
            return []
        seqs = [s.seq for s in batch.samples]
        # each token drawn with its request's uniform at its position (seeds.py): what shares the batch, the device and
        # a resume or division of the request do not change the draws
        emitted = verify(logits, [s.request.sampling for s in seqs], [s.draft for s in batch.samples],
                         [(s.seed, s.position) for s in seqs])
        m = self.metrics
        done = []
        for sample, out in zip(batch.samples, emitted):
            seq, kept = sample.seq, 0
            reason = None
            for tok, lp in zip(out.tokens, out.logprobs):
                seq.out_tokens.append(tok)
                seq.out_logprobs.append(lp)
                seq.out_versions.append(version)
                kept += 1
                if reason := self._stop_reason(seq, tok):
                    done.append((seq, reason))
                    break
            m.generated_tokens += kept
            if seq.kv is not None:  # K/V is kept for the fed tokens up to the last emitted one (not its own)
                seq.kv.length -= len(sample.draft) - (kept - 1)
            if sample.decoding:
                m.decode_seq_steps = (m.decode_seq_steps or 0) + 1
                m.decode_seq_tokens = (m.decode_seq_tokens or 0) + kept
                if self.sched.policy is not None:
                    self.sched.policy.verified(seq.acceptance, len(sample.draft), out.accepted)
                    m.draft_tokens = (m.draft_tokens or 0) + len(sample.draft)
                    m.accepted_tokens = (m.accepted_tokens or 0) + min(out.accepted, kept)  # not those a stop cut
            if self.drafter is not None:  # a finished sequence's last tokens too: its siblings draft from them
                self.drafter.extend(seq.uid, seq.out_tokens[-kept:])
        if batch.draft_s:
            m.draft_s = (m.draft_s or 0.0) + batch.draft_s
        return done

    def _stop_reason(self, seq: Seq, tok: int) -> str | None:
        sp = seq.request.sampling
        if (tok == self.eos_token_id and not sp.ignore_eos) or tok in sp.stop_token_ids:
            return "stop"
        if sp.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(seq.out_tokens[-32:], skip_special_tokens=True)
            if any(s in tail for s in sp.stop):
                return "stop"
        if len(seq.out_tokens) >= sp.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Seq, reason: str) -> None:
        self.metrics.finished += 1
        kept = 0
        if self.cache is not None and seq.kv is not None and reason != "interrupted":
            # Keep the turn's K/V for the program's next turn (its tokens minus the last sampled one,
            # whose K/V was never computed).
            self.cache.insert(seq.kv_tokens(), seq.kv, seq.request.program_id)
            kept = min(len(seq.kv_tokens()), seq.kv.length)
        if self.kv_pool is not None and seq.kv is not None and reason != "interrupted" and seq not in self._crossed:
            self.kv_pool.put(seq.kv_tokens(), seq.kv, self._version)
        self._crossed.discard(seq)
        self.programs.finished(seq.request.program_id, kept)
        # read before retire frees the K/V they are stored beside: every position but the last sampled token's
        routed = self.runner.routed_experts(seq.kv, len(seq.request.prompt_ids) + len(seq.out_tokens) - 1)
        self.sched.retire(seq)
        deliver(seq.future, GenerationResult(token_ids=list(seq.out_tokens), logprobs=list(seq.out_logprobs),
                                              versions=list(seq.out_versions), finish_reason=reason,
                                              routed_experts=routed))
