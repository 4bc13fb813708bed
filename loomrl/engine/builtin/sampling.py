"""The built-in engine's sampling: per-row temperature, top-k and top-p over a batch of logits, one token each."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (0 = off) and top-p (1 = off) filtering; logits [B, V]."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    remove |= before > top_p.unsqueeze(1)
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def distributions(logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution each row of logits [B, V] is sampled from under its SamplingParams, as log-probabilities
    [B, V] (softmax(logits / T) after top-k/top-p; for greedy rows, T <= 0, softmax(logits)), and which rows are
    greedy [B]."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        # greedy rows are left unfiltered: their token is the argmax, their logprob that of softmax(logits)
        top_k = torch.where(greedy, torch.zeros_like(top_k), top_k)
        top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
        scaled = filter_logits(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1), greedy


def draw(logprobs: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logprobs` [B, V] (distributions()): greedy rows their argmax, the others by inverse CDF
    with the caller's uniforms [B] in [0, 1) (one per row, so a seeded request draws from its own generator whatever
    else shares the batch: one cumsum and one search for all rows, where a torch.multinomial call per row cost ~1 ms
    each at a 49k vocabulary)."""
    cdf = logprobs.exp().cumsum_(dim=-1)
    # right=True: the first token whose cumulative mass exceeds u * total, never a zero-probability one.
    drawn = torch.searchsorted(cdf, (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return torch.where(greedy, logprobs.argmax(dim=-1), drawn.clamp_(max=logprobs.shape[1] - 1))


def sample_tokens(logits: torch.Tensor, params: list, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V] under each row's SamplingParams; (tokens, logprobs).

    The logprob is of the distribution sampled from: softmax(logits / T) after top-k/top-p; for
    greedy rows (T <= 0) the token is the argmax and its logprob that of softmax(logits)."""
    logprobs, greedy = distributions(logits, params)
    chosen = draw(logprobs, greedy, uniforms)
    return chosen, logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
