"""The Ray parts (runtime.backend=ray): ActorRollouts (rollout actors, each an engine + agent loops, and optionally
reward, env and engine actors), ActorTrainer (trainer actors: rank 0 and, with trainer.world_size > 1, the other
data-parallel ranks) and a weight route (ObjectStoreRoute; BroadcastRoute with runtime.weight_transport=broadcast;
StreamedRoute with runtime.weight_transport=cuda_ipc, colocated),
each actor placed by its own resources across a Ray cluster; RayCluster is what they share (the connection, the
placement, the latest published version). The driver (runtime/driver.py) decides what runs and what a failure means;
these parts place actors, move groups and weights (transport "ray": the trainer returns its weights, so the object
belongs to the driver and outlives a trainer that dies), and replace what died:
- a rollout actor dies (its engine dies with it, and its own env pool and reward pool when it has
  them): a fresh actor takes its place with the current weights and its attempts end RolloutLost
  (the driver retries them). Sandboxes it had leased from env actors are destroyed and replaced, and the
  episodes it ran in them closed (their browser tabs go back). One
  whose constructor raises stops the run.
- a reward actor dies: Ray restarts it (stateless) and retries its calls; a trajectory that still
  cannot be scored is stored as reward_failed and not trained.
- an env actor dies: Ray restarts it with fresh sandboxes (or, for an environment with a browser, whose episodes run
  in the env actors, a fresh environment and browsers); the episodes whose sandboxes or browsers it held end
  env_error (agent.retry_on runs them again).
- an engine actor dies (ray.engine.count > 0): Ray restarts it; it loads the latest published weights
  (engine/actor.py WeightBoard) before serving, and the requests it was running end engine_error. Not with
  runtime.weight_transport=broadcast or cuda_ipc (each version goes once: over the trainer actor's group, or from
  each trainer rank to the engine on its GPU): the run stops (EngineLost: the driver stops it) and --resume continues
  it.
- a trainer actor dies (any rank): TrainerLost; the driver has fresh ones made from the run folder's
  latest checkpoint (which must be on a filesystem every node sees).

What is not here: restarting the driver itself (a dead driver is a crashed run: `--resume` continues
from the latest checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.actor_support import actor_error_line, constructor_failed, failure_line
from loomrl.config import Placement, RunConfig
from loomrl.engine.actor import EngineActor, WeightBoard
from loomrl.engine.base import EngineMetrics
from loomrl.engine.readings import Reading, counter_changes, engine_step_metrics
from loomrl.env.api import environment_for
from loomrl.env.remote import EnvActor
from loomrl.env.remote_episode import EpisodeActor, runs_episodes
from loomrl.env.sandbox import SandboxError
from loomrl.errors import error_line, error_tail
from loomrl.rollout.actor import RolloutActor
from loomrl.rollout.reward_actor import RewardActor
from loomrl.rollout.worker import rollout_concurrency
from loomrl.runtime.failures import CannotStart, EngineLost, RolloutLost, TrainerLost
from loomrl.runtime.parts import Parts, RolloutReport, Rollouts, Trainer, TrainerState, WeightRoute
from loomrl.runtime.ray_resources import (
    beside_running,
    cluster_address,
    colocation_mismatch,
    ray_init_kwargs,
    reserves,
    run_asks,
    shortfall,
)
from loomrl.train_pool.actor import TrainerActor, TrainerRankActor
from loomrl.train_pool.ranks import RankLost
from loomrl.trainer_boundary import Carried, PositionSet, TrainStep
from loomrl.types import Evaluation, Trajectory
from loomrl.weights.handle import Transport, VersionNotDelivered, WeightHandle

log = logging.getLogger("loomrl")


def import_ray():
    try:
        import ray
    except ImportError:
        raise CannotStart("runtime.backend=ray needs the ray package; install it with "
                       "pip install -e '.[ray]' (or set runtime.backend=local)") from None
    return ray


def fail_if_cannot_start(err: BaseException, what: str) -> None:
    """An actor whose constructor raised: every fresh one would too, so the run stops with the cause;
    sandboxes that cannot work (EnvPoolFailed in an actor) likewise, in one line."""
    if constructor_failed(err):
        raise CannotStart(f"{what} failed to start (its constructor raised):\n{error_tail(err)}") from None
    if isinstance(err, SandboxError):
        raise CannotStart(actor_error_line(err)) from None


async def result_or(ref: Any, timeout_s: float, default: Any) -> Any:
    """A call's result, or `default` when its actor died (for good: past its restarts) or got stuck."""
    try:
        return await asyncio.wait_for(ref, timeout=timeout_s)
    except Exception:  # noqa: BLE001 - the caller kills it anyway, or reports it as gone
        return default


def add_into(into: dict[str, Any], values: dict[str, Any]) -> None:
    """Sum counters (nested ones too, e.g. episodes by purpose) into `into`."""
    for k, v in values.items():
        if isinstance(v, dict):
            add_into(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0) + v


