"""The Env protocol: gymnasium's reset/step, in OpenAI message space, async.

`reset(task)` gives the opening messages and tool schemas; `step(action_text)` gives the messages to
append (tool results), a step reward, whether the episode is over, and info: `final_answer`, `tool_calls` (the turn's
records: {name, arguments, error, ...}, `error` when the call could not be parsed, `tool_error` when it was well formed
and the tool could not carry it out; reward/process.py counts both) and `record` (what the environment's own reward reads later, kept as Trajectory.env_record).
An Env signals a broken environment by raising EnvCrash or ToolTimeout: the agent loop turns these
into a trajectory status (`env_error`, `timeout`) and never lets them reach sibling rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from loomrl.types import Task


class EnvCrash(RuntimeError):
    """The environment or a tool process crashed (not the agent's fault)."""


class ToolTimeout(RuntimeError):
    """A tool call ran past its deadline and was killed."""


@dataclass(slots=True, kw_only=True)
class Observation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI tool schemas, for templates that render them


@dataclass(slots=True, kw_only=True)
class StepResult:
    observation: list[dict[str, Any]]  # messages to append (empty when done)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    """Environments subclass it (explicitly) to take its defaults: finalize and close do nothing."""

    version: str  # recorded on every trajectory (metadata.env_version)

    async def reset(self, task: Task) -> Observation: ...

    async def step(self, action: str) -> StepResult: ...

    async def finalize(self) -> str | None:
        """The final answer of an episode cut short by its turn or context budget (codefix: run the
        hidden tests on what the agent left), or None when the environment has nothing to add (by
        default: a cut-short episode is judged on its last answer, if it gave one)."""
        return None  # a body, not only a docstring: else the default is abstract to type checkers

    async def close(self) -> None:
        """Release what the episode holds (by default nothing)."""
        return None
