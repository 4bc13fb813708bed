"""ModelRunner: a variable-length forward pass over a Llama-family HF model with our own KV storage.

All new tokens of all scheduled sequences are flattened into one [N, hidden] batch, so projections,
norms and MLPs run as single matmuls whatever the mix of prefill chunks and decode tokens; attention
runs per sequence over that sequence's own contiguous KV (no padding, no gathering of other
sequences' caches). The weights are the HF module's own tensors, so `load_state_dict` on the model is
immediately visible here.

Supported: decoder layers with q/k/v/o projections, RMSNorm, rotary embeddings from the model's own
`rotary_emb`, grouped-query attention, and an MLP module (Llama, Mistral, Qwen2, SmolLM2). Anything
else raises UnsupportedModel at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class UnsupportedModel(ValueError):
    pass


class SequenceKV:
    """KV of one sequence for every layer: [layers, 2, kv_heads, capacity, head_dim], grown by doubling."""

    __slots__ = ("data", "length")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        self.data = torch.empty((layers, 2, kv_heads, max(capacity, 16), head_dim), dtype=dtype)
        self.length = 0  # tokens whose K/V are stored

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        cap = self.capacity
        while cap < total:
            cap *= 2
        grown = torch.empty((*self.data.shape[:3], cap, self.data.shape[4]), dtype=self.data.dtype)
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown

    def copy_prefix(self, other: SequenceKV, n: int) -> None:
        """Take the first n tokens' K/V from `other` (a prefix-cache hit)."""
        self.reserve(n)
        self.data[:, :, :, :n] = other.data[:, :, :, :n]
        self.length = n


@dataclass(slots=True)
class Chunk:
    """New tokens of one sequence in this forward pass; they follow kv.length cached tokens."""

    kv: SequenceKV
    tokens: list[int]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module):
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise UnsupportedModel(f"builtin engine: {type(model).__name__} is not a Llama-family causal LM")
        attn = base.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn, name):
                raise UnsupportedModel(f"builtin engine: attention without {name}")
        if hasattr(attn, "q_norm") or getattr(model.config, "sliding_window", None):
            raise UnsupportedModel("builtin engine: q/k norms and sliding windows are not supported yet")
        cfg = model.config
        self.model = model
        self.base = base
        self.head = model.get_output_embeddings()
        self.n_layers = len(base.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.dtype = next(model.parameters()).dtype

    def new_kv(self, capacity: int) -> SequenceKV:
        return SequenceKV(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the new tokens of every chunk; store their K/V; return last-token logits [len(chunks), V]."""
        lengths = [len(c.tokens) for c in chunks]
        starts = [c.kv.length for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        for c, n in zip(chunks, lengths):
            c.kv.reserve(c.kv.length + n)
        h = self.base.embed_tokens(ids)  # [N, hidden]
        cos, sin = self.base.rotary_emb(h, positions.unsqueeze(0))  # [1, N, D]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, D]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        masks = [
            None if n == 1 else torch.ones(n, s + n, dtype=torch.bool).tril(diagonal=s)
            for s, n in zip(starts, lengths)
        ]
        N = ids.shape[0]
        # Per-sequence (start, end, past, whole-model kv tensor, mask), computed once for all layers.
        plan = [(offsets[i], offsets[i + 1], starts[i], c.kv.data, masks[i]) for i, c in enumerate(chunks)]
        gqa = self.n_kv_heads != self.n_heads
        for li, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(N, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(N, self.n_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(N, self.n_kv_heads, self.head_dim)
            q = (q * cos + _rotate_half(q) * sin).transpose(0, 1)  # [H, N, D]
            k = k * cos + _rotate_half(k) * sin
            new_kv = torch.stack((k, v)).transpose(1, 2)  # [2, kv_heads, N, D]
            out = torch.empty_like(q)  # [H, N, D]
            for a, b, s, data, mask in plan:
                store = data[li]  # [2, kv_heads, cap, D]
                end = s + b - a
                store[:, :, s:end] = new_kv[:, :, a:b]
                # 4-D inputs: with 3-D ones torch falls back to its slow "math" attention on CPU.
                out[:, a:b] = F.scaled_dot_product_attention(
                    q[None, :, a:b], store[None, 0, :, :end], store[None, 1, :, :end], attn_mask=mask,
                    scale=self.scaling, enable_gqa=gqa,
                )[0]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(N, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for c, n in zip(chunks, lengths):
            c.kv.length += n
        last = torch.tensor([o - 1 for o in offsets[1:]])
        return self.head(self.base.norm(h[last])).float()
