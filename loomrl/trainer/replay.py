"""Router replay (R3) for mixture-of-experts models: the trainer's forward uses the experts the engine's router chose,
with routing weights from the trainer's own router, so the router keeps its gradient and the trainer's logprobs are
those of the policy that sampled (up to its weights' change), not of a different expert choice.

What it is. `replay_routing` hooks every routed MoE block's router (transformers 5.x `Qwen3MoeTopKRouter`,
`MixtralTopKRouter`, `OlmoeTopKRouter`: the same (logits, weights, indices) contract in 5.19 and 5.25) for the length
of a forward: the router computes its logits as usual; the hook replaces its top-k indices with the recorded experts
and its weights with the router's own probabilities gathered at them, normalised as that model normalises its top-k
(Qwen3-MoE, OLMoE: softmax over all experts, gather, divide by their sum when `norm_topk_prob`, back to the logits'
dtype; Mixtral: the same with the division always, which is the softmax over the chosen logits). Recorded experts
equal to the router's own top-k give the model's own forward exactly. It also collects each layer's router logits for
the load-balancing loss (`aux_loss`: transformers' own `load_balancing_loss_func`).

The input: per sample, `experts` an integer tensor [T, L, k] aligned with the sample's token_ids: row t holds, for each
of the model's L routed MoE layers (bottom first, counting only layers with a routed block: Qwen3-MoE's
`mlp_only_layers` are skipped), the k experts the engine's router chose for token t when token t was the input
(prompt tokens at prefill, a sampled token when fed back). Order within k does not matter. `dense_rows` lays them out
as the padded [B, T] forward's flattened rows; `keyed_tree` as a merged forward's packed nodes.

Tree merge. Two samples share a trie node only when their tokens AND recorded experts agree on the whole prefix up to
and including that token: samples whose prefixes were prefilled under different weight versions (and so may have
routed differently) are split into separate branches there, each computed with its own experts. Never merged
across a disagreement, never refused.

In a run (trainer.router_replay): the built-in engine records each token's experts (routed_experts.py), the
agent loop keeps them per turn and the samples carry each context's record (turn_experts.py, TrainingSample
.routed_experts); every policy forward of a step (the proximal policy's, the KL reference's, the training one, dense
or tree-merged) runs under `replay_routing` with them (trainer/moe_step.py). Rows the engine did not route (-1 in
`experts`: UNKNOWN in the record) take the router's own top-k. Activation checkpointing: the backward recomputes each
decoder layer's forward after `replay_routing` has ended, so the trainer's backward runs under `replayed_recompute`,
which hooks the routers again with the same forced rows (a layer's hook reads its own column of them, so a recompute
replays exactly what the forward did, in any order of layers). FSDP2 (trainer/fsdp.py shards each decoder layer): the
routers stay plain children of their layer, whose unsharded parameters they use inside the layer's forward, so the
hooks see the same calls. Not covered: the depth-first tree pass (it packs its trie by token alone: the config refuses
it with replay); other MoE families (ValueError naming the model).

Cost: the record is layers x top_k bytes a token (uint8 ids: Qwen3-30B-A3B, 48 layers x top-8, 384 bytes a token); in
the forward, one gather and a normalisation of [rows, k] per layer (docs/training.md has the measured time).
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from loomrl.trainer.tree import PackedTree, pack_tree

# router class name -> whether it always renormalises its top-k (Mixtral) or follows `norm_topk_prob`
_ROUTERS = {"Qwen3MoeTopKRouter": False, "OlmoeTopKRouter": False, "MixtralTopKRouter": True}


@dataclass(slots=True, kw_only=True)
class Routing:
    """One forward's routing. In: per sample the engine's experts [T_i, L, k] (-1 rows: not recorded; None: the model
    routes itself). Out: each routed layer's router logits [rows, E] (bottom first) and which rows are real tokens
    ([rows] 0/1; None: all), what `aux_loss` needs; the experts forced on the rows ([rows, L, k], -1: the router's
    own) and which rows are sampled tokens ([rows] bool), what `agreement` needs."""

    experts: Sequence[torch.Tensor] | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    mask: torch.Tensor | None = None
    forced: torch.Tensor | None = None
    sampled: torch.Tensor | None = None


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model`'s routed MoE blocks, bottom first; ValueError if it has none loomrl can replay."""
    routers = [m for m in model.modules() if type(m).__name__ in _ROUTERS]
    if not routers:
        raise ValueError(f"router replay: {type(model).__name__} has no mixture-of-experts router loomrl can replay "
                         f"(transformers' {', '.join(_ROUTERS)})")
    return routers


