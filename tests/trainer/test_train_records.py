"""What a train step records for the run viewer: the policy's entropy at the trained tokens, from the training
forward's own logits (trainer/head.py), against a hand computation on full logits; the engine-vs-trainer logprob gap
(StepStats: 0 when the engine's logprobs are the trainer's, the shift when one is shifted), on the dense, tree-merged
and depth-first forwards; and the per-trajectory train records (trainer/records.py) across a restarted context."""

from __future__ import annotations

import json

import pytest
import torch
from test_credit import episode

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.run_folder import TRAIN_RECORDS
from loomrl.trainer.credit import AdvantageRule, group_credit
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.grpo import samples_from_group
from loomrl.trainer.head import Entropies, chunked_logprobs
from loomrl.trainer.records import append_records, cut_records, train_records
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample


def hand_entropy(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """-sum p log p of softmax(logits / T) per row, T <= 0 scored at 1 (as the head scores greedy rows)."""
    t = torch.where(temps > 0, temps, torch.ones_like(temps))
    logp = torch.log_softmax(logits.double() / t.double()[:, None], dim=-1)
    return -(logp.exp() * logp).sum(-1).float()


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_heads_entropy_is_the_hand_computed_one_and_leaves_gradients_alone(chunk, softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g).requires_grad_()
    weight = (torch.randn(101, 16, generator=g) * 0.8).requires_grad_()
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9])
    rows = torch.tensor([4, 0, 0, 8, 2, 2, 7])  # a row may serve several targets, in any order
    targets = torch.randint(0, 101, (7,), generator=g)
    z = hidden.detach() @ weight.detach().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    grads = []
    for sink in (None, Entropies()):
        hidden.grad = weight.grad = None
        chunked_logprobs(hidden, weight, targets, temps, rows=rows, chunk=chunk, softcap=softcap,
                         entropy=sink).sum().backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    torch.testing.assert_close(sink.all(), hand_entropy(z, temps)[rows], rtol=1e-5, atol=1e-5)
    assert not sink.all().requires_grad
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _sample(tokenizer, text: str, n_prompt: int, adv: float, temperature: float = 1.0) -> TrainingSample:
    ids = tokenizer.encode(text)
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return TrainingSample(trajectory_id=text, group_id="g", token_ids=ids, loss_mask=mask,
                          behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                          advantages=[adv * m for m in mask], temperature=temperature)


# the dense forward, a tree-merged one, and the depth-first pass over the step's trie: each computes the entropy and
# the gap on its own path
FORWARDS = {"dense": {}, "tree": {"tree_merge": "on"},
            "depth_first": {"tree_merge": "on", "tree_token_budget": 12, "tree_merge_memory": "depth_first"}}


