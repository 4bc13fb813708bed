"""Gateway: an OpenAI-compatible endpoint in front of the engine for black-box agents, one session per rollout.

A rollout opens a Session (`open_session`): it gets a key, and every call the agent makes with that key
(`Authorization: Bearer <key>`, as the `openai` client sends it) is served by the engine and recorded: the prompt token
ids the engine was given, the sampled token ids, their logprobs and policy versions, taken from the engine at sampling
time. Nothing sampled is ever re-tokenized.

Assembly into a trajectory (the same form as a white-box one): when a call's messages extend the previous call's
messages plus the assistant reply the gateway gave (the usual agent loop: it appends our reply and the tool results),
the prompt is the previous context's exact tokens followed by the rendered new messages, and the call continues the same
context (one training sample). When they do not (the agent edited, dropped or reordered history), the call starts a new
context: the previous one is closed as a ContextSegment with the reason, and is trained as its own sample.

Budgets per session (calls, sampled tokens, context tokens, wall time) are enforced here: a call past one gets an
OpenAI-style 400 error with code `budget_exceeded` (the `openai` client raises, and does not retry) and the trajectory
is marked truncated. An unknown key, or the key of a closed session, gets 401. A key only ever reaches its own session:
there is no way to name another.

Programs (ThunderAgent's abstraction): each session is a Program with an id, the tokens in its context, its tools, the
engine it is bound to, its phase ("reasoning" while the engine generates for it, "acting" while the agent works between
calls) and status; `GET /programs` lists them (admin key). `engine.release(program_id)` is called when a session closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves endpoint annotations from the module

from loomrl.agent.loop import add_turn, finish_metadata
from loomrl.engine.base import EngineFault, SamplingParams, generate_resuming
from loomrl.model.chat import ChatRenderer
from loomrl.server import responses as oai
from loomrl.server.protocol import ChatCompletionRequest
from loomrl.types import ContextSegment, RolloutStatus, TokenSpan, Trajectory, new_id


@dataclass(slots=True, kw_only=True)
class Budget:
    max_calls: int | None = None
    max_sampled_tokens: int | None = None
    max_context_tokens: int | None = None  # prompt + max_tokens of a call
    max_wall_s: float | None = None


@dataclass(slots=True, kw_only=True)
class Program:
    program_id: str
    engine: str
    tools: list[str] = field(default_factory=list)
    phase: str = "acting"  # "reasoning" while the engine generates for it, "acting" between calls
    status: str = "running"  # running, finished, truncated, failed
    tokens_in_context: int = 0
    calls: int = 0
    started_at: float = field(default_factory=time.time)


def _normalize(message: dict[str, Any]) -> tuple:
    """What must be equal for a message to count as unchanged: role, content (None == ""), tool calls
    by name and parsed arguments, and the tool_call_id of tool results."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "")
        with contextlib.suppress(ValueError):  # arguments that are not JSON are compared as text
            args = json.loads(args) if isinstance(args, str) else args
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return (message.get("role"), content or "", tuple(calls), message.get("tool_call_id"))


