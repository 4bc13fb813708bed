"""Prefix-tree merged training (loomrl/trainer/tree.py): the trie by hand, and per-token logprobs and
parameter gradients of the tree forward against the dense one on a tiny float32 Llama built from a
config (random token ids: only the sharing pattern matters)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tiny_lora_models import spread_tiny

from loomrl.config import TrainerConfig
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.step_plan import micro_batches
from loomrl.trainer.trainer import Trainer
from loomrl.trainer.tree import (
    compression_ratio,
    dense_attention_pairs,
    depth_first_backward,
    pack_tree,
    plan_tries,
    tree_attention_pairs,
    tree_token_logprobs,
    unique_tokens,
)
from loomrl.types import TrainingSample

RTOL = 1e-5


def test_trie_by_hand():
    seqs = [[5, 6, 7], [5, 6, 8], [5, 9], [5, 6, 7]]
    tree = pack_tree(seqs)
    # Depth-first, children in token order: 5, 6, 7, 8 (under 6), 9 (under 5); the duplicate adds nothing.
    assert tree.token_ids == [5, 6, 7, 8, 9]
    assert tree.positions == [0, 1, 2, 2, 1]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.sample_nodes == [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2]]
    assert sorted(tree.node_samples[0]) == [0, 1, 2, 3] and sorted(tree.node_samples[1]) == [0, 1, 3]
    assert sorted(tree.node_samples[2]) == [0, 3] and tree.node_samples[3] == [1] and tree.node_samples[4] == [2]
    assert [(s.start, s.end, s.spans) for s in tree.segments] == [
        (0, 3, [(0, 3)]), (3, 4, [(0, 2), (3, 4)]), (4, 5, [(0, 1), (4, 5)])]
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(_ancestor_mask(tree), expected)
    assert dense_attention_pairs(seqs) == 6 + 6 + 3 + 6 and tree_attention_pairs(seqs) == int(expected.sum()) == 11
    assert unique_tokens(seqs) == 5 and compression_ratio(seqs) == 11 / 5
    # Budget 4, lexicographic order [5,6,7] x2, [5,6,8], [5,9]: 3 + 0 + 1 tokens, then [5,9] recomputes 5.
    assert plan_tries(seqs, 4) == [[0, 3, 1], [2]]
    assert plan_tries(seqs, 1) == [[0], [3], [1], [2]]  # each longer than the budget: one per sub-trie


def test_mask_matches_ancestors_on_a_random_trie():
    rng = random.Random(1)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 7))] for _ in range(12)]
    tree = pack_tree(seqs)
    mask = _ancestor_mask(tree)
    for j in range(len(tree.token_ids)):
        ancestors, k = {j}, tree.parents[j]
        while k >= 0:
            ancestors.add(k)
            k = tree.parents[k]
        assert set(torch.nonzero(mask[j]).flatten().tolist()) == ancestors
        assert tree.positions[j] == len(ancestors) - 1
    for i, s in enumerate(seqs):
        assert [tree.token_ids[n] for n in tree.sample_nodes[i]] == s
        assert all(i in tree.node_samples[n] for n in tree.sample_nodes[i])
    assert sum(map(len, tree.node_samples)) == sum(map(len, seqs))


# --- tree vs dense on a tiny model ---------------------------------------------------------------


def _tiny(tokenizer):
    """The tiny config's model with its matrices redrawn at std 0.2 (tests/tiny_lora_models.py). At the default 0.02 its
    next-token distribution is nearly uniform, so wrong positions or a wrong mask move logprobs by only ~1e-4
    relative; at 0.2 they move them by >10% (test_wrong_tree_is_caught), and a 1e-5 agreement says something."""
    return spread_tiny(len(tokenizer), tokenizer.eos_token_id)


@pytest.fixture()
def model(tokenizer):
    return _tiny(tokenizer)


def _sample(ids: list[int], n_prompt: int, temperature: float = 1.0) -> TrainingSample:
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return TrainingSample(trajectory_id="t", group_id="g", token_ids=ids, loss_mask=mask,
                          behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                          advantages=[float(m) for m in mask], temperature=temperature)


def _grpo(rng: random.Random, vocab: int, group: int, prompt: int) -> list[TrainingSample]:
    p = [rng.randrange(vocab) for _ in range(prompt)]
    return [_sample(p + [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))], prompt) for _ in range(group)]


def _multiturn(rng: random.Random, vocab: int) -> list[TrainingSample]:
    """A conversation's turn-samples (each a prefix of the next) plus two branches off its history;
    loss masks cover every sampled turn, so targets of different samples share logit rows."""
    ids, mask, out = [rng.randrange(vocab) for _ in range(6)], [0] * 6, []
    for _ in range(3):
        act = [rng.randrange(vocab) for _ in range(4)]
        ids, mask = ids + act, mask + [1] * 4
        s = _sample(list(ids), 0)
        s.loss_mask = list(mask)
        out.append(s)
        ids, mask = ids + [rng.randrange(vocab) for _ in range(3)], mask + [0] * 3
    for cut in (8, 13):
        s = _sample(out[-1].token_ids[:cut] + [rng.randrange(vocab) for _ in range(5)], cut)
        out.append(s)
    return out


def _cases(vocab: int) -> dict[str, list[TrainingSample]]:
    rng = random.Random(0)
    grpo = _grpo(rng, vocab, 6, 10)
    multiturn = _multiturn(rng, vocab)
    mix = _grpo(rng, vocab, 4, 7) + _multiturn(rng, vocab) + _grpo(rng, vocab, 3, 5)
    no_sharing = [_sample([rng.randrange(vocab) for _ in range(n)], 2) for n in (5, 9, 7)]
    one = [_sample([rng.randrange(vocab) for _ in range(12)], 3)]
    duplicates = [copy.deepcopy(grpo[0]) for _ in range(3)] + [grpo[1]]
    temps = _grpo(rng, vocab, 4, 8)
    for s, t in zip(temps, (1.0, 0.7, 0.0, 1.3)):
        s.temperature = t
    same_node_temps = [copy.deepcopy(grpo[2]) for _ in range(3)]  # one node, three divisors
    for s, t in zip(same_node_temps, (1.0, 0.5, 2.0)):
        s.temperature = t
    prompt_only = [_sample(grpo[0].token_ids[:10], 10)] + grpo[:2]  # a sample with no loss tokens
    return {"grpo": grpo, "multiturn": multiturn, "mix": mix, "no_sharing": no_sharing, "one_sequence": one,
            "duplicates": duplicates, "temperatures": temps, "same_node_temperatures": same_node_temps,
            "no_loss_tokens": prompt_only}


CASES = ["grpo", "multiturn", "mix", "no_sharing", "one_sequence", "duplicates", "temperatures",
         "same_node_temperatures", "no_loss_tokens"]


def _logprobs_and_grads(model, samples, fn):
    model.zero_grad(set_to_none=True)
    logps = fn(model, samples)
    weights = torch.Generator().manual_seed(3)
    loss = sum((lp * torch.randn(lp.shape, generator=weights)).sum() for lp in logps if lp.numel())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in logps], grads


def _assert_same(dense, tree):
    (d_lp, d_g), (t_lp, t_g) = dense, tree
    assert [x.shape for x in t_lp] == [x.shape for x in d_lp]
    for a, b in zip(t_lp, d_lp):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6)
    assert t_g.keys() == d_g.keys()
    for name in d_g:
        err = float((t_g[name] - d_g[name]).norm())
        assert err <= RTOL * float(d_g[name].norm()) + 1e-8, (name, err, float(d_g[name].norm()))


@pytest.mark.parametrize("case", CASES)
def test_tree_matches_dense(model, case):
    samples = _cases(model.config.vocab_size)[case]
    dense = _logprobs_and_grads(model, samples, lambda m, s: token_logprobs(m, s, with_grad=True))
    tree = _logprobs_and_grads(model, samples, lambda m, s: tree_token_logprobs(m, s, with_grad=True))
    _assert_same(dense, tree)


@pytest.mark.parametrize("case", ["grpo", "multiturn", "mix", "one_sequence", "duplicates", "temperatures"])
def test_flex_attention_tree_mask_matches_the_segments_forward(model, case):
    """FlexAttention's block mask of the trie gives the segments' logprobs. Forward only: torch's FlexAttention
    has no backward on the CPU; its gradients are checked on a GPU (scripts/gpu_smoke.py part c)."""
    samples = _cases(model.config.vocab_size)[case]
    segments = tree_token_logprobs(model, samples, with_grad=False)
    flex = tree_token_logprobs(model, samples, with_grad=False, flex=True)
    for a, b in zip(flex, segments):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6)


def test_flex_attention_is_refused_for_a_cpu_trainer(tokenizer):
    with pytest.raises(ValueError, match="tree_attention=flex needs a CUDA"):
        Trainer(_tiny(tokenizer), TrainerConfig(tree_merge="on", tree_attention="flex"))


def _ancestor_mask(tree) -> torch.Tensor:
    """[N, N] bool: row i is True at i and at each of its ancestors (from the tree's segments)."""
    mask = torch.zeros(len(tree.token_ids), len(tree.token_ids), dtype=torch.bool)
    for seg in tree.segments:
        for a, b in seg.spans:
            mask[seg.start : seg.end, a:b] = True
        mask[seg.start : seg.end, seg.start : seg.end].tril_()  # causal inside the segment
    return mask


def _mask_logprobs(model, samples, *, with_grad):
    """The plain reference: the model's own attention over the packed trie with the 4-D ancestor mask,
    which transformers passes through as it is (boolean, True = attend, for sdpa; additive for eager:
    a boolean mask given to eager would be added as 0/1, silently wrong). N^2 per head and layer."""
    from loomrl.trainer import tree as tree_module

    tree = pack_tree([s.token_ids for s in samples])
    allowed = _ancestor_mask(tree)[None, None]
    if model.config._attn_implementation == "eager":
        dtype = model.model.embed_tokens.weight.dtype
        allowed = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    with torch.set_grad_enabled(with_grad):
        hidden = model.model(input_ids=torch.tensor([tree.token_ids]), position_ids=torch.tensor([tree.positions]),
                             attention_mask=allowed).last_hidden_state[0]
        return tree_module._sample_logprobs(model, hidden, samples, tree.sample_nodes)


@pytest.mark.parametrize("path,impl", [("mask", "sdpa"), ("mask", "eager"), ("segments", "eager")])
def test_other_attention_paths_match_dense(model, path, impl):
    """The 4-D ancestor mask through the model's own attention (bool for sdpa, additive for eager) agrees
    with dense, and so does the segment attention on a model configured for eager, which it restores."""
    model.set_attn_implementation(impl)
    samples = _cases(model.config.vocab_size)["mix"]
    dense = _logprobs_and_grads(model, samples, lambda m, s: token_logprobs(m, s, with_grad=True))
    forward = _mask_logprobs if path == "mask" else tree_token_logprobs
    tree = _logprobs_and_grads(model, samples, lambda m, s: forward(m, s, with_grad=True))
    _assert_same(dense, tree)
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("corrupt", ["packed_positions", "causal_over_packed"])
def test_wrong_tree_is_caught(model, monkeypatch, corrupt):
    """The comparison can fail: position ids by packed index instead of depth, or plain causal
    attention over the packed sequence (siblings see each other), are far outside the tolerance."""
    from loomrl.trainer import tree as tree_module

    pack = tree_module.pack_tree

    def wrong(seqs):
        tree = pack(seqs)
        if corrupt == "packed_positions":
            tree.positions = list(range(len(tree.token_ids)))
        else:
            n = len(tree.token_ids)
            tree.segments = [tree_module.Segment(start=0, end=n, spans=[(0, n)])]
        return tree

    samples = _cases(model.config.vocab_size)["mix"]
    with torch.no_grad():
        dense = token_logprobs(model, samples, with_grad=False)
        monkeypatch.setattr(tree_module, "pack_tree", wrong)
        bad = tree_token_logprobs(model, samples, with_grad=False)
    worst = max(float(((b - d).abs() / d.abs()).max()) for b, d in zip(bad, dense) if d.numel())
    assert worst > 1e3 * RTOL


def test_token_budget_splits_into_sub_tries(model):
    samples = _cases(model.config.vocab_size)["mix"]
    assert len(plan_tries([s.token_ids for s in samples], 30)) > 2
    dense = _logprobs_and_grads(model, samples, lambda m, s: token_logprobs(m, s, with_grad=True))
    def sub_tries(m, s):  # as the trainer forwards a step's micro-batches: one sub-trie after another
        out = [None] * len(s)
        for group in plan_tries([x.token_ids for x in s], 30):
            for i, logp in zip(group, tree_token_logprobs(m, [s[i] for i in group], with_grad=True)):
                out[i] = logp
        return out

    _assert_same(dense, _logprobs_and_grads(model, samples, sub_tries))


@pytest.mark.parametrize("case,budget", [("grpo", 20), ("multiturn", 12), ("mix", 20), ("duplicates", 12),
                                         ("no_loss_tokens", 12)])
def test_depth_first_matches_dense(model, case, budget):
    """The depth-first pass: sub-tries that share a trunk, each node forwarded once, logprobs and
    gradients equal dense; no forward holds more tokens than the sub-trie being trained."""
    samples = sorted(_cases(model.config.vocab_size)[case], key=lambda s: s.token_ids)
    seqs = [s.token_ids for s in samples]
    batches = [[samples[i] for i in g] for g in plan_tries(seqs, budget)]
    sizes = [unique_tokens([s.token_ids for s in b]) for b in batches]
    assert len(batches) >= 2 and sum(sizes) > unique_tokens(seqs)  # sub-tries share a trunk
    dense = _logprobs_and_grads(model, [s for b in batches for s in b],
                                lambda m, s: token_logprobs(m, s, with_grad=True))

    forwards: list[int] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        result, grads = _depth_first(model, batches)
    finally:
        hook.remove()
    _assert_same(dense, ([lp for b in result.logprobs for lp in b], grads))
    assert forwards == result.forward_tokens
    assert sum(forwards) == unique_tokens(seqs)  # each node of the whole trie once
    # Alive per forward: its own tokens plus the trunk pieces it may attend to, all inside the sub-trie
    # being trained, so never more than the largest sub-trie (the budget, unless one sample is longer).
    assert max(result.alive_tokens) <= max(sizes)
    assert max(sizes) <= max(budget, max(map(len, seqs)))


def test_depth_first_is_caught_without_the_trunk_backward(model, monkeypatch):
    """The trunk's gradient arrives only through its K/V and hidden leaves: skip the trunks' backward
    (the one call with grad_tensors=; loss.backward() passes its gradient positionally) and the
    embeddings' gradient is far off."""
    samples = sorted(_cases(model.config.vocab_size)["grpo"], key=lambda s: s.token_ids)
    batches = [[samples[i] for i in g] for g in plan_tries([s.token_ids for s in samples], 20)]
    dense = _logprobs_and_grads(model, [s for b in batches for s in b],
                                lambda m, s: token_logprobs(m, s, with_grad=True))
    real = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward",
                        lambda tensors, *a, **k: None if "grad_tensors" in k else real(tensors, *a, **k))
    _, grads = _depth_first(model, batches)
    name = "model.embed_tokens.weight"
    err = float((grads[name] - dense[1][name]).norm())
    assert err > 1e3 * RTOL * float(dense[1][name].norm())


