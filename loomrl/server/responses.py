"""OpenAI-style requests and responses shared by `loomrl serve` (server/app.py) and the black-box gateway
(agent/gateway.py): the error bodies, message checks, a request's sampling, the sampled text and its logprobs,
the completion body, the assistant message for sampled text (tool calls parsed), and the body as a stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from loomrl.engine.base import GenerationResult, SamplingParams
from loomrl.model.messages import TemplateMessages
from loomrl.model.tools import parse_tool_calls


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | int | None = None):
    """An OpenAI-style error response."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": code if code is not None else status}})


def invalid_request(exc):
    """The 400 for a body that failed validation (a RequestValidationError), naming its first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error_response(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc or None)


def bad_roles(messages: list[Any]):
    """A 400 naming the first message whose role is not an OpenAI one, or None."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return error_response(400, f"messages[{i}].role must be system, user, assistant or tool", f"messages[{i}].role")
    return None


def sampling_params(req, max_tokens: int) -> SamplingParams:
    """The engine's sampling for a request (vLLM's top_k -1 or 0: off; `stop`: a string or a list of them)."""
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), max_tokens=max_tokens,
                          stop_token_ids=list(req.stop_token_ids or []), seed=req.seed, ignore_eos=req.ignore_eos,
                          stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []))


def sampled_text(tokenizer, result: GenerationResult, stops: list[str]) -> tuple[str, str]:
    """The decoded output cut before the first stop string, and its finish reason ("interrupted" is
    reported as "stop")."""
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    reason = result.finish_reason
    for s in stops:
        idx = text.find(s)
        if idx >= 0:
            text, reason = text[:idx], "stop"
    return text, ("stop" if reason == "interrupted" else reason)


def chat_logprobs(tokenizer, result: GenerationResult, top: bool) -> dict[str, Any]:
    """Chat logprobs of the sampled tokens; with `top`, each lists itself as its one top logprob (the
    engine does not compute alternatives)."""
    content = []
    for t, lp in zip(result.token_ids, result.logprobs):
        tok = tokenizer.decode([t])
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
        content.append({**entry, "top_logprobs": [entry] if top else []})
    return {"content": content}


def completion_body(id_prefix: str, kind: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """A (chat) completion response: `kind` is its "object", "text_completion" or "chat.completion"."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}


def stream_events(body: dict[str, Any], include_usage: bool = False) -> Iterator[str]:
    """A finished completion `body` (chat or text) as OpenAI server-sent events, per choice: (chat: the role,)
    what it sampled, then its finish reason; the usage when asked (stream_options.include_usage), then [DONE].
    The Engine protocol returns a request's tokens together, so what a choice sampled comes in one chunk once it
    has finished, not token by token; that chunk carries all its choice carries (logprobs, and with
    return_token_ids its token_ids and policy_versions)."""
    chat = body["object"] == "chat.completion"
    base = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"]}

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    for choice in body["choices"]:
        index, finish = choice["index"], choice["finish_reason"]
        sampled = {k: v for k, v in choice.items() if k not in ("message", "finish_reason")}
        if chat:
            message = choice["message"]
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            delta = {"content": message["content"]} if message.get("content") else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            sampled["delta"] = delta
        yield event([{**sampled, "finish_reason": None}])
        yield event([{"index": index, **({"delta": {}} if chat else {"text": ""}), "finish_reason": finish}])
    if include_usage:
        yield event([], usage=body["usage"])
    yield "data: [DONE]\n\n"


def model_list(names: str | list[str], created: int) -> dict[str, Any]:
    """/v1/models' body: the model `names` (one name, or several) served."""
    ids = [names] if isinstance(names, str) else names
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "loomrl"}
                                       for n in ids]}


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


def assistant_message(text: str, reason: str, tools: list[dict[str, Any]] | None,
                      template: TemplateMessages) -> tuple[dict[str, Any], str]:
    """The OpenAI assistant message for sampled `text` (tool calls parsed when tools were offered),
    and the finish reason ("tool_calls" when it called any). `template` remembers the text behind the calls, so
    that a template without tool support shows the model its own words when the agent sends the reply back."""
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
            template.remember(message, text)
    return message, reason
