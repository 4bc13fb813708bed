"""Prefix-tree merged training: the samples of a micro-batch become one trie, each shared token is computed once, and
every sample's per-token logprobs (and so its gradients) equal the dense computation's up to float rounding.

What it is. `pack_tree` inserts the samples' token ids into a trie and lays its nodes out in depth-first order: each
unique (prefix, token) appears once, with its depth as position id, and a packed token may attend exactly to its
ancestors (itself included). `tree_token_logprobs` runs the model once over that packed sequence and returns what
`trainer.token_logprobs` returns. The logprob of a sample's token t is read from the packed node of token t-1; the LM
head runs once per distinct (node, temperature), so duplicate samples and the shared history of multi-turn samples cost
one logit row, and samples of different temperatures that share a node each get their own division.

Attention: a custom transformers attention function (registered in transformers' `AttentionInterface` and switched on
for the duration of the forward with the documented `model.set_attn_implementation`). The packed sequence is cut into
segments, runs in which every token's parent is the token before it; a segment's queries see a few contiguous key spans
(its ancestors) plus itself causally, so each is one SDPA call over only the keys it needs: the cost is the tree's
(query, key) pairs, not N^2 (plus the upper triangle of a segment's own block, which the CPU kernel computes under the
mask when the segment has ancestors). The tests check it against the model's own attention given the 4-D ancestor mask.
On CUDA (trainer.tree_attention auto or flex) the same attention is one FlexAttention call over the whole packed
sequence with a block mask: in depth-first order token j is an ancestor of i (or i itself) exactly when
j <= i < j + size of j's subtree, so the mask is two comparisons per (query, key) and only the blocks holding
tree pairs are computed. Not on the CPU: in torch 2.13 FlexAttention has no backward there (NotImplementedError),
so there the CPU tests check its forward against the segments only; its gradients are checked on a GPU
(scripts/gpu_smoke.py part c).

Memory, two ways. Sub-tries: `plan_tries` splits the lexicographically sorted samples into consecutive sub-tries of at
most a budget of unique tokens (one sample longer than the budget is a sub-trie of its own), forwarded one after
another. A prefix shared across two sub-tries is computed once per sub-trie, so the realised compression is lower than
the whole batch's.

Depth-first (AReaL-DTA style), `depth_first_backward`: every node of the whole trie is computed once, and the caller's
loss is applied and backwarded per sub-trie inside the pass. A node used by sub-tries lo..hi (lo < hi) is trunk; trunk
nodes with the same (lo, hi) form one chain (siblings have disjoint, ordered sample ranges), forwarded once just before
sub-trie lo. Its output hidden state and each layer's K and V are then detached into leaves that require grad; later
forwards attend to the leaves and the LM head reads the hidden leaf, so each sub-trie's backward stops at them and
accumulates their .grad. After sub-trie hi, the chain's own graph is backwarded with those gradients
(torch.autograd.backward(outputs, grad_tensors=leaf grads)), latest chain first, since a chain may attend to an earlier
one's leaves but never the reverse. The gradient is the chain rule split at the leaves, so exact: equal to dense up to
float summation order. Alive during a forward: its own nodes plus the trunk chains whose range covers the current
sub-trie, all of them nodes of that sub-trie, so never more than the sub-trie's unique tokens
(`DepthFirstResult.alive_tokens`).
Cost over sub-tries: shared prefixes are not recomputed; a trunk node's logit row needed by two sub-tries (a split
group's last prompt token) goes through the LM head once per sub-trie, and each forward concatenates the alive trunk K/V
per layer (one copy). The past K/V reach the attention through the segment plan, a side channel, not transformers'
`cache=`: the attention function gets exactly the post-RoPE, pre-GQA K/V a cache would hold (captured the same way in
the trunk forward), indexed by `module.layer_idx`, and no cache object (with its in-place growth and its own masks and
cache positions) is involved; positions are the nodes' depths as everywhere else.

Not covered: sliding-window or soft-capped attention (ValueError), models whose decoder does not take `position_ids`,
batches with padding inside a sample (loomrl samples have none); for the depth-first pass, attention modules without a
`layer_idx` and a no-grad use (the trainer's no-grad passes use `tree_token_logprobs` per sub-trie). The "segments"
switch of the attention implementation is not thread-safe against a concurrent forward of the same model object
(loomrl's trainer owns its model during a step: sync mode alternates with the engine, async mode trains in its own
process).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from loomrl.tokens import common_prefix_len
from loomrl.trainer.head import Entropies, head_logprobs
from loomrl.types import TrainingSample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TREE_ATTENTION = "loomrl_tree"  # the name the segment attention is registered under in transformers

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V, [1, Hkv, n, D] each


class Capture:
    """Where the depth-first pass's attention calls leave each layer's K/V (by layer index). Deliberately
    neither a dict nor a dataclass: FSDP2 rebuilds those it finds in a unit's forward arguments (to hook the
    tensors inside), so a write into one would land in a copy."""

    __slots__ = ("kv",)

    def __init__(self) -> None:
        self.kv: dict[int, KV] = {}


@dataclass(slots=True, kw_only=True)
class Segment:
    """Packed tokens [start, end), each the child of the one before it; its queries see `spans`
    (half-open packed ranges: the ancestors, then the segment itself, which it sees causally)."""

    start: int
    end: int
    spans: list[tuple[int, int]]


@dataclass(slots=True, kw_only=True)
class PackedTree:
    """The trie of a batch's token sequences, laid out depth-first (children in token order)."""

    token_ids: list[int]  # [N] one per unique (prefix, token)
    positions: list[int]  # [N] depth: the token's position in every sample passing through it
    parents: list[int]  # [N] packed index of the previous token; -1 at a root
    node_samples: list[list[int]]  # [N] indices (into the input list) of the samples through the node
    sample_nodes: list[list[int]]  # per sample, the packed index of each of its tokens
    segments: list[Segment] = field(default_factory=list)


