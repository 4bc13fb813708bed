"""Reward functions users already wrote, used unchanged: loomrl's `(trajectory, task) -> {name: value}`, TRL's
`(prompts, completions, **columns) -> list[float | None]` and verl's `compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | {"score": float, ...}`, told apart by their signature at load (a function of
none of these shapes stops the run there, naming its parameters), one or several with weights (reward.function,
reward.functions; docs/rewards.md). What is here is the arithmetic (arguments, values, None, weights); running the
functions, each bounded by reward.timeout_s in a worker process, is reward/workers.py's.

TRL-style functions are told apart by their signature (a `completions` parameter) and called the way TRL's
GRPOTrainer calls them (trl/trainer/grpo_trainer.py `_calculate_rewards`), with a batch of one trajectory:
`fn(prompts=[p], completions=[c], completion_ids=[ids], **{column: [value]}, trainer_state=..., log_extra=...,
log_metric=...)`; an `async def` one is awaited. The columns are `answer` (the task's answer) and the task's `data`
(a dataset's other columns, verl's `extra_info` among them), a column of the data winning over `answer`.
A task that brought chat messages (a dataset's, Task.messages) is conversational, as TRL calls it: `p` is those
messages and `c` the episode's messages after them, every assistant turn and every tool or user message the environment
answered with, in order (`[{"role": "assistant", "content": ...}]` for one reply, TRL's form); otherwise `p` is the
prompt's text and `c` the assistant turns' text, joined by newlines. An assistant turn's content is its text as the
agent loop split it, any `<think>...</think>` put back in front of the rest. `completion_ids` are the exact token ids
after the opening prompt, as TRL's: the sampled ones and the environment's answers between them.

None is "no opinion" (TRL: a math reward on a code task): that component is left out of the total and out of its
mean, never a 0; a trajectory that every function left without an opinion has no reward (reward_failed, never
trained). Each component is stored raw on the trajectory (Trajectory.reward_components) and its weight applied only
to the total.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loomrl.types import Task, Trajectory, Turn


class NoOpinion(Exception):
    """Every reward function returned None for the trajectory: it has no reward."""


class NotAReward(TypeError):
    """A function returned what is not a reward (wrong type or length, not a number, not finite); names the function."""


class RewardStyle(enum.StrEnum):
    """How a reward function is called, told from its signature at load (`reward_style`)."""

    LOOMRL = "loomrl"  # fn(trajectory, task) -> {name: value}
    TRL = "trl"  # fn(prompts, completions, **columns) -> [value]
    VERL = "verl"  # compute_score(data_source, solution_str, ground_truth, extra_info=None) -> value | {"score": ...}


SHAPES = ("fn(trajectory, task) -> {name: value} (loomrl), fn(prompts, completions, **columns) -> [value] (TRL), or "
          "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> value (verl)")


@dataclass(frozen=True, slots=True)
class RewardTerm:
    name: str  # its component's name (a loomrl-style function names its own components)
    spec: str  # "package.module:function", so that a reward worker process imports the same function
    fn: Callable[..., Any]
    weight: float
    style: RewardStyle

    @property
    def trl(self) -> bool:
        return self.style is RewardStyle.TRL


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What TRL's `trainer_state` offers reward functions that shape by progress (`global_step / max_steps`)."""

    global_step: int  # the policy version that sampled the trajectory's newest token (the trainer's step)
    max_steps: int  # trainer.total_steps