def _depth_first(model, batches):
    """depth_first_backward with the loss of _logprobs_and_grads (the same weights in the same order)."""
    model.zero_grad(set_to_none=True)
    weights = torch.Generator().manual_seed(3)

    def loss_fn(k, logps):
        terms = [(lp * torch.randn(lp.shape, generator=weights)).sum() for lp in logps if lp.numel()]
        return sum(terms) if terms else None

    result = depth_first_backward(model, batches, loss_fn)
    return result, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _trained(tokenizer, samples, **options):
    model = _tiny(tokenizer)
    trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=4, **options))
    stats = trainer.train_step(samples)
    return dict(model.named_parameters()), stats


@pytest.mark.parametrize("options", [{}, {"loss": {"kind": "decoupled_ppo", "kl": "k3", "kl_coef": 0.1}},
                                     {"loss": {"aggregation": "seq_mean_token_mean"}}],
                         ids=["default", "decoupled_ppo+kl", "seq_mean"])
def test_train_step_with_tree_merge_equals_dense(tokenizer, options):
    rng = random.Random(5)
    vocab = len(tokenizer)
    samples = _grpo(rng, vocab, 4, 12) + _multiturn(rng, vocab) + _grpo(rng, vocab, 4, 9)
    for s in samples:  # behaviour logprobs near the policy's, advantages of both signs
        s.behaviour_logprobs = [-10.8 * m for m in s.loss_mask]
        s.advantages = [a * rng.choice([-1.0, 1.0]) for a in s.advantages]
    off, off_stats = _trained(tokenizer, samples, **options)
    on, on_stats = _trained(tokenizer, samples, tree_merge="on", **options)
    budget, budget_stats = _trained(tokenizer, samples, tree_merge="on", tree_token_budget=40, **options)
    depth, depth_stats = _trained(tokenizer, samples, tree_merge="on", tree_token_budget=20,
                                  tree_merge_memory="depth_first", **options)
    for name, p in off.items():
        for other in (on, budget, depth):
            grad = other[name].grad
            assert float((grad - p.grad).norm()) <= RTOL * float(p.grad.norm()) + 1e-8, name
            # AdamW's first step is lr * g / (|g| + 1e-8): where |g| is within a few eps of float noise
            # (~1e-9 next to a norm of 0.3) the step is a noise-dependent fraction of lr (seen: 2e-5);
            # everywhere else the updated parameters agree to float rounding.
            delta = (other[name] - p).detach().abs()
            steady = p.grad.abs() > 1e-6
            assert not bool((delta[steady] > 1e-6).any()), name
            assert float(delta.max()) <= 2 * 1e-3, name
    assert off_stats.tree_ratio == 1.0 and on_stats.tree_ratio > 1.5 and budget_stats.tree_ratio > 1.0
    assert off_stats.attn_pairs == off_stats.attn_pairs_dense == on_stats.attn_pairs_dense > on_stats.attn_pairs > 0
    assert abs(on_stats.loss - off_stats.loss) <= 1e-5 * max(1.0, abs(off_stats.loss))
    seqs = [s.token_ids for s in samples]
    assert depth_stats.tree_ratio == pytest.approx(compression_ratio(seqs))
    groups = plan_tries(sorted(seqs), 20)  # at 20, groups and histories straddle micro-batches: trunks
    assert sum(unique_tokens([sorted(seqs)[i] for i in g]) for g in groups) > unique_tokens(seqs)
    assert depth_stats.attn_pairs == tree_attention_pairs(seqs)
    assert abs(depth_stats.loss - off_stats.loss) <= 1e-5 * max(1.0, abs(off_stats.loss))
    for key in ("clip_frac", "ratio_mean", "approx_kl"):  # per token; ess is per micro-batch, so differs
        assert getattr(depth_stats, key) == pytest.approx(getattr(off_stats, key), rel=1e-5, abs=1e-6)


