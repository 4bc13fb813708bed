"""The agent gateway through real HTTP and the real `openai` client, on a tiny model with the built-in
engine: recording and assembly (one context, or a new one when history is edited), exact token
fidelity, streaming, and the security of sessions (keys, 401/400/403, budgets)."""

from __future__ import annotations

import httpx
import pytest

from loomrl.agent.gateway import Budget, Gateway, ServerThread
from loomrl.engine.base import SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.trainer.grpo import samples_from_group

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def gateway(tiny_model, tokenizer):
    engine = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, kv_budget_tokens=8192)
    gw = Gateway(engine, tokenizer, "tiny")
    server = ServerThread(gw.app())
    yield gw, server
    server.stop()
    engine.close()


def client_for(server, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=session.key, max_retries=0)


def ask(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                          extra_body={"return_token_ids": True}, **kw)


def test_multi_turn_calls_assemble_into_one_context_with_the_exact_sampled_tokens(gateway):
    gw, server = gateway
    session = gw.open_session(task_id="t1", sampling=SamplingParams(temperature=1.0, seed=3))
    client = client_for(server, session)
    messages = [{"role": "system", "content": "You have a calculator."}, {"role": "user", "content": "What is 2+3?"}]
    sampled = []
    for turn in range(3):
        out = ask(client, messages, tools=TOOLS)
        choice = out.choices[0]
        sampled.append(choice.model_extra["token_ids"])
        messages.append(choice.message.model_dump(exclude_none=True))  # what an openai-SDK agent appends
        messages.append({"role": "user", "content": f"Result: {turn}"})
    traj = gw.close_session(session)
    assert traj.segments == [] and len(traj.turns) == 3  # one context throughout
    sample = samples_from_group([traj, traj])[0]
    trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert trained == [t for ids in sampled for t in ids]  # trained tokens == the tokens sampled, exactly
    for turn, ids in zip(traj.turns, sampled):
        assert traj.token_ids[turn.act_span.start:turn.act_span.end] == ids and len(turn.logprobs) == len(ids)
        assert set(turn.versions) == {gw.engine.version}
    assert traj.turns[0].obs_span is not None and "Result: 0" in traj.turns[0].obs
    assert traj.metadata.total_steps == 3 and traj.trajectory_id == session.session_id


