"""Tool-call parsing from model text.

Two syntaxes are recognised, in this order:
- Hermes/Qwen style: <tool_call>{"name": "calc", "arguments": {"expression": "2 + 3"}}</tool_call>
- a plain function call of a known tool, `calc(2 + 3)`, the form small models pick up from a couple
  of examples; its argument text is passed as the tool's single string argument.
Parsing never raises: malformed calls come back as ToolCall(error=...), so the agent loop can answer
with an error observation and record it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(slots=True, kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def _function_calls(text: str, tools: dict[str, str]) -> list[ToolCall]:
    """Find `name(arg)` for known tool names; `tools` maps name -> its single argument's name."""
    calls = []
    for name, arg_name in tools.items():
        for match in re.finditer(rf"\b{re.escape(name)}\(", text):
            depth, start = 1, match.end()
            for i in range(start, len(text)):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                if depth == 0:
                    calls.append((match.start(), ToolCall(name=name, arguments={arg_name: text[start:i].strip()},
                                                          raw=text[match.start() : i + 1])))
                    break
            else:
                calls.append((match.start(), ToolCall(name=name, raw=text[match.start() :], error="unbalanced parentheses")))
    return [c for _, c in sorted(calls, key=lambda x: x[0])]


def parse_tool_calls(text: str, tools: dict[str, str]) -> list[ToolCall]:
    """All tool calls in `text`, in order of appearance."""
    hermes = _HERMES.findall(text)
    if hermes:
        calls = []
        for body in hermes:
            try:
                obj = json.loads(body)
                name, args = obj["name"], obj.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                calls.append(ToolCall(name=str(name), arguments=dict(args), raw=body))
            except (ValueError, KeyError, TypeError) as err:
                calls.append(ToolCall(name="", raw=body, error=f"malformed tool call: {err}"))
        return calls
    return _function_calls(text, tools)
