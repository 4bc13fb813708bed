"""Losses, advantages, IS corrections, KL estimators and aggregation against references computed by hand
with plain Python math (never by calling the function under test)."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_references import decoupled_ppo_loss, effective_sample_size

from loomrl.config import LossConfig
from loomrl.trainer.losses import (
    aggregate,
    cispo_loss,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    gspo_loss,
    importance_weights,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    rloo_advantages,
)

F64 = torch.float64


def _loss(kind, logp, old_logp, advantages, seq_ids, *, chunk_ids=None, prox_logp=None, ref_logp=None,
          num_seqs=None, is_variant="none", **options):
    """policy_loss with the options a trainer.loss section gives it (is_variant "none" unless set)."""
    return policy_loss(LossConfig(kind=kind, is_variant=is_variant, **options), logp, old_logp, advantages, seq_ids,
                       chunk_ids=chunk_ids, prox_logp=prox_logp, ref_logp=ref_logp, num_seqs=num_seqs)


TOL = {"atol": 1e-12, "rtol": 1e-12}

# Two sequences: 2 and 3 sampled tokens. Probabilities chosen so that the ratios are round numbers.
MU = [0.5, 0.5, 0.4, 0.5, 0.2]  # behaviour (engine)
PI = [0.75, 0.25, 0.6, 0.55, 0.1]  # current: pi/mu = 1.5, 0.5, 1.5, 1.1, 0.5
PROX = [0.6, 0.5, 0.5, 0.35, 0.3]  # proximal / trainer: prox/mu = 1.2, 1.0, 1.25, 0.7, 1.5
ADV = [1.0, 1.0, -2.0, -2.0, -2.0]
SEQ = [0, 0, 1, 1, 1]
CHUNK = [7, 7, 3, 3, 9]  # seq 1 has two turns: chunk 3 (2 tokens), chunk 9 (1 token)


def logt(ps: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in ps], dtype=F64, requires_grad=grad)


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def ppo_ref(r: float, a: float, lo: float, hi: float) -> float:
    return -min(r * a, clip(r, 1 - lo, 1 + hi) * a)


def close(a: torch.Tensor, b: list[float] | float) -> bool:
    return torch.allclose(a, torch.as_tensor(b, dtype=F64), **TOL)


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_population_std():
    r = [1.0, 0.0, 0.5]
    mean = 0.5
    std = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    assert close(grpo_advantages(r), [(x - mean) / (std + 1e-6) for x in r])
    assert close(grpo_advantages(t(r), eps=0.0), [(x - mean) / std for x in r])
    assert close(grpo_advantages([0.5, 0.5]), [0.0, 0.0])  # no signal, no NaN
    assert close(compute_advantages("grpo", r), [(x - mean) / (std + 1e-6) for x in r])


def test_dr_grpo_advantages_no_std():
    r = [3.0, 1.0, 2.0, 0.0]
    assert close(dr_grpo_advantages(r), [1.5, -0.5, 0.5, -1.5])
    assert close(compute_advantages("dr_grpo", r), [1.5, -0.5, 0.5, -1.5])


def test_rloo_advantages_leave_one_out():
    r = [1.0, 0.0, 0.5]
    assert close(rloo_advantages(r), [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])
    assert close(rloo_advantages([1.0, 0.0]), [1.0, -1.0])  # n = 2: the other one is the baseline
    assert close(compute_advantages("rloo", torch.tensor([2, 4])), [-2.0, 2.0])  # integer tensor


def test_advantage_errors():
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        rloo_advantages([1.0])
    with pytest.raises(ValueError, match="kind='ppo'.*grpo, dr_grpo, rloo"):
        compute_advantages("ppo", [1.0, 0.0])
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages([])


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_symmetric_values_grads_stats():
    logp = logt(PI, grad=True)
    loss, stats = ppo_clip_loss(logp, logt(MU), t(ADV), clip_low=0.2, clip_high=0.2)
    # r = 1.5, 0.5, 1.5, 1.1, 0.5: -min(rA, clip(r)A) = -1.2 (clipped), -0.5, 3, 2.2, 1.6 (clipped)
    assert close(loss, [-1.2, -0.5, 3.0, 2.2, 1.6])
    loss.sum().backward()
    # d/dlogp of -rA is -rA on the unclipped branch, 0 where the clip binds
    assert close(logp.grad, [0.0, -0.5, 3.0, 2.2, 0.0])
    assert close(stats["clip_frac"], 2 / 5)
    assert close(stats["ratio_mean"], (1.5 + 0.5 + 1.5 + 1.1 + 0.5) / 5)
    ratios = [p / m for p, m in zip(PI, MU)]
    assert close(stats["approx_kl"], sum(r - 1 - math.log(r) for r in ratios) / 5)


def test_ppo_clip_asymmetric():
    logp, old, adv = logt(PI), logt(MU), t(ADV)
    ratios = [p / m for p, m in zip(PI, MU)]
    higher, _ = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.6)  # DAPO's clip-higher
    assert close(higher, [ppo_ref(r, a, 0.2, 0.6) for r, a in zip(ratios, ADV)])
    assert close(higher[0], -1.5) and close(higher[4], 1.6)  # 1.5 < 1.6 no longer clipped; 0.5 still at 0.8
    lower, _ = ppo_clip_loss(logp, old, adv, clip_low=0.6, clip_high=0.2)
    assert close(lower[0], -1.2) and close(lower[4], 1.0)  # 0.5 within [0.4, 1.2]: -(0.5 * -2)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_values_and_clip():
    loss, stats = gspo_loss(logt(PI), logt(MU), t(ADV), ids(SEQ), clip_low=0.05, clip_high=0.05)
    s0 = math.exp((math.log(1.5) + math.log(0.5)) / 2)  # geometric mean: sqrt(0.75) ~ 0.866
    s1 = math.exp((math.log(1.5) + math.log(1.1) + math.log(0.5)) / 3)  # 0.825 ** (1/3) ~ 0.938
    l0 = -min(s0 * 1.0, clip(s0, 0.95, 1.05) * 1.0)  # A > 0, s < 1: unclipped
    l1 = -min(s1 * -2.0, clip(s1, 0.95, 1.05) * -2.0)  # A < 0, s < 0.95: clipped to 0.95 -> 1.9
    assert close(loss, [l0, l0, l1, l1, l1])
    assert math.isclose(l1, 1.9) and math.isclose(l0, -s0)
    assert close(stats["clip_frac"], 0.5)  # one of two sequences
    assert close(stats["ratio_mean"], (s0 + s1) / 2)


def test_gspo_gradient_flows_through_the_mean():
    for lo, hi in ((0.05, 0.05), (0.5, 0.5)):
        logp = logt(PI, grad=True)
        loss, _ = gspo_loss(logp, logt(MU), t(ADV), ids(SEQ), clip_low=lo, clip_high=hi)
        aggregate(loss, ids(SEQ), "seq_mean_token_mean").backward()  # = (L_0 + L_1) / 2
        s0 = math.sqrt(0.75)
        s1 = 0.825 ** (1 / 3)
        # d(-s_i A_i)/dlogp_t = -A_i s_i / |y_i|, then / 2 sequences
        g0 = -1.0 * s0 / 2 / 2
        g1 = 0.0 if lo == 0.05 else 2.0 * s1 / 3 / 2  # sequence 1 clipped in the first case
        assert close(logp.grad, [g0, g0, g1, g1, g1])


# ---------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_values_weight_detached_and_capped():
    logp, prox, behav = logt(PI, grad=True), logt(PROX, grad=True), logt(MU, grad=True)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, t(ADV), clip_low=0.2, clip_high=0.2)
    w = [p / m for p, m in zip(PROX, MU)]  # 1.2, 1, 1.25, 0.7, 1.5
    r = [c / p for c, p in zip(PI, PROX)]  # 1.25, 0.5, 1.2, 1.571.., 1/3
    assert close(loss, [wi * ppo_ref(ri, a, 0.2, 0.2) for wi, ri, a in zip(w, r, ADV)])
    assert close(stats["behav_weight_mean"], sum(w) / 5)
    loss.sum().backward()
    assert behav.grad is None  # behaviour enters only through the detached weight
    expected = [0.0 if clip(ri, 0.8, 1.2) * a < ri * a else -wi * ri * a for wi, ri, a in zip(w, r, ADV)]
    assert close(logp.grad, expected)
    capped, _ = decoupled_ppo_loss(logt(PI), logt(PROX), logt(MU), t(ADV), weight_cap=1.3)
    assert close(capped, [min(wi, 1.3) * ppo_ref(ri, a, 0.2, 0.2) for wi, ri, a in zip(w, r, ADV)])


@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.6)])
def test_decoupled_ppo_equals_ppo_clip_when_prox_is_behaviour(clips):
    lo, hi = clips
    a, b = logt(PI, grad=True), logt(PI, grad=True)
    ref, _ = ppo_clip_loss(a, logt(MU), t(ADV), clip_low=lo, clip_high=hi)
    got, _ = decoupled_ppo_loss(b, logt(MU), logt(MU), t(ADV), clip_low=lo, clip_high=hi, weight_cap=2.0)
    assert torch.equal(got, ref)
    ref.sum().backward()
    got.sum().backward()
    assert torch.equal(a.grad, b.grad)
    # and through the entry point, for every IS variant of the built-in weight
    for variant in ("none", "truncated", "masked"):
        a, b = logt(PI, grad=True), logt(PI, grad=True)
        ref, _ = _loss("ppo_clip", a, logt(MU), t(ADV), ids(SEQ), clip_low=lo, clip_high=hi)
        got, _ = _loss("decoupled_ppo", b, logt(MU), t(ADV), ids(SEQ), prox_logp=logt(MU), clip_low=lo,
                             clip_high=hi, is_variant=variant)
        assert torch.equal(got, ref)
        ref.backward()
        got.backward()
        assert torch.equal(a.grad, b.grad)


# ---------------------------------------------------------------- CISPO


def test_cispo_values_and_gradient():
    logp = logt(PI, grad=True)
    loss, stats = cispo_loss(logp, logt(MU), t(ADV), clip_low=0.2, clip_high=0.2)
    w = [1.2, 0.8, 1.2, 1.1, 0.8]  # clip(1.5, 0.5, 1.5, 1.1, 0.5) to [0.8, 1.2]
    assert close(loss, [-wi * a * math.log(p) for wi, a, p in zip(w, ADV, PI)])
    loss.sum().backward()
    # the weight is stop-gradient: d/dlogp = -w A, on every token (PPO would give 0 on tokens 0 and 4)
    assert close(logp.grad, [-wi * a for wi, a in zip(w, ADV)])
    assert close(stats["clip_frac"], 4 / 5)
    default, _ = cispo_loss(logt(PI), logt(MU), t(ADV))  # no lower bound, upper 1 + 0.28
    assert close(default, [-min(r, 1.28) * a * math.log(p) for r, a, p in zip([1.5, 0.5, 1.5, 1.1, 0.5], ADV, PI)])


# ---------------------------------------------------------------- importance weights


W_TOK = [p / m for p, m in zip(PROX, MU)]  # 1.2, 1.0, 1.25, 0.7, 1.5


@pytest.mark.parametrize(
    "level,variant,expected",
    [
        ("token", "none", W_TOK),
        ("token", "truncated", [1.2, 1.0, 1.25, 0.7, 1.3]),
        ("token", "masked", [1.2, 1.0, 1.25, 0.0, 0.0]),  # 0.7 < 1/1.3 and 1.5 > 1.3 dropped
        ("sequence", "none", [1.2, 1.2, 1.3125, 1.3125, 1.3125]),  # 1.25 * 0.7 * 1.5
        ("sequence", "truncated", [1.2, 1.2, 1.3, 1.3, 1.3]),
        ("sequence", "masked", [1.2, 1.2, 0.0, 0.0, 0.0]),
        ("chunk", "none", [1.2, 1.2, 0.875, 0.875, 1.5]),  # chunk 3: 1.25 * 0.7
        ("chunk", "truncated", [1.2, 1.2, 0.875, 0.875, 1.3]),
        ("chunk", "masked", [1.2, 1.2, 0.875, 0.875, 0.0]),
        ("none", "masked", [1.0] * 5),
    ],
)
def test_importance_weights(level, variant, expected):
    train = logt(PROX, grad=True)
    w, stats = importance_weights(train, logt(MU), level=level, variant=variant, cap=1.3, seq_ids=ids(SEQ),
                                  chunk_ids=ids(CHUNK))
    assert close(w, expected)
    assert not w.requires_grad
    assert close(stats["is_weight_mean"], sum(expected) / 5)
    if variant == "masked" and level != "none":
        assert close(stats["is_masked_frac"], sum(e == 0.0 for e in expected) / 5)
    if variant == "truncated":
        assert close(stats["is_truncated_frac"], sum(e == 1.3 for e in expected) / 5)


def ess_ref(ws: list[float]) -> float:
    return sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws))


def test_effective_sample_size():
    train, behav = logt(PROX), logt(MU)
    _, equal = importance_weights(behav + 0.3, behav, level="token", variant="none")
    assert close(equal["ess"], 1.0)
    _, tok = importance_weights(train, behav, level="token", variant="none")
    assert close(tok["ess"], ess_ref(W_TOK)) and tok["ess"] < 1.0
    _, seq = importance_weights(train, behav, level="sequence", variant="none", seq_ids=ids(SEQ))
    assert close(seq["ess"], ess_ref([1.2, 1.3125]))  # over sequences, the units carrying the weight
    _, chunk = importance_weights(train, behav, level="chunk", variant="masked", cap=1.3, chunk_ids=ids(CHUNK))
    assert close(chunk["ess"], ess_ref([1.2, 0.875, 0.0]))  # masked chunks count as 0
    assert close(effective_sample_size(t([2.0, 2.0, 2.0])), 1.0)
    assert close(effective_sample_size(t([1.0, 3.0])), ess_ref([1.0, 3.0]))
    # huge sequence products (e^800, e^1200) do not overflow the metric: ESS is scale-free
    _, big = importance_weights(behav + 400.0, behav, level="sequence", variant="none", seq_ids=ids(SEQ))
    assert close(big["ess"], ess_ref([math.exp(800.0 - 1200.0), 1.0])) and close(big["ess"], 0.5)


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = logt(PI, grad=True), logt(MU)
    d = [math.log(m / p) for p, m in zip(PI, MU)]  # ref - logp
    assert close(kl_penalty(logp, ref, "k1"), [-x for x in d])
    assert close(kl_penalty(logp, ref, "k2"), [0.5 * x * x for x in d])
    k3 = kl_penalty(logp, ref, "k3")
    assert close(k3, [math.exp(x) - x - 1 for x in d])
    assert bool((k3 >= 0).all())
    k3.sum().backward()
    assert close(logp.grad, [1 - math.exp(x) for x in d])  # d/dlogp (e^d - d - 1) = -e^d + 1
    with pytest.raises(ValueError, match="kl='k4'"):
        kl_penalty(logp, ref, "k4")


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    "mode,kwargs,expected",
    [
        ("token_mean", {}, 15 / 5),
        ("seq_mean_token_mean", {}, (3 / 2 + 12 / 3) / 2),
        ("seq_mean_token_mean", {"num_seqs": 4}, (3 / 2 + 12 / 3) / 4),
        ("seq_mean_token_sum", {}, (3 + 12) / 2),
        ("token_sum_norm", {"norm_constant": 10.0}, 15 / 10),
    ],
)
def test_aggregation(mode, kwargs, expected):
    for seq in (SEQ, [5, 5, 2, 2, 2]):  # ids need not be contiguous
        loss = t([1.0, 2.0, 3.0, 4.0, 5.0]).requires_grad_()
        out = aggregate(loss, ids(seq), mode, **kwargs)
        assert close(out, expected)
    out.backward()
    if mode == "seq_mean_token_mean" and not kwargs:
        assert close(loss.grad, [1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6])  # 1 / (S |y_i|)


# ---------------------------------------------------------------- entry point


def test_policy_loss_ppo_clip_and_stats():
    loss, stats = _loss("ppo_clip", logt(PI), logt(MU), t(ADV), ids(SEQ))
    assert close(loss, (-1.2 - 0.5 + 3.0 + 2.2 + 1.6) / 5)
    assert stats["clip_frac"] == pytest.approx(0.4) and stats["num_tokens"] == 5 and stats["num_seqs"] == 2
    ratios = [p / m for p, m in zip(PI, MU)]
    assert stats["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 5, abs=1e-12)
    assert all(isinstance(v, float) for v in stats.values())


def test_policy_loss_is_without_prox_uses_current_as_train():
    # pi/mu enters once: ratio vs logp.detach() (= 1, gradient d logp) times w = min(pi/mu, cap)
    logp = logt(PI, grad=True)
    loss, stats = _loss("ppo_clip", logp, logt(MU), t(ADV), ids(SEQ), is_level="token",
                              is_variant="truncated", is_cap=1.3)
    w = [min(p / m, 1.3) for p, m in zip(PI, MU)]  # 1.3, 0.5, 1.3, 1.1, 0.5
    assert close(loss, sum(-wi * a for wi, a in zip(w, ADV)) / 5)
    assert close(loss, 0.8)
    loss.backward()
    assert close(logp.grad, [-wi * a / 5 for wi, a in zip(w, ADV)])
    assert stats["ratio_mean"] == 1.0 and stats["ess"] == pytest.approx(ess_ref(w), abs=1e-12)


def test_policy_loss_prox_with_sequence_mis():
    loss, stats = _loss("ppo_clip", logt(PI), logt(MU), t(ADV), ids(SEQ), prox_logp=logt(PROX),
                              is_level="sequence", is_variant="masked", is_cap=1.3,
                              aggregation="seq_mean_token_sum")
    r = [c / p for c, p in zip(PI, PROX)]
    w = [1.2, 1.2, 0.0, 0.0, 0.0]  # sequence 1's product 1.3125 > 1.3: masked out
    per_tok = [wi * ppo_ref(ri, a, 0.2, 0.2) for wi, ri, a in zip(w, r, ADV)]
    assert close(loss, (per_tok[0] + per_tok[1] + 0.0) / 2)
    assert stats["is_masked_frac"] == pytest.approx(0.6)


def test_policy_loss_decoupled_matches_function_and_chunk_level():
    got, _ = _loss("decoupled_ppo", logt(PI), logt(MU), t(ADV), ids(SEQ), prox_logp=logt(PROX),
                         is_variant="truncated", is_cap=1.3)
    per_tok, _ = decoupled_ppo_loss(logt(PI), logt(PROX), logt(MU), t(ADV), weight_cap=1.3)
    assert close(got, per_tok.mean())
    chunk, _ = _loss("decoupled_ppo", logt(PI), logt(MU), t(ADV), ids(SEQ), prox_logp=logt(PROX),
                           is_level="chunk", chunk_ids=ids(CHUNK), aggregation="token_sum_norm", norm_constant=8.0)
    r = [c / p for c, p in zip(PI, PROX)]
    w = [1.2, 1.2, 0.875, 0.875, 1.5]
    assert close(chunk, sum(wi * ppo_ref(ri, a, 0.2, 0.2) for wi, ri, a in zip(w, r, ADV)) / 8.0)


def test_policy_loss_gspo_cispo_defaults_and_kl():
    gspo, stats = _loss("gspo", logt(PI), logt(MU), t(ADV), ids(SEQ), aggregation="seq_mean_token_mean")
    s0, s1 = math.sqrt(0.75), 0.825 ** (1 / 3)
    # GSPO default range [1 - 3e-4, 1 + 4e-4]: sequence 1 (A < 0, s1 < 1 - 3e-4) is clipped, sequence 0 (A > 0) not
    assert close(gspo, (-s0 + -min(s1 * -2, (1 - 3e-4) * -2)) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)
    cispo, _ = _loss("cispo", logt(PI), logt(MU), t(ADV), ids(SEQ))
    ratios = [p / m for p, m in zip(PI, MU)]
    assert close(cispo, sum(-min(r, 1.28) * a * math.log(p) for r, a, p in zip(ratios, ADV, PI)) / 5)
    base, _ = _loss("ppo_clip", logt(PI), logt(MU), t(ADV), ids(SEQ))
    with_kl, stats = _loss("ppo_clip", logt(PI), logt(MU), t(ADV), ids(SEQ), kl="k3", ref_logp=logt(MU),
                                 kl_coef=0.1)
    k3 = [m / p - math.log(m / p) - 1 for p, m in zip(PI, MU)]
    assert close(with_kl, float(base) + 0.1 * sum(k3) / 5)
    assert stats["kl_ref"] == pytest.approx(sum(k3) / 5, abs=1e-12)
    monitor, stats = _loss("ppo_clip", logt(PI), logt(MU), t(ADV), ids(SEQ), kl="k1", ref_logp=logt(MU))
    assert torch.equal(monitor, base) and "kl_ref" in stats


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "ppo"}, r"kind\s+Input should be 'ppo_clip', 'gspo', 'decoupled_ppo' or 'cispo'"),
        ({"is_level": "turn"}, r"is_level\s+Input should be 'none', 'token', 'sequence' or 'chunk'"),
        ({"is_variant": "clipped"}, r"is_variant\s+Input should be 'none', 'truncated' or 'masked'"),
        ({"aggregation": "mean"}, r"aggregation\s+Input should be 'token_mean'"),
        ({"kl": "k4", "ref_logp": "mu"}, r"kl\s+Input should be 'k1', 'k2' or 'k3'"),
        ({"kl": "k3"}, "ref_logp is required"),
        ({"kl_coef": 0.1}, "kl_coef"),
        ({"kind": "decoupled_ppo"}, "prox_logp is required"),
        ({"is_level": "chunk"}, "chunk_ids is required"),
        ({"aggregation": "token_sum_norm"}, "norm_constant"),
        ({"aggregation": "seq_mean_token_mean", "num_seqs": 1}, "num_seqs"),
        ({"is_level": "token", "is_variant": "masked", "is_cap": 0.5}, "cap"),
        ({"advantages": [1.0, 2.0]}, "advantages has 2 tokens"),
        ({"seq_ids": "float"}, "seq_ids must be a 1-D integer tensor"),
    ],
)
def test_policy_loss_errors(kwargs, match):
    args = {"kind": "ppo_clip", "logp": logt(PI), "old_logp": logt(MU), "advantages": t(ADV), "seq_ids": ids(SEQ)}
    for key, value in kwargs.items():
        if value == "mu":
            value = logt(MU)
        elif value == "float":
            value = t([0.0, 0.0, 1.0, 1.0, 1.0])
        elif isinstance(value, list):
            value = t(value)
        args[key] = value
    kind, logp, old, adv, seq = (args.pop(k) for k in ("kind", "logp", "old_logp", "advantages", "seq_ids"))
    with pytest.raises(ValueError, match=match):
        _loss(kind, logp, old, adv, seq, **args)


def test_other_errors():
    empty = torch.zeros(0, dtype=F64)
    with pytest.raises(ValueError, match="logp has no tokens"):
        _loss("ppo_clip", empty, empty, empty, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="level='turn'"):
        importance_weights(logt(PROX), logt(MU), level="turn")
    with pytest.raises(ValueError, match="seq_ids is required"):
        importance_weights(logt(PROX), logt(MU), level="sequence")
    with pytest.raises(ValueError, match="weight_cap"):
        decoupled_ppo_loss(logt(PI), logt(PROX), logt(MU), t(ADV), weight_cap=0.0)
    with pytest.raises(ValueError, match="aggregation='sum'"):
        aggregate(t([1.0]), ids([0]), "sum")