def add_counter_changes(out: dict[str, float], last: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """`out` plus each counter's change from `last` to `now`; a counter below its last value was reset (its actor
    restarted): its whole value is the change."""
    for name, value in now.items():
        change = value - last.get(name, 0.0)
        out[name] = out.get(name, 0.0) + (change if change >= 0 else value)
    return out


class Polled:
    """Counters that live in actors, read without waiting: each actor (by its index) is asked at every step and read
    at a later one, once it has answered; an actor that died answers nothing and its replacement is asked next time."""

    def __init__(self, ray: Any):
        self.ray = ray
        self.asks: dict[int, Any] = {}

    def answers(self) -> list[tuple[int, Any]]:
        """(index, answer) of the actors that have answered since the last call."""
        out = []
        for key, ref in list(self.asks.items()):
            done, _ = self.ray.wait([ref], timeout=0)
            if not done:
                continue
            del self.asks[key]
            try:
                out.append((key, self.ray.get(ref)))
            except self.ray.exceptions.RayError:  # that actor died; its replacement is asked next time
                continue
        return out

    def ask(self, methods: list[Any]) -> None:
        """Ask each actor method (index: its place in `methods`) that has no question outstanding."""
        for key, method in enumerate(methods):
            if key not in self.asks:
                self.asks[key] = method.remote()


@dataclass(slots=True, kw_only=True)
class WorkerSlot:
    handle: Any
    owner: str = ""  # its name in the env actors' lease tables
    incarnation: int = 0
    load: int = 0  # groups in flight on it
    engine: Any = None  # the engine actor it generates on (ray.engine.count > 0)


def running_cluster() -> str | None:
    """The address `ray start` left in this machine's ray_current_cluster file (Ray's own lookup; None: none)."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    return path.read_text().strip() or None if path.is_file() else None


class RayCluster:
    """What the Ray parts share: the connection to the cluster (joined or started here), the trainer ranks' placement
    group (colocated: reserved with the engines, kept across trainer restarts), where the actors ran, the latest
    published version and the weight loads not yet read for the metrics."""

    def __init__(self, cfg: RunConfig):
        self.ray = import_ray()
        self.cfg = cfg
        self.cfg_json = cfg.model_dump_json()
        self.owns_ray = False
        self.address = cluster_address(cfg.ray.address, os.environ)
        self.local_cluster = self.address == "local"  # one loomrl starts here, and shuts down at the end
        self.asks = run_asks(cfg, env_actors=uses_env_actors(cfg))
        # engine.sleep_while_training with engine actors: engine i and trainer rank i share bundle i of one placement
        # group (a GPU each: fractional num_gpus), reserved before the engines start and kept across trainer restarts
        self.colocated = cfg.engine.sleep_while_training and cfg.ray.engine.count > 0
        self.trainer_group: Any = None  # the trainer ranks' placement group
        self.placement: dict[str, Any] = {}  # where the first actors ran
        self.weights: WeightHandle | None = None  # the latest published version
        self.syncs: list = []  # update_weights calls not yet read for the metrics
        # broadcast: which trainer actor (its start's count) sent each sync's version; a load of a version whose
        # trainer died mid-broadcast fails, and the fresh trainer's next version supersedes it
        self.trainer_starts = 0
        self.sync_sender: dict[Any, int] = {}

    def actor(self, cls: type, spec: Placement, **options: Any) -> Any:
        return self.ray.remote(cls).options(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus or None,
                                            resources=spec.resources, **options)

    def connect(self) -> None:
        """Join the cluster ray.address names (runtime/ray_resources.py cluster_address) or start a one-machine one;
        one we start we also shut down. CannotStart when the cluster cannot hold the run's actors."""
        if not self.ray.is_initialized():
            cores = os.cpu_count() or 1
            kwargs = ray_init_kwargs(self.address, self.asks, cores, os.environ, cwd=os.getcwd())
            if warning := beside_running(self.cfg.ray.address, self.address, running_cluster()):
                log.warning(warning)
            if self.local_cluster and kwargs["num_cpus"] > cores:
                log.info("ray: the actors reserve %d CPUs; the one-machine cluster offers them on %d cores",
                         kwargs["num_cpus"], cores)
            self.ray.init(**kwargs)
            self.owns_ray = True  # a joined cluster is only disconnected from (ray.shutdown leaves it running)
        nodes = [n["Resources"] for n in self.ray.nodes() if n["Alive"]]
        why = shortfall(self.asks, self.ray.cluster_resources(), nodes, self.label())
        if why is not None:
            raise CannotStart(why)

    def label(self) -> str:
        """The cluster as the user knows it, for messages."""
        if self.local_cluster:
            return "this machine's one-node Ray (started by loomrl)"
        return "the Ray cluster running on this machine" if self.address == "auto" else \
            f"the Ray cluster at {self.address}"

    async def where(self, actors: list[Any]) -> list[tuple[str | None, int | None]]:
        return [tuple(await result_or(actor.where.remote(), 30, (None, None))) for actor in actors]

    def kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(actor, no_restart=True)

    async def reserve_trainer(self) -> None:
        """A placement group with one bundle per trainer rank (ray.trainer_placement), so that all ranks are placed
        together or not at all; none when a rank asks for nothing to reserve. Colocated: each bundle holds engine i
        too (Ray then gives both the same GPU)."""
        if self.trainer_group is not None:  # colocated: reserved with the engines, kept
            return
        spec, world = self.cfg.ray.trainer, self.cfg.trainer.world_size
        bundle = reserves(spec)
        if self.colocated:
            engine = reserves(self.cfg.ray.engine)
            bundle = {k: bundle.get(k, 0.0) + engine.get(k, 0.0) for k in {*bundle, *engine}}
        if not bundle:
            return
        from ray.util.placement_group import placement_group

        self.trainer_group = placement_group([bundle] * world, strategy=self.cfg.ray.trainer_placement)
        try:
            await asyncio.wait_for(self.trainer_group.ready(), timeout=self.cfg.ray.placement_timeout_s)
        except TimeoutError:
            # the cluster has enough in all (connect): other actors or jobs hold what the ranks need
            total = self.ray.cluster_resources()
            held = "; `ray status` on the cluster shows what is in use" if not self.local_cluster else ""
            raise CannotStart(f"{self.label()} could not place {world} trainer rank(s) of {bundle} "
                              f"({self.cfg.ray.trainer_placement}) within {self.cfg.ray.placement_timeout_s:.0f}s, "
                              f"though it has { {k: total.get(k, 0.0) for k in bundle} } in all; check "
                              f"ray.trainer{held}") from None
        self.placement["trainer_bundles"] = [bundle] * world

    def release_trainer(self) -> None:
        """The ranks' reservation goes with them (a restart reserves anew), unless it is shared with the engines."""
        if self.trainer_group is not None and not self.colocated:
            self.ray.util.remove_placement_group(self.trainer_group)
            self.trainer_group = None

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Trainer rank `rank`'s (or, colocated, engine `rank`'s) bundle of the ranks' placement group."""
        if self.trainer_group is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.trainer_group,
                                                                        placement_group_bundle_index=rank)}

    def shutdown(self) -> None:
        if self.trainer_group is not None:  # colocated: kept through the run (a user's cluster outlives it)
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(self.trainer_group)
            self.trainer_group = None
        if self.owns_ray:
            self.ray.shutdown()


