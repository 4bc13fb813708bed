"""OpenAI-style responses shared by `loomrl serve` (server/app.py) and the black-box gateway
(agent/gateway.py): the error body, and the assistant message for sampled text (tool calls parsed)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from loomrl.model.tools import parse_tool_calls


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | int | None = None):
    """An OpenAI-style error response."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": code if code is not None else status}})


def _tool_arg_names(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """name -> its single required parameter, for `name(args)` style calls."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", {})
        params = fn.get("parameters", {}) or {}
        required = params.get("required") or list((params.get("properties") or {}).keys())
        if fn.get("name") and len(required) == 1:
            out[fn["name"]] = required[0]
    return out


def assistant_message(text: str, reason: str, tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
    """The OpenAI assistant message for sampled `text` (tool calls parsed when tools were offered),
    and the finish reason ("tool_calls" when it called any)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    names = _tool_arg_names(tools)
    if tools:
        calls = [c for c in parse_tool_calls(text, names) if not c.error]
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls
            ]
            message["content"] = None if text.strip().startswith(("<tool_call>",) + tuple(names)) else text
            reason = "tool_calls"
    return message, reason
