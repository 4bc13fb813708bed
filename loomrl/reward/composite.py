"""A reward made of named terms, each with a weight and an optional gate (reward.terms; docs/training.md, "Reward
terms"). The total is what the advantage sees; every term is stored raw on the trajectory (reward_components) and
logged on its own (reward/<name>).

A term is a component of the reward by its name: one the environment's reward, a reward function or the judge gave
(`correct`, `format`, `judge`, a TRL function's name), or a built-in one, computed only when reward.terms names it:
- the process terms (reward/process.py): per turn, 1 where the turn offends; their raw component is the episode's
  count, and each offending turn carries weight x 1 in Turn.reward_terms, so that per-turn credit places the penalty
  at the turn that earned it (Trajectory.turn_rewards);
- completion_time: the episode's wall time (tool time included) against its group's, (mean - own) / mean clipped to
  [-1, 1], positive for a faster episode; the mean is over the group's scored episodes whose gate is open, so that
  e.g. with `gate: correct` right answers race right answers. Set when the group is complete (score_group).

A gate names a component and a condition: `correct` (open when correct > 0), `not correct`, `correct >= 0.5`. A
closed gate leaves the term out of the total (it is still stored and logged). A gate on a component the trajectory
does not have (no opinion, or a misspelt name) is closed, and said once in the log with the components there were.
Components reward.terms does not name count with weight 1. A reward function's own weight (reward.functions[i].weight)
multiplies in as well.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from loomrl.config.terms import PROCESS_TERMS, Gate
from loomrl.reward.process import CHECKS
from loomrl.types import Trajectory

log = logging.getLogger(__name__)

GROUP_TERMS = ("completion_time",)
BUILTIN_TERMS = (*PROCESS_TERMS, *GROUP_TERMS)

class TermSpec(Protocol):
    """One of reward.terms as Composite.from_config reads it (config.TermConfig meets it)."""

    @property
    def weight(self) -> float: ...

    @property
    def gate(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Term:
    name: str
    weight: float = 1.0
    gate: Gate | None = None


class Composite:
    """Applies reward.terms: weights, gates, the built-in terms. One per reward pool (and one per rollout worker for
    the group terms); it keeps no state but which missing gate components it has already warned of."""

    def __init__(self, terms: Mapping[str, Term] | None = None):
        self.terms = dict(terms or {})
        self._warned: set[tuple[str, str]] = set()

    @classmethod
    def from_config(cls, terms: Mapping[str, TermSpec]) -> Composite:
        """From reward.terms (config.TermConfig: weight, gate), already validated."""
        return cls({name: Term(name, t.weight, Gate.parse(t.gate) if t.gate else None) for name, t in terms.items()})

    def _factor(self, name: str, components: Mapping[str, float]) -> float:
        """The term's weight, or 0 where its gate is closed."""
        term = self.terms.get(name)
        if term is None:
            return 1.0
        if term.gate is not None:
            is_open = term.gate.open(components)
            if is_open is None and (name, term.gate.component) not in self._warned:
                self._warned.add((name, term.gate.component))
                log.warning("reward.terms.%s.gate: a trajectory has no component %r (it has %s); the term does not "
                            "count where that is so", name, term.gate.component, ", ".join(sorted(components)) or "none")
            if not is_open:
                return 0.0
        return term.weight

    def score(self, traj: Trajectory, components: Mapping[str, float],
              weights: Mapping[str, float] | None = None) -> Trajectory:
        """Sets traj.reward_components (the components given, and the process terms reward.terms names) and
        traj.total_reward (their weighted, gated sum). `weights`: each component's weight from where it came (a
        reward function's); 1 for the others."""
        weights = weights or {}
        comps = dict(components)
        turns = traj.all_turns()
        process = {name: CHECKS[name](turns) for name in PROCESS_TERMS if name in self.terms}
        for name, per_turn in process.items():
            comps[name] = float(sum(per_turn))
        total = sum(weights.get(name, 1.0) * self._factor(name, comps) * value
                    for name, value in comps.items() if name not in process)
        for t in turns:  # scored again (a retry, a resumed run): no stale terms
            t.reward_terms = {k: v for k, v in t.reward_terms.items() if k not in PROCESS_TERMS}
        for name, per_turn in process.items():
            factor = self._factor(name, comps)
            for t, hit in zip(turns, per_turn):
                if hit and factor:
                    t.reward_terms[name] = factor * hit
                    total += factor * hit
        traj.reward_components = comps
        traj.total_reward = float(total)
        return traj

    def score_group(self, group: list[Trajectory]) -> None:
        """The group terms (completion_time), once the group's trajectories are all scored: each scored one gets the
        raw component, and its weighted value is added to its total."""
        term = self.terms.get("completion_time")
        if term is None:
            return
        scored = [t for t in group if t.scored]
        counted = [t for t in scored if self._factor(term.name, t.reward_components)]
        mean = sum(t.metadata.wall_time for t in counted) / len(counted) if counted else 0.0
        for t in scored:
            factor = self._factor(term.name, t.reward_components)
            raw = min(1.0, max(-1.0, (mean - t.metadata.wall_time) / mean)) if mean > 0 else 0.0
            t.total_reward += factor * (raw - t.reward_components.get(term.name, 0.0))  # scored twice: once
            t.reward_components[term.name] = raw