def engine_lost(why: object, transport: str = "broadcast") -> EngineLost:
    """An engine actor died with a route that sends each version once (runtime.weight_transport=broadcast or
    cuda_ipc). `why`: Ray's error (its first line is said) or a sentence."""
    how = ("broadcast once, to a group of fixed members" if transport == "broadcast" else
           "pushed once, by the trainer rank on its GPU")
    return EngineLost(f"an engine actor died, and with runtime.weight_transport={transport} no fresh one can "
                      f"get the run's current weights (each version is {how}): "
                      f"{error_line(str(why))}; continue with --resume, or use the default transport (Ray's "
                      "object store), with which engine actors survive restarts")


def uses_env_actors(cfg: RunConfig) -> bool:
    """Whether ray.env.count > 0 makes env actors: for an environment's sandboxes, or to run episodes that use a
    browser (env/remote_episode.py runs_episodes)."""
    return environment_for(cfg.env).sandbox is not None or runs_episodes(cfg.env, cfg.agent.kind)


def sends_once(cfg: RunConfig) -> bool:
    """Whether each version goes to the engine actors once (broadcast; cuda_ipc, pushed by the colocated ranks): an
    engine actor that dies cannot get it again, so engine actors are not restarted."""
    return cfg.runtime.weight_transport in ("broadcast", "cuda_ipc")