def test_edited_history_starts_a_new_context_trained_as_its_own_sample(gateway):
    gw, server = gateway
    session = gw.open_session(task_id="t2")
    client = client_for(server, session)
    messages = [{"role": "user", "content": "Count to three."}]
    first = ask(client, messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    ask(client, messages)
    edited = [{"role": "user", "content": "Count to four."}, {"role": "user", "content": "Go on."}]
    third = ask(client, edited)
    traj = gw.close_session(session)
    assert [s.reason for s in traj.segments] == ["history edited at message 0"]
    assert len(traj.segments[0].turns) == 2 and len(traj.turns) == 1
    assert traj.token_ids[traj.turns[0].act_span.start:] == third.choices[0].model_extra["token_ids"]
    samples = samples_from_group([traj, traj])
    assert len(samples) == 4 and sum(samples[0].loss_mask) + sum(samples[1].loss_mask) == sum(
        len(t.logprobs) for t in traj.all_turns())


def test_streaming_gives_the_same_message(gateway):
    gw, server = gateway
    session = gw.open_session(sampling=SamplingParams(temperature=0.0))
    client = client_for(server, session)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    traj = gw.close_session(session)
    assert text == traj.turns[0].act


def test_keys_are_scoped_to_their_own_session(gateway):
    gw, server = gateway
    a, b = gw.open_session(task_id="a"), gw.open_session(task_id="b")
    ask(client_for(server, b), [{"role": "user", "content": "b speaks"}])
    own = httpx.get(server.url + "/v1/session", headers={"Authorization": f"Bearer {a.key}"}).json()
    assert own["session_id"] == a.session_id and own["calls"] == 0
    # Naming the other session anywhere does not reach it: there is no such route or header.
    spoof = {"Authorization": f"Bearer {a.key}", "X-Session-Id": b.session_id}
    ask(openai.OpenAI(base_url=server.url + "/v1", api_key=a.key, default_headers=spoof, max_retries=0),
        [{"role": "user", "content": "a speaks"}])
    assert httpx.get(server.url + f"/v1/session/{b.session_id}", headers=spoof).status_code == 404
    assert len(gw.close_session(a).turns) == 1 and len(gw.close_session(b).turns) == 1
    decode = gw.tokenizer.decode
    assert "b speaks" in decode(b.trajectory.prompt_ids) and "a speaks" not in decode(b.trajectory.token_ids)
    assert "a speaks" in decode(a.trajectory.prompt_ids) and "b speaks" not in decode(a.trajectory.token_ids)


def test_unknown_and_expired_keys_get_401(gateway):
    gw, server = gateway
    with pytest.raises(openai.AuthenticationError):
        ask(openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nope", max_retries=0), [{"role": "user", "content": "x"}])
    session = gw.open_session()
    client = client_for(server, session)
    gw.close_session(session)
    with pytest.raises(openai.AuthenticationError, match="invalid or expired"):
        ask(client, [{"role": "user", "content": "x"}])


def test_malformed_bodies_get_400_with_an_openai_error(gateway):
    gw, server = gateway
    session = gw.open_session()
    headers = {"Authorization": f"Bearer {session.key}"}
    for body in [{"model": "tiny"}, {"model": "tiny", "messages": "hello"},
                 {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400
    gw.close_session(session)


def test_budget_spent_gives_a_clear_error_and_truncates(gateway):
    gw, server = gateway
    session = gw.open_session(budget=Budget(max_calls=2))
    client = client_for(server, session)
    messages = [{"role": "user", "content": "one"}]
    for _ in range(2):
        out = ask(client, messages)
        messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    with pytest.raises(openai.BadRequestError, match="budget exceeded: call budget of 2 calls") as err:
        ask(client, messages)
    assert err.value.code == "budget_exceeded"
    traj = gw.close_session(session)
    assert traj.status == "truncated" and traj.metadata.truncated and "budget" in traj.error


def test_programs_need_the_admin_key_and_show_phase(gateway):
    gw, server = gateway
    session = gw.open_session()
    assert httpx.get(server.url + "/programs", headers={"Authorization": f"Bearer {session.key}"}).status_code == 403
    ask(client_for(server, session), [{"role": "user", "content": "x"}], tools=TOOLS)
    listed = httpx.get(server.url + "/programs", headers={"Authorization": f"Bearer {gw.admin_key}"}).json()["programs"]
    mine = [p for p in listed if p["program_id"] == session.session_id][0]
    assert mine["phase"] == "acting" and mine["status"] == "running" and mine["tools"] == ["calc"]
    assert mine["calls"] == 1 and mine["tokens_in_context"] > 0
    gw.close_session(session)
    assert session.program.status == "finished" and session.session_id not in [p["program_id"] for p in gw.programs()]


def test_reward_endpoint_only_where_the_task_allows_it(gateway):
    gw, server = gateway
    session = gw.open_session()
    headers = {"Authorization": f"Bearer {session.key}"}
    assert httpx.post(server.url + "/v1/reward", json={"reward": {"done": 1}}, headers=headers).status_code == 403
    gw.allow_agent_reward = True
    try:
        assert httpx.post(server.url + "/v1/reward", json={"reward": "lots"}, headers=headers).status_code == 400
        assert httpx.post(server.url + "/v1/reward", json={"reward": {"done": 1}}, headers=headers).json() == {"ok": True}
        assert session.reward == {"done": 1.0}
    finally:
        gw.allow_agent_reward = False
        gw.close_session(session)
