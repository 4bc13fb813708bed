"""A verifiers task's tools, run in loomrl's rollout process: what verifiers serves over MCP, called directly.

verifiers (0.4.0) launches each `vf.Toolset` as an MCP server (a subprocess of the host, by default) and its `null`
harness lists the servers' tools and calls them over HTTP. Here the same `@vf.tool` methods are called in process,
through the MCP library's own tool wrapper (`mcp.server.mcpserver.tools.Tool`), so the model sees what verifiers would
show it: the tool named `<server>_<tool>` (the server's TOOL_PREFIX, else its snake-cased class name; none when
TOOL_PREFIX is None), the schema MCP makes from the signature and the docstring as its description, the result's
text, and a failure as the text MCP answers with ("Error executing tool count: ...").

State: a tool's `self.state` is the rollout's `trace.state` (the Task's vf.State type), validated into the toolset's
own State type for the call and written back after it, as verifiers' state channel does (last write wins).
Lifetimes: a task's own servers (Task.toolsets) are made per episode, `setup()` and `setup_task(task)` first and
their exit stack closed with the episode; the taskset's (Taskset.toolsets) once per process, `setup()` before the
first episode, and they live as long as the process.

Not covered: toolsets that run elsewhere (a `url`, or a runtime other than `subprocess`: docker, prime, modal...) and
servers that are not a vf.Toolset (verifiers.py refuses them at load); image results reach the model as their text
only. A plain (not async) tool runs on a thread, which Python cannot stop: past env.tool_timeout_s the episode goes on
without it, as ToolEnv's tools do.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import verifiers.v1 as vf
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool as McpTool
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.mcp.server import _call_state  # the context variable a Toolset's `self.state` reads
from verifiers.v1.runtimes import SubprocessConfig
from verifiers.v1.utils.decorators import discover_decorated

from loomrl.env.tools import callable_name


def refusal(toolset: object) -> str | None:
    """Why this tool server cannot run in loomrl's process (one line naming the feature), or None."""
    name = getattr(toolset, "server_name", type(toolset).__name__)
    if not isinstance(toolset, vf.Toolset):
        return f"tool server {name!r} ({type(toolset).__name__}) is not a vf.Toolset (custom MCP servers)"
    config = toolset.config
    if getattr(config, "url", None):
        return f"tool server {name!r} is a remote MCP server ({config.url})"
    runtime = getattr(config, "runtime", None)
    if runtime is not None and not isinstance(runtime, SubprocessConfig):
        return f"tool server {name!r} asks for a {runtime.type} runtime (tools run in loomrl's rollout process)"
    return None


@dataclass(frozen=True, slots=True)
class BoundTool:
    """One tool as the model calls it, and the server instance it belongs to."""

    name: str  # <server>_<tool>
    mcp: McpTool  # the method, its argument model and its schema, as an MCP server holds them
    server: vf.Toolset

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema, as verifiers' chat harness builds it from the server's tool list."""
        return {"type": "function", "function": {"name": self.name, "description": self.mcp.description,
                                                 "parameters": self.mcp.parameters}}


def bind(toolsets: Sequence[vf.Toolset]) -> dict[str, BoundTool]:
    """The tools of `toolsets` by the name the model calls them; a name given twice is a ValueError."""
    out: dict[str, BoundTool] = {}
    for server in toolsets:
        prefix = server.server_name
        for fn in discover_decorated(server, "tool"):
            raw = getattr(fn, "tool_name", None) or callable_name(fn)
            name = f"{prefix}_{raw}" if prefix else raw
            if name in out:
                raise ValueError(f"two tools are named {name!r}; give one server a distinct TOOL_PREFIX")
            description = (fn.__doc__ or "").strip() or None
            out[name] = BoundTool(name=name, mcp=McpTool.from_function(fn, name=raw, description=description),
                                  server=server)
    return out


async def call(tool: BoundTool, arguments: dict[str, Any], trace: vf.Trace, timeout_s: float) -> str:
    """Run one call; the text the model gets back (a failure is text too: it is the agent's to read)."""
    server = tool.server
    syncs = server._state_cls is not vf.State  # a server on the base State syncs nothing (verifiers: the same)
    state = (server._state_adapter.validate_json(trace.state.model_dump_json()) if syncs else vf.State())
    token = _call_state.set(state)
    try:
        result = await asyncio.wait_for(tool.mcp.run(arguments, Context(), convert_result=True), timeout_s)
    except TimeoutError:
        return f"Error executing tool {tool.mcp.name}: it ran past its {timeout_s:g} s timeout"
    except ToolError as err:  # MCP's own wording of a tool that raised or got bad arguments
        return str(err)
    except Exception as err:  # noqa: BLE001 - whatever the tool did, the agent reads it
        return f"Error executing tool {tool.mcp.name}: {err}"
    finally:
        _call_state.reset(token)
    if syncs:
        trace.state = type(trace.state).model_validate_json(server._state_adapter.dump_json(state))
    content = mcp_content_to_chat_content(result.content)
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")  # images: dropped


class SharedTools:
    """The taskset's tool servers (Taskset.toolsets): one instance each per process, `setup()` once before the first
    episode that uses them; every episode's calls carry that episode's own state."""

    def __init__(self, toolsets: Sequence[vf.Toolset]):
        self.toolsets = list(toolsets)
        self._ready = False
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()

    async def ready(self) -> list[vf.Toolset]:
        if not self._ready and self.toolsets:
            lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
            async with lock:
                if not self._ready:
                    for server in self.toolsets:
                        await server.setup()
                    self._ready = True
        return self.toolsets