def _sorted_with_prefix(seqs: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(input index, length of the prefix shared with the previous one) in lexicographic order.
    In that order a sequence's longest common prefix with any earlier one is the one with its
    predecessor, so the trie grows by len - shared per sequence."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    out, prev = [], ()
    for i in order:
        out.append((i, common_prefix_len(prev, seqs[i])))
        prev = seqs[i]
    return out


def pack_tree(seqs: Sequence[Sequence[int]]) -> PackedTree:
    """Build the trie of `seqs` and lay it out depth-first; see PackedTree."""
    tree = PackedTree(token_ids=[], positions=[], parents=[], node_samples=[], sample_nodes=[[] for _ in seqs])
    prev_path: list[int] = []
    for i, shared in _sorted_with_prefix(seqs):
        path = prev_path[:shared]
        for node in path:
            tree.node_samples[node].append(i)
        for depth in range(shared, len(seqs[i])):
            path.append(len(tree.token_ids))
            tree.token_ids.append(seqs[i][depth])
            tree.positions.append(depth)
            tree.parents.append(path[-2] if depth else -1)
            tree.node_samples.append([i])
        tree.sample_nodes[i] = path
        prev_path = path
    tree.segments = _segments(tree.parents)
    return tree


def _segments(parents: list[int], cut: int = 0) -> list[Segment]:
    """Cut the depth-first layout where a token's parent is not the token before it (and at `cut`).
    Any order in which parents come before their children works."""
    starts = [j for j, p in enumerate(parents) if j == 0 or p != j - 1 or j == cut]
    segments: list[Segment] = []
    owner = [0] * len(parents)  # segment index of each packed token
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(parents)
        owner[start:end] = [k] * (end - start)
        parent = parents[start]
        if parent < 0:
            spans = [(start, end)]
        else:  # the parent's segment's spans, cut just after the parent, then this segment
            above = segments[owner[parent]].spans
            spans = [*above[:-1], (above[-1][0], parent + 1), (start, end)]
        segments.append(Segment(start=start, end=end, spans=spans))
    return segments


def plan_tries(seqs: Sequence[Sequence[int]], token_budget: int) -> list[list[int]]:
    """Split `seqs` (lexicographically sorted) into consecutive groups whose tries hold at most
    `token_budget` unique tokens each; a sequence longer than the budget is a group of its own.
    Returns input indices per group. Prefixes shared across groups are computed once per group."""
    if token_budget <= 0:
        raise ValueError(f"plan_tries: token_budget must be > 0, got {token_budget}")
    groups: list[list[int]] = []
    used = token_budget + 1  # forces a first group
    for i, shared in _sorted_with_prefix(seqs):
        new = len(seqs[i]) - shared
        if used + new > token_budget:
            groups.append([])
            used, new = 0, len(seqs[i])  # a new sub-trie recomputes the shared prefix
        groups[-1].append(i)
        used += new
    return groups


def unique_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """Nodes of the trie of `seqs` (the tokens a merged forward computes), without building it."""
    return sum(len(seqs[i]) - shared for i, shared in _sorted_with_prefix(seqs))


def tree_attention_pairs(seqs: Sequence[Sequence[int]]) -> int:
    """(query, key) pairs of tree attention over the trie of `seqs` (a node at depth d sees d + 1
    keys), without building it."""
    total = 0
    for i, shared in _sorted_with_prefix(seqs):
        n = len(seqs[i])
        total += (n * (n + 1) - shared * (shared + 1)) // 2  # depths shared..n-1, each seeing depth + 1 keys
    return total


def dense_attention_pairs(seqs: Sequence[Sequence[int]]) -> int:
    """(query, key) pairs of causal attention over each sequence separately."""
    return sum(n * (n + 1) // 2 for n in map(len, seqs))


def compression_ratio(seqs: Sequence[Sequence[int]]) -> float:
    """Total tokens / unique tokens of the trie of `seqs`."""
    return sum(map(len, seqs)) / max(unique_tokens(seqs), 1)


# --- the forward -------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _SegmentPlan:
    """The packed sequence's segments as tensors, built once per forward and shared by all layers.

    Queries are split by segment (`q_sizes`, in packed order). Keys/values are gathered once into one tensor, each
    segment's spans one after another (`kv_index`; None when there is a single segment: the keys are the sequence
    itself), then split by `kv_sizes`. One gather and one split keep the backward to one index_add and one cat; slicing
    per segment would allocate a zero tensor of the whole sequence for every slice's gradient. `masks`: [L, K] bool per
    segment, None for a root segment (plain causal).

    Depth-first pass only: `past` holds, per layer, the K/V [1, Hkv, P, D] of the P packed tokens
    before the queries (keys index past + new); `capture`, when set, receives each layer's new K/V.
    FlexAttention instead (`block_mask`, _flex_plan): one call over the whole sequence, no segments."""

    q_sizes: list[int]
    kv_sizes: list[int]
    kv_index: torch.Tensor | None
    masks: list[torch.Tensor | None]
    past: list[KV] | None = None
    capture: Capture | None = None
    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask


def _flex_plan(parents: list[int], device: torch.device) -> _SegmentPlan:
    """The trie's ancestor mask as a FlexAttention block mask (depth-first layout: parents come first)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = len(parents)
    size = [1] * n
    for i in range(n - 1, -1, -1):
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    end = torch.tensor([j + size[j] for j in range(n)], dtype=torch.long, device=device)  # past j's subtree

    def ancestor_or_self(b, h, q, kv):
        return (kv <= q) & (q < end[kv])

    mask = create_block_mask(ancestor_or_self, None, None, n, n, device=device, _compile=device.type == "cuda")
    return _SegmentPlan(q_sizes=[n], kv_sizes=[n], kv_index=None, masks=[None], block_mask=mask)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled (once per process): uncompiled it materialises every score."""
    from torch.nn.attention.flex_attention import flex_attention

    # cast: torch's stub gives every overload of flex_attention the return type of all of them (a tuple too), even
    # return_lse=False's, which returns the attention output alone
    return cast("Callable[..., torch.Tensor]", torch.compile(flex_attention))


def _plan(segments: list[Segment], device: torch.device, first: int = 0) -> _SegmentPlan:
    """The plan (its tensors on `device`) for queries from packed index `first` on; keys index the whole layout
    (with `first` > 0, the tokens before it are a past whose K/V the caller supplies in plan.past)."""
    q_sizes, kv_sizes, index, masks = [], [], [], []
    for seg in segments:
        if seg.start < first:
            continue
        length = seg.end - seg.start
        keys = sum(b - a for a, b in seg.spans)
        q_sizes.append(length)
        kv_sizes.append(keys)
        index.extend(j for a, b in seg.spans for j in range(a, b))
        masks.append(None if len(seg.spans) == 1
                     else torch.ones(length, keys, dtype=torch.bool, device=device).tril_(keys - length))
    kv_index = torch.tensor(index, dtype=torch.long, device=device) if len(segments) > 1 else None
    return _SegmentPlan(q_sizes=q_sizes, kv_sizes=kv_sizes, kv_index=kv_index, masks=masks)


def _segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: query [1, H, N, D], key/value [1, Hkv, N, D] of the packed
    sequence; each segment attends to its key spans only. Returns ([1, N, H, D], None)."""
    plan: _SegmentPlan | None = kwargs.get("tree_plan")
    if plan is None:
        raise RuntimeError(f"attention '{TREE_ATTENTION}' needs tree_plan=...: it only runs inside tree_hidden")
    if plan.capture is not None or plan.past is not None:
        layer = module.layer_idx  # the decoder layer this attention belongs to (Llama-style modules)
        if plan.capture is not None:
            plan.capture.kv[layer] = (key, value)  # post-RoPE, before GQA repetition: what a KV cache holds
        if plan.past is not None:
            past_k, past_v = plan.past[layer]
            key, value = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)  # [1, Hkv, P + N, D]
    gqa = query.shape[1] != key.shape[1]
    if plan.block_mask is not None:
        if query.is_cuda:
            flex = _compiled_flex_attention()
        else:  # eager: the CPU has FlexAttention's forward only, for the tests
            from torch.nn.attention.flex_attention import flex_attention as flex
        out = flex(query, key, value, block_mask=plan.block_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if plan.kv_index is not None:
        key, value = key.index_select(2, plan.kv_index), value.index_select(2, plan.kv_index)  # [1, Hkv, sum K, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = [sdpa(q, k, v, attn_mask=m, is_causal=m is None, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
            for q, k, v, m in zip(query.split(plan.q_sizes, dim=2), key.split(plan.kv_sizes, dim=2),
                                  value.split(plan.kv_sizes, dim=2), plan.masks)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, N, D]
    return out.transpose(1, 2).contiguous(), None


def _check_supported(model: PreTrainedModel) -> None:
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError("tree merge: sliding-window attention is not supported (the tree mask would replace it)")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("tree merge: soft-capped attention is not supported")


def tree_attention(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    """The tree attention switched on, for a backward that recomputes checkpointed layers of a merged forward
    (trainer.activation_checkpointing): the recompute then runs the attention the forward ran, with the same plan."""
    return _attention_implementation(model, TREE_ATTENTION)


@contextmanager
def _attention_implementation(model: PreTrainedModel, name: str) -> Generator[None, None, None]:
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _segment_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _device(model: PreTrainedModel) -> torch.device:
    """Where the model's inputs go: its input embedding's device."""
    return input_embedding_weight(model).device


def decoder_and_head(model: PreTrainedModel) -> tuple[PreTrainedModel, torch.nn.Module]:
    """A causal LM's decoder stack (hidden states out) and its LM head."""
    base = getattr(model, "model", None) or model.get_decoder()
    return base, model.get_output_embeddings()


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a causal LM's decoder stack, bottom first."""
    layers = decoder_and_head(model)[0].layers
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: its decoder's `layers` is a {type(layers).__name__}, not a "
                        "ModuleList")
    return layers


def input_embedding_weight(model: PreTrainedModel) -> torch.Tensor:
    """The weight of a causal LM's input embedding."""
    weight = decoder_and_head(model)[0].get_input_embeddings().weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(model).__name__}: its input embedding has no weight tensor")
    return weight


