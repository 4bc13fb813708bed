"""An agent whose replies come from an OpenAI-compatible endpoint (a strong model behind vLLM or a hosted API,
`loomrl serve`), playing an Env in message space: what `loomrl check-env` (runtime/check_env.py) runs to tell a broken
environment from a weak model.

Each turn sends the conversation and the observation's tool schemas to /v1/chat/completions and turns the reply into
the text the environment parses, as loomrl reads an OpenAI conversation for a template without tool support
(model/messages.py TemplateMessages): the reply's text, then each of its tool calls in Hermes form
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which model/tools.py parses). A reply whose text already
holds its calls in that form (`loomrl serve` keeps the text when the model wrote words before a call) is taken as it
is, so that no call runs twice. The environment's answer goes back as `tool` messages answering the reply's calls by
id when it answered each call with one; otherwise (the model wrote `calc(2 + 3)` as text, or the environment answered
in a `user` message) the reply goes back as its text and the answer as `user` messages: an OpenAI server refuses a
`tool` message that answers no call of the message before it.

Limits: each request is bounded by `timeout_s`, and one that failed for the server's sake (connection refused or
reset, timeout, 5xx, 408, 409, 429: reward/judge_client.py's rule) is sent again up to `max_retries` times,
0.5 s x 2^k apart; then EndpointUnavailable, as for a refused key or model (401, 403, 404): no episode can be played
without the endpoint, so the check stops with that one line. Another refusal (a 400: the conversation is too long for
the endpoint's context) ends that episode `engine_error`. Each env call (reset, step, finalize) is bounded by
`env_timeout_s` (agent.trajectory_timeout_s); past it the episode ends `timeout`: the environment's time only, the
endpoint's has its own bound. Before any episode, resolve_model asks /models which model to use (the check that the
endpoint answers at all); a 404 there is a server without that list, and --model is then taken as given.

Not here: token ids, logprobs and context budgets (the endpoint's tokenizer is not ours). An episode played here has
its turns, tool-call records, final answer and environment record, the inputs of a reward, and no tokens: it is for
checking an environment, never for training.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from typing import Any

from loomrl.agent.loop import finish_metadata, record_step, split_think  # the loop's: rewards read the same turns
from loomrl.config import ConfigError
from loomrl.env.base import Env, ToolTimeout
from loomrl.errors import error_line, named_line, with_frames
from loomrl.model.messages import TemplateMessages
from loomrl.reward.judge_client import RETRIED_STATUS
from loomrl.types import RolloutStatus, Task, Trajectory, Turn, new_id

AUTH_STATUS = frozenset({401, 403})  # a wrong or missing key
STOPPING_STATUS = AUTH_STATUS | {404}  # or a wrong model or URL: every request would fail alike


class EndpointUnavailable(Exception):
    """The endpoint cannot serve the check (unreachable, retries spent, key or model refused): the message says why."""


class EndpointRefused(Exception):
    """The endpoint refused one request (e.g. a conversation too long for its context): that episode is engine_error."""


class EndpointPolicy:
    """One model on one endpoint; `reply` is safe to call concurrently from the loop that first calls it."""

    def __init__(self, *, base_url: str, model: str | None, api_key_env: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 256, timeout_s: float = 120.0, max_retries: int = 2):
        if importlib.util.find_spec("openai") is None:
            raise ConfigError("check-env needs the openai client; run `pip install 'loomrl[judge]'`")
        key = "unused"  # openai refuses an empty key; a local server ignores it
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ConfigError(f"check-env --api-key-env {api_key_env}: the environment variable is not set; export "
                                  "it with the endpoint's API key (or leave the flag out for a server that needs none)")
        from openai import AsyncOpenAI

        self.base_url, self.model = base_url.rstrip("/"), model
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.requests = self.retries = 0
        self._client = AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._client.close()

    async def resolve_model(self) -> str:
        """Ask the endpoint which models it serves (also the check that it answers at all): --model must be one of
        them; without --model, the first."""
        import openai

        try:
            # a 404 here is a server without /models, not a wrong URL: asked of the chat endpoint, it would be
            served = [m.id for m in (await self._bounded(self._client.models.list, stopping=AUTH_STATUS)).data]
        except EndpointRefused as err:  # a server without /models: only a model named by the user can be asked for
            if self.model is None:
                raise EndpointUnavailable(f"{self.base_url} does not list its models ({err}); name one with "
                                          "--model") from None
            return self.model
        except openai.APIError as err:  # a 200 that is no model list
            raise EndpointUnavailable(f"{self.base_url}/models gave no model list: {named_line(err, 200)}") from None
        if self.model is None:
            if not served:
                raise EndpointUnavailable(f"{self.base_url} serves no model")
            self.model = served[0]
        elif self.model not in served:
            raise EndpointUnavailable(f"{self.base_url} does not serve --model {self.model!r}; it serves "
                                      f"{', '.join(map(repr, served[:10]))}")
        return self.model

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The endpoint's assistant message for `messages` (with `tools` offered), as a dict."""
        assert self.model is not None, "resolve_model() names the model first"
        # the messages and tools are the environment's OpenAI dicts, not the client's TypedDicts: passed as they are
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                "max_completion_tokens": self.max_tokens, **({"tools": tools} if tools else {})}
        create = self._client.chat.completions.create
        out = await self._bounded(lambda: create(**body))
        if not out.choices:
            raise EndpointRefused(f"{self.base_url} answered with no choice")
        message = out.choices[0].message.model_dump(exclude_none=True)
        message["finish_reason"] = out.choices[0].finish_reason
        return message

    async def _bounded(self, request, stopping: frozenset[int] = STOPPING_STATUS):
        """`request()` within timeout_s, again on the server's failures up to max_retries times; a refusal with a
        `stopping` status stops the check."""
        import openai

        for attempt in range(self.max_retries + 1):
            self.requests += 1
            try:
                async with asyncio.timeout(self.timeout_s):  # the whole request, however the server trickles it
                    return await request()
            except (openai.APIError, TimeoutError) as err:
                status = err.status_code if isinstance(err, openai.APIStatusError) else None
                why = (f"timed out after {self.timeout_s:g}s" if isinstance(err, (TimeoutError, openai.APITimeoutError))
                       else f"HTTP {status}: {error_line(err)[:200]}" if status is not None else named_line(err, 200))
                if status in stopping:
                    raise EndpointUnavailable(f"{self.base_url} refused the request: {why}") from None
                if not (status is None or status >= 500 or status in RETRIED_STATUS):
                    raise EndpointRefused(f"{self.base_url} refused the request: {why}") from None
                if status is None and not isinstance(err, (openai.APIConnectionError, TimeoutError)):
                    raise EndpointRefused(f"{self.base_url} gave no usable answer: {why}") from None
                if attempt == self.max_retries:
                    raise EndpointUnavailable(f"no reply from {self.base_url} after {attempt + 1} attempt(s); the "
                                              f"last: {why}") from None
                self.retries += 1
                await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable: the loop returns or raises")


