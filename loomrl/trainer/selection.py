"""What one training step consumes of the groups it takes from the buffer: the samples of the groups with signal (the
buffer's filters, the advantage rule, the balance filter), why the others are skipped, the idle groups' counts that the
loss's denominators include, the lag decay of samples from older policies, and the consumption metrics. Pure functions
of their inputs (TrainerService.run_step composes them).

What it is not: the buffer (buffer/), the advantages' math (credit.py, grpo.py) or the optimizer step (trainer.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from loomrl.buffer import usable_group
from loomrl.buffer.filters import balance_samples
from loomrl.config import BufferConfig
from loomrl.trainer.credit import AdvantageRule, GroupCredit, group_credit
from loomrl.trainer.grpo import samples_from_credit, samples_from_group
from loomrl.types import TrainingSample, Trajectory


@dataclass(slots=True, kw_only=True)
class Selection:
    """What a step's groups give the trainer: the samples of the groups with signal and their trajectories (ids and
    records), the credit of each such group, the trajectories left out by reason, the groups skipped by reason, and
    the idle (zero-variance) groups' sampled tokens, sequences and longest sequence, which count in the loss's
    denominators (Trainer.train_step)."""

    samples: list[TrainingSample] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    credits: list[GroupCredit] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    why_skipped: Counter[str] = field(default_factory=Counter)
    idle_tokens: int = 0
    idle_seqs: int = 0
    idle_longest: int = 0


def _select_group(chosen: Selection, group: list[Trajectory], buffer: BufferConfig, count_idle: bool,
                  rule: AdvantageRule) -> None:
    """Add one group to `chosen`: its usable trajectories' samples, or the reason it is skipped."""
    usable, left_out, reason = usable_group(group, buffer, rule.credit)
    for why, ids in left_out.items():
        chosen.skipped.setdefault(why, []).extend(ids)
    out = {i for ids in left_out.values() for i in ids}
    if reason:
        chosen.why_skipped[reason] += 1
        if reason == "zero_variance" and count_idle:  # no gradient, but part of the mean
            idle = samples_from_group([t for t in group if t.trajectory_id not in out and any(t.all_turns())], rule)
            chosen.idle_tokens += sum(sum(s.loss_mask) for s in idle)
            chosen.idle_seqs += len(idle)
            chosen.idle_longest = max([chosen.idle_longest, *(sum(s.loss_mask) for s in idle)])
        chosen.skipped.setdefault(reason, []).extend(t.trajectory_id for t in group if t.trajectory_id not in out)
        return
    chosen.credits.append(group_credit(usable, rule))
    chosen.samples.extend(samples_from_credit(usable, chosen.credits[-1]))
    chosen.trained.extend(t.trajectory_id for t in usable)
    chosen.trajectories.extend(usable)
    accounted = {t.trajectory_id for t in usable} | out
    unaccounted = [t.trajectory_id for t in group if t.trajectory_id not in accounted]
    if unaccounted:  # no turn at all
        chosen.skipped.setdefault("incomplete", []).extend(unaccounted)


def select_groups(groups: list[list[Trajectory]], buffer: BufferConfig, count_idle: bool,
                  rule: AdvantageRule) -> Selection:
    """What a step trains on of `groups`, under the buffer's filters and the advantage rule; `count_idle`
    (trainer.count_idle_groups): the zero-variance groups' tokens count in the loss's denominators."""
    chosen = Selection()
    for group in groups:
        _select_group(chosen, group, buffer, count_idle, rule)
    return chosen


def balance(chosen: Selection, max_ratio: float, *, seed: int) -> None:
    """buffer.balance_max_ratio: `chosen` with its samples balanced (buffer/filters.py), those left out recorded as
    skipped for "balance" and no longer trained."""
    before = {s.trajectory_id for s in chosen.samples}
    chosen.samples, _ = balance_samples(chosen.samples, max_ratio, seed=seed)
    after = {s.trajectory_id for s in chosen.samples}
    if before - after:
        chosen.skipped.setdefault("balance", []).extend(sorted(before - after))
        chosen.trained = [t for t in chosen.trained if t in after]


def lag_weighted(samples: list[TrainingSample], version: int, decay: float) -> tuple[list[TrainingSample], int]:
    """buffer.lag_decay: `samples` with those sampled by older policies down-weighted, advantages x exp(-decay x lag)
    (lag = `version` - the sample's oldest token version), as new samples (the others as they are); and how many were
    down-weighted."""
    out, weighted = [], 0
    for sample in samples:
        lag = max(version - sample.min_version, 0) if sample.min_version >= 0 else 0
        if decay > 0 and lag:
            w = math.exp(-decay * lag)
            out.append(replace(sample, advantages=[a * w for a in sample.advantages]))
            weighted += 1
        else:
            out.append(sample)
    return out, weighted


def consumption_metrics(groups: list[list[Trajectory]], stale: list[list[Trajectory]], depth: int,
                        why_skipped: Counter[str], waits: list[float], staleness: list[int]) -> dict[str, float]:
    """What a step consumed: its groups, those dropped as stale or skipped (by reason), the buffer's depth when the step
    began (backpressure), how long the groups waited there, and the histogram of their lag (`staleness`)."""
    metrics: dict[str, float] = {"groups": len(groups), "groups_stale": len(stale),
                                 "groups_skipped": sum(why_skipped.values()),
                                 "buffer/depth": depth,  # backpressure: groups waiting when the step began
                                 **{f"groups_skipped/{k}": v for k, v in why_skipped.items()}}
    if waits:
        metrics["buffer/wait_s_mean"] = sum(waits) / len(waits)
        metrics["buffer/wait_s_max"] = max(waits)
    for lag, count in sorted(Counter(staleness).items()):
        metrics[f"staleness/lag_{lag}"] = count  # histogram of the consumed groups' lag
    return metrics
