"""The Ray actors of runtime.backend=ray: rollout actors (model copy + engine + env pool, i.e. a
RolloutWorker, scoring on its own threads or on the reward actors), reward actors, the trainer actor
(a TrainerService; rank 0) and, with trainer.world_size > 1, the other data-parallel trainer ranks
(runtime/trainer_ranks.py). Plain classes here; the driver (runtime/ray_runtime.py) wraps them with
`ray.remote` so that importing this module needs no ray.

What they are not: supervisors. A rollout or trainer actor that dies stays dead (max_restarts=0);
the driver notices the failed calls, makes a fresh one and decides what happens to the work that
died with it. Reward actors hold no state, so Ray restarts them and retries their calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from loomrl.config import RunConfig
from loomrl.env.pool import EnvPool, EnvPoolFailed, Leases, PoolMetrics, sandbox_pool
from loomrl.env.registry import env_family
from loomrl.env.sandbox.base import ExecResult, Health, Sandbox, SandboxError
from loomrl.model.chat import ChatRenderer
from loomrl.reward.pool import RewardPool, mark_reward_failed
from loomrl.runtime.rollout import RolloutWorker, sandbox_pool_size
from loomrl.runtime.trainer_ranks import Follower, RankGroup, RankLost, RankReport, RankWork
from loomrl.runtime.trainer_service import TrainerService, repair_ledger_for_restart
from loomrl.runtime.weight_sync import WeightHandle
from loomrl.types import Task, Trajectory


def constructor_failed(err: BaseException) -> bool:
    """Whether a Ray actor error says the actor's constructor raised (every fresh one would too)."""
    return "creation task" in str(err)


