"""Reward functions users already wrote, used unchanged: loomrl's `(trajectory, task) -> {name: value}`, TRL's
`(prompts, completions, **columns) -> list[float | None]` and verl's `compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | {"score": float, ...}`, told apart by their signature at load (a function of
none of these shapes stops the run there, naming its parameters), one or several with weights (reward.function,
reward.functions; docs/rewards.md). What is here is the arithmetic (arguments, values, None, weights); running the
functions, each bounded by reward.timeout_s in a worker process, is reward/workers.py's.

TRL-style functions are told apart by their signature (a `prompts`, `completions` or `completion_ids` parameter)
and called the way TRL's GRPOTrainer calls them (trl/trainer/grpo_trainer.py `_calculate_rewards`), with a batch of
one trajectory: `fn(prompts=[p], completions=[c], completion_ids=[ids], **{column: [value]}, trainer_state=...,
log_extra=..., log_metric=...)`; an `async def` one is awaited. The columns are `answer` (the task's answer) and the
task's `data` (a dataset's other columns, verl's `extra_info` among them), a column of the data winning over `answer`.

The shape of `p` and `c`, the one place it is stated (docs/rewards.md repeats it for users). Every episode is a chat
(the Env API speaks messages and the model sees them through its chat template), so every task, a dataset's or an
environment's own, is conversational, as TRL calls it, and gets the shape TRL 1.16 gives a conversational dataset
with tools or an environment (read in trl/trainer/grpo_trainer.py: `_generate` makes `[parse_response(...)]` per
completion; `_tool_call_loop` appends each tool result `{"role": "tool", "name", "content"}` and the reply after it;
`_calculate_rewards` passes those lists; `_generate_and_score_completions` makes an environment's own prompt a user
message):
- `p` is the task's opening messages: a dataset's (Task.messages: its system prompt, few-shot turns and prompt), else
  `[{"role": "user", "content": task.prompt}]` (an environment's system prompt and worked examples are not the task's).
- `c` is every message after them, in order: each assistant turn `{"role": "assistant", "content", "tool_calls"?}`,
  then what the environment answered it with (`{"role": "tool", "name"?, "content"}` after a tool call, else a `user`
  message); an answer the model never saw (the episode ended) is left out. So `c[0]` is the first assistant turn
  (in a tool episode the tool-call turn, as in TRL) and `c[-1]` the last reply; a one-reply episode is
  `[{"role": "assistant", "content": ...}]`, the one-message completion TRL's documented functions index with
  `completion[0]["content"]`. A function scoring a tool episode's final answer reads `completion[-1]["content"]`, as
  TRL's own agent example does (examples/scripts/grpo_agent.py `correctness_reward`).
- An assistant turn's `content` is its text as TRL's response parsing leaves it (trl/chat_template_utils.py
  `parse_response` with a response schema, whose regex puts the text before the first `<tool_call>` in `content`
  and the calls in `tool_calls`): a turn whose calls all parsed keeps the text before its first `<tool_call>`
  (a newline just before it dropped); any `<think>...</think>` the agent loop split off is put back in front.
  `tool_calls` are in OpenAI's form, `{"type": "function", "function": {"name", "arguments"}}`.
- `completion_ids` are the exact token ids after the opening prompt, as TRL's: the sampled ones and the environment's
  answers between them (of every context, in order).

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


# what TRL passes every reward function by name: a function taking any of them is TRL-style (TRL's docs' first
# example, `reward_func(completion_ids, **kwargs)`, takes no `completions`)
TRL_PARAMETERS = frozenset({"prompts", "completions", "completion_ids"})
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
    """How `fn` is called, from its parameters: one named as TRL passes them (TRL_PARAMETERS) is TRL's; `solution_str` and `ground_truth`
    verl's; one that takes two positional arguments loomrl's. TypeError naming the parameters for anything else, so
    that a function of the wrong shape stops the run at load, not on every trajectory."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: loomrl's positional form
        return RewardStyle.LOOMRL
    params = sig.parameters
    if params.keys() & TRL_PARAMETERS:
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
    assistant turns' text, joined by newlines), ground_truth (the task's answer: verl's
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


def _reply_content(turn: Turn, calls: list[dict[str, Any]]) -> str:
    """An assistant turn's `content`, as TRL's parse_response leaves it (see the module's doc)."""
    act = turn.act
    at = act.find("<tool_call>")
    if calls and at >= 0 and not any(c.get("error") for c in turn.tool_calls):
        act = act[:at].removesuffix("\n")
    return _turn_text(turn.think, act)


def _completion_messages(traj: Trajectory) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in traj.all_turns():
        calls = [_openai_call(c) for c in t.tool_calls if not c.get("error")]
        message: dict[str, Any] = {"role": "assistant", "content": _reply_content(t, calls)}
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
    # every episode is a chat: conversational for an environment's own tasks too (TRL's environments are)
    prompt = list(task.messages) if task.messages else [{"role": "user", "content": task.prompt}]
    completion = _completion_messages(traj)
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
