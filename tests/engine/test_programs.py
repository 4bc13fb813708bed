"""Programs under a KV budget (engine/builtin/programs.py): pausing an acting program's K/V and restoring it on its next
turn changes no token, never serves K/V of an old weight version, starves no program, and the phase of white-box
(agent loop) and black-box (gateway) programs is tracked. Everything runs on the tiny random model with the real
engine; the tool waits of the multi-turn driver are asyncio sleeps."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.agent.loop import AgentLoop
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.programs import Phase, ProgramTable
from loomrl.env.base import Observation, StepResult
from loomrl.model.chat import ChatRenderer
from loomrl.types import Task

POLICIES = ["smallest_first", "longest_wait"]


def _programs(tokenizer, n: int = 4, long_one: bool = False):
    out = []
    for p in range(n):
        words = 60 if long_one and p == 0 else 12
        prompt = tokenizer.encode(f"Program {p}: " + " ".join(f"fact {p}.{j} is {j * p % 7}." for j in range(words)))
        out.append((f"p{p}", prompt, tokenizer.encode(f" Tool said {p * 11}.")))
    return out


def _multi_turn(engine, programs, turns: int = 3, new_tokens: int = 5, seeded: bool = False, waits=None):
    """Each program: generate, wait on its 'tool' (an asyncio sleep), append the observation, again."""
    async def program(i, pid, prompt, obs):
        ctx, outs = list(prompt), []
        for t in range(turns):
            sp = SamplingParams(temperature=1.0 if seeded else 0.0, max_tokens=new_tokens, ignore_eos=True,
                                seed=100 * i + t if seeded else None)
            r = await engine.generate(GenerationRequest(prompt_ids=ctx, program_id=pid, sampling=sp))
            outs.append(r.token_ids)
            await asyncio.sleep((waits or {}).get(pid, 0.01 * (1 + i % 3)))
            ctx = ctx + r.token_ids + obs
        engine.release(pid)
        return outs

    async def go():
        return await asyncio.gather(*[program(i, *p) for i, p in enumerate(programs)])

    return asyncio.run(go())


def _engine(tiny_model, tokenizer, budget: int, policy: str = "lru", **kw) -> BuiltinEngine:
    return BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=budget,
                         program_policy=policy, **kw)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_pause_and_restore_change_no_token(tiny_model, tokenizer, seeded):
    programs = _programs(tokenizer)
    roomy = _engine(tiny_model, tokenizer, 1 << 16)
    try:
        reference = _multi_turn(roomy, programs, seeded=seeded)
        assert roomy.programs.metrics.restored == 0
    finally:
        roomy.close()
    budget = 2 * max(len(p[1]) for p in programs) + 40  # about two programs: the others must be dropped
    for policy in POLICIES:
        tight = _engine(tiny_model, tokenizer, budget, policy)
        try:
            assert _multi_turn(tight, programs, seeded=seeded) == reference, policy
            m = tight.programs.metrics
            assert m.paused > 0 and m.restored > 0 and m.recomputed_tokens > 0, (policy, m)
            assert tight.metrics.preemptions == 0  # room for a turn is made up front: no running turn is cut
        finally:
            tight.close()


def test_a_program_restored_after_a_weight_update_recomputes_under_the_new_weights(tiny_model, tokenizer):
    programs = _programs(tokenizer, 2)
    (pa, prompt_a, obs), (pb, prompt_b, _) = programs
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    new = {k: v * 1.5 for k, v in tiny_model.state_dict().items()}
    engine = _engine(tiny_model.__class__(tiny_model.config).eval(), tokenizer, len(prompt_a) + len(prompt_b),
                     "longest_wait")
    engine.update_weights(tiny_model.state_dict(), 0)
    try:
        first = asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt_a, program_id=pa, sampling=greedy)))
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt_b, program_id=pb, sampling=greedy)))
        assert engine.programs.get(pa).paused  # b needed the room: a, acting, was paused
        engine.update_weights(new, 1)
        nxt = prompt_a + first.token_ids + obs
        reused = engine.metrics.reused_tokens
        second = asyncio.run(engine.generate(GenerationRequest(prompt_ids=nxt, program_id=pa, sampling=greedy)))
        assert engine.metrics.reused_tokens == reused  # nothing of version 0 served
        assert set(second.versions) == {1}
    finally:
        engine.close()
    fresh = _engine(tiny_model.__class__(tiny_model.config).eval(), tokenizer, 1 << 16)
    fresh.update_weights(new, 1)
    try:
        expected = asyncio.run(fresh.generate(GenerationRequest(prompt_ids=nxt, sampling=greedy)))
        assert second.token_ids == expected.token_ids
    finally:
        fresh.close()


def test_no_program_is_paused_more_than_the_bound_in_a_row(tiny_model, tokenizer):
    """Adversarial mix: one large program with the longest tool wait (the policy's first choice every time) among many
    small ones; it is spared after max_pauses_in_row pauses, and outputs are unchanged."""
    programs = _programs(tokenizer, 6, long_one=True)
    waits = {pid: (0.12 if pid == "p0" else 0.01) for pid, _, _ in programs}
    roomy = _engine(tiny_model, tokenizer, 1 << 16)
    try:
        reference = _multi_turn(roomy, programs, turns=5, waits=waits)
    finally:
        roomy.close()
    tight = _engine(tiny_model, tokenizer, len(programs[0][1]) + 3 * len(programs[1][1]), "longest_wait",
                    max_pauses_in_row=2)
    try:
        assert _multi_turn(tight, programs, turns=5, waits=waits) == reference
        m = tight.programs.metrics
        assert m.paused > 0 and m.max_pauses_in_row <= 2, m
    finally:
        tight.close()


def test_the_policies_choose_as_documented():
    """The table alone (a fake clock): smallest_first picks the smallest acting program whatever it costs, again and
    again; longest_wait picks the one expected away longest and spares it after max_pauses_in_row pauses in a row."""
    now = [0.0]
    for policy in ("smallest_first", "longest_wait"):
        table = ProgramTable(policy, max_pauses_in_row=2, clock=lambda: now[0])  # type: ignore[arg-type]
        for pid, wait in (("big", 5.0), ("s1", 0.5), ("s2", 0.5)):  # one turn each, then one wait observed
            table.started(GenerationRequest(prompt_ids=[1], program_id=pid, sampling=SamplingParams()))
            table.finished(pid, 10)
            now[0] += wait
            table.started(GenerationRequest(prompt_ids=[1], program_id=pid, sampling=SamplingParams()))
            table.finished(pid, 10)
        held = {"big": 900, "s1": 30, "s2": 40}
        picks = []
        for _ in range(3):
            victim = table.victim(held, 10_000)
            assert victim is not None
            picks.append(victim)
            table.paused(victim)
            table.started(GenerationRequest(prompt_ids=[1], program_id=victim, sampling=SamplingParams()))
            table.admitted(GenerationRequest(prompt_ids=[1] * 20, program_id=victim, sampling=SamplingParams()),
                           20, 0, 0.0)
            table.finished(victim, 20)  # restored and acting again
        if policy == "smallest_first":
            assert picks == ["s1", "s1", "s1"] and table.get("s1").pauses_in_row == 3
        else:
            assert picks == ["big", "big", "s2"] and table.metrics.max_pauses_in_row == 2
    assert ProgramTable("lru").victim({"x": 5}, 5) is None  # lru: the prefix cache chooses, entry by entry


def test_the_table_forgets_idle_programs_past_its_bound(monkeypatch):
    """A client that never releases (`loomrl serve` names every HTTP request a program) cannot grow it for ever."""
    monkeypatch.setattr("loomrl.engine.builtin.programs.MAX_PROGRAMS", 8)
    table = ProgramTable("longest_wait")
    for i in range(40):
        table.started(GenerationRequest(prompt_ids=[1], program_id=f"http-{i}", sampling=SamplingParams()))
        table.finished(f"http-{i}", 3)
    table.started(GenerationRequest(prompt_ids=[1], program_id="busy", sampling=SamplingParams()))
    assert len(table.programs) <= 8 and table.get("busy") is not None and table.get("http-39") is not None


def test_phase_of_a_direct_request_and_release(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, 1 << 16)
    try:
        fut = engine.submit(GenerationRequest(prompt_ids=tokenizer.encode("hello there"), program_id="prog",
                                              group_id="g", sampling=SamplingParams(max_tokens=3, temperature=0.0)))
        program = engine.programs.get("prog")
        assert program is not None and program.group_id == "g"
        assert program.phase in (Phase.REASONING, Phase.ACTING)  # the engine may already have finished it
        fut.result(timeout=30)
        assert program.phase is Phase.ACTING and program.prefix_tokens > 0
        engine.release("prog")
        assert engine.programs.get("prog") is None
    finally:
        engine.close()


class _WatchingEnv:
    """Two turns; at each tool step it records the phase of every program the engine knows."""

    version = "watch-v1"

    def __init__(self, engine: BuiltinEngine):
        self.engine, self.seen = engine, []

    async def reset(self, task: Task) -> Observation:
        return Observation(messages=[{"role": "user", "content": "Call the tool."}])

    async def step(self, action: str) -> StepResult:
        self.seen.append({pid: (p.phase, p.prefix_tokens) for pid, p in self.engine.programs.programs.items()})
        return StepResult(observation=[{"role": "user", "content": "The tool said 4."}], done=len(self.seen) >= 2)

    async def close(self) -> None:
        pass


def test_white_box_agent_loop_programs_act_between_turns(tiny_model, tokenizer):
    engine = _engine(tiny_model, tokenizer, 1 << 16, "longest_wait")
    try:
        env = _WatchingEnv(engine)
        loop = AgentLoop(engine, ChatRenderer(tokenizer), sampling=SamplingParams(temperature=0.0, max_tokens=4),
                         max_turns=3, max_context_tokens=2048)
        traj = asyncio.run(loop.run(env, Task(task_id="t", prompt="", answer="")))
        assert [list(s) for s in env.seen] == [[traj.trajectory_id]] * 2
        assert all(s[traj.trajectory_id][0] is Phase.ACTING and s[traj.trajectory_id][1] > 0 for s in env.seen)
        assert engine.programs.get(traj.trajectory_id) is None  # released when the trajectory ended
    finally:
        engine.close()


def test_black_box_gateway_programs_act_between_calls(tiny_model, tokenizer):
    openai = pytest.importorskip("openai")
    from loomrl.agent.gateway import Gateway, ServerThread

    engine = _engine(tiny_model, tokenizer, 8192, "longest_wait")
    gw = Gateway(engine, tokenizer, "tiny")
    server = ServerThread(gw.app())
    try:
        session = gw.open_session(task_id="t", group_id="grp")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=session.key, max_retries=0)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        for _ in range(2):
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
            program = engine.programs.get(session.session_id)
            assert program is not None and program.phase is Phase.ACTING and program.group_id == "grp"
            messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        gw.close_session(session)
        assert engine.programs.get(session.session_id) is None
    finally:
        server.stop()
        engine.close()
