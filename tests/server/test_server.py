"""`loomrl serve`'s OpenAI-compatible API, through real HTTP and the real `openai` client, on a tiny
model with the built-in engine."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.server.app import create_app

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    import uvicorn

    engine = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, kv_budget_tokens=4096)
    app = create_app(engine, tokenizer, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def test_completions_with_token_ids_match_the_engine(client, server, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == out.usage.completion_tokens
    assert choice.text == tokenizer.decode(extra["token_ids"], skip_special_tokens=True)
    assert len(choice.logprobs.token_logprobs) == len(extra["token_ids"])
    assert all(v == server[1].version for v in extra["policy_versions"])
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                      extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]  # greedy is deterministic


def test_n_samples_seeded_and_text_prompts(client):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, n=3, seed=11, temperature=1.0)
    assert len(out.choices) == 3 and [c.index for c in out.choices] == [0, 1, 2]
    same = client.completions.create(model="tiny", prompt="hello", max_tokens=5, n=3, seed=11, temperature=1.0)
    assert [c.text for c in out.choices] == [c.text for c in same.choices]


def test_chat_completion_with_tools(client, tokenizer):
    tools = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                              "required": ["expression"]}}}]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                         tools=tools, max_tokens=6, temperature=0.0, logprobs=True,
                                         extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant" and out.usage.completion_tokens == len(choice.model_extra["token_ids"])
    from loomrl.model.chat import ChatRenderer

    assert out.model_extra["prompt_token_ids"] == ChatRenderer(tokenizer).prompt_ids(
        [{"role": "user", "content": "What is 2 + 2?"}], tools)
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])


def test_tool_calls_are_parsed_into_openai_form(server, tokenizer):
    from loomrl.server.app import OpenAIServer
    from loomrl.server.protocol import ChatCompletionRequest

    srv = OpenAIServer(server[1], tokenizer, "tiny")
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    class Replay:  # the tiny random model never writes a tool call; replay one through the server code
        version = 0
        kv_budget = 1 << 20

        async def generate(self, request):
            from loomrl.engine.base import GenerationResult

            return GenerationResult(token_ids=ids, logprobs=[-0.1] * len(ids), versions=[0] * len(ids),
                                    finish_reason="stop")

    srv.engine = Replay()
    import asyncio

    body = asyncio.run(srv.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "2+2?"}],
                                                      tools=[{"type": "function", "function": {"name": "calc"}}])))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "calc" and call["function"]["arguments"] == '{"expression": "2+2"}'
    # streamed, the same call arrives as OpenAI chunks (parsed by the openai package's own types)
    import json

    from openai.types.chat import ChatCompletionChunk

    from loomrl.server.responses import stream_events

    events = list(stream_events(body))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[len("data: "):])) for e in events[:-1]]
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("calc", '{"expression": "2+2"}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_answers_equal_the_unstreamed_ones(client):
    """stream=true on both endpoints through the openai client: the same texts per choice (seeded, n=2), the
    token ids and policy versions with return_token_ids, the usage chunk when asked, the finish reasons."""
    ask = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "n": 2, "seed": 5, "temperature": 1.0,
           "extra_body": {"return_token_ids": True}}
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, ids, finish = ["", ""], [[], []], [None, None]
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += (c.model_extra or {}).get("token_ids") or []
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices] and finish == [c.finish_reason for c in whole.choices]
    assert ids == [c.model_extra["token_ids"] for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError):  # refused before anything is streamed: a JSON error
        client.completions.create(model="tiny", prompt="x", max_tokens=100000, stream=True)


def test_errors_are_openai_style(server, client):
    base = server[0]
    bad = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=100000)
    garbage = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and "error" in garbage.json()


def test_health_models_and_metrics(server, client):
    base = server[0]
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text = httpx.get(f"{base}/metrics").text
    assert "loomrl_engine_generated_tokens_total" in text and "loomrl_policy_version" in text


def test_more_logprobs_than_the_sampled_token_are_refused_by_name(server, client):
    """The engines compute the sampled token's logprob only: asking for alternatives is a 400 naming the field,
    not a silent list of one; one entry per position (the sampled token) is served."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="hello", max_tokens=3, logprobs=5)
    assert refused.value.body["param"] == "logprobs" and "sampled token" in refused.value.body["message"]
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, logprobs=True, top_logprobs=3)
    assert refused.value.body["param"] == "top_logprobs" and "sampled token" in refused.value.body["message"]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0.0,
                                         logprobs=True, top_logprobs=1)
    assert all([t.token for t in c.top_logprobs] == [c.token] for c in out.choices[0].logprobs.content)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.0, logprobs=0)
    lp = out.choices[0].logprobs
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]  # vLLM's logprobs=0: the sampled token


@pytest.fixture(scope="module")
def served_checkpoint(tmp_path_factory, tiny_model, tokenizer):
    """`loomrl serve --checkpoint` of a checkpoint saved at step 3, in a process of its own; (base URL, its stdout
    lines as they come)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from loomrl.trainer.checkpoint import save_checkpoint

    run_dir = tmp_path_factory.mktemp("served")
    optimizer = torch.optim.AdamW(tiny_model.parameters())
    save_checkpoint(run_dir, 3, model=tiny_model, tokenizer=tokenizer, optimizer=optimizer,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), state={})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    recipe = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "loomrl.cli", "serve", str(recipe), "--checkpoint", str(run_dir),
                             "--port", str(port), "--model-name", "tiny-ckpt"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, "loomrl serve did not start"
            try:
                httpx.get(f"{base}/health")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base, lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_served_checkpoint_reports_its_step_as_the_policy_version(served_checkpoint):
    base, _ = served_checkpoint
    assert httpx.get(f"{base}/health").json()["policy_version"] == 3
    assert "loomrl_policy_version 3.0" in httpx.get(f"{base}/metrics").text
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.completions.create(model="tiny-ckpt", prompt="hello", max_tokens=4,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["policy_versions"] == [3] * len(out.choices[0].model_extra["token_ids"])


def test_serve_prints_one_line_once_listening(served_checkpoint):
    base, lines = served_checkpoint
    deadline = time.time() + 10  # the line is written before the first request can be answered; flushed at once
    while not lines and time.time() < deadline:
        time.sleep(0.1)
    assert len(lines) == 1, lines
    assert all(part in lines[0] for part in (f"{base}/v1", "tiny-ckpt", "engine builtin", "policy version 3")), lines
