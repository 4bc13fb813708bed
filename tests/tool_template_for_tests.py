"""A chat template that renders tool schemas, for the tests of what loomrl does when a template can (SmolLM2's, the
tests' tokenizer, renders none): SmolLM2's ChatML with the tools' JSON in a system turn of their own."""

from __future__ import annotations

import copy

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def rendering_tools(tokenizer):
    """A copy of `tokenizer` whose chat template renders tool schemas (the session's tokenizer is left as it is)."""
    own = copy.deepcopy(tokenizer)
    own.chat_template = TOOLS_TEMPLATE
    return own
