"""EnvPool: pre-warmed sandboxes, handed out healthy and taken back clean.

- Pre-warm: `start()` creates `prewarm` instances concurrently before the first rollout needs one.
- Acquire: an idle instance if there is one, else a new one while the pool is under `size`, else wait.
  Every instance gets a health check when it is made and before it is handed out from the idle ones;
  a failing one is destroyed and replaced.
- Bounded failure: after `max_failures` failed creations or health checks in a row (with no healthy
  instance in between) the pool gives up for good: every acquire, waiting or new, raises EnvPoolFailed
  with the sandbox's own error output (bwrap's message, say). Backing off and retrying forever would
  hang a run whose sandbox backend cannot work here; the rollout worker stops the run on it.
- Release: the instance is reset to its initial state (workdir snapshot restored, leftovers killed) in
  the background and only then becomes idle again, so the next acquire does not pay for the reset.
  An instance released as broken (a step or trajectory timeout, a crash) is destroyed, never reused,
  and a replacement is prepared in the background.
- `lease()`: acquire + release as an async context manager; an exception or cancellation inside it
  (the trajectory's deadline, say) releases the instance as broken, and cleanup hooks run either way.
- Nothing is left behind: `close()` destroys every instance, and an atexit hook does it for pools
  still open when the interpreter exits.
Metrics: acquire wait, reset latency, health failures, creation failures, kills (broken releases).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loomrl.env.sandbox.base import Health, PooledSandbox, Sandbox, SandboxError
from loomrl.env.sandbox.factory import make_sandbox
from loomrl.errors import folded

if TYPE_CHECKING:
    from loomrl.config import EnvConfig

log = logging.getLogger(__name__)

_open_pools: weakref.WeakSet[EnvPool] = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        pool.destroy_all_now()


@dataclass(slots=True)
class PoolMetrics:
    created: int = 0
    destroyed: int = 0
    acquired: int = 0
    released: int = 0
    resets: int = 0
    reset_s_total: float = 0.0
    reset_s_max: float = 0.0
    acquire_wait_s_total: float = 0.0
    acquire_wait_s_max: float = 0.0
    health_failures: int = 0
    create_failures: int = 0
    reset_failures: int = 0
    kills: int = 0  # instances destroyed after a broken release (timeout, crash)

    def add_acquire(self, t0: float) -> None:
        """Count one acquire that began at time.perf_counter() `t0` (EnvPool's and RemoteEnvPool's alike)."""
        wait = time.perf_counter() - t0
        self.acquired += 1
        self.acquire_wait_s_total += wait
        self.acquire_wait_s_max = max(self.acquire_wait_s_max, wait)


class EnvPoolFailed(SandboxError):
    """The pool gave up: its sandboxes cannot be created, or cannot run a trivial command."""


GENERIC_FIX = ("the sandbox backend does not work here: `loomrl sandbox run -- /usr/bin/true` shows why; fix it, "
               "or choose another backend with env.sandbox (process isolates nothing)")


def pool_size_for(concurrency: int, spare: float = 0.25) -> int:
    """Instances for `concurrency` simultaneous rollouts, plus spares being reset or replaced meanwhile."""
    if concurrency < 1:
        raise ValueError(f"pool size: concurrency must be >= 1, got {concurrency}")
    return concurrency + max(1, math.ceil(concurrency * spare))


def sandbox_pool(e: EnvConfig, size: int, binds: dict[str, str] | None = None) -> EnvPool:
    """The env pool a run's config asks for: env.sandbox sandboxes with env.sandbox_limits (and
    `binds`), env.prewarm of them made up front, giving up after env.sandbox_max_failures."""
    limits = "".join(f" --limit {k}={v}" for k, v in e.sandbox_limits.items())
    fix = (f"the sandboxes of env.sandbox={e.sandbox}" + (f" with env.sandbox_limits={e.sandbox_limits}" if limits else "")
           + f" do not work here: `loomrl sandbox run --backend {e.sandbox}{limits} -- /usr/bin/true` shows why; fix "
           "that, or change env.sandbox / env.sandbox_limits (env.sandbox=process isolates nothing)")
    return EnvPool(lambda: make_sandbox(e.sandbox, limits=e.sandbox_limits, binds=binds), size=size,
                   prewarm=e.prewarm, max_failures=e.sandbox_max_failures, fix=fix)


class Leases(ABC):
    """`lease()` over a pool's acquire/release (EnvPool here; remote.RemoteEnvPool for sandboxes on
    other nodes)."""

    # Set once the pool has given up for good (EnvPool: max_failures in a row); the rollout worker
    # stops the run on it instead of failing episode after episode.
    failure: EnvPoolFailed | None = None
    metrics: PoolMetrics  # this side's counts (the run's summary.json reports them under env_pool)

    async def start(self) -> Leases:
        """Get ready to lease (EnvPool: pre-warm); returns self."""
        return self

    @abstractmethod
    async def acquire(self) -> Sandbox: ...

    @abstractmethod
    async def release(self, sb: Sandbox, *, broken: bool = False) -> None: ...

    async def close(self) -> None:  # noqa: B027 - a hook: not every side owns anything
        """Tear down what this side owns (EnvPool: every instance; remote.RemoteEnvPool: nothing, the
        driver owns and closes the env actors)."""

    @asynccontextmanager
    async def lease(self, cleanup: list[Callable[[Sandbox], Any]] | None = None) -> AsyncGenerator[Sandbox, None]:
        """`async with pool.lease() as sb:` an exception or cancellation inside marks the instance
        broken; `cleanup` hooks run before the release in every case (their errors are logged)."""
        sb = await self.acquire()
        broken = False
        try:
            yield sb
        except BaseException:
            broken = True
            raise
        finally:
            for hook in cleanup or []:
                try:
                    result = hook(sb)
                    if asyncio.iscoroutine(result):
                        await result
                except Exception as err:  # noqa: BLE001 - a failing hook must not leak the instance
                    log.warning("env pool: cleanup hook failed: %s", err)
                    broken = True
            await asyncio.shield(self.release(sb, broken=broken))


class EnvPool(Leases):
    def __init__(self, factory: Callable[[], PooledSandbox], *, size: int, prewarm: int | None = None,
                 health_timeout_s: float = 5.0, max_failures: int = 5,
                 prepare: Callable[[PooledSandbox], Awaitable[None]] | None = None, fix: str = GENERIC_FIX):
        """`factory` makes one sandbox (it runs in a worker thread); `prepare`, if given, lays out an
        instance's initial state once, before its snapshot is taken (reset restores that state).
        `max_failures`: failed creations or health checks in a row before the pool gives up; `fix`
        finishes its error (how to see the failure by hand, what to change)."""
        if size < 1:
            raise ValueError(f"EnvPool: size must be >= 1, got {size}")
        if max_failures < 1:
            raise ValueError(f"EnvPool: max_failures must be >= 1, got {max_failures}")
        self.factory = factory
        self.prepare = prepare
        self.size = size
        self.prewarm = size if prewarm is None else min(prewarm, size)
        self.health_timeout_s = health_timeout_s
        self.max_failures = max_failures
        self.fix = fix
        self.metrics = PoolMetrics()
        self._failures_in_a_row = 0
        self._idle: deque[PooledSandbox] = deque()
        self._all: dict[int, PooledSandbox] = {}  # every live instance: idle, leased or being reset
        self._creating = 0
        self._changed = asyncio.Condition()  # bound to the running loop when first waited on
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        _open_pools.add(self)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> EnvPool:
        """Pre-warm: create `prewarm` instances concurrently."""
        results = await asyncio.gather(*[self._create() for _ in range(self.prewarm)], return_exceptions=True)
        async with self._changed:
            self._idle.extend(r for r in results if not isinstance(r, BaseException))
            self._changed.notify_all()
        if self.failure is not None:
            raise self.failure
        if self.prewarm and not self._idle:
            raise SandboxError(f"env pool: could not create any of {self.prewarm} instances: {results[0]}")
        return self

    async def close(self) -> None:
        self._closed = True
        # Let in-flight resets and creations finish rather than cancel them: their work runs in
        # threads that a cancellation would not stop, and a reset finishing after the teardown would
        # bring a workdir back.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.destroy_all_now()

    def destroy_all_now(self) -> None:
        """Synchronous teardown of every instance (idle or leased); used by close() and at exit."""
        self._closed = True
        for sb in list(self._all.values()):
            self._destroy_sync(sb)
        self._idle.clear()
        _open_pools.discard(self)

    @property
    def live(self) -> int:
        return len(self._all) + self._creating

    @property
    def idle(self) -> int:
        return len(self._idle)

    # -- acquire / release --------------------------------------------------------------------------
    async def acquire(self) -> Sandbox:
        """A healthy instance. Raises EnvPoolFailed once the pool has given up (see the module doc)."""
        t0 = time.perf_counter()
        while True:
            sb = None
            async with self._changed:
                self._check_usable()
                while not self._idle and self.live >= self.size:
                    await self._changed.wait()
                    self._check_usable()
                if self._idle:
                    sb = self._idle.popleft()
                else:
                    self._creating += 1  # reserve the slot while it is created outside the lock
            if sb is None:
                try:
                    sb = await self._create(reserved=True)
                except SandboxError:
                    # Counted in _create; a short pause before the next try (the pool gives up after
                    # max_failures in a row, so this loop is bounded).
                    await asyncio.sleep(0.05 * self._failures_in_a_row)
                    continue
                break  # just made, and checked as it was made
            health = await self._healthy(sb)
            if health.ok:
                self._failures_in_a_row = 0
                break
            self.metrics.health_failures += 1
            log.warning("env pool: instance failed its health check (%s); replacing it", folded(health.detail, 200))
            await asyncio.to_thread(self._destroy_sync, sb)
            await self._failed("health check", health.detail)
            self._spawn_replacement()
        self.metrics.add_acquire(t0)
        return sb

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise SandboxError("env pool is closed")

    async def _failed(self, what: str, detail: str) -> None:
        """One more failure in a row; past max_failures the pool gives up and wakes every waiter."""
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.max_failures and self.failure is None:
            self.failure = EnvPoolFailed(f"sandbox error: {self._failures_in_a_row} sandboxes in a row failed "
                                         f"({what}): {folded(detail)}. Fix: {self.fix}")
            async with self._changed:
                self._changed.notify_all()

    async def release(self, sb: Sandbox, *, broken: bool = False) -> None:
        """Give an instance back: reset in the background, or destroyed and replaced if `broken`."""
        self.metrics.released += 1
        owned = self._all.get(id(sb))  # the pool's own instance (with snapshot and reset)
        if owned is None:
            return
        if self._closed:
            self._destroy_sync(owned)
            return
        if broken:
            self.metrics.kills += 1
            await asyncio.to_thread(self._destroy_sync, owned)
            self._spawn_replacement()
        else:
            self._spawn(self._reset(owned))

    # -- internals ----------------------------------------------------------------------------------
    async def _create(self, reserved: bool = False) -> PooledSandbox:
        """A new instance (prepared and snapshotted), or SandboxError; counted in metrics and in the
        failures in a row."""
        if not reserved:
            self._creating += 1
        try:
            try:
                sb = await asyncio.to_thread(self.factory)
            except (OSError, SandboxError) as err:
                self.metrics.create_failures += 1
                await self._failed("creating one", f"{type(err).__name__}: {err}")
                raise SandboxError(f"env pool: creating an instance failed: {err}") from err
            try:
                # Checked once when made, so that a backend that cannot run anything here is found
                # while the pool pre-warms, before the first rollout.
                health = await self._healthy(sb)
                if not health.ok:
                    raise SandboxError(health.detail)
                self._failures_in_a_row = 0
                if self.prepare is not None:
                    await self.prepare(sb)
                await asyncio.to_thread(sb.snapshot)
            except Exception as err:  # noqa: BLE001 - a bad instance is dropped, not handed out
                self.metrics.create_failures += 1
                await asyncio.to_thread(sb.close)
                await self._failed("starting one", health.detail or f"{type(err).__name__}: {err}")
                raise SandboxError(f"env pool: a new instance did not start: {err}") from err
            self._all[id(sb)] = sb
            self.metrics.created += 1
            return sb
        finally:
            self._creating -= 1
            async with self._changed:
                self._changed.notify_all()

    def _spawn_replacement(self) -> None:
        if self.failure is not None or self._closed:
            return  # a pool that gave up makes no more instances
        self._creating += 1  # counted now, so an acquire in between does not create one too
        self._spawn(self._replace())

    async def _replace(self) -> None:
        try:
            sb = await self._create(reserved=True)
        except SandboxError as err:
            log.warning("%s", err)
            return
        await self._make_idle(sb)

    async def _reset(self, sb: PooledSandbox) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(sb.reset)
        except Exception as err:  # noqa: BLE001 - an instance that cannot be reset is replaced
            self.metrics.reset_failures += 1
            log.warning("env pool: reset failed (%s); replacing the instance", err)
            await asyncio.to_thread(self._destroy_sync, sb)
            self._spawn_replacement()
            return
        dt = time.perf_counter() - t0
        self.metrics.resets += 1
        self.metrics.reset_s_total += dt
        self.metrics.reset_s_max = max(self.metrics.reset_s_max, dt)
        await self._make_idle(sb)

    async def _make_idle(self, sb: PooledSandbox) -> None:
        async with self._changed:
            if self._closed or id(sb) not in self._all:
                self._destroy_sync(sb)
            else:
                self._idle.append(sb)
            self._changed.notify_all()

    async def _healthy(self, sb: PooledSandbox) -> Health:
        try:
            return await sb.health(timeout=self.health_timeout_s)
        except Exception as err:  # noqa: BLE001 - any failure is unhealthy
            return Health(ok=False, detail=f"{type(err).__name__}: {err}")

    def _destroy_sync(self, sb: PooledSandbox) -> None:
        if self._all.pop(id(sb), None) is not None:
            self.metrics.destroyed += 1
        try:
            sb.close()
        except Exception as err:  # noqa: BLE001
            log.warning("env pool: closing an instance failed: %s", err)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