class RewardActor:
    """A reward worker (ray.num_reward_workers > 0): the run's reward function on its own threads, on
    whatever node ray.reward_resources picks, shared by every rollout actor. Stateless, so Ray itself
    restarts it when it dies (max_restarts) and retries the calls it was running on the fresh one
    (max_task_retries); calls that still fail reach RemoteRewardPool as errors."""

    def __init__(self, cfg_json: str):
        from loomrl.runtime.rollout import reward_fn_for

        cfg = RunConfig.model_validate_json(cfg_json)
        self.pool = RewardPool(reward_fn_for(cfg), workers=cfg.reward.workers)

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        return await self.pool.score(traj, task)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RemoteRewardPool:
    """RewardPool's interface over the reward actors (round robin). A call that fails even after Ray's
    retries on restarted actors marks the trajectory reward_failed with the reason: it is stored and
    left out of training, and the rollout goes on."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self._next = itertools.cycle(range(len(actors)))
        self.scored = 0
        self.failed = 0

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        import ray

        i = next(self._next)
        try:
            out = await self.actors[i].score.remote(traj, task)
        except ray.exceptions.RayError as err:
            if constructor_failed(err):  # a reward setup that cannot work: fail the rollout, and so the run
                raise
            self.failed += 1
            out = mark_reward_failed(traj, f"reward actor {i}: {type(err).__name__}: {str(err).splitlines()[0]}")
        self.scored += 1
        return out

    def close(self) -> None:
        pass  # the driver owns the reward actors


class EnvActor:
    """Sandboxes on whatever node ray.env_resources picks (ray.num_env_workers > 0): an EnvPool whose
    instances rollout actors lease by id and drive by calls (RemoteEnvPool, RemoteSandbox), so that
    sandboxes can live on CPU nodes while engines sit on GPU nodes. Every lease names its owner (a
    rollout actor incarnation): when that actor dies the driver calls release_owner, and its sandboxes
    are destroyed and replaced instead of leaking. Ray restarts a dead env actor (max_restarts) with a
    fresh pool; calls on the leases of the old one fail with SandboxError (the episode ends env_error,
    and agent.retry_on may run it again). Calls are not retried by Ray: a command may not be idempotent."""

    def __init__(self, cfg_json: str, concurrency: int):
        """`concurrency`: trajectories that may lease from this actor at once (its share of the run's)."""
        cfg = RunConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        self.size = sandbox_pool_size(cfg, concurrency)  # sized on this node (its cores)
        self.pool: EnvPool | None = None
        self.leases: dict[str, tuple[str, Sandbox]] = {}  # lease id -> (owner, sandbox)
        # Leases given up before their acquire finished (the caller was cancelled), and owners that
        # died: an acquire that completes for either is released at once, never leaked.
        self.abandoned: set[str] = set()
        self.dead_owners: set[str] = set()
        self._start_lock: asyncio.Lock | None = None

    async def _pool(self) -> EnvPool:
        if self._start_lock is None:  # made on the actor's event loop
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.pool is None:
                pool = sandbox_pool(self.cfg.env, self.size)
                await pool.start()
                self.pool = pool
        return self.pool

    def _sandbox(self, lease: str) -> Sandbox:
        try:
            return self.leases[lease][1]
        except KeyError:
            raise SandboxError(f"env worker: no sandbox under lease {lease} (the worker restarted, or the lease "
                               "was released)") from None

    async def start(self) -> int:
        """Pre-warm now (instead of at the first lease); returns the pool size."""
        await self._pool()
        return self.size

    async def acquire(self, owner: str, lease: str) -> dict[str, str]:
        """Lease a sandbox under `lease` (an id the caller chose, so that it can give the lease up
        before this returns)."""
        if owner in self.dead_owners:
            raise SandboxError(f"env worker: owner {owner} is gone")
        pool = await self._pool()
        sb = await pool.acquire()
        if lease in self.abandoned or owner in self.dead_owners:
            self.abandoned.discard(lease)
            await pool.release(sb)
            raise SandboxError(f"env worker: lease {lease} was given up while it waited")
        self.leases[lease] = (owner, sb)
        return {"lease": lease, "backend": sb.backend, "workdir": str(sb.workdir), "python": sb.python}

    async def release(self, lease: str, broken: bool = False) -> None:
        entry = self.leases.pop(lease, None)
        if entry is None:
            self.abandoned.add(lease)  # its acquire has not finished yet: released when it does
            return
        if self.pool is not None:
            await self.pool.release(entry[1], broken=broken)

    async def release_owner(self, owner: str) -> int:
        """Destroy (and replace) every sandbox leased by `owner`, a rollout actor that died; returns how many."""
        self.dead_owners.add(owner)
        mine = [lease for lease, (o, _) in self.leases.items() if o == owner]
        for lease in mine:
            await self.release(lease, broken=True)
        return len(mine)

    async def exec(self, lease: str, argv: list[str], timeout: float, stdin: str | None,
                   env: dict[str, str] | None) -> ExecResult:
        return await self._sandbox(lease).exec(argv, timeout=timeout, stdin=stdin, env=env)

    async def write_file(self, lease: str, path: str, data: str | bytes) -> None:
        await asyncio.to_thread(self._sandbox(lease).write_file, path, data)

    async def read_file(self, lease: str, path: str) -> str:
        return await asyncio.to_thread(self._sandbox(lease).read_file, path)

    def metrics(self) -> dict[str, Any]:
        return self.pool.metrics.as_dict() if self.pool is not None else {}

    async def close(self) -> dict[str, Any]:
        """Tear the sandboxes down; returns the pool's metrics (teardown included)."""
        if self.pool is not None:
            await self.pool.close()
        return self.metrics()

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RemoteSandbox:
    """The Sandbox protocol over an EnvActor lease. exec is awaited; write_file / read_file block on
    the call, so callers run them off the event loop (codefix does, with asyncio.to_thread)."""

    def __init__(self, actor: Any, info: dict[str, str]):
        self.actor = actor
        self.lease = info["lease"]
        self.backend = info["backend"]
        self.workdir = Path(info["workdir"])  # on the env actor's node
        self.python = info["python"]

    async def exec(self, argv: list[str], *, timeout: float, stdin: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        return await _remote(self.actor.exec.remote(self.lease, argv, timeout, stdin, env))

    def write_file(self, path: str, data: str | bytes) -> None:
        import ray

        _raise_as_sandbox_error(lambda: ray.get(self.actor.write_file.remote(self.lease, path, data)))

    def read_file(self, path: str) -> str:
        import ray

        return _raise_as_sandbox_error(lambda: ray.get(self.actor.read_file.remote(self.lease, path)))

    async def health(self, timeout: float = 5.0) -> Health:
        return Health(ok=True)  # the env actor's pool checks its instances before it leases them

    def snapshot(self) -> None:
        raise NotImplementedError("a remote sandbox is snapshotted and reset by its env actor's pool")

    reset = snapshot

    def close(self) -> None:
        pass  # released through RemoteEnvPool


def _env_worker_failed(err: BaseException) -> SandboxError:
    """A dead env actor is a dead sandbox to the environment code: SandboxError, with the reason."""
    return SandboxError(f"env worker failed: {type(err).__name__}: {str(err).splitlines()[0]}")


def actor_error_line(err: BaseException) -> str:
    """The message of the exception an actor raised (Ray wraps it in a traceback)."""
    import ray

    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        err = err.cause
    return str(err).strip().splitlines()[-1]


def _raise_as_sandbox_error(call: Any) -> Any:
    import ray

    try:
        return call()
    except SandboxError:
        raise
    except ray.exceptions.RayError as err:
        raise _env_worker_failed(err) from None


async def _remote(ref: Any) -> Any:
    import ray

    try:
        return await ref
    except SandboxError:
        raise
    except ray.exceptions.RayError as err:
        raise _env_worker_failed(err) from None


class RemoteEnvPool(Leases):
    """The env pool interface (acquire / release / lease) over the env actors, round robin; a lease
    that fails on one actor (dead, restarting) is tried on the next. `owner` names this rollout actor
    incarnation in the env actors' lease tables."""

    ACQUIRE_PATIENCE_S = 30.0

    def __init__(self, actors: list[Any], owner: str):
        self.actors = actors
        self.owner = owner
        self._next = itertools.cycle(range(len(actors)))
        self.metrics = PoolMetrics()  # this side's view: leases, waits, broken releases

    async def start(self) -> RemoteEnvPool:
        return self

    async def acquire(self) -> Sandbox:
        """A sandbox from the next env actor that can lease one. An actor that Ray is restarting takes
        a few seconds: the lease is tried on the others and again, with backoff, for up to
        ACQUIRE_PATIENCE_S before the episode fails with SandboxError."""
        t0 = time.perf_counter()
        errors = []
        for attempt in itertools.count():
            actor = self.actors[next(self._next)]
            lease = uuid.uuid4().hex
            try:
                info = await _remote(actor.acquire.remote(self.owner, lease))
            except EnvPoolFailed as err:  # that actor's sandboxes cannot work: waiting will not help
                self.failure = EnvPoolFailed(actor_error_line(err))
                raise self.failure from None
            except SandboxError as err:
                errors.append(str(err))
                if time.perf_counter() - t0 > self.ACQUIRE_PATIENCE_S:
                    break
                await asyncio.sleep(min(2.0, 0.1 * 2 ** (attempt // len(self.actors))))
                continue
            except asyncio.CancelledError:  # e.g. the episode's deadline: the acquire may still finish there
                actor.release.remote(lease, False)
                raise
            wait = time.perf_counter() - t0
            self.metrics.acquired += 1
            self.metrics.acquire_wait_s_total += wait
            self.metrics.acquire_wait_s_max = max(self.metrics.acquire_wait_s_max, wait)
            return RemoteSandbox(actor, info)
        raise SandboxError(f"no env worker could lease a sandbox in {time.perf_counter() - t0:.0f}s: {errors[-1]}")

    async def release(self, sb: Sandbox, *, broken: bool = False) -> None:
        assert isinstance(sb, RemoteSandbox)
        self.metrics.released += 1
        self.metrics.kills += int(broken)
        try:
            await _remote(sb.actor.release.remote(sb.lease, broken))
        except SandboxError:
            pass  # the env actor died: the sandbox died with it

    async def close(self) -> None:
        pass  # the driver owns (and closes) the env actors


class RolloutActor:
    """One rollout worker on some node. Async actor: many groups run at once over one engine.
    `reward_actors`: score on these (RemoteRewardPool) instead of this actor's own threads.
    `env_actors`: lease sandboxes from these (RemoteEnvPool, as `owner`) instead of this node's."""

    def __init__(self, cfg_json: str, reward_actors: list[Any] | None = None, env_actors: list[Any] | None = None,
                 owner: str = ""):
        from loomrl.runtime.local import build_model, make_engine

        cfg = RunConfig.model_validate_json(cfg_json)
        # engine.threads, else the CPUs Ray reserved for this actor (several actors share a node's cores)
        torch.set_num_threads(cfg.engine.threads or max(1, int(cfg.ray.rollout_num_cpus)))
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        # Architecture, tokenizer and frozen weights; the trainable ones arrive with update_weights
        # before the first group (the driver sends the trainer's current version to every new actor).
        model, tokenizer = build_model(cfg, None)
        self.engine = make_engine(cfg, model, tokenizer, 0)
        # On a thread: this constructor runs inside the actor's event loop, and a family may run one of
        # its own to build its tasks (codefix validates its corpus in local sandboxes, once per process).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            train_tasks, self.heldout = pool.submit(env_family(cfg.env.name).splits, cfg).result()
        rewards = RemoteRewardPool(reward_actors) if reward_actors else None
        envs = RemoteEnvPool(env_actors, owner) if env_actors else None
        self.worker = RolloutWorker(cfg, self.engine, ChatRenderer(tokenizer), train_tasks, reward_pool=rewards,
                                    env_pool=envs)
        self._weights_lock: asyncio.Lock | None = None

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:  # made on the actor's event loop
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    async def update_weights(self, handle: WeightHandle) -> dict[str, float]:
        """Load a published version into the engine; groups sent after this call wait for it.
        Returns the version and how long fetching (from the object store) and applying took."""
        async with self._lock():
            t0 = time.perf_counter()
            weights = await handle.payload  # transport "ray": an ObjectRef owned by the driver
            t1 = time.perf_counter()
            if self.cfg.runtime.interrupt_on_update:
                self.engine.interrupt()  # in-flight turns resume under the new weights (AgentLoop._generate)
            await asyncio.to_thread(self.engine.update_weights, weights, handle.version)
        return {"version": handle.version, "load_s": t1 - t0, "apply_s": time.perf_counter() - t1}

    async def run_group(self, position: int) -> list[Trajectory]:
        # An update sent before this group (e.g. the rollback after a trainer restart) lands first:
        # the lock is FIFO and update_weights takes it before its first await.
        async with self._lock():
            pass
        return await self.worker.run_group(position)

    async def evaluate(self) -> dict[str, Any]:
        async with self._lock():  # the latest published weights first, as for run_group
            pass
        res = await self.worker.evaluate(self.heldout[: self.cfg.eval.n_tasks])
        return {"success": res.success, "n": res.n, "stderr": res.stderr, "statuses": res.statuses}

    async def close(self) -> dict[str, Any]:
        """Tear down sandboxes and the engine; returns the env pool's metrics."""
        await self.worker.aclose()
        self.engine.close()
        return self.worker.pool_metrics()

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id): where the scheduler placed this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class TrainerActor:
    """The TrainerService on the trainer's node (rank 0 when trainer.world_size > 1). Made from the run
    folder's latest checkpoint when there is one: a fresh run has none, a resumed run or a restart
    after a crash continues from it."""

    def __init__(self, cfg_json: str, extra: dict[str, Any]):
        from loomrl.runtime.local import build_model
        from loomrl.trainer.checkpoint import latest_checkpoint

        cfg = RunConfig.model_validate_json(cfg_json)
        torch.set_num_threads(cfg.trainer.threads or max(1, int(cfg.ray.trainer_num_cpus)))  # as reserved
        self.ckpt = latest_checkpoint(cfg.run_dir)
        repair_ledger_for_restart(cfg.run_dir, self.ckpt)
        model, tokenizer = build_model(cfg, self.ckpt)
        self.service = TrainerService(cfg, model, tokenizer, resume_from=self.ckpt)
        for k, v in extra.items():
            self.service.extra.setdefault(k, v)

    def rendezvous(self) -> tuple[str, int, str | None]:
        """Where the other ranks meet this one (this node's address, a free port) and the checkpoint
        they must start from (this rank's)."""
        import ray

        from loomrl.trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port(""), str(self.ckpt) if self.ckpt else None

    def join_ranks(self, followers: list[Any], addr: str, port: int) -> None:
        """Rank 0 joins the process group of the follower actors (which join theirs concurrently)."""
        ranks = RayRankGroup(self.service.trainer, len(followers) + 1, followers)
        ranks.join(addr, port)
        self.service.ranks = ranks

    def state(self) -> tuple[int, dict[str, Any]]:
        """The policy version and the positions received (as of the checkpoint it started from)."""
        return self.service.version, self.service.received.state()

    def receive(self, position: int, group: list[Trajectory]) -> None:
        self.service.receive(position, group)

    def step(self) -> dict[str, Any] | None:
        """One training step when a step's groups are buffered (and the run is not done), else None."""
        return self.service.train_step() if self.service.ready() else None

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights of the current version. Returned (not ray.put here) so that the
        object is owned by the caller and outlives this actor."""
        return self.service.trainable_weights()

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id): where the scheduler placed this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class TrainerRankActor:
    """A data-parallel trainer rank r > 0 (runtime/trainer_ranks.Follower) on some node."""

    def __init__(self, cfg_json: str, ckpt: str | None):
        cfg = RunConfig.model_validate_json(cfg_json)
        torch.set_num_threads(cfg.trainer.threads or max(1, int(cfg.ray.trainer_num_cpus)))  # as reserved
        self.follower = Follower(cfg, Path(ckpt) if ckpt else None)

    def join(self, rank: int, world_size: int, addr: str, port: int) -> None:
        self.follower.join(rank, world_size, addr, port)

    def work(self, work: RankWork) -> RankReport:
        return self.follower.work(work)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RayRankGroup(RankGroup):
    """Rank 0 over Ray actor calls to the follower actors."""

    def __init__(self, trainer: Any, world_size: int, followers: list[Any]):
        super().__init__(trainer, world_size)
        self.followers = followers
        self.refs: list[Any] = []

    def _send(self, works: list[RankWork]) -> None:
        self.refs = [f.work.remote(w) for f, w in zip(self.followers, works)]

    def _collect(self) -> list[RankReport]:
        import ray

        reports = []
        for rank, ref in enumerate(self.refs, start=1):
            try:
                reports.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                raise RankLost(f"trainer rank {rank} died: {str(err).splitlines()[0]}") from None
            except ray.exceptions.RayTaskError as err:
                raise RankLost(f"trainer rank {rank} failed: {err}") from None
        return reports
