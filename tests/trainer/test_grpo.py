from __future__ import annotations

import math

import pytest
import torch

from loomrl.config import TrainerConfig
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.grpo import group_advantages
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert [round(a, 5) for a in adv] == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]
    r = [1.0, 0.1, 0.0]
    mean = sum(r) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
    assert all(abs(a - (x - mean) / (std + 1e-6)) < 1e-9 for a, x in zip(group_advantages(r), r))


def _sample(tokenizer, text: str, n_prompt: int, adv: float) -> TrainingSample:
    ids = tokenizer.encode(text)
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return TrainingSample(trajectory_id=text, group_id="g", token_ids=ids, loss_mask=mask,
                          behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                          advantages=[adv * m for m in mask], temperature=1.0)


def test_token_logprobs_match_full_logits(tiny_model, tokenizer):
    samples = [_sample(tokenizer, "the answer is forty two", 2, 1.0), _sample(tokenizer, "short one", 1, -1.0)]
    got = token_logprobs(tiny_model, samples, with_grad=False)
    for s, lp in zip(samples, got):
        with torch.no_grad():
            logits = tiny_model(torch.tensor([s.token_ids])).logits[0]
        full = torch.log_softmax(logits, -1)
        idx = [t for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
        ref = torch.stack([full[t - 1, s.token_ids[t]] for t in idx])
        assert torch.allclose(lp, ref, atol=1e-5)


@pytest.mark.parametrize("options", [
    {}, {"kind": "gspo"}, {"kind": "decoupled_ppo"}, {"kind": "cispo"},
    {"is_level": "sequence", "is_variant": "truncated"}, {"is_level": "chunk", "is_variant": "masked", "is_cap": 100.0},
    {"kl": "k3", "kl_coef": 0.1}, {"aggregation": "seq_mean_token_mean"}, {"aggregation": "token_sum_norm"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_train_step_moves_logprobs_in_the_advantage_direction(tokenizer, options):
    from loomrl.config import ModelConfig
    from loomrl.model.loader import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    good = _sample(tokenizer, "calc(3 + 4) then the answer", 2, 1.0)
    bad = _sample(tokenizer, "random words about nothing", 2, -1.0)
    for s in (good, bad):  # behaviour logprobs = the current policy's, as an on-policy rollout
        s.behaviour_logprobs = [0.0] * len(s.token_ids)
        lp = token_logprobs(model, [s], with_grad=False)[0].tolist()
        for t, v in zip([t for t in range(1, len(s.token_ids)) if s.loss_mask[t]], lp):
            s.behaviour_logprobs[t] = v
    before = [token_logprobs(model, [s], with_grad=False)[0].sum().item() for s in (good, bad)]
    # PPO's clip range wide open (the other kinds keep their papers' ranges)
    wide = {"clip_low": 10.0} if options.get("kind", "ppo_clip") in ("ppo_clip", "decoupled_ppo") else {}
    trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=1, loss={**wide, **options}))
    for _ in range(3):
        stats = trainer.train_step([good, bad])
    after = [token_logprobs(model, [s], with_grad=False)[0].sum().item() for s in (good, bad)]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.step == 3 and stats.loss_tokens == sum(good.loss_mask) + sum(bad.loss_mask)
    assert 0 < stats.ess <= 1.0


def test_freeze_layers_keeps_bottom_fixed(tokenizer):
    from loomrl.config import ModelConfig
    from loomrl.model.loader import build_tiny_model

    model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "layers.0." in k or "embed" in k}
    trainer = Trainer(model, TrainerConfig(lr=1e-2, freeze_layers=1))
    trainer.train_step([_sample(tokenizer, "some text to learn from", 1, 1.0)])
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in frozen.items())
    assert not torch.equal(state["model.layers.1.mlp.down_proj.weight"],
                           build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
                           .state_dict()["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("aggregation,norm_constant", [("token_mean", None), ("seq_mean_token_mean", None),
                                                       ("token_sum_norm", 40.0), ("token_sum_norm", None)])
def test_idle_counts_make_skipping_a_zero_advantage_group_exact(tokenizer, aggregation, norm_constant):
    """Leaving a zero-variance group out of the backward pass but counting its tokens and sequences
    (idle_tokens/idle_seqs) gives the gradient of training on it with zero advantage; leaving it out
    of the denominator too gives a larger one."""
    from loomrl.config import ModelConfig
    from loomrl.model.loader import build_tiny_model

    informative = [_sample(tokenizer, "calc(3 + 4) then the answer", 2, 1.0),
                   _sample(tokenizer, "random words about nothing", 2, -1.0)]
    # the longest sequence is idle: token_sum_norm's default constant must see it (idle_longest)
    idle = [_sample(tokenizer, "all of this group got the same reward, and it is the longest of them", 1, 0.0),
            _sample(tokenizer, "so its advantage is zero", 1, 0.0)]
    norm = norm_constant

    def grads(samples, **kw):
        torch.manual_seed(0)
        model = build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id)
        trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=2, grad_clip=1e9,
                                               loss={"aggregation": aggregation, "norm_constant": norm}))
        trainer.train_step(samples, **kw)  # .grad keeps the step's gradient after the update
        return torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None])

    full = grads(informative + idle)
    skipped = grads(informative, idle_tokens=sum(sum(s.loss_mask) for s in idle), idle_seqs=len(idle),
                    idle_longest=max(sum(s.loss_mask) for s in idle))
    renormalised = grads(informative)
    assert torch.allclose(full, skipped, atol=1e-7, rtol=1e-5)
    if norm_constant is None:  # a fixed constant does not depend on the batch
        assert renormalised.norm() > full.norm() * 1.2
    with pytest.raises(ValueError, match="idle_tokens"):
        grads(informative, idle_tokens=-1)
