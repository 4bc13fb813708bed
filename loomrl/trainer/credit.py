"""Credit assignment: from a scored group of trajectories to the advantage each turn's sampled tokens carry.

What is covered: the group baseline (`trainer.advantage`: the group's mean, or RLOO's mean of the others), the
division of the centred returns (`trainer.advantage_norm`: GRPO's std, a std with a floor relative to the reward
range, or none), and two ways to spread credit over an episode (`trainer.credit`): `outcome`, one advantage for the
whole episode from its return; `turn`, one per turn from its return-to-go against the other episodes' returns-to-go
at that turn (a leave-one-out baseline, which stays unbiased when the policy decides how many turns to take).
What is not: value functions / GAE (there is no critic), discounting (gamma = 1), the rewards themselves
(loomrl/reward/; Trajectory.turn_rewards places them on turns), laying advantages on tokens (grpo.py).

The estimators, their assumptions and their variance: docs/training.md, "Advantages and per-turn credit".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomrl.config import OWN_NORM, AdvantageKind, AdvantageNorm, CreditKind, TrainerConfig
from loomrl.trainer.losses import dr_grpo_advantages, rloo_advantages
from loomrl.types import Trajectory

# GRPO's: std + EPS, so that a group whose returns are all equal divides 0 by EPS, not by 0
EPS = 1e-6


@dataclass(slots=True, frozen=True, kw_only=True)
class AdvantageRule:
    """trainer.advantage, advantage_norm (resolved: never unset), the floor in reward units, and credit."""

    kind: AdvantageKind = "grpo"
    norm: AdvantageNorm = "std"
    floor: float = 0.0  # std_floor: the least a group's scale may be (trainer.std_floor x trainer.reward_range)
    credit: CreditKind = "outcome"

    @classmethod
    def of(cls, cfg: TrainerConfig) -> AdvantageRule:
        return cls(kind=cfg.advantage, norm=cfg.advantage_norm or OWN_NORM[cfg.advantage],
                   floor=cfg.std_floor * cfg.reward_range, credit=cfg.credit)


@dataclass(slots=True, kw_only=True)
class GroupCredit:
    """One group's advantages, per trajectory and per turn (Trajectory.all_turns order), and how they were scaled."""

    turns: list[list[float]]  # [trajectory][turn] the advantage that turn's sampled tokens carry
    scale: float  # what the centred returns were divided by (1.0: not divided)
    floored: bool  # std_floor: the group's std was under the floor, which set the scale
    fallback_turns: int = 0  # credit=turn: turns no other trajectory reached (their baseline: the others' returns)


def group_scale(returns: list[float], norm: AdvantageNorm, floor: float = 0.0) -> tuple[float, bool]:
    """What a group's centred returns are divided by, and whether the floor set it. std: the population std + EPS
    (GRPO's); std_floor: the same, but at least `floor`; none: 1."""
    if norm == "none":
        return 1.0, False
    if norm not in ("std", "std_floor"):
        raise ValueError(f"trainer.advantage_norm={norm!r} is not one of std, std_floor, none")
    std = float(torch.as_tensor(returns, dtype=torch.float64).std(correction=0)) + EPS
    if norm == "std_floor" and floor > std:
        return floor, True
    return std, False


def returns_to_go(rewards: list[float]) -> list[float]:
    """G_t = sum over t' >= t of r_t' (undiscounted): what turn t's action could still change."""
    out, acc = [], 0.0
    for r in reversed(rewards):
        acc += r
        out.append(acc)
    return out[::-1]


def turn_baselines(returns: list[list[float]], episode: list[float]) -> tuple[list[list[float]], int]:
    """b[i][t]: the mean of G[j][t] over the other trajectories j that reached turn t; where none did, the mean of
    the others' episode returns. Trajectory i's own returns never enter its baseline: that keeps the estimator
    unbiased (docs/training.md). Also the number of turns that fell back."""
    n = len(returns)
    if n < 2:
        raise ValueError(f"trainer.credit=turn needs at least 2 trajectories in a group (a baseline from the others), "
                         f"got {n}")
    out, fallback = [], 0
    for i, own in enumerate(returns):
        others = [g for j, g in enumerate(returns) if j != i]
        rest = sum(e for j, e in enumerate(episode) if j != i) / (n - 1)
        row = []
        for t in range(len(own)):
            reached = [g[t] for g in others if len(g) > t]
            fallback += not reached
            row.append(sum(reached) / len(reached) if reached else rest)
        out.append(row)
    return out, fallback


def group_credit(group: list[Trajectory], rule: AdvantageRule) -> GroupCredit:
    """The advantages of one group's trajectories, per turn, by `rule`.

    Outcome credit: A_i = (R_i - b_i) / s on every turn of trajectory i, R_i its return (total_reward), b_i the
    group's mean (grpo, dr_grpo) or the others' mean (rloo), s the group_scale of the R_i.
    Turn credit: A_it = (G_it - b_it) / s, G_it the return-to-go of its turn t, b_it from turn_baselines, s the
    group_scale of every turn's G_it pooled (with the rewards all at the last turn and as many turns each, the
    std of the R_i again). Not of the R_i alone: episodes with equal returns may differ turn by turn, and the
    std of their returns (0) would blow those differences up."""
    episode = [float(t.total_reward) for t in group]
    if rule.credit == "outcome":
        scale, floored = group_scale(episode, rule.norm, rule.floor)
        centred = (rloo_advantages if rule.kind == "rloo" else dr_grpo_advantages)(episode)
        advantages = [float(a) for a in centred / scale]
        return GroupCredit(turns=[[a] * len(t.all_turns()) for t, a in zip(group, advantages)], scale=scale,
                           floored=floored)
    if rule.credit != "turn":
        raise ValueError(f"trainer.credit={rule.credit!r} is not one of outcome, turn")
    returns = [returns_to_go(t.turn_rewards()) for t in group]
    baselines, fallback = turn_baselines(returns, episode)
    scale, floored = group_scale([g for gs in returns for g in gs] or episode, rule.norm, rule.floor)
    turns = [[(g - b) / scale for g, b in zip(gs, bs)] for gs, bs in zip(returns, baselines)]
    return GroupCredit(turns=turns, scale=scale, floored=floored, fallback_turns=fallback)
