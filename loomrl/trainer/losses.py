"""Policy-gradient losses, group advantages, off-policy importance corrections, KL penalties and loss
aggregation, as pure functions on torch tensors.

What is covered: GRPO / Dr. GRPO / RLOO advantages; per-token PPO-clip (with DAPO's clip-higher),
GSPO, AReaL's decoupled PPO and MiniMax-M1's CISPO; token / sequence / chunk importance weights
(truncated, masked or raw) with their effective sample size; k1/k2/k3 KL estimators; four ways to
reduce a per-token loss to a scalar; and `policy_loss`, one entry point composing them (`compute_loss`: the same
over one micro-batch's typed `LossInputs`).
What is not: value functions / GAE, entropy bonuses, anything that touches a model or a sample.

Conventions. Every per-token tensor is flat, [N] over the sampled tokens of one micro-batch. `seq_ids` [N] (integer)
says which sequence each token belongs to and `chunk_ids` [N] (integer, unique across the micro-batch) which chunk: a
chunk is the span of sampled tokens between two environment interactions, i.e. one turn (ROLL's chunked MDP). Ids need
not be contiguous. Losses return (per-token loss [N], stats) where stats are detached scalar tensors, averaged over the
micro-batch. "Behaviour" logprobs are the engine's at sampling time (mu); "proximal" / "train" logprobs are the
trainer's under a recent policy (e.g. the weights the sample was generated for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

import torch

from loomrl.config import AdvantageKind, Aggregation, ISLevel, ISVariant, KLKind, LossConfig

Tensor = torch.Tensor

# (clip_low, clip_high) per loss when the caller leaves them unset: PPO's 0.2; GSPO's paper values
# (its ratio is a per-token geometric mean, so the range is tiny); CISPO as in MiniMax-M1, no lower
# bound (1 - 1.0 = 0 < any ratio) and a tuned upper one (DAPO's 0.28 here).
DEFAULT_CLIP: dict[str, tuple[float, float]] = {"ppo_clip": (0.2, 0.2), "decoupled_ppo": (0.2, 0.2),
                                                 "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


def _check_choice(name: str, value: object, choices: Any) -> None:
    """`value` is one of the values of the Literal type `choices`."""
    if value not in get_args(choices):
        raise ValueError(f"{name}={value!r} is not one of {', '.join(get_args(choices))}")


# ---------------------------------------------------------------- advantages (one group of rewards)


def _rewards(rewards: list[float] | Tensor) -> Tensor:
    r = rewards if isinstance(rewards, Tensor) else torch.as_tensor(rewards, dtype=torch.float64)
    if not r.is_floating_point():
        r = r.to(torch.float64)
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D list or tensor, got shape {tuple(r.shape)}")
    return r


def grpo_advantages(rewards: list[float] | Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps), population std."""
    r = _rewards(rewards)
    return (r - r.mean()) / (r.std(correction=0) + eps)


def dr_grpo_advantages(rewards: list[float] | Tensor) -> Tensor:
    """Dr. GRPO (Liu et al., 2025): A_i = r_i - mean(r), no std normalisation. Pair it with the
    "token_sum_norm" aggregation (no per-sequence length normalisation) for the paper's loss."""
    r = _rewards(rewards)
    return r - r.mean()


def rloo_advantages(rewards: list[float] | Tensor) -> Tensor:
    """RLOO (Ahmadian et al., 2024): A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean(r)); n >= 2."""
    r = _rewards(rewards)
    n = r.numel()
    if n < 2:
        raise ValueError(f"rewards: rloo needs at least 2 rewards in the group, got {n}")
    return r - (r.sum() - r) / (n - 1)


def compute_advantages(kind: AdvantageKind, rewards: list[float] | Tensor) -> Tensor:
    """Advantages [n] of one group's per-trajectory rewards by `kind` (grpo, dr_grpo, rloo)."""
    _check_choice("kind", kind, AdvantageKind)
    return {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}[kind](rewards)


# ---------------------------------------------------------------- segment helpers


