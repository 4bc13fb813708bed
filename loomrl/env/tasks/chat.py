"""chat: one reply to a dataset's prompt, checked against its answer. The environment for tasks a recipe's `data:`
section brings (loomrl/data/) when they need no tools: it has no tasks of its own.

The final answer is read from the reply by `env.args.answer_format`:
  last_number  the last number in the reply (commas dropped): "... so she has 42 apples." -> 42
  hash         after "####", as GSM8K's solutions and verl's gsm8k reward write it (else none)
  boxed        the content of the last \\boxed{...} (nested braces kept), as math datasets write it
  answer_is    "The answer is X" (the calculator's form)
  answer_tag   the content of the last <answer>...</answer>, stripped, as reasoning-gym's prompts ask for it
  text         the whole reply, stripped
A reply with no answer in that form has none: it scores 0 like a wrong one (it was played out, the policy did it).
Answers compare as numbers when both read as numbers (42 == 42.0), else as text, stripped and case-folded.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from loomrl.env.api import Environment, EpisodeContext, opening_messages
from loomrl.env.base import Env, Observation, StepResult
from loomrl.types import Task, Trajectory

ENV_VERSION = "chat-v1"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*(.+?)(?:\.\s*$|\.\s+|$)", re.IGNORECASE | re.MULTILINE)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
AnswerFormat = Literal["last_number", "hash", "boxed", "answer_is", "answer_tag", "text"]


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str, form: AnswerFormat) -> str | None:
    """The final answer in `text` written in `form` (see the module's doc), or None."""
    text = _THINK.sub("", text)
    if form == "text":
        return text.strip()
    if form == "boxed":
        return _last_boxed(text)
    if form == "hash":
        _, sep, after = text.rpartition("####")
        return after.strip().splitlines()[0].strip() if sep and after.strip() else None
    if form == "answer_is":
        found = _ANSWER_IS.findall(text)
        return found[-1].strip() if found else None
    if form == "answer_tag":
        found = _ANSWER_TAG.findall(text)
        return found[-1].strip() if found else None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def answers_match(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    a, b = _as_number(given), _as_number(expected)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return given.strip().casefold() == expected.strip().casefold()


class ChatArgs(BaseModel):
    """env.args of env.name=chat."""

    model_config = ConfigDict(extra="forbid")
    answer_format: AnswerFormat = "last_number"
    system_prompt: str | None = None  # used when the task brings none (a data: section's system_prompt wins)


class ChatEnv(Env):
    version = ENV_VERSION

    def __init__(self, args: ChatArgs):
        self.args = args

    async def reset(self, task: Task) -> Observation:
        return Observation(messages=opening_messages(task, self.args.system_prompt))

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[], done=True, info={"final_answer": extract_answer(action,
                                                                                        self.args.answer_format)})


class ChatEnvironment(Environment):
    """Single-turn question answering on a dataset's tasks."""

    Args = ChatArgs
    version = ENV_VERSION

    def __init__(self, args: ChatArgs):
        self.args = args

    def episode(self, ctx: EpisodeContext) -> Env:
        return ChatEnv(self.args)

    def success(self, traj: Trajectory, task: Task) -> bool:
        return answers_match(traj.final_answer, task.answer)