class ActorRollouts(Rollouts):
    """Rollout actors (and the reward, env and engine actors they share), replaced when they die."""

    label = "ray"

    def __init__(self, cluster: RayCluster):
        self.cluster, self.cfg, self.ray = cluster, cluster.cfg, cluster.ray
        self.pool = self.cfg.rollout_pool()
        self.pool_json = self.pool.model_dump_json()  # what the rollout and reward actors are given
        self.workers: list[WorkerSlot] = []
        self.reward_actors: list[Any] = []  # ray.reward.count, shared by the rollout actors
        self.env_actors: list[Any] = []  # ray.env.count, shared by the rollout actors
        self.engines: list[Any] = []  # ray.engine.count engine actors, shared by the rollout actors
        self.board: Any = None  # the latest published version, for engine actors Ray restarts
        self.owners = 0  # rollout actors made so far
        self.reclaims: list[Any] = []  # release_owner calls: sandboxes (or episodes) of dead rollout actors reclaimed
        self.rollout_restarts = 0
        # each version goes once (sends_once): an engine actor that dies then stops the run
        self.once = sends_once(self.cfg)
        # the reward pools' counters (an LLM judge's: judge/*), which live in the actors that score, and the engines'
        # (engine/readings.py), which live in the engine actors, else the rollout actors: asked at each step, read at
        # a later one (never waited on); the last reading per actor, for the change since
        self.reward_polled = Polled(self.ray)
        self.reward_seen: dict[int, dict[str, float]] = {}
        self.engine_polled = Polled(self.ray)
        self.engine_seen: dict[int, Reading] = {}
        self.pids: dict[str, list[int | None]] = {}  # reward / env actors' processes at the start

    def targets(self) -> list[Any]:
        """What loads each version: the engine actors, else the rollout actors' own engines."""
        return self.engines or [s.handle for s in self.workers]

    def _new_rollout_actor(self) -> WorkerSlot:
        r, cluster = self.cfg.ray, self.cluster
        self.owners += 1  # names this incarnation in the env actors' lease tables
        owner = f"rollout-{self.owners}"
        cls = cluster.actor(RolloutActor, r.rollout, max_restarts=0, max_concurrency=1000)
        engine = self.engines[(self.owners - 1) % len(self.engines)] if self.engines else None
        actor = cls.remote(self.pool_json, self.reward_actors, self.env_actors, owner, engine)
        if cluster.weights is not None and engine is None:  # a fresh actor's engine gets the current version
            cluster.syncs.append(actor.update_weights.remote(cluster.weights))
        return WorkerSlot(handle=actor, owner=owner, engine=engine)

    def _new_env_actors(self) -> list[Any]:
        """Env actors sized for every rollout actor's concurrency, split between them: episode actors for an
        environment with a browser (env/remote_episode.py), else sandbox leases (env/remote.py)."""
        r = self.cfg.ray
        if not r.env.count:
            return []
        if not uses_env_actors(self.cfg):
            log.warning("ray.env.count=%d ignored: env %s uses no sandbox and no browser", r.env.count,
                        self.cfg.env.name)
            return []
        share = math.ceil(rollout_concurrency(self.pool) * r.rollout.count / r.env.count)
        # Concurrency: every waiting acquire (or reset) holds a slot, and releases must still get in (else a full
        # pool could never be given back to): room for all of them, with margin.
        options = {"max_concurrency": max(1000, 4 * share), "max_restarts": r.env.max_restarts}
        if runs_episodes(self.cfg.env, self.cfg.agent.kind):
            episodes = self.cluster.actor(EpisodeActor, r.env, **options)
            return [episodes.remote(self.pool_json, share) for _ in range(r.env.count)]
        cls = self.cluster.actor(EnvActor, r.env, **options)
        env_json = self.cfg.env.model_dump_json()
        return [cls.remote(env_json, share, self.cfg.agent.kind) for _ in range(r.env.count)]

    async def start(self) -> None:
        cluster, r = self.cluster, self.cfg.ray
        cluster.connect()
        reward = cluster.actor(RewardActor, r.reward, max_concurrency=1000, max_restarts=r.reward.max_restarts,
                               max_task_retries=r.max_reward_attempts - 1)
        self.reward_actors = [reward.remote(self.pool_json) for _ in range(r.reward.count)]
        self.env_actors = self._new_env_actors()
        try:
            for env in self.env_actors:  # pre-warm the sandboxes (or start the environment and its tabs) first
                await env.start.remote()
        except self.ray.exceptions.RayError as err:
            fail_if_cannot_start(err, "an env actor")
            raise
        if r.engine.count:
            self.board = self.ray.remote(WeightBoard).options(num_cpus=0).remote()
            if cluster.colocated:
                await cluster.reserve_trainer()
            # broadcast: engine i's processes are ranks 1 + i * receivers.. of the trainer's group
            setup_json, receivers = self.pool.engine.model_dump_json(), self.cfg.weight_route().receivers
            self.engines = [cluster.actor(EngineActor, r.engine, max_concurrency=1000,
                                          max_restarts=0 if self.once else r.engine.max_restarts,
                                          **cluster.trainer_options(i)).remote(setup_json, self.board, i,
                                                                               1 + i * receivers)
                            for i in range(r.engine.count)]
            if cluster.colocated:
                cluster.placement["engine_gpus"] = [await e.gpu_ids.remote() for e in self.engines]
        for name, actors in (("reward", self.reward_actors), ("env", self.env_actors), ("engine", self.engines)):
            where = await cluster.where(actors)
            cluster.placement[name] = [node for node, _ in where]
            self.pids[name] = [pid for _, pid in where]
        self.workers = [self._new_rollout_actor() for _ in range(r.rollout.count)]

    def _replace_worker(self, i: int, why: str) -> None:
        """A fresh actor in a dead one's place (the driver counts replacements against ray.rollout.max_restarts)."""
        slot = self.workers[i]
        self.cluster.kill(slot.handle)
        self.rollout_restarts += 1
        log.warning("rollout actor %d died (%s); starting a fresh one", i, why)
        for env in self.env_actors:  # its sandboxes are destroyed and replaced, its episodes closed: not leaked
            self.reclaims.append(env.release_owner.remote(slot.owner))
        fresh = self._new_rollout_actor()
        slot.handle, slot.owner, slot.incarnation, slot.load = fresh.handle, fresh.owner, slot.incarnation + 1, 0

    def _worker_died(self, i: int, incarnation: int, err: BaseException) -> RolloutLost:
        fail_if_cannot_start(err, "a rollout actor")
        why = f"actor_died: {type(err).__name__}"
        replaced = self.workers[i].incarnation == incarnation  # the first attempt to see this death replaces it
        if replaced:
            self._replace_worker(i, why)
        return RolloutLost(why, replaced=replaced)

    def dispatch(self, position: int) -> asyncio.Future:
        return asyncio.ensure_future(self._attempt(position))

    async def _attempt(self, position: int) -> list[Trajectory]:
        i = min(range(len(self.workers)), key=lambda k: self.workers[k].load)
        slot = self.workers[i]
        incarnation = slot.incarnation
        slot.load += 1
        ref = None
        try:
            await self._engine_caught_up(slot)
            ref = slot.handle.run_group.remote(position)
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # its actor is gone: nothing left to cancel
                if ref is not None:
                    self.ray.cancel(ref)
            raise
        except self.ray.exceptions.RayActorError as err:
            raise self._worker_died(i, incarnation, err) from None
        except self.ray.exceptions.RayError as err:
            fail_if_cannot_start(err, "an actor the rollouts use (e.g. a reward actor)")
            raise
        finally:
            if slot.incarnation == incarnation:
                slot.load -= 1

    async def _engine_caught_up(self, slot: WorkerSlot) -> None:
        """With engine actors: once the slot's engine has loaded the versions published so far (a dead engine
        actor's update is lost: its restart loads the board's latest, and `catch_up` loads one lost meanwhile)."""
        if slot.engine is None:
            return
        latest, timeout_s = self.cluster.weights, self.cfg.ray.placement_timeout_s
        if not self.once:
            await result_or(slot.engine.catch_up.remote(latest), timeout_s, None)
            return
        try:
            await asyncio.wait_for(slot.engine.catch_up.remote(latest), timeout_s)
        except self.ray.exceptions.RayActorError as err:
            raise engine_lost(err, self.cfg.runtime.weight_transport) from None

    async def evaluate(self, label: str) -> Evaluation:
        slot = self.workers[0]
        incarnation = slot.incarnation
        try:
            await self._engine_caught_up(slot)
            return await slot.handle.evaluate.remote()
        except self.ray.exceptions.RayActorError as err:
            raise self._worker_died(0, incarnation, err) from None

    async def sleep(self) -> None:
        await self._on_engines([actor.sleep.remote() for actor in self.targets()])

    async def wake(self) -> None:
        await self._on_engines([actor.wake.remote() for actor in self.targets()])

    async def _on_engines(self, calls: list[Any]) -> None:
        """Engine.sleep or wake on every engine (the engine actors', else the rollout actors' own): one that died
        meanwhile is left to the supervision (a fresh engine is awake); one that failed is EngineLost (a trainer
        step next to an engine that kept its memory would run out of it)."""
        for ref in calls:
            try:
                await ref
            except self.ray.exceptions.RayActorError:
                continue
            except self.ray.exceptions.RayError as err:
                raise EngineLost("an engine could not sleep or wake (engine.sleep_while_training):\n"
                                 + error_tail(err)) from None

    def _reward_metrics(self) -> dict[str, float]:
        """The change since the last read of the reward pools' counters (judge/calls, judge/cost_usd, ...), summed
        over the actors that score: the reward actors (ray.reward.count), else the rollout actors. Each is asked at
        every step and read once it has answered, so a step's counts may be logged a step later; an actor that was
        restarted starts again from 0, which is read as a fresh start, not a negative change."""
        if self.cfg.reward.judge is None:  # the only counters there are, for now
            return {}
        out: dict[str, float] = {}
        for key, now in self.reward_polled.answers():
            out = add_counter_changes(out, self.reward_seen.get(key, {}), now)
            self.reward_seen[key] = now
        self.reward_polled.ask([a.metrics for a in self.reward_actors] if self.reward_actors
                               else [slot.handle.reward_metrics for slot in self.workers])
        return out

    def _engine_metrics(self) -> dict[str, float]:
        """The engines' step metrics (engine/readings.py) from the readings that arrived since the last step, each
        against its engine's previous one: the engine actors (ray.engine.count), else each rollout actor's own engine.
        A reading may arrive a step late (it then counts in the step it arrived in); a restarted engine counts from
        its start."""
        changes = []
        for key, now in self.engine_polled.answers():
            changes.append(counter_changes(self.engine_seen.get(key), now))
            self.engine_seen[key] = now
        self.engine_polled.ask([e.reading for e in self.engines] if self.engines
                               else [slot.handle.engine_reading for slot in self.workers])
        return engine_step_metrics(changes)

    def step_metrics(self) -> dict[str, float]:
        return {"ray/rollout_restarts": float(self.rollout_restarts), **self._reward_metrics(),
                **self._engine_metrics()}

    async def close(self) -> RolloutReport:
        try:
            return await self._close()
        finally:
            self.cluster.shutdown()

    async def _close(self) -> RolloutReport:
        cluster = self.cluster
        pool: dict[str, float] = {}  # the sandbox pools' metrics, as each rollout actor's close gives them
        rollouts: dict[str, Any] = {}
        for slot in self.workers:  # a dead or stuck actor counts nothing (and is killed anyway)
            counts, metrics = await result_or(slot.handle.close.remote(), 30, ({}, {}))
            add_into(rollouts, counts)
            add_into(pool, metrics)
            cluster.kill(slot.handle)
        # Ray restarts reward and env actors itself: a new process id means at least one restart
        restarts = {name: sum(a != b for a, (_, b) in zip(self.pids.get(name, []), await cluster.where(actors)))
                    for name, actors in (("reward", self.reward_actors), ("env", self.env_actors),
                                         ("engine", self.engines))}
        engines: dict[str, float] = {}  # the engine actors' counters (since their last start)
        for engine in self.engines:
            counters = dataclasses.asdict(await result_or(engine.close.remote(), 60, EngineMetrics()))
            del counters["started"]  # a clock reading, not a count
            add_into(engines, {k: v for k, v in counters.items() if v is not None})  # None: not measured
        # an env actor that died meanwhile took its sandboxes with it
        reclaimed = sum([await result_or(ref, 30, 0) for ref in self.reclaims])
        env_pool: dict[str, float] = {}  # the env actors' own pools (ray.env.count > 0)
        for env in self.env_actors:
            add_into(env_pool, await result_or(env.close.remote(), 60, {}))
        for actor in [*self.reward_actors, *self.env_actors, *self.engines, self.board]:
            if actor is not None:
                cluster.kill(actor)
        # rollouts: as the rollout actors alive at the end counted them (a dead actor's counts die with it)
        return RolloutReport(rollouts=rollouts, env_pool=env_pool if self.env_actors else pool, extra={"ray": {
            "rollout_restarts": self.rollout_restarts, "reward_restarts": restarts["reward"],
            "env_restarts": restarts["env"], "env_leases_reclaimed": reclaimed, "placement": cluster.placement,
            **({"engine_restarts": restarts["engine"], "engines": engines} if self.engines else {})}})


