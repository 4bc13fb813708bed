"""ModelRunner: a variable-length forward pass over a Llama-family HF model with our own KV storage.

All new tokens of all scheduled sequences are flattened into one [N, hidden] batch, so projections,
norms and MLPs run as single matmuls whatever the mix of prefill chunks and decode tokens.

Where the time goes on a CPU, and what this module does about it (SmolLM2-135M, 32 sequences
decoding, 2 cores of this machine; numbers in benchmarks/RESULTS.md):
- Matmuls. torch's default CPU GEMM here is MKL, which on AMD processors runs its AVX2 code path;
  oneDNN's AVX-512 kernels with weights pre-packed for them are 2.5-4x faster at decode batch sizes.
  The runner keeps a packed copy of every projection (q/k/v fused, gate/up fused; linears.py) and rebuilds
  those whose weights changed in `refresh()`, which the engine calls whenever weights change (update_weights).
  Runners whose models share a weight tensor share its packed copy (linears.py: `loomrl serve --adapter`).
  Without oneDNN (or for dtypes it does not pack) it falls back to F.linear on the fused plain tensors.
- Attention of decode tokens. Running sequences keep their K/V in one pool tensor, a slot each
  ([layers, 2, slots, kv_heads, capacity, head_dim]), so the decode tokens of a step attend in one
  batched matmul per layer (padded to the longest sequence, masked) instead of one call per sequence.
  Prefill chunks attend per sequence (causal mask) over their own slot.
- K/V of finished sequences that the prefix cache keeps are copied out of the pool into compact
  standalone tensors (`SequenceKV.detach`), so pool slots are reused at once.

Supported: decoder layers with q/k/v/o projections (biases allowed), RMSNorm, rotary embeddings from
the model's own `rotary_emb`, grouped-query attention, q/k RMSNorm per head (Qwen3) or over the whole projection
(OLMoE), a gated MLP or a top-k mixture of experts (moe.py: Qwen3-MoE, Mixtral, OLMoE), tied or separate embeddings
(Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM2, Qwen3-MoE, Mixtral, OLMoE).
With record_experts, an MoE model's routed experts are stored beside each token's K/V (KVPool.experts) and travel
with it (prefix-cache copies, detach), so a sequence's record covers a reused prefix with the routing its K/V was
computed with (routed_experts.py defines the record).
Anything else raises UnsupportedModel at construction. The runner computes in the model's dtype on its device,
and makes every tensor of a step there (K/V in that dtype too); the oneDNN packing is for float32 on the CPU only.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loomrl.engine.builtin.linears import Linear, linear_of, rows_independent
from loomrl.engine.builtin.moe import MoeMlp, is_sparse_block, moe_mlp_of
from loomrl.routed_experts import RoutedExperts

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class UnsupportedModel(ValueError):
    pass


def _doubled(capacity: int, need: int) -> int:
    """`capacity` doubled until it holds `need` tokens."""
    while capacity < need:
        capacity *= 2
    return capacity


class KVPool:
    """K/V of running sequences: [layers, 2, slots, kv_heads, capacity, head_dim], a slot per sequence.

    Both the slot count and the per-slot capacity grow by doubling (copying the pool); slots are handed out lowest
    first so the batched decode attention, which spans slots 0..max used, scans few holes."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 slots: int = 8, capacity: int = 256, routing: tuple[int, int] | None = None):
        self.data = torch.zeros((layers, 2, slots, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        # routing=(MoE layers, top_k): each stored token's routed experts beside its K/V, [slots, capacity, MoE
        # layers, top_k], -1 where not computed here (a prefix from a shared pool); None: not recorded
        self.experts = None if routing is None else torch.full((slots, capacity, *routing), -1, dtype=torch.int16,
                                                               device=device)
        self._free = list(range(slots))

    @property
    def slots(self) -> int:
        return self.data.shape[2]

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def acquire(self) -> int:
        if not self._free:
            old = self.slots
            self._regrow(slots=old * 2)
            self._free = list(range(old, old * 2))
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def ensure_capacity(self, tokens: int) -> None:
        if tokens > self.capacity:
            self._regrow(capacity=_doubled(self.capacity, tokens))

    def _regrow(self, *, slots: int | None = None, capacity: int | None = None) -> None:
        s, c = slots or self.slots, capacity or self.capacity
        grown = self.data.new_zeros((*self.data.shape[:2], s, self.data.shape[3], c, self.data.shape[5]))
        grown[:, :, : self.slots, :, : self.capacity] = self.data
        if self.experts is not None:
            experts = self.experts.new_full((s, c, *self.experts.shape[2:]), -1)
            experts[: self.slots, : self.capacity] = self.experts
            self.experts = experts
        self.data = grown


class SequenceKV:
    """K/V of one sequence for every layer, [layers, 2, kv_heads, capacity, head_dim].

    Either a slot of a KVPool (running sequences) or a standalone tensor (entries kept by the prefix
    cache after their sequence left the batch, and the unit tests). Where the pool records routing, `experts` holds
    each stored token's routed experts beside its K/V ([capacity, MoE layers, top_k], -1: unknown), copied with it."""

    __slots__ = ("_data", "_experts", "pool", "slot", "length", "owner")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 pool: KVPool | None = None, device: torch.device | str = "cpu"):
        self.pool = pool
        self.slot = -1
        self._data: torch.Tensor | None = None
        self._experts: torch.Tensor | None = None  # a standalone copy's routing (detach); pool slots use the pool's
        if pool is not None:
            self.slot = pool.acquire()
            pool.ensure_capacity(capacity)
        else:
            self._data = torch.empty((layers, 2, kv_heads, max(capacity, 16), head_dim), dtype=dtype, device=device)
        self.length = 0  # tokens whose K/V are stored
        self.owner = ""  # the program it was computed for (programs.py counts each program's tokens by it)

    @property
    def data(self) -> torch.Tensor:
        if self.pool is not None:
            return self.pool.data[:, :, self.slot]
        assert self._data is not None, "SequenceKV used after free()"
        return self._data

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def experts(self) -> torch.Tensor | None:
        """The stored tokens' routed experts, [capacity, MoE layers, top_k] (-1: unknown); None where not recorded."""
        if self.pool is not None:
            return None if self.pool.experts is None else self.pool.experts[self.slot]
        return self._experts

    def reserve(self, total: int) -> None:
        if self.pool is not None:
            self.pool.ensure_capacity(total)
            return
        if total <= self.capacity:
            return
        grown = self.data.new_empty((*self.data.shape[:3], _doubled(self.capacity, total), self.data.shape[4]))
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        if self._experts is not None:
            experts = self._experts.new_full((grown.shape[3], *self._experts.shape[1:]), -1)
            experts[: self.length] = self._experts[: self.length]
            self._experts = experts
        self._data = grown

    def copy_prefix(self, other: SequenceKV, n: int) -> None:
        """Take the first n tokens' K/V from `other` (a prefix-cache hit)."""
        self.reserve(n)
        self.data[:, :, :, :n] = other.data[:, :, :, :n]
        mine, theirs = self.experts, other.experts
        if mine is not None:  # a donor without routing (a shared pool's entry): those tokens' experts are unknown
            mine[:n] = theirs[:n] if theirs is not None else -1
        self.length = n

    def detach(self) -> None:
        """Leave the pool: keep a compact copy of the stored tokens and give the slot back."""
        if self.pool is not None:
            self._data = self.data[:, :, :, : max(self.length, 1)].clone()
            experts = self.experts
            self._experts = None if experts is None else experts[: max(self.length, 1)].clone()
            self.pool.release(self.slot)
            self.pool, self.slot = None, -1

    def free(self) -> None:
        if self.pool is not None:
            self.pool.release(self.slot)
        self.pool, self.slot, self._data, self._experts = None, -1, None, None


@dataclass(slots=True)
class Chunk:
    """New tokens of one sequence in this forward pass; they follow kv.length cached tokens. `logits`: how many of its
    last positions' logits the pass returns (1: the next token's; 1 + k: a decode token and k drafts to verify; 0: a
    prefill chunk that samples nothing yet)."""

    kv: SequenceKV
    tokens: list[int]
    logits: int = 1


@dataclass(slots=True)
class _Block:
    """A batched attention plan (ModelRunner._block): the query rows of some chunks laid out T per slot."""

    slots: torch.Tensor  # [S] pool slots the block attends over, in block order
    T: int
    span: int
    mask: torch.Tensor  # [S, 1, 1, T, span] additive
    gather: bool  # slots are gathered (else they are the pool's 0..S-1, read as a view)
    q_rows: torch.Tensor  # the query rows of the step's flattened batch ...
    q_block: torch.Tensor  # ... their index in the block ...
    q_t: torch.Tensor  # ... and their row within it


# Chunks up to this many tokens attend batched over the pool (decode tokens, drafts being verified); longer ones alone.
SHORT_CHUNK = 16
MIN_SPAN = 16  # the fewest key positions a batched attention spans (_block)


@dataclass(slots=True)
class _LayerWeights:
    qkv: Linear
    o: Linear
    gate_up: Linear | None  # a gated MLP's (None in an MoE layer)
    down: Linear | None
    moe: MoeMlp | None  # an MoE layer's experts and router
    norm1: torch.Tensor
    norm2: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm of each head's q and k before the rotary embedding
    k_norm: torch.Tensor | None  # (OLMoE: of the whole q and k projections, _qk_norms_whole)


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, record_experts: bool = False, share_linears: bool = False):
        """`record_experts`: keep every computed token's routed experts beside its K/V (an MoE model's; a dense model
        has none to keep), read back by routed_experts(). `share_linears`: share packed linears with other sharing
        runners over the same unchanged tensors (linears.py; `loomrl serve --adapter`)."""
        self.share_linears = share_linears
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise UnsupportedModel(f"builtin engine: {type(model).__name__} is not a Llama-family causal LM")
        layer0 = base.layers[0]
        attn = layer0.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn, name):
                raise UnsupportedModel(f"builtin engine: attention without {name}")
        if getattr(model.config, "sliding_window", None):
            raise UnsupportedModel("builtin engine: sliding-window attention is not supported yet")
        qk_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]  # Qwen3: RMSNorm per head
        if any(n is None for n in qk_norms) and any(n is not None for n in qk_norms):
            raise UnsupportedModel("builtin engine: a q norm without a k norm (or the reverse) is not supported")
        if getattr(model.config, "clip_qkv", None) is not None:
            raise UnsupportedModel("builtin engine: clip_qkv (clamped q/k/v projections) is not supported yet")
        self.moe_layers = self._check_mlps(base.layers)
        for norm in (layer0.input_layernorm, layer0.post_attention_layernorm, base.norm, *filter(None, qk_norms)):
            if "RMSNorm" not in type(norm).__name__ or "Gemma" in type(norm).__name__ \
                    or not hasattr(norm, "variance_epsilon"):
                raise UnsupportedModel(f"builtin engine: {type(norm).__name__} is not a plain RMSNorm")
        cfg = model.config
        self.base = base
        self.head_module = model.get_output_embeddings()
        self.n_layers = len(base.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.eps = layer0.input_layernorm.variance_epsilon
        self.qk_eps = qk_norms[0].variance_epsilon if qk_norms[0] is not None else None
        self._qk_norms_whole = self._qk_norm_span(qk_norms[0], qk_norms[1])
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # every tensor of a step is made here
        self.refresh()
        moe = next((w.moe for w in self.layers if w.moe is not None), None)
        self.num_experts = moe.num_experts if moe is not None else 0
        routing = (len(self.moe_layers), moe.top_k) if record_experts and moe is not None else None
        self.pool = KVPool(self.n_layers, self.n_kv_heads, self.head_dim, self.dtype, self.device, routing=routing)

    @staticmethod
    def _check_mlps(layers) -> tuple[int, ...]:
        """The indexes of the MoE layers (moe.py's blocks), after checking every other layer has a gated MLP."""
        sparse = []
        for i, layer in enumerate(layers):
            if is_sparse_block(layer.mlp):
                sparse.append(i)
                continue
            for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
                if not hasattr(layer.mlp, name):
                    raise UnsupportedModel(f"builtin engine: {type(layer.mlp).__name__} of layer {i} has no {name} "
                                           "(a gated MLP or a Qwen3-MoE, Mixtral or OLMoE expert block is required)")
        return tuple(sparse)

    def _qk_norm_span(self, q_norm, k_norm) -> bool:
        """Whether the q/k RMSNorms span whole projections (OLMoE) rather than each head (Qwen3); False without."""
        if q_norm is None:
            return False
        H, KH, D = self.n_heads, self.n_kv_heads, self.head_dim
        widths = (q_norm.weight.shape[0], k_norm.weight.shape[0])
        if widths == (D, D):
            return False
        if widths == (H * D, KH * D):
            return True
        raise UnsupportedModel(f"builtin engine: q/k norms of widths {widths} are neither per head ({D}) nor over "
                               f"the whole projections ({H * D}, {KH * D})")

    def refresh(self) -> None:
        """Re-read the model's weights; call after they change. A group whose tensors did not change keeps its packed
        copy (shared with other runners over the same tensors); one whose did gets a new one (linears.py)."""
        lin = functools.partial(linear_of, share=self.share_linears)
        layers: list[_LayerWeights] = []
        for i, layer in enumerate(self.base.layers):
            a, m = layer.self_attn, layer.mlp
            moe = None
            if i in self.moe_layers:
                try:
                    moe = moe_mlp_of(m)
                except ValueError as err:
                    raise UnsupportedModel(f"builtin engine: {err}") from err
            layers.append(_LayerWeights(
                qkv=lin(a.q_proj, a.k_proj, a.v_proj), o=lin(a.o_proj),
                gate_up=lin(m.gate_proj, m.up_proj) if moe is None else None,
                down=lin(m.down_proj) if moe is None else None, moe=moe,
                norm1=layer.input_layernorm.weight.detach(), norm2=layer.post_attention_layernorm.weight.detach(),
                q_norm=a.q_norm.weight.detach() if self.qk_eps is not None else None,
                k_norm=a.k_norm.weight.detach() if self.qk_eps is not None else None,
            ))
        self.layers = layers
        self.head = lin(self.head_module)

    def batch_invariant(self) -> bool:
        """Whether a request's logits are the same bits whatever else shares its step: every projection's kernel gives
        a row the same bits for any number of rows (linears.py rows_independent, measured once per shape) and no MoE
        layer groups tokens by expert. Attention runs per sequence or over masked padding; measured not to change the
        bits on this project's CPUs (tests/runtime/test_reproducible.py)."""
        if self.moe_layers:
            return False
        linears = [lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down) if lin is not None]
        return all(rows_independent(*lin.shape, dtype=self.dtype, device=str(self.device))
                   for lin in {lin.shape: lin for lin in [*linears, self.head]}.values())

    def _block(self, which: list[int], chunks: list[Chunk], lengths: list[int], starts: list[int],
               offsets: list[int], *, gather: bool) -> _Block | None:
        """The batched attention plan of chunks `which`: their slots (gathered: only theirs, in order; else the pool's
        0..max slot, those without a query seeing position 0 only), a query block of T rows each, row t of a chunk
        seeing its slot's positions before start + t + 1."""
        if not which:
            return None
        dev = self.device
        T = max(lengths[i] for i in which)
        own = [chunks[i].kv.slot for i in which]
        block_of = list(range(len(which))) if gather else own  # each chunk's index in the block
        n = len(which) if gather else max(own) + 1
        limit = [[1] * T for _ in range(n)]
        for i, at in zip(which, block_of):
            limit[at] = [starts[i] + min(t, lengths[i] - 1) + 1 for t in range(T)]
        # at least MIN_SPAN positions: torch's CPU GEMM sums fewer in another grouping, so a short sequence's bits would
        # depend on whether a longer one shares its step (docs/reproducibility.md); the mask hides the extra positions
        span = min(max(MIN_SPAN, *(max(row) for row in limit)), self.pool.data.shape[4])
        lim = torch.tensor(limit, dtype=torch.long, device=dev)  # [S, T]
        mask = torch.zeros(n, T, span, dtype=self.dtype, device=dev).masked_fill_(
            torch.arange(span, device=dev)[None, None, :] >= lim[:, :, None], float("-inf")).view(n, 1, 1, T, span)
        return _Block(
            slots=torch.tensor(own if gather else list(range(n)), dtype=torch.long, device=dev), T=T, span=span, mask=mask,
            gather=gather,
            q_rows=torch.tensor([offsets[i] + t for i in which for t in range(lengths[i])], dtype=torch.long,
                                device=dev),
            q_block=torch.tensor([at for i, at in zip(which, block_of) for _ in range(lengths[i])], dtype=torch.long,
                                 device=dev),
            q_t=torch.tensor([t for i in which for t in range(lengths[i])], dtype=torch.long, device=dev))

    def new_kv(self, capacity: int) -> SequenceKV:
        """K/V storage of a running sequence: a slot of the pool."""
        return SequenceKV(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype, pool=self.pool)

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the new tokens of every chunk and store their K/V; return the logits of each chunk's last `logits`
        positions, in chunk order: [sum of logits, V]."""
        lengths = [len(c.tokens) for c in chunks]
        starts = [c.kv.length for c in chunks]
        for c, n in zip(chunks, lengths):
            c.kv.reserve(c.kv.length + n)
        dev = self.device
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=dev)
        positions = torch.tensor([p for s, n in zip(starts, lengths) for p in range(s, s + n)], dtype=torch.long,
                                 device=dev)
        N, H, KH, D = ids.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        group = H // KH
        h = self.base.embed_tokens(ids)  # [N, hidden]
        cos, sin = self.base.rotary_emb(h, positions.unsqueeze(0))  # [1, N, D]
        cos = cos[0].unsqueeze(1)  # [N, 1, D]
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        sin = (sin[0] * torch.tensor([-1.0] * (D // 2) + [1.0] * (D // 2), dtype=sin.dtype, device=dev)).unsqueeze(1)

        offsets = [0, *itertools.accumulate(lengths)]
        if any(c.kv.pool is None for c in chunks):
            raise ValueError("ModelRunner.forward: every chunk's kv must come from new_kv() (a pool slot)")
        # Where each new token's K/V goes in the pool.
        slot_of = torch.tensor([c.kv.slot for c, n in zip(chunks, lengths) for _ in range(n)], dtype=torch.long,
                               device=dev)

        # Decode tokens attend in one batched matmul per layer over the pool's slots 0..max (a query row per slot).
        # Other short chunks (a decode token with drafts to verify, a short prompt tail) attend batched too, over
        # their own slots gathered, T query rows each: kept apart so that a few drafts do not pad every decode row
        # to T rows. Longer chunks (prefill) attend one call each.
        blocks = [b for b in (
            self._block([i for i, n in enumerate(lengths) if n == 1], chunks, lengths, starts, offsets, gather=False),
            self._block([i for i, n in enumerate(lengths) if 1 < n <= SHORT_CHUNK], chunks, lengths, starts, offsets,
                        gather=True)) if b is not None]
        prefill = [i for i, n in enumerate(lengths) if n > SHORT_CHUNK]
        pre_plan = [
            (offsets[i], offsets[i + 1], starts[i], chunks[i].kv.slot,
             torch.ones(lengths[i], starts[i] + lengths[i], dtype=torch.bool, device=dev).tril(diagonal=starts[i]))
            for i in prefill
        ]
        pool = self.pool.data
        for li, w in enumerate(self.layers):
            x = F.rms_norm(h, (h.shape[-1],), w.norm1, self.eps)
            qkv = w.qkv(x).view(N, H + 2 * KH, D)
            qk = qkv[:, : H + KH]
            if w.q_norm is not None and self._qk_norms_whole:
                qk = torch.cat((F.rms_norm(qk[:, :H].reshape(N, H * D), (H * D,), w.q_norm, self.qk_eps),
                                F.rms_norm(qk[:, H:].reshape(N, KH * D), (KH * D,), w.k_norm, self.qk_eps)),
                               dim=1).view(N, H + KH, D)
            elif w.q_norm is not None:
                qk = torch.cat((F.rms_norm(qk[:, :H], (D,), w.q_norm, self.qk_eps),
                                F.rms_norm(qk[:, H:], (D,), w.k_norm, self.qk_eps)), dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KH :]
            layer_kv = pool[li]  # [2, slots, KH, cap, D]
            layer_kv[:, slot_of, :, positions] = torch.stack((k, v), dim=1)
            out = h.new_empty(N, H, D)
            for blk in blocks:
                S, T, span = blk.slots.shape[0], blk.T, blk.span
                qs = h.new_zeros(S, H, T, D)
                qs[blk.q_block, :, blk.q_t] = q[blk.q_rows]
                if blk.gather:
                    # sliced first: index_select copies, and a slot holds its whole capacity
                    keys = layer_kv[0, :, :, :span].index_select(0, blk.slots)  # [S, KH, span, D]
                    values = layer_kv[1, :, :, :span].index_select(0, blk.slots)
                else:
                    keys, values = layer_kv[0, :S, :, :span], layer_kv[1, :S, :, :span]
                scores = torch.matmul(qs.view(S, KH, group * T, D), keys.transpose(-1, -2))
                scores = scores.mul_(self.scaling).view(S, KH, group, T, span).add_(blk.mask)
                probs = torch.softmax(scores, dim=-1).view(S, KH, group * T, span)
                out[blk.q_rows] = torch.matmul(probs, values).view(S, H, T, D)[blk.q_block, :, blk.q_t]
            for a, b, s, slot, mask in pre_plan:
                end = s + b - a
                # 4-D inputs: with 3-D ones torch falls back to its slow "math" attention on CPU.
                out[a:b] = F.scaled_dot_product_attention(
                    q[None, a:b].transpose(1, 2), layer_kv[None, 0, slot, :, :end], layer_kv[None, 1, slot, :, :end],
                    attn_mask=mask, scale=self.scaling, enable_gqa=KH != H,
                )[0].transpose(0, 1)
            h = h + w.o(out.view(N, H * D))
            x = F.rms_norm(h, (h.shape[-1],), w.norm2, self.eps)
            h = h + self._mlp(li, w, x, slot_of, positions)
        for c, n in zip(chunks, lengths):
            c.kv.length += n
        rows = torch.tensor([p for c, end in zip(chunks, offsets[1:]) for p in range(end - c.logits, end)],
                            dtype=torch.long, device=dev)
        hl = F.rms_norm(h[rows], (h.shape[-1],), self.base.norm.weight.detach(), self.base.norm.variance_epsilon)
        return self.head(hl).float()

    def _mlp(self, li: int, w: _LayerWeights, x: torch.Tensor, slot_of: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        """Layer li's MLP of the normed tokens x [N, hidden]; an MoE layer records their experts at their K/V's places
        when the pool keeps routing."""
        if w.moe is None:
            assert w.gate_up is not None and w.down is not None  # refresh() builds them for every non-MoE layer
            gate, up = w.gate_up(x).chunk(2, dim=-1)
            return w.down(self.base.layers[li].mlp.act_fn(gate) * up)
        out, chosen = w.moe(x)  # chosen: [N, top_k]
        if self.pool.experts is not None:
            self.pool.experts[slot_of, positions, self.moe_layers.index(li)] = chosen.to(torch.int16)
        return out

    def routed_experts(self, kv: SequenceKV | None, tokens: int) -> RoutedExperts | None:
        """The routed experts of the first `tokens` positions `kv` stores (fewer where it stores fewer; none for a
        sequence without K/V): the record routed_experts.py defines. None unless the runner records them."""
        if self.pool.experts is None:
            return None
        experts = kv.experts if kv is not None else None
        if kv is None or experts is None:  # never admitted (an interrupt while it waited): no token computed
            experts, tokens = self.pool.experts[0], 0
        ids = experts[: min(tokens, kv.length if kv is not None else 0)]
        return RoutedExperts.of(ids, layers=self.moe_layers, num_experts=self.num_experts)
