"""A reward for checking the machinery, not a task: `examples/calculator_tiny.yaml` trains a random tiny model with it.

A random model never solves a calculator problem, so the calculator's verifier scores every rollout 0, every group has
zero variance and no step trains. `first_token_parity` scores 1 when the first sampled token id is even: about half of
a random model's samples, so every group has signal, every step takes a gradient, and a policy that learns shows it as
a rising `rollout/reward_mean` (it learns to prefer even first tokens). It says nothing about arithmetic: held-out
calculator success stays near 0.
"""

from __future__ import annotations

from loomrl.types import Task, Trajectory


def first_token_parity(traj: Trajectory, task: Task) -> dict[str, float]:
    """1 when the first sampled token id is even, else 0 (a trajectory with no sampled token: 0)."""
    first = traj.turns[0].act_span.start if traj.turns and traj.turns[0].act_span else None
    return {"parity": float(first is not None and traj.token_ids[first] % 2 == 0)}
