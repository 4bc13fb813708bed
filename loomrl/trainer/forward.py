"""The trainer's forward passes at the model level: per-sample logprobs of a micro-batch (dense, or tree-merged:
tree.py), the dtype they compute in, and activation checkpointing; with a `Routing` (passed, or set around the call
by `routed`), an MoE model's forward replays the engine's experts (replay.py). Nothing here reads the run's config, so that scripts/gpu_smoke.py runs these passes
on a machine with torch and transformers only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

import torch
import transformers

from loomrl.model.transformers_contract import checkpointing_method
from loomrl.trainer.head import Entropies, head_logprobs
from loomrl.trainer.replay import Routing, dense_rows, keyed_tree, replay_routing
from loomrl.trainer.tree import (
    _sample_logprobs,
    decoder_and_head,
    pack_tree,
    sampled_positions,
    tree_hidden,
    tree_token_logprobs,
)
from loomrl.types import TrainingSample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The routing of the forward(s) run inside `routed`: set around a `Logprobs` call rather than passed through it, so that
# it reaches logprobs_of through any wrapper of the forward (LoRA's reference, FSDP's root module) unchanged, as
# autocast reaches the ops inside.
_ROUTING: ContextVar[Routing | None] = ContextVar("loomrl_routing", default=None)


@contextlib.contextmanager
def routed(routing: Routing | None) -> Generator[None, None, None]:
    """The forwards inside run with `routing` (its experts replayed, its router logits collected); None: plain."""
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)


def token_logprobs(model: PreTrainedModel, samples: list[TrainingSample], *, with_grad: bool,
                   entropy: Entropies | None = None, routing: Routing | None = None) -> list[torch.Tensor]:
    """Logprob of each sample's loss-masked tokens under `model` (at the sample's temperature); `entropy`: the
    distributions' entropies at those tokens (detached, all samples' in one tensor) are added to it (head.py);
    `routing`: its experts replayed, its router logits collected (replay.py)."""
    base, _ = decoder_and_head(model)
    device = next(model.parameters()).device
    width = max(len(s.token_ids) for s in samples)
    pad = [width - len(s.token_ids) for s in samples]
    ids = torch.tensor([s.token_ids + [0] * p for s, p in zip(samples, pad)], dtype=torch.long, device=device)  # [B, T]
    attn = torch.tensor([[1] * len(s.token_ids) + [0] * p for s, p in zip(samples, pad)], dtype=torch.long,
                        device=device)  # [B, T]
    targets = [sampled_positions(s) for s in samples]
    # the hidden state before each sampled token: one row per target, every sample's rows in one head pass
    at = torch.tensor([(i, t) for i, ts in enumerate(targets) for t in ts], dtype=torch.long,
                      device=device).view(-1, 2)
    temps = torch.tensor([s.temperature for s, ts in zip(samples, targets) for _ in ts], dtype=torch.float32,
                         device=device)
    hooked = contextlib.nullcontext()
    if routing is not None:
        routing.mask = attn.flatten()  # [B * T] the router sees the padded batch's rows
        routing.sampled = torch.tensor([s.loss_mask + [0] * p for s, p in zip(samples, pad)],
                                       dtype=torch.bool).flatten()  # [B * T]
        forced = dense_rows(routing.experts, width) if routing.experts is not None else None
        hooked = replay_routing(model, routing, forced)
    with torch.set_grad_enabled(with_grad):
        with hooked:
            hidden = base(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H]
        logp = head_logprobs(model, hidden[at[:, 0], at[:, 1] - 1], ids[at[:, 0], at[:, 1]], temps, entropy=entropy)
    return list(torch.split(logp, [len(ts) for ts in targets]))


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """trainer.precision on `device`: "auto" is bfloat16 on CUDA, float32 on the CPU (whose bf16 matmuls are slower)."""
    if precision == "auto":
        precision = "bfloat16" if device.type == "cuda" else "float32"
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def compute_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """What the trainer's forward passes run under: autocast to trainer.precision, or nothing for float32."""
    dtype = compute_dtype(precision, device)
    if dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


class Logprobs(Protocol):
    """A micro-batch forward: (micro-batch, merged, entropy sink) -> per sample, the logprobs of its loss-masked
    tokens; with `entropy` given, the micro-batch's per-token entropies (detached) are added to it."""

    def __call__(self, batch: list[TrainingSample], merged: bool,
                 entropy: Entropies | None = None) -> list[torch.Tensor]: ...


def forward_of(model: PreTrainedModel, *, flex: bool = False) -> Logprobs:
    """The micro-batch forward of a model held whole by this process (`flex`: tree attention through FlexAttention)."""
    return lambda batch, merged, entropy=None: logprobs_of(model, batch, merged, with_grad=torch.is_grad_enabled(),
                                                           flex=flex, entropy=entropy)


def logprobs_of(model: PreTrainedModel, batch: list[TrainingSample], merged: bool, *, with_grad: bool,
                flex: bool = False, entropy: Entropies | None = None,
                routing: Routing | None = None) -> list[torch.Tensor]:
    """Per sample of `batch`, the logprobs of its loss-masked tokens; `merged`: over the batch's prefix tree
    (`flex`: its attention through FlexAttention); `entropy`, `routing`: as token_logprobs (default: `routed`'s)."""
    routing = routing if routing is not None else _ROUTING.get()
    if merged and routing is not None:
        return replayed_tree_logprobs(model, batch, routing, with_grad=with_grad, flex=flex, entropy=entropy)
    if merged:
        return tree_token_logprobs(model, batch, with_grad=with_grad, flex=flex, entropy=entropy)
    return token_logprobs(model, batch, with_grad=with_grad, entropy=entropy, routing=routing)


def replayed_tree_logprobs(model: PreTrainedModel, batch: list[TrainingSample], routing: Routing, *, with_grad: bool,
                           flex: bool = False, entropy: Entropies | None = None) -> list[torch.Tensor]:
    """tree_token_logprobs with `routing`: a trie whose nodes are (token, recorded experts) pairs (replay.py
    keyed_tree: samples whose experts differ split there), each node's experts replayed."""
    seqs = [s.token_ids for s in batch]
    tree, forced = keyed_tree(seqs, routing.experts) if routing.experts is not None else (pack_tree(seqs), None)
    routing.mask = None  # every packed node is a real token
    sampled = torch.zeros(len(tree.token_ids), dtype=torch.bool)  # [N] nodes that are some sample's sampled token
    for s, nodes in zip(batch, tree.sample_nodes):
        sampled[[n for n, m in zip(nodes, s.loss_mask) if m]] = True
    routing.sampled = sampled
    with torch.set_grad_enabled(with_grad):
        with replay_routing(model, routing, forced):
            hidden = tree_hidden(model, tree, flex=flex)  # [N, H]
        return _sample_logprobs(model, hidden, batch, tree.sample_nodes, entropy)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """transformers' per-decoder-layer checkpointing, non-reentrant (safe with keyword arguments), by the method the
    installed transformers has (model/transformers_contract.py: renamed in 5.23; vLLM's pin resolves to 5.19)."""
    method, keyword = checkpointing_method(transformers.__version__)
    getattr(model, method)(**{keyword: {"use_reentrant": False}})
