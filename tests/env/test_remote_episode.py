"""Web episodes in an env actor (loomrl/env/remote_episode.py) without a Ray cluster: the EpisodeActor class itself,
with its own real browser pool and the real shop, driven through RemoteEpisodes / RemoteEnv.

The one stand-in is Ray's actor handle (`_Handle`): `handle.method.remote(*args)` runs the actor's method on this
process's event loop, so that the bookkeeping (ids, owners, closes, cancellations) is checked in seconds; Ray's own
transport and a real env actor's death are what tests/runtime/test_ray_runtime.py runs."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomrl.config import load_config
from loomrl.env.api import EpisodeContext, TaskSetup, environment_for
from loomrl.env.base import EnvCrash, ToolTimeout
from loomrl.env.browser.chromium import missing_requirements
from loomrl.env.remote_episode import CallBounds, EnvWorkerLost, EpisodeActor, RemoteEpisodes

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing_requirements() is not None,
                                                      reason=missing_requirements() or "")]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


class _Handle:
    """Ray's actor handle, in process: `.remote()` schedules the method on the running loop, and a caller that stops
    waiting for it (its bound) does not stop it, as with Ray."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        method = getattr(self.actor, name)
        return SimpleNamespace(remote=lambda *args: asyncio.shield(asyncio.ensure_future(method(*args))))


class _DeadHandle:
    """What calls on a dead Ray actor give: ActorDiedError."""

    def __getattr__(self, name):
        import ray.exceptions

        async def died(*args):
            raise ray.exceptions.ActorDiedError()

        return SimpleNamespace(remote=lambda *args: asyncio.ensure_future(died(*args)))


@pytest.fixture(scope="module")
def web(run):
    """(the episode actor, started: 1 browser x 2 tabs; the run's env section; its training tasks)."""
    cfg = load_config(RECIPE, ["env.name=web", "env.args={}", "env.families=[contact, find]", "env.n_train=8",
                               "env.n_heldout=4", "env.browser.tabs_per_browser=2"])
    pool = cfg.rollout_pool()
    actor = EpisodeActor(pool.model_dump_json(), concurrency=1)
    run(actor.start())
    train, _ = environment_for(pool.env).tasks(TaskSetup.of(pool.env))
    yield actor, pool.env, train
    run(actor.close())


def _source(actor, env, owner: str = "rollout-1") -> RemoteEpisodes:
    return RemoteEpisodes([_Handle(actor)], owner, env, "v")


def _ctx() -> EpisodeContext:
    return EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=5.0)


async def _settled(actor) -> None:
    """Until the tabs given back are reset and idle again (the pool resets them in the background)."""
    for _ in range(200):
        if actor.browsers.idle == actor.browsers.size:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"tabs not back: {actor.browsers.idle} of {actor.browsers.size} idle")


def test_an_episode_runs_in_the_actor_by_id_and_closes_once(run, web):
    actor, env, train = web
    task = next(t for t in train if t.family == "find")

    async def go():
        remote = _source(actor, env).episode(_ctx())
        obs = await remote.reset(task)
        assert remote.id in actor.episodes and task.prompt in obs.messages[-1]["content"] and obs.tools
        step = await remote.step("click(999)")  # a model's mistake: a tool error, the episode goes on
        assert step.observation[0]["content"].startswith("Error: no element [999]") and not step.done
        done = await remote.step("answer(0.01)")
        assert done.done and done.info["record"]["solved"] is False
        await remote.close()
        await remote.close()  # idempotent: nothing is sent twice
        assert actor.episodes == {} and actor.abandoned == set()
        with pytest.raises(EnvCrash, match="not after close"):
            await remote.step("click(1)")
        await _settled(actor)

    run(go())
    m = actor.browsers.metrics
    assert m.acquired == m.released and m.kills == 0