class ActorTrainer(Trainer):
    """Trainer actors: rank 0 and, with trainer.world_size > 1, the follower ranks, placed together."""

    def __init__(self, cluster: RayCluster, rollouts: ActorRollouts):
        self.cluster, self.cfg, self.ray, self.rollouts = cluster, cluster.cfg, cluster.ray, rollouts
        self.trainer: Any = None  # rank 0
        self.trainer_ranks: list[Any] = []  # ranks 1.. (trainer.world_size > 1)
        self.broadcast = self.cfg.runtime.weight_transport == "broadcast"
        self.streamed = self.cfg.runtime.weight_transport == "cuda_ipc"  # colocated: pushed by the ranks in the step

    def actor(self) -> Any:
        """Rank 0's actor (start() makes it)."""
        if self.trainer is None:
            raise RuntimeError("ActorTrainer: used before start() or after stop()")
        return self.trainer

    async def call(self, ref: Any) -> Any:
        """The result of a call on a trainer actor; TrainerLost when any trainer rank is gone."""
        try:
            return await ref
        except self.ray.exceptions.RayActorError as err:
            # a constructor that raised: its cause is at the end of Ray's message, which begins with where it ran
            raise TrainerLost(error_tail(err) if constructor_failed(err) else error_line(err)) from None
        except RankLost as err:  # another trainer rank died or failed: all ranks restart
            raise TrainerLost(error_line(err, end=True)) from None

    async def start(self, carried: Carried) -> TrainerState:
        cluster, spec, world = self.cluster, self.cfg.ray.trainer, self.cfg.trainer.world_size
        pool_json = self.cfg.train_pool().model_dump_json()  # the training pool's part of the recipe
        cluster.trainer_starts += 1
        await cluster.reserve_trainer()
        trainer = self.trainer = cluster.actor(TrainerActor, spec, max_restarts=0,
                                               **cluster.trainer_options(0)).remote(pool_json, carried)
        if self.cfg.trainer.distributed:  # follower rank actors from rank 0's checkpoint, all in one process group
            addr, port, ckpt = await self.call(trainer.rendezvous.remote())
            self.trainer_ranks = [cluster.actor(TrainerRankActor, spec, max_restarts=0, **cluster.trainer_options(rank))
                                  .remote(pool_json, ckpt) for rank in range(1, world)]
            try:  # a follower that dies or fails, reading its model or joining, stops the start
                # rank 0 reads its model first (the followers read theirs as they are made): no rank then waits in the
                # rendezvous, which times out after COLLECTIVE_TIMEOUT_S, while rank 0 reads a large model; a follower
                # that cannot start stops the start then, not after rank 0's read
                await asyncio.gather(self.call(trainer.load.remote()),
                                     *(f.__ray_ready__.remote() for f in self.trainer_ranks))
                joins = [f.join.remote(rank, world, addr, port) for rank, f in enumerate(self.trainer_ranks, start=1)]
                await asyncio.gather(self.call(trainer.join_ranks.remote(self.trainer_ranks, addr, port)), *joins)
            except self.ray.exceptions.RayError as err:
                raise TrainerLost(f"a trainer rank failed to start: {failure_line(err)}") from None
        version, state, metrics = await self.call(trainer.state.remote())
        weights: Any = None  # broadcast: the trainer actor publishes the version itself (BroadcastRoute)
        if self.streamed:  # rank i pushes to engine actor i (the same bundle: the same GPU), the start's version first
            engines = self.rollouts.engines
            await self.call(trainer.attach_engine.remote(engines[0]))
            await asyncio.gather(*(self.call(f.attach_engine.remote(engines[rank], rank))
                                   for rank, f in enumerate(self.trainer_ranks, start=1)))
            weights = trainer.push_start.remote()
            await self.settled_push(weights)
        elif not self.broadcast:
            weights = trainer.weights.remote()  # what publish(version) sends first
            if cluster.colocated:  # its state is in host memory once this is made: only then may the engines wake
                await asyncio.to_thread(self.ray.wait, [weights], fetch_local=False)
        placement = cluster.placement
        if "trainer" not in placement:
            if cluster.colocated:
                placement["trainer_gpus"] = [await a.gpu_ids.remote() for a in [trainer, *self.trainer_ranks]]
                if why := colocation_mismatch(placement["engine_gpus"], placement["trainer_gpus"]):
                    raise CannotStart(f"engine.sleep_while_training on Ray: {why} (check `ray status`)")
            placement.update(
                trainer=(await cluster.where([trainer]))[0][0],
                trainer_ranks=[node for node, _ in await cluster.where(self.trainer_ranks)],
                rollout=[node for node, _ in await cluster.where([s.handle for s in self.rollouts.workers])])
        return TrainerState(version, PositionSet.of(state), metrics, weights)

    async def settled_push(self, report: Any) -> None:
        """cuda_ipc: the start's push (`report`, the ObjectRef of its PushReport) answered (its state is in host memory
        after it: only then may the engines wake); an engine that failed it is EngineLost."""
        try:
            await self.call(report)
        except self.ray.exceptions.RayTaskError as err:
            raise await self._not_delivered(err) from None

    async def _not_delivered(self, err: Any) -> BaseException:
        """What a step or push that raised `err` means: a version sent once that missed an engine (an engine died,
        or failed to load it) is EngineLost; anything else is the trainer's own error, raised as it came."""
        if not isinstance(err.cause, VersionNotDelivered):
            return err
        # the last version did not reach every engine actor: one that died is the usual cause
        alive = [await result_or(engine.info.remote(), 30, None) is not None for engine in self.rollouts.engines]
        if not all(alive):
            return engine_lost(f"engine actor {alive.index(False)} is gone", self.cfg.runtime.weight_transport)
        return EngineLost(str(err.cause))

    def stop(self) -> None:
        for actor in [self.trainer, *self.trainer_ranks]:
            if actor is not None:
                self.cluster.kill(actor)
        self.trainer, self.trainer_ranks = None, []
        self.cluster.release_trainer()

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        await self.call(self.actor().receive.remote(position, group))

    async def has_step(self) -> bool:
        return await self.call(self.actor().has_step.remote())

    async def train_step(self) -> TrainStep | None:
        # two returns: the weights (or cuda_ipc's PushReport) are an object this process owns, which outlives the
        # trainer actor; the step refers to it, and the route publishes what it refers to
        step_ref, weights_ref = self.actor().step.options(num_returns=2).remote()
        try:
            step = await self.call(step_ref)
        except self.ray.exceptions.RayTaskError as err:
            raise await self._not_delivered(err) from None
        return None if step is None else step.with_weights(None if self.broadcast else weights_ref)


