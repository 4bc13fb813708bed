from __future__ import annotations

import asyncio
import random
import re

import pytest

from loomrl.config import ConfigError, load_config
from loomrl.env.base import EnvCrash, ToolTimeout
from loomrl.env.pool import EnvPool
from loomrl.env.registry import split_templates
from loomrl.env.sandbox import make_sandbox
from loomrl.env.tasks.calculator import FAMILIES as ALL_FAMILIES
from loomrl.env.tasks.calculator import CalculatorEnv, generate_tasks, make_splits, parse_final_answer, template_ids

FAMILIES = ["add", "sub", "mul", "div", "add_sub", "distract_add", "distract_sub", "distract_mul"]
DISTRACT = ["distract_add", "distract_sub", "distract_mul"]


def test_splits_are_reproducible_and_disjoint():
    train, heldout = make_splits(FAMILIES, FAMILIES, 300, 100, seed=7)
    again_train, again_heldout = make_splits(FAMILIES, FAMILIES, 300, 100, seed=7)
    assert [t.prompt for t in train] == [t.prompt for t in again_train]
    assert [t.prompt for t in heldout] == [t.prompt for t in again_heldout]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    for task in train[:50]:
        assert str(round(eval(task.data["expression"]))) == task.answer


def test_template_split_is_disjoint_and_covers_every_distract_family():
    train, heldout = make_splits(FAMILIES, FAMILIES, 600, 150, seed=7, heldout_template_share=0.25)
    held_numbers = [t for t in heldout if t.split == "heldout"]
    held_templates = [t for t in heldout if t.split == "heldout_templates"]
    assert len(held_numbers) == len(held_templates) == 150
    trained = {t.data["template"] for t in train}
    new = {t.data["template"] for t in held_templates}
    assert not trained & new  # no held-out phrasing is ever trained on
    assert {t.data["template"] for t in held_numbers} <= trained
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    # a quarter of each 16-template family is held out; a family of one or two keeps all its templates
    assert {f: sum(t.startswith(f + "/") for t in new) for f in DISTRACT} == dict.fromkeys(DISTRACT, 4)
    assert {t.family for t in held_templates} == set(DISTRACT)
    assert {t.data["template"] for t in train if t.family.startswith("distract_")} == {
        i for f in DISTRACT for i in template_ids([f])[f]} - new  # every training template is used


def test_template_split_is_per_family_and_refuses_a_bad_share():
    ids = template_ids(DISTRACT)
    train, held = split_templates(ids, 0.25, seed=3)
    alone_train, alone_held = split_templates({"distract_mul": ids["distract_mul"]}, 0.25, seed=3)
    assert alone_held["distract_mul"] == held["distract_mul"]  # a family's split ignores which others are listed
    assert split_templates(ids, 0.25, seed=4)[1] != held
    assert split_templates(ids, 0.0, seed=3)[1] == dict.fromkeys(DISTRACT, [])
    with pytest.raises(ConfigError, match="env.heldout_template_share"):
        split_templates(ids, 1.0, seed=3)
    _, heldout = make_splits(DISTRACT, DISTRACT, 30, 10, seed=3, heldout_template_share=0.0)
    assert {t.split for t in heldout} == {"heldout"}


def test_bad_template_share_in_a_recipe_names_the_field():
    from pathlib import Path

    recipe = Path(__file__).parents[2] / "examples" / "calculator_tiny.yaml"
    with pytest.raises(ConfigError, match="env.heldout_template_share"):
        load_config(recipe, ["env.heldout_template_share=1.5"])


def test_generator_is_reproducible_from_the_seed():
    def prompts(seed):
        train, heldout = make_splits(DISTRACT, DISTRACT, 200, 50, seed=seed, heldout_template_share=0.25)
        return [(t.prompt, t.answer, t.data["template"]) for t in train + heldout]

    assert prompts(11) == prompts(11)
    assert prompts(11) != prompts(12)


@pytest.mark.integration
def test_every_template_is_solved_by_one_tool_call():
    """Each template of each family, drawn several times: the expression is one `a op b` on two numbers
    of the question, and the real tool, in a real sandbox, returns the answer from that one call."""
    async def go():
        pool = await _pool().start()
        env = CalculatorEnv(pool)
        try:
            for family, ids in template_ids(list(ALL_FAMILIES)).items():
                for tid in ids:
                    tasks = generate_tasks([family], 20, 5, "check", templates={family: [tid]})
                    assert {t.data["template"] for t in tasks} == {tid}
                    for task in tasks:
                        assert "{" not in task.prompt and "}" not in task.prompt, task.prompt
                        numbers = re.findall(r"\d+", task.prompt)
                        if family.startswith("distract_"):  # one step, two operands and a distractor
                            a, op, b = task.data["expression"].split(" ")
                            assert op in "+-*" and a in numbers and b in numbers and len(numbers) == 3, task.prompt
                            assert int(task.answer) >= 0
                    await env.reset(tasks[0])
                    step = await env.step(f"calc({tasks[0].data['expression']})")
                    assert step.observation[0]["content"] == f"Result: {tasks[0].answer}", tid
        finally:
            await env.close()
            await pool.close()

    asyncio.run(go())


def test_no_worked_example_is_an_instance_of_a_template():
    """The few-shot examples are shown in every prompt: one drawn from a template would show a held-out
    phrasing to the model."""
    from loomrl.env.tasks.calculator import FEW_SHOT

    def patterns(families):
        return [re.compile("^" + re.sub(r"\\{\w+\\}", ".+?", re.escape(q)) + "$")
                for f in families for q, _ in ALL_FAMILIES[f][1]]

    examples = [(mode, q) for mode, shots in FEW_SHOT.items() for q, _, _ in shots if not q.startswith("What is")]
    assert len(examples) == 4
    for mode, question in examples:
        # known: few_shot=word shows the phrasing of add's first template (two templates: none held out
        # unless env.heldout_template_share >= 0.5)
        families = [f for f in ALL_FAMILIES if not (mode == "word" and f == "add")]
        assert not [p.pattern for p in patterns(families) if p.match(question)], question
    assert any(p.match(FEW_SHOT["word"][0][0]) for p in patterns(["add"]))  # the patterns do match


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


def test_an_unknown_family_is_a_config_error_before_any_lookup():
    """make_splits looked the names up (template_ids) before generate_tasks checked them: a KeyError."""
    with pytest.raises(ConfigError) as err:
        make_splits(["distract_add", "nope"], ["distract_add"], 10, 2, seed=0)
    assert str(err.value).startswith("config error: env.families: unknown calculator family 'nope'; choose from add, ")
    with pytest.raises(ConfigError, match="^config error: env.args.heldout_families: unknown calculator family"):
        make_splits(["add"], ["add", "nope"], 10, 2, seed=0)
