"""Reference implementations the trainer's tests compare against: the textbook form of what the package
computes another way (decoupled PPO as its own loss, the ESS from the weights, the LM head through full logits)."""

from __future__ import annotations

import torch
from torch import Tensor

from loomrl.trainer.losses import _check_tokens, _ess_from_log, ppo_clip_loss


def decoupled_ppo_loss(logp: Tensor, prox_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, *,
                       clip_low: float = 0.2, clip_high: float = 0.2,
                       weight_cap: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, Fu et al., 2025): the behaviour policy mu (engine, sampling time) is
    decoupled from the proximal policy pi_prox that anchors the trust region.
    loss_t = -w_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = pi/pi_prox,
    w_t = sg(pi_prox/mu), truncated to min(w_t, weight_cap) if a cap is given. With pi_prox == mu,
    w_t = 1 exactly and this is ppo_clip_loss exactly (values and gradients).

    Stats: those of ppo_clip_loss against pi_prox, plus behav_weight_mean."""
    _check_tokens(logp=logp, prox_logp=prox_logp, behaviour_logp=behaviour_logp, advantages=advantages)
    if weight_cap is not None and not weight_cap > 0:
        raise ValueError(f"weight_cap must be > 0 or None, got {weight_cap}")
    weight = torch.exp((prox_logp - behaviour_logp).detach())
    if weight_cap is not None:
        weight = torch.clamp(weight, max=weight_cap)
    loss, stats = ppo_clip_loss(logp, prox_logp, advantages, clip_low=clip_low, clip_high=clip_high)
    stats["behav_weight_mean"] = weight.mean()
    return loss * weight, stats


def effective_sample_size(weights: Tensor) -> Tensor:
    """Normalised ESS = (sum w)^2 / (n sum w^2) in (0, 1] (1 iff all weights are equal; 0 if all are 0)."""
    return _ess_from_log(torch.log(weights.detach()))


def dense_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperatures: Tensor | None = None, *,
                   bias: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """log_softmax(head(hidden) / temperature)[target] through the full [N, V] logits, one target per row."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperatures is not None:
        t = temperatures.to(device=hidden.device, dtype=torch.float32)
        z = z / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)
