from __future__ import annotations

from loomrl.model.chat import ChatRenderer
from loomrl.model.tools import parse_tool_calls

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 1 + 2?"}]


def test_continuation_equals_full_render_for_canonical_text(tokenizer):
    r = ChatRenderer(tokenizer)
    prompt = r.prompt_ids(MESSAGES)
    sampled = r.encode_text("calc(1 + 2)") + [tokenizer.eos_token_id]
    history = [*MESSAGES, {"role": "assistant", "content": "calc(1 + 2)"}]
    new = [{"role": "user", "content": "Result: 3"}]
    cont = r.continuation_ids(history, new, closed=True)
    assert prompt + sampled + cont == r.prompt_ids(history + new)


def test_unclosed_turn_gets_its_end_token(tokenizer):
    r = ChatRenderer(tokenizer)
    history = [*MESSAGES, {"role": "assistant", "content": "calc(1 +"}]
    new = [{"role": "user", "content": "Error"}]
    closed = r.continuation_ids(history, new, closed=True)
    unclosed = r.continuation_ids(history, new, closed=False)
    assert unclosed == [tokenizer.eos_token_id, *closed]


def test_parse_function_style_and_hermes_calls():
    calls = parse_tool_calls("Let me see. calc((3 + 4) * 2) then", {"calc": "expression"})
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "(3 + 4) * 2"})]
    hermes = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>', {})
    assert hermes[0].name == "calc" and hermes[0].arguments == {"expression": "1+1"}
    broken = parse_tool_calls("<tool_call>{not json}</tool_call>", {})
    assert broken[0].error and "malformed" in broken[0].error
    unbalanced = parse_tool_calls("calc(3 + (4", {"calc": "expression"})
    assert unbalanced[0].error == "unbalanced parentheses"
    assert parse_tool_calls("no call here", {"calc": "expression"}) == []
