"""Ray runtime (runtime.backend=ray): rollout actors (engine + agent loops), trainer actors (rank 0 and,
with trainer.world_size > 1, the other data-parallel ranks), and optionally reward actors and env
actors (sandboxes), each placed by its own resources across a Ray cluster, driven and supervised from
the `loomrl train` process.

The driver runs the async admission loop of runtime/local.py (the group at data position p is
launched only while p // groups_per_step - version <= buffer.max_policy_lag; mode=sync uses lag 0, so
a step's groups are sampled by the current policy), spreads positions over the least-loaded rollout
actors, stores every returned group, feeds groups to the trainer actor and sends each new version to
every rollout actor (transport "ray": the trainer returns its weights, so the object belongs to the
driver and outlives a trainer that dies).

Supervision (nothing lost, nothing trained twice; see runtime/accounting.py for the tally):
- a rollout actor dies (its engine dies with it, and its own env pool and reward pool when it has
  them): a fresh actor takes its place with the current weights; its groups in flight are dispatched
  again after ray.retry_backoff_s x 2^k, at most ray.max_group_attempts times in all, then recorded as
  failed (the trajectories that died in it count as failed: actor_died either way). Sandboxes it had
  leased from env actors are destroyed and replaced. One whose constructor raises stops the run.
- a reward actor dies: Ray restarts it (stateless) and retries its calls; a trajectory that still
  cannot be scored is stored as reward_failed and not trained.
- an env actor dies: Ray restarts it with fresh sandboxes; the episodes whose sandboxes it held end
  env_error (agent.retry_on runs them again).
- the trainer actor dies (or, with trainer.world_size > 1, any trainer rank: rank 0's step then
  fails): fresh ones resume from the run folder's latest checkpoint (the run folder must be on a
  filesystem every node sees), cutting the ledger back to it. Groups it received after
  that checkpoint, and groups still in flight, may hold tokens of versions the restored model never
  had: they are discarded (reason trainer_restart) and their positions run again with the restored
  weights. Rollout actors get the restored version before any new group.

What is not here: GPU engines (vLLM / SGLang actors), or restarting the driver itself (a dead driver
is a crashed run: `--resume` continues from the latest checkpoint).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from loomrl.buffer.admission import admits
from loomrl.config import RunConfig
from loomrl.env.registry import env_family
from loomrl.env.sandbox import SandboxError
from loomrl.metrics import MetricsLogger
from loomrl.runtime.accounting import Accounting, ledger_line
from loomrl.runtime.local import RunError, _progress, positions_after, prepare_run_dir
from loomrl.runtime.ray_actors import (
    EnvActor,
    RewardActor,
    RolloutActor,
    TrainerActor,
    TrainerRankActor,
    actor_error_line,
    constructor_failed,
)
from loomrl.runtime.rollout import group_summary, rollout_concurrency
from loomrl.runtime.trainer_ranks import RankLost
from loomrl.runtime.trainer_service import PositionSet, read_ledger
from loomrl.runtime.weight_sync import Transport, WeightHandle
from loomrl.store import TrajectoryStore
from loomrl.trainer.checkpoint import checkpoint_step, load_state

log = logging.getLogger("loomrl")


def import_ray():
    try:
        import ray
    except ImportError:
        raise RunError("run error: runtime.backend=ray needs the ray package; install it with "
                       "pip install -e '.[ray]' (or set runtime.backend=local)") from None
    return ray


def last_lines(err: BaseException, n: int = 3) -> str:
    return "\n".join(str(err).splitlines()[-n:])


def fail_if_cannot_start(err: BaseException, what: str) -> None:
    """An actor whose constructor raised: every fresh one would too, so the run stops with the cause."""
    if constructor_failed(err):
        raise RunError(f"run error: {what} failed to start (its constructor raised):\n{last_lines(err)}")


@dataclass(slots=True, kw_only=True)
class Dispatch:
    """One attempt at one position on one rollout actor."""

    position: int
    worker: int  # index into RayRun.workers
    incarnation: int  # of that worker slot when dispatched
    serial: int  # the position's live attempt is the one whose serial RayRun.live holds


@dataclass(slots=True, kw_only=True)
class WorkerSlot:
    handle: Any
    owner: str = ""  # its name in the env actors' lease tables
    incarnation: int = 0
    load: int = 0  # groups in flight on it


class TrainerDied(Exception):
    """The trainer actor died; the loop restarts it."""


class RayRun:
    def __init__(self, cfg: RunConfig, resume: bool = False, wall_start: float | None = None):
        self.ray = import_ray()
        self.cfg = cfg
        self.wall_start = wall_start or time.time()
        self.ckpt = prepare_run_dir(cfg, resume)
        self.logger = MetricsLogger(cfg.run_dir)
        if self.ckpt is not None:
            self.logger.rollback(checkpoint_step(self.ckpt), "resume")
        self.store = TrajectoryStore(cfg.run_dir / "trajectories")
        self.acc = Accounting()
        self.B = cfg.trainer.groups_per_step
        self.G = cfg.trainer.group_size
        self.lag = 0 if cfg.runtime.mode == "sync" else cfg.buffer.max_policy_lag
        self.workers: list[WorkerSlot] = []
        self.trainer: Any = None  # rank 0
        self.trainer_ranks: list[Any] = []  # ranks 1.. (trainer.world_size > 1)
        self.reward_actors: list[Any] = []  # ray.num_reward_workers, shared by the rollout actors
        self.env_actors: list[Any] = []  # ray.num_env_workers, shared by the rollout actors
        self.owners = 0  # rollout actors made so far
        self._reclaims: list[Any] = []  # release_owner calls: sandboxes of dead rollout actors reclaimed
        self.env_leases_reclaimed = 0
        self.version = 0
        self.weights: WeightHandle | None = None
        self._syncs: list = []  # update_weights calls not yet read for the metrics
        self.inflight: dict[asyncio.Future, tuple[Dispatch, Any]] = {}
        self.live: dict[int, int] = {}  # position -> serial of its live attempt
        self.attempts: dict[int, int] = {}
        self.retry_at: dict[int, float] = {}  # position -> when to dispatch it again
        self.gave_up: dict[int, str] = {}  # position -> why (past ray.max_group_attempts)
        self.sent: dict[int, list[str]] = {}  # position -> ids, sent to the trainer since it started
        self.serials = itertools.count()
        self.rollout_restarts = 0
        self.reward_restarts = 0  # reward actors found with a new process at the end (Ray restarted them)
        self.env_restarts = 0  # env actors likewise
        self.trainer_restarts = 0
        self.statuses: dict[str, int] = {}
        self.placement: dict[str, Any] = {}  # where the first actors ran: {"trainer": node, "rollout": [nodes]}

    # -- actors -----------------------------------------------------------------------------------
    def _init_ray(self) -> bool:
        """Connect (ray.address) or start a local Ray; returns whether we own it (and shut it down)."""
        if self.ray.is_initialized():
            return False
        r = self.cfg.ray
        env = {"TOKENIZERS_PARALLELISM": "false"}
        if os.environ.get("PYTHONPATH"):  # e.g. where a custom reward function lives
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": False,
                                  "configure_logging": False}
        if r.address is None:  # a one-machine cluster offering the resources the config asks for
            need: dict[str, float] = {}
            ranks = self.cfg.trainer.world_size
            for res, n in [(r.rollout_resources, r.num_rollout_workers), (r.trainer_resources, ranks),
                           (r.reward_resources, r.num_reward_workers), (r.env_resources, r.num_env_workers)]:
                for k, v in res.items():
                    need[k] = need.get(k, 0) + v * n
            kwargs.update(include_dashboard=False, resources=need or None)
        # "local": always a new one-machine cluster; plain None would join a cluster found running
        # (RAY_ADDRESS, or the last one started on this machine)
        self.ray.init(address=r.address or "local", **kwargs)
        return True

    def _new_rollout_actor(self) -> tuple[Any, str]:
        """A rollout actor and its owner name (how env actors know its leases)."""
        r = self.cfg.ray
        cls = self.ray.remote(RolloutActor).options(num_cpus=r.rollout_num_cpus, resources=r.rollout_resources,
                                                     max_restarts=0, max_concurrency=1000)
        self.owners += 1  # names this incarnation in the env actors' lease tables
        owner = f"rollout-{self.owners}"
        actor = cls.remote(self.cfg.model_dump_json(), self.reward_actors, self.env_actors, owner)
        if self.weights is not None:
            self._syncs.append(actor.update_weights.remote(self.weights))
        return actor, owner

    def _new_reward_actors(self) -> list[Any]:
        r = self.cfg.ray
        cls = self.ray.remote(RewardActor).options(
            num_cpus=r.reward_num_cpus, resources=r.reward_resources, max_concurrency=1000,
            max_restarts=r.max_reward_restarts, max_task_retries=r.max_reward_attempts - 1)
        return [cls.remote(self.cfg.model_dump_json()) for _ in range(r.num_reward_workers)]

    def _new_env_actors(self) -> list[Any]:
        """Env actors sized for every rollout actor's concurrency, split between them."""
        r = self.cfg.ray
        if not r.num_env_workers:
            return []
        if env_family(self.cfg.env.name).sandbox_use is None:
            log.warning("ray.num_env_workers=%d ignored: env %s uses no sandbox", r.num_env_workers, self.cfg.env.name)
            return []
        total = rollout_concurrency(self.cfg) * r.num_rollout_workers
        share = math.ceil(total / r.num_env_workers)  # trajectories that may lease from one env actor at once
        # Concurrency: every waiting acquire holds a slot, and releases must still get in (else a full
        # pool could never be given back to): room for all of them, with margin.
        cls = self.ray.remote(EnvActor).options(num_cpus=r.env_num_cpus, resources=r.env_resources,
                                                 max_concurrency=max(1000, 4 * share), max_restarts=r.max_env_restarts)
        return [cls.remote(self.cfg.model_dump_json(), share) for _ in range(r.num_env_workers)]

    async def _pids(self, actors: list[Any]) -> list[int | None]:
        out = []
        for actor in actors:
            try:
                out.append((await asyncio.wait_for(actor.where.remote(), timeout=30))[1])
            except Exception:  # noqa: BLE001 - dead for good (past its restarts) or stuck
                out.append(None)
        return out

    def _replace_worker(self, i: int, why: str) -> None:
        slot = self.workers[i]
        try:
            self.ray.kill(slot.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.rollout_restarts += 1
        if self.rollout_restarts > self.cfg.ray.max_rollout_restarts:  # e.g. an actor that dies as it starts
            raise RunError(f"run error: rollout actors died {self.rollout_restarts} times (last: {why}); see the "
                           "Ray logs of the rollout nodes, then continue with --resume")
        log.warning("rollout actor %d died (%s); starting a fresh one", i, why)
        for env in self.env_actors:  # its sandboxes are destroyed and replaced, not leaked
            self._reclaims.append(env.release_owner.remote(slot.owner))
        (slot.handle, slot.owner), slot.incarnation, slot.load = self._new_rollout_actor(), slot.incarnation + 1, 0

    async def _call_trainer(self, method: str, *args):
        try:
            return await getattr(self.trainer, method).remote(*args)
        except self.ray.exceptions.RayActorError as err:
            raise TrainerDied(str(err).splitlines()[0]) from None
        except RankLost as err:  # another trainer rank died or failed: all ranks restart
            raise TrainerDied(str(err).splitlines()[-1]) from None

    def _kill_trainer(self) -> None:
        for actor in [self.trainer, *self.trainer_ranks]:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.trainer_ranks = []

    async def _start_ranks(self) -> None:
        """trainer.world_size > 1: follower rank actors from rank 0's checkpoint, all in one process group."""
        r, world = self.cfg.ray, self.cfg.trainer.world_size
        addr, port, ckpt = await self._call_trainer("rendezvous")
        cls = self.ray.remote(TrainerRankActor).options(num_cpus=r.trainer_num_cpus, resources=r.trainer_resources,
                                                         max_restarts=0)
        self.trainer_ranks = [cls.remote(self.cfg.model_dump_json(), ckpt) for _ in range(world - 1)]
        joins = [f.join.remote(rank, world, addr, port) for rank, f in enumerate(self.trainer_ranks, start=1)]
        try:
            await asyncio.gather(self._call_trainer("join_ranks", self.trainer_ranks, addr, port), *joins)
        except self.ray.exceptions.RayError as err:  # a follower died or failed while joining
            raise TrainerDied(f"a trainer rank failed to start: {str(err).splitlines()[0]}") from None

    async def _start_trainer(self, extra: dict[str, Any]) -> None:
        """A trainer actor from the latest checkpoint (if any); rollback of everything after it."""
        r = self.cfg.ray
        cls = self.ray.remote(TrainerActor).options(num_cpus=r.trainer_num_cpus, resources=r.trainer_resources,
                                                     max_restarts=0)
        self.trainer = cls.remote(self.cfg.model_dump_json(), extra)
        if self.cfg.trainer.world_size > 1:
            await self._start_ranks()
        version, state = await self._call_trainer("state")
        received = PositionSet(state["watermark"], set(state["above"]))
        for pos in [p for p in self.sent if p not in received]:
            self.acc.discard(self.sent.pop(pos), "trainer_restart")
        self.live.clear()  # attempts in flight are superseded: their results are discarded on arrival
        self.retry_at.clear()
        self.attempts.clear()
        self.gave_up.clear()
        self.version = version
        self.positions = positions_after(received)
        self.next_pos = next(self.positions)
        self._publish(self.trainer.weights.remote(), version)

    async def _node_of(self, actor) -> str | None:
        try:
            return (await actor.where.remote())[0]
        except self.ray.exceptions.RayActorError:  # died already: supervision deals with it later
            return None

    def _publish(self, ref, version: int) -> None:
        self.weights = WeightHandle(transport=Transport.RAY, version=version, nbytes=0, payload=ref)
        for slot in self.workers:
            self._syncs.append(slot.handle.update_weights.remote(self.weights))

    def _sync_metrics(self) -> dict[str, float]:
        """The slowest finished weight transfer to a rollout actor since the last step (fetch from the
        object store, apply in the engine); transfers still running are reported later."""
        if not self._syncs:
            return {}
        done, self._syncs = self.ray.wait(self._syncs, num_returns=len(self._syncs), timeout=0)
        timings = []
        for ref in done:
            try:
                timings.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError:  # that actor died: supervision replaces it
                continue
            except self.ray.exceptions.RayError as err:  # a live engine could not load the trainer's weights:
                # every actor gets the same ones, so retrying cannot help (and the engine refuses requests)
                raise RunError(f"run error: a rollout actor's engine could not load the trainer's weights:\n"
                               f"{last_lines(err)}") from None
        if not timings:
            return {}
        return {"weight_sync/load_s": max(t["load_s"] for t in timings),
                "weight_sync/apply_s": max(t["apply_s"] for t in timings),
                "weight_sync/transfers": float(len(timings))}

    # -- dispatch ---------------------------------------------------------------------------------
    def _dispatch(self, pos: int) -> None:
        i = min(range(len(self.workers)), key=lambda k: self.workers[k].load)
        slot = self.workers[i]
        d = Dispatch(position=pos, worker=i, incarnation=slot.incarnation, serial=next(self.serials))
        self.live[pos] = d.serial
        self.attempts[pos] = self.attempts.get(pos, 0) + 1
        ref = slot.handle.run_group.remote(pos)
        self.inflight[asyncio.wrap_future(ref.future())] = (d, ref)
        slot.load += 1
        self.acc.launched += self.G

    def _admit(self) -> None:
        for pos in [p for p, t in self.retry_at.items() if t <= time.monotonic()]:
            del self.retry_at[pos]
            self._dispatch(pos)
        # admission counts positions that will deliver a group: ones given up on free their place
        while admits(self.next_pos - len(self.gave_up), version=self.version, groups_per_step=self.B,
                     max_lag=self.lag):
            self._dispatch(self.next_pos)
            self.next_pos = next(self.positions)

    def _rollout_failed(self, d: Dispatch, err: BaseException) -> None:
        fail_if_cannot_start(err, "a rollout actor")
        why = f"actor_died: {type(err).__name__}"
        self.acc.failed["actor_died"] += self.G  # the group's trajectories died with the actor
        if self.workers[d.worker].incarnation == d.incarnation:
            self._replace_worker(d.worker, why)
        if self.live.get(d.position) != d.serial:
            return  # superseded (trainer restart): the position runs again anyway
        del self.live[d.position]
        k = self.attempts[d.position]
        if k < self.cfg.ray.max_group_attempts:
            self.retry_at[d.position] = time.monotonic() + self.cfg.ray.retry_backoff_s * 2 ** (k - 1)
        else:
            self.gave_up[d.position] = f"{why} ({k} attempts)"
            log.warning("position %d failed %d times; recorded as failed", d.position, k)

    def _keep_unconsumed(self, group: list) -> None:
        """Count and store a returned group (the trainer may or may not get it)."""
        self.acc.returned.update(t.trajectory_id for t in group)
        for t in group:
            self.statuses[str(t.status)] = self.statuses.get(str(t.status), 0) + 1
            if t.reward_failed:
                self.statuses["reward_failed"] = self.statuses.get("reward_failed", 0) + 1
        self.store.append(group)

    async def _arrived(self, d: Dispatch, group: list) -> list | None:
        """Store a returned group; send it to the trainer unless it was superseded."""
        ids = [t.trajectory_id for t in group]
        self._keep_unconsumed(group)  # stored first: whatever happens next, it is on disk
        if self.live.get(d.position) != d.serial:
            self.acc.discard(ids, "trainer_restart")
            return None
        del self.live[d.position]
        if max((t.metadata.policy_version_max for t in group), default=-1) > self.version:
            # sampled by weights the trainer no longer has (a rollback raced this group): never train it
            self.acc.discard(ids, "newer_than_trainer")
            self.gave_up[d.position] = "newer_than_trainer"
            return None
        self.sent[d.position] = ids
        await self._call_trainer("receive", d.position, group)
        return group

    # -- the loop ---------------------------------------------------------------------------------
    async def _loop(self, extra: dict[str, Any]) -> int:
        cfg = self.cfg
        await self._start_trainer(extra)
        self.placement = {**self.placement, "trainer": await self._node_of(self.trainer),
                          "trainer_ranks": [await self._node_of(f) for f in self.trainer_ranks],
                          "rollout": [await self._node_of(slot.handle) for slot in self.workers]}
        bar = _progress(cfg.trainer.total_steps, "train (ray)", cfg.progress)
        bar.update(self.version)
        recent: list = []
        step_started = time.perf_counter()
        while self.version < cfg.trainer.total_steps:
            try:
                self._admit()
                if not self.inflight:
                    if not self.retry_at:
                        raise RunError(f"run error: nothing in flight at version {self.version} and nothing "
                                       "to retry; every position of the step failed")
                    await asyncio.sleep(max(0.0, min(self.retry_at.values()) - time.monotonic()))
                    continue
                wait = max(0.0, min(self.retry_at.values()) - time.monotonic()) if self.retry_at else None
                done, _ = await asyncio.wait(list(self.inflight), timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    d, _ref = self.inflight.pop(fut)
                    if self.workers[d.worker].incarnation == d.incarnation:
                        self.workers[d.worker].load -= 1
                    err = fut.exception()
                    if isinstance(err, self.ray.exceptions.RayActorError):
                        self._rollout_failed(d, err)
                        continue
                    if err is not None:
                        fail_if_cannot_start(err, "an actor the rollouts use (e.g. a reward actor)")
                        raise err
                    group = await self._arrived(d, fut.result())
                    if group is not None:
                        recent.append(group)
                while self.version < cfg.trainer.total_steps:
                    metrics = await self._call_trainer("step")
                    if metrics is None:
                        break
                    self.version += 1
                    self._publish(self.trainer.weights.remote(), self.version)
                    now = time.perf_counter()
                    metrics.update({"time/step_s": now - step_started, "ray/rollout_restarts": self.rollout_restarts,
                                    "ray/trainer_restarts": self.trainer_restarts,
                                    "admission/inflight_groups": len(self.inflight), **group_summary(recent),
                                    **self._sync_metrics()})
                    self.logger.log(self.version, metrics)
                    step_started, recent = now, []
                    bar.update(1)
            except TrainerDied as err:
                self.trainer_restarts += 1
                if self.trainer_restarts > cfg.ray.max_trainer_restarts:
                    raise RunError(f"run error: the trainer actor died {self.trainer_restarts} times (last: {err}); "
                                   "continue with --resume") from None
                log.warning("trainer actor died (%s); restarting it from the latest checkpoint", err)
                self._kill_trainer()
                try:
                    await self._start_trainer(extra)
                    self.logger.rollback(self.version, "trainer_restart")
                except TrainerDied:  # died again while starting: the next pass restarts it (kill the
                    self._kill_trainer()  # ranks still up: rank 0 may wait for a dead one to join)
                    continue
                bar.n = self.version
                bar.refresh()
        bar.close()
        return self.version

    async def _evaluate(self, label: str, step: int) -> dict[str, Any] | None:
        cfg = self.cfg
        if not cfg.eval.n_tasks or not getattr(cfg.eval, label):
            return None
        for _ in range(cfg.ray.max_group_attempts):
            try:
                record = await self.workers[0].handle.evaluate.remote()
                break
            except self.ray.exceptions.RayActorError as err:
                fail_if_cannot_start(err, "a rollout actor")
                self._replace_worker(0, f"during eval: {type(err).__name__}")
        else:
            log.warning("eval %s: the rollout actor kept dying; no result", label)
            return None
        self.logger.log(step, {f"eval/{k}": v for k, v in record.items() if k != "statuses"}, kind=f"eval_{label}")
        log.info("held-out success %s: %.3f ± %.3f (n=%d)", label, record["success"], record["stderr"], record["n"])
        return record

    async def _run(self) -> dict[str, Any]:
        extra = load_state(self.ckpt).get("extra", {}) if self.ckpt else {}
        self.reward_actors = self._new_reward_actors()
        self.env_actors = self._new_env_actors()
        for env in self.env_actors:  # pre-warm the sandboxes before the first rollout
            await env.start.remote()
        reward_pids, env_pids = await self._pids(self.reward_actors), await self._pids(self.env_actors)
        self.placement["reward"] = [(await self._node_of(a)) for a in self.reward_actors]
        self.placement["env"] = [(await self._node_of(a)) for a in self.env_actors]
        self.workers = [WorkerSlot(handle=h, owner=o) for h, o in
                        (self._new_rollout_actor() for _ in range(self.cfg.ray.num_rollout_workers))]
        pool: dict[str, Any] = {}
        env_pool: dict[str, Any] = {}  # the env actors' own pool metrics (ray.num_env_workers > 0)
        try:
            before = extra.get("eval_before")
            if before is None:
                before = await self._evaluate("before", 0)
                if before is not None:
                    extra["eval_before"] = before
            steps = await self._loop(extra)
            for fut, (_d, ref) in self.inflight.items():  # the run is over: what is in flight is not needed
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._keep_unconsumed(fut.result())  # finished but not read: stored, not trained
                    continue
                try:
                    self.ray.cancel(ref)
                except Exception:  # noqa: BLE001 - its actor is gone: nothing left to cancel
                    pass
                fut.cancel()
                self.acc.cancelled += self.G
            self.inflight.clear()
            after = await self._evaluate("after", steps)
        finally:
            for slot in self.workers:
                try:
                    metrics = await asyncio.wait_for(slot.handle.close.remote(), timeout=30)
                    for k, v in metrics.items():
                        pool[k] = pool.get(k, 0) + v
                except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
                    pass
                self.ray.kill(slot.handle, no_restart=True)
            if self.trainer is not None:
                self._kill_trainer()
            # Ray restarts reward and env actors itself: a new process id means at least one restart
            self.reward_restarts = sum(a != b for a, b in zip(reward_pids, await self._pids(self.reward_actors)))
            self.env_restarts = sum(a != b for a, b in zip(env_pids, await self._pids(self.env_actors)))
            for ref in self._reclaims:
                try:
                    self.env_leases_reclaimed += await asyncio.wait_for(ref, timeout=30)
                except Exception:  # noqa: BLE001 - that env actor died meanwhile (its sandboxes with it)
                    pass
            for env in self.env_actors:  # sandboxes torn down; what this side saw stays in `pool` above
                try:
                    metrics = await asyncio.wait_for(env.close.remote(), timeout=60)
                    for k, v in metrics.items():
                        env_pool[k] = env_pool.get(k, 0) + v
                except Exception:  # noqa: BLE001 - a dead env actor took its sandboxes with it
                    pass
            for actor in [*self.reward_actors, *self.env_actors]:
                self.ray.kill(actor, no_restart=True)
        return {"before": before, "after": after, "steps": steps, "env_pool": env_pool if self.env_actors else pool}

    def train(self) -> dict[str, Any]:
        owns = self._init_ray()
        try:
            result = asyncio.run(self._run())
        except SandboxError as err:  # sandboxes that cannot work (EnvPoolFailed in an actor): one line
            raise RunError(f"run error: {actor_error_line(err)}") from None
        finally:
            self.store.flush()
            self.logger.close()
            if owns:
                self.ray.shutdown()
        acc = self.acc.settle(read_ledger(self.cfg.run_dir))
        log.info(ledger_line(acc))
        before, after = result["before"], result["after"]
        summary = {
            "success_before": before["success"] if before else None,
            "success_after": after["success"] if after else None,
            "n_heldout": (after or before or {}).get("n", 0),
            "stderr_before": before["stderr"] if before else None,
            "stderr_after": after["stderr"] if after else None,
            "steps": result["steps"],
            "run_dir": str(self.cfg.run_dir),
            "wall_s": round(time.time() - self.wall_start, 1),
            # training trajectories only (eval episodes run on the actors and are not counted here)
            "rollouts": {"launched": self.acc.launched, **self.statuses, **{f"failed:{k}": v for k, v in
                                                                          self.acc.failed.items()},
                         "cancelled": self.acc.cancelled},
            "env_pool": {k: round(v, 4) if isinstance(v, float) else v for k, v in result["env_pool"].items()},
            "accounting": acc,
            "ray": {"rollout_restarts": self.rollout_restarts, "trainer_restarts": self.trainer_restarts,
                    "reward_restarts": self.reward_restarts, "env_restarts": self.env_restarts,
                    "env_leases_reclaimed": self.env_leases_reclaimed,
                    "positions_failed": {str(k): v for k, v in self.gave_up.items()},
                    "placement": self.placement},
        }
        (self.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
