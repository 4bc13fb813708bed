"""A tool call sent back the way the `openai` SDK returns it, with the real SmolLM2-135M-Instruct (whose template knows
nothing of tool calls) and the black-box example's own prompt: through `loomrl serve`'s app and through a gateway
session, over real HTTP with the real client. The model really calls the tool, reads the result as it was prompted
to, answers, and the gateway's trajectory holds exactly the sampled tokens in one context. Slow: loads SmolLM2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loomrl.agent.gateway import Gateway, ServerThread
from loomrl.engine.base import SamplingParams
from loomrl.trainer.grpo import samples_from_group

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "blackbox_agent"))
import agent as example  # noqa: E402 - the shipped agent program: its prompt, tool schema and calculator

QUESTION = "Hana saved 16 tickets last week, 24 beads yesterday, and 11 tickets today. How many tickets has Hana saved?"


@pytest.fixture(scope="module")
def smollm2():
    from loomrl.config import ModelConfig
    from loomrl.engine.builtin.engine import BuiltinEngine
    from loomrl.model.loader import load_model

    model, tokenizer = load_model(ModelConfig(kind="smollm2"))
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, kv_budget_tokens=8192)
    yield engine, tokenizer
    engine.close()


def opening() -> list[dict]:
    messages = [{"role": "system", "content": example.SYSTEM}]
    for question, expression, result in example.EXAMPLES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": f"calc({expression})"},
                     {"role": "user", "content": f"Result: {result}"},
                     {"role": "assistant", "content": f"The answer is {result}."}]
    return [*messages, {"role": "user", "content": QUESTION}]


def run_agent(client) -> tuple[list[dict], list]:
    """The example agent's loop (agent.py main), greedy: the messages it ends with and the replies it got."""
    messages, replies = opening(), []
    for _ in range(example.MAX_STEPS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=example.TOOLS, max_tokens=48,
                                               temperature=0.0, extra_body={"return_token_ids": True})
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = example.calc(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"Result: {result}"})
    return messages, replies


@pytest.mark.slow
def test_serve_takes_the_tool_result_back_and_the_model_answers(smollm2):
    from loomrl.server.app import create_app

    engine, tokenizer = smollm2
    server = ServerThread(create_app(engine, tokenizer, "policy"))
    try:
        messages, replies = run_agent(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    finally:
        server.stop()
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "calc"
    assert len(replies) == 2 and replies[1].choices[0].message.content == "The answer is 51."


@pytest.mark.slow
def test_gateway_session_trains_exactly_the_sampled_tokens_of_a_tool_round_trip(smollm2):
    engine, tokenizer = smollm2
    gateway = Gateway(engine, tokenizer, "policy")
    server = ServerThread(gateway.app())
    try:
        session = gateway.open_session(task_id="t", sampling=SamplingParams(temperature=0.0, max_tokens=48))
        _, replies = run_agent(openai.OpenAI(base_url=server.url + "/v1", api_key=session.key, max_retries=0))
        traj = gateway.close_session(session)
    finally:
        server.stop()
    assert [r.choices[0].finish_reason for r in replies] == ["tool_calls", "stop"]
    assert traj.segments == [] and len(traj.turns) == 2  # the tool result continued the same context
    sampled = [r.choices[0].model_extra["token_ids"] for r in replies]
    sample = samples_from_group([traj, traj])[0]
    assert [t for t, m in zip(sample.token_ids, sample.loss_mask) if m] == [t for ids in sampled for t in ids]
    # the result reached the model as the user turn it was prompted with, right after its own call
    obs = traj.turns[0].obs_span
    assert tokenizer.decode(traj.token_ids[obs.start:obs.end]) == (
        "\n<|im_start|>user\nResult: 51<|im_end|>\n<|im_start|>assistant\n")
