"""loomrl's requests in vLLM's terms and vLLM's answers in loomrl's, for both vLLM adapters (in process:
engine/vllm/engine.py; over HTTP: engine/vllm/http.py): the sampling parameters, one policy version per token from
vLLM's weight-version spans, and the finish reason.

What it is not: a parser of a transport's format (each adapter reads its own); vLLM is imported only where the
in-process adapter builds its SamplingParams, so the HTTP client runs where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

from loomrl.engine.base import EngineFault, SamplingParams

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
