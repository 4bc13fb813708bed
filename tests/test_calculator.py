from __future__ import annotations

import asyncio
import random

import pytest

from loomrl.config import ConfigError
from loomrl.env.base import EnvCrash, ToolTimeout
from loomrl.env.sandbox import make_sandbox
from loomrl.env.tasks.calculator import CalculatorEnv, generate_tasks, make_splits, parse_final_answer

FAMILIES = ["add", "sub", "mul", "div", "add_sub", "distract_add", "distract_sub", "distract_mul"]


def test_splits_are_reproducible_and_disjoint():
    train, heldout = make_splits(FAMILIES, FAMILIES, 300, 100, seed=7)
    again_train, again_heldout = make_splits(FAMILIES, FAMILIES, 300, 100, seed=7)
    assert [t.prompt for t in train] == [t.prompt for t in again_train]
    assert [t.prompt for t in heldout] == [t.prompt for t in again_heldout]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    for task in train[:50]:
        assert str(round(eval(task.data["expression"]))) == task.answer


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="env.families"):
        generate_tasks(["algebra"], 3, 0, "train")


def test_final_answer_parsing():
    assert parse_final_answer("The answer is 1,234.") == "1234"
    assert parse_final_answer("so the answer is: -7") == "-7"
    assert parse_final_answer("I think 5") is None


@pytest.mark.parametrize("backend", ["auto", "process"])
def test_tool_call_runs_in_sandbox_and_answers(backend):
    task = generate_tasks(["add"], 1, 0, "train")[0]

    async def go():
        env = CalculatorEnv(make_sandbox(backend))
        obs = await env.reset(task)
        assert obs.messages[-1]["content"] == task.prompt
        step = await env.step(f"calc({task.data['expression']})")
        assert step.observation == [{"role": "user", "content": f"Result: {task.answer}"}] and not step.done
        bad = await env.step("calc(__import__('os').system('ls'))")
        assert "Error" in bad.observation[0]["content"]
        final = await env.step(f"The answer is {task.answer}.")
        assert final.done and final.info["final_answer"] == task.answer
        await env.close()
        assert not env.sandbox.workdir.exists()

    asyncio.run(go())


def test_crashing_tool_raises_env_crash():
    task = generate_tasks(["add"], 1, 0, "train")[0]

    async def go():
        env = CalculatorEnv(make_sandbox("auto"), crash_rate=1.0, rng=random.Random(0))
        await env.reset(task)
        with pytest.raises(EnvCrash, match="exited with status"):
            await env.step("calc(1 + 1)")
        await env.close()

    asyncio.run(go())


def test_hanging_tool_is_killed_at_its_timeout(monkeypatch):
    import loomrl.env.tasks.calculator as calc

    monkeypatch.setattr(calc, "TOOL_SOURCE", "import time; time.sleep(30)")
    task = generate_tasks(["add"], 1, 0, "train")[0]

    async def go():
        env = CalculatorEnv(make_sandbox("auto"), tool_timeout_s=0.5)
        await env.reset(task)
        with pytest.raises(ToolTimeout):
            await env.step("calc(1 + 1)")
        await env.close()

    asyncio.run(go())