def _segments(ids: Tensor, name: str) -> tuple[Tensor, int]:
    """Dense index [N] in 0..K-1 for arbitrary integer ids, and K (number of distinct ids)."""
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got dtype {ids.dtype} shape {tuple(ids.shape)}")
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return inverse, uniq.numel()


def _segment_sum(x: Tensor, index: Tensor, k: int) -> Tensor:
    return x.new_zeros(k).index_add(0, index, x)  # [K], differentiable in x


def _check_tokens(**tensors: Tensor | None) -> None:
    """All given tensors are 1-D with the same length."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in given:
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D over the sampled tokens, got shape {tuple(t.shape)}")
        first, n = given[0][0], given[0][1].numel()
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} tokens but {first} has {n}")


def _k3(log_ratio: Tensor) -> Tensor:
    """k3 with log_ratio = log(p/q) at x ~ q: (p/q - 1) - log(p/q), an estimate of KL(q || p) >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def _frac(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.dtype).mean() if mask.numel() else like.new_zeros(())


@torch.no_grad()
def _ratio_stats(binds: Tensor, ratio: Tensor, log_ratio: Tensor) -> dict[str, Tensor]:
    """clip_frac (where `binds`), ratio_mean, approx_kl (k3 of the token log ratios), detached."""
    return {"clip_frac": _frac(binds, ratio), "ratio_mean": ratio.mean(), "approx_kl": _k3(log_ratio).mean()}


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                       log_ratio: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), with stats; clip_frac counts where the clipped
    branch binds, i.e. where the gradient is zeroed."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), _ratio_stats(clipped < unclipped, ratio, log_ratio)