def reward_style(fn: Callable[..., Any]) -> RewardStyle:
    """How `fn` is called, from its parameters: a `completions` one is TRL's; `solution_str` and `ground_truth`
    verl's; one that takes two positional arguments loomrl's. TypeError naming the parameters for anything else, so
    that a function of the wrong shape stops the run at load, not on every trajectory."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: loomrl's positional form
        return RewardStyle.LOOMRL
    params = sig.parameters
    if "completions" in params:
        return RewardStyle.TRL
    if {"solution_str", "ground_truth"} <= set(params):
        return RewardStyle.VERL
    try:
        sig.bind(None, None)
    except TypeError:
        raise TypeError(f"it takes ({', '.join(params)}); a reward function is {SHAPES}") from None
    return RewardStyle.LOOMRL


def verl_arguments(traj: Trajectory, task: Task, accepts: Callable[[str], bool]) -> dict[str, Any]:
    """The keyword arguments verl's reward manager passes compute_score for one response (verl/workers/
    reward_manager/naive.py): data_source (a dataset's data_source column, the task's family), solution_str (the
    assistant turns' text, as TRL's string completion), ground_truth (the task's answer: verl's
    reward_model.ground_truth) and extra_info (the extra_info column); each only where the function takes it."""
    args = {"data_source": task.data.get("data_source", task.family),
            "solution_str": "\n".join(_turn_text(t.think, t.act) for t in traj.all_turns()),
            "ground_truth": task.answer, "extra_info": task.data.get("extra_info")}
    return {k: v for k, v in args.items() if accepts(k)}


def _accepts(fn: Callable[..., Any]) -> Callable[[str], bool]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda name: True
    return lambda name: name in params


def _turn_text(think: str, act: str) -> str:
    return f"<think>{think}</think>{act}" if think else act


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    """A turn's tool call in the OpenAI form TRL's completions carry. A turn holds either that form already (a black-box
    agent's reply) or the environment's parse, {name, arguments, error}."""
    if "function" in call:
        return call
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


def _completion_messages(traj: Trajectory) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in traj.all_turns():
        message: dict[str, Any] = {"role": "assistant", "content": _turn_text(t.think, t.act)}
        calls = [_openai_call(c) for c in t.tool_calls if not c.get("error")]
        if calls:
            message["tool_calls"] = calls
        out.append(message)
        if t.obs_span is not None and t.obs:  # an answer the model was shown (a last one it never saw is left out)
            answer = {"role": "tool" if t.tool_calls else "user", "content": t.obs}
            if len(calls) == 1:
                answer["name"] = calls[0]["function"]["name"]
            out.append(answer)
    return out


def _ignored(*args: Any, **kwargs: Any) -> None:
    """TRL's log_extra and log_metric: accepted so that functions calling them run; what they log is not kept."""


def trl_arguments(traj: Trajectory, task: Task, max_steps: int = 0) -> dict[str, Any]:
    """The keyword arguments TRL would pass for this one trajectory (see the module's doc)."""
    if task.messages:
        prompt: Any = list(task.messages)
        completion: Any = _completion_messages(traj)
    else:
        prompt = task.prompt
        completion = "\n".join(_turn_text(t.think, t.act) for t in traj.all_turns())
    # as TRL's: every token after the opening prompt, the environment's answers between the replies too
    ids = [i for c in traj.contexts() for i in _after_prompt(c.token_ids, c.turns)]
    columns = {"answer": task.answer, **task.data}
    state = TrainerState(global_step=max(traj.metadata.policy_version_max, 0), max_steps=max_steps)
    return {**{k: [v] for k, v in columns.items()}, "prompts": [prompt], "completions": [completion],
            "completion_ids": [ids], "trainer_state": state, "log_extra": _ignored, "log_metric": _ignored}


def _after_prompt(token_ids: list[int], turns: list[Turn]) -> list[int]:
    """A context's tokens from its first reply to its last reply or answer (the turns' spans)."""
    spans = [s for t in turns for s in (t.act_span, t.obs_span) if s is not None]
    return token_ids[min(s.start for s in spans) : max(s.end for s in spans)] if spans else []


def evaluate(term: RewardTerm, traj: Trajectory, task: Task, max_steps: int = 0) -> dict[str, float | None]:
    """The term's raw components for one trajectory ({name: value or None}); NotAReward for what is not one."""
    if term.trl:
        values = term.fn(**trl_arguments(traj, task, max_steps))
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            got = f"a list of {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
            raise NotAReward(f"{term.name} returned {got}; a TRL-style reward function returns one value per "
                            "completion (a list of 1 here)")
        value = values[0]
        # TRL turns None into NaN and nansums: a NaN is no opinion there too
        out = {term.name: None if isinstance(value, float) and math.isnan(value) else value}
    elif term.style is RewardStyle.VERL:
        value = term.fn(**verl_arguments(traj, task, _accepts(term.fn)))
        if isinstance(value, dict):  # verl's reward manager takes result["score"]; the other keys are its extra info
            if "score" not in value:
                raise NotAReward(f"{term.name} returned a dict without 'score' ({sorted(value)}); verl's "
                                 "compute_score returns a number or a dict with 'score'")
            value = value["score"]
        out = {term.name: value}
    else:
        out = term.fn(traj, task)
        if not isinstance(out, dict):
            raise NotAReward(f"{term.name} returned {type(out).__name__}, not a dict of components")
    return {name: None if value is None else _number(term, name, value) for name, value in out.items()}


async def _awaited(values: Any) -> Any:
    return await values


def _number(term: RewardTerm, name: str, value: Any) -> float:
    try:
        if isinstance(value, (str, bytes)):  # float("1") would pass; TRL would not take it either
            raise TypeError
        number = float(value)  # a bool, an int, numpy's and torch's scalars too
    except (TypeError, ValueError):
        raise NotAReward(f"{term.name} returned {type(value).__name__} {value!r} for {name}, not a number") from None
    if not math.isfinite(number):
        raise NotAReward(f"{term.name} returned {number} for {name}, not a finite number")
    return number


class CombinedReward:
    """Several terms as one reward: raw components by name (None ones left out), and `total`, their weighted sum (a
    loomrl-style term's weight applies to each of its components). `keep_reported`: a trajectory that already has
    components (a black-box agent reported them, agent.reward_from_agent) keeps them, their sum its total."""

    def __init__(self, terms: list[RewardTerm], max_steps: int = 0, keep_reported: bool = False):
        self.terms = terms
        self.max_steps = max_steps
        self.keep_reported = keep_reported

    def combine(self, values: list[dict[str, float | None]]) -> tuple[dict[str, float], dict[str, float]]:
        """(components, each one's weight) from each term's evaluate(); NoOpinion when every value is None. The total
        is their weighted sum, gated by reward.terms (reward/composite.py)."""
        parts = [(name, value, term.weight) for term, out in zip(self.terms, values)
                 for name, value in out.items() if value is not None]
        if not parts:
            raise NoOpinion("every reward function returned None (no opinion)")
        return {name: value for name, value, _ in parts}, {name: weight for name, _, weight in parts}
