"""`loomrl check-env`: a recipe's environment checked before training, as verifiers' `vf-eval` does: N of its tasks
played with a model behind an OpenAI-compatible endpoint choosing each reply (agent/endpoint.py), each episode scored
with the recipe's reward exactly as a run scores it (rollout/worker.py reward_pool_for: reward.function(s) in reward
worker processes, the environment's own reward, reward.terms, the judge), and the report (runtime/check_report.py)
that tells "the environment failed" from "the model did not solve it".

The environment runs as in a run: made from env.name and env.args, its start-up step and tasks (env/registry.py
prepared_tasks), a sandbox pool when it uses sandboxes, env.tool_timeout_s per tool call, agent.max_turns per episode.
The tasks are the first N of the held-out split (or of train). Episodes run `concurrency` at a time; `episodes`
fills as each is scored, so a Ctrl-C keeps the ones that finished (the CLI reports them).

Not here: the recipe's model, engine and trainer (nothing is loaded but the environment and its reward), black-box
agent programs (the endpoint's model is the agent), and `Environment.use_tokenizer` (no tokenizer here: an environment
that words its prompt by what a template renders sees its default).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from loomrl.agent.endpoint import EndpointPolicy, play
from loomrl.config import RunConfig
from loomrl.env.api import EpisodeContext, environment_for
from loomrl.env.pool import LeasePool, Leases, sandbox_pool
from loomrl.env.registry import prepared_tasks, sandbox_pool_size
from loomrl.rollout.worker import gather_all, reward_pool_for
from loomrl.types import Task, Trajectory

if TYPE_CHECKING:
    from loomrl.env.browser.pool import BrowserTab


class Progress(Protocol):
    """A progress bar (tqdm's)."""

    def update(self, n: int = 1) -> object: ...


@dataclass(slots=True, kw_only=True)
class CheckSettings:
    """The command line's choices (cli.py check-env)."""

    base_url: str
    model: str | None = None  # None: the first model the endpoint lists
    api_key_env: str | None = None
    n: int = 20
    split: Literal["heldout", "train"] = "heldout"
    concurrency: int = 4
    timeout_s: float = 120.0  # one request to the endpoint
    max_retries: int = 2
    temperature: float | None = None  # None: eval.temperature
    max_tokens: int | None = None  # None: sampling.max_tokens


@dataclass(slots=True, kw_only=True)
class Episode:
    trajectory: Trajectory
    success: bool | None  # None: not scored (it could not be played out, or its reward could not be computed)


class EnvCheck:
    """One check of `cfg`'s environment against an endpoint."""

    def __init__(self, cfg: RunConfig, settings: CheckSettings):
        self.cfg, self.settings = cfg, settings
        self.environment = environment_for(cfg.env)
        self.episodes: list[Episode] = []
        self.planned = 0  # the episodes it set out to play (fewer than n when the split has fewer tasks)
        self.model: str | None = settings.model

    def policy(self) -> EndpointPolicy:
        s, cfg = self.settings, self.cfg
        return EndpointPolicy(base_url=s.base_url, model=s.model, api_key_env=s.api_key_env,
                              temperature=cfg.eval.temperature if s.temperature is None else s.temperature,
                              max_tokens=s.max_tokens or cfg.sampling.max_tokens, timeout_s=s.timeout_s,
                              max_retries=s.max_retries)

    async def run(self, progress: Callable[[int], Progress]) -> None:
        """Ask the endpoint which model it serves, then play and score the tasks; `progress(total)` is called once
        the tasks are known and returns the bar each scored episode advances (tqdm's)."""
        policy = self.policy()
        pool: Leases | None = None
        browsers: LeasePool[BrowserTab] | None = None
        rewards = None
        try:
            self.model = await policy.resolve_model()  # an endpoint that cannot serve stops here, before any env
            tasks = await asyncio.to_thread(self._tasks)  # prepared_tasks runs its own event loop
            self.planned = len(tasks)
            bar = progress(len(tasks))
            if self.environment.sandbox is not None:
                size = sandbox_pool_size(self.cfg.env, self.cfg.agent.kind, self.settings.concurrency)
                pool = sandbox_pool(self.cfg.env, size)
                await pool.start()
            if self.environment.browser:
                from loomrl.env.browser.pool import browser_pool

                browsers = await browser_pool(self.cfg.env.browser, self.settings.concurrency).start()
            rewards = reward_pool_for(self.cfg.rollout_pool())
            slots = asyncio.Semaphore(self.settings.concurrency)
            rng = random.Random(f"{self.cfg.seed}:check-env")
            seeds = [rng.random() for _ in tasks]

            async def one(i: int, task: Task) -> None:
                async with slots:
                    await self._one(policy, pool, browsers, rewards, task, i, seeds[i])
                bar.update(1)

            await gather_all([one(i, t) for i, t in enumerate(tasks)])
        finally:
            await policy.aclose()
            if rewards is not None:
                await rewards.aclose()
            if pool is not None:
                await pool.close()
            if browsers is not None:
                await browsers.close()

    def _tasks(self) -> list[Task]:
        train, heldout = prepared_tasks(self.cfg.env, self.cfg.data)
        return list(heldout if self.settings.split == "heldout" else train)[: self.settings.n]

    async def _one(self, policy: EndpointPolicy, pool: Leases | None, browsers: LeasePool[BrowserTab] | None, rewards,
                   task: Task, i: int, seed: float) -> None:
        cfg = self.cfg
        env = self.environment.episode(EpisodeContext(pool=pool, rng=random.Random(seed),
                                                      tool_timeout_s=cfg.env.tool_timeout_s, browsers=browsers,
                                                      action_timeout_s=cfg.env.browser.action_timeout_s))
        traj = await play(env, task, policy, max_turns=cfg.agent.max_turns,
                          env_timeout_s=cfg.agent.trajectory_timeout_s, group_id=f"check-{i:05d}")
        traj.metadata.env_version = self.environment.version
        for leases in (pool, browsers):  # the sandboxes (browsers) cannot work here: every episode would fail
            if leases is not None and leases.failure is not None:
                raise leases.failure
        traj = await rewards.score(traj, task)
        self.episodes.append(Episode(trajectory=traj,
                                     success=self.environment.success(traj, task) if traj.scored else None))
