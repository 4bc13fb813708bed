"""Chunked LM head + logprob: log_softmax(h @ W.T / temperature)[target] for N rows without ever holding
the full [N, vocab] logits.

The dense way (`log_softmax(head(hidden)).gather(...)`) keeps the float32 logits and their softmax for
the backward pass: 4 bytes x N x V each, 19 GB for 32k tokens of a 152k vocabulary. Here the forward
runs over chunks of `chunk` rows, keeping only each row's log-sum-exp (N floats); the backward
recomputes each chunk's logits, turns them into the gradient of the logits (softmax - one-hot, scaled)
and multiplies straight into the hidden rows' and the head's gradients. Peak extra memory: a few
[chunk, V] float32 blocks, whatever N is; the price is the head's matmul once more in the backward.

Chunk size and the backward's GEMMs depend on the device (`head_plan`). On the CPU, small blocks (128 rows) stay in
cache and the head's gradient is one float32 GEMM per chunk. On CUDA every chunk is a pass over the head's weight and
its float32 gradient ([V, H] each: 2.5 GB at 152k x 4096), so chunks are as large as a memory budget allows (thousands
of rows, not 128: a 32k-token step of a 152k vocabulary in 20 passes, not 256), and each chunk's gradient GEMMs run in
the compute dtype (bf16 tensor cores) on one cast of the logits' gradient, the head's then added into its float32
accumulator (one rounding to bf16 per chunk, as autocast's dense backward rounds the whole gradient once). The CUDA
plan has not run on a GPU here; its structure and numerics are tested on the CPU (tests/trainer/test_head.py).

Numerics: the head's matmul runs in the head's dtype, or in the autocast dtype under
trainer.precision (the same one in forward and backward); its output is upcast to float32 before the
softcap, the temperature and the softmax; the head's gradient is accumulated in float32 over the
chunks and cast once at the end. Final-logit soft-capping (Gemma 2:
cap * tanh(logits / cap)) is applied here, with its derivative, when `softcap` is given.

Entropy (the trainer's `train/entropy`): when asked, the forward also gives each target's entropy
H = lse - sum(softmax(z) * z), of the same temperature-scaled (and capped) distribution whose logprob it returns, from
the block's logits it already holds: one more exp over each [chunk, V] block, no extra forward, no memory beyond N
floats. It is detached (the loss has no entropy term).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Tensor = torch.Tensor

# Rows per block on the CPU: [128, 49k] blocks stay cache-friendly (one [U, 49k] block ran ~2x slower);
# 128 x 152k x 4 bytes = 78 MB for the largest vocabulary in use.
CPU_CHUNK = 128
# On CUDA: as many rows as keep one float32 [chunk, V] block within CUDA_BLOCK_BYTES (the backward holds about three
# such blocks at once: the capped logits, dz, and dz in the compute dtype), in multiples of CHUNK_ALIGN rows (whole
# GEMM tiles), between CUDA_MIN_CHUNK and CUDA_MAX_CHUNK (past that the passes over the weight cost little next to
# the GEMMs). 152k vocabulary: 1,664 rows; 49k: 5,376.
CUDA_BLOCK_BYTES = 1 << 30
CHUNK_ALIGN = 128
CUDA_MIN_CHUNK, CUDA_MAX_CHUNK = 512, 8192


class Entropies:
    """Where a forward puts the per-token entropies it computes (detached, float32), a tensor per head pass.
    A plain class, not a list or a dataclass: FSDP rebuilds the lists and dataclasses in its forward's inputs (to
    cast and move their tensors), so appends would go to its copy; an object it does not know it passes as it is."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[Tensor] = []

    def add(self, entropy: Tensor) -> None:
        self.parts.append(entropy.detach())

    def all(self) -> Tensor:
        """Every token's entropy, in the order they were added ([0] when none was)."""
        return torch.cat(self.parts).float().cpu() if self.parts else torch.zeros(0)  # one copy off the device


@dataclass(slots=True, frozen=True, kw_only=True)
class HeadPlan:
    """How the chunked head runs on a device."""

    chunk: int  # rows per block
    # the backward's GEMMs on the logits' gradient cast to the compute dtype (under bf16 autocast: tensor cores);
    # False: the head's gradient as a float32 GEMM (exact accumulation; the CPU's)
    grads_in_compute_dtype: bool


def head_plan(device: torch.device, vocab: int) -> HeadPlan:
    """The chunk size and backward GEMMs for a head of `vocab` rows on `device`."""
    if device.type != "cuda":
        return HeadPlan(chunk=CPU_CHUNK, grads_in_compute_dtype=False)
    rows = CUDA_BLOCK_BYTES // (4 * vocab) // CHUNK_ALIGN * CHUNK_ALIGN
    return HeadPlan(chunk=min(CUDA_MAX_CHUNK, max(CUDA_MIN_CHUNK, rows)), grads_in_compute_dtype=True)