def tree_hidden(model: PreTrainedModel, tree: PackedTree, *, flex: bool = False) -> torch.Tensor:
    """Last hidden state of every packed token, [N, H]: one forward of the decoder over the trie (`flex`: its
    attention through FlexAttention)."""
    _check_supported(model)
    base, _ = decoder_and_head(model)
    device = _device(model)
    ids = torch.tensor([tree.token_ids], dtype=torch.long, device=device)  # [1, N]
    pos = torch.tensor([tree.positions], dtype=torch.long, device=device)  # [1, N]
    with _attention_implementation(model, TREE_ATTENTION):
        plan = _flex_plan(tree.parents, device) if flex else _plan(tree.segments, device)
        return base(input_ids=ids, position_ids=pos, tree_plan=plan).last_hidden_state[0]


def sampled_positions(sample: TrainingSample) -> list[int]:
    """The positions t >= 1 whose token is trained (loss-masked); its logprob is read at t - 1."""
    return [t for t in range(1, len(sample.token_ids)) if sample.loss_mask[t]]


def tree_token_logprobs(model: PreTrainedModel, samples: list[TrainingSample], *, with_grad: bool,
                        flex: bool = False, entropy: Entropies | None = None) -> list[torch.Tensor]:
    """Same result as trainer.token_logprobs (per sample, the logprobs of its loss-masked tokens at
    its temperature, and with `entropy` their entropies), computed over the samples' prefix tree."""
    tree = pack_tree([s.token_ids for s in samples])
    with torch.set_grad_enabled(with_grad):
        return _sample_logprobs(model, tree_hidden(model, tree, flex=flex), samples, tree.sample_nodes, entropy)


