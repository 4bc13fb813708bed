"""RoutedExperts: the experts a mixture-of-experts engine routed each token of a sequence to, per MoE layer.

The record the trainer's router replay (R3) reads: with it the trainer forces the engine's expert choice for every
token it recomputes, while the routing weights still come from its own router (so the router keeps its gradient).

Format (engine-independent; vLLM's `CompletionOutput.routed_experts` is the same [tokens, layers, top_k] array in the
same narrow dtype, so a vLLM engine can fill this record too):
- `data`: the bytes of a C-order array of shape [tokens, len(layers), top_k] in `dtype`: uint8 when the model has at
  most 255 experts, else uint16 (2 bytes). bytes_per_token = len(layers) * top_k * itemsize.
- Rows (tokens), in sequence order from position 0: the request's prompt, then its generated tokens, all but the last
  generated one: row i is the token at position i of prompt + output, for i < len(prompt) + len(output) - 1. The last
  generated token was sampled, never fed through the model, so it has no routing (and no logprob depends on it).
  An interrupted request's record may hold fewer rows (what was computed before the interrupt).
- `layers`: the decoder-layer index of each recorded layer, in order: only MoE layers (a Qwen3-MoE model with
  mlp_only_layers has dense ones, which route nothing).
- Within a row and layer: the top_k expert ids in the router's top-k order (descending routing probability, as
  torch.topk returns them, the order HF's experts read their weights in).
- UNKNOWN (the dtype's largest value, 255 or 65535) marks a row whose routing the engine did not compute itself: its
  K/V came from a shared K/V pool of another instance (engine/kv_pool.py), which keeps no routing. The trainer routes
  such rows with its own router. Prefix-cache hits within one engine are not unknown: the built-in engine keeps each
  token's experts with its cached K/V, so a reused prefix reports the routing its K/V was computed with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch


def experts_dtype(num_experts: int) -> Literal["uint8", "uint16"]:
    """The narrowest dtype that holds every expert id of `num_experts` and the UNKNOWN mark above them."""
    if num_experts <= 255:
        return "uint8"
    if num_experts <= 65535:
        return "uint16"
    raise ValueError(f"routed experts: {num_experts} experts do not fit a uint16 record")


@dataclass(slots=True, kw_only=True, frozen=True)
class RoutedExperts:
    """Routed experts of a sequence's tokens: [tokens, len(layers), top_k] in `dtype` (see the module docstring)."""

    data: bytes
    dtype: Literal["uint8", "uint16"]
    tokens: int
    layers: tuple[int, ...]  # decoder-layer index of each recorded (MoE) layer
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if len(self.data) != self.tokens * self.bytes_per_token:
            raise ValueError(f"RoutedExperts: {len(self.data)} bytes do not hold {self.tokens} tokens of "
                             f"{self.bytes_per_token} bytes")

    @property
    def unknown(self) -> int:
        """The id that marks a row the engine did not route itself."""
        return int(np.iinfo(self.dtype).max)

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * self.top_k * np.dtype(self.dtype).itemsize

    def array(self) -> np.ndarray:
        """The ids as a read-only array [tokens, layers, top_k] in `dtype` (UNKNOWN where unrouted)."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.tokens, len(self.layers), self.top_k)

    def tensor(self) -> torch.Tensor:
        """The ids as an int64 tensor [tokens, layers, top_k], -1 where the engine did not route the token."""
        import torch

        ids = self.array().astype(np.int64)
        ids[ids == self.unknown] = -1
        return torch.from_numpy(ids)

    @classmethod
    def of(cls, ids: torch.Tensor, *, layers: tuple[int, ...], num_experts: int) -> RoutedExperts:
        """The record of `ids` ([tokens, layers, top_k] integers, -1 where unrouted), on any device."""
        dtype = experts_dtype(num_experts)
        arr = ids.detach().to("cpu").numpy().astype(np.int64)
        arr[arr < 0] = np.iinfo(dtype).max
        return cls(data=arr.astype(dtype).tobytes(), dtype=dtype, tokens=arr.shape[0], layers=layers,
                   top_k=arr.shape[2], num_experts=num_experts)
