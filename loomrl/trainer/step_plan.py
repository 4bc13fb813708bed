"""The plan of one training step: how its samples are cut into micro-batches, which of them are forwarded as a prefix
tree (tree.py), the padding a sharded step adds so that every rank runs as many forwards, and the step's attention
pair counts. Pure: no model, no tensors; the Trainer (trainer.py) runs the plan.

What it is not: the loss's inputs (loss_inputs.py) or the forwards themselves (forward.py, tree.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loomrl.config import TrainerConfig
from loomrl.trainer.tree import (
    compression_ratio,
    dense_attention_pairs,
    plan_tries,
    tree_attention_pairs,
    unique_tokens,
)
from loomrl.types import TrainingSample

# A micro-batch that trains nothing: ranks of a sharded step with fewer micro-batches than others run it,
# so that every rank joins every forward's and backward's collectives.
PADDING = TrainingSample(trajectory_id="padding", group_id="padding", token_ids=[0, 0], loss_mask=[0, 1],
                         behaviour_logprobs=[0.0, 0.0], versions=[0, 0], advantages=[0.0, 0.0])


@dataclass(slots=True, kw_only=True)
class MicroBatches:
    """The step's samples cut into micro-batches: each one's positions in the step's sample list, whether it is
    forwarded as a prefix tree, and the step's tree_ratio (its tokens / the tokens its forwards compute)."""

    index: list[list[int]]
    merged: list[bool]
    tree_ratio: float


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """What a step runs: its micro-batches (the real ones, then `len(batches) - real` padding ones), each one's
    positions in the step's sample list (padding: none), whether each is tree-merged, whether the whole step is one
    depth-first pass over its trie, and the attention (query, key) pairs of its samples each on its own
    (`attn_pairs_dense`) and of the forwards actually run (`attn_pairs`)."""

    batches: list[list[TrainingSample]]
    index: list[list[int]]
    merged: list[bool]
    real: int
    depth_first: bool
    tree_ratio: float
    attn_pairs_dense: int
    attn_pairs: int


def depth_first(cfg: TrainerConfig) -> bool:
    """Whether a step is one depth-first pass over its trie (tree.py depth_first_backward)."""
    return cfg.tree_merge != "off" and cfg.tree_token_budget is not None and cfg.tree_merge_memory == "depth_first"


def _cut(cfg: TrainerConfig, samples: list[TrainingSample], order: list[int]) -> list[list[int]]:
    """Consecutive runs of `order` (positions in `samples`): sub-tries under a token budget, dense micro-batches under
    micro_batch_tokens, or micro_batch_size samples each."""
    if cfg.tree_merge != "off" and cfg.tree_token_budget is not None:
        return [[order[i] for i in g] for g in plan_tries([samples[i].token_ids for i in order], cfg.tree_token_budget)]
    if cfg.tree_merge == "off" and cfg.micro_batch_tokens is not None:
        batches: list[list[int]] = []  # ordered by length: a batch's padded size is its count x its last sample's length
        for i in order:
            n = len(samples[i].token_ids)
            if batches and (len(batches[-1]) + 1) * n <= cfg.micro_batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches
    mb = cfg.micro_batch_size
    return [order[i : i + mb] for i in range(0, len(order), mb)]


def micro_batches(cfg: TrainerConfig, samples: list[TrainingSample]) -> MicroBatches:
    """The step's micro-batches, as trainer.tree_merge, tree_token_budget, micro_batch_tokens and micro_batch_size
    say."""
    if cfg.tree_merge == "off":  # micro-batches of similar length waste less padding
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids))
    else:  # lexicographic order puts samples that share a prefix next to each other, in one micro-batch
        order = sorted(range(len(samples)), key=lambda i: samples[i].token_ids)
    index = _cut(cfg, samples, order)
    if cfg.tree_merge == "off":
        return MicroBatches(index=index, merged=[False] * len(index), tree_ratio=1.0)
    if depth_first(cfg):  # every micro-batch merged; each node of the step forwarded once
        ratio = compression_ratio([samples[i].token_ids for i in order])
        return MicroBatches(index=index, merged=[True] * len(index), tree_ratio=ratio)
    merged, tokens, forwarded = [], 0, 0
    for b in index:
        seqs = [samples[i].token_ids for i in b]
        total, unique = sum(map(len, seqs)), unique_tokens(seqs)
        merged.append(cfg.tree_merge == "on" or total >= cfg.tree_merge_min_ratio * unique)
        tokens += total
        forwarded += unique if merged[-1] else total
    return MicroBatches(index=index, merged=merged, tree_ratio=tokens / max(forwarded, 1))


def plan_step(cfg: TrainerConfig, samples: list[TrainingSample],
              shared_plan: Callable[[int], int] | None = None) -> StepPlan:
    """The plan of a step over `samples`; `shared_plan` (a sharded step's, train_pool/distributed.py): the number of
    micro-batches every rank runs given this rank's, the rest padding."""
    cut = micro_batches(cfg, samples)
    batches = [[samples[i] for i in b] for b in cut.index]
    real = len(batches)
    pad = shared_plan(real) - real if shared_plan is not None else 0
    batches, merged = batches + [[PADDING]] * pad, cut.merged + [False] * pad
    pairs_dense = [dense_attention_pairs([s.token_ids for s in b]) for b in batches]
    pairs = [tree_attention_pairs([s.token_ids for s in b]) if m else d
             for b, m, d in zip(batches, merged, pairs_dense)]
    whole = depth_first(cfg)
    if whole and samples:  # one pass over the step's trie: each node attends to its ancestors once
        pairs = [tree_attention_pairs([s.token_ids for s in samples])]
    return StepPlan(batches=batches, index=cut.index + [[] for _ in range(pad)], merged=merged, real=real,
                    depth_first=whole, tree_ratio=cut.tree_ratio, attn_pairs_dense=sum(pairs_dense),
                    attn_pairs=sum(pairs))
