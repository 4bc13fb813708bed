"""Filters applied to a group before it becomes training samples.

- completeness: trajectories that ended in `env_error` or `timeout` are not the policy's doing; they
  are left out of the advantage computation (they stay in the trajectory store for diagnosis).
- zero variance: a group whose rewards are all equal has zero GRPO advantage everywhere; training on it
  costs a full forward/backward for no gradient, so it is skipped.
"""

from __future__ import annotations

from loomrl.types import RolloutStatus, Trajectory

_NOT_POLICY_FAULT = (RolloutStatus.ENV_ERROR, RolloutStatus.TIMEOUT, RolloutStatus.ABORTED)


def usable_group(group: list[Trajectory]) -> tuple[list[Trajectory], str | None]:
    """The trainable part of a group, or ([], reason) when nothing in it can be trained."""
    complete = [t for t in group if t.status not in _NOT_POLICY_FAULT and any(t.turns)]
    if len(complete) < 2:
        return [], "incomplete"
    rewards = {round(t.total_reward, 9) for t in complete}
    if len(rewards) == 1:
        return [], "zero_variance"
    return complete, None
