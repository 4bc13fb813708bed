"""The first built-in engine: batched generation with a plain torch decode loop over an HF model.

What it does: gathers concurrent `generate` calls into one batch (waiting up to batch_wait_ms),
prefills the batch's longest common prefix once (the few-shot system prompt every request shares),
then the per-request suffixes, then decodes with a KV cache, dropping finished rows from the batch.
Every token carries the policy version of the weights that produced it; new weights are applied only
between batches, so a batch never sees a half-updated model.

What it does not do (yet): continuous batching (requests arriving mid-batch wait for the next one),
a prefix cache across batches, KV kept for a program between its turns, preemption, interrupts.

Logprobs are of the distribution actually sampled from: softmax(logits / T) after top-k/top-p
filtering; for greedy rows (T = 0) they are of softmax(logits), the T = 1 distribution.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from loomrl.engine.base import GenerationRequest, GenerationResult, SamplingParams
from loomrl.engine.common import deliver, sample_tokens


@dataclass(slots=True)
class EngineStats:
    batches: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually run through prefill (shared prefix counted once)
    generated_tokens: int = 0
    busy_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


def _common_prefix_len(seqs: list[list[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return n


class TorchEngine:
    """Engine over an in-process HF causal LM. Thread-safe; `generate` is awaited from asyncio."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        max_batch_size: int = 64,
        batch_wait_ms: float = 5.0,
        seed: int = 0,
        version: int = 0,
    ):
        self.model = model
        # transformers renamed `past_key_values` to `cache` (5.x); use whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.eos_token_id = eos_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.stats = EngineStats()
        self._version = version
        self._pending_weights: tuple[dict | None, int] | None = None
        self._lock = threading.Lock()
        self._busy = False  # a batch is running (guarded by _lock)
        self._queue: queue.Queue = queue.Queue()
        self._generator = torch.Generator().manual_seed(seed)
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name="loomrl-engine", daemon=True)
        self._thread.start()

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((request, fut))
        return await asyncio.wrap_future(fut)

    def update_weights(self, weights: dict | None, version: int) -> None:
        with self._lock:
            self._pending_weights = (weights, version)
            if not self._busy:  # idle: apply now so `version` is current for callers
                self._apply_pending_locked()

    def release(self, program_id: str) -> None:
        """No per-program state is kept by this engine; nothing to drop."""

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- worker -----------------------------------------------------------------------------------
    def _apply_pending_locked(self) -> None:
        """Load pending weights; the caller holds the lock and no batch is running."""
        pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        weights, version = pending
        if weights is not None:
            with torch.no_grad():
                self.model.load_state_dict(weights, strict=False)
        self._version = version

    def _worker(self) -> None:
        while not self._closed:
            item = self._queue.get()
            if item is None:
                break
            batch = [item]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - time.monotonic()
                try:
                    nxt = self._queue.get(timeout=max(timeout, 0.0)) if timeout > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._closed = True
                    break
                batch.append(nxt)
            with self._lock:  # weights change only here, between batches, never mid-batch
                self._apply_pending_locked()
                self._busy = True
            requests = [r for r, _ in batch]
            try:
                t0 = time.perf_counter()
                results = self._run_batch(requests)
                self.stats.busy_s += time.perf_counter() - t0
            except BaseException as err:  # noqa: BLE001 - delivered to every waiting caller
                for _, fut in batch:
                    deliver(fut, exception=err)
                continue
            finally:
                with self._lock:
                    self._busy = False
            for (_, fut), res in zip(batch, results):
                deliver(fut, result=res)

    @torch.no_grad()
    def _run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        from transformers import DynamicCache

        model = self.model
        version = self._version
        n = len(requests)
        prompts = [r.prompt_ids for r in requests]
        for p in prompts:
            if not p:
                raise ValueError("generate: prompt_ids is empty")
        self.stats.batches += 1
        self.stats.requests += n
        self.stats.batch_sizes.append(n)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)

        # Shared prefix once, then per-row suffixes (left-padded, padding masked out).
        shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1) if n > 1 else 0
        cache = DynamicCache()
        if shared > 0:
            model(
                input_ids=torch.tensor([prompts[0][:shared]]),
                position_ids=torch.arange(shared).unsqueeze(0),
                **{self._cache_kw: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            cache.batch_repeat_interleave(n)
        suffixes = [p[shared:] for p in prompts]
        width = max(len(s) for s in suffixes)
        ids = torch.full((n, width), self.eos_token_id, dtype=torch.long)
        suffix_mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(suffixes):
            ids[i, width - len(s) :] = torch.tensor(s)
            suffix_mask[i, width - len(s) :] = 1
        self.stats.prefill_tokens += shared + sum(len(s) for s in suffixes)
        attn = torch.cat([torch.ones((n, shared), dtype=torch.long), suffix_mask], dim=1)
        positions = (shared + suffix_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
        next_pos = positions[:, -1:] + 1

        params: list[SamplingParams] = [r.sampling for r in requests]
        stops = [set(p.stop_token_ids) | {self.eos_token_id} for p in params]
        max_new = [p.max_tokens for p in params]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        finish = [""] * n
        rows = list(range(n))  # request index of each live batch row

        while True:
            chosen, chosen_lp = sample_tokens(logits, [params[r] for r in rows],
                                              torch.rand(len(rows), generator=self._generator))
            keep = []
            for b, req_idx in enumerate(rows):
                tok = int(chosen[b])
                tokens[req_idx].append(tok)
                logps[req_idx].append(float(chosen_lp[b]))
                if tok in stops[req_idx]:
                    finish[req_idx] = "stop"
                elif len(tokens[req_idx]) >= max_new[req_idx]:
                    finish[req_idx] = "length"
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                attn, next_pos, chosen = attn[idx], next_pos[idx], chosen[idx]
                rows = [rows[b] for b in keep]
            attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            out = model(
                input_ids=chosen.unsqueeze(1),
                attention_mask=attn,
                position_ids=next_pos,
                **{self._cache_kw: cache},
                use_cache=True,
            )
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        self.stats.generated_tokens += sum(len(t) for t in tokens)
        return [
            GenerationResult(token_ids=tokens[i], logprobs=logps[i], versions=[version] * len(tokens[i]), finish_reason=finish[i])
            for i in range(n)
        ]
