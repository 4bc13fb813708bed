"""Whole episodes in Ray env actors (ray.env.count > 0, an environment with a browser): EpisodeActor runs them where
the browsers are, RemoteEpisodes and RemoteEnv are what a rollout actor drives them through.

A browser tab cannot be leased across processes the way a sandbox is (env/remote.py RemoteSandbox forwards exec and
file calls; a Playwright Page and the site it routes to, the shop's SQLite or MiniWoB's pages, live in the process
that made them). So the env actor makes the Environment itself (from the run's config, started as a rollout worker
starts it), owns the browser pool and serves the Env protocol (reset, step, finalize, close) per episode id; the
rollout actor's RemoteEnv forwards those four calls. Guarantees:
- the episode id is the caller's (a uuid chosen before reset is sent), so a reset the caller gave up on (its deadline,
  a cancelled group) is closed by id: a close that arrives first makes the late reset refuse and give its tab back;
- every call is bounded (CallBounds): past its bound it is ToolTimeout (`timeout`), and the close that follows
  cancels the call still running in the env actor;
- an env actor that dies mid-episode ends the episode with EnvCrash (`env_error`, never scored); Ray restarts it
  (ray.env.max_restarts) with a fresh Environment and browser pool, which knows none of the old episodes; a reset
  that meets a dead or restarting env actor tries the others, and it again, for RESET_PATIENCE_S;
- the episodes of a rollout actor that died are closed by the driver (release_owner) and their tabs go back;
- closing is idempotent (RemoteEnv closes once; the env actor closes an id once).

What is not here: the sandbox leases of env actors (env/remote.py), which environments without a browser use.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from loomrl.actor_support import Placed, actor_error_line
from loomrl.config import EnvConfig, RolloutPoolConfig
from loomrl.env.api import Environment, EpisodeContext, environment_for
from loomrl.env.base import Env, EnvCrash, Observation, StepResult, ToolTimeout
from loomrl.env.pool import EnvPool, EnvPoolFailed, sandbox_pool
from loomrl.env.registry import prepared_tasks, sandbox_pool_size
from loomrl.errors import named_line
from loomrl.types import Task

if TYPE_CHECKING:
    from loomrl.env.browser.pool import BrowserPool

log = logging.getLogger(__name__)

ACTIONS_PER_CALL = 8  # browser actions one reset or step may take at its bound each (a step may act several times)
MARGIN_S = 10.0  # the call's way to the env actor and back, and a busy machine's slack


def runs_episodes(env: EnvConfig, agent_kind: str) -> bool:
    """Whether env actors (ray.env.count > 0) run whole episodes: an environment with a browser, played by a
    white-box agent (a black-box agent's program runs beside its gateway in a sandbox lease instead)."""
    return agent_kind != "blackbox" and environment_for(env).browser


@dataclass(frozen=True, slots=True, kw_only=True)
class CallBounds:
    """How long a rollout actor waits for each call on an episode. The env actor's own bounds (each browser action's
    env.browser.action_timeout_s, a tool's env.tool_timeout_s) come first; these catch an env actor that hangs or
    cannot be reached: ACTIONS_PER_CALL actions at their bound, plus a browser launch for a reset (its tab may need
    one), plus MARGIN_S."""

    reset_s: float
    step_s: float
    close_s: float

    @classmethod
    def of(cls, env: EnvConfig) -> CallBounds:
        action = max(env.tool_timeout_s, env.browser.action_timeout_s)
        step = ACTIONS_PER_CALL * action + MARGIN_S
        return cls(reset_s=step + env.browser.launch_timeout_s, step_s=step, close_s=action + MARGIN_S)


def started_environment(pool: RolloutPoolConfig) -> Environment:
    """The run's Environment, started as a rollout worker starts it: its start step and its task splits (the web
    environment's worked examples are its first training tasks), and the tokenizer when it reads one (loaded only
    then: an env actor on a CPU node need not have the model). Runs event loops of its own: call it on a thread."""
    prepared_tasks(pool.env, pool.data)
    environment = environment_for(pool.env)
    if type(environment).use_tokenizer is not Environment.use_tokenizer:
        from loomrl.model.loader import load_tokenizer

        environment.use_tokenizer(load_tokenizer(pool.model))
    return environment


class EpisodeRefused(EnvCrash):
    """A reset the env actor did not open (its owner died, or it was closed first): there is nothing to close."""


class EnvWorkerLost(EnvCrash):
    """The env actor running an episode died, or could not be reached."""


@dataclass(slots=True, kw_only=True)
class _Episode:
    owner: str  # the rollout actor incarnation that opened it
    env: Env
    call: asyncio.Task | None = None  # its reset, step or finalize in flight (cancelled when it is closed)


class EpisodeActor(Placed):
    """An env actor that runs whole episodes (runs_episodes): the Environment, its browser pool (and its sandbox pool
    when it has a sandbox too) and the episodes in flight by id, each opened by an owner (a rollout actor
    incarnation). Calls are not retried by Ray: a step is not idempotent."""

    def __init__(self, pool_json: str, concurrency: int):
        """`pool_json`: the rollout pool's config as JSON; `concurrency`: episodes this actor may run at once (its
        share of the run's)."""
        self.pool = RolloutPoolConfig.model_validate_json(pool_json)
        self.concurrency = concurrency
        self.environment: Environment | None = None
        self.browsers: BrowserPool | None = None
        self.sandboxes: EnvPool | None = None
        self.episodes: dict[str, _Episode] = {}
        # Ids closed before their reset arrived (the caller gave up on it), and owners that died: a reset for either
        # is refused when it comes, so no tab is leased for an episode nobody will close.
        self.abandoned: set[str] = set()
        self.dead_owners: set[str] = set()
        self._start_lock = asyncio.Lock()  # bound to the actor's event loop when first waited on

    async def _ready(self) -> Environment:
        """The Environment and its pools, made on first use (a pool that fails to start is not kept)."""
        async with self._start_lock:
            if self.environment is None:
                self.environment = await asyncio.to_thread(started_environment, self.pool)
            if self.browsers is None:
                from loomrl.env.browser.pool import browser_pool

                self.browsers = await browser_pool(self.pool.env.browser, self.concurrency).start()
            if self.sandboxes is None and self.environment.sandbox is not None:
                size = sandbox_pool_size(self.pool.env, self.pool.agent.kind, self.concurrency)
                self.sandboxes = await sandbox_pool(self.pool.env, size).start()
        return self.environment

    async def start(self) -> int:
        """Start the environment and pre-warm its tabs now (instead of at the first reset); returns the concurrency."""
        await self._ready()
        return self.concurrency

    def _context(self, rng_state: Any) -> EpisodeContext:
        rng = random.Random()
        rng.setstate(rng_state)  # the rollout worker's draw for this episode: the same stream as a local run's
        e = self.pool.env
        return EpisodeContext(pool=self.sandboxes, rng=rng, tool_timeout_s=e.tool_timeout_s, browsers=self.browsers,
                              action_timeout_s=e.browser.action_timeout_s)

    def _episode(self, episode: str) -> _Episode:
        try:
            return self.episodes[episode]
        except KeyError:
            raise EnvCrash(f"env worker: no episode {episode} (the worker restarted, or the episode was closed)") \
                from None

    async def _run(self, ep: _Episode, work: Any) -> Any:
        """Await `work` as the episode's call in flight, so that closing the episode cancels it."""
        ep.call = asyncio.ensure_future(work)
        try:
            return await ep.call
        finally:
            ep.call = None

    async def reset(self, owner: str, episode: str, rng_state: Any, task: Task) -> Observation:
        """Open episode `episode` (an id the caller chose) for `owner` and reset it on `task`."""
        environment = await self._ready()
        if owner in self.dead_owners:
            raise EpisodeRefused(f"env worker: owner {owner} is gone")
        if episode in self.abandoned:
            self.abandoned.discard(episode)
            raise EpisodeRefused(f"env worker: episode {episode} was closed before its reset arrived")
        if episode in self.episodes:
            raise EnvCrash(f"env worker: episode {episode} was reset already")
        ep = self.episodes[episode] = _Episode(owner=owner, env=environment.episode(self._context(rng_state)))
        return await self._run(ep, ep.env.reset(task))

    async def step(self, episode: str, action: str) -> StepResult:
        ep = self._episode(episode)
        return await self._run(ep, ep.env.step(action))

    async def finalize(self, episode: str) -> str | None:
        ep = self._episode(episode)
        return await self._run(ep, ep.env.finalize())

    async def close_episode(self, episode: str) -> bool:
        """Close an episode: its call in flight cancelled, its tab back to the pool. False when this actor has no
        such episode (its reset has not arrived yet: refused when it does; or the actor restarted since)."""
        ep = self.episodes.pop(episode, None)
        if ep is None:
            self.abandoned.add(episode)
            return False
        if ep.call is not None:
            ep.call.cancel()
            await asyncio.wait({ep.call})
        try:
            await ep.env.close()
        except Exception as err:  # noqa: BLE001 - one episode's failed close must not stop the others'
            log.warning("env worker: closing episode %s failed: %s", episode, named_line(err))
        return True

    async def release_owner(self, owner: str) -> int:
        """Close every episode of `owner`, a rollout actor that died (their tabs go back); returns how many."""
        self.dead_owners.add(owner)
        mine = [episode for episode, ep in self.episodes.items() if ep.owner == owner]
        for episode in mine:
            await self.close_episode(episode)
        return len(mine)

    def metrics(self) -> dict[str, Any]:
        """The pools' metrics, the browser pool's under browser_* (as a rollout worker's pool_metrics gives them)."""
        out = asdict(self.sandboxes.metrics) if self.sandboxes is not None else {}
        if self.browsers is not None:
            out.update({f"browser_{k}": v for k, v in asdict(self.browsers.metrics).items()})
        return out

    async def close(self) -> dict[str, Any]:
        """Close every episode and the pools; returns the pools' metrics (teardown included)."""
        for episode in list(self.episodes):
            await self.close_episode(episode)
        for pool in (self.browsers, self.sandboxes):
            if pool is not None:
                await pool.close()
        return self.metrics()


class RemoteEpisodes:
    """Environment.episode's counterpart on a rollout actor whose episodes run in env actors: each episode goes to the
    next env actor in turn. `owner` names this rollout actor incarnation in the env actors' tables; `failure` is set
    once an env actor's browser pool gave up for good (the rollout worker then stops the run on it)."""

    RESET_PATIENCE_S = 30.0  # how long a reset tries env actors that are dead or restarting (RemoteEnvPool's patience)

    def __init__(self, actors: list[Any], owner: str, env: EnvConfig, version: str):
        self.actors, self.owner, self.version = actors, owner, version
        self.bounds = CallBounds.of(env)
        self.failure: EnvPoolFailed | None = None
        self._next = itertools.cycle(range(len(actors)))

    def episode(self, ctx: EpisodeContext) -> RemoteEnv:
        """A fresh remote episode; only ctx.rng is read (the env actor makes the rest of the context itself)."""
        return RemoteEnv(self, ctx.rng.getstate())

    def next_actor(self) -> Any:
        return self.actors[next(self._next)]

    async def answer(self, ref: Any, bound_s: float, what: str) -> Any:
        """The result of a call on an env actor: what the episode raised there is raised here as it was (EnvCrash,
        ToolTimeout, an environment's own error); no answer within `bound_s` is ToolTimeout; a dead actor
        EnvWorkerLost."""
        import ray.exceptions

        try:
            return await asyncio.wait_for(ref, bound_s)
        except ray.exceptions.RayTaskError as err:  # first: one raised for a TimeoutError is a TimeoutError too
            if isinstance(err.cause, EnvPoolFailed):  # its tabs cannot work: every later episode would fail too
                self.failure = EnvPoolFailed(actor_error_line(err))
            if err.cause is None:
                raise EnvCrash(f"env worker: {what} failed: {named_line(err)}") from None
            raise err.cause from None
        except ray.exceptions.RayError as err:
            raise EnvWorkerLost(f"env worker failed: {named_line(err)}") from None
        except TimeoutError:
            raise ToolTimeout(f"env worker: {what} did not answer in {bound_s:.0f}s") from None


class RemoteEnv(Env):
    """One episode in an env actor, through the Env protocol. Its id is chosen here, before its reset is sent (a new
    one for each env actor a reset is tried on)."""

    def __init__(self, source: RemoteEpisodes, rng_state: Any):
        self.source, self.rng_state, self.version = source, rng_state, source.version
        self.id = ""
        self.actor: Any = None  # the env actor its reset went to
        self.closed = False

    async def reset(self, task: Task) -> Observation:
        """Reset on the next env actor. One that is dead or restarting (Ray refuses calls while it restarts) is given
        up for the next, with backoff, for RESET_PATIENCE_S; one that may have opened it all the same is told to close
        it (a fresh id goes to the next, so that close cannot meet the next try)."""
        s = self.source
        if self.closed:
            raise EnvCrash("remote episode: closed (an Env serves one episode)")
        t0 = time.perf_counter()
        for attempt in itertools.count():
            self.actor, self.id = s.next_actor(), uuid.uuid4().hex
            try:
                return await s.answer(self.actor.reset.remote(s.owner, self.id, self.rng_state, task),
                                      s.bounds.reset_s, "reset")
            except EpisodeRefused:
                self.actor = None  # nothing was opened: nothing to close
                raise
            except EnvWorkerLost as err:
                await self._close_on(self.actor)
                waited = time.perf_counter() - t0
                if waited > s.RESET_PATIENCE_S:
                    raise EnvWorkerLost(f"no env worker could open the episode in {waited:.0f}s: {err}") from None
                await asyncio.sleep(min(2.0, 0.1 * 2 ** (attempt // len(s.actors))))
        raise AssertionError("unreachable")  # itertools.count() does not end

    async def step(self, action: str) -> StepResult:
        s = self.source
        return await s.answer(self._live().step.remote(self.id, action), s.bounds.step_s, "step")

    async def finalize(self) -> str | None:
        s = self.source
        return await s.answer(self._live().finalize.remote(self.id), s.bounds.step_s, "finalize")

    def _live(self) -> Any:
        if self.actor is None or self.closed:
            raise EnvCrash("remote episode: reset it first, and not after close")
        return self.actor

    async def _close_on(self, actor: Any) -> None:
        with contextlib.suppress(EnvCrash, ToolTimeout):  # a dead env actor took the episode with it
            await self.source.answer(actor.close_episode.remote(self.id), self.source.bounds.close_s, "close")

    async def close(self) -> None:
        """Close the episode in its env actor (once)."""
        if self.closed:
            return
        self.closed = True
        if self.actor is not None:
            await self._close_on(self.actor)