class ActorRoute(WeightRoute):
    """A version to every engine: the engine actors (the board first: one restarted meanwhile reads it there), else
    every rollout actor. How the version travels is the subclass's; its loads are read for the metrics without
    waiting, a step later if need be."""

    def __init__(self, cluster: RayCluster, rollouts: ActorRollouts, trainer: ActorTrainer):
        self.cluster, self.ray, self.rollouts, self.trainer = cluster, cluster.ray, rollouts, trainer

    @abstractmethod
    async def handle(self, version: int, weights: Any) -> WeightHandle:
        """The version's handle, as this route moves it (`weights`: the trainer's reference to them)."""

    async def publish(self, version: int, weights: Any) -> None:
        cluster = self.cluster
        cluster.weights = await self.handle(version, weights)
        if self.rollouts.engines:
            await self.rollouts.board.post.remote(cluster.weights)
            refs = [engine.update_weights.remote(cluster.weights) for engine in self.rollouts.engines]
            cluster.sync_sender.update(dict.fromkeys(refs, cluster.trainer_starts))
            cluster.syncs.extend(refs)
            return
        for slot in self.rollouts.workers:
            cluster.syncs.append(slot.handle.update_weights.remote(cluster.weights))

    async def settle(self, timeout_s: float) -> None:
        """The loads still in flight, awaited (the trainer actor broadcasting the last version must outlive them):
        left running after `timeout_s`, said in one line."""
        pending = list(self.cluster.syncs)
        if not pending:
            return
        _, left = await asyncio.to_thread(self.ray.wait, pending, num_returns=len(pending), timeout=timeout_s)
        if left:
            log.warning("%d weight load(s) still running %.0f s after the last step; the trainer stops anyway",
                        len(left), timeout_s)

    def load_died(self, err: BaseException) -> None:
        """The actor loading a version died: supervision replaces it (a fresh one loads the latest)."""

    def load_failed(self, err: BaseException, sender: int) -> None:
        """A live engine could not load a version: every engine gets the same ones, so retrying cannot help (and the
        engine refuses requests)."""
        raise EngineLost("a rollout actor's engine could not load the trainer's weights:\n" + error_tail(err)) from None

    def step_metrics(self) -> dict[str, float]:
        """The slowest finished weight transfer since the last step (fetch, apply in the engine, confirm); transfers
        still running are reported later."""
        cluster = self.cluster
        if not cluster.syncs:
            return {}
        done, cluster.syncs = self.ray.wait(cluster.syncs, num_returns=len(cluster.syncs), timeout=0)
        timings = []
        for ref in done:
            sender = cluster.sync_sender.pop(ref, cluster.trainer_starts)
            try:
                timings.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError as err:
                self.load_died(err)
            except self.ray.exceptions.RayError as err:
                self.load_failed(err, sender)
        if not timings:
            return {}
        out = {"weight_sync/load_s": max(t["load_s"] for t in timings),
               "weight_sync/apply_s": max(t["apply_s"] for t in timings),
               "weight_sync/confirm_s": max(t["confirm_s"] for t in timings),
               "weight_sync/fingerprinted": float(min(t["fingerprinted"] for t in timings)),
               "weight_sync/transfers": float(len(timings))}
        adapters = [t for t in timings if "adapter_version" in t]  # trainer.lora publish=adapter (WeightGate.load)
        if adapters:  # the oldest adapter an engine confirmed serving, and one version's bytes
            out["weight_sync/adapter_version"] = float(min(t["adapter_version"] for t in adapters))
            out["weight_sync/adapter_bytes"] = float(adapters[-1]["adapter_bytes"])
        return out


