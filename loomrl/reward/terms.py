"""Reward functions users already wrote, used unchanged: loomrl's `(trajectory, task) -> {name: value}` and TRL's
`(prompts, completions, **columns) -> list[float | None]`, one or several with weights (reward.function,
reward.functions; docs/rewards.md).

TRL-style functions are told apart by their signature (a `completions` parameter) and called the way TRL's
GRPOTrainer calls them, with a batch of one: `fn(prompts=[p], completions=[c], completion_ids=[ids],
trainer_state=None, **{column: [value]})`. The columns are the task's `data` (a dataset's other columns, verl's
`extra_info` among them) and `answer` (the task's answer, unless a column has that name). A task that brought chat
messages (a dataset's, Task.messages) is conversational, as TRL calls it: `p` is those messages and `c` the episode's
messages after them, every assistant turn and every tool or user message the environment answered with, in order
(`[{"role": "assistant", "content": ...}]` for one reply); otherwise `p` is the prompt's text and `c` the assistant
turns' text, joined by newlines. An assistant turn's content is its text as the agent loop split it, any
`<think>...</think>` put back in front of the rest (the exact sampled tokens are `completion_ids`).

None is "no opinion" (TRL: a math reward on a code task): that component is left out of the total and out of its
mean, never a 0; a trajectory that every function left without an opinion has no reward (reward_failed, never
trained). Each component is stored raw on the trajectory (Trajectory.reward_components) and its weight applied only
to the total.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loomrl.types import Task, Trajectory


class NoOpinion(Exception):
    """Every reward function returned None for the trajectory: it has no reward."""


@dataclass(frozen=True, slots=True)
class RewardTerm:
    name: str
    fn: Callable[..., Any]
    weight: float
    trl: bool  # TRL's signature (prompts, completions, **columns), else loomrl's (trajectory, task)


def is_trl_style(fn: Callable[..., Any]) -> bool:
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: loomrl's positional form
        return False


def _turn_text(think: str, act: str) -> str:
    return f"<think>{think}</think>{act}" if think else act


def trl_arguments(traj: Trajectory, task: Task) -> dict[str, Any]:
    """The keyword arguments TRL would pass for this one trajectory (see the module's doc)."""
    turns = traj.all_turns()
    if task.messages:
        completion: Any = []
        for t in turns:
            completion.append({"role": "assistant", "content": _turn_text(t.think, t.act)})
            if t.obs_span is not None and t.obs:
                completion.append({"role": "tool" if t.tool_calls else "user", "content": t.obs})
        prompt: Any = list(task.messages)
    else:
        completion = "\n".join(_turn_text(t.think, t.act) for t in turns)
        prompt = task.prompt
    ids = [i for c in traj.contexts() for t, m in [(c.token_ids, c.sampled_mask())] for i, s in zip(t, m) if s]
    columns = {"answer": task.answer, **task.data}
    return {"prompts": [prompt], "completions": [completion], "completion_ids": [ids], "trainer_state": None,
            **{k: [v] for k, v in columns.items()}}


def _value(term: RewardTerm, traj: Trajectory, task: Task) -> dict[str, float | None]:
    if not term.trl:
        out = term.fn(traj, task)
        if not isinstance(out, dict):
            raise TypeError(f"{term.name} returned {type(out).__name__}, not a dict of components")
        return out
    values = term.fn(**trl_arguments(traj, task))
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        got = f"a list of {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
        raise TypeError(f"{term.name} returned {got}; a TRL-style reward function returns one value per completion "
                        "(a list of 1 here)")
    return {term.name: values[0]}


class CombinedReward:
    """Several terms as one reward function: raw components by name (None ones left out), and `total`, their
    weighted sum (a loomrl-style term's weight applies to each of its components)."""

    def __init__(self, terms: list[RewardTerm]):
        self.terms = terms

    def _components(self, traj: Trajectory, task: Task) -> list[tuple[str, float, float]]:
        out = []
        for term in self.terms:
            for name, value in _value(term, traj, task).items():
                if value is None:
                    continue
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"{term.name} returned {value} for {name}")
                out.append((name, value, term.weight))
        if not out:
            raise NoOpinion("every reward function returned None")
        return out

    def scored(self, traj: Trajectory, task: Task) -> tuple[dict[str, float], float]:
        parts = self._components(traj, task)
        return {name: value for name, value, _ in parts}, sum(value * weight for _, value, weight in parts)

    def __call__(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return self.scored(traj, task)[0]
