"""The seams of a training step, each alone (loomrl issue 44): the step plan (micro-batches, merge flags, a sharded
step's padding, pair counts, each sample's position), the pure function from a micro-batch's samples to the loss's
typed inputs (chunk ids included), the step's loss config (its denominators), and the lag decay that returns new
samples. By hand, on small samples; no model (the end-to-end step is tests/trainer/test_step_regression.py)."""

from __future__ import annotations

import math

import pytest
import torch

from loomrl.config import LossConfig, TrainerConfig
from loomrl.trainer.loss_inputs import chunk_ids, loss_inputs, step_loss_config
from loomrl.trainer.selection import lag_weighted
from loomrl.trainer.step_plan import PADDING, micro_batches, plan_step
from loomrl.trainer.tree import dense_attention_pairs, tree_attention_pairs
from loomrl.types import TrainingSample

CPU = torch.device("cpu")


def sample(tid: str, ids: list[int], mask: list[int], *, versions: list[int] | None = None) -> TrainingSample:
    return TrainingSample(trajectory_id=tid, group_id="g", token_ids=ids, loss_mask=mask,
                          behaviour_logprobs=[-0.1 * (t + 1) * m for t, m in enumerate(mask)],
                          versions=versions or [0] * len(ids), advantages=[(t + 1.0) * m for t, m in enumerate(mask)])


def test_chunk_ids_start_a_chunk_per_sequence_and_after_every_gap():
    # sequence 0: turns at 4-6 and 9-10 (an observation at 7-8); sequence 1: one token; sequence 2: 2-3 then 7
    assert chunk_ids([[4, 5, 6, 9, 10], [3], [2, 3, 7]]) == [0, 0, 0, 1, 1, 2, 3, 3, 4]
    assert chunk_ids([[1, 2], [1, 2]]) == [0, 0, 1, 1]  # two sequences never share a chunk, even where contiguous
    assert chunk_ids([]) == [] and chunk_ids([[], [5]]) == [0]


def test_loss_inputs_are_the_trained_tokens_of_the_samples_that_have_some():
    two_turns = sample("a", [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1])  # trained: 2, 3 | 5, 6
    prompt_only = sample("b", [1, 2, 3], [0, 0, 0])
    one_turn = sample("c", [1, 9, 8], [0, 1, 1])  # trained: 1, 2
    logps = [torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.zeros(0), torch.tensor([-5.0, -6.0])]
    prox = [lp - 0.5 for lp in logps]
    got = loss_inputs([two_turns, prompt_only, one_turn], logps, prox=prox, num_seqs=7, device=CPU)
    assert got is not None and got.samples == [0, 2] and got.counts == [4, 2]
    x = got.loss
    torch.testing.assert_close(x.logp, torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]))
    torch.testing.assert_close(x.old_logp, torch.tensor([-0.3, -0.4, -0.6, -0.7, -0.2, -0.3]))
    torch.testing.assert_close(x.advantages, torch.tensor([3.0, 4.0, 6.0, 7.0, 2.0, 3.0]))
    assert x.seq_ids.tolist() == [0, 0, 0, 0, 1, 1] and x.chunk_ids is not None
    assert x.chunk_ids.tolist() == [0, 0, 1, 1, 2, 2]  # a's two turns are two chunks; c's one turn a third
    assert x.prox_logp is not None and x.prox_logp.tolist() == [-1.5, -2.5, -3.5, -4.5, -5.5, -6.5]
    assert x.ref_logp is None and x.num_seqs == 7
    assert loss_inputs([prompt_only], [torch.zeros(0)], num_seqs=1, device=CPU) is None


def test_the_steps_loss_config_divides_by_the_whole_step_idle_groups_included():
    samples = [sample("a", [1, 2, 3, 4], [0, 1, 1, 1]), sample("b", [1, 2], [0, 1])]
    kl = {"kl": "k3", "kl_coef": 0.1}
    token = step_loss_config(LossConfig(**kl), samples, idle_tokens=6, idle_seqs=2, idle_longest=5)
    assert (token.aggregation, token.norm_constant, token.kl, token.kl_coef) == ("token_sum_norm", 3 + 1 + 6, "k3", 0.1)
    seq = step_loss_config(LossConfig(aggregation="seq_mean_token_sum"), samples, idle_seqs=2, idle_longest=5)
    assert (seq.aggregation, seq.norm_constant) == ("seq_mean_token_sum", 5.0 * (2 + 2))  # longest x sequences
    fixed = step_loss_config(LossConfig(aggregation="token_sum_norm", norm_constant=9.0), samples)
    assert fixed.norm_constant == 9.0
    no_ref = step_loss_config(LossConfig(**kl), samples, with_ref=False)
    assert (no_ref.kl, no_ref.kl_coef) == (None, 0.0)


def test_the_step_plan_cuts_pads_and_counts_pairs():
    samples = [sample("long", [1, 2, 3, 4, 5], [0, 1, 1, 1, 1]), sample("short", [1, 2], [0, 1]),
               sample("mid", [1, 2, 7], [0, 1, 1])]
    plan = plan_step(TrainerConfig(micro_batch_size=2), samples, shared_plan=lambda real: real + 2)
    assert plan.index == [[1, 2], [0], [], []] and plan.real == 2  # by length; two padding micro-batches
    assert plan.batches[:2] == [[samples[1], samples[2]], [samples[0]]] and plan.batches[2:] == [[PADDING]] * 2
    assert plan.merged == [False] * 4 and plan.tree_ratio == 1.0 and not plan.depth_first
    assert plan.attn_pairs == plan.attn_pairs_dense == dense_attention_pairs([s.token_ids for s in samples]) + 2 * 3
    merged = plan_step(TrainerConfig(micro_batch_size=3, tree_merge="on"), samples)
    assert merged.index == [[1, 0, 2]] and merged.merged == [True]  # lexicographic: [1, 2], [1, 2, 3, ...], [1, 2, 7]
    assert merged.attn_pairs == tree_attention_pairs([s.token_ids for s in samples]) < merged.attn_pairs_dense
    assert merged.tree_ratio == pytest.approx(10 / 6)  # 10 tokens, 6 distinct prefixes
    auto = micro_batches(TrainerConfig(micro_batch_size=1, tree_merge="auto"), samples)
    assert auto.merged == [False, False, False] and auto.tree_ratio == 1.0  # one sample a batch shares nothing


def test_lag_decay_returns_new_samples_and_leaves_the_given_ones_alone():
    fresh = sample("fresh", [1, 2, 3], [0, 1, 1], versions=[0, 5, 5])
    old = sample("old", [1, 2, 3], [0, 1, 1], versions=[0, 3, 4])  # oldest trained token: version 3, lag 2
    unknown = sample("unknown", [1, 2], [0, 0])  # no trained token: min_version -1, never decayed
    given = [list(s.advantages) for s in (fresh, old, unknown)]
    out, weighted = lag_weighted([fresh, old, unknown], version=5, decay=0.5)
    assert weighted == 1 and out[0] is fresh and out[2] is unknown and out[1] is not old
    assert out[1].advantages == pytest.approx([a * math.exp(-1.0) for a in old.advantages])
    assert out[1].trajectory_id == "old" and out[1].versions == old.versions
    assert [s.advantages for s in (fresh, old, unknown)] == given  # not rewritten in place
    assert lag_weighted([old], version=5, decay=0.0) == ([old], 0)
