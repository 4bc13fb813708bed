"""Tools as plain typed Python functions, and ToolEnv: a multi-turn environment built from them.

A tool is a function with type hints and a Google-style docstring (a summary, then `Args:` with a line per
parameter): `transformers.utils.get_json_schema` makes its OpenAI schema from them, the same schema chat templates
render, and pydantic checks the arguments the model sends against the hints. A tool runs
- in process (the default): a plain or async function. An async one is cancelled at its timeout; a plain one runs on a
  thread, which Python cannot stop: past its timeout the episode goes on without it and the thread is left to end on
  its own (so code that may hang belongs in a sandbox);
- in a pool sandbox (`@tool(sandbox=True)`): the function gets the leased sandbox as its `sandbox` argument and runs
  what it must there (`await sandbox.exec([...], timeout=...)`); the model never sees that parameter.

A tool that raises, runs past its timeout, or is called with bad arguments (or one that does not exist) answers the
agent with an error message and is recorded on the turn's tool calls (`tool_error`, and `failure`: ToolFailure): the
episode goes on. A call the agent got wrong is `refused` (a tool raises ToolError to say so itself); a tool that raises
anything else has a bug (`raised`, with its `exception`): the agent is told only that the tool failed (unless
`show_tool_exceptions`), the process term tool_error does not count it against the agent, and the run counts it per
tool and exception (`tool/*` metrics) and warns when a tool fails on most of its calls (runtime/failure_watch.py).
What is not the agent's doing stays an infrastructure failure: a sandbox that cannot be leased or dies (EnvCrash,
SandboxError) ends the episode `env_error`, never a reward of 0.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from loomrl.config import ConfigError
from loomrl.env.api import EpisodeContext, opening_messages
from loomrl.env.base import Env, EnvCrash, Observation, StepResult
from loomrl.env.sandbox import SandboxError
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task

SANDBOX_PARAM = "sandbox"
_MARK = "__loomrl_tool__"


@dataclass(frozen=True, slots=True)
class ToolOptions:
    sandbox: bool = False  # runs with a leased pool sandbox, passed as its `sandbox` argument
    timeout_s: float | None = None  # None: env.tool_timeout_s


def tool(fn: Callable[..., Any] | None = None, *, sandbox: bool = False, timeout_s: float | None = None):
    """Mark a function (or a ToolEnv method) as a tool: `@tool`, or `@tool(sandbox=True, timeout_s=10)`."""
    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _MARK, ToolOptions(sandbox=sandbox, timeout_s=timeout_s))
        return f
    return mark(fn) if fn is not None else mark


def callable_name(fn: Callable[..., Any]) -> str:
    """The name a function or method is known by (a tool's name): a callable without one (a partial, a callable
    object) is refused, clearly."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise ConfigError(f"{fn!r} has no __name__: a tool is a function or a method")
    return name


