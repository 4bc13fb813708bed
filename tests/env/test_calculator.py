from __future__ import annotations

import asyncio
import random

import pytest

from loomrl.config import ConfigError
from loomrl.env.base import EnvCrash, ToolTimeout
from loomrl.env.pool import EnvPool
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


def _pool(backend="auto", size=2):
    return EnvPool(lambda: make_sandbox(backend), size=size)


@pytest.mark.parametrize("backend", ["auto", "process"])
def test_tool_call_runs_in_sandbox_and_answers(backend):
    task = generate_tasks(["add"], 1, 0, "train")[0]

    async def go():
        pool = await _pool(backend).start()
        env = CalculatorEnv(pool)
        obs = await env.reset(task)
        assert obs.messages[-1]["content"] == task.prompt
        step = await env.step(f"calc({task.data['expression']})")
        assert step.observation == [{"role": "user", "content": f"Result: {task.answer}"}] and not step.done
        bad = await env.step("calc(__import__('os').system('ls'))")
        assert "Error" in bad.observation[0]["content"]
        final = await env.step(f"The answer is {task.answer}.")
        assert final.done and final.info["final_answer"] == task.answer
        await env.close()
        assert pool.metrics.acquired == 2 and pool.metrics.kills == 0  # one lease per tool call
        dirs = [sb.workdir for sb in pool._all.values()]
        await pool.close()
        assert dirs and not any(d.exists() for d in dirs)

    asyncio.run(go())


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_crashing_or_hanging_tool_fails_the_step_and_its_sandbox_is_replaced(fault):
    task = generate_tasks(["add"], 1, 0, "train")[0]

    async def go():
        pool = await _pool(size=1).start()
        rates = {"crash_rate": 1.0} if fault == "crash" else {"hang_rate": 1.0}
        env = CalculatorEnv(pool, tool_timeout_s=0.5, rng=random.Random(0), **rates)
        await env.reset(task)
        first = next(iter(pool._all.values()))
        with pytest.raises(EnvCrash if fault == "crash" else ToolTimeout,
                           match="exited with status" if fault == "crash" else "ran past 0.5s"):
            await env.step("calc(1 + 1)")
        await env.close()
        ok = CalculatorEnv(pool)
        await ok.reset(task)
        assert (await ok.step("calc(1 + 1)")).observation[0]["content"] == "Result: 2"
        assert pool.metrics.kills == 1 and first.closed and first not in pool._all.values()
        await pool.close()

    asyncio.run(go())
