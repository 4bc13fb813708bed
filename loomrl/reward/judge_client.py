"""JudgeClient: chat completions from an OpenAI-compatible endpoint, within limits, for LLM judges (reward/judge.py,
reward/task_review.py).

What it holds to: at most `max_concurrency` requests in flight; request starts at least 1/requests_per_s apart, in
arrival order (a token bucket of one token, each start timed from when the one before it went: no burst, even after
the event loop stalled, so the rate holds over any window); each request bounded by `timeout_s`; a
request that failed for the server's sake (connection refused or reset, timeout, 5xx, 408, 409, 429) sent again up to
`max_retries` times, `retry_backoff_s` x 2^k apart, outside the concurrency slot; then JudgeUnavailable, which the
caller records on its trajectory (never a 0). Every request, retry and token is counted (JudgeMetrics), with its cost
at the configured prices. It uses the real `openai` AsyncOpenAI client (its own retries off: these are counted here).

Not covered: a server that answers 200 with nonsense (the caller's parser decides), and limits shared with other
processes (each rollout worker or reward actor holds its own client, so N of them send N x requests_per_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loomrl.config.judge import JudgePrices
from loomrl.errors import error_line, named_line

if TYPE_CHECKING:  # openai is the judge extra's: imported where a request is made
    from openai.types.chat import ChatCompletionMessageParam

log = logging.getLogger(__name__)

RETRIED_STATUS = frozenset({408, 409, 429})  # and every 5xx: the server's trouble, worth another try


class JudgeUnavailable(Exception):
    """The endpoint gave no reply: retries spent, or a request it refused (the message says which and why)."""


@dataclass(slots=True)
class JudgeMetrics:
    """Counters since the client was made (the run's step metrics log their change per step as judge/<name>)."""

    calls: int = 0  # judgements asked of the endpoint (a cache hit is none)
    cache_hits: int = 0  # judgements answered from the cache, or by sharing an identical one in flight
    parse_failures: int = 0  # replies with no score on the scale (no value for their trajectories, never a 0)
    failures: int = 0  # judgements that got no reply (retries spent, or refused): their trajectories reward_failed
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    timeouts: int = 0  # requests past timeout_s (each also retried or failed)
    prompt_tokens: int = 0  # as the endpoint's `usage` reports them
    completion_tokens: int = 0
    cost_usd: float = 0.0  # the tokens at reward.judge.prices
    busy_s: float = 0.0  # wall time with at least one request in flight: at most what the judge adds to a step

    def as_dict(self) -> dict[str, float]:
        return {f"judge/{k}": float(v) for k, v in dataclasses.asdict(self).items()}


class RateLimiter:
    """Starts at least 1/rate apart, in arrival order: each caller waits for the one before it, then until 1/rate after
    that one went (as it resumed, not as it was scheduled: a loop that stalled does not release a burst after)."""

    def __init__(self, rate: float | None):
        self.interval = 1.0 / rate if rate else 0.0
        self._last = -float("inf")
        self._turn = asyncio.Lock()  # binds to the loop that first waits on it: one RateLimiter per loop

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._turn:  # FIFO: the waiters go in the order they came
            delay = self._last + self.interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._last = time.monotonic()


class JudgeClient:
    """One model on one endpoint. complete() is safe to call concurrently from one event loop; the HTTP client and
    the semaphore are made on first use in each loop (a run may use several, one after another)."""

    def __init__(self, *, base_url: str, model: str, api_key_env: str | None = None, max_concurrency: int = 8,
                 requests_per_s: float | None = None, max_retries: int = 3, retry_backoff_s: float = 0.5,
                 timeout_s: float = 60.0, prices: JudgePrices | None = None, field: str = "reward.judge.api_key_env"):
        from loomrl.config import ConfigError

        if importlib.util.find_spec("openai") is None:
            raise ConfigError("config error: an LLM judge (reward.judge, validate-tasks --judge) needs the openai "
                              "client; run `pip install 'loomrl[judge]'`")
        key = "unused"  # openai refuses an empty key; a local server ignores it
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ConfigError(f"config error: {field}: the environment variable {api_key_env} is not set; "
                                  f"export it with the judge endpoint's API key (or leave {field} out for a server "
                                  "that needs none)")
        self.base_url, self.model, self._key = base_url, model, key
        self.max_concurrency, self.max_retries = max_concurrency, max_retries
        self.retry_backoff_s, self.timeout_s = retry_backoff_s, timeout_s
        self.prices = prices or JudgePrices()
        self.requests_per_s = requests_per_s
        self.metrics = JudgeMetrics()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0
        self._busy_since = 0.0

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            from openai import AsyncOpenAI

            self._loop = loop
            self._client = AsyncOpenAI(base_url=self.base_url, api_key=self._key, max_retries=0,
                                       timeout=self.timeout_s)
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._limiter = RateLimiter(self.requests_per_s)

    async def aclose(self) -> None:
        """Closes the HTTP client's connections (on the loop that made them: left open, they are closed when the
        client is collected, after that loop may have closed, and httpx logs an error)."""
        if self._loop is asyncio.get_running_loop():
            await self._client.close()
            self._loop = None

    async def complete(self, messages: list[ChatCompletionMessageParam], *, max_tokens: int, temperature: float,
                       seed: int | None = None) -> str:
        """The reply's text ("" when it has none); JudgeUnavailable when no reply came."""
        import openai

        self._bind()
        for attempt in range(self.max_retries + 1):
            try:
                async with self._slots:
                    await self._limiter.wait()
                    return await self._request(messages, max_tokens, temperature, seed)
            except (openai.APIError, TimeoutError) as err:
                status = err.status_code if isinstance(err, openai.APIStatusError) else None
                why = _describe(err, self.timeout_s)
                retried = isinstance(err, (openai.APIConnectionError, TimeoutError)) or (
                    status is not None and (status >= 500 or status in RETRIED_STATUS))
                if not retried:  # another 4xx, or a 200 that is no chat completion: asking again cannot help
                    what = "refused the request" if status is not None else "gave no chat completion"
                    raise self._failed(f"{self.base_url} {what}: {why}") from None
                if attempt == self.max_retries:
                    raise self._failed(f"no reply from {self.base_url} after {attempt + 1} attempt(s); the last: "
                                       f"{why}") from None
                self.metrics.retries += 1
                delay = self.retry_backoff_s * 2 ** attempt
                log.debug("judge request failed (%s); again in %.2fs", why, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises")

    def _failed(self, why: str) -> JudgeUnavailable:
        """Counted, and said in the log at the 1st, 2nd, 4th, 8th... failure (a judge that is down fails them all)."""
        self.metrics.failures += 1
        n = self.metrics.failures
        if n & (n - 1) == 0:
            log.warning("LLM judge: %s (%d judgement(s) failed so far; their trajectories are reward_failed)", why, n)
        return JudgeUnavailable(why)

    async def _request(self, messages: list[ChatCompletionMessageParam], max_tokens: int, temperature: float,
                       seed: int | None) -> str:
        import openai

        m = self.metrics
        m.requests += 1
        if self._inflight == 0:
            self._busy_since = time.perf_counter()
        self._inflight += 1
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole request, however the server trickles it
                create = self._client.chat.completions.create
                # no seed: none sent (openai>=1.40 has no one "omitted" value across its versions)
                out = await (create(model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature)
                             if seed is None else
                             create(model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature,
                                    seed=seed))
        except (TimeoutError, openai.APITimeoutError):  # ours, or the HTTP client's own
            m.timeouts += 1
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                m.busy_s += time.perf_counter() - self._busy_since
        if out.usage is not None:  # a server that reports none costs nothing we can count
            prompt, completion = out.usage.prompt_tokens or 0, out.usage.completion_tokens or 0
            m.prompt_tokens += prompt
            m.completion_tokens += completion
            m.cost_usd += (prompt * self.prices.prompt + completion * self.prices.completion) / 1e6
        return (out.choices[0].message.content or "") if out.choices else ""


def _describe(err: Exception, timeout_s: float) -> str:
    """One line: what went wrong with a request."""
    import openai

    if isinstance(err, (TimeoutError, openai.APITimeoutError)):
        return f"timed out after timeout_s={timeout_s:g}s"
    if isinstance(err, openai.APIStatusError):
        return f"HTTP {err.status_code}: {error_line(err)[:200]}"
    return named_line(err, 200)
