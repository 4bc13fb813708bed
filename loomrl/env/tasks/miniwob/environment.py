"""MiniWoB++ as an outside benchmark (env.name=miniwob): the `miniwob` package's own task pages in a leased tab.

An episode leases a tab of the run's browser pool, attaches the package's files as a site (site.py), opens the task's
page and starts its episode as the package's own driver does: `Math.seedrandom(seed)`, the data mode, then
`core.startEpisodeReal()`, which generates the problem from the seeded generator. So task instance (name, seed) is the
instance the package's gymnasium environment shows for `reset(seed=seed)`. The instruction is the page's utterance
(`core.getUtterance()`); the model gets it and the page as text with element ids (page_text.observe), and acts with
click, type_text, select and scroll (actions.perform). After every action the page's own globals say whether the
episode is over (`WOB_DONE_GLOBAL`) and its raw reward (`WOB_RAW_REWARD_GLOBAL`, before MiniWoB's time discount);
the episode ends there, and success is a raw reward above 0. The verdict is kept as the trajectory's env_record
after every step (step info "record"), so an episode cut short by its turn budget is judged (unsolved) like the web
environment's.

Time limit: each task page ends its episode after `core.EPISODE_MAX_TIME` of real time (10 s for most), with reward
-1. A model on a CPU takes longer than that per turn, so by default the page's timer is switched off right after the
episode starts (the turn budget, agent.max_turns, bounds the episode instead); `env.args.time_limit_s` sets a limit
of our choosing instead. The page's reward display (last reward, time left) is hidden: it is not part of the task.

Failures: the model's mistakes (an id not on the page, an action not offered) are tool errors and the episode goes on;
the browser's or the page's (a hang past env.browser.action_timeout_s, a crash, a page whose scripts did not load)
are EnvCrash: the episode ends env_error, never scored, and the tab goes back broken.

What is not here: the tasks that need coordinates, drawing or dragging (no such actions), MiniWoB's time-discounted
reward (kept in the record as `env_reward` only), its "transfer" tasks' test data mode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field, field_validator

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.base import Env, EnvCrash, Observation, StepResult
from loomrl.env.browser.actions import TOOL_SCHEMAS
from loomrl.env.browser.episode import TabSession
from loomrl.env.browser.page_text import bounded_evaluate
from loomrl.env.tasks.miniwob.site import MiniWoBSite, miniwob_html, task_page
from loomrl.env.tools import describe_schemas
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task, Trajectory

ENV_VERSION = "miniwob-1.1.0-v1"
# Tasks a text agent can do with click, type_text and select on our page text (each checked by a scripted agent in
# tests/env/test_miniwob.py or by hand): no coordinates, drawing, dragging, colours or shapes.
DEFAULT_TASKS = ["click-button", "click-link", "click-dialog", "click-tab", "click-option", "click-checkboxes",
                 "focus-text", "enter-text", "enter-password", "login-user", "choose-list"]
ACTIONS = ("click", "type_text", "select", "scroll")
TOOLS = [s for s in TOOL_SCHEMAS if s["function"]["name"] in ACTIONS]
SINGLE_ARG = {"click": "element", "scroll": "direction"}
HELDOUT_SEED0 = 1_000_000  # held-out instances use seeds from here; training ones from 0 (disjoint ranges)
READY_TIMEOUT_S = 5.0  # a page that says it is not ready (WOB_TASK_READY) for this long is a page failure
SYSTEM = ("You do small tasks on a web page. The page is shown as text; the things you can use have an id in "
          "brackets, like [3]. Act with one tool call per reply. The task ends by itself when it is done.")

# Starts the episode the way the package's SeleniumInstance.begin_task does (seed, data mode, startEpisodeReal), then
# applies our time limit (null: the page's timer is cleared; a non-null EP_TIMER must stay, as endEpisode ignores any
# end once it is null) and hides the reward display.
_START_JS = """
([seed, limitMs]) => {
  Math.seedrandom(seed);
  core.setDataMode('train');
  if (limitMs !== null) core.EPISODE_MAX_TIME = limitMs;
  core.startEpisodeReal();
  if (limitMs === null) {
    clearTimeout(core.EP_TIMER);
    core.EP_TIMER = 'loomrl: no time limit';
    core.clearTimer();
  }
  core.hideDisplay();
  return WOB_TASK_READY;
}
"""
_UTTERANCE_JS = "() => { const u = core.getUtterance(); return typeof u === 'string' ? u : u.utterance; }"
_STATE_JS = ("() => ({done: WOB_DONE_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL, env_reward: WOB_REWARD_GLOBAL, "
             "reason: WOB_REWARD_REASON === null ? null : String(WOB_REWARD_REASON)})")


class MiniWoBArgs(BaseModel):
    """env.args of env.name=miniwob."""

    model_config = {"extra": "forbid"}

    tasks: list[str] = Field(default_factory=lambda: list(DEFAULT_TASKS), min_length=1)  # MiniWoB++ task names
    max_chars: int = Field(1200, ge=200)  # an observation's characters at most (the page scrolls beyond)
    time_limit_s: float | None = Field(None, gt=0)  # the page's own time limit (None: off; the turn budget bounds)
    describe_tools: bool = True  # the actions' schemas in the system prompt as text (for templates without tools)

    @field_validator("tasks")
    @classmethod
    def _known(cls, tasks: list[str]) -> list[str]:
        try:
            pages = miniwob_html() / "miniwob"
        except ImportError as err:  # a config error of one line at load, not a traceback
            raise ValueError(str(err)) from None
        unknown = [t for t in tasks if not (pages / f"{t}.html").is_file()]
        if unknown:
            raise ValueError(f"unknown MiniWoB++ task(s) {', '.join(unknown)}; the package's tasks are the names of "
                             f"{pages}/*.html")
        return tasks


def make_tasks(names: list[str], n: int, split: str) -> list[Task]:
    """`n` instances cycling through `names`: instance i is task names[i % len] with seed i // len (plus
    HELDOUT_SEED0 for held-out splits), so a split is the same list in every run: env.seed does not move a
    benchmark's instances."""
    base = 0 if split == "train" else HELDOUT_SEED0
    out = []
    for i in range(n):
        name, seed = names[i % len(names)], base + i // len(names)
        out.append(Task(task_id=f"miniwob-{name}-{seed}", split=split, family=name, answer="",
                        prompt=f"MiniWoB++ {name}, seed {seed} (the instruction is generated by the page)",
                        data={"task": name, "seed": seed}))
    return out