def test_release_owner_closes_a_dead_owners_episodes_and_refuses_its_later_resets(run, web):
    """The driver's call for a rollout actor that died: its episodes (one with a step in flight) are closed and their
    tabs go back; another owner's episode goes on; a reset the dead owner sent late is refused."""
    actor, env, train = web
    task = next(t for t in train if t.family == "contact")

    async def go():
        dead, alive = _source(actor, env, "rollout-dead"), _source(actor, env, "rollout-alive")
        mine, other = dead.episode(_ctx()), alive.episode(_ctx())
        await mine.reset(task)
        await other.reset(task)
        in_flight = asyncio.ensure_future(mine.step("click(999)"))
        await asyncio.sleep(0)  # sent, not answered
        assert await actor.release_owner("rollout-dead") == 1
        await asyncio.gather(in_flight, return_exceptions=True)
        assert in_flight.cancelled() or isinstance(in_flight.exception(), EnvCrash)
        assert list(actor.episodes) == [other.id]
        assert not (await other.step("click(999)")).done  # the other owner's episode goes on
        late = dead.episode(_ctx())
        with pytest.raises(EnvCrash, match="owner rollout-dead is gone"):
            await late.reset(task)
        await late.close()  # a refused reset opened nothing: nothing is sent
        await other.close()
        assert actor.episodes == {} and actor.abandoned == set()
        await _settled(actor)

    run(go())
    assert actor.browsers.metrics.acquired == actor.browsers.metrics.released


def test_a_reset_its_caller_gave_up_on_leaves_no_tab_leased(run, web):
    """A reset past its bound is ToolTimeout; the close that follows cancels it in the actor, wherever it was (leasing
    the tab, loading the page). A close that arrives before its reset makes the reset refuse."""
    actor, env, train = web
    task = next(t for t in train if t.family == "find")

    async def go():
        source = _source(actor, env)
        timed_out = []
        for bound in (0.001, 0.01, 0.03, 0.1, 0.3):  # cut at different points of the reset (the later ones may answer)
            source.bounds = CallBounds(reset_s=bound, step_s=bound, close_s=30)
            remote = source.episode(_ctx())
            try:
                await remote.reset(task)
            except ToolTimeout as err:
                assert "reset did not answer" in str(err)
                timed_out.append(bound)
            await remote.close()
            assert actor.episodes == {}
        assert timed_out[:2] == [0.001, 0.01], timed_out
        await actor.close_episode("early")  # its reset has not arrived yet
        with pytest.raises(EnvCrash, match="closed before its reset arrived"):
            await actor.reset("rollout-1", "early", random.Random(0).getstate(), task)
        await _settled(actor)
        assert actor.abandoned == set() and actor.episodes == {}  # the late resets came, and were refused

    run(go())
    assert actor.browsers.metrics.acquired == actor.browsers.metrics.released


def test_a_dead_env_actor_ends_the_episode_env_error(run, web):
    """Every call on a dead env actor is EnvWorkerLost (an EnvCrash: the episode ends env_error, never scored); a
    reset is tried on the next actor (under a fresh id), and on all of them again until its patience runs out; close
    says nothing."""
    pytest.importorskip("ray")
    actor, env, train = web
    task = next(t for t in train if t.family == "find")

    async def go():
        source = RemoteEpisodes([_DeadHandle(), _Handle(actor)], "rollout-1", env, "v")
        first = source.episode(_ctx())
        await first.reset(task)  # the dead actor first in turn: opened on the live one
        assert list(actor.episodes) == [first.id]
        await first.close()
        with pytest.raises(EnvCrash, match="closed"):  # an Env serves one episode
            await first.reset(task)
        remote = source.episode(_ctx())
        await remote.reset(task)
        remote.actor = _DeadHandle()  # as if its env actor died after the reset
        with pytest.raises(EnvWorkerLost, match="env worker failed: ActorDiedError"):
            await remote.step("click(1)")
        await remote.close()
        alone = RemoteEpisodes([_DeadHandle()], "rollout-1", env, "v")
        alone.RESET_PATIENCE_S = 0.5
        lost = alone.episode(_ctx())
        with pytest.raises(EnvWorkerLost, match=r"no env worker could open the episode in \ds"):
            await lost.reset(task)
        await lost.close()
        await actor.close_episode(remote.id)  # what release_owner would do for the rollout actor of `remote`
        await _settled(actor)

    run(go())
    assert issubclass(EnvWorkerLost, EnvCrash)
