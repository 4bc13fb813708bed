"""GRPO pieces: group-normalised advantages and the token-level clipped policy loss.

Advantage of trajectory i in its group: (r_i - mean(r)) / (std(r) + eps), the same for every sampled
token of the trajectory. Loss per sampled token t, with ratio = exp(logp_t - behaviour_logp_t):
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
averaged over all sampled tokens of the step (token-level mean, as DAPO; long and short answers weigh
per token).
"""

from __future__ import annotations

import math

import torch

from loomrl.types import TrainingSample, Trajectory


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def samples_from_group(group: list[Trajectory]) -> list[TrainingSample]:
    """One TrainingSample per context of each trajectory (usually one; more when its context was
    started anew), all with the trajectory's group advantage on their sampled tokens."""
    advantages = group_advantages([t.total_reward for t in group])
    samples = []
    for traj, adv in zip(group, advantages):
        for ctx in traj.contexts():
            mask = ctx.sampled_mask()
            samples.append(
                TrainingSample(
                    trajectory_id=traj.trajectory_id,
                    group_id=traj.group_id,
                    token_ids=list(ctx.token_ids),
                    loss_mask=mask,
                    behaviour_logprobs=ctx.token_logprobs(),
                    versions=ctx.token_versions(),
                    advantages=[adv * m for m in mask],
                    temperature=traj.temperature,
                    reward=traj.total_reward,
                )
            )
    return samples


def clipped_policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_eps: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (not reduced) and diagnostics; all inputs are [N] over sampled tokens."""
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "clip_frac": ((ratio - 1.0).abs() > clip_eps).float().sum(),
            "ratio": ratio.sum(),
            "approx_kl": ((ratio - 1.0) - log_ratio).sum(),  # k3 estimator of KL(behaviour || current)
        }
    return loss, stats