class MiniWoBEnvironment(Environment):
    """MiniWoB++ tasks from the `miniwob` package's pages, in a leased browser tab."""

    Args = MiniWoBArgs
    version = ENV_VERSION
    browser = True

    def __init__(self, args: MiniWoBArgs):
        self.args = args

    def check(self, setup: TaskSetup) -> None:
        if setup.families:
            raise ConfigError("config error: env.families: env.name=miniwob picks its tasks with env.args.tasks "
                              "(MiniWoB++ task names); remove env.families")

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        return make_tasks(self.args.tasks, setup.n_train, "train"), make_tasks(self.args.tasks, setup.n_heldout,
                                                                               "heldout")

    def episode(self, ctx: EpisodeContext) -> Env:
        if ctx.browsers is None:
            raise EnvCrash("env.name=miniwob needs the run's browser pool, and this episode was given none")
        return MiniWoBEnv(ctx, self.args)

    def success(self, traj: Trajectory, task: Task) -> bool:
        return bool(traj.env_record and traj.env_record.get("solved"))

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return {"correct": 1.0 if self.success(traj, task) else 0.0}


class MiniWoBEnv(Env):
    version = ENV_VERSION

    def __init__(self, ctx: EpisodeContext, args: MiniWoBArgs):
        assert ctx.browsers is not None, "MiniWoBEnvironment.episode checks it"
        self.ctx, self.args = ctx, args
        self.tab = TabSession(ctx.browsers, action_timeout_s=ctx.action_timeout_s, max_chars=args.max_chars)
        self.task: Task | None = None
        self.instruction = ""
        self.state: dict[str, Any] = {"done": False, "raw_reward": 0.0, "env_reward": 0.0, "reason": None}

    async def reset(self, task: Task) -> Observation:
        self.task = task
        await self.tab.open(MiniWoBSite())
        self.instruction = await self.tab.run(self._start(task.data["task"], int(task.data["seed"])))
        text = await self.tab.observe()
        system = SYSTEM + (f"\n\n{describe_schemas(TOOLS)}" if self.args.describe_tools else "")
        return Observation(messages=[{"role": "system", "content": system},
                                     {"role": "user", "content": f"Task: {self.instruction}\n\n{text}"}], tools=TOOLS)

    async def _start(self, name: str, seed: int) -> str:
        """Open the task's page, start its seeded episode, wait (bounded) until it is ready: its instruction."""
        t = self.ctx.action_timeout_s
        await self.tab.page.goto(self.tab.origin + task_page(name), timeout=t * 1000, wait_until="load")
        limit = None if self.args.time_limit_s is None else round(self.args.time_limit_s * 1000)
        ready = await bounded_evaluate(self.tab.page, _START_JS, [seed, limit], t, "starting the MiniWoB++ episode")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while not ready:
            if loop.time() > deadline:
                raise TimeoutError(f"the MiniWoB++ page {name} was not ready {READY_TIMEOUT_S:g} s after its start")
            await asyncio.sleep(0.05)
            ready = await bounded_evaluate(self.tab.page, "() => WOB_TASK_READY", None, t, "waiting for the page")
        return str(await bounded_evaluate(self.tab.page, _UTTERANCE_JS, None, t, "reading the instruction"))

    async def _read_state(self) -> None:
        self.state = await bounded_evaluate(self.tab.page, _STATE_JS, None, self.ctx.action_timeout_s,
                                            "reading the episode's state")

    async def step(self, action: str) -> StepResult:
        assert self.task is not None, "reset first"
        await self.tab.run(self._read_state())  # a page may end its episode on its own (a timer, an animation)
        calls = parse_tool_calls(action, SINGLE_ARG)
        if self.state["done"] or not calls:  # a reply without a call gives up, as in env.name=web
            return StepResult(observation=[], done=True, info={"final_answer": action.strip(),
                                                               "record": self._record()})
        messages, records = [], []
        for call in calls:
            record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": call.error}
            output = await self._act(call, record)
            messages.append({"role": "tool", "name": call.name or "unknown", "content": output})
            records.append(record)
            if self.state["done"]:
                break  # the page ended the episode: later calls have no page to act on
        done = bool(self.state["done"])  # the observation of a finished episode is never shown: none is sent
        return StepResult(observation=[] if done else messages, done=done,
                          info={"tool_calls": records, "record": self._record()})

    async def _act(self, call: Any, record: dict[str, Any]) -> str:
        """One tool call on the page: the tool's answer (the page after it, the end, or the model's error)."""
        error = await self.tab.act(call, record, ACTIONS)
        if error is not None:
            return error
        await self.tab.run(self._read_state())
        if self.state["done"]:
            return "The task is over."  # not sent: a done step sends no observation
        return await self.tab.observe()

    def _record(self) -> dict[str, Any]:
        """The verdict now (kept as env_record: the last step's wins): solved once the page ended with raw reward
        above 0."""
        assert self.task is not None
        done, raw = bool(self.state["done"]), float(self.state["raw_reward"])
        return {"solved": done and raw > 0, "done": done, "raw_reward": raw,
                "env_reward": float(self.state["env_reward"]), "reason": self.state["reason"],
                "task": self.task.data["task"], "seed": self.task.data["seed"], "instruction": self.instruction}

    async def close(self) -> None:
        """The tab back to the pool (as broken after a browser or page failure: destroyed and replaced)."""
        await self.tab.close()
