"""What the driver says about failed trajectories while a run goes on: the first error of each kind as it happens, and
a step none of whose trajectories could be scored.

Why: a failure that hits every trajectory (a reward function that raises or returns a string, a verl-style
compute_score given TRL's arguments, an environment whose step raises) used to show only as counts (`reward_failed
12`, "NOTHING WAS TRAINED" at the end) while the exception sat in the trajectory store's `error` column: a 1,000-step
run with a typo in its reward trained nothing to its end and exited 0. Now the first error of each kind is logged with
where it was raised (the trajectory's error keeps its traceback's last frames: errors.with_frames), and a step whose
every trajectory failed stops the run with one line, unless runtime.tolerate_failed_steps. A tool that fails on its
own (raises: a bug in the tool, env/tools.py ToolFailure.RAISED) on most of its calls is warned about once, with its
exceptions' counts: to the policy such a bug looks like its own mistake.

What it is not: a retry policy (a rollout worker that died is retried by the driver: RolloutLost), or a judge of
partial failure (a step with some scored trajectories trains on them; the counts are in rollout/status_*).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from loomrl.errors import error_line
from loomrl.types import Trajectory

# the exception type inside an error's first line ("reward failed: score raised TypeError: ..." -> TypeError)
_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Timeout|Fault|Crash))\b")


def failure_kind(traj: Trajectory) -> str | None:
    """How a trajectory failed, as a short key ("reward_failed: TypeError", "env_error: AttributeError"); None when it
    was scored."""
    if traj.scored:
        return None
    line = error_line(traj.error or "")
    found = _EXCEPTION.search(line)
    return f"{traj.ending}: {found.group(1) if found else line[:80] or 'no error recorded'}"


# A tool is warned about once it has failed on its own (raised, env/tools.py ToolFailure.RAISED) on more than half of at
# least this many calls: few enough to say so in the first step, enough that one odd input does not.
TOOL_WARN_MIN_CALLS = 8


@dataclass(slots=True)
class FailureWatch:
    """The kinds of failure seen so far in this segment, and each one's count; each tool's calls and own failures."""

    counts: Counter[str] = field(default_factory=Counter)
    tool_calls: Counter[str] = field(default_factory=Counter)
    tool_raised: dict[str, Counter[str]] = field(default_factory=dict)  # tool -> exception type -> count
    tool_first: dict[str, str] = field(default_factory=dict)  # tool -> its first own failure's message
    warned: set[str] = field(default_factory=set)

    def tool_warnings(self, group: list[Trajectory]) -> list[str]:
        """A warning for each tool that now fails on its own on most of its calls (once per tool): to the policy a
        bug in a tool looks like a mistake of its own, which no training fixes."""
        for call in (c for t in group for turn in t.all_turns() for c in turn.tool_calls if c.get("name")):
            name = call["name"]
            self.tool_calls[name] += 1
            if call.get("failure") == "raised":
                self.tool_raised.setdefault(name, Counter())[call.get("exception") or "Exception"] += 1
                self.tool_first.setdefault(name, error_line(call.get("tool_error") or name))
        out = []
        for name, raised in self.tool_raised.items():
            calls, failed = self.tool_calls[name], sum(raised.values())
            if name in self.warned or calls < TOOL_WARN_MIN_CALLS or failed * 2 <= calls:
                continue
            self.warned.add(name)
            kinds = ", ".join(f"{k} {v}" for k, v in raised.most_common())
            out.append(f"tool {name!r} failed on {failed} of its {calls} calls so far ({kinds}): a bug in the tool, "
                       f"not the model's doing (tool/{name}/* in metrics.jsonl). The first: {self.tool_first[name]}")
        return out

    def first_errors(self, group: list[Trajectory]) -> list[str]:
        """A message for each trajectory of `group` that is the first of its kind: the kind, where (task and
        trajectory ids) and its error in full (the traceback's last frames included)."""
        out = []
        for traj in group:
            kind = failure_kind(traj)
            if kind is None:
                continue
            self.counts[kind] += 1
            if self.counts[kind] == 1:
                out.append(f"first {kind} (task {traj.task_id}, trajectory {traj.trajectory_id}; later ones are "
                           f"counted in rollout/status_* and kept in the trajectory store's error column):\n"
                           f"{traj.error or '(no error recorded)'}")
        return out


def failed_step(groups: list[list[Trajectory]], step: int) -> str | None:
    """The line a run stops with when none of `groups`' trajectories (those that arrived for `step`) could be scored;
    None when some could, or none arrived."""
    trajs = [t for g in groups for t in g]
    if not trajs or any(t.scored for t in trajs):
        return None
    kinds = Counter(str(failure_kind(t)) for t in trajs)
    (kind, n), *others = kinds.most_common()
    first = next(t for t in trajs if failure_kind(t) == kind)
    also = f" (and {', '.join(f'{k} {c}' for k, c in others)})" if others else ""
    return (f"run error: step {step}: none of its {len(trajs)} trajectories could be scored: {kind} {n}{also}. The "
            f"first: {error_line(first.error or str(kind))}. Fix the cause (the whole error with where it was raised is "
            "above, and in the trajectory store's error column), or set runtime.tolerate_failed_steps=true to go on "
            "past such steps")
