"""A reward for checking the machinery, not a task: `examples/calculator_tiny.yaml` trains a random tiny model with it.

A random model never solves a calculator problem, so the calculator's verifier scores every rollout 0, every group has
zero variance and no step trains. `even_token_share` (the recipe's) scores the share of sampled token ids that are even:
graded, so a group's rollouts almost never tie and every step takes a gradient, and a policy that learns shows it as a
rising `rollout/reward_mean` (it learns to prefer even tokens). `first_token_parity` scores the first sampled token's
parity alone (0 or 1): its groups tie more often as the policy learns. Neither says anything about arithmetic: held-out
calculator success stays near 0.
"""

from __future__ import annotations

from loomrl.types import Task, Trajectory


def first_token_parity(traj: Trajectory, task: Task) -> dict[str, float]:
    """1 when the first sampled token id is even, else 0 (a trajectory with no sampled token: 0)."""
    first = traj.turns[0].act_span.start if traj.turns and traj.turns[0].act_span else None
    return {"parity": float(first is not None and traj.token_ids[first] % 2 == 0)}


def even_token_share(traj: Trajectory, task: Task) -> dict[str, float]:
    """The share of the sampled tokens whose ids are even (0 with none): graded where `first_token_parity` is 0 or 1.

    Why graded: a group has signal only when its rollouts' rewards differ. With one bit per rollout, a group of 4 ties
    whenever all four bits agree: 1 in 8 at a coin flip, and more as the policy learns to prefer even tokens (0.41 at
    0.8); the smoke recipe's async steps then sometimes trained nothing (a step whose 2 groups both tied). Over a dozen
    sampled tokens the share takes 13 values, and four rollouts tie on it about 1 in 150 at a coin flip, 1 in 30 at
    0.9, so a step of 2 groups trains nothing about once in 1,000 even then. Still learnable: a policy that prefers
    even token ids scores higher."""
    sampled = [t for ctx in traj.contexts() for t, m in zip(ctx.token_ids, ctx.sampled_mask()) if m]
    # the term's name is first_token_parity's: recipes that weigh or gate "parity" keep working
    return {"parity": sum(t % 2 == 0 for t in sampled) / len(sampled) if sampled else 0.0}
