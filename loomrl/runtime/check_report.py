"""The report of `loomrl check-env` (runtime/check_env.py): success with its standard error, mean turns, each tool's
calls and failures by kind (env/tools.py ToolFailure: refused, timeout, raised with the exception types: the tool-call
records' `failure` and `exception` keys), episodes by how they ended (Trajectory.ending) with the first error of each
kind of failure (runtime/failure_watch.py failure_kind), and a one-line verdict.

The verdict's rule: the environment failed when an episode could not be played out for the environment's sake
(env_error, timeout: an env call past its bound), when a reward could not be computed (reward_failed), or when a tool
raised (a bug in the tool, whatever the model sent). None of these is the model's doing, and no model, however strong,
trains through them. Otherwise the environment worked, and success says what the model made of it: a strong model
that solves none points at the task or its reward (read a few episodes: --json), a weak one at the model. Episodes the
endpoint refused (engine_error) are the endpoint's, counted apart. What the model got wrong (a malformed call, a bad
argument, a tool that does not exist: `refused`) is counted and is no environment failure.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from loomrl.errors import error_line
from loomrl.runtime.check_env import Episode
from loomrl.runtime.failure_watch import failure_kind
from loomrl.types import REWARD_FAILED, RolloutStatus, Score

ENV_FAILURES = (RolloutStatus.ENV_ERROR.value, RolloutStatus.TIMEOUT.value, REWARD_FAILED)
ORDER = ("completed", "truncated", REWARD_FAILED, "env_error", "timeout", "engine_error", "aborted")


@dataclass(slots=True, kw_only=True)
class ToolTally:
    """One tool's calls and those it did not carry out, by why."""

    calls: int = 0
    refused: int = 0  # the model's doing: bad arguments, or the tool said so with ToolError
    timeout: int = 0
    raised: dict[str, int] = field(default_factory=dict)  # the tool's own exceptions, by type
    first_raised: str | None = None  # the first one's message


@dataclass(slots=True, frozen=True, kw_only=True)
class EpisodeLine:
    """One episode as --json lists it: how it ended, its reward and success where it was scored, and every reply."""

    task_id: str
    ending: str  # Trajectory.ending
    turns: int
    reward: float | None  # None: not scored
    success: bool | None
    final_answer: str | None
    error: str | None
    replies: list[str]  # each turn's act, as the model wrote it

    @classmethod
    def of(cls, e: Episode) -> EpisodeLine:
        t = e.trajectory
        return cls(task_id=t.task_id, ending=t.ending, turns=len(t.turns),
                   reward=t.total_reward if e.success is not None else None, success=e.success,
                   final_answer=t.final_answer, error=t.error, replies=[turn.act for turn in t.all_turns()])


@dataclass(slots=True, kw_only=True)
class CheckReport:
    env: str
    endpoint: str
    model: str
    split: str
    planned: int  # episodes set out to play
    episodes: int  # episodes that finished (fewer than planned after a Ctrl-C)
    interrupted: bool
    success: Score  # over the scored episodes
    turns_mean: float
    reward_mean: float | None  # over the scored episodes
    statuses: dict[str, int]  # Trajectory.ending -> episodes
    first_errors: dict[str, str]  # failure kind ("env_error: AttributeError") -> the first one's error, in full
    tools: dict[str, ToolTally]
    malformed_calls: int  # calls that could not be parsed (the model's doing)
    env_failed: bool
    verdict: str
    episode_list: list[EpisodeLine]

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tool_tallies(episodes: list[Episode]) -> tuple[dict[str, ToolTally], int]:
    """Per tool its tally, and the calls that could not be parsed."""
    tools: dict[str, ToolTally] = {}
    malformed = 0
    for call in (c for e in episodes for turn in e.trajectory.all_turns() for c in turn.tool_calls):
        if call.get("error"):  # the call itself was malformed: no tool ran
            malformed += 1
            continue
        tally = tools.setdefault(str(call.get("name") or "?"), ToolTally())
        tally.calls += 1
        failure = call.get("failure")
        if failure == "raised":
            kind = str(call.get("exception") or "Exception")
            tally.raised[kind] = tally.raised.get(kind, 0) + 1
            tally.first_raised = tally.first_raised or error_line(str(call.get("tool_error") or kind))
        elif failure == "timeout":
            tally.timeout += 1
        elif failure == "refused":
            tally.refused += 1
    return tools, malformed


