"""The web environment (env.name=web; loomrl/env/tasks/web/environment.py) over the real browser pool (Debian's
headless chromium in bubblewrap) and the shop site: a scripted agent's tool calls, reading element ids from the
observations as a model would, solve a contact task and a find task (reward 1 from the site's end state); the model's
mistakes come back as tool errors and the episode goes on; an episode cut short is judged on what it left on the site;
a site that fails and a page that hangs end the episode env_error (EnvCrash) and the tab goes back broken."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from loomrl.env.api import EpisodeContext, TaskSetup
from loomrl.env.base import EnvCrash
from loomrl.env.browser.chromium import missing_requirements
from loomrl.env.browser.site import SiteRequest
from loomrl.env.tasks.web.environment import WebArgs, WebEnvironment
from loomrl.types import Task, Trajectory

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing_requirements() is not None,
                                                      reason=missing_requirements() or "")]


@pytest.fixture(scope="module")
def tasks():
    environment = WebEnvironment(WebArgs())
    train, _ = environment.tasks(TaskSetup(families=None, n_train=60, n_heldout=10, seed=0,
                                           heldout_template_share=0.25, sandbox="process"))
    return environment, train


def _ctx(pool, action_timeout_s: float = 10.0) -> EpisodeContext:
    return EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=5.0, browsers=pool,
                          action_timeout_s=action_timeout_s)


def _id(text: str, kind: str, label: str) -> int:
    """The id the observation gives the element `kind "label"` (as a model reads it)."""
    found = re.search(rf"\[(\d+)\] {kind} \"{re.escape(label)}\"", text)
    assert found, f'no {kind} "{label}" in:\n{text}'
    return int(found.group(1))


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _trajectory(record: dict | None) -> Trajectory:
    return Trajectory(task_id="t", trajectory_id="x", group_id="g", env_record=record)


def test_a_scripted_agent_solves_a_contact_task_and_mistakes_are_tool_errors(run, pool, tasks):
    environment, train = tasks
    task: Task = next(t for t in train if t.family == "contact")
    f = task.data["fields"]
    env = environment.episode(_ctx(pool))

    async def go():
        try:
            obs = await env.reset(task)
            page = obs.messages[-1]["content"]
            assert task.prompt in page and obs.tools and "[" in page
            step = await env.step("click(999)")  # the short form, with an id not on the page: the model's mistake
            assert step.observation[0]["content"].startswith("Error: no element [999]") and not step.done
            assert step.info["tool_calls"][0]["tool_error"] and step.info["record"]["solved"] is False
            page = (await env.step(f"click({_id(page, 'link', 'Contact')})")).observation[0]["content"]
            for field, label in (("name", "Your name"), ("email", "Email"), ("order_ref", "Order number (optional)"),
                                 ("message", "Message")):
                if f[field]:
                    page = (await env.step(_call("type_text", element=_id(page, "textbox", label),
                                                 text=f[field]))).observation[0]["content"]
            page = (await env.step(_call("select", element=_id(page, "combobox", "Topic"), option=f["topic"])))\
                .observation[0]["content"]
            after = await env.step(_call("click", element=_id(page, "button", "Send message")))
            assert "Message sent" in after.observation[0]["content"] and after.info["record"]["solved"], after.info
            assert after.info["record"]["url"].endswith("/contact/sent/1")  # the redirect's URL, in the address bar
            done = await env.step(_call("answer", text="sent"))
            return done
        finally:
            await env.close()

    done = run(go())
    assert done.done and done.info["final_answer"] == "sent"
    traj = _trajectory(done.info["record"])
    assert environment.success(traj, task) and environment.reward(traj, task) == {"correct": 1.0}
    assert pool.metrics.kills == 0


def test_a_find_task_is_judged_on_the_answer_and_a_cut_short_buy_on_the_end_state(run, pool, tasks):
    environment, train = tasks
    find = next(t for t in train if t.family == "find" and t.data["attribute"] == "price")
    buy = next(t for t in train if t.family == "buy")

    async def go():
        env = environment.episode(_ctx(pool))
        try:
            await env.reset(find)
            wrong = await env.step("answer(0.01)")
        finally:
            await env.close()
        env = environment.episode(_ctx(pool))
        try:
            await env.reset(buy)
            cut = await env.step(_call("goto", path="/cart"))  # the turn budget ends here: nothing was bought
        finally:
            await env.close()
        return wrong, cut

    wrong, cut = run(go())
    assert wrong.done and not environment.success(_trajectory(wrong.info["record"]), find)
    assert "Cart" in cut.observation[0]["content"] and not cut.done
    assert cut.info["record"]["solved"] is False and "order" in cut.info["record"]["reason"]


def test_a_failing_site_and_a_hung_page_end_the_episode_env_error_and_the_tab_goes_back_broken(run, pool, tasks):
    environment, train = tasks
    task = next(t for t in train if t.family == "contact")
    kills = pool.metrics.kills

    async def go():
        env = environment.episode(_ctx(pool))
        try:
            obs = await env.reset(task)
            real = env.site.handle

            async def broken(request: SiteRequest):
                if "/contact" in request.url:
                    raise RuntimeError("database is locked")
                return await real(request)

            env.site.handle = broken
            with pytest.raises(EnvCrash, match="site failed: GET .*/contact: RuntimeError: database is locked"):
                await env.step(f"click({_id(obs.messages[-1]['content'], 'link', 'Contact')})")
        finally:
            await env.close()
        env = environment.episode(_ctx(pool, action_timeout_s=1.0))
        try:
            obs = await env.reset(task)

            async def hang(request: SiteRequest):
                await asyncio.sleep(3600)

            env.site.handle = hang
            with pytest.raises(EnvCrash, match="browser: TimeoutError"):
                await env.step(f"click({_id(obs.messages[-1]['content'], 'link', 'Contact')})")
        finally:
            await env.close()

    run(go())
    assert pool.metrics.kills == kills + 2  # both tabs destroyed and replaced, never reused


def test_a_training_run_on_the_web_environment_leases_a_tab_per_episode_and_leaves_nothing_running(tmp_path):
    """A real run (tiny random model, sync, one step) with env.name=web: the rollout worker makes the browser pool,
    every episode leases a tab, the counts add up, and no chromium process of ours is left after it. The random model
    acts badly; what is checked is the wiring."""
    from pathlib import Path

    from loomrl.config import load_config
    from loomrl.env.browser.chromium import pids_mentioning
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    recipe = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
    cfg = load_config(recipe, [f"output_dir={tmp_path}", "progress=false", "name=web", "env.name=web", "env.args={}",
                               "env.families=[contact, find]", "runtime.mode=sync", "trainer.total_steps=1",
                               "trainer.group_size=2", "eval.n_tasks=2", "env.n_train=8", "env.n_heldout=4",
                               "reward.function=null", "reward.terms={}", "agent.max_turns=2",
                               "agent.max_context_tokens=2048", "sampling.max_tokens=16", "env.browser.browsers=1"])
    before = set(pids_mentioning("loomrl-chromium-"))  # the module's own pool (the fixture) stays up meanwhile
    summary = train(cfg)
    launched = sum(v["launched"] for v in summary["rollouts"].values())
    # two held-out splits (training templates, held-out templates) of 2 tasks, before and after training
    assert {k: v["launched"] for k, v in summary["rollouts"].items()} == {"training": 2 * 2, "evaluation": 2 * 2 * 2}
    assert summary["env_pool"]["browser_acquired"] >= launched - summary["env_pool"].get("browser_kills", 0)
    assert summary["env_pool"]["browser_launches"] >= 1
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert rows and all(r["status"] in ("completed", "truncated", "env_error") for r in rows)
    assert not set(pids_mentioning("loomrl-chromium-")) - before  # the run's pool closed its browsers


def test_few_shot_shows_a_solved_episode_of_real_pages_and_a_model_following_it_solves_a_find_task(run, pool):
    """env.args.few_shot: the episode opens with a worked example, played on the real shop in the episode's own tab
    (its observations are real page text), then the task; doing what the example did solves a held-out find task.
    A family without an example is refused at load."""
    environment = WebEnvironment(WebArgs(few_shot=True))
    setup = TaskSetup(families=["find"], n_train=20, n_heldout=10, seed=0, heldout_template_share=0.25,
                      sandbox="process")
    train, heldout = environment.tasks(setup)
    task = next(t for t in heldout if t.data["attribute"] == "price")
    env = environment.episode(_ctx(pool))

    async def go():
        try:
            obs = await env.reset(task)
            msgs = obs.messages
            assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                 "assistant", "user"]
            example = environment.examples["find"]
            assert msgs[1]["content"].startswith(example.prompt) and msgs[-1]["content"].startswith(task.prompt)
            assert '"name": "type_text"' in msgs[2]["content"] and msgs[4]["content"].startswith("click(")
            assert msgs[6]["content"] == f"answer({example.answer})" and example.data["name"] in msgs[5]["content"]
            page = msgs[-1]["content"]
            found = await env.step(_call("type_text", element=_id(page, "textbox", "Search products"),
                                         text=task.data["name"], submit=True))
            product = await env.step(f"click({_id(found.observation[0]['content'], 'link', task.data['name'])})")
            assert task.answer in product.observation[0]["content"]
            return await env.step(f"answer({task.answer})")
        finally:
            await env.close()

    done = run(go())
    assert done.done and environment.success(_trajectory(done.info["record"]), task)
    with pytest.raises(Exception, match="no worked example for the families \\['buy'\\]"):
        environment.check(TaskSetup(families=["find", "buy"], n_train=2, n_heldout=2, seed=0,
                                    heldout_template_share=0.25, sandbox="process"))
