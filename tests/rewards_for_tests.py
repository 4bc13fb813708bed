"""Reward functions for end-to-end tests on a random tiny model (which never solves a task, so the
calculator reward would be 0 everywhere and GRPO would have no signal to train on)."""

from __future__ import annotations

from loomrl.types import Task, Trajectory


def parity_reward(traj: Trajectory, task: Task) -> dict[str, float]:
    """1 when the first sampled token id is even: ~half of a random model's samples, so groups vary."""
    first = traj.turns[0].act_span.start if traj.turns and traj.turns[0].act_span else None
    return {"parity": float(first is not None and traj.token_ids[first] % 2 == 0)}


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
