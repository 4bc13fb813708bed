"""Reward functions for end-to-end tests on a random tiny model (which never solves a task, so the
calculator reward would be 0 everywhere and GRPO would have no signal to train on): the smoke recipe's parity
reward, and one that kills its reward actor."""

from __future__ import annotations

from loomrl.reward.smoke import first_token_parity as parity_reward  # the smoke recipe's reward
from loomrl.types import Task, Trajectory

_calls = 0


def reward_that_kills_its_actor(traj: Trajectory, task: Task) -> dict[str, float]:
    """parity_reward, except that the 6th call in a reward worker process kills the process that runs its reward pool
    (its parent: on Ray, the reward actor), as the OOM killer or a lost node would. (A reward function that kills its
    own process fails only its trajectory: tests/reward/test_reward_workers.py.)"""
    global _calls
    _calls += 1
    if _calls == 6:
        import os
        import signal

        os.kill(os.getppid(), signal.SIGKILL)
    return parity_reward(traj, task)


def reward_with_a_typo(traj: Trajectory, task: Task) -> dict[str, float]:
    """A user's reward with a bug that fails every call (an attribute the task does not have)."""
    return {"correct": float(traj.final_answer == task.expected)}  # type: ignore[attr-defined]
