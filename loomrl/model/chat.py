"""Chat rendering straight to token ids, with token fidelity across turns.

A multi-turn trajectory is one growing token sequence. The prompt is rendered with the model's chat
template once; after that, only *new* messages (observations, tool results) are rendered and their
tokens appended after the exact tokens the engine sampled. Model output is never decoded and
re-encoded (decode→encode is not a bijection; see TRL #5224, verl #3960).

How a continuation is rendered: the template is applied to the conversation with and without the new
messages; the text difference is the new part. The sampled turn ends with the end-of-turn token (or
was cut by max_tokens, in which case the end-of-turn token is appended); whatever the template puts
after that token (the "glue", "\n" for ChatML) is prepended to the new part.

Messages reach the template through `messages` (model/messages.py): OpenAI tool calls and tool results in the form
this template can render. Tool schemas reach it as `tools`, which many small models' templates (SmolLM2's) drop:
`renders_tools` tells which, for environments that then say them in words.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from loomrl.model.messages import Message, TemplateMessages, renders_tool_calls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_PROBE_NAME = "loomrl_probe_tool"
_PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A tool only a template that renders tool schemas shows.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
# per tokenizer: (the chat template probed, whether it renders tools); a template set afterwards is probed anew
_RENDERS_TOOLS: weakref.WeakKeyDictionary[Any, tuple[Any, bool]] = weakref.WeakKeyDictionary()


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders the tool schemas it is passed: a probe conversation rendered with
    a tool must differ from it rendered without, by the tool's name. Cached per tokenizer and template."""
    template = tokenizer.chat_template
    known = _RENDERS_TOOLS.get(tokenizer)
    if known is not None and known[0] == template:
        return known[1]
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    with_tool = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    renders = isinstance(with_tool, str) and with_tool != bare and _PROBE_NAME in with_tool
    _RENDERS_TOOLS[tokenizer] = (template, renders)
    return renders


class ChatRenderer:
    """Renders OpenAI-style messages to token ids for one tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token
        self.messages = TemplateMessages(renders_tool_calls(lambda m: self._apply(m, None, False)))
        self._glue = self._find_glue()

    def _apply(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tools=[*tools] if tools is not None else None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):  # tokenize=False renders text
            raise TypeError(f"the tokenizer's apply_chat_template(tokenize=False) returned a {type(text).__name__}")
        return text

    def _template(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self._apply(self.messages.prepare(messages), tools, add_generation_prompt)

    def _find_glue(self) -> str:
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "MARKER"}]
        text = self._template([{"role": "system", "content": "s"}, *probe], None, False)
        tail = text[text.rindex("MARKER") + len("MARKER") :]
        if not tail.startswith(self.eos_text):
            raise ValueError(f"chat template does not end an assistant turn with the eos token {self.eos_text!r}; "
                             "set the tokenizer's eos_token to the end-of-turn token")
        return tail[len(self.eos_text) :]

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation, ending with the assistant generation prompt."""
        return self.encode_text(self._template(messages, tools, add_generation_prompt=True))

    def continuation_ids(self, history: list[Message], new_messages: list[Message], *, closed: bool,
                         tools: list[dict] | None = None) -> list[int]:
        """Tokens to append after a sampled assistant turn so the context shows `new_messages`.

        `history` ends with the assistant message whose tokens were sampled; `closed` says whether the sampled tokens
        already end with the end-of-turn token."""
        before = self._template(history, tools, add_generation_prompt=False)
        after = self._template(history + new_messages, tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("chat template is not prefix-stable for this conversation; cannot append tokens")
        ids = self.encode_text(self._glue + after[len(before) :])
        return ids if closed else [self.eos_token_id, *ids]

    def decode(self, ids: list[int]) -> str:
        """Text of sampled ids for display and parsing only (never re-encoded for training)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not isinstance(text, str):  # one sequence of ids decodes to one text
            raise TypeError(f"the tokenizer's decode returned a {type(text).__name__}")
        return text
