"""Reward functions for end-to-end tests on a random tiny model (which never solves a task, so the
calculator reward would be 0 everywhere and GRPO would have no signal to train on)."""

from __future__ import annotations

from loomrl.types import Task, Trajectory


def parity_reward(traj: Trajectory, task: Task) -> dict[str, float]:
    """1 when the first sampled token id is even: ~half of a random model's samples, so groups vary."""
    first = traj.turns[0].act_span.start if traj.turns and traj.turns[0].act_span else None
    return {"parity": float(first is not None and traj.token_ids[first] % 2 == 0)}
