"""Chunked LM head + logprob: log_softmax(h @ W.T / temperature)[target] for N rows without ever holding
the full [N, vocab] logits.

The dense way (`log_softmax(head(hidden)).gather(...)`) keeps the float32 logits and their softmax for
the backward pass: 4 bytes x N x V each, 19 GB for 32k tokens of a 152k vocabulary. Here the forward
runs over chunks of `chunk` rows, keeping only each row's log-sum-exp (N floats); the backward
recomputes each chunk's logits, turns them into the gradient of the logits (softmax - one-hot, scaled)
and multiplies straight into the hidden rows' and the head's gradients. Peak extra memory: a few
[chunk, V] float32 blocks, whatever N is; the price is the head's matmul once more in the backward.

Numerics: the logits are computed in the head's dtype (bf16 on GPU, as the dense path does) and
upcast to float32 before the temperature, the softcap and the softmax; the head's gradient is
accumulated in float32 over the chunks and cast once at the end. Final-logit soft-capping (Gemma 2:
cap * tanh(logits / cap)) is applied here, with its derivative, when `softcap` is given.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

DEFAULT_CHUNK = 1024  # rows per block: 1024 x 152k x 4 bytes = 0.6 GB for the largest vocabulary in use


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: Tensor, softcap: float | None) -> Tensor:
    """float32 logits of one chunk, after temperature (rows scaled by 1/T) and soft-capping."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_temp[:, None]


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, inv_temp: Tensor,
                chunk: int, softcap: float | None) -> Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, inv_temp[s : s + chunk], softcap)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, inv_temp, lse)
        ctx.chunk, ctx.softcap = chunk, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, bias, targets, inv_temp, lse = ctx.saved_tensors
        chunk, softcap = ctx.chunk, ctx.softcap
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, g, it = hidden[s : s + chunk], grad_out[s : s + chunk].float(), inv_temp[s : s + chunk]
            raw = torch.nn.functional.linear(h, weight, bias).float()
            capped = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
            # d logp[target] / d z = onehot(target) - softmax(z), z = capped / T
            dz = torch.exp(capped * it[:, None] - lse[s : s + chunk, None]).mul_(-g[:, None])
            dz.scatter_add_(1, targets[s : s + chunk, None], g[:, None])
            dz.mul_(it[:, None])  # through the temperature
            if softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                dz.mul_(1 - (capped / softcap) ** 2)
            if need_h:
                grad_h[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dz.t(), h.float())
            if need_b:
                grad_b += dz.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None)


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor | None = None, *,
                     bias: Tensor | None = None, chunk: int = DEFAULT_CHUNK, softcap: float | None = None) -> Tensor:
    """float32 [N] logprob of targets[i] under softmax(head(hidden[i]) / temperatures[i]); `hidden`
    [N, H] and `weight` [V, H] (the LM head's), `temperatures` [N] (None or <= 0: 1, as greedy rows
    are scored at temperature 1). Memory: O(chunk x V), not O(N x V)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_logprobs: hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} "
                         "must be [N, H] and [V, H]")
    if chunk < 1:
        raise ValueError(f"chunked_logprobs: chunk must be >= 1, got {chunk}")
    if temperatures is None:
        inv_temp = torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    else:
        t = temperatures.to(device=hidden.device, dtype=torch.float32)
        inv_temp = torch.where(t > 0, 1.0 / t.clamp_min(1e-12), torch.ones_like(t))
    return _ChunkedLogprob.apply(hidden, weight, bias, targets.to(hidden.device), inv_temp, chunk, softcap)


def dense_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor | None = None, *,
                   bias: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """The same through full [N, V] logits (the reference the chunked head is tested against)."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperatures is not None:
        t = temperatures.to(device=hidden.device, dtype=torch.float32)
        z = z / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)
