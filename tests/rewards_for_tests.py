"""Reward functions for end-to-end tests on a random tiny model (which never solves a task, so the
calculator reward would be 0 everywhere and GRPO would have no signal to train on): the smoke recipe's parity
reward, and one whose process dies."""

from __future__ import annotations

from loomrl.reward.smoke import first_token_parity as parity_reward  # the smoke recipe's reward
from loomrl.types import Task, Trajectory

_calls = 0


def reward_that_kills_its_process(traj: Trajectory, task: Task) -> dict[str, float]:
    """parity_reward, except that the 6th call in a process ends that process (a reward worker that
    dies, e.g. from a verifier's segfault or the OOM killer)."""
    global _calls
    _calls += 1
    if _calls == 6:
        import os

        os._exit(1)
    return parity_reward(traj, task)
