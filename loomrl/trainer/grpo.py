"""From a scored group of trajectories to training samples: one per context of each trajectory, each turn's
sampled tokens carrying that turn's advantage (credit.py: the whole episode's under outcome credit, the turn's own
under turn credit). The losses themselves live in losses.py.
"""

from __future__ import annotations

from loomrl.config import AdvantageKind
from loomrl.trainer.credit import AdvantageRule, GroupCredit, group_credit
from loomrl.trainer.losses import compute_advantages
from loomrl.turn_experts import context_experts
from loomrl.types import TrainingSample, Trajectory


def group_advantages(rewards: list[float], kind: AdvantageKind = "grpo") -> list[float]:
    return [float(a) for a in compute_advantages(kind, [float(r) for r in rewards])]


def samples_from_credit(group: list[Trajectory], credit: GroupCredit) -> list[TrainingSample]:
    """One TrainingSample per context of each trajectory (usually one; more when its context was started anew), each
    turn's act_span carrying credit.turns' value for it; prompt and observation tokens carry 0; with the engine's
    routed experts of the context's tokens where its turns recorded them (router replay)."""
    if len(credit.turns) != len(group):
        raise ValueError(f"credit has advantages for {len(credit.turns)} trajectories, the group has {len(group)}")
    samples = []
    for traj, per_turn in zip(group, credit.turns):
        if len(per_turn) != len(traj.all_turns()):
            raise ValueError(f"credit has {len(per_turn)} turn advantages for trajectory {traj.trajectory_id}, "
                             f"which has {len(traj.all_turns())} turns")
        values = iter(per_turn)  # all_turns() is the contexts' turns in order
        for ctx in traj.contexts():
            advantages = [0.0] * len(ctx.token_ids)
            for turn in ctx.turns:
                adv = next(values)
                if turn.act_span is not None:
                    span = turn.act_span
                    advantages[span.start : span.end] = [adv] * (span.end - span.start)
            samples.append(TrainingSample(
                trajectory_id=traj.trajectory_id, group_id=traj.group_id, token_ids=list(ctx.token_ids),
                loss_mask=ctx.sampled_mask(), behaviour_logprobs=ctx.token_logprobs(), versions=ctx.token_versions(),
                advantages=advantages, temperature=traj.temperature, reward=traj.total_reward,
                routed_experts=context_experts(ctx.turns, len(ctx.token_ids))))
    return samples


GRPO = AdvantageRule()  # the default: GRPO's group-normalised advantage of the episode's return on every turn


def samples_from_group(group: list[Trajectory], rule: AdvantageRule = GRPO) -> list[TrainingSample]:
    """samples_from_credit of the group's credit under `rule` (default: GRPO, outcome credit)."""
    return samples_from_credit(group, group_credit(group, rule))
