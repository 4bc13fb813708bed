"""What reward.terms may name and how a term's gate is written: the built-in process terms (reward/process.py computes
them, under these names) and Gate, a term's `component op threshold` condition, parsed here so that a recipe with a
gate that cannot be read stops at load."""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass

# the per-turn process terms (reward/process.py CHECKS, in this order: tests/reward check that the two agree)
PROCESS_TERMS = ("tool_error", "malformed_call", "repeated_action", "language_mixing")

_GATE = re.compile(r"^\s*(not\s+)?([A-Za-z_][\w./-]*)\s*(?:(>=|<=|>|<|==|!=)\s*(-?\d+(?:\.\d+)?(?:e-?\d+)?))?\s*$")
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
        "!=": operator.ne}


@dataclass(frozen=True, slots=True)
class Gate:
    """When a term counts: `component op threshold`, perhaps negated."""

    component: str
    op: str = ">"
    threshold: float = 0.0
    negate: bool = False

    @classmethod
    def parse(cls, text: str) -> Gate:
        m = _GATE.match(text)
        if not m:
            raise ValueError(f"cannot read the gate {text!r}: write a component's name (`correct`: counts when "
                             "correct > 0), `not correct`, or a comparison such as `correct >= 0.5`")
        negate, name, op, threshold = m.groups()
        return cls(component=name, op=op or ">", threshold=float(threshold or 0.0), negate=bool(negate))

    def open(self, components: Mapping[str, float]) -> bool | None:
        """Whether the term counts; None when the trajectory has no such component (then it does not)."""
        if self.component not in components:
            return None
        return _OPS[self.op](components[self.component], self.threshold) != self.negate

    def __str__(self) -> str:
        return f"{'not ' if self.negate else ''}{self.component} {self.op} {self.threshold:g}"
