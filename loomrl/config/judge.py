"""The `reward.judge:` section of a recipe: an LLM judge over an OpenAI-compatible endpoint (reward/judge.py).

A module of the config package (its sections sit below every component, so that no component's import leads back
up)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from loomrl.config.base import Section

# What a rubric may name: the task's prompt, its reference answer, what the trajectory is judged on, the scale's ends
RUBRIC_FIELDS = ("prompt", "reference", "response", "low", "high")

DEFAULT_RUBRIC = """Grade the answer to the task below from {low} to {high} ({high}: fully correct, {low}: wrong or no answer).

Task: {prompt}
Reference answer: {reference}
Answer to grade: {response}

Reply with one line, "Score: N", N a whole number from {low} to {high}."""


class JudgeExample(Section):
    """A worked grading, shown to the judge as an earlier user turn (the rubric over these fields) and its reply
    ("Score: N"): a small judge (SmolLM2-135M) answers in the format only after one or two."""

    prompt: str
    reference: str = ""
    response: str
    score: float


class JudgePrices(Section):
    """USD per 1M tokens, as providers list them (0: a local server)."""

    prompt: float = Field(0.0, ge=0.0)
    """USD per 1M prompt tokens"""
    completion: float = Field(0.0, ge=0.0)
    """USD per 1M completion tokens"""


class JudgeConfig(Section):
    base_url: str
    """the endpoint's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (`loomrl serve`) or a provider's"""
    model: str
    """the model id the endpoint serves (`loomrl serve --model-name`)"""
    api_key_env: str | None = None
    """the environment variable holding the API key; None: no key (a local server)"""
    rubric: str = DEFAULT_RUBRIC
    """the judge's prompt: a template over {prompt} {reference} {response} {low} {high}, or a file holding one (a single
    line naming an existing file, relative to the current directory); read at load, so the resolved config keeps it"""
    examples: list[JudgeExample] = Field(default_factory=list)
    """worked gradings shown first (few-shot)"""
    show: Literal["final_reply", "final_answer", "conversation"] = "final_reply"
    """what {response} is: the last assistant message (final_reply), the environment's extracted answer (final_answer:
    the most cache hits in a group), or every turn with what the environment answered (conversation)"""
    scale: tuple[float, float] = (0.0, 10.0)
    """the reply's "Score: N" is on this scale, from low to high; the `judge` component is (N - low) / (high - low)"""
    weight: float = Field(1.0, allow_inf_nan=False)
    """of the judge component in total_reward"""
    max_tokens: int = Field(16, gt=0)
    """of the judge's reply"""
    temperature: float = Field(0.0, ge=0.0)
    """of the judge's reply (0: the same content gets the same grade)"""
    cache: bool = True
    """judge each distinct content once (a GRPO group's identical answers share one call)"""
    cache_size: int = Field(100_000, gt=0)
    """judgements kept, least recently used dropped first"""
    max_concurrency: int = Field(8, gt=0)
    """requests in flight at once"""
    requests_per_s: float | None = Field(None, gt=0.0)
    """requests started per second at most (None: no limit)"""
    max_retries: int = Field(3, ge=0)
    """a request refused for the server's sake (connection failed, timeout, 5xx, 408/409/429) is sent again up to this
    many times, retry_backoff_s x 2^k apart; then its trajectory is reward_failed. Other 4xx are not retried"""
    retry_backoff_s: float = Field(0.5, ge=0.0)
    """seconds before the first retry of a failed call, doubled after each"""
    timeout_s: float = Field(60.0, gt=0.0)
    """one request"""
    prices: JudgePrices = Field(default_factory=JudgePrices)
    """for judge/cost_usd"""
    on_parse_failure: Literal["no_opinion", "reward_failed"] = "no_opinion"
    """a reply without a score on the scale: no_opinion (the trajectory keeps its other components, no `judge` one, and
    the reply in its error) or reward_failed (the trajectory is not trained). Never a 0"""
    heldout: bool = False
    """judge evaluation episodes too (their success is the environment's; the score is stored)"""

    @field_validator("rubric")
    @classmethod
    def _read_rubric_file(cls, value: str) -> str:
        line = value.strip()
        if "\n" not in line and "{" not in line and Path(line).is_file():
            return Path(line).read_text()
        return value

    @model_validator(mode="after")
    def _rubric_and_scale(self) -> JudgeConfig:
        low, high = self.scale
        if not low < high:
            raise ValueError(f"reward.judge.scale: {list(self.scale)} is not [low, high] with low < high, e.g. [0, 10]")
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(self.rubric) if name is not None}
        except ValueError as err:
            raise ValueError(f"reward.judge.rubric: not a template ({err}); write literal braces as {{{{ }}}}") \
                from None
        unknown = sorted(names - set(RUBRIC_FIELDS))
        if unknown:
            raise ValueError(f"reward.judge.rubric: unknown field(s) {unknown}; a rubric may use "
                             f"{', '.join('{' + f + '}' for f in RUBRIC_FIELDS)} (or name a file that exists)")
        if "response" not in names:
            raise ValueError("reward.judge.rubric: it never shows the judge the trajectory; put {response} in it "
                             "(or name a file that exists)")
        return self
