"""Seer's ordering of multi-turn agent programs as engine request priorities (runtime.schedule=seer).

The single-request dispatcher it was first written beside (barrier / refill / Seer over one engine,
with divided rollout) lives in benchmarks/dispatcher.py, the tool of benchmark B2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_PROBE = -(1 << 40)  # below any length-based priority: probes are admitted first


@dataclass(eq=False)
class _ProgramGroup:
    arrival: int
    programs: dict[str, int] = field(default_factory=dict)  # program id -> tokens generated so far
    finished: set[str] = field(default_factory=set)


class ProgramPriorities:
    """Seer's ordering for the training rollout's multi-turn agent programs, as engine request
    priorities (lower is admitted first). The benchmarks' RolloutDispatcher orders single requests; an agent
    program makes several engine calls with tool calls in between, so here the ordering is expressed
    per call and the engine's queue applies it whenever requests wait for a running slot:

    - the first program seen in a group is its probe: until one sibling has finished, the probe's calls
      go before everything else, earlier groups first;
    - every other call is ordered longest-estimate-first, where a group's estimate is the most tokens
      any sibling has generated (over all its turns) once one has finished, and before that the
      program budget (`budget_tokens`: max_turns x max_tokens), so an unprobed group counts as long.

    With fewer programs than engine slots nothing waits and the order has no effect."""

    def __init__(self, budget_tokens: int):
        if budget_tokens < 1:
            raise ValueError(f"budget_tokens must be at least 1, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._groups: dict[str, _ProgramGroup] = {}
        self._arrivals = 0

    def _group(self, group_id: str, program_id: str) -> _ProgramGroup:
        g = self._groups.get(group_id)
        if g is None:
            g = self._groups[group_id] = _ProgramGroup(arrival=self._arrivals)
            self._arrivals += 1
        g.programs.setdefault(program_id, 0)
        return g

    def estimate(self, group_id: str) -> int:
        g = self._groups.get(group_id)
        return max(g.programs.values()) if g is not None and g.finished else self.budget_tokens

    def priority(self, group_id: str, program_id: str) -> int:
        g = self._group(group_id, program_id)
        probe = next(iter(g.programs)) == program_id  # the oldest program still counted
        if probe and not g.finished:
            return _PROBE + g.arrival
        return -self.estimate(group_id)

    def generated(self, group_id: str, program_id: str, tokens: int) -> None:
        self._group(group_id, program_id).programs[program_id] += tokens

    def finished(self, group_id: str, program_id: str) -> None:
        self._group(group_id, program_id).finished.add(program_id)

    def abandoned(self, group_id: str, program_id: str) -> None:
        """The program failed (env error, timeout): its tokens are no length evidence; if it was the
        probe, the next program the group starts becomes the probe."""
        g = self._groups.get(group_id)
        if g is not None:
            g.programs.pop(program_id, None)
            g.finished.discard(program_id)

    def forget(self, group_id: str) -> None:
        """The group is done (all its programs returned)."""
        self._groups.pop(group_id, None)
