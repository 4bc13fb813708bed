"""Reward for the calculator task: exact final answer, plus a small format term.

format = share of turns that are exactly one tool call (`calc(...)`) or a final-answer sentence;
it rewards clean tool use a little, never more than a correct answer.
"""

from __future__ import annotations

import re

from loomrl.types import Task, Trajectory

_CALL_ONLY = re.compile(r"^\s*calc\([^\n]*\)\s*$")
_ANSWER_ONLY = re.compile(r"^\s*The answer is\s*-?[\d,]*\.?\d+\.?\s*$", re.IGNORECASE)


def calculator_reward(traj: Trajectory, task: Task, *, correct: float = 1.0, format_weight: float = 0.1) -> dict[str, float]:
    """Components of the reward; the total is their sum."""
    is_correct = traj.final_answer is not None and traj.final_answer == task.answer
    well_formed = [bool(_CALL_ONLY.match(t.act) or _ANSWER_ONLY.match(t.act)) for t in traj.turns]
    fmt = sum(well_formed) / len(well_formed) if well_formed else 0.0
    return {"correct": correct if is_correct else 0.0, "format": format_weight * fmt}