def _sample_logprobs(model: PreTrainedModel, hidden: torch.Tensor, samples: Sequence[TrainingSample],
                     rows_of: Sequence[Sequence[int]], entropy: Entropies | None = None) -> list[torch.Tensor]:
    """Per sample, the logprobs of its loss-masked tokens, read from `hidden` [R, H], whose row
    rows_of[i][t] holds sample i's token t; `entropy`: their entropies are added to it (head.py)."""
    # One logit row per distinct (row of token t-1, temperature divisor); each target picks one entry.
    rows: dict[tuple[int, float], int] = {}
    row_of, tokens, counts = [], [], []
    for i, s in enumerate(samples):
        divisor = s.temperature if s.temperature > 0 else 1.0
        targets = sampled_positions(s)
        for t in targets:
            row_of.append(rows.setdefault((rows_of[i][t - 1], divisor), len(rows)))
            tokens.append(s.token_ids[t])
        counts.append(len(targets))
    if not rows:
        return [hidden.new_zeros(0) for _ in samples]
    dev = hidden.device
    nodes = torch.tensor([node for node, _ in rows], dtype=torch.long, device=dev)
    divisors = torch.tensor([d for _, d in rows], dtype=torch.float32, device=dev)
    logp = head_logprobs(model, hidden[nodes], torch.tensor(tokens, dtype=torch.long, device=dev), divisors,
                         rows=torch.tensor(row_of, dtype=torch.long, device=dev), entropy=entropy)
    return list(torch.split(logp, counts))