def _schema_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the model sees it: without `self` (a bound method already has none) and without `sandbox`."""
    sig = inspect.signature(fn)
    if SANDBOX_PARAM not in sig.parameters:
        return fn

    def view(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a schema view is never called")
    view.__name__, view.__doc__ = callable_name(fn), fn.__doc__
    hints = dict(getattr(fn, "__annotations__", {}))
    hints.pop(SANDBOX_PARAM, None)
    view.__annotations__ = hints
    # what inspect.signature (and so get_json_schema) reads; functions do not declare it
    view.__dict__["__signature__"] = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != SANDBOX_PARAM])
    return view


def _arguments_model(fn: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model of the parameters the model fills in (all but `sandbox`): unknown ones are refused."""
    hints = typing.get_type_hints(fn)
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in (SANDBOX_PARAM, "self") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        fields[p.name] = (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
    return create_model(f"{callable_name(fn)}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool: its name, the function, the schema the model sees, how it runs."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    options: ToolOptions
    arguments: type[BaseModel]  # checks what the model sent
    single_arg: str | None  # the one parameter of a one-parameter tool: `name(text)` is accepted for it

    @classmethod
    def of(cls, fn: Callable[..., Any], options: ToolOptions | None = None) -> Tool:
        options = options or getattr(fn, _MARK, None) or ToolOptions()
        name = callable_name(fn)
        if options.sandbox and SANDBOX_PARAM not in inspect.signature(fn).parameters:
            raise ConfigError(f"tool {name!r}: a sandbox tool takes the leased sandbox as a parameter named "
                              f"{SANDBOX_PARAM!r}")
        # transformers: the schema code chat templates are fed with (imported here: it is slow to import)
        from transformers.utils import get_json_schema
        from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

        try:
            schema = get_json_schema(_schema_source(fn))
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise ConfigError(f"tool {name!r}: {err} (a tool needs a type hint for every parameter and a "
                              "Google-style docstring: a summary line, then 'Args:' with 'name: description' for "
                              "each)") from None
        schema["function"].pop("return", None)  # not part of OpenAI's tool schema
        params = list(schema["function"]["parameters"].get("properties", {}))
        return cls(name=name, fn=fn, schema=schema, options=options, arguments=_arguments_model(fn),
                   single_arg=params[0] if len(params) == 1 else None)


def tools_of(obj: Any, extra: Sequence[Callable[..., Any]] = ()) -> list[Tool]:
    """The tools of `obj` (its methods marked with @tool, in definition order, a subclass's overriding its base's)
    and the functions in `extra`."""
    marked: dict[str, ToolOptions] = {}
    for klass in reversed(type(obj).__mro__):
        for name, member in vars(klass).items():
            options = getattr(member, _MARK, None)
            if isinstance(options, ToolOptions):
                marked[name] = options
    return [Tool.of(getattr(obj, name), options) for name, options in marked.items()] + [Tool.of(f) for f in extra]


def describe_tools(tools: Sequence[Tool]) -> str:
    """A plain-text list of the tools and how to call them, for the system prompt: many small models' templates
    render no tool schemas, so the prompt says it in words too."""
    return describe_schemas([t.schema for t in tools])


def describe_schemas(schemas: Sequence[dict[str, Any]]) -> str:
    """describe_tools' words for OpenAI tool schemas (an adapter's tools, which are not Tool objects): each tool's
    signature and description, and the `<tool_call>` form model/tools.py parses."""
    lines = []
    for schema in schemas:
        fn = schema["function"]
        props = fn["parameters"].get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {fn['name']}({args}): {fn.get('description') or ''}")
    example = schemas[0]["function"]["name"] if schemas else "TOOL"
    return ("Tools:\n" + "\n".join(lines) + "\nCall a tool with <tool_call>{\"name\": \"" + example +
            "\", \"arguments\": {...}}</tool_call>; reply without a tool call to give your final answer.")


class ToolFailure(enum.StrEnum):
    """Why a well-formed tool call was not carried out (its record's `failure`)."""

    REFUSED = "refused"  # the agent's doing: no such tool, bad arguments, or the tool raised ToolError to say so
    TIMEOUT = "timeout"  # the tool ran past its timeout
    RAISED = "raised"  # the tool raised another exception: a bug in the tool, not a mistake of the agent's


class ToolError(Exception):
    """A tool call the agent got wrong: the message goes back to it. A tool raises it to tell the agent something
    ("no such key"); any other exception a tool raises is its own failure (ToolFailure.RAISED)."""

    def __init__(self, message: str, failure: ToolFailure = ToolFailure.REFUSED, exception: str | None = None):
        super().__init__(message)
        self.failure = failure
        self.exception = exception  # RAISED: the exception's type name


class ToolEnv(Env):
    """A multi-turn environment whose actions are tool calls. Each turn: every tool call in the reply is run in order
    and its result sent back as a `tool` message; a reply without one is the final answer and ends the episode.

    Subclass it with @tool methods (or pass `tools=`), a `system_prompt`, and optionally `few_shot` messages,
    `final_answer(text)` (default: the reply's text) and `observe(task)` state. `version` is recorded on trajectories.
    """

    version = "tool-env-1"
    system_prompt = "You are a helpful assistant."
    few_shot: Sequence[dict[str, Any]] = ()
    describe_in_prompt = True  # append describe_tools() to the system prompt
    # A tool that raises (other than ToolError) has a bug: by default the agent is told only that the tool failed, so
    # that the interpreter's own words ("'NoneType' object has no attribute 'group'") stay out of the policy's
    # context; the record keeps them. True: the agent sees "name raised Type: message".
    show_tool_exceptions = False

    def __init__(self, ctx: EpisodeContext, tools: Sequence[Callable[..., Any]] = ()):
        self.ctx = ctx
        self.tools = {t.name: t for t in tools_of(self, tools)}
        self.task: Task | None = None

    def final_answer(self, text: str) -> str | None:
        return text.strip()

    async def start(self, task: Task) -> None:
        """Set up the episode's state before the first turn (by default nothing)."""

    async def reset(self, task: Task) -> Observation:
        self.task = task
        await self.start(task)
        system = self.system_prompt
        if self.describe_in_prompt and self.tools:
            system = f"{system}\n\n{describe_tools(list(self.tools.values()))}"
        return Observation(messages=opening_messages(task, system, self.few_shot),
                           tools=[t.schema for t in self.tools.values()])

    async def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, {t.name: t.single_arg for t in self.tools.values() if t.single_arg})
        if not calls:
            return StepResult(observation=[], done=True, info={"final_answer": self.final_answer(action)})
        messages, records = [], []
        for call in calls:
            record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": call.error}
            try:
                if call.error:
                    raise ToolError(call.error)
                output = await self.call(call.name, call.arguments)
                record["output"] = output
            except ToolError as err:
                output = f"Error: {err}"
                if not call.error:  # the call was well formed; the tool could not carry it out
                    record["tool_error"], record["failure"] = str(err), str(err.failure)
                    if err.failure is ToolFailure.RAISED:
                        record["exception"] = err.exception
                        if not self.show_tool_exceptions:
                            output = f"Error: {call.name} failed (an error inside the tool, not in the call)"
            messages.append({"role": "tool", "name": call.name or "unknown", "content": output})
            records.append(record)
        return StepResult(observation=messages, info={"tool_calls": records})

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call; a ToolError for what the agent got wrong, EnvCrash for what broke under it."""
        t = self.tools.get(name)
        if t is None:
            raise ToolError(f"no tool named {name!r}; the tools are {', '.join(self.tools)}")
        if not isinstance(arguments, dict):
            raise ToolError(f"{name}: arguments must be an object, got {type(arguments).__name__}")
        if SANDBOX_PARAM in arguments:
            raise ToolError(f"{name}: no argument named {SANDBOX_PARAM!r}")
        timeout = t.options.timeout_s or self.ctx.tool_timeout_s
        if t.options.sandbox:
            if self.ctx.pool is None:
                raise EnvCrash(f"tool {name!r} needs a sandbox, but the environment declares no sandbox use "
                               "(set sandbox = 'call' or 'episode' on the Environment)")
            try:
                async with self.ctx.pool.lease() as sandbox:
                    return await self._run(t, {**arguments, SANDBOX_PARAM: sandbox}, timeout)
            except SandboxError as err:
                raise EnvCrash(f"tool {name!r}: sandbox failed: {err}") from err
        return await self._run(t, dict(arguments), timeout)

    async def _run(self, t: Tool, arguments: dict[str, Any], timeout: float) -> str:
        sandbox = arguments.pop(SANDBOX_PARAM, None)
        try:
            checked = dict(t.arguments.model_validate(arguments))
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join(str(p) for p in e["loc"]) or "arguments"
            raise ToolError(f"{t.name}: bad argument {where}: {e['msg']}") from None
        if sandbox is not None:
            checked[SANDBOX_PARAM] = sandbox
        try:
            if inspect.iscoroutinefunction(t.fn):
                result = await asyncio.wait_for(t.fn(**checked), timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(t.fn, **checked), timeout)
        except TimeoutError:
            raise ToolError(f"{t.name} ran past its {timeout:g} s timeout", ToolFailure.TIMEOUT) from None
        except (EnvCrash, SandboxError, ToolError):
            raise
        except Exception as err:  # noqa: BLE001 - the tool's own failure: recorded as such, the episode goes on
            raise ToolError(f"{t.name} raised {type(err).__name__}: {err}", ToolFailure.RAISED,
                            type(err).__name__) from None
        return result if isinstance(result, str) else json.dumps(result, default=str)
