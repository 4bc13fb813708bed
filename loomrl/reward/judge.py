"""Judge: an LLM grades a trajectory against a rubric (reward.judge; docs/rewards.md "LLM judge").

The judge is shown the rubric (a template over the task's prompt, its reference answer and the trajectory's reply:
reward.judge.show) after any worked examples, and answers "Score: N" on the declared scale; the `judge` component
is N normalised to [0, 1]. A reply without such a line, or with N off the scale, is a parse failure: recorded (the
count, the reply itself in the trajectory's error), never a 0. The endpoint's limits, retries and counts are
JudgeClient's (reward/judge_client.py); a judgement that got no reply raises JudgeUnavailable, which RewardPool turns
into reward_failed.

The cache: judgements are keyed by everything the judge is sent (the rendered rubric, so the trajectory's content
and the rubric, with the examples) and the model, temperature and reply budget. A GRPO group's identical answers are
judged once: the first asks, the others share its call while it is in flight, or its verdict after. A failure (no
reply) is not kept: the next identical trajectory asks again. The cache is per process (each rollout worker or
reward actor has its own) and bounded (reward.judge.cache_size, least recently used dropped).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loomrl.config.judge import JudgeConfig
from loomrl.reward.judge_client import JudgeClient, JudgeMetrics, JudgeUnavailable
from loomrl.types import Task, Trajectory

if TYPE_CHECKING:  # openai is the judge extra's
    from openai.types.chat import ChatCompletionMessageParam

__all__ = ["Judge", "JudgeUnavailable", "Verdict", "judge_for", "parse_score"]

log = logging.getLogger(__name__)

SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)  # "Score: 7", "score = 7.5", "**Score:** 7"


@dataclass(slots=True, frozen=True, kw_only=True)
class Verdict:
    """A judge's reply: the normalised score, or None with why it did not parse."""

    score: float | None  # in [0, 1]; None: no score on the scale in the reply
    reply: str
    why: str = ""  # a parse failure's reason


def parse_score(reply: str, scale: tuple[float, float]) -> Verdict:
    """The first "Score: N" of `reply`, normalised over `scale`; a Verdict with score None if there is none on it."""
    low, high = scale
    found = SCORE.search(reply)
    if found is None:
        return Verdict(score=None, reply=reply, why="no 'Score: N' line")
    value = float(found.group(1))
    if not low <= value <= high:
        return Verdict(score=None, reply=reply, why=f"{value:g} is off the scale [{low:g}, {high:g}]")
    return Verdict(score=(value - low) / (high - low), reply=reply)


class Judge:
    """reward.judge: grade() a trajectory; metrics counts what it cost."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.client = JudgeClient(base_url=cfg.base_url, model=cfg.model, api_key_env=cfg.api_key_env,
                                  max_concurrency=cfg.max_concurrency, requests_per_s=cfg.requests_per_s,
                                  max_retries=cfg.max_retries, retry_backoff_s=cfg.retry_backoff_s,
                                  timeout_s=cfg.timeout_s, prices=cfg.prices)
        self._done: OrderedDict[str, Verdict] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Verdict]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        low, high = cfg.scale
        self._bounds = {"low": _number(low), "high": _number(high)}
        self._shots: list[ChatCompletionMessageParam] = []
        for ex in cfg.examples:
            self._shots.extend([{"role": "user", "content": self._render(ex.prompt, ex.reference, ex.response)},
                                {"role": "assistant", "content": f"Score: {_number(ex.score)}"}])

    @property
    def metrics(self) -> JudgeMetrics:
        return self.client.metrics

    async def aclose(self) -> None:
        await self.client.aclose()

    def wants(self, task: Task) -> bool:
        """Whether trajectories of `task` are judged: training ones, and evaluation's with reward.judge.heldout."""
        return task.split == "train" or self.cfg.heldout

    def messages(self, traj: Trajectory, task: Task) -> list[ChatCompletionMessageParam]:
        """What the judge is sent for `traj`: the worked examples, then the rubric over this trajectory."""
        return [*self._shots, {"role": "user", "content": self._render(task.prompt, task.answer, self.response(traj))}]

    def response(self, traj: Trajectory) -> str:
        """The part of `traj` the judge grades (reward.judge.show)."""
        turns = traj.all_turns()
        if self.cfg.show == "final_answer":
            return traj.final_answer if traj.final_answer is not None else "(no answer)"
        if self.cfg.show == "final_reply":
            return turns[-1].act if turns else "(no reply)"
        return "\n".join(f"Assistant: {t.act}" + (f"\nResult: {t.obs}" if t.obs else "") for t in turns) \
            or "(no reply)"

    async def grade(self, traj: Trajectory, task: Task) -> Verdict:
        """The judge's verdict on `traj`, from the cache when its content was judged already; JudgeUnavailable when
        the endpoint gave no reply."""
        messages = self.messages(traj, task)
        if not self.cfg.cache:
            return await self._ask(messages)
        if asyncio.get_running_loop() is not self._loop:  # futures of another loop cannot be awaited here
            self._loop, self._inflight = asyncio.get_running_loop(), {}
        key = self._key(messages)
        done = self._done.get(key)
        if done is not None:
            self._done.move_to_end(key)
            self.metrics.cache_hits += 1
            return done
        shared = self._inflight.get(key)
        if shared is None:  # the first to ask: a task of its own, so that a caller cancelled does not cancel the others
            shared = self._inflight[key] = asyncio.ensure_future(self._ask(messages))
            shared.add_done_callback(lambda f: self._settle(key, f))
        else:
            self.metrics.cache_hits += 1
        return await asyncio.shield(shared)

    async def _ask(self, messages: list[ChatCompletionMessageParam]) -> Verdict:
        self.metrics.calls += 1
        reply = await self.client.complete(messages, max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
        verdict = parse_score(reply, self.cfg.scale)
        if verdict.score is None:
            self.metrics.parse_failures += 1
            n = self.metrics.parse_failures
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th...: a rubric the judge does not follow shows at once
                log.warning("LLM judge: no score in a reply (%s): %r (%d of %d replies so far)", verdict.why,
                            reply[:200], n, self.metrics.calls)
        return verdict

    def _settle(self, key: str, future: asyncio.Future[Verdict]) -> None:
        self._inflight.pop(key, None)
        if not future.cancelled() and future.exception() is None:  # no reply: not kept, asked again next time
            self._done[key] = future.result()
            if len(self._done) > self.cfg.cache_size:
                self._done.popitem(last=False)

    def _key(self, messages: list[ChatCompletionMessageParam]) -> str:
        c = self.cfg
        return hashlib.sha256(json.dumps([c.base_url, c.model, c.temperature, c.max_tokens, messages],
                                         sort_keys=True).encode()).hexdigest()

    def _render(self, prompt: str, reference: str, response: str) -> str:
        return self.cfg.rubric.format(prompt=prompt, reference=reference or "(none)", response=response,
                                      **self._bounds)


def judge_for(cfg: JudgeConfig | None) -> Judge | None:
    """The run's judge (reward.judge), or None."""
    return Judge(cfg) if cfg is not None else None


def _number(x: float) -> str:
    """10.0 -> "10", 7.5 -> "7.5": as a person writes a score."""
    return f"{x:g}"
