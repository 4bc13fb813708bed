"""The web environment (env.name=web): an agent shops on the local site (shop.py) in a leased browser tab.

An episode leases one tab of the run's browser pool (loomrl/env/browser/pool.py) for its whole length, attaches a
fresh copy of the site to it (its own SQLite database, restored from the snapshot), and opens the home page. The model
reads the page as text with element ids (page_text.observe) and acts through tool calls (actions.TOOL_SCHEMAS: click,
type_text, select, scroll, go_back, goto; `answer` or a reply without a call ends the episode). After every step the
task is checked on the site's end state (shop_checks.check_task) and kept as the trajectory's env_record, so that an
episode cut short by its turn budget is judged on what it left on the site, like a finished one.

Failures, kept apart on purpose:
- the model's mistake (an id not on the page, an option not in the list, a page off the site, a malformed call): the
  tool answers with the error text, recorded as a tool error; the episode goes on;
- the browser's or the site's (a page that hangs past env.browser.action_timeout_s, a crashed browser, a site handler
  that raised or did not answer): EnvCrash, the episode ends `env_error` (never scored, retried per agent.retry_on)
  and the tab goes back to the pool as broken (destroyed and replaced).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.base import Env, EnvCrash, Observation, StepResult
from loomrl.env.browser.actions import TOOL_SCHEMAS
from loomrl.env.browser.episode import TabSession
from loomrl.env.tasks.web.demos import DEMO_FAMILIES, WebDemos
from loomrl.env.tasks.web.shop import ShopSite, shop_site
from loomrl.env.tasks.web.shop_checks import check_task
from loomrl.env.tasks.web.shop_tasks import ENV_VERSION, FAMILIES, check_families, make_splits
from loomrl.env.tools import describe_schemas
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task, Trajectory

SYSTEM = ("You use a web shop through its pages. Each page is shown as text; the things you can use have an id in "
          "brackets, like [3]. Act with one tool call per reply. When the task is done, answer with the tool answer "
          "(for a question, put the answer in it).")
# the one-argument actions also take the short form small models pick up: click(3), goto(/cart), answer(12.50)
SINGLE_ARG = {"click": "element", "goto": "path", "scroll": "direction", "answer": "text"}
ACTIONS = [t["function"]["name"] for t in TOOL_SCHEMAS if t["function"]["name"] != "answer"]


class WebArgs(BaseModel):
    """env.args of env.name=web."""

    model_config = {"extra": "forbid"}

    site: Literal["shop"] = "shop"  # the site the tasks are on (the only one shipped)
    max_chars: int = Field(1200, ge=200)  # an observation's characters at most (the page scrolls beyond)
    screenshots: bool = False  # a JPEG of the page after every step, kept in the trajectory's env_record (off: large)
    describe_tools: bool = True  # the actions' schemas in the system prompt as text (for templates without tools)
    few_shot: bool = False  # a solved episode of the task's family (find, contact) as earlier turns (demos.py)


class WebEnvironment(Environment):
    """Shop tasks (buy, contact, find) on the local site, in a leased browser tab."""

    Args = WebArgs
    version = ENV_VERSION
    browser = True

    def __init__(self, args: WebArgs):
        self.args = args
        self.demos = WebDemos()
        self.examples: dict[str, Task] = {}  # each family's worked example: its first training task

    def check(self, setup: TaskSetup) -> None:
        families = setup.families or list(FAMILIES)
        check_families(families)
        if self.args.few_shot and (missing := [f for f in families if f not in DEMO_FAMILIES]):
            raise ConfigError(f"env.args.few_shot: no worked example for the families {missing} (those with one: "
                              f"{list(DEMO_FAMILIES)}); drop them from env.families or set few_shot: false")

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        train, heldout = make_splits(setup.families or list(FAMILIES), setup.n_train, setup.n_heldout, setup.seed,
                                     setup.heldout_template_share)
        for t in train:
            self.examples.setdefault(t.family, t)
        return train, heldout

    def episode(self, ctx: EpisodeContext) -> Env:
        if ctx.browsers is None:
            raise EnvCrash("env.name=web needs the run's browser pool, and this episode was given none")
        return WebEnv(ctx, self.args, self if self.args.few_shot else None)

    def success(self, traj: Trajectory, task: Task) -> bool:
        return bool(traj.env_record and traj.env_record.get("solved"))

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return {"correct": 1.0 if self.success(traj, task) else 0.0}


def user_turn(task: Task, page: str) -> str:
    """The task and the page the episode starts on, as the user's turn."""
    return f"{task.prompt}\n\n{page}"


class WebEnv(Env):
    version = ENV_VERSION

    def __init__(self, ctx: EpisodeContext, args: WebArgs, examples: WebEnvironment | None = None):
        assert ctx.browsers is not None, "WebEnvironment.episode checks it"
        self.args, self.examples = args, examples
        self.tab = TabSession(ctx.browsers, action_timeout_s=ctx.action_timeout_s, max_chars=args.max_chars,
                              screenshots=args.screenshots)
        self.site: ShopSite | None = None
        self.task: Task | None = None

    async def reset(self, task: Task) -> Observation:
        self.task = task
        shots: list[dict[str, Any]] = []
        if self.examples is not None:
            example = self.examples.examples.get(task.family)
            if example is None:
                raise EnvCrash(f"env.args.few_shot: no training task of the family {task.family!r} to show solved")
            shots = await self.examples.demos.messages(example, self.tab, user_turn)
        self.site = shop_site(seed=task.data["catalogue_seed"])
        await self.tab.open(self.site)
        await self.tab.goto(self.site.origin + "/")
        text = await self.tab.observe()
        system = SYSTEM + (f"\n\n{describe_schemas(TOOL_SCHEMAS)}" if self.args.describe_tools else "")
        return Observation(messages=[{"role": "system", "content": system}, *shots,
                                     {"role": "user", "content": user_turn(task, text)}], tools=TOOL_SCHEMAS)

    async def step(self, action: str) -> StepResult:
        assert self.task is not None, "reset first"
        calls = parse_tool_calls(action, SINGLE_ARG)
        answer = next((c for c in calls if c.name == "answer" and not c.error), None)
        if not calls or answer is not None:
            final = str(answer.arguments.get("text", "")) if answer is not None else action.strip()
            return StepResult(observation=[], done=True,
                              info={"final_answer": final, "record": self._record(final)})
        messages, records = [], []
        for call in calls:
            record: dict[str, Any] = {"name": call.name, "arguments": call.arguments, "error": call.error}
            output = await self.tab.act(call, record, ACTIONS) or await self.tab.observe()
            messages.append({"role": "tool", "name": call.name or "unknown", "content": output})
            records.append(record)
        return StepResult(observation=messages, info={"tool_calls": records, "record": self._record(None)})

    def _record(self, answer: str | None) -> dict[str, Any]:
        """The task checked on the site's end state now (kept as env_record: the last step's wins)."""
        assert self.task is not None and self.site is not None
        verdict = check_task(self.task, self.site.db, answer)
        out: dict[str, Any] = {"solved": verdict.solved, "reason": verdict.reason, "url": self.tab.page.url}
        if self.tab.screenshots:
            out["screenshots"] = list(self.tab.screenshots)
        return out

    async def close(self) -> None:
        """The tab back to the pool (as broken after a browser or site failure: destroyed and replaced)."""
        await self.tab.close()
