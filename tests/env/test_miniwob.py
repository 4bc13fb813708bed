"""MiniWoB++ (env.name=miniwob; loomrl/env/tasks/miniwob/) over the real browser pool (Debian's headless chromium in
bubblewrap) and the `miniwob` package's own task pages: the site serves them and nothing outside the package; a
scripted agent that reads only our observation text, as a model would, solves four tasks through the environment's
step() (success from the page's own raw reward), and a wrong click ends the episode unsolved; the page's timer does not
end an episode however slow the agent is (the page's clock is Playwright's fake one, run forward an hour); the same
(task, seed) gives the same instruction."""

from __future__ import annotations

import json
import random
import re

import pytest

from loomrl.env.api import EpisodeContext, TaskSetup
from loomrl.env.browser.chromium import missing_requirements
from loomrl.env.browser.pool import BrowserPool, BrowserTab
from loomrl.env.browser.site import SiteRequest
from loomrl.env.pool import LeasePool
from loomrl.types import Task, Trajectory

miniwob = pytest.importorskip("miniwob", reason="the miniwob package is not installed (pip install 'loomrl[miniwob]')")

from loomrl.env.tasks.miniwob.environment import MiniWoBArgs, MiniWoBEnvironment, make_tasks  # noqa: E402
from loomrl.env.tasks.miniwob.site import ORIGIN, MiniWoBSite  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing_requirements() is not None,
                                                      reason=missing_requirements() or "")]


def _ctx(pool) -> EpisodeContext:
    return EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=5.0, browsers=pool, action_timeout_s=10.0)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _id(text: str, kind: str, label: str | None = None, after: str | None = None) -> int:
    """The id of `kind "label"` in the page text (or of the first `kind` on a line after the line `after`)."""
    if after is not None:
        text = text.split(f"\n{after}\n", 1)[1]
    pattern = rf"\[(\d+)\] {kind}" + (rf" \"{re.escape(label)}\"" if label is not None else "")
    found = re.search(pattern, text)
    assert found, f"no {kind} {label or ''} in:\n{text}"
    return int(found.group(1))


def _quoted(instruction: str) -> list[str]:
    return re.findall(r'"([^"]*)"', instruction)


# Scripted agents: from the instruction and the page text (the first user message), the replies that solve the task.
def _click_button(instruction: str, page: str) -> list[str]:
    return [f"click({_id(page, 'button', _quoted(instruction)[0])})"]


def _click_checkboxes(instruction: str, page: str) -> list[str]:
    wanted = re.fullmatch(r"Select (.*) and click Submit\.", instruction).group(1)
    names = [] if wanted == "nothing" else re.split(r", | and ", wanted)
    return [_call("click", element=_id(page, "checkbox", n)) for n in names] + [
        _call("click", element=_id(page, "button", "Submit"))]


def _login_user(instruction: str, page: str) -> list[str]:
    user, password = _quoted(instruction)
    return [_call("type_text", element=_id(page, "textbox", after="Username"), text=user),
            _call("type_text", element=_id(page, "textbox", after="Password"), text=password),
            _call("click", element=_id(page, "button", "Login"))]


def _choose_list(instruction: str, page: str) -> list[str]:
    option = re.fullmatch(r"Select (.*) from the list and click Submit\.", instruction).group(1)
    return [_call("select", element=_id(page, "combobox"), option=option),
            _call("click", element=_id(page, "button", "Submit"))]


AGENTS = {"click-button": _click_button, "click-checkboxes": _click_checkboxes, "login-user": _login_user,
          "choose-list": _choose_list}


async def _play(environment: MiniWoBEnvironment, pool, task: Task, agent) -> tuple[str, list]:
    """One episode: the instruction and every step's result."""
    env = environment.episode(_ctx(pool))
    try:
        obs = await env.reset(task)
        page = obs.messages[-1]["content"]
        instruction = page.split("\n", 1)[0].removeprefix("Task: ")
        steps = []
        for reply in agent(instruction, page):
            steps.append(await env.step(reply))
            if steps[-1].done:
                break
        return instruction, steps
    finally:
        await env.close()


def test_the_site_serves_the_package_pages_and_nothing_outside_it(run):
    site = MiniWoBSite()

    async def get(path: str, method: str = "GET"):
        return await site.handle(SiteRequest(method=method, url=ORIGIN + path))

    page, core = run(get("/miniwob/click-button.html")), run(get("/core/core.js"))
    assert page.status == 200 and b"genProblem" in page.body and page.headers["content-type"].startswith("text/html")
    assert core.status == 200 and core.headers["content-type"].startswith("text/javascript")
    # the package's Python files sit one folder above html/: every way up is refused
    for path in ("/../environment.py", "/%2e%2e/environment.py", "/miniwob/..%2f..%2fenvironment.py",
                 "/%2e%2e/%2e%2e/%2e%2e/etc/passwd", "/no-such-task.html", "/"):
        refused = run(get(path))
        assert refused.status == 404 and b"import" not in refused.body, path
    assert run(get("/miniwob/click-button.html", "POST")).status == 405


