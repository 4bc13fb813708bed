"""MoeMlp: the sparse mixture-of-experts MLP of the built-in engine's runner, computed as transformers computes it.

Covered: the top-k softmax routers of transformers 5.x's Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock and
OlmoeSparseMoeBlock (5.19 and 5.25 compute them alike), whose experts are fused 3-D tensors: gate_up_proj
[experts, 2 * intermediate, hidden] (gate rows first, then up) and down_proj [experts, hidden, intermediate]. The router
is softmax(x @ router.T) in float32, then top-k of the probabilities, then (Mixtral always; Qwen3-MoE and OLMoE when
norm_topk_prob) the k weights renormalised to sum to 1; Qwen3-MoE and OLMoE cast them back to the logits' dtype, Mixtral
keeps them float32. Each token's output is the weighted sum of its experts' gated MLPs, added in ascending expert order
as HF's loop adds them.

Not covered (refused by the runner): shared experts (Qwen2-MoE), grouped or biased routing (DeepSeek-V3, GLM-4.5),
experts with biases (GPT-OSS), per-expert nn.Linear modules (transformers 4.x layouts).

The tokens of a step are batched: they are sorted by expert once (one host sync for the counts), and each expert runs
one matmul pair over its rows (index_select in, index_add out). The experts' weights are the model's own tensors
(no packed copy: at CPU decode batch sizes each expert sees a few rows, where packing gains little).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn

# The HF blocks covered, and whether each always renormalises its top-k weights (None: its router's norm_topk_prob
# says) and casts them back to the logits' dtype.
_BLOCKS: dict[str, tuple[bool | None, bool]] = {
    "Qwen3MoeSparseMoeBlock": (None, True),
    "OlmoeSparseMoeBlock": (None, True),
    "MixtralSparseMoeBlock": (True, False),
}


def is_sparse_block(mlp: nn.Module) -> bool:
    """Whether `mlp` is an MoE block of a family this module computes."""
    return type(mlp).__name__ in _BLOCKS


@dataclass(slots=True)
class MoeMlp:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]
    down: torch.Tensor  # [experts, hidden, intermediate]
    act: Callable[[torch.Tensor], torch.Tensor]
    top_k: int
    renormalise: bool  # the top-k weights divided by their sum
    cast_weights: bool  # the top-k weights cast back to the router logits' dtype (else kept float32)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and expert ids: ([N, k], [N, k]), in the router's top-k order."""
        logits = F.linear(x, self.router)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.cast_weights else weights), chosen

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for tokens x [N, hidden], and the experts each was routed to [N, k]."""
        weights, chosen = self.route(x)
        k = self.top_k
        flat = chosen.reshape(-1)  # [N * k]: token t's j-th choice at t * k + j
        order = torch.argsort(flat, stable=True)  # grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            picks = order[start : start + n]
            start += n
            rows = picks // k  # [n] tokens routed to e (each once: a token never picks an expert twice)
            gate, up = F.linear(x.index_select(0, rows), self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e]) * weights.reshape(-1)[picks, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out, chosen


def moe_mlp_of(block: nn.Module) -> MoeMlp:
    """The MoeMlp computing `block` (is_sparse_block) with its current weights; ValueError naming what differs."""
    name = type(block).__name__
    always, cast = _BLOCKS[name]
    # transformers' modules, read by their attribute names (typed Any: nn.Module's __getattr__ says Tensor | Module)
    router: Any = block.gate
    experts: Any = block.experts
    gate_up: torch.Tensor = experts.gate_up_proj
    down: torch.Tensor = experts.down_proj
    E, H = router.weight.shape
    if gate_up.dim() != 3 or gate_up.shape[0] != E or gate_up.shape[2] != H or down.shape != (
            E, H, gate_up.shape[1] // 2):
        raise ValueError(f"{name}: experts are not fused [experts, 2 * intermediate, hidden] and "
                         "[experts, hidden, intermediate] tensors")
    # the layout flags transformers' use_experts_implementation sets (5.x); absent, the class's own defaults hold
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) \
            or not getattr(experts, "is_concatenated", True) or not getattr(experts, "has_gate", True):
        raise ValueError(f"{name}: experts with biases, transposed, interleaved or ungated weights are not supported")
    renormalise = always if always is not None else bool(router.norm_topk_prob)
    return MoeMlp(router=router.weight.detach(), gate_up=gate_up.detach(), down=down.detach(), act=experts.act_fn,
                  top_k=router.top_k, renormalise=renormalise, cast_weights=cast)