def test_auto_merges_only_micro_batches_that_share(tokenizer):
    rng = random.Random(6)
    vocab = len(tokenizer)
    shared = _grpo(rng, vocab, 4, 30)  # ratio about 4: merged
    _, stats = _trained(tokenizer, shared, tree_merge="auto")
    assert stats.tree_ratio == pytest.approx(compression_ratio([s.token_ids for s in shared]))
    apart = [_sample([rng.randrange(vocab) for _ in range(10)], 2) for _ in range(4)]  # ratio 1: dense
    _, stats = _trained(tokenizer, apart, tree_merge="auto")
    assert stats.tree_ratio == 1.0
    _, stats = _trained(tokenizer, shared, tree_merge="auto", tree_merge_min_ratio=100.0)
    assert stats.tree_ratio == 1.0


def test_attention_pair_counts_match_the_packed_trie():
    import random



    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randint(0, 3) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 6))]
        tree = pack_tree(seqs)  # counted from the packed trie: a node at depth d sees d + 1 keys
        assert tree_attention_pairs(seqs) == sum(p + 1 for p in tree.positions) == int(_ancestor_mask(tree).sum())
        assert dense_attention_pairs(seqs) == sum(n * (n + 1) // 2 for n in map(len, tree.sample_nodes))
    assert tree_attention_pairs([[1, 2, 3], [1, 2, 4]]) == 1 + 2 + 3 + 3  # the shared [1, 2] counted once


@pytest.mark.parametrize("merge", [{}, {"tree_merge": "on"}, {"tree_merge": "on", "tree_token_budget": 40}],
                         ids=["dense", "tree", "tree_subtries"])
def test_activation_checkpointing_gives_the_same_gradients(tokenizer, merge):
    """Recomputing each decoder layer in the backward pass changes memory, not the step: the same
    loss and gradients (to float rounding: the recompute runs the same kernels on the same inputs). Under
    tree merge the recompute must run the tree attention again: run outside it, the gradients differ."""
    rng = random.Random(7)
    samples = _grpo(rng, len(tokenizer), 4, 12) + _multiturn(rng, len(tokenizer))
    off, off_stats = _trained(tokenizer, samples, **merge)
    on, on_stats = _trained(tokenizer, samples, activation_checkpointing=True, **merge)
    assert on_stats.loss == pytest.approx(off_stats.loss, rel=1e-6, abs=1e-7)
    for name, p in off.items():
        assert torch.allclose(on[name].grad, p.grad, rtol=1e-5, atol=1e-8), name
    with pytest.raises(ValueError, match="activation_checkpointing does not work with trainer.tree_merge_memory"):
        TrainerConfig(activation_checkpointing=True, tree_merge="on", tree_token_budget=40,
                      tree_merge_memory="depth_first")


@pytest.mark.integration
def test_bfloat16_training_stays_near_float32_for_five_steps(tokenizer):
    """trainer.precision=bfloat16 (autocast; float32 weights, gradients, AdamW state and loss) against
    float32, 5 steps on CPU. Stated tolerance: each step's loss within 1% relative and every weight
    tensor within 1% (relative norm) after 5 steps (measured here: 0.33% and 0.28%)."""
    rng = random.Random(3)
    samples = _grpo(rng, len(tokenizer), 4, 12) + _multiturn(rng, len(tokenizer))
    for s in samples:
        s.behaviour_logprobs = [-10.8 * m for m in s.loss_mask]
    runs = {}
    for precision in ("float32", "bfloat16"):
        model = _tiny(tokenizer)
        trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=4, precision=precision))
        runs[precision] = ([trainer.train_step(samples).loss for _ in range(5)],
                           {n: p.detach() for n, p in model.named_parameters()})
    (l32, w32), (l16, w16) = runs["float32"], runs["bfloat16"]
    assert l16 != l32  # autocast did run in bfloat16
    for a, b in zip(l32, l16):
        assert abs(a - b) <= 0.01 * abs(a)
    for name, p in w32.items():
        assert p.dtype == w16[name].dtype == torch.float32
        assert float((w16[name] - p).norm()) <= 0.01 * float(p.norm()), name