# ---------------------------------------------------------------- per-token policy losses


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
                  clip_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al., 2017; asymmetric eps = DAPO's clip-higher):
    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(logp_t - old_logp_t).

    Stats: clip_frac (tokens where the clipped branch binds, i.e. whose gradient is zeroed),
    ratio_mean, approx_kl (k3 estimate of KL(old || current))."""
    _check_tokens(logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = logp - old_logp
    return _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, log_ratio)


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, seq_ids: Tensor, *, clip_low: float = 3e-4,
              clip_high: float = 4e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Qwen, Zheng et al., 2025): sequence-level ratio s_i = exp(mean_{t in i}(logp_t - old_logp_t))
    (geometric mean of token ratios), loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i),
    broadcast to every token of sequence i. A_i is the mean of the sequence's token advantages (they
    are equal under GRPO). The gradient flows through the mean: d s_i / d logp_t = s_i / |y_i|.
    The paper averages over sequences: use the "seq_mean_token_mean" aggregation for that.

    Stats (over sequences, the unit that is clipped): clip_frac, ratio_mean; approx_kl per token."""
    _check_tokens(logp=logp, old_logp=old_logp, advantages=advantages, seq_ids=seq_ids)
    inv, k = _segments(seq_ids, "seq_ids")
    counts = torch.bincount(inv, minlength=k).to(logp.dtype)  # [S]
    log_ratio = logp - old_logp
    seq_ratio = torch.exp(_segment_sum(log_ratio, inv, k) / counts)  # [S]
    seq_adv = _segment_sum(advantages.to(logp.dtype), inv, k) / counts  # [S]
    seq_loss, stats = _clipped_surrogate(seq_ratio, seq_adv, clip_low, clip_high, log_ratio)  # [S]
    return seq_loss[inv], stats


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_low: float = 1.0,
               clip_high: float = 0.28) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t,
    r_t = exp(logp_t - old_logp_t). The clipped IS weight is stop-gradient, so every token keeps a
    gradient -w_t A_t d logp_t (PPO would zero it outside the clip range). The loss value itself is
    not a surrogate objective; only its gradient is meaningful.

    Stats: clip_frac (tokens whose weight was clipped), ratio_mean, approx_kl."""
    _check_tokens(logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = (logp - old_logp).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logp, _ratio_stats(weight != ratio, ratio, log_ratio)


# ---------------------------------------------------------------- off-policy importance weights


def _ess_from_log(log_w: Tensor) -> Tensor:
    """ESS from log weights, scale-free (exp(log_w - max)), so huge sequence products do not overflow."""
    if log_w.numel() == 0 or not torch.isfinite(log_w.max()):
        return log_w.new_zeros(())
    x = torch.exp(log_w - log_w.max())
    return x.sum() ** 2 / (x.numel() * (x * x).sum())


def importance_weights(logp_train: Tensor, logp_behaviour: Tensor, *, level: ISLevel = "token",
                       variant: ISVariant = "truncated", cap: float = 2.0, seq_ids: Tensor | None = None,
                       chunk_ids: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached off-policy weights [N] for the training/inference mismatch or staleness, w = pi_train/mu.

    level: "token" w_t = exp(lp_train_t - lp_behav_t); "sequence" w_i = exp(sum_{t in i} (...)), the
    product of the sequence's token ratios, broadcast to its tokens; "chunk" the same per chunk (one
    turn; ROLL's chunked MDP); "none" all ones.
    variant: "truncated" min(w, cap) (TIS, Yao et al., 2025); "masked" w where 1/cap <= w <= cap, else 0
    (MIS: the unit is dropped from the loss); "none" w as it is.
    Stats: ess (over the units carrying a weight: tokens, sequences or chunks; masked units count as
    0), is_weight_mean (over tokens), is_truncated_frac, is_masked_frac (over tokens)."""
    _check_choice("level", level, ISLevel)
    _check_choice("variant", variant, ISVariant)
    _check_tokens(logp_train=logp_train, logp_behaviour=logp_behaviour, seq_ids=seq_ids, chunk_ids=chunk_ids)
    if not cap > 0 or (variant == "masked" and cap < 1):
        raise ValueError(f"cap must be > 0 (>= 1 for the masked variant), got {cap}")
    log_ratio = (logp_train - logp_behaviour).detach()  # [N]
    zero = log_ratio.new_zeros(())
    if level == "none":
        return torch.ones_like(log_ratio), {"ess": zero + 1.0, "is_weight_mean": zero + 1.0,
                                            "is_truncated_frac": zero, "is_masked_frac": zero}
    if level == "token":
        unit_log, index = log_ratio, None
    else:
        arg, ids = ("seq_ids", seq_ids) if level == "sequence" else ("chunk_ids", chunk_ids)
        if ids is None:
            raise ValueError(f"{arg} is required for level={level!r}")
        index, k = _segments(ids, arg)
        unit_log = _segment_sum(log_ratio, index, k)  # [K] log of the product over the unit
    unit_w = torch.exp(unit_log)
    truncated = masked = torch.zeros_like(unit_w, dtype=torch.bool)
    unit_log_w = unit_log  # log of the final unit weights, for the ESS
    if variant == "truncated":
        truncated = unit_w > cap
        unit_w = torch.clamp(unit_w, max=cap)
        unit_log_w = torch.clamp(unit_log, max=math.log(cap))
    elif variant == "masked":
        masked = (unit_w < 1.0 / cap) | (unit_w > cap)
        unit_w = torch.where(masked, torch.zeros_like(unit_w), unit_w)
        unit_log_w = torch.where(masked, torch.full_like(unit_log, -math.inf), unit_log)
    if index is not None:
        unit_w, truncated, masked = unit_w[index], truncated[index], masked[index]
    return unit_w, {"ess": _ess_from_log(unit_log_w), "is_weight_mean": unit_w.mean() if unit_w.numel() else zero,
                    "is_truncated_frac": _frac(truncated, log_ratio), "is_masked_frac": _frac(masked, log_ratio)}


