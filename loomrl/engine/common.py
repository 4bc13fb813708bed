"""Pieces both engines use: per-row top-k/top-p filtering and resolving a caller's future."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (0 = off) and top-p (1 = off) filtering; logits [B, V]."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    remove |= before > top_p.unsqueeze(1)
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def deliver(fut: concurrent.futures.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve a caller's future unless the caller has gone (cancelled) meanwhile."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
