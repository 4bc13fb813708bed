"""`env.name: openenv:<server>`: an OpenEnv (openenv-core 0.3.0) environment, trained on with the exact tokens loomrl's
engine sampled (docs/environments.md, 'OpenEnv environments').

`<server>` is a running server's URL, or the `package.module:app` of an environment package's FastAPI app, which is
started with uvicorn on a free loopback port in each process that uses the environment (LocalServer) and stopped when
that process exits or dies; one not healthy within `env.args.start_timeout_s` stops the run at load in one line.

An episode is one OpenEnv session on the server's `/ws` WebSocket (its HTTP `/reset` and `/step` make a fresh
environment per request: no multi-turn episode there). The wire is openenv-core's: `{"type": "reset" | "step" |
"close", "data": ...}` answered by `{"type": "observation", "data": {observation, reward, done}}` or `{"type":
"error"}`, spoken with `websockets` directly because importing openenv.core loads gradio (about 9 s a process). The
reply becomes the action as the server's `/schema` says: a text environment's one string field (or
`env.args.action_field`); an MCP environment's (CallToolAction) `call_tool` steps, one per `<tool_call>`, with the
tools listed at reset. An observation becomes a user message (a tool result a `tool` message). The reward is the
episode's return (the sum of the step rewards); tasks are reset seeds, or a `data:` section's rows as reset() keyword
arguments.

Failures: a server that cannot be reached, answers with an error, closes the session or does not answer within
`env.args.timeout_s` ends the episode `env_error` (EnvCrash), never a reward of 0. Connecting is retried
`connect_attempts` times and a server at capacity waited for up to `session_wait_s`; a step is never retried (it may
not be idempotent). Not covered: Docker images and Hugging Face Spaces (start them, give the URL), OpenEnv's
production mode (JSON-RPC MCP only), rubrics apart from the step rewards, non-text observations.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup, opening_messages
from loomrl.env.base import Env, EnvCrash, Observation, StepResult
from loomrl.env.tools import describe_schemas
from loomrl.errors import folded
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task, Trajectory

log = logging.getLogger(__name__)
TESTED = "0.3.0"  # the openenv-core release whose wire protocol this adapter speaks (pyproject's `openenv` extra)
_FAILURES = {"tool_not_found": "refused", "invalid_args": "refused", "timeout": "timeout"}  # else "raised"


class OpenEnvArgs(BaseModel):
    """env.args of env.name=openenv:<server>."""

    model_config = ConfigDict(extra="forbid")
    env_id: str  # from env.name: http(s)://host:port, or package.module:app to start
    paths: list[str] = []  # folders put first on a started server's PYTHONPATH
    action_field: str | None = None  # the action's text field; None: its one required string field
    observation_field: str | None = None  # the observation's text field; None: its only string field, else its JSON
    system_prompt: str | None = None
    reset_args: dict[str, Any] = {}  # keyword arguments of every reset (under a data: row's and the seed)
    success_threshold: float = 1.0
    start_timeout_s: float = Field(60.0, gt=0)  # bound of a server's start (or a URL's first health check)
    timeout_s: float = Field(60.0, gt=0)  # bound of each request: connect, reset, step
    connect_attempts: int = Field(3, ge=1)
    session_wait_s: float = Field(60.0, ge=0)  # waiting for a session slot on a server at capacity
    max_sessions: int = Field(1, ge=1)  # this process's sessions at once (create_app's max_concurrent_envs: 1)


class LocalServer:
    """An environment package's app run by uvicorn on a free loopback port; stopped at exit, or when its parent dies."""

    def __init__(self, app: str, paths: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix="loomrl-openenv-", suffix=".log")[1])
        found = [*map(os.path.abspath, paths), os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in found if p)}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509 - only prctl, before exec
        atexit.register(self.stop)

    def last_line(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return folded(lines[-1]) if lines else "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no server outlives a killed trainer


def _get(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the user's own server
        return json.loads(r.read())


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment server (see the module's doc)."""

    Args = OpenEnvArgs

    def __init__(self, args: OpenEnvArgs):
        self.args = args
        self.name = f"openenv:{args.env_id}"
        self.server: LocalServer | None = None
        try:
            installed = dist_version("openenv-core")
        except PackageNotFoundError:
            raise ConfigError(f"config error: env.name={self.name}: openenv-core is not installed; pip install "
                              f"'loomrl[openenv]' (openenv-core=={TESTED})") from None
        if installed != TESTED:
            log.warning("env.name=%s: openenv-core %s is installed; this adapter is written for %s", self.name,
                        installed, TESTED)
        if "://" not in args.env_id:
            self.server = LocalServer(args.env_id, args.paths)
        self.url = self.server.url if self.server else args.env_id.rstrip("/")
        self._wait_healthy()
        schema = self._fetch("schema")
        meta = self._fetch("metadata")
        self.version = f"openenv:{meta.get('name', 'env')}-{meta.get('version') or '0'}"
        # None: an MCP environment, whose actions are tool calls; else the action's field the reply goes in
        self.action_field = None if schema["action"].get("title") == "CallToolAction" else \
            self._text_field(schema["action"])
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def _fail(self, why: str) -> ConfigError:
        if self.server is not None:
            why = f"{why}; its last log line: {self.server.last_line()}"
            self.server.stop()
        return ConfigError(f"config error: env.name={self.name}: {why}")

    def _wait_healthy(self) -> None:
        deadline, last = time.monotonic() + self.args.start_timeout_s, "no answer"
        while time.monotonic() < deadline:
            if self.server is not None and self.server.proc.poll() is not None:
                raise self._fail(f"the server exited with code {self.server.proc.returncode} before it was healthy")
            try:
                if _get(f"{self.url}/health", 2.0).get("status") == "healthy":
                    return
                last = "unhealthy"
            except (OSError, ValueError) as err:
                last = f"{type(err).__name__}: {err}"
            time.sleep(0.2)
        raise self._fail(f"the server at {self.url} was not healthy within env.args.start_timeout_s="
                         f"{self.args.start_timeout_s:g} s (last: {folded(last, 200)})")

    def _fetch(self, path: str) -> dict[str, Any]:
        try:
            return _get(f"{self.url}/{path}", self.args.timeout_s)
        except (OSError, ValueError) as err:
            raise self._fail(f"GET /{path} failed: {type(err).__name__}: {err}") from None

    def _text_field(self, action: dict[str, Any]) -> str:
        props = {k: v for k, v in action.get("properties", {}).items() if k != "metadata"}
        if self.args.action_field is not None:
            if self.args.action_field not in props:
                raise self._fail(f"env.args.action_field={self.args.action_field!r} is not a field of the action "
                                 f"({', '.join(props)})")
            return self.args.action_field
        text = [k for k in action.get("required", []) if props.get(k, {}).get("type") == "string"]
        if len(text) != 1:
            raise self._fail(f"the action ({action.get('title')}: {', '.join(props)}) has no single required string "
                             "field to put the reply in; name one with env.args.action_field")
        return text[0]

    def close(self) -> None:
        """Stop the server this environment started (also done at exit)."""
        if self.server is not None:
            self.server.stop()

    def check(self, setup: TaskSetup) -> None:
        if setup.families:
            raise ConfigError(f"config error: env.families: env.name={self.name} has no task families; drop it")

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        seeds = random.Random(f"{setup.seed}:openenv").sample(range(2**31), setup.n_heldout + setup.n_train)

        def task(s: int, split: str) -> Task:
            return Task(task_id=f"openenv-{split}-{s}", prompt=f"reset(seed={s})", answer="", split=split,
                        family=self.version, data={"seed": s})
        return ([task(s, "train") for s in seeds[setup.n_heldout:]],
                [task(s, "heldout") for s in seeds[: setup.n_heldout]])

    def slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.args.max_sessions)
        return self._slots[loop]

    def episode(self, ctx: EpisodeContext) -> Env:
        return OpenEnvEpisode(self)

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        """The episode's return: the sum of the rewards its steps got from the server."""
        return {"env": float(sum(t.reward_step for t in traj.all_turns()))}

    def success(self, traj: Trajectory, task: Task) -> bool:
        return traj.scored and traj.total_reward >= self.args.success_threshold


class OpenEnvEpisode(Env):
    """One OpenEnv session over the server's WebSocket, from reset() to close()."""

    def __init__(self, environment: OpenEnvEnvironment):
        self.env, self.args, self.version = environment, environment.args, environment.version
        self._ws: Any = None
        self._slot: asyncio.Semaphore | None = None
        self._tools: dict[str, str] = {}  # MCP: tool name -> its single argument, for `name(text)` calls

    async def reset(self, task: Task) -> Observation:
        slot = self.env.slots()
        await slot.acquire()  # kept only once held (a reset cancelled while waiting holds none)
        self._slot = slot  # released by close(), which the rollout worker always calls
        reply = await self._open({**self.args.reset_args, **json.loads(json.dumps(task.data, default=str))})
        text = self._render(reply.get("observation") or {})
        system = self.args.system_prompt
        schemas = await self._list_tools() if self.env.action_field is None else None
        if schemas:
            system = f"{system}\n\n{describe_schemas(schemas)}" if system else describe_schemas(schemas)
        # the environment's own task is a seed: its opening is the reset observation; a data: row's prompt comes first
        head = ([{"role": "system", "content": system}] if system else []) if task.messages is None \
            else opening_messages(task, system)
        return Observation(messages=[*head, *([{"role": "user", "content": text}] if text else [])], tools=schemas)

    async def _list_tools(self) -> list[dict[str, Any]]:
        listed = (await self._request("step", {"type": "list_tools"}))["observation"].get("tools") or []
        for t in listed:
            props = (t.get("input_schema") or {}).get("properties", {})
            if len(props) == 1:
                self._tools[t["name"]] = next(iter(props))
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                  "parameters": t.get("input_schema") or {}}} for t in listed]

    async def step(self, action: str) -> StepResult:
        final = {"final_answer": action.strip()}
        if (field := self.env.action_field) is not None:
            reply = await self._request("step", {field: action})
            done = bool(reply.get("done"))
            messages = [] if done else [{"role": "user", "content": self._render(reply.get("observation") or {})}]
            return StepResult(observation=messages, reward=float(reply.get("reward") or 0.0), done=done,
                              info=final if done else {})
        calls = parse_tool_calls(action, self._tools)
        if not calls:  # a reply without a tool call is the final answer, as in loomrl's own tool environments
            return StepResult(observation=[], done=True, info=final)
        messages, records, reward, done = [], [], 0.0, False
        for call in calls:
            record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": call.error}
            output = f"Error: {call.error}"
            if not call.error:
                reply = await self._request("step", {"type": "call_tool", "tool_name": call.name,
                                                     "arguments": call.arguments})
                reward, done = reward + float(reply.get("reward") or 0.0), bool(reply.get("done"))
                output = _tool_output(reply.get("observation") or {}, record)
            messages.append({"role": "tool", "name": call.name or "unknown", "content": output})
            records.append(record)
            if done:
                break
        return StepResult(observation=[] if done else messages, reward=reward, done=done,
                          info={"tool_calls": records, **(final if done else {})})

    def _render(self, obs: dict[str, Any]) -> str:
        field = self.args.observation_field
        if field is not None:
            if field not in obs:
                raise EnvCrash(f"the observation has no field {field!r} (env.args.observation_field); it has "
                               f"{', '.join(obs)}")
            return str(obs[field])
        strings = [v for v in obs.values() if isinstance(v, str)]
        return strings[0] if len(strings) == 1 else json.dumps(obs, default=str) if obs else ""

    # -- the wire ----------------------------------------------------------------------------------------------------
    async def _open(self, data: dict[str, Any]) -> dict[str, Any]:
        """Connect and reset: connecting retried with backoff, a server at capacity waited for, both bounded."""
        from websockets.asyncio.client import connect

        deadline, attempt = time.monotonic() + self.args.session_wait_s, 0
        while True:
            try:
                self._ws = await connect(self.env.url.replace("http", "ws", 1) + "/ws",
                                         open_timeout=self.args.timeout_s, max_size=2**27)
                return await self._request("reset", data)
            except EnvCrash as err:
                await self._drop()
                if "CAPACITY_REACHED" not in str(err) or time.monotonic() > deadline:
                    raise
            except (OSError, TimeoutError) as err:
                await self._drop()
                attempt += 1
                if attempt >= self.args.connect_attempts:
                    raise EnvCrash(f"openenv server {self.env.url}: could not connect ({attempt} attempts): "
                                   f"{type(err).__name__}: {err}") from err
            except Exception as err:  # noqa: BLE001 - e.g. websockets' InvalidStatus: no OpenEnv session there
                await self._drop()
                raise EnvCrash(f"openenv server {self.env.url}: {type(err).__name__}: {err}") from err
            await asyncio.sleep(min(0.25 * 2**attempt, 2.0))

    async def _request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """One message and its answer within env.args.timeout_s; every failure an EnvCrash naming the server."""
        from websockets.exceptions import ConnectionClosed

        if self._ws is None:
            raise EnvCrash(f"openenv server {self.env.url}: {kind} outside a session (step before reset)")
        try:
            await self._ws.send(json.dumps({"type": kind, "data": data}))
            answer = json.loads(await asyncio.wait_for(self._ws.recv(), self.args.timeout_s))
        except TimeoutError:
            raise EnvCrash(f"openenv server {self.env.url}: no answer to {kind} within env.args.timeout_s="
                           f"{self.args.timeout_s:g} s") from None
        except ConnectionClosed as err:
            raise EnvCrash(f"openenv server {self.env.url}: the session closed during {kind} ({err})") from None
        if answer.get("type") == "error":
            error = answer.get("data") or {}
            raise EnvCrash(f"openenv server {self.env.url}: {kind} failed: {folded(str(error.get('message')))} "
                           f"({error.get('code')})")
        return answer.get("data") or {}

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        with contextlib.suppress(Exception):  # the session is gone either way
            if ws is not None:
                await asyncio.wait_for(ws.close(), 2.0)

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):  # best effort: the server ends the session on disconnect too
                await asyncio.wait_for(self._ws.send(json.dumps({"type": "close"})), 2.0)
        await self._drop()
        if self._slot is not None:
            self._slot.release()
            self._slot = None


def _tool_output(obs: dict[str, Any], record: dict[str, Any]) -> str:
    """A CallToolObservation's result as text; its error recorded as loomrl's own tools' are (env/tools.py): a bug in
    the tool (`raised`) is shown to the agent only as "failed", its message kept on the record."""
    error = obs.get("error")
    if error:
        failure = _FAILURES.get(str(error.get("error_type")), "raised")
        record.update(tool_error=str(error.get("message")), failure=failure)
        if failure != "raised":
            return f"Error: {error.get('message')}"
        record["exception"] = "execution_error"
        return f"Error: {record['name']} failed (an error inside the tool, not in the call)"
    result = obs.get("result")
    content = result.get("content") if isinstance(result, dict) else None
    if isinstance(content, list):  # an MCP CallToolResult: its text parts
        output = "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    else:
        output = result if isinstance(result, str) else json.dumps(result, default=str)
    record["output"] = output
    return output
