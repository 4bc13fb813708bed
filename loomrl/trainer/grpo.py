"""From a scored group of trajectories to training samples: one per context of each trajectory,
carrying the trajectory's group advantage (estimator from loomrl/trainer/losses.py: GRPO, Dr. GRPO,
RLOO) on its sampled tokens. The losses themselves live in losses.py.
"""

from __future__ import annotations

from loomrl.trainer.losses import compute_advantages
from loomrl.types import TrainingSample, Trajectory


def group_advantages(rewards: list[float], kind: str = "grpo") -> list[float]:
    return [float(a) for a in compute_advantages(kind, [float(r) for r in rewards])]


def samples_from_group(group: list[Trajectory], advantage: str = "grpo") -> list[TrainingSample]:
    """One TrainingSample per context of each trajectory (usually one; more when its context was
    started anew), all with the trajectory's group advantage on their sampled tokens."""
    advantages = group_advantages([t.total_reward for t in group], advantage)
    samples = []
    for traj, adv in zip(group, advantages):
        for ctx in traj.contexts():
            mask = ctx.sampled_mask()
            samples.append(TrainingSample(
                trajectory_id=traj.trajectory_id, group_id=traj.group_id, token_ids=list(ctx.token_ids), loss_mask=mask,
                behaviour_logprobs=ctx.token_logprobs(), versions=ctx.token_versions(),
                advantages=[adv * m for m in mask], temperature=traj.temperature, reward=traj.total_reward))
    return samples