# --- the depth-first pass (memory) -------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class DepthFirstResult:
    """What `depth_first_backward` computed: per batch, per sample, the detached logprobs of its
    loss-masked tokens; the summed loss; per forward, the tokens it computed and the tokens whose
    activations were alive during it (its own plus the trunk pieces it could attend to)."""

    logprobs: list[list[torch.Tensor]]
    loss: float
    forward_tokens: list[int]
    alive_tokens: list[int]


@dataclass(slots=True, kw_only=True)
class _Trunk:
    """Nodes shared by batches lo..hi (lo < hi), forwarded once before batch lo; its graph is
    backwarded after batch hi with the gradients accumulated in its leaves."""

    nodes: list[int]
    hi: int
    outputs: list[torch.Tensor]  # the hidden state [n, H], then per layer K and V [1, Hkv, n, D], with graph
    leaves: list[torch.Tensor]  # the same, detached: what later forwards and the LM head read


def _part_hidden(model: PreTrainedModel, tree: PackedTree, alive: list[_Trunk], nodes: list[int],
                 capture: Capture | None, result: DepthFirstResult) -> torch.Tensor:
    """Hidden states [n, H] of packed `nodes` (parents first), each attending to its ancestors among the alive trunks'
    nodes (through their K/V leaves) and among `nodes`; the forward's token counts go to `result`."""
    base, _ = decoder_and_head(model)
    past_nodes = [n for t in alive for n in t.nodes]  # creation order: parents before children
    result.alive_tokens.append(len(past_nodes) + len(nodes))
    result.forward_tokens.append(len(nodes))
    order = [*past_nodes, *nodes]
    local = {n: j for j, n in enumerate(order)}
    parents = [local[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in order]  # KeyError: a missing ancestor
    device = _device(model)
    plan = _plan(_segments(parents, cut=len(past_nodes)), device, first=len(past_nodes))
    plan.capture = capture
    if alive:
        layers = len(alive[0].leaves) // 2
        plan.past = [(torch.cat([t.leaves[1 + 2 * layer] for t in alive], dim=2),
                      torch.cat([t.leaves[2 + 2 * layer] for t in alive], dim=2)) for layer in range(layers)]
    ids = torch.tensor([[tree.token_ids[n] for n in nodes]], dtype=torch.long, device=device)  # [1, n]
    pos = torch.tensor([[tree.positions[n] for n in nodes]], dtype=torch.long, device=device)  # [1, n] depth
    with _attention_implementation(model, TREE_ATTENTION):
        return base(input_ids=ids, position_ids=pos, tree_plan=plan).last_hidden_state[0]


def depth_first_backward(model: PreTrainedModel, batches: Sequence[Sequence[TrainingSample]],
                         loss_fn: Callable[[int, list[torch.Tensor]], torch.Tensor | None], *,
                         entropy: Entropies | None = None) -> DepthFirstResult:
    """Forward and backward `batches` (sub-tries: consecutive runs of the lexicographically sorted
    samples, as `plan_tries` cuts them) over their common prefix tree, each node computed once.
    loss_fn(k, logprobs of batch k's samples) -> the batch's loss (None: nothing to train); its
    gradient is accumulated into the parameters' .grad. `entropy`: each batch's per-token entropies are appended to
    it. See the module docstring."""
    _check_supported(model)
    tree = pack_tree([s.token_ids for b in batches for s in b])
    own, starting = _trunk_plan(tree, batches)
    width, dtype = model.config.hidden_size, input_embedding_weight(model).dtype
    result = DepthFirstResult(logprobs=[], loss=0.0, forward_tokens=[], alive_tokens=[])
    alive: list[_Trunk] = []
    for k, batch in enumerate(batches):
        for hi, nodes in starting.get(k, []):
            capture = Capture()
            hidden = _part_hidden(model, tree, alive, nodes, capture, result)
            outputs = [hidden, *(x for layer in sorted(capture.kv) for x in capture.kv[layer])]
            alive.append(_Trunk(nodes=nodes, hi=hi, outputs=outputs,
                                leaves=[x.detach().requires_grad_(x.requires_grad) for x in outputs]))
        if own[k]:
            hidden = _part_hidden(model, tree, alive, own[k], None, result)  # [n, H]
        else:  # every node of the batch is shared with a neighbour
            hidden = torch.zeros(0, width, dtype=dtype, device=_device(model))
        # Rows: the alive trunks' hidden leaves, then the batch's own nodes; every node of the batch is one.
        row = {n: j for j, n in enumerate([*(n for t in alive for n in t.nodes), *own[k]])}
        table = torch.cat([*(t.leaves[0] for t in alive), hidden])  # [R, H]
        first = sum(len(b) for b in batches[:k])
        logps = _sample_logprobs(model, table, batch, [[row[n] for n in tree.sample_nodes[first + i]]
                                                       for i in range(len(batch))], entropy)
        loss = loss_fn(k, logps)
        if loss is not None:
            if loss.requires_grad:
                loss.backward()  # frees the batch's own graph; gradients reach the trunk leaves
            result.loss += float(loss.detach())
        result.logprobs.append([lp.detach() for lp in logps])
        _backward_trunks([t for t in alive if t.hi == k])
        alive = [t for t in alive if t.hi != k]
    return result


def _trunk_plan(tree: PackedTree, batches: Sequence[Sequence[TrainingSample]],
                ) -> tuple[list[list[int]], dict[int, list[tuple[int, list[int]]]]]:
    """Per batch, the packed nodes only it uses (packed order); per batch k, the trunks forwarded just before it:
    (the last batch using the trunk, its nodes in packed order)."""
    batch_of = [k for k, b in enumerate(batches) for _ in b]
    own: list[list[int]] = [[] for _ in batches]
    shared: dict[tuple[int, int], list[int]] = {}  # (first, last batch using it) -> nodes, packed order
    for n, through in enumerate(tree.node_samples):
        lo, hi = min(batch_of[i] for i in through), max(batch_of[i] for i in through)
        if lo == hi:
            own[lo].append(n)
        else:
            shared.setdefault((lo, hi), []).append(n)
    # Trunks starting at batch k are forwarded before it, widest first: an ancestor is used by at least
    # the batches of its descendants, so it has a smaller-or-equal lo and a greater-or-equal hi.
    starting: dict[int, list[tuple[int, list[int]]]] = {}
    for (lo, hi), nodes in sorted(shared.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        starting.setdefault(lo, []).append((hi, nodes))
    return own, starting


def _backward_trunks(done: list[_Trunk]) -> None:
    """Backward the graphs of trunks no later batch uses with the gradients their leaves accumulated, latest first (a
    later trunk may have attended to an earlier one's leaves, never the reverse)."""
    for trunk in reversed(done):
        pairs = [(out, leaf.grad) for out, leaf in zip(trunk.outputs, trunk.leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], grad_tensors=[g for _, g in pairs])
