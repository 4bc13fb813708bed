"""Messages as a chat template can render them (model/messages.py): SmolLM2's template knows nothing of tool calls or
the tool role, a Qwen-style one does; the OpenAI SDK's own message objects round-trip through both."""

from __future__ import annotations

import copy

import pytest

from loomrl.model.chat import ChatRenderer
from loomrl.model.messages import TemplateMessages

# A tool-aware template in the style of Qwen2.5's: tool calls as <tool_call> JSON with the arguments as an object,
# tool results as a user turn wrapped in <tool_response>.
TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "16 + 11"}'}}
CONVERSATION = [{"role": "system", "content": "You have a calculator."}, {"role": "user", "content": "16 + 11?"},
                {"role": "assistant", "tool_calls": [CALL]},  # as model_dump(exclude_none=True) leaves it
                {"role": "tool", "tool_call_id": "call_1", "content": "Result: 27"}]


@pytest.fixture
def tool_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_smollm2_template_without_tool_support_fails_on_sdk_messages_unprepared(tokenizer):
    # the failure the gateway and `loomrl serve` answered with a 400 before messages were prepared
    with pytest.raises(Exception, match="content"):
        tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert not ChatRenderer(tokenizer).messages.tool_support


def test_without_tool_support_calls_are_the_emitted_text_and_results_a_user_turn(tokenizer):
    renderer = ChatRenderer(tokenizer)
    renderer.messages.remember({"tool_calls": [CALL]}, "calc(16 + 11)")
    text = tokenizer.decode(renderer.prompt_ids(CONVERSATION))
    assert "<|im_start|>assistant\ncalc(16 + 11)<|im_end|>\n<|im_start|>user\nResult: 27<|im_end|>" in text
    assert "tool" not in text.replace("calculator", "")  # no role the model never saw


def test_a_call_this_process_did_not_return_is_rendered_in_hermes_form():
    prepared = TemplateMessages(tool_support=False).prepare(
        [{"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]}])
    assert prepared == [{"role": "assistant", "content": 'Let me compute.\n<tool_call>{"name": "calc", "arguments": '
                                                         '{"expression": "16 + 11"}}</tool_call>'}]


def test_the_remembered_texts_are_bounded():
    messages = TemplateMessages(tool_support=False, remembered=2)
    for i in range(3):
        messages.remember({"tool_calls": [{**CALL, "id": f"call_{i}"}]}, f"calc({i})")
    got = [messages.prepare([{"role": "assistant", "tool_calls": [{**CALL, "id": f"call_{i}"}]}])[0]["content"]
           for i in range(3)]
    assert got[1:] == ["calc(1)", "calc(2)"] and got[0].startswith("<tool_call>")


def test_content_parts_and_none_content_render():
    prepared = TemplateMessages(tool_support=False).prepare(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "assistant", "content": None}])
    assert [m["content"] for m in prepared] == ["ab", ""]


def test_a_template_with_tool_support_gets_calls_and_tool_messages_as_they_are(tool_tokenizer):
    renderer = ChatRenderer(tool_tokenizer)
    assert renderer.messages.tool_support
    text = tool_tokenizer.decode(renderer.prompt_ids(CONVERSATION))
    # the arguments reach the template as an object (one JSON encoding, not a string encoded again)
    assert '{"name": "calc", "arguments": {"expression": "16 + 11"}}' in text
    assert "<tool_response>\nResult: 27\n</tool_response>" in text