def _capped(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """float32 logits of a block of rows (the matmul in the weight's dtype), soft-capped when the model caps them."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
    return softcap * torch.tanh(z / softcap) if softcap is not None else z


class _ChunkedLogprob(torch.autograd.Function):
    """Rows are hidden states; targets name a row each (sorted by row: a row may serve several targets,
    e.g. a prefix-tree node whose children are different tokens)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                inv_temp: Tensor, plan: HeadPlan, softcap: float | None, want_entropy: bool) -> tuple[Tensor, Tensor]:
        # Under autocast (trainer.precision) the head's matmul runs in the autocast dtype, as it would
        # outside this function; forward and backward use the same one, so their logits agree.
        device, chunk = hidden.device.type, plan.chunk
        ctx.compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        w_c, b_c = weight.to(ctx.compute_dtype), bias.to(ctx.compute_dtype) if bias is not None else None
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        ent = torch.empty(hidden.shape[0] if want_entropy else 0, dtype=torch.float32, device=hidden.device)  # per row
        bounds = torch.searchsorted(rows, torch.arange(0, hidden.shape[0] + chunk, chunk, device=rows.device)).tolist()
        for k, s in enumerate(range(0, hidden.shape[0], chunk)):
            z = _capped(hidden[s : s + chunk], w_c, b_c, softcap) * inv_temp[s : s + chunk, None]
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            a, b = bounds[k], bounds[k + 1]
            out[a:b] = z[rows[a:b] - s, targets[a:b]] - lse[rows[a:b]]
            if want_entropy:  # H = lse - E_p[z]; p = exp(z - lse)
                ent[s : s + chunk] = lse[s : s + chunk] - (torch.exp(z - lse[s : s + chunk, None]) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, rows, inv_temp, lse)
        ctx.plan, ctx.softcap, ctx.bounds = plan, softcap, bounds
        ent = ent[rows] if want_entropy else ent  # per target
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor | None):
        # one gradient per output of forward: the logprobs', then the (non-differentiable) entropies'
        grad_out = grad_outputs[0]
        if grad_out is None:
            raise RuntimeError("_ChunkedLogprob.backward: no gradient for the logprobs")
        hidden, weight, bias, targets, rows, inv_temp, lse = ctx.saved_tensors
        plan, softcap, bounds = ctx.plan, ctx.softcap, ctx.bounds
        chunk, compute = plan.chunk, ctx.compute_dtype
        # the head's gradient in the compute dtype: only where that is not float32 already (then both paths agree)
        low_w = plan.grads_in_compute_dtype and compute != torch.float32
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
            dz_c = dz.to(compute)  # one cast, for both GEMMs
            if grad_h is not None:  # need_h
                grad_h[s : s + chunk] = (dz_c @ w_c).to(hidden.dtype)
            if grad_w is not None and low_w:  # [V, chunk] @ [chunk, H] on tensor cores, rounded once, summed in float32
                grad_w += dz_c.t() @ h.to(compute)
            elif grad_w is not None:
                grad_w.addmm_(dz.t(), h.float())
            if grad_b is not None:  # need_b
                grad_b += dz.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None, None, None)


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor | None = None, *,
                     rows: Tensor | None = None, bias: Tensor | None = None, chunk: int | None = None,
                     plan: HeadPlan | None = None, softcap: float | None = None,
                     entropy: Entropies | None = None) -> Tensor:
    """float32 [T] logprob of targets[i] under softmax(head(hidden[rows[i]]) / temperatures[rows[i]]).
    `hidden` [R, H] and `weight` [V, H] (the LM head's); `rows` [T] (default: target i reads row i);
    `temperatures` [R] (None or <= 0: 1, as greedy rows are scored at temperature 1). `plan`: head_plan for hidden's
    device unless given; `chunk` overrides its rows per block. Memory: O(chunk x V) beyond the inputs, not O(R x V).
    `entropy`: when given, the float32 [T] entropy of target i's distribution is added to it."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_logprobs: hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} "
                         "must be [N, H] and [V, H]")
    device = hidden.device
    plan = plan or head_plan(device, weight.shape[0])
    if chunk is not None:
        plan = HeadPlan(chunk=chunk, grads_in_compute_dtype=plan.grads_in_compute_dtype)
    if plan.chunk < 1:
        raise ValueError(f"chunked_logprobs: chunk must be >= 1, got {plan.chunk}")
    targets = targets.to(device)
    rows = torch.arange(targets.shape[0], device=device) if rows is None else rows.to(device)
    if temperatures is None:
        inv_temp = torch.ones(hidden.shape[0], dtype=torch.float32, device=device)
    else:
        t = temperatures.to(device=device, dtype=torch.float32)
        inv_temp = torch.where(t > 0, 1.0 / t.clamp_min(1e-12), torch.ones_like(t))
    order = torch.argsort(rows, stable=True)  # targets grouped by row: each chunk of rows takes a contiguous run
    out, ent = _ChunkedLogprob.apply(hidden, weight, bias, targets[order], rows[order], inv_temp, plan, softcap,
                                     entropy is not None)
    back = torch.argsort(order)
    if entropy is not None:
        entropy.add(ent[back])
    return out[back]


def head_logprobs(model: PreTrainedModel, hidden: Tensor, targets: Tensor, temperatures: Tensor, *,
                  rows: Tensor | None = None, entropy: Entropies | None = None) -> Tensor:
    """chunked_logprobs through `model`'s own output head, with its final-logit soft-capping (Gemma 2)."""
    head = model.get_output_embeddings()
    return chunked_logprobs(hidden, head.weight, targets, temperatures, rows=rows, bias=head.bias,
                            softcap=getattr(model.config, "final_logit_softcapping", None), entropy=entropy)
