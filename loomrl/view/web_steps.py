"""A web episode's steps as the trajectory view shows them: each tool call as a readable action (`click [12]`,
`type_text [3] "bob"`), the screenshot each executed action left, and the env_record's verdict (solved, reason, url).

Which screenshot belongs to which step follows how the web environment takes them (env/tasks/web/environment.py):
one after reset (index 0), then one after each action it executed; a call that did not parse (`error`) or that the
page refused (`tool_error`: an id not on the page, ...) leaves none. Indices past the stored count are dropped: an
episode that ended on a browser failure kept the record of its last good step.
What it is not: a reader of the store (store_index.py) or of the screenshot files (loomrl/store/screenshots.py).
"""

from __future__ import annotations

import json
from typing import Any

from loomrl.store.screenshots import SCREENSHOTS

# The argument that names the element an action works on, shown as `[id]` after the action's name.
_ELEMENT = "element"


def action_text(call: dict[str, Any]) -> str:
    """One recorded tool call, readable: `click [12]`, `type_text [3] "bob"`, `goto "/cart"`."""
    name = call.get("name") or (call.get("function") or {}).get("name") or "?"
    args = call.get("arguments")
    if isinstance(args, str):  # OpenAI form: the arguments as the model wrote them
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"{name} {args}"
    args = args if isinstance(args, dict) else {}
    parts = [name]
    if _ELEMENT in args:
        parts.append(f"[{args[_ELEMENT]}]")
    parts += [json.dumps(v) if isinstance(v, str) else str(v) for k, v in args.items() if k != _ELEMENT]
    return " ".join(parts)


def _executed(call: dict[str, Any]) -> bool:
    return not call.get("error") and not call.get("tool_error")


def annotate_steps(contexts: list[dict[str, Any]], screenshots: int) -> None:
    """Give every recorded tool call of every turn (earlier contexts first) its `action` text and its `screenshot`
    index (None: it left none), in place."""
    taken = 1  # index 0 is the page after reset
    for ctx in contexts:
        for turn in ctx["turns"]:
            for call in turn.get("tool_calls") or []:
                call["action"] = action_text(call)
                call["screenshot"] = None
                if _executed(call):
                    call["screenshot"] = taken if taken < screenshots else None
                    taken += 1


def env_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the view shows of an env_record: solved, reason, url (each None when the environment records none) and
    how many screenshots were stored; None for a trajectory without a record."""
    if record is None:
        return None
    shots = record.get(SCREENSHOTS)
    return {"solved": record.get("solved"), "reason": record.get("reason"), "url": record.get("url"),
            "screenshots": shots if isinstance(shots, int) else 0}