def action_text(reply: dict[str, Any]) -> str:
    """The text the environment parses for an assistant reply: its text, then its tool calls in Hermes form."""
    content = reply.get("content") or ""
    calls = [c for c in reply.get("tool_calls") or [] if c.get("function")]
    if not calls or "<tool_call>" in content:
        return content
    return TemplateMessages(tool_support=False).prepare([{"role": "assistant", "content": content,
                                                          "tool_calls": calls}])[0]["content"]


def exchange(reply: dict[str, Any], action: str, observation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply and the environment's answer as the endpoint is shown them next turn (see the module's doc)."""
    calls = [c for c in reply.get("tool_calls") or [] if c.get("function")]
    answers = [m for m in observation if m.get("role") == "tool"]
    if calls and len(answers) == len(calls) == len(observation):
        return [{"role": "assistant", "content": reply.get("content"), "tool_calls": calls},
                *({"role": "tool", "tool_call_id": c["id"], "content": str(m.get("content") or "")}
                  for c, m in zip(calls, answers))]
    shown = [{"role": "user", "content": str(m.get("content") or "")} if m.get("role") == "tool" else dict(m)
             for m in observation]
    return [{"role": "assistant", "content": action}, *shown]


async def play(env: Env, task: Task, policy: EndpointPolicy, *, max_turns: int, env_timeout_s: float,
               group_id: str = "") -> Trajectory:
    """One episode of `task`, the endpoint choosing each reply; how it ended is its status (errors are data), except
    EndpointUnavailable, which ends the check. The environment is closed in every case."""
    traj = Trajectory(task_id=task.task_id, trajectory_id=new_id("check"), group_id=group_id or new_id("group"),
                      temperature=policy.temperature, prompt=task.prompt, answer=task.answer, split=task.split)
    traj.metadata.env_version = env.version
    start = time.perf_counter()
    try:
        await _turns(env, task, policy, traj, max_turns, env_timeout_s)
        if traj.status == RolloutStatus.TRUNCATED:  # as the rollout worker does: e.g. codefix runs its tests now
            answer = await asyncio.wait_for(env.finalize(), env_timeout_s)
            if answer is not None:
                traj.final_answer = answer
    except EndpointUnavailable:
        raise
    except EndpointRefused as err:
        traj.status, traj.error = RolloutStatus.ENGINE_ERROR, str(err)
    except Exception as err:  # noqa: BLE001 - errors are data: the environment's failure is this episode's
        timeout = isinstance(err, (ToolTimeout, TimeoutError))
        traj.status = RolloutStatus.TIMEOUT if timeout else RolloutStatus.ENV_ERROR
        what = f"an env call ran past agent.trajectory_timeout_s={env_timeout_s:g}s" if type(err) is TimeoutError \
            else f"{type(err).__name__}: {err}"
        traj.error = with_frames(what, err)
        traj.metadata.env_errors += 1
        if traj.turns:
            traj.turns[-1].error = traj.error
    finally:
        await env.close()
    finish_metadata(traj, time.perf_counter() - start)
    return traj


async def _turns(env: Env, task: Task, policy: EndpointPolicy, traj: Trajectory, max_turns: int,
                 env_timeout_s: float) -> None:
    t0 = time.perf_counter()
    obs = await asyncio.wait_for(env.reset(task), env_timeout_s)
    traj.metadata.reset_s = time.perf_counter() - t0
    messages = list(obs.messages)
    traj.status = RolloutStatus.TRUNCATED  # until a turn says done
    for _ in range(max_turns):
        t0 = time.perf_counter()
        reply = await policy.reply(messages, obs.tools)
        t1 = time.perf_counter()
        action = action_text(reply)
        think, act = split_think(action)
        # a reasoning parser's text (vLLM: `reasoning`, formerly `reasoning_content`), else the reply's <think>
        think = str(reply.get("reasoning") or reply.get("reasoning_content") or "") or think
        turn = Turn(think=think, act=act, finish_reason=str(reply.get("finish_reason") or ""), gen_s=t1 - t0)
        traj.turns.append(turn)
        step = await asyncio.wait_for(env.step(action), env_timeout_s)
        turn.env_s = time.perf_counter() - t1
        if record_step(traj, turn, step):
            return
        turn.obs = "\n".join(str(m.get("content", "")) for m in step.observation)
        messages.extend(exchange(reply, action, step.observation))
