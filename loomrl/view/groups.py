"""Group cards: a step's groups side by side, each member with its reward, terms, advantage, status and fate.

A member the trainer trained has the advantages it was trained with in RUN/train_records.jsonl (trainer/records.py:
per turn, after credit assignment and lag decay): the card shows those, `advantage_source` "as trained (step N)"; the
member's `advantage` is its first trained turn's (all of them under outcome credit), `advantages` every turn's.
Members without a record (skipped or stale ones, pending ones, runs from before records were written, evaluation
episodes) get the outcome advantage computed the way GRPO does (trainer/credit.py with advantage=grpo,
advantage_norm=std, credit=outcome): over the group's scored members, (r - mean) / (population std + 1e-6); members
that were not scored get none. The source says which (per member and per card). A run trained with another rule (rloo,
std_floor, turn credit) differs from the computed number; the card then names the run's rule next to it.
What it is not: the trainer's per-token values (the trajectory view lays the record's per-turn ones on the tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from loomrl.view.run_folder import Fate
from loomrl.view.store_index import IndexRow

EPS = 1e-6  # trainer/credit.py EPS: std + EPS, so a group whose rewards are all equal has advantages 0
ADVANTAGE_SOURCE = "computed as GRPO does: (r - group mean) / (group std + 1e-6) over the scored members; not recorded"


def trained_source(step: int) -> str:
    return f"as trained (step {step})"


def recorded_advantage(record: dict[str, Any]) -> float | None:
    """A train record's advantage of its first trained turn (every turn's under outcome credit)."""
    return next((a for a in record.get("advantages", []) if a is not None), None)


@dataclass(slots=True, kw_only=True)
class Member:
    trajectory_id: str
    task_id: str
    split: str
    status: str  # how it ended: a RolloutStatus, or reward_failed (store_index.IndexRow.ending)
    reward: float | None
    terms: dict[str, float]  # its reward terms (a failed reward has none: its marker is its status)
    advantage: float | None
    advantage_source: str  # trained (a train record's) | computed (GRPO's, see the module docstring) | "" (none)
    advantages: list[float | None] | None  # per turn, as trained (None: no record)
    versions: tuple[int, int]
    n_turns: int
    total_tokens: int
    error: str | None
    fate: str  # trained | skipped | stale | pending (not in the ledger yet, or never given to the trainer)
    fate_step: int | None
    fate_reason: str


@dataclass(slots=True, kw_only=True)
class GroupCard:
    group_id: str
    task_id: str
    position: int
    step: int | None  # the step whose ledger line names its members (None: pending)
    members: list[Member] = field(default_factory=list)
    advantage_source: str = ADVANTAGE_SOURCE
    reward_mean: float | None = None


def advantages(rewards: list[float | None]) -> list[float | None]:
    """GRPO's outcome advantage of each scored reward within its group; None for the unscored."""
    scored = [r for r in rewards if r is not None]
    if not scored:
        return [None] * len(rewards)
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    return [None if r is None else (r - mean) / (std + EPS) for r in rewards]


def advantage_rule(config: dict[str, Any]) -> str:
    """The run's own advantage rule, from its config.yaml, for the card's note."""
    trainer = config.get("trainer") or {}
    return (f"advantage={trainer.get('advantage', 'grpo')}, advantage_norm={trainer.get('advantage_norm') or 'own'}, "
            f"credit={trainer.get('credit', 'outcome')}")


def group_cards(rows: list[IndexRow], fates: dict[str, Fate],
                records: dict[str, dict[str, Any]] | None = None) -> list[GroupCard]:
    """The rows' groups in store order, each with its members; `records`: the run's train records by trajectory."""
    records = records or {}
    by_group: dict[str, list[IndexRow]] = {}
    for row in rows:
        by_group.setdefault(row.group_id, []).append(row)
    cards = []
    for gid, members in by_group.items():
        advs = advantages([m.total_reward for m in members])
        steps = {fates[m.trajectory_id].step for m in members if m.trajectory_id in fates}
        card = GroupCard(group_id=gid, task_id=members[0].task_id, position=members[0].position,
                         step=min(steps) if steps else None)
        trained_steps = set()
        for m, adv in zip(members, advs):
            fate = fates.get(m.trajectory_id)
            record = records.get(m.trajectory_id)
            if record is not None:
                adv = recorded_advantage(record)
                trained_steps.add(record["step"])
            card.members.append(Member(
                trajectory_id=m.trajectory_id, task_id=m.task_id, split=m.split, status=m.ending, reward=m.total_reward,
                terms=m.terms, advantage=adv,
                advantage_source="trained" if record is not None else "computed" if adv is not None else "",
                advantages=record["advantages"] if record is not None else None,
                versions=(m.policy_version_min, m.policy_version_max), n_turns=m.n_turns, total_tokens=m.total_tokens,
                error=m.error, fate=fate.fate if fate else "pending", fate_step=fate.step if fate else None,
                fate_reason=fate.reason if fate else ""))
        scored = [m.total_reward for m in members if m.total_reward is not None]
        card.reward_mean = sum(scored) / len(scored) if scored else None
        if trained_steps:
            trained = trained_source(min(trained_steps))
            computed = [x for x in card.members if x.advantage_source == "computed"]
            card.advantage_source = trained if not computed else f"{trained} where recorded; others {ADVANTAGE_SOURCE}"
        cards.append(card)
    return cards


@dataclass(slots=True, kw_only=True)
class GroupFilter:
    """The trajectory viewer's filters; a group is kept when any member passes them all."""

    step: int | None = None  # the ledger step that consumed the group; -1: not consumed (pending)
    status: str | None = None  # how it ended: a RolloutStatus or reward_failed
    task: str | None = None  # a substring of the task id
    min_reward: float | None = None
    max_reward: float | None = None

    def keeps(self, row: IndexRow, fate: Fate | None) -> bool:
        if self.step is not None and (fate.step if fate else -1) != self.step:
            return False
        if self.status and row.ending != self.status:
            return False
        if self.task and self.task not in row.task_id:
            return False
        r = row.total_reward
        if self.min_reward is not None and (r is None or r < self.min_reward):
            return False
        return not (self.max_reward is not None and (r is None or r > self.max_reward))


def filtered_groups(rows: list[IndexRow], fates: dict[str, Fate], flt: GroupFilter,
                    records: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The groups with a member passing `flt`, whole (a group is only read with all of its members)."""
    keep = {r.group_id for r in rows if flt.keeps(r, fates.get(r.trajectory_id))}
    return [asdict(c) for c in group_cards([r for r in rows if r.group_id in keep], fates, records)]
