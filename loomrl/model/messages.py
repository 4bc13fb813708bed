"""OpenAI-style messages made renderable by one chat template.

Agents written with the `openai` SDK send back what the API gave them: an assistant message whose content is None (or
absent, after `model_dump(exclude_none=True)`) and whose `tool_calls` hold the call, then a `tool` message with the
result. Templates of models trained with tools (Qwen2.5, Llama 3.1, Hermes) render both. Many others, SmolLM2's among
them, read `message['content']` and know nothing of tool calls or of a `tool` role: such a conversation fails to render
(`'dict object' has no attribute 'content'`), or renders a role the model never saw.

`TemplateMessages.prepare` turns a conversation into what the template can render, decided once per template by a
probe (does it print an assistant message's tool calls?):
- every template: content given as parts becomes their text; with tool support, JSON-string arguments become objects
  (HF templates expect a dict; vLLM does the same);
- without tool support: content None or absent becomes ""; an assistant message with tool calls becomes the text the
  model emitted for it (remembered by call id when this process produced the reply: exactly what was sampled, so a
  re-rendered history shows the model its own words), else its content followed by the calls in Hermes form
  (`<tool_call>{...}</tool_call>`, which `model/tools.py` parses); a `tool` message becomes a `user` message with the
  same content, the form such models are prompted with ("Result: 27" after `calc(16 + 11)`).

What is not here: sampled tokens are never re-rendered (token fidelity is ChatRenderer.continuation_ids' job); this only
decides what the template is shown.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]

_PROBE_NAME = "loomrl_probe_tool"


def renders_tool_calls(render: Callable[[list[Message]], str]) -> bool:
    """Whether a template prints an assistant message's tool calls (a template that fails on them does not)."""
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {"x": 1}}}
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_probe", "content": "r"}]
    try:
        return _PROBE_NAME in render(probe)
    except Exception:  # noqa: BLE001 - any template error means: no tool support
        return False


def _text(content: Any) -> Any:
    """Content parts ([{"type": "text", "text": ...}, ...]) as their text; other content unchanged."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its arguments as an object, as HF templates expect (the API sends a JSON string)."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def _hermes(call: dict[str, Any]) -> str:
    fn = _arguments(call)["function"]
    return "<tool_call>" + json.dumps({"name": fn.get("name", ""), "arguments": fn.get("arguments", {})}) + "</tool_call>"


class TemplateMessages:
    """Prepares conversations for one template; remembers the text behind the tool calls this process returned."""

    def __init__(self, tool_support: bool, remembered: int = 4096):
        self.tool_support = tool_support
        self._emitted: OrderedDict[str, str] = OrderedDict()  # tool call id -> the assistant text it was parsed from
        self._capacity = remembered

    def remember(self, message: Message, text: str) -> None:
        """Note the sampled `text` an assistant reply with tool calls was made from (bounded: oldest forgotten)."""
        for call in message.get("tool_calls") or []:
            if call_id := call.get("id"):
                self._emitted[call_id] = text
                self._emitted.move_to_end(call_id)
        while len(self._emitted) > self._capacity:
            self._emitted.popitem(last=False)

    def prepare(self, messages: list[Message]) -> list[Message]:
        return [self._one(m) for m in messages]

    def _one(self, message: Message) -> Message:
        out = dict(message)
        if "content" in out:
            out["content"] = _text(out["content"])
        calls = out.get("tool_calls") or []
        if self.tool_support:
            if calls:
                out["tool_calls"] = [_arguments(c) for c in calls]
            return out
        if out.get("role") == "tool":
            return {"role": "user", "content": out.get("content") or ""}
        content = out.get("content") or ""
        if calls:
            out.pop("tool_calls")
            emitted = self._emitted.get(calls[0].get("id", ""))
            content = emitted if emitted is not None else "\n".join([content, *map(_hermes, calls)]).strip()
        out["content"] = content
        return out