def test_micro_batches_by_token_budget(tokenizer):
    """trainer.micro_batch_tokens: dense micro-batches of at most that many padded tokens (a longer sample
    alone); the step's gradient does not depend on how it is cut (the denominators are the step's)."""
    rng = random.Random(11)
    samples = _grpo(rng, len(tokenizer), 4, 12) + _multiturn(rng, len(tokenizer)) + _grpo(rng, len(tokenizer), 4, 3)
    budget = 45
    cut = micro_batches(TrainerConfig(micro_batch_tokens=budget), samples)
    batches = [[samples[i] for i in b] for b in cut.index]
    assert sorted(id(s) for b in batches for s in b) == sorted(map(id, samples))  # each sample once
    assert len(batches) > 2
    for b in batches:
        assert len(b) == 1 or len(b) * max(len(s.token_ids) for s in b) <= budget
    by_count, count_stats = _trained(tokenizer, samples)
    by_tokens, token_stats = _trained(tokenizer, samples, micro_batch_tokens=budget)
    assert token_stats.loss == pytest.approx(count_stats.loss, rel=1e-5, abs=1e-7)
    for name, p in by_count.items():
        assert float((by_tokens[name].grad - p.grad).norm()) <= RTOL * float(p.grad.norm()) + 1e-8, name
