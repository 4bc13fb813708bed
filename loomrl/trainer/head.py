"""Chunked LM head + logprob: log_softmax(h @ W.T / temperature)[target] for N rows without ever holding
the full [N, vocab] logits.

The dense way (`log_softmax(head(hidden)).gather(...)`) keeps the float32 logits and their softmax for
the backward pass: 4 bytes x N x V each, 19 GB for 32k tokens of a 152k vocabulary. Here the forward
runs over chunks of `chunk` rows, keeping only each row's log-sum-exp (N floats); the backward
recomputes each chunk's logits, turns them into the gradient of the logits (softmax - one-hot, scaled)
and multiplies straight into the hidden rows' and the head's gradients. Peak extra memory: a few
[chunk, V] float32 blocks, whatever N is; the price is the head's matmul once more in the backward.

Numerics: the head's matmul runs in the head's dtype, or in the autocast dtype under
trainer.precision (the same one in forward and backward); its output is upcast to float32 before the
softcap, the temperature and the softmax; the head's gradient is accumulated in float32 over the
chunks and cast once at the end. Final-logit soft-capping (Gemma 2:
cap * tanh(logits / cap)) is applied here, with its derivative, when `softcap` is given.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Rows per block: on CPU [128, 49k] blocks stay cache-friendly (one [U, 49k] block ran ~2x slower);
# 128 x 152k x 4 bytes = 78 MB for the largest vocabulary in use.
DEFAULT_CHUNK = 128


def _capped(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """float32 logits of a block of rows (the matmul in the weight's dtype), soft-capped when the model caps them."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
    return softcap * torch.tanh(z / softcap) if softcap is not None else z


class _ChunkedLogprob(torch.autograd.Function):
    """Rows are hidden states; targets name a row each (sorted by row: a row may serve several targets,
    e.g. a prefix-tree node whose children are different tokens)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                inv_temp: Tensor, chunk: int, softcap: float | None) -> Tensor:
        # Under autocast (trainer.precision) the head's matmul runs in the autocast dtype, as it would
        # outside this function; forward and backward use the same one, so their logits agree.
        device = hidden.device.type
        ctx.compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        w_c, b_c = weight.to(ctx.compute_dtype), bias.to(ctx.compute_dtype) if bias is not None else None
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        bounds = torch.searchsorted(rows, torch.arange(0, hidden.shape[0] + chunk, chunk, device=rows.device)).tolist()
        for k, s in enumerate(range(0, hidden.shape[0], chunk)):
            z = _capped(hidden[s : s + chunk], w_c, b_c, softcap) * inv_temp[s : s + chunk, None]
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            a, b = bounds[k], bounds[k + 1]
            out[a:b] = z[rows[a:b] - s, targets[a:b]] - lse[rows[a:b]]
        ctx.save_for_backward(hidden, weight, bias, targets, rows, inv_temp, lse)
        ctx.chunk, ctx.softcap, ctx.bounds = chunk, softcap, bounds
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, bias, targets, rows, inv_temp, lse = ctx.saved_tensors
        chunk, softcap, bounds = ctx.chunk, ctx.softcap, ctx.bounds
        compute = ctx.compute_dtype
        w_c, b_c = weight.to(compute), bias.to(compute) if bias is not None else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g_all = grad_out.float()
        for k, s in enumerate(range(0, hidden.shape[0], chunk)):
            h, it = hidden[s : s + chunk], inv_temp[s : s + chunk, None]
            a, b = bounds[k], bounds[k + 1]
            local, g = rows[a:b] - s, g_all[a:b]
            capped = _capped(h, w_c, b_c, softcap)
            # d logp[t] / d z = onehot(t) - softmax(z), z = capped / T, summed over the row's targets
            g_row = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device).index_add_(0, local, g)
            dz = torch.exp(capped * it - lse[s : s + chunk, None]).mul_(-g_row[:, None])
            dz.index_put_((local, targets[a:b]), g, accumulate=True)
            dz.mul_(it)  # through the temperature
            if softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                dz.mul_(1 - (capped / softcap) ** 2)
            if need_h:
                grad_h[s : s + chunk] = (dz.to(compute) @ w_c).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dz.t(), h.float())
            if need_b:
                grad_b += dz.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor | None = None, *,
                     rows: Tensor | None = None, bias: Tensor | None = None, chunk: int = DEFAULT_CHUNK,
                     softcap: float | None = None) -> Tensor:
    """float32 [T] logprob of targets[i] under softmax(head(hidden[rows[i]]) / temperatures[rows[i]]).
    `hidden` [R, H] and `weight` [V, H] (the LM head's); `rows` [T] (default: target i reads row i);
    `temperatures` [R] (None or <= 0: 1, as greedy rows are scored at temperature 1). Memory: O(chunk x V)
    beyond the inputs, not O(R x V)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_logprobs: hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} "
                         "must be [N, H] and [V, H]")
    if chunk < 1:
        raise ValueError(f"chunked_logprobs: chunk must be >= 1, got {chunk}")
    device = hidden.device
    targets = targets.to(device)
    rows = torch.arange(targets.shape[0], device=device) if rows is None else rows.to(device)
    if temperatures is None:
        inv_temp = torch.ones(hidden.shape[0], dtype=torch.float32, device=device)
    else:
        t = temperatures.to(device=device, dtype=torch.float32)
        inv_temp = torch.where(t > 0, 1.0 / t.clamp_min(1e-12), torch.ones_like(t))
    order = torch.argsort(rows, stable=True)  # targets grouped by row: each chunk of rows takes a contiguous run
    out = _ChunkedLogprob.apply(hidden, weight, bias, targets[order], rows[order], inv_temp, chunk, softcap)
    return out[torch.argsort(order)]


def head_logprobs(model: torch.nn.Module, hidden: Tensor, targets: Tensor, temperatures: Tensor, *,
                  rows: Tensor | None = None) -> Tensor:
    """chunked_logprobs through `model`'s own output head, with its final-logit soft-capping (Gemma 2)."""
    head = model.get_output_embeddings()
    return chunked_logprobs(hidden, head.weight, targets, temperatures, rows=rows, bias=head.bias,
                            softcap=getattr(model.config, "final_logit_softcapping", None))