class ObjectStoreRoute(ActorRoute):
    """Transport "ray": the trainer returned the version's weights as an object the driver owns (it outlives a
    trainer that dies); each engine fetches it from Ray's object store."""

    async def handle(self, version: int, weights: Any) -> WeightHandle:
        if weights is None:  # the trainer answers its start and every step with the ObjectRef of its weights
            raise RuntimeError(f"ObjectStoreRoute: version {version} is published without the trainer's weights")
        return WeightHandle(transport=Transport.RAY, version=version, nbytes=0, payload=weights)


class BroadcastRoute(ActorRoute):
    """runtime.weight_transport=broadcast: the trainer actor broadcasts each version over its process group to the
    engine actors' processes as they receive it (NCCL between GPUs); nothing goes through the object store, and an
    engine actor that dies cannot be given the current version again."""

    async def handle(self, version: int, weights: Any) -> WeightHandle:
        """The trainer actor publishes its current weights itself (`weights` is None: nothing travels with the step)."""
        return await self.trainer.call(self.trainer.actor().publish.remote(version))

    def load_died(self, err: BaseException) -> None:
        if self.rollouts.engines:
            raise engine_lost(err) from None

    def load_failed(self, err: BaseException, sender: int) -> None:
        if sender < self.cluster.trainer_starts:  # its trainer died mid-broadcast; the fresh trainer's next version
            log.info("ray: a version whose trainer actor died while broadcasting it was not loaded (the new "
                     "trainer's next version replaces it): %s", error_line(err, end=True)[:200])
            return
        super().load_failed(err, sender)


