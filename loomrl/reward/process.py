"""Process terms: what a turn did wrong, judged per turn from the trajectory alone (no model, no sandbox).

Each check returns, for every turn of an episode (Trajectory.all_turns(), in order), 1.0 where the turn offends and
0.0 where it does not; reward/composite.py weights them (a negative weight: a penalty) and places them at their turn.

- tool_error: a tool call the tool could not carry out (it ran past its timeout, did not exist, refused the arguments),
  as the environment recorded it: the turn's tool-call records (env/base.py) with a `tool_error`; not one the tool
  itself failed on (its record's `failure` "raised": a bug in the tool, which the policy cannot fix).
- malformed_call: a tool call that could not be parsed (its record's `error`).
- repeated_action: the same action (whitespace aside) as an earlier turn of the episode; the loop of an agent that
  did not read the answer it got.
- language_mixing: a turn whose letters come from two scripts (e.g. Latin and CJK), the minority one at least
  MIXING_MIN_LETTERS letters (so that a π or an é does not count); the mixing RL on multilingual models is known for.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

from loomrl.types import Turn

MIXING_MIN_LETTERS = 3

# Writing systems that belong together count as one (Japanese mixes kana and kanji; Korean has hanja).
_SAME_SCRIPT = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK", "FULLWIDTH": "LATIN"}


def tool_error(turns: list[Turn]) -> list[float]:
    # a tool that raised on a well-formed call has a bug (env/tools.py ToolFailure.RAISED): not the turn's doing
    return [float(any(c.get("tool_error") and c.get("failure") != "raised" for c in t.tool_calls)) for t in turns]


def malformed_call(turns: list[Turn]) -> list[float]:
    return [float(any(c.get("error") for c in t.tool_calls)) for t in turns]


def repeated_action(turns: list[Turn]) -> list[float]:
    seen: set[str] = set()
    out = []
    for t in turns:
        action = " ".join(t.act.split())
        out.append(float(bool(action) and action in seen))
        seen.add(action)
    return out


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    first = name.split(" ", 1)[0]
    return _SAME_SCRIPT.get(first, first)


def scripts(text: str) -> dict[str, int]:
    """Letters per script ("LATIN", "CJK", "CYRILLIC", ...)."""
    counts: dict[str, int] = {}
    for ch in text:
        if ch.isalpha():
            s = _script(ch)
            counts[s] = counts.get(s, 0) + 1
    return counts


def language_mixing(turns: list[Turn]) -> list[float]:
    out = []
    for t in turns:
        counts = sorted(scripts(f"{t.think} {t.act}").values(), reverse=True)
        out.append(float(len(counts) > 1 and counts[1] >= MIXING_MIN_LETTERS))
    return out


CHECKS: dict[str, Callable[[list[Turn]], list[float]]] = {
    "tool_error": tool_error, "malformed_call": malformed_call, "repeated_action": repeated_action,
    "language_mixing": language_mixing,
}
