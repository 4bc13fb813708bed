"""model/chat.py renders_tools: whether a tokenizer's chat template renders the tool schemas it is given (SmolLM2's
drops them; adapters that pass tools only through the template must then describe them in words)."""

from __future__ import annotations

from tool_template_for_tests import TOOLS_TEMPLATE, rendering_tools

from loomrl.model.chat import ChatRenderer, renders_tools


def test_smollm2_renders_no_tools_and_a_template_that_does_is_told_apart(tokenizer):
    assert renders_tools(tokenizer) is False
    own = rendering_tools(tokenizer)
    assert renders_tools(own) is True
    ChatRenderer(own)  # and it is a template loomrl renders with (an assistant turn ends with the eos token)


def test_the_answer_is_cached_per_tokenizer_and_follows_a_new_template(tokenizer):
    own = rendering_tools(tokenizer)
    assert renders_tools(own) is True
    rendered = []
    apply = own.apply_chat_template
    own.apply_chat_template = lambda *a, **k: rendered.append(1) or apply(*a, **k)  # counts the probe's renderings
    assert renders_tools(own) is True and rendered == []  # cached
    own.chat_template = tokenizer.chat_template  # a template set afterwards is probed anew
    assert renders_tools(own) is False and rendered
    own.chat_template = TOOLS_TEMPLATE
    assert renders_tools(own) is True