class StreamedRoute(WeightRoute):
    """runtime.weight_transport=cuda_ipc, colocated: every trainer rank pushed the version to the engine actor on its
    GPU a bucket at a time within the step (train_pool/push.py), before its state left the GPU; here only the reports of
    those pushes are read. Nothing is held to send again: an engine actor that dies stops the run (engine_lost)."""

    def __init__(self, cluster: RayCluster, rollouts: ActorRollouts, trainer: ActorTrainer):
        del rollouts, trainer  # ActorRoute's constructor (ray_parts makes either); the reports come with each version
        self.cluster, self.ray = cluster, cluster.ray

    async def publish(self, version: int, weights: Any) -> None:
        # the version is in every engine already (the step or the start answered only after the pushes); `weights` is
        # the ObjectRef of the pushes' report, read for the metrics
        self.cluster.weights = WeightHandle(transport=Transport.CUDA_IPC, version=version, nbytes=0)
        self.cluster.syncs.append(weights)

    async def settle(self, timeout_s: float) -> None:
        """Nothing travels after publish."""

    def step_metrics(self) -> dict[str, float]:
        """Rank 0's pushes since the last step (each rank pushes the same bytes to its own engine)."""
        reports, self.cluster.syncs = self.ray.get(self.cluster.syncs), []
        if not reports:
            return {}
        last = reports[-1]
        return {"weight_sync/push_s": max(r.push_s for r in reports),
                "weight_sync/confirm_s": max(r.confirm_s for r in reports),
                "weight_sync/fingerprinted": float(min(r.fingerprinted for r in reports)),
                "weight_sync/buckets": float(last.buckets), "weight_sync/bytes": float(last.bytes),
                "weight_sync/buffer_bytes": float(last.buffer_bytes), "weight_sync/transfers": float(len(reports))}


def ray_parts(cfg: RunConfig) -> Parts:
    """The Ray run's parts: actor rollouts, actor trainer, and the route runtime.weight_transport names."""
    cluster = RayCluster(cfg)
    rollouts = ActorRollouts(cluster)
    trainer = ActorTrainer(cluster, rollouts)
    route = {"broadcast": BroadcastRoute, "cuda_ipc": StreamedRoute}.get(cfg.runtime.weight_transport,
                                                                         ObjectStoreRoute)
    return Parts(rollouts, trainer, route(cluster, rollouts, trainer))