# ---------------------------------------------------------------- KL to a reference policy


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi (Schulman, "Approximating KL
    divergence", 2020), with d = ref_logp - logp: k1 = -d = logp - ref_logp; k2 = d^2 / 2;
    k3 = exp(d) - d - 1 >= 0 (GRPO's penalty). Differentiable in logp; ref_logp is detached."""
    _check_choice("kl", kind, KLKind)
    _check_tokens(logp=logp, ref_logp=ref_logp)
    d = ref_logp.detach() - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d


# ---------------------------------------------------------------- aggregation


def aggregate(loss: Tensor, seq_ids: Tensor, mode: Aggregation = "token_mean", *, norm_constant: float | None = None,
              num_seqs: int | None = None) -> Tensor:
    """Reduce a per-token loss [N] to a scalar.

    "token_mean": sum_t l_t / N (DAPO: every token weighs the same).
    "seq_mean_token_mean": (1/S) sum_i (1/|y_i|) sum_{t in i} l_t (original GRPO).
    "seq_mean_token_sum": (1/S) sum_i sum_{t in i} l_t.
    "token_sum_norm": sum_t l_t / norm_constant, a fixed constant such as max_tokens x num_seqs
    (Dr. GRPO's unbiased form; with the step's total token count it is the step-level token mean).
    S is the number of distinct seq_ids, or `num_seqs` if given (e.g. the whole step's count, so
    that micro-batch losses add up to the step's mean over sequences)."""
    _check_choice("aggregation", mode, Aggregation)
    _check_tokens(loss=loss, seq_ids=seq_ids)
    if loss.numel() == 0:
        raise ValueError("loss has no tokens to aggregate")
    if mode == "token_mean":
        return loss.sum() / loss.numel()
    if mode == "token_sum_norm":
        if norm_constant is None or not norm_constant > 0:
            raise ValueError(f"norm_constant must be a positive number for aggregation='token_sum_norm', got {norm_constant}")
        return loss.sum() / norm_constant
    inv, k = _segments(seq_ids, "seq_ids")
    if num_seqs is not None and num_seqs < k:
        raise ValueError(f"num_seqs={num_seqs} is less than the {k} sequences present in seq_ids")
    sums = _segment_sum(loss, inv, k)  # [S]
    if mode == "seq_mean_token_mean":
        sums = sums / torch.bincount(inv, minlength=k).to(loss.dtype)
    return sums.sum() / (num_seqs if num_seqs is not None else k)


# ---------------------------------------------------------------- entry point


@dataclass(slots=True, kw_only=True)
class LossInputs:
    """What the policy loss of one micro-batch is computed from, every tensor [N] over its sampled tokens (the module's
    conventions): the trainer's logprobs (with their graph), the engine's (behaviour, mu), the advantages, each token's
    sequence and chunk (turn) ids, the proximal policy's and the reference policy's logprobs where the loss uses them,
    and the number of sequences a sequence-mean aggregation divides by (the whole step's)."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    seq_ids: Tensor
    chunk_ids: Tensor | None = None
    prox_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    num_seqs: int | None = None


def compute_loss(cfg: LossConfig, inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """`policy_loss` over one micro-batch's typed inputs."""
    return policy_loss(cfg, inputs.logp, inputs.old_logp, inputs.advantages, inputs.seq_ids, chunk_ids=inputs.chunk_ids,
                       prox_logp=inputs.prox_logp, ref_logp=inputs.ref_logp, num_seqs=inputs.num_seqs)


def _ratio_base(cfg: LossConfig, logp: Tensor, old_logp: Tensor, prox_logp: Tensor | None, seq_ids: Tensor,
                chunk_ids: Tensor | None) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """What the policy ratio is taken against, and the IS weights [N] (None: no correction) with their stats: see
    `policy_loss`."""
    level = "token" if cfg.kind == "decoupled_ppo" and cfg.is_level == "none" else cfg.is_level
    if level == "none":
        return (prox_logp if prox_logp is not None else old_logp), None, {}
    base = prox_logp.detach() if prox_logp is not None else logp.detach()  # pi_train
    weights, is_stats = importance_weights(base, old_logp, level=level, variant=cfg.is_variant, cap=cfg.is_cap,
                                           seq_ids=seq_ids, chunk_ids=chunk_ids)
    return base, weights, is_stats


def _check_loss_args(cfg: LossConfig, prox_logp: Tensor | None, ref_logp: Tensor | None,
                     chunk_ids: Tensor | None) -> None:
    """The inputs `cfg` needs are given and the loss has tokens to train."""
    if cfg.kl is not None:
        if ref_logp is None:
            raise ValueError(f"ref_logp is required when kl={cfg.kl!r}")
    elif cfg.kl_coef != 0.0:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs kl set to one of {', '.join(get_args(KLKind))}")
    if cfg.kind == "decoupled_ppo" and prox_logp is None:
        raise ValueError("prox_logp is required for kind='decoupled_ppo' (the proximal policy's logprobs)")
    if cfg.is_level == "chunk" and chunk_ids is None:
        raise ValueError("chunk_ids is required for is_level='chunk'")


def policy_loss(cfg: LossConfig, logp: Tensor, old_logp: Tensor, advantages: Tensor, seq_ids: Tensor, *,
                chunk_ids: Tensor | None = None, prox_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                num_seqs: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss of one micro-batch and float stats, as `cfg` (trainer.loss) says. `old_logp` is always the behaviour
    (engine) logprob mu; `prox_logp`, if given, the trainer's logprob under a recent policy (pi_train).

    Composition, so that pi/mu is never counted twice (pi/mu = pi/pi_train * pi_train/mu):
    - the policy ratio (clip / GSPO / CISPO weight) is taken against pi_train = prox_logp if given;
      else, with an IS correction on, against logp.detach() (ratio 1 in value, gradient d logp); else
      against old_logp (plain PPO on the behaviour policy);
    - with is_level != "none" the per-token loss is multiplied by importance_weights(pi_train, mu)
      at that level and variant (TIS/MIS);
    - "decoupled_ppo" needs prox_logp and always carries its weight pi_prox/mu: is_level "none"
      means "token" (AReaL's form) and is_variant="truncated" caps it at is_cap;
    - with `kl` set, kl_coef * kl_penalty(logp, ref_logp, kl) is added to every token (not weighted);
    - the result is reduced by `aggregate(..., aggregation, norm_constant, num_seqs)`.
    clip_low / clip_high default per kind (DEFAULT_CLIP). Stats: clip_frac, ratio_mean (of the
    policy ratio), approx_kl (k3 of KL(mu || pi), always vs behaviour), the IS stats (ess, ...) when a
    correction is on, kl_ref when `kl` is set, num_tokens and num_seqs."""
    kind, kl = cfg.kind, cfg.kl
    _check_loss_args(cfg, prox_logp, ref_logp, chunk_ids)
    _check_tokens(logp=logp, old_logp=old_logp, advantages=advantages, seq_ids=seq_ids, chunk_ids=chunk_ids,
                  prox_logp=prox_logp, ref_logp=ref_logp)
    n_seqs = _segments(seq_ids, "seq_ids")[1]
    if logp.numel() == 0:
        raise ValueError("logp has no tokens: skip empty micro-batches before calling policy_loss")
    default_low, default_high = DEFAULT_CLIP[kind]
    clip = {"clip_low": default_low if cfg.clip_low is None else cfg.clip_low,
            "clip_high": default_high if cfg.clip_high is None else cfg.clip_high}

    base, weights, is_stats = _ratio_base(cfg, logp, old_logp, prox_logp, seq_ids, chunk_ids)
    if kind == "gspo":
        per_token, stats = gspo_loss(logp, base, advantages, seq_ids, **clip)
    else:
        per_token, stats = (cispo_loss if kind == "cispo" else ppo_clip_loss)(logp, base, advantages, **clip)
    if weights is not None:
        per_token = per_token * weights
    stats.update(is_stats)
    if kl is not None and ref_logp is not None:  # ref_logp is checked above: never None with kl set
        kl_t = kl_penalty(logp, ref_logp, kl)
        per_token = per_token + cfg.kl_coef * kl_t
        stats["kl_ref"] = kl_t.detach().mean()
    with torch.no_grad():
        stats["approx_kl"] = _k3(logp - old_logp).mean()
    loss = aggregate(per_token, seq_ids, cfg.aggregation, norm_constant=cfg.norm_constant, num_seqs=num_seqs)
    return loss, {**{name: float(v) for name, v in stats.items()}, "num_tokens": float(logp.numel()),
                  "num_seqs": float(n_seqs)}
