"""One verifiers episode inside loomrl's agent loop: loomrl samples, the verifiers environment decides the rest.

verifiers (0.4.0, v1) plays an episode as `Env.run(task, agents)`: its control flow holds conversations through
`agents.<role>.run(task)` or `agents.<role>.interaction(task)` and `turn(message)`, and each turn is one harness
segment: the model called until it replies without a tool call. Here the environment's own `setup`/`run` are that
control flow, unchanged, in a background task of the episode, and its one agent is `_Seat`, whose segments are the
agent loop's turns:

  reset(task)   starts run(); the first segment's input (the task's system prompt and prompt, or the user message
                run() opens with) is the opening observation, the task's tools its tool schemas; when the chat
                template renders no tool schemas (Protocol.describe_tools), its system prompt also says the tools and
                the call format in words, as ToolEnv's does (the trace keeps verifiers' own messages)
  step(reply)   records the reply on the vf Trace; its tool calls run in process (verifiers_tools.py) and their
                results are the next observation. A reply without a tool call ends the segment: run() goes on, and
                its next user message is the next observation, or it returns: done, the final answer being the
                trace's last reply

Before every model turn, as verifiers' interception server does, the seat's turn limit (agent.max_turns) and the
task's @vf.stop hooks on the Trace and on the Request are checked; a stop ends the conversation (run() gets a
terminated segment, and the results of the tool calls it refused are never shown). A Response stop is checked once the
reply is recorded, before its tool calls run. Every step leaves the episode's record in StepResult.info["record"] (the
vf Trace as JSON and the tools' state): the rubric reads it later, on the reward pool (verifiers.py).

Not covered: a second agent run in one episode (best-of-n, a modelled user), steering (`interaction.send/steer`),
borrowed runtimes and tool servers (`agent.provision`, `runtime=`, `tools=`): the episode ends env_error naming them.
Tool calls are read from the reply's `<tool_call>{...}</tool_call>` blocks (the Hermes form chat templates render).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.session import call_hook, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.types import content_text

from loomrl.env.adapters import verifiers_tools as tools
from loomrl.env.api import EpisodeContext
from loomrl.env.base import Env, EnvCrash, Observation, StepResult
from loomrl.env.tools import describe_schemas
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task

_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclass(slots=True, kw_only=True)
class Protocol:
    """What every episode of one verifiers environment shares, made once at load (verifiers.py)."""

    env: vf.Env  # its setup() and run() are each episode's control flow
    seat: str  # its one agent role, played by the policy
    agent: vf.AgentConfig  # that role's config (agent.max_turns is read; the rest is refused at load or unused)
    shared: tools.SharedTools  # the taskset's tool servers
    version: str
    has_tools: bool  # its tasks have tools (the first task's and the taskset's, seen at load)
    # the opening system prompt describes the tools in words: the chat template renders no tool schemas
    # (VerifiersEnvironment.use_tokenizer)
    describe_tools: bool = False

    def task(self, data: dict[str, Any], kind: str = "") -> vf.Task:
        """The verifiers Task of a TaskData dumped as JSON; `kind` (a trace's task type) "Task": a plain vf.Task, the
        kind an Env.run() makes for a seat of its own."""
        task_type = type(self.env.taskset).task_type()
        if kind == "Task" and task_type.__name__ != "Task":
            return vf.Task(vf.TaskData.model_validate(data))
        return task_type(task_type.data_type().model_validate(data), self.env.taskset.config.task)


@dataclass(slots=True)
class _Ask:
    """run() wants a model turn on these new input messages (already on the trace)."""

    messages: list[vf.Message]


@dataclass(slots=True)
class _Ended:
    """run() returned (no error) or raised."""

    error: BaseException | None = None


@dataclass(slots=True)
class _Stops:
    """A task's @vf.stop hooks by what they read."""

    trace: list
    request: list
    response: list

    @classmethod
    def of(cls, task: vf.Task) -> _Stops:
        out = cls([], [], [])
        for fn in task.hooks("stop"):
            kind = hook_boundary(fn, allow_trace=True)
            (out.trace if kind is vf.Trace else out.request if kind is vf.Request else out.response).append(fn)
        return out

    async def before_turn(self, trace: vf.Trace, new: list[vf.Message]) -> str | None:
        for fn in self.trace:
            if await _fired(fn, {vf.Trace: trace}):
                return fn.__name__
        if self.request:
            request = vf.Request(messages=[*trace.messages, *new], tools=trace.tools or None)
            for fn in self.request:
                if await _fired(fn, {vf.Request: request.model_copy(deep=True), vf.Trace: trace}):
                    return fn.__name__
        return None

    async def after_reply(self, trace: vf.Trace, reply: vf.AssistantMessage) -> str | None:
        if not self.response:
            return None
        response = vf.Response(id=f"loomrl-{trace.num_turns}", created=int(time.time()), model="loomrl", message=reply,
                               finish_reason="tool_calls" if reply.tool_calls else "stop")
        for fn in self.response:
            if await _fired(fn, {vf.Response: response.model_copy(deep=True), vf.Trace: trace}):
                return fn.__name__
        return None


async def _fired(fn, available: dict[type, object]) -> bool:
    result = await call_hook(fn, available)
    if not isinstance(result, bool):
        raise EnvCrash(f"verifiers @stop {fn.__name__} returned {type(result).__name__}, not bool")
    return result


def _wire(message: vf.Message) -> dict[str, Any]:
    """A vf message as the OpenAI message loomrl renders."""
    if not isinstance(message.content, str) and any(part.type != "text" for part in message.content or []):
        raise EnvCrash("a message with images: multimodal messages are not supported")
    out: dict[str, Any] = {"role": message.role, "content": content_text(message.content)}
    if isinstance(message, vf.ToolMessage):
        out.update(tool_call_id=message.tool_call_id, name=message.name)
    return out


def _described(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The opening messages with the tools in words after the system prompt (a system message of their own when there
    is none), as ToolEnv's describe_in_prompt: the trace keeps verifiers' own messages, this is loomrl's rendering."""
    words = describe_schemas(schemas)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{words}"}, *messages[1:]]
    return [{"role": "system", "content": words}, *messages]


def opening(data: vf.TaskData) -> list[vf.Message]:
    """The first segment's own input, as verifiers' chat harness sends it: the system prompt, then the prompt."""
    head: list[vf.Message] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if data.prompt is None:
        return head
    return [*head, *([vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt)]


class _Chat:
    """An open conversation, as run() sees it (verifiers' Interaction): each turn() is one segment."""

    def __init__(self, episode: VerifiersEpisode, trace: vf.Trace):
        self._episode = episode
        self.trace = trace
        self._started = False
        self._over = False
        self._lock = asyncio.Lock()

    async def turn(self, message: str | list | None = None) -> vf.Segment:
        async with self._lock:
            if self._over:
                raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
            prompted = not self._started and self.trace.task.data.prompt is not None
            if message is None and not prompted:
                raise ValueError("nothing to run a turn on: this exchange takes its next user message")
            if message is not None and prompted:
                raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
            new = [] if self._started else opening(self.trace.task.data)
            if isinstance(message, str):
                new.append(vf.UserMessage(content=message))
            elif message is not None:
                new.extend(parse_message(m) if isinstance(m, dict) else m for m in message)
            self._started = True
            segment = await self._episode.segment(new)
            self._over = segment.terminated
            return segment

    async def send(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("interaction.send/steer (messages delivered mid-turn) is not supported by loomrl")

    steer = send

    def close(self) -> None:
        if self.trace.stop_condition is None:
            self.trace.stop("user_closed")


class _Seat:
    """The environment's one agent (`agents.<role>`): its runs are played by loomrl's agent loop."""

    def __init__(self, episode: VerifiersEpisode):
        self._episode = episode
        self.trainable = True  # an Env.setup() may set it; the policy is trained on its turns either way

    async def run(self, task: vf.Task, **borrowed: Any) -> vf.Trace:
        async with self.interaction(task, **borrowed) as chat:
            await chat.turn()
            if chat.trace.stop_condition is None:
                chat.trace.stop("agent_completed")
        return chat.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: vf.Task, **borrowed: Any) -> AsyncGenerator[_Chat, None]:
        lent = [name for name, value in borrowed.items() if value is not None]
        if lent:
            raise NotImplementedError(f"agent.run/interaction({', '.join(lent)}=...): borrowed runtimes and tool "
                                      "servers are not supported by loomrl")
        chat = await self._episode.open(task)
        try:
            yield chat
        finally:
            chat.close()

    async def provision(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("agent.provision (a runtime box) is not supported by loomrl")


class VerifiersEpisode(Env):
    """One episode of a verifiers environment (see the module's doc)."""

    def __init__(self, protocol: Protocol, ctx: EpisodeContext):
        self.protocol = protocol
        self.version = protocol.version
        self.ctx = ctx
        self.trace: vf.Trace | None = None
        self._tools: dict[str, tools.BoundTool] = {}
        self._servers: list[vf.Toolset] = []  # this episode's own (task-scoped) tool servers
        self._stops = _Stops([], [], [])
        self._events: asyncio.Queue[_Ask | _Ended] = asyncio.Queue()
        self._segment_done: asyncio.Future[None] | None = None
        self._run: asyncio.Task[None] | None = None

    # -- loomrl's side: the agent loop calls these ----------------------------------------------------------------
    async def reset(self, task: Task) -> Observation:
        if "vf" not in task.data:
            raise EnvCrash(f"task {task.task_id} is not a verifiers task: a verifiers environment brings its own "
                           "tasks (remove the recipe's data: section)")
        self._run = asyncio.create_task(self._drive(self.protocol.task(task.data["vf"])))
        event = await self._events.get()
        if isinstance(event, _Ended):
            raise self._crash(event.error) if event.error else EnvCrash("the verifiers environment's run() ended "
                                                                          "before the model's first turn")
        schemas = [t.schema for t in self._tools.values()]
        messages = [_wire(m) for m in event.messages]
        if self.protocol.describe_tools and schemas:
            messages = _described(messages, schemas)
        return Observation(messages=messages, tools=schemas or None)

    async def step(self, action: str) -> StepResult:
        trace = self._trace()
        reply, calls = self._reply(action, trace.num_turns)
        self._commit([reply], sampled=True)
        records: list[dict[str, Any]] = []
        stopped = await self._stops.after_reply(trace, reply)
        if stopped:
            trace.stop(stopped)
        elif reply.tool_calls:
            results: list[vf.Message] = []
            for call, (arguments, error) in zip(reply.tool_calls, calls):
                output = error or await self._call(call.name, arguments)
                records.append({"id": call.id, "name": call.name, "arguments": arguments, "output": output,
                                "error": error})
                results.append(vf.ToolMessage(tool_call_id=call.id, name=call.name, content=output))
            if not await self._refused(results):
                self._commit(results)
                return StepResult(observation=[_wire(m) for m in results],
                                  info={"tool_calls": records, "record": self._record()})
        return await self._end_segment(records)

    async def close(self) -> None:
        if self._run is not None and not self._run.done():  # cut short by loomrl: run() waits on a segment
            self._run.cancel()
            await asyncio.gather(self._run, return_exceptions=True)
        for server in self._servers:
            await server._exit_stack.aclose()  # what the server registered in setup(), as its MCP process would

    # -- run()'s side: the seat calls these ---------------------------------------------------------------------
    async def open(self, task: vf.Task) -> _Chat:
        """A conversation of the seat on `task` (its own tool servers set up): the episode's one agent run."""
        if self.trace is not None:
            raise NotImplementedError("a second agent run in one episode (best-of-n, another seat) is not supported "
                                      "by loomrl: an episode is one conversation")
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                hash=task.hash),
                              agent=vf.AgentInfo(config=self.protocol.agent, name=self.protocol.seat),
                              state=state_cls(type(task))())
        for server in type(task).toolsets(task.config):
            self._servers.append(server)
            await server.setup()
            await server.setup_task(task)
        self._tools = tools.bind([*self._servers, *await self.protocol.shared.ready()])
        self.trace.tools = [vf.Tool(name=t.name, description=t.mcp.description, parameters=t.mcp.parameters)
                            for t in self._tools.values()]
        self._stops = _Stops.of(task)
        return _Chat(self, self.trace)

    async def segment(self, new: list[vf.Message]) -> vf.Segment:
        """One segment on the new input messages: the model's turns until it replies without a tool call."""
        trace = self._trace()
        before = len(trace.nodes)
        if await self._refused(new):
            return vf.Segment(messages=[], terminated=True)
        self._commit(new)
        self._segment_done = asyncio.get_running_loop().create_future()
        self._events.put_nowait(_Ask(new))
        await self._segment_done
        messages, answered = [], False
        for node in trace.nodes[before:]:  # what verifiers' Interaction.turn hands back
            answered = answered or node.sampled
            if node.sampled or (answered and isinstance(node.message, vf.ToolMessage)):
                messages.append(node.message)
        return vf.Segment(messages=messages)

    # -- the machinery --------------------------------------------------------------------------------------------
    async def _drive(self, task: vf.Task) -> None:
        env, seat = self.protocol.env, _Seat(self)
        # cast: verifiers bounds Agents' factory by vf.Agent, yet an Env's run() only calls an agent's run(),
        # interaction() and trainable, which the seat plays (module docstring)
        agents = vf.Agents(env.config, lambda name, spec: cast(vf.Agent, seat))
        try:
            await env.setup(agents)
            await env.run(task, agents)
            if self.trace is None:
                raise RuntimeError(f"{type(env).__name__}.run() ran no agent")
            outcome = _Ended()
        except Exception as err:  # noqa: BLE001 - errors are data: run()'s failure ends the episode env_error
            outcome = _Ended(err)
        self._events.put_nowait(outcome)

    async def _end_segment(self, records: list[dict[str, Any]]) -> StepResult:
        assert self._segment_done is not None, "a step always answers a segment's model turn"
        self._segment_done.set_result(None)
        event = await self._events.get()  # run() goes on: its next user message, or its end
        if isinstance(event, _Ask):
            return StepResult(observation=[_wire(m) for m in event.messages],
                              info={"tool_calls": records, "record": self._record()})
        if event.error is not None:
            raise self._crash(event.error)
        trace = self._trace()
        return StepResult(observation=[], done=True,
                          info={"final_answer": trace.last_reply, "tool_calls": records, "record": self._record()})

    async def _refused(self, new: list[vf.Message]) -> bool:
        """Whether the next model turn is refused: a stop already met, the turn limit, a @vf.stop (it is recorded)."""
        trace = self._trace()
        if trace.stop_condition is None:
            limit = self.protocol.agent.max_turns
            if limit is not None and trace.num_turns >= limit:
                trace.stop("max_turns")
            elif stopped := await self._stops.before_turn(trace, new):
                trace.stop(stopped)
        return trace.stop_condition is not None

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        tool = self._tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}"  # verifiers' chat harness's words
        return await tools.call(tool, arguments, self._trace(), self.ctx.tool_timeout_s)

    def _reply(self, text: str, turn: int) -> tuple[vf.AssistantMessage, list[tuple[dict[str, Any], str | None]]]:
        """The reply as verifiers records it (reasoning, content and tool calls apart), and each call's arguments with
        the error that stops it running (a malformed call)."""
        thoughts = [t.strip() for t in _THINK.findall(text)]
        content = _TOOL_CALL.sub("", _THINK.sub("", text)).strip()
        calls, parsed = [], []
        for i, call in enumerate(parse_tool_calls(text, {})):
            error = f"error: {call.error}; resend the call as valid JSON" if call.error else None
            calls.append(vf.ToolCall(id=f"call_{turn}_{i}", name=call.name or "invalid",
                                     arguments=call.raw if call.error else json.dumps(call.arguments)))
            parsed.append((call.arguments, error))
        return vf.AssistantMessage(content=content, reasoning_content="\n".join(thoughts) or None,
                                   tool_calls=calls or None), parsed

    def _commit(self, messages: list[vf.Message], sampled: bool = False) -> None:
        trace = self._trace()
        for message in messages:
            parent = len(trace.nodes) - 1 if trace.nodes else None
            trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled,
                                           tools=trace.tools if parent is None else []))

    def _record(self) -> dict[str, Any]:
        """What the rubric reads (verifiers.py): the trace, and the state verifiers keeps off the trace's JSON."""
        trace = self._trace()
        return {"trace": trace.model_dump(mode="json"), "state": trace.state.model_dump(mode="json")}

    def _trace(self) -> vf.Trace:
        if self.trace is None:
            raise EnvCrash("the verifiers environment has no open conversation")
        return self.trace

    def _crash(self, error: BaseException) -> EnvCrash:
        crash = EnvCrash(f"the verifiers environment's run() raised {type(error).__name__}: {error}")
        crash.__cause__ = error
        return crash
