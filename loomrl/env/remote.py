"""The env pool's Ray half: env actors holding sandboxes (ray.env.count > 0), and the pool and
sandbox interfaces over them that rollout actors on other nodes use. Environments with a browser run whole
episodes in env actors instead (env/remote_episode.py): a browser tab cannot be driven from another process."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Generator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loomrl.actor_support import Placed, actor_error_line
from loomrl.config import EnvConfig
from loomrl.env.pool import EnvPool, EnvPoolFailed, Leases, PoolMetrics, sandbox_pool
from loomrl.env.registry import sandbox_pool_size
from loomrl.env.sandbox.base import ExecResult, Health, Sandbox, SandboxError
from loomrl.errors import named_line


class EnvActor(Placed):
    """Sandboxes on whatever node ray.env.resources picks (ray.env.count > 0): an EnvPool whose
    instances rollout actors lease by id and drive by calls (RemoteEnvPool, RemoteSandbox), so that
    sandboxes can live on CPU nodes while engines sit on GPU nodes. Every lease names its owner (a
    rollout actor incarnation): when that actor dies the driver calls release_owner, and its sandboxes
    are destroyed and replaced instead of leaking. Ray restarts a dead env actor (max_restarts) with a
    fresh pool; calls on the leases of the old one fail with SandboxError (the episode ends env_error,
    and agent.retry_on may run it again). Calls are not retried by Ray: a command may not be idempotent."""

    def __init__(self, env_json: str, concurrency: int, agent_kind: str):
        """`env_json`: the env section as JSON; `concurrency`: trajectories that may lease from this actor at once (its
        share of the run's), each an `agent_kind` agent's (agent.kind: a black-box one holds its sandbox all along)."""
        self.env = EnvConfig.model_validate_json(env_json)
        self.size = sandbox_pool_size(self.env, agent_kind, concurrency)  # sized on this node (its cores)
        self.pool: EnvPool | None = None
        self.leases: dict[str, tuple[str, Sandbox]] = {}  # lease id -> (owner, sandbox)
        # Leases given up before their acquire finished (the caller was cancelled), and owners that
        # died: an acquire that completes for either is released at once, never leaked.
        self.abandoned: set[str] = set()
        self.dead_owners: set[str] = set()
        self._start_lock = asyncio.Lock()  # bound to the actor's event loop when first waited on

    async def _pool(self) -> EnvPool:
        async with self._start_lock:
            if self.pool is None:  # set once pre-warmed: a pool that fails to start is not kept
                self.pool = await sandbox_pool(self.env, self.size).start()
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
        return asdict(self.pool.metrics) if self.pool is not None else {}

    async def close(self) -> dict[str, Any]:
        """Tear the sandboxes down; returns the pool's metrics (teardown included)."""
        if self.pool is not None:
            await self.pool.close()
        return self.metrics()


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
        _get(self.actor.write_file.remote(self.lease, path, data))

    def read_file(self, path: str) -> str:
        return _get(self.actor.read_file.remote(self.lease, path))

    async def health(self, timeout: float = 5.0) -> Health:
        return Health(ok=True)  # the env actor's pool checks its instances before it leases them

    def close(self) -> None:
        pass  # released through RemoteEnvPool


@contextmanager
def _env_worker_errors() -> Generator[None, None, None]:
    """A dead env actor is a dead sandbox to the environment code: SandboxError, with the reason (the
    env actor's own SandboxError passes as it is)."""
    import ray.exceptions

    try:
        yield
    except SandboxError:
        raise
    except ray.exceptions.RayError as err:
        raise SandboxError(f"env worker failed: {named_line(err)}") from None


def _get(ref: Any) -> Any:
    import ray

    with _env_worker_errors():
        return ray.get(ref)


async def _remote(ref: Any) -> Any:
    with _env_worker_errors():
        return await ref


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
            self.metrics.add_acquire(t0)
            return RemoteSandbox(actor, info)
        raise SandboxError(f"no env worker could lease a sandbox in {time.perf_counter() - t0:.0f}s: {errors[-1]}")

    async def release(self, sb: Sandbox, *, broken: bool = False) -> None:
        assert isinstance(sb, RemoteSandbox)
        self.metrics.released += 1
        self.metrics.kills += int(broken)
        with suppress(SandboxError):  # the env actor died: the sandbox died with it
            await _remote(sb.actor.release.remote(sb.lease, broken))