class Session:
    """One rollout's calls and the trajectory they assemble into."""

    def __init__(self, gateway: Gateway, *, task_id: str, group_id: str, budget: Budget,
                 sampling: SamplingParams | None, position: int = -1):
        self.gateway = gateway
        self.session_id = new_id("sess")
        self.key = "sk-loomrl-" + secrets.token_urlsafe(24)
        self.budget = budget
        self.sampling = sampling  # when set, the run's sampling overrides what the agent asks for
        self.created = time.monotonic()
        self.program = Program(program_id=self.session_id, engine=gateway.engine_name)
        self.trajectory = Trajectory(task_id=task_id, trajectory_id=self.session_id, group_id=group_id or new_id("group"),
                                     position=position, temperature=sampling.temperature if sampling else 1.0)
        self.closed = False
        self.truncated_reason: str | None = None
        self.sampled_tokens = 0
        self.reward: dict[str, float] | None = None  # reported by the agent, where the task allows it
        self.engine_fault: str | None = None  # the engine failed during one of its calls
        self._known: list[tuple] | None = None  # normalized messages the current context holds
        self._last_closed = True
        self._lock = asyncio.Lock()  # one context is sequential: calls of a session are served in order

    # -- budgets ----------------------------------------------------------------------------------
    def _spent(self, prompt_len: int) -> str | None:
        """Which budget is spent, if one is (the session is then truncated)."""
        b = self.budget
        why = None
        if b.max_wall_s is not None and time.monotonic() - self.created > b.max_wall_s:
            why = f"wall-time budget of {b.max_wall_s}s is spent"
        elif b.max_calls is not None and self.program.calls >= b.max_calls:
            why = f"call budget of {b.max_calls} calls is spent"
        elif b.max_sampled_tokens is not None and self.sampled_tokens >= b.max_sampled_tokens:
            why = f"token budget of {b.max_sampled_tokens} sampled tokens is spent"
        elif b.max_context_tokens is not None and prompt_len >= b.max_context_tokens:
            why = f"context budget of {b.max_context_tokens} tokens is spent (prompt has {prompt_len})"
        if why:
            self.truncated_reason = why
            self.trajectory.status = RolloutStatus.TRUNCATED
            self.program.status = "truncated"
        return why

    def _max_tokens(self, prompt_len: int, asked: int) -> int:
        b, n = self.budget, asked
        if b.max_sampled_tokens is not None:
            n = min(n, b.max_sampled_tokens - self.sampled_tokens)
        if b.max_context_tokens is not None:
            n = min(n, b.max_context_tokens - prompt_len)
        return max(n, 1)

    # -- assembly ---------------------------------------------------------------------------------
    def plan(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[list[int], str | None]:
        """Prompt ids for this call, and why a new context starts (None: it continues the current one)."""
        renderer = self.gateway.renderer
        norm = [_normalize(m) for m in messages]
        known = self._known
        if known is not None and len(norm) > len(known) and norm[: len(known)] == known:
            return list(self.trajectory.token_ids) + renderer.continuation_ids(
                messages[: len(known)], messages[len(known):], closed=self._last_closed, tools=tools), None
        if known is None:
            return renderer.prompt_ids(messages, tools), "start"
        first = next((i for i, (a, b) in enumerate(zip(norm, known)) if a != b), min(len(norm), len(known)))
        reason = (f"history edited at message {first}" if first < min(len(norm), len(known))
                  else f"history shortened to {len(norm)} messages" if len(norm) <= len(known)
                  else "history changed")
        return renderer.prompt_ids(messages, tools), reason

    def record(self, messages: list[dict[str, Any]], prompt_ids: list[int], new_context: str | None,
               result, text: str, reply: dict[str, Any], finish_reason: str) -> None:
        traj = self.trajectory
        if new_context is not None:
            if traj.turns:  # close the current context
                traj.segments.append(ContextSegment(reason=new_context, prompt_ids=traj.prompt_ids,
                                                    token_ids=traj.token_ids, turns=traj.turns))
            traj.prompt_ids, traj.token_ids, traj.turns = list(prompt_ids), list(prompt_ids), []
        else:
            start = len(traj.token_ids)
            traj.token_ids.extend(prompt_ids[start:])
            last = traj.turns[-1]
            last.obs_span = TokenSpan(start=start, end=len(traj.token_ids))
            last.obs = "\n".join(str(m.get("content") or "") for m in messages[len(self._known or []):])
        add_turn(traj, result, act=text, finish_reason=finish_reason, tool_calls=list(reply.get("tool_calls") or []))
        self._known = [_normalize(m) for m in messages] + [_normalize(reply)]
        self._last_closed = result.finish_reason == "stop"
        self.program.calls += 1
        self.sampled_tokens += len(result.token_ids)
        self.program.tokens_in_context = len(traj.token_ids)

    def summary(self) -> dict[str, Any]:
        traj = self.trajectory
        return {"session_id": self.session_id, "calls": self.program.calls, "sampled_tokens": self.sampled_tokens,
                "contexts": len(traj.contexts()), "status": str(traj.status), "truncated_reason": self.truncated_reason,
                "program": asdict(self.program)}


class Gateway:
    """Sessions over one engine; `app()` is the FastAPI application to serve."""

    def __init__(self, engine, tokenizer, model_name: str = "loomrl", *, default_budget: Budget | None = None,
                 allow_agent_reward: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.model_name = model_name
        self.engine_name = type(engine).__name__
        self.default_budget = default_budget or Budget()
        self.allow_agent_reward = allow_agent_reward
        self.admin_key = "sk-loomrl-admin-" + secrets.token_urlsafe(24)
        self._by_key: dict[str, Session] = {}  # the open sessions

    # -- sessions ---------------------------------------------------------------------------------
    def open_session(self, *, task_id: str = "", group_id: str = "", position: int = -1, budget: Budget | None = None,
                     sampling: SamplingParams | None = None) -> Session:
        session = Session(self, task_id=task_id, group_id=group_id, budget=budget or self.default_budget,
                          sampling=sampling, position=position)
        self._by_key[session.key] = session
        return session

    def close_session(self, session: Session, *, failed: str | None = None) -> Trajectory:
        """End the session: its key stops working, the engine forgets the program, the trajectory is final."""
        session.closed = True
        self._by_key.pop(session.key, None)
        self.engine.release(session.program.program_id)
        traj = session.trajectory
        if failed:
            traj.status, traj.error = RolloutStatus.ENV_ERROR, failed
            session.program.status = "failed"
        elif session.program.status == "running":
            session.program.status = "finished"
        session.program.phase = "done"
        if session.truncated_reason:
            traj.error = traj.error or f"budget: {session.truncated_reason}"
        finish_metadata(traj, time.monotonic() - session.created)
        return traj

    def programs(self) -> list[dict[str, Any]]:
        return [asdict(s.program) for s in self._by_key.values()]

    def _session_for(self, request: Request) -> Session | None:
        if not (authorization := request.headers.get("authorization", "")).startswith("Bearer "):
            return None
        session = self._by_key.get(authorization[len("Bearer "):].strip())
        return session if session is not None and not session.closed else None

    # -- the chat endpoint ------------------------------------------------------------------------
    async def chat(self, session: Session, req: ChatCompletionRequest):
        if (bad := oai.bad_roles(req.messages)) is not None:
            return bad
        if req.n != 1:
            return oai.error_response(400, "n must be 1 through the gateway (one rollout, one context)", "n")
        async with session._lock:
            try:
                prompt_ids, new_context = session.plan(req.messages, req.tools)
            except Exception as err:  # noqa: BLE001 - a conversation the template cannot render
                return oai.error_response(400, f"cannot render messages with the chat template: {err}", "messages")
            asked = req.max_completion_tokens or req.max_tokens or 256
            if session.sampling is not None:
                asked = min(asked, session.sampling.max_tokens)  # the run's per-turn cap
            if (spent := session._spent(len(prompt_ids))) is not None:
                return oai.error_response(400, f"budget exceeded: {spent}; the rollout is over", None,
                                          code="budget_exceeded")
            sampling = replace(oai.sampling_params(req, session._max_tokens(len(prompt_ids), asked)), ignore_eos=False)
            if (run := session.sampling) is not None:  # the run's sampling overrides what the agent asks for
                sampling = replace(sampling, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
                                   seed=run.seed)
            session.program.phase = "reasoning"
            session.program.tools = [t.get("function", {}).get("name", "") for t in req.tools or []]
            try:
                result, _ = await generate_resuming(self.engine, prompt_ids, sampling, session.program.program_id,
                                                    group_id=session.trajectory.group_id)
            except EngineFault as err:  # the program sees a failed call; its trajectory says why
                session.engine_fault = str(err)
                raise
            finally:
                session.program.phase = "acting"
            text, reason = oai.sampled_text(self.tokenizer, result, sampling.stop)
            reply, reason = oai.assistant_message(text, reason, req.tools, self.renderer.messages)
            session.record(req.messages, prompt_ids, new_context, result, text, reply, reason)
        choice = {"index": 0, "message": reply, "finish_reason": reason,
                  "logprobs": oai.chat_logprobs(self.tokenizer, result, top=False) if req.logprobs else None}
        body = oai.completion_body("chatcmpl", "chat.completion", self.model_name, [choice], len(prompt_ids),
                                   len(result.token_ids))
        if req.return_token_ids:  # vLLM's extension: the exact ids (what the trajectory trains on)
            choice["token_ids"] = list(result.token_ids)
            body["prompt_token_ids"] = prompt_ids
        return body

    # -- the application --------------------------------------------------------------------------
    def app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="loomrl gateway", docs_url=None, redoc_url=None)
        gateway = self

        def unauthorized():
            return oai.error_response(401, "invalid or expired API key (each rollout has its own key; it ends with the rollout)",
                          None, kind="authentication_error", code="invalid_api_key")

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError):
            return oai.invalid_request(exc)

        @app.get("/v1/models")
        async def models(request: Request):
            return oai.model_list(gateway.model_name, 0) if gateway._session_for(request) else unauthorized()

        @app.post("/v1/chat/completions")
        async def chat(req: ChatCompletionRequest, request: Request):
            if (session := gateway._session_for(request)) is None:
                return unauthorized()
            body = await gateway.chat(session, req)
            if not req.stream or isinstance(body, JSONResponse):
                return body
            return StreamingResponse(oai.stream_events(body, req.include_usage), media_type="text/event-stream")

        @app.get("/v1/session")
        async def own_session(request: Request):
            session = gateway._session_for(request)
            return unauthorized() if session is None else session.summary()

        @app.post("/v1/reward")
        async def reward(request: Request):
            if (session := gateway._session_for(request)) is None:
                return unauthorized()
            if not gateway.allow_agent_reward:
                return oai.error_response(403, "this task does not accept rewards from the agent", None, kind="permission_error")
            try:
                data = await request.json()
                session.reward = {str(k): float(v) for k, v in dict(data.get("reward", {})).items()}
            except (ValueError, TypeError, AttributeError):
                return oai.error_response(400, 'body must be {"reward": {"name": number, ...}}', "reward")
            return {"ok": True}

        @app.get("/programs")
        async def programs(request: Request):
            if request.headers.get("authorization") != f"Bearer {gateway.admin_key}":
                return oai.error_response(403, "the program list needs the gateway's admin key", None, kind="permission_error")
            return {"programs": gateway.programs()}

        return app


class ServerThread:
    """Serve an ASGI app with uvicorn on a background thread, on a TCP port of 127.0.0.1 (`url`) or
    on a unix socket (`uds`, for sandboxes that have no network but can be handed a socket file)."""

    def __init__(self, app, *, uds: str | None = None):
        import os
        import socket
        import threading

        import uvicorn

        self.uds, self.port = uds, 0
        if uds is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.port = sock.getsockname()[1]
        config = (uvicorn.Config(app, log_level="warning", uds=uds) if uds is not None
                  else uvicorn.Config(app, log_level="warning", host="127.0.0.1", port=self.port))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="loomrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        where = f"unix socket {uds}" if uds is not None else f"127.0.0.1:{self.port}"
        while not self._server.started:  # bounded: 30 s, or until the server's thread gives up
            if not self._thread.is_alive():
                raise RuntimeError(f"gateway: the HTTP server on {where} failed to start (uvicorn's error is "
                                   "logged above)")
            if time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"gateway: the HTTP server on {where} did not start within 30 s")
            time.sleep(0.02)
        if uds is not None:
            os.chmod(uds, 0o666)  # sandboxed agents run as their own uids

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