def test_scripted_agents_solve_four_tasks_and_a_wrong_click_is_no_success(run, pool):
    environment = MiniWoBEnvironment(MiniWoBArgs(tasks=list(AGENTS)))
    train, heldout = environment.tasks(TaskSetup(families=None, n_train=8, n_heldout=4, seed=0,
                                                 heldout_template_share=0.0, sandbox="process"))
    assert {t.task_id for t in train}.isdisjoint(t.task_id for t in heldout)
    for task in train[:4]:
        instruction, steps = run(_play(environment, pool, task, AGENTS[task.family]))
        record = steps[-1].info["record"]
        assert steps[-1].done and record["solved"] and record["raw_reward"] == 1.0, (instruction, record)
        assert record["instruction"] == instruction and all(not s.done for s in steps[:-1])
        traj = Trajectory(task_id=task.task_id, trajectory_id="x", group_id="g", env_record=record)
        assert environment.success(traj, task) and environment.reward(traj, task) == {"correct": 1.0}

    def wrong(instruction: str, page: str) -> list[str]:
        label = _quoted(instruction)[0]
        others = [n for n, text in re.findall(r'\[(\d+)\] button "([^"]*)"', page) if text != label]
        assert others, page
        right = _id(page, "button", label)
        return ["click(999)", f"click({others[0]})", f"click({right})"]  # a mistake, the wrong button, (too late)

    task = next(t for t in train if t.family == "click-button")
    _, steps = run(_play(environment, pool, task, wrong))
    assert steps[0].observation[0]["content"].startswith("Error: no element [999]") and not steps[0].done
    assert len(steps) == 2 and steps[1].done and steps[1].info["record"]["raw_reward"] == -1.0
    assert not environment.success(Trajectory(task_id="t", trajectory_id="x", group_id="g",
                                              env_record=steps[1].info["record"]), task)
    assert pool.metrics.kills == 0


class _FakeClockTabs(LeasePool[BrowserTab]):
    """The real pool's tabs with Playwright's fake clock installed on each before the episode opens its page, so the
    test can run the page's timers an hour forward in no time. A wrapper, not a fake: every tab is the real pool's."""

    def __init__(self, pool: BrowserPool):
        self.pool, self.metrics = pool, pool.metrics

    async def acquire(self) -> BrowserTab:
        tab = await self.pool.acquire()
        await tab.context.clock.install()
        return tab

    async def release(self, item: BrowserTab, /, *, broken: bool = False) -> None:
        await self.pool.release(item, broken=broken)


@pytest.mark.parametrize("time_limit_s", [None, 5.0])
def test_the_page_timer_ends_an_episode_only_when_a_limit_is_asked_for(run, pool, time_limit_s):
    """The task page's own limit is 10 s; an hour of the page's time passes between reset and the first action."""
    environment = MiniWoBEnvironment(MiniWoBArgs(tasks=["click-button"], time_limit_s=time_limit_s))
    task = make_tasks(["click-button"], 1, "train")[0]

    async def go():
        env = environment.episode(_ctx(_FakeClockTabs(pool)))
        try:
            obs = await env.reset(task)
            await env.tab.tab.context.clock.run_for("01:00:00")  # the TabSession's leased BrowserTab
            page = obs.messages[-1]["content"]
            return await env.step(_click_button(page.split("\n", 1)[0].removeprefix("Task: "), page)[0])
        finally:
            await env.close()

    step = run(go())
    record = step.info["record"]
    if time_limit_s is None:  # the click after an hour still counts
        assert step.done and record["solved"] and record["raw_reward"] == 1.0, record
    else:  # the limit we set ended the episode before the click: the page's timer is live and ours to set
        assert step.done and not record["solved"] and record["reason"] == "timed out", record


def test_the_same_task_instance_gives_the_same_instruction(run, pool):
    environment = MiniWoBEnvironment(MiniWoBArgs(tasks=["login-user"]))

    def read(instruction: str, page: str) -> list[str]:
        return []

    def instruction(seed: int) -> str:
        task = Task(task_id="t", prompt="", answer="", family="login-user", data={"task": "login-user", "seed": seed})
        return run(_play(environment, pool, task, read))[0]

    first, again, other = instruction(7), instruction(7), instruction(8)
    assert first == again and first != other and "username" in first
