"""Context management as an action of the agent (Forge), for the white-box loop.

When a strategy fires, the loop rewrites the conversation and starts a new context: the tokens so far are closed as a
ContextSegment (trained as their own sample, with their own masks), and the model continues from the rewritten
conversation, rendered afresh. So the model is trained on the context it actually saw at every turn, never on a history
it did not see. Each rewrite is recorded on the last turn of the closed context (`Turn.context_events`): which action,
tokens and messages before and after.

Strategies:
- discard_all: past `threshold` of the window, keep only the opening messages (system prompt and task).
- keep_last: past `threshold`, keep the opening messages and the last `keep_last` turns.
- clear_thinking: when a new user or tool message arrives, drop `<think>` blocks from earlier
  assistant messages (their reasoning is spent; their actions stay).
- summarize: past `threshold`, the policy itself writes a summary of the conversation (a sampled
  turn, trained with the closed context), and the new context is the opening messages plus it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)

SUMMARY_REQUEST = ("Summarize the conversation so far in a few sentences: what the task is, what you have "
                   "done, and what you have learned. The earlier messages will be removed.")


@dataclass(slots=True)
class ContextStrategy:
    name: str = "none"  # none, discard_all, keep_last, clear_thinking, summarize
    window: int = 1024  # the context window in tokens (agent.max_context_tokens)
    threshold: float = 0.8  # fraction of the window that triggers discard_all, keep_last, summarize
    keep_last: int = 2  # keep_last: turns kept (an assistant message and what answered it)
    summary_max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.name not in ("none", "discard_all", "keep_last", "clear_thinking", "summarize"):
            raise ValueError(f"agent.context.strategy: unknown strategy {self.name!r}; choose none, discard_all, "
                             "keep_last, clear_thinking or summarize")

    @property
    def makes_room(self) -> bool:
        """Whether the strategy shortens a context that is full (clear_thinking only trims reasoning)."""
        return self.name in ("discard_all", "keep_last", "summarize")

    def fires(self, context_tokens: int, messages: list[Message], new_message: bool) -> bool:
        """Whether to rewrite before the next turn."""
        if self.name == "none":
            return False
        if self.name == "clear_thinking":
            return new_message and any(m.get("role") == "assistant" and _THINK.search(m.get("content") or "")
                                       for m in messages)
        return context_tokens >= self.threshold * self.window

    def rewrite(self, opening: list[Message], messages: list[Message], summary: str | None = None) -> list[Message]:
        """The conversation of the new context."""
        if self.name == "clear_thinking":
            return [{**m, "content": _THINK.sub("", m.get("content") or "")} if m.get("role") == "assistant" else m
                    for m in messages]
        if self.name == "discard_all":
            return list(opening)
        if self.name == "keep_last":
            later = messages[len(opening):]
            starts = [i for i, m in enumerate(later) if m.get("role") == "assistant"]
            cut = starts[-self.keep_last] if len(starts) >= self.keep_last else 0
            return [*opening, *later[cut:]]
        if self.name == "summarize":
            return [*opening, {"role": "user", "content": f"Summary of the earlier turns: {summary or ''}"}]
        return list(messages)