@pytest.mark.parametrize("forward", FORWARDS)
def test_entropy_and_logprob_gap_of_a_step(tokenizer, forward):
    from loomrl.model.loader import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    with torch.no_grad():  # a random model's distributions are near uniform: sharpen them, so entropies differ
        model.get_output_embeddings().weight.mul_(6.0)
    samples = [_sample(tokenizer, "the answer is forty two", 2, 1.0),
               _sample(tokenizer, "the answer is five", 2, -1.0, temperature=0.7),
               _sample(tokenizer, "random words about nothing", 1, 0.5)]
    want_entropy = []
    for s in samples:  # the engine's logprobs = the trainer's before the step (an on-policy rollout, exact numerics)
        trained = [t for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
        for t, v in zip(trained, token_logprobs(model, [s], with_grad=False)[0].tolist()):
            s.behaviour_logprobs[t] = v
        with torch.no_grad():
            logits = model(torch.tensor([s.token_ids])).logits[0]  # [T, V]: the full head, the dense way
        want_entropy.append(hand_entropy(logits[[t - 1 for t in trained]], torch.full((len(trained),), s.temperature)))
    want = float(torch.cat(want_entropy).mean())
    # two tokens as an engine that disagreed would have them: 0.25 nats lower, 0.1 higher
    samples[1].behaviour_logprobs[[t for t in range(1, len(samples[1].token_ids)) if samples[1].loss_mask[t]][1]] -= 0.25
    samples[2].behaviour_logprobs[[t for t in range(1, len(samples[2].token_ids)) if samples[2].loss_mask[t]][0]] += 0.1
    stats = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=2, **FORWARDS[forward])).train_step(samples)

    per_token = torch.cat(want_entropy)
    assert 0 < want < torch.log(torch.tensor(float(len(tokenizer)))).item() - 1 and per_token.std() > 0.3
    assert stats.entropy == pytest.approx(want, rel=1e-4)
    n = stats.loss_tokens
    assert [len(g) for g in stats.gaps] == [sum(s.loss_mask[1:]) for s in samples]  # in the order given
    assert stats.gaps[1][1] == pytest.approx(0.25, abs=1e-4) and stats.gaps[2][0] == pytest.approx(0.1, abs=1e-4)
    assert max(g for i, gs in enumerate(stats.gaps) for j, g in enumerate(gs) if (i, j) not in ((1, 1), (2, 0))) < 1e-4
    assert stats.logprob_gap_max == pytest.approx(0.25, abs=1e-4)
    assert stats.logprob_gap_mean == pytest.approx(0.35 / n, abs=1e-5)
    metrics = stats.metrics()
    assert {"entropy", "logprob_gap_mean", "logprob_gap_max"} <= set(metrics) and "gaps" not in metrics


def test_train_records_carry_the_advantages_and_gaps_per_context(tmp_path):
    rule = AdvantageRule(credit="turn")
    group = [episode("a", [{"x": 0.5}, {"x": 0.5}], 1.0, restart_after=0), episode("b", [{}, {"x": 0.2}], 0.2)]
    credit = group_credit(group, rule)
    samples = samples_from_group(group, rule)
    assert [s.trajectory_id for s in samples] == ["a", "a", "b"]  # a's two contexts, then b's one
    for s in samples:
        s.advantages = [v * 0.5 for v in s.advantages]  # the lag decay, applied to the samples after credit
    gaps = [[0.123456, 0.0, 1.0], [0.5, 0.25, 0.125], None]  # b: trained on a rank that did not report it
    rec_a, rec_b = train_records(7, group, samples, gaps)
    assert rec_a.trajectory_id == "a" and rec_a.step == 7
    assert rec_a.advantages == pytest.approx([0.5 * a for a in credit.turns[0]])
    assert rec_a.gaps == [[0.1235, 0.0, 1.0], [0.5, 0.25, 0.125]]
    assert rec_b.advantages == pytest.approx([0.5 * a for a in credit.turns[1]]) and rec_b.gaps == [None]
    # the balance filter left a's second context out: its turn has no advantage, its context no gaps
    (partial,) = train_records(7, group[:1], samples[:1], gaps[:1])
    assert partial.advantages == pytest.approx([0.5 * credit.turns[0][0], None]) and partial.gaps[1] is None
    unreported = train_records(7, group, samples, [])  # a trainer that reports no gaps: advantages only
    assert [r.gaps for r in unreported] == [[None, None], [None]] and unreported[0].advantages == rec_a.advantages
    with pytest.raises(ValueError, match="2 gap lists for 3 samples"):
        train_records(7, group, samples, gaps[:2])
    append_records(tmp_path, [rec_a, rec_b])
    append_records(tmp_path, [train_records(8, group[:1], samples[:1], gaps[:1])[0]])
    with (tmp_path / TRAIN_RECORDS).open("a") as f:
        f.write('{"step": 9, "traj')  # torn by a kill
    cut_records(tmp_path, 7)  # resumed from step 7's checkpoint
    lines = [json.loads(x) for x in (tmp_path / TRAIN_RECORDS).read_text().splitlines()]
    assert [(x["step"], x["trajectory_id"]) for x in lines] == [(7, "a"), (7, "b")]
    cut_records(tmp_path, None)  # a restart without a checkpoint
    assert not (tmp_path / TRAIN_RECORDS).exists()