def build_report(episodes: list[Episode], *, env: str, endpoint: str, model: str, split: str, planned: int,
                 interrupted: bool) -> CheckReport:
    trajs = [e.trajectory for e in episodes]
    scored = [e for e in episodes if e.success is not None]
    statuses = Counter(t.ending for t in trajs)
    first_errors: dict[str, str] = {}
    for t in trajs:
        if (kind := failure_kind(t)) is not None:
            first_errors.setdefault(kind, f"(task {t.task_id}) {t.error or 'no error recorded'}")
    tools, malformed = tool_tallies(episodes)
    rewards = [e.trajectory.total_reward for e in scored]
    report = CheckReport(
        env=env, endpoint=endpoint, model=model, split=split, planned=planned, episodes=len(episodes),
        interrupted=interrupted, success=Score.of([bool(e.success) for e in scored]),
        turns_mean=sum(len(t.all_turns()) for t in trajs) / len(trajs) if trajs else 0.0,
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        statuses={k: statuses[k] for k in sorted(statuses, key=lambda k: (ORDER + (k,)).index(k))},
        first_errors=first_errors, tools=tools, malformed_calls=malformed, env_failed=False, verdict="",
        episode_list=[EpisodeLine.of(e) for e in episodes])
    report.env_failed, report.verdict = verdict(report)
    return report


def verdict(r: CheckReport) -> tuple[bool, str]:
    """(whether the environment failed, the one-line verdict): see the module's doc for the rule."""
    env_side = [f"{r.statuses[k]} {k}" for k in ENV_FAILURES if r.statuses.get(k)]
    env_side += [f"tool {name!r} raised on {sum(t.raised.values())} of its {t.calls} calls "
                 f"({', '.join(f'{k} {v}' for k, v in sorted(t.raised.items()))})"
                 for name, t in r.tools.items() if t.raised]
    endpoint = r.statuses.get("engine_error", 0)
    aside = f"; the endpoint refused {endpoint} episode(s) (engine_error: the endpoint's, not the environment's)" \
        if endpoint else ""
    s = r.success
    solved = f"the model solved {round(s.success * s.n)} of {s.n} ({s.success:.3f} ± {s.stderr:.3f})"
    if env_side:
        return True, (f"VERDICT: the environment failed: {'; '.join(env_side)}. Not the model's doing: fix these "
                      f"before training (the first error of each kind is above){aside}")
    if not s.n:
        return False, f"VERDICT: no episode was scored{aside}"
    if s.success == 0:
        return False, (f"VERDICT: the environment ran cleanly (every episode played out and scored, no tool failed "
                       f"on its own); {solved}: a weak model, or a task or reward that never counts an answer as "
                       f"right (a strong model that solves none points there: read its replies with --json){aside}")
    return False, f"VERDICT: the environment works: every episode played out and scored cleanly; {solved}{aside}"


def report_text(r: CheckReport) -> str:
    """The report as the terminal shows it."""
    s = r.success
    stop = f" (interrupted: {r.episodes} of {r.planned} finished)" if r.interrupted else ""
    lines = [f"check-env {r.env}: {r.episodes} {r.split} episode(s) with {r.model!r} at {r.endpoint}{stop}",
             f"success      {s.success:.3f} ± {s.stderr:.3f} (solved {round(s.success * s.n)} of {s.n} scored)",
             f"turns        {r.turns_mean:.2f} per episode" + ("" if r.reward_mean is None else
                                                               f"; reward {r.reward_mean:.3f} per scored episode"),
             "episodes     " + (", ".join(f"{k} {v}" for k, v in r.statuses.items()) or "none")]
    if r.tools or r.malformed_calls:
        lines.append("tools        calls  refused  timeout  raised")
        for name, t in r.tools.items():
            raised = ", ".join(f"{k} {v}" for k, v in sorted(t.raised.items())) or "0"
            lines.append(f"  {name:<10} {t.calls:>5}  {t.refused:>7}  {t.timeout:>7}  {raised}")
            if t.first_raised:
                lines.append(f"    first raised: {t.first_raised}")
        if r.malformed_calls:
            lines.append(f"  malformed calls (the model's): {r.malformed_calls}")
    for kind, error in r.first_errors.items():
        lines.append(f"first {kind}:")
        lines += [f"    {line}" for line in error.splitlines()[:8]]
    lines.append(r.verdict)
    return "\n".join(lines)