def replayed_weights(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The routing weights [N, k] of `chosen` experts [N, k] from `logits` [N, E], normalised as `router`'s model does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
    picked = probs.gather(1, chosen)  # [N, k]
    if _ROUTERS[type(router).__name__] or router.norm_topk_prob:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    # Mixtral keeps float32 weights (the experts' product promotes); Qwen3-MoE and OLMoE cast back
    return picked if _ROUTERS[type(router).__name__] else picked.to(logits.dtype)


@contextmanager
def replay_routing(model: torch.nn.Module, routing: Routing, forced: torch.Tensor | None) -> Generator[None, None, None]:
    """For the forwards inside: each routed layer l uses experts `forced`[:, l] ([rows, L, k], rows = the tokens the
    router sees, in its order; None: its own top-k), and appends its router logits to `routing.logits`."""
    routers = moe_routers(model)
    if forced is not None and forced.shape[1] != len(routers):
        raise ValueError(f"router replay: experts for {forced.shape[1]} MoE layers, {type(model).__name__} has "
                         f"{len(routers)}")
    if forced is not None:  # one copy to the routers' device per forward, not one per layer
        forced = forced.to(device=next(model.parameters()).device, dtype=torch.long)
    routing.forced = forced

    def hook_of(layer: int):
        def hook(router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits = output[0]  # [rows, E]
            routing.logits.append(logits)
            if forced is None:
                return None
            if forced.shape[0] != logits.shape[0]:
                raise ValueError(f"router replay: experts for {forced.shape[0]} tokens, layer {layer}'s router saw "
                                 f"{logits.shape[0]}")
            chosen = forced[:, layer]  # [rows, k]
            unknown = chosen[:, :1] < 0  # [rows, 1] rows the engine did not route: the router's own choice
            chosen = torch.where(unknown, output[2], chosen)
            return logits, replayed_weights(router, logits, chosen), chosen
        return hook

    handles = [r.register_forward_hook(hook_of(layer)) for layer, r in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def replayed_recompute(model: torch.nn.Module, routing: Routing | None) -> Generator[None, None, None]:
    """Around the backward of a forward run under `replay_routing(model, routing, ...)` with activation checkpointing:
    each layer the backward recomputes uses the experts that forward forced (`routing.forced`), its router logits
    dropped (the forward kept its own). Without it the recompute would route by the trainer's router: other experts
    than the forward's (torch's checkpoint then fails on the saved tensors' count, or the gradients are wrong)."""
    if routing is None or routing.forced is None:  # the router routed itself in the forward: so it will again
        yield
        return
    with replay_routing(model, Routing(), routing.forced):
        yield


def agreement(routing: Routing) -> tuple[int, int]:
    """Of the (row, layer, k) expert choices `routing` forced at its sampled rows that the engine recorded, how many
    the trainer's own router (the top-k of its logits in that forward) also made, and how many there were."""
    if routing.forced is None or routing.sampled is None or not routing.logits:
        return 0, 0
    forced = routing.forced.to(routing.logits[0].device)  # [rows, L, k]
    keep = routing.sampled.to(forced.device) & (forced[:, :, 0] >= 0).all(dim=1)  # [rows]
    if not bool(keep.any()):
        return 0, 0
    k = forced.shape[2]
    agree = 0
    for layer, logits in enumerate(routing.logits):
        own = logits.detach()[keep].topk(k, dim=-1).indices  # [n, k] softmax keeps the logits' order
        engine = forced[keep, layer]  # [n, k]
        agree += int((engine.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum())  # order within k does not matter
    return agree, int(keep.sum()) * len(routing.logits) * k


def dense_rows(experts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample experts [T_i, L, k] as the rows of a padded [B, width] forward, [B * width, L, k]; padding rows
    route to experts 0..k-1 (padding sits after each sample: causal attention keeps it out of real tokens)."""
    _, layers, k = experts[0].shape
    out = torch.arange(k, dtype=torch.long).expand(len(experts), width, layers, k).clone()  # [B, width, L, k]
    for i, e in enumerate(experts):
        out[i, : e.shape[0]] = e
    return out.view(-1, layers, k)


def keyed_tree(seqs: Sequence[Sequence[int]], experts: Sequence[torch.Tensor]) -> tuple[PackedTree, torch.Tensor]:
    """The trie of `seqs` in which a node is a (token, recorded experts) pair, so samples whose experts differ split
    there; its token_ids are the real tokens. Returns it and each packed node's experts, [N, L, k]."""
    keys: dict[tuple[int, bytes], int] = {}
    keyed, flat = [], []
    for seq, e in zip(seqs, experts, strict=True):
        if e.shape[0] != len(seq):
            raise ValueError(f"router replay: experts for {e.shape[0]} tokens, the sample has {len(seq)}")
        rows = e.to(device="cpu", dtype=torch.int32).flatten(1).numpy()  # [T, L*k]
        keyed.append([keys.setdefault((tok, row.tobytes()), len(keys)) for tok, row in zip(seq, rows)])
        flat.append(e.to(device="cpu", dtype=torch.long))
    token_of = {key: tok for (tok, _), key in keys.items()}
    tree = pack_tree(keyed)
    row_of_key = torch.empty(len(keys), dtype=torch.long)  # key -> a row of the concatenated experts holding it
    row_of_key[torch.tensor([k for ks in keyed for k in ks])] = torch.arange(sum(map(len, keyed)))
    node_experts = torch.cat(flat)[row_of_key[torch.tensor(tree.token_ids, dtype=torch.long)]]  # [N, L, k]
    tree.token_ids = [token_of[key] for key in tree.token_ids]
    return tree, node_experts


def aux_loss(model: torch.nn.Module, routing: Routing) -> torch.Tensor:
    """transformers' load-balancing loss (Switch Transformer; the model's own `load_balancing_loss_func`) over the
    router logits `routing` collected, padding rows left out; what `model(..., output_router_logits=True).aux_loss`
    is for the same forward."""
    if not routing.logits:
        raise ValueError(f"moe aux loss: no router logits were collected from {type(model).__name__}'s forward")
    router = moe_routers(model)[0]
    balance = sys.modules[type(router).__module__].load_balancing_loss_func
    return balance(tuple(routing.logits), router.num_experts, router.top_k, routing.mask)
