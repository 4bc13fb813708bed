"""loomrl's requests in vLLM's terms and vLLM's answers in loomrl's, for both vLLM adapters (in process:
engine/vllm/engine.py; over HTTP: engine/vllm/http.py): the sampling parameters, one policy version per token from
vLLM's weight-version spans, the finish reason, and an MoE model's routed experts as loomrl's RoutedExperts.

What it is not: a parser of a transport's format (each adapter reads its own); vLLM is imported only where the
in-process adapter builds its SamplingParams, so the HTTP client runs where vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from loomrl.config import ConfigError
from loomrl.engine.base import EngineFault, SamplingParams
from loomrl.routed_experts import RoutedExperts, experts_dtype

if TYPE_CHECKING:
    from torch import nn

STREAM_INTERVAL = 8  # tokens per output vLLM sends a request's caller (in process)


def sampling_params(s: SamplingParams) -> Any:
    """vLLM's SamplingParams for the in-process AsyncLLM: DELTA outputs every STREAM_INTERVAL tokens (generated_tokens
    counts as they come, without a wake-up per token); logprobs=0, the sampled token's only; vLLM's text (which trims
    stop strings) is never read, so it is made only where stop strings need it."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.sampling_params import RequestOutputKind

    return VLLMSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                        stop_token_ids=list(s.stop_token_ids) or None, stop=list(s.stop) or None, seed=s.seed,
                        ignore_eos=s.ignore_eos, logprobs=0, detokenize=bool(s.stop),
                        output_kind=RequestOutputKind.DELTA, stream_interval=STREAM_INTERVAL)


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


@dataclass(slots=True, kw_only=True, frozen=True)
class ExpertLayout:
    """Where an MoE model routes: the decoder-layer index of each MoE layer (bottom first) and the experts of each."""

    layers: tuple[int, ...]
    num_experts: int


def expert_layout(model: nn.Module) -> ExpertLayout | None:
    """The MoE layers of `model` (a transformers causal LM, its meta-device skeleton too) as the built-in engine counts
    them (engine/builtin/moe.py's blocks); None for a dense model."""
    from loomrl.engine.builtin.moe import is_sparse_block

    base: Any = model.get_submodule("model")
    sparse = [(i, layer.mlp) for i, layer in enumerate(base.layers) if is_sparse_block(layer.mlp)]
    if not sparse:
        return None
    return ExpertLayout(layers=tuple(i for i, _ in sparse), num_experts=int(sparse[0][1].gate.weight.shape[0]))


def recorded_layout(model: nn.Module, record: bool) -> ExpertLayout | None:
    """The MoE layout a vLLM engine records routed experts for (`record`: trainer.router_replay), None when it records
    none; a dense model cannot record any (vLLM refuses enable_return_routed_experts for it: 'AuxOutput Connector
    only supports MoE models.', vllm/config/vllm.py:1153), refused here in one line."""
    if not record:
        return None
    layout = expert_layout(model)
    if layout is None:
        raise ConfigError(f"trainer.router_replay with engine.kind=vllm: the model ({type(model).__name__}) has no "
                          "mixture-of-experts layer, so there is no routing to replay; turn trainer.router_replay off")
    return layout


def routed_experts(rows: np.ndarray | None, *, tokens: int, layout: ExpertLayout | None,
                   interrupted: bool) -> RoutedExperts | None:
    """loomrl's record (routed_experts.py) of vLLM 0.32's routed experts for a request of `tokens` tokens
    (prompt + output): `rows` is CompletionOutput.routed_experts (or the HTTP answer's, decoded), [n, decoder layers,
    top_k] for positions 0..n-1 with n = tokens - 1 (vllm/distributed/aux_output_connector/connector.py take_output:
    up to num_tokens - 1; routed_experts_prompt_start left at 0), uint8 up to 256 experts, else uint16. vLLM keeps a
    column for every decoder layer (a dense layer's routes nothing and holds zeros): only `layout.layers` are kept,
    and the ids are re-typed to loomrl's dtype, whose UNKNOWN mark sits above the experts (255 experts for uint8, not
    256). An interrupted request may hold fewer rows, or none (vLLM sends none for a request aborted before any
    forward ran). None where the engine records none (`layout` None); a request that completed without rows is an
    EngineFault: vLLM was not started with enable_return_routed_experts, and replay would silently not happen."""
    if layout is None:
        return None
    if rows is None:
        if interrupted:
            return None
        raise EngineFault("vLLM returned no routed experts for a completed request: start it with "
                          "enable_return_routed_experts (a server: --enable-return-routed-experts)")
    arr = np.asarray(rows)
    k = arr.shape[2] if arr.ndim == 3 else 0
    if arr.ndim != 3 or k == 0 or arr.shape[1] <= max(layout.layers):
        raise EngineFault(f"vLLM's routed experts have shape {arr.shape}, not [tokens, decoder layers, top_k] over "
                          f"the model's MoE layers {layout.layers}")
    if len(arr) > tokens - 1 or (len(arr) < tokens - 1 and not interrupted):
        raise EngineFault(f"vLLM returned routed experts for {len(arr)} tokens of a {tokens}-token sequence (expected "
                          f"{tokens - 1}: every token but the last sampled one)")
    kept = arr[:, list(layout.layers), :].astype(np.int64)  # [n, MoE layers, top_k]
    if kept.size and (kept.min() < 0 or kept.max() >= layout.num_experts):
        raise EngineFault(f"vLLM's routed experts hold ids outside the model's {layout.num_experts} experts "
                          f"({kept.min()}..{kept.max()})")
    dtype = experts_dtype(layout.num_experts)
    return RoutedExperts(data=np.ascontiguousarray(kept.astype(dtype)).tobytes(), dtype=dtype, tokens=len(kept),
                         layers=layout.layers, top_k=k, num_experts=layout.num_experts)
