"""The weights' way into vLLM, shared by both vLLM adapters (in process: engine/vllm/engine.py; over HTTP:
engine/vllm/http.py): names and shapes checked against the served model, buckets in the engine's dtype, and the
"loomrl_inline" wire format that engine/vllm/worker.py decodes inside vLLM's worker.

The wire format: update_info = {names, dtypes, shapes, blobs}, one entry per tensor, blobs its raw bytes. In process
the blobs are memoryviews (msgpack carries bytes intact); over HTTP the body is JSON, so they travel as base64 strings.
The worker accepts both.

What it is not: a transport (each adapter sends the buckets its own way) and nothing here imports vLLM, so the HTTP
client runs where vLLM is not installed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import torch

from loomrl.engine.base import EngineFault


def parameter_shapes(model: Any) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """The parameters' names -> shapes as the trainer sends them, and the names that are another parameter (a tied
    lm_head.weight, which vLLM has no slot for: dropped from updates). `model` may be a meta-device skeleton."""
    params = dict(model.named_parameters())  # a tied head appears once, under the embedding's name
    # every name of every parameter: the tied ones by identity, not storage, so that a meta-device skeleton (no
    # storage: every data_ptr is 0, model/loader.py load_skeleton) gives what its loaded model would
    aliases = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False) if n not in params)
    return {n: tuple(p.shape) for n, p in params.items()}, aliases


def checked_weights(weights: dict, shapes: dict[str, tuple[int, ...]], aliases: frozenset[str],
                    broken: str | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors to send, in the caller's order, tied aliases dropped; names and shapes the served model lacks
    are refused, and after a failed load (`broken`: why) anything but a complete update."""
    named = [(n, t) for n, t in weights.items() if n not in aliases]
    unknown = [n for n, _ in named if n not in shapes]
    if unknown:
        raise EngineFault(f"update_weights: the served model has no parameter {unknown[:3]} "
                          f"({len(unknown)} unknown names; it has e.g. {list(shapes)[:2]})")
    wrong = [(n, tuple(t.shape), shapes[n]) for n, t in named if tuple(t.shape) != shapes[n]]
    if wrong:
        n, got, want = wrong[0]
        raise EngineFault(f"update_weights: {n} has shape {list(got)}, the served model's is {list(want)} "
                          f"({len(wrong)} tensors of the wrong shape)")
    if broken is not None and len({n for n, _ in named}) < len(shapes):
        raise EngineFault(f"update_weights: the last update failed inside vLLM ({broken}), which may have "
                          f"left layers half-loaded; send all {len(shapes)} parameters, not {len(named)}")
    return named


def weight_buckets(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of about `bucket_bytes` in `dtype` on the CPU, in the caller's order (vLLM processes a layer as soon
    as all its weights have arrived, so layer order keeps few layers in flight)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        t = t.detach().to(device="cpu", dtype=dtype).contiguous()
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def to_wire(named: list[tuple[str, torch.Tensor]], *, text: bool = False) -> dict[str, Any]:
    """update_info for one bucket of CPU tensors: memoryviews over their bytes (no copy), or base64 strings when
    `text` (a JSON body)."""
    flat = [t.contiguous().view(-1).view(torch.uint8).numpy().data for _, t in named]
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "blobs": [base64.b64encode(f).decode("ascii") for f in flat] if text else flat}


def from_wire(update: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an update_info (names, dtypes, shapes, blobs: bytes or base64 strings)."""
    return [(n, torch.frombuffer(base64.b64decode(b) if isinstance(b, str) else bytearray(b),
                                 dtype=getattr(torch, d)).view(s))
            for n, d, s, b in zip(update.names, update.dtypes, update.shapes, update.blobs)]
