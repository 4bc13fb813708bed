"""Pools of pre-warmed resources, handed out healthy and taken back clean: EnvPool (sandboxes) here, and the
browser pool (loomrl/env/browser/pool.py) on the same machinery (ResourcePool).

- Pre-warm: `start()` creates `prewarm` instances concurrently before the first rollout needs one.
- Acquire: an idle instance if there is one, else a new one while the pool is under `size`, else wait.
  Every instance gets a health check when it is made and before it is handed out from the idle ones;
  a failing one is destroyed and replaced.
- Bounded failure: after `max_failures` failed creations or health checks in a row (with no healthy
  instance in between) the pool gives up for good: every acquire, waiting or new, raises EnvPoolFailed
  with the resource's own error output (bwrap's message, say). Backing off and retrying forever would
  hang a run whose sandbox backend cannot work here; the rollout worker stops the run on it.
- Release: the instance is reset to its initial state (workdir snapshot restored, leftovers killed) in
  the background and only then becomes idle again, so the next acquire does not pay for the reset.
  An instance released as broken (a step or trajectory timeout, a crash) is destroyed, never reused,
  and a replacement is prepared in the background.
- `lease()`: acquire + release as an async context manager; an exception or cancellation inside it
  (the trajectory's deadline, say) releases the instance as broken, and cleanup hooks run either way.
  An acquire cancelled before it returns (the same deadline, or an env actor closing an episode whose reset is
  still leasing) loses nothing: an idle instance being checked goes back to the idle ones, a new one is torn down.
- Nothing is left behind: `close()` destroys every instance, and an atexit hook kills what pools still
  open at the interpreter's exit hold (Lifecycle.kill_now: no event loop is left to run anything).
Metrics: acquire wait, reset latency, health failures, creation failures, kills (broken releases).

What a pool holds is described by a Lifecycle: async create / health / prepare / reset / close, all on the
pool's event loop (a browser context cannot be driven from another thread), plus a synchronous kill for the
exit. Sandboxes, whose calls are blocking, are adapted by SandboxLifecycle (their calls run in threads).
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
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from loomrl.env.sandbox.base import Health, PooledSandbox, Sandbox, SandboxError
from loomrl.env.sandbox.factory import make_sandbox
from loomrl.errors import folded

if TYPE_CHECKING:
    from loomrl.config import EnvConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

_open_pools: weakref.WeakSet[ResourcePool] = weakref.WeakSet()


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
    """The pool gave up: its instances cannot be created, or fail a trivial health check."""


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


class Lifecycle(Protocol[T]):
    """How a pool makes, checks, resets and tears down its instances. Every method but kill_now runs on
    the pool's event loop; the pool bounds the waits it cannot leave to the instance (health, close)."""

    noun: str  # what an instance is called in errors: "sandbox", "browser tab"
    nouns: str  # and several: "sandboxes"

    async def create(self) -> T:
        """A new instance; raises SandboxError (or OSError) when one cannot be made (counted as a failure)."""
        ...

    async def health(self, item: T, timeout: float) -> Health:
        """Can it still do trivial work within `timeout`? Health, with its own error output when not."""
        ...

    async def prepare(self, item: T) -> None:
        """Once, after its first health check: lay out the initial state that reset() restores."""
        ...

    async def reset(self, item: T) -> None:
        """Back to that state between leases; raising makes the pool destroy and replace it."""
        ...

    async def close(self, item: T) -> None:
        """Tear it down (stop what it runs, remove its files)."""
        ...

    def kill_now(self, item: T) -> None:
        """The last resort at the interpreter's exit, when no event loop is left: kill, synchronously."""
        ...


class SandboxLifecycle:
    """Sandboxes as a Lifecycle[Sandbox]: their blocking calls (the factory, snapshot, reset, close) run in
    worker threads so that the pool's loop stays free. It keeps the PooledSandbox view of what it made (the
    pool hands instances out as plain Sandboxes, the interface environments use)."""

    noun, nouns = "sandbox", "sandboxes"

    def __init__(self, factory: Callable[[], PooledSandbox],
                 prepare: Callable[[PooledSandbox], Awaitable[None]] | None = None):
        self.factory = factory
        self.prepare_fn = prepare
        self._made: dict[int, PooledSandbox] = {}

    async def create(self) -> Sandbox:
        sb = await asyncio.to_thread(self.factory)
        self._made[id(sb)] = sb
        return sb

    async def health(self, item: Sandbox, timeout: float) -> Health:
        return await item.health(timeout=timeout)

    async def prepare(self, item: Sandbox) -> None:
        sb = self._made[id(item)]
        if self.prepare_fn is not None:
            await self.prepare_fn(sb)
        await asyncio.to_thread(sb.snapshot)

    async def reset(self, item: Sandbox) -> None:
        await asyncio.to_thread(self._made[id(item)].reset)

    async def close(self, item: Sandbox) -> None:
        await asyncio.to_thread(self.kill_now, item)

    def kill_now(self, item: Sandbox) -> None:
        self._made.pop(id(item), None)
        item.close()


class LeasePool(ABC, Generic[T]):
    """`lease()` over a pool's acquire/release, whatever it hands out."""

    # Set once the pool has given up for good (EnvPool: max_failures in a row); the rollout worker
    # stops the run on it instead of failing episode after episode.
    failure: EnvPoolFailed | None = None
    metrics: PoolMetrics  # this side's counts (the run's summary.json reports them under env_pool)

    async def start(self) -> Self:
        """Get ready to lease (EnvPool: pre-warm); returns self."""
        return self

    @abstractmethod
    async def acquire(self) -> T: ...

    @abstractmethod
    async def release(self, item: T, /, *, broken: bool = False) -> None: ...

    async def close(self) -> None:  # noqa: B027 - a hook: not every side owns anything
        """Tear down what this side owns (EnvPool: every instance; remote.RemoteEnvPool: nothing, the
        driver owns and closes the env actors)."""

    @asynccontextmanager
    async def lease(self, cleanup: list[Callable[[T], Any]] | None = None) -> AsyncGenerator[T, None]:
        """`async with pool.lease() as item:` an exception or cancellation inside marks the instance
        broken; `cleanup` hooks run before the release in every case (their errors are logged)."""
        item = await self.acquire()
        broken = False
        try:
            yield item
        except BaseException:
            broken = True
            raise
        finally:
            for hook in cleanup or []:
                try:
                    result = hook(item)
                    if asyncio.iscoroutine(result):
                        await result
                except Exception as err:  # noqa: BLE001 - a failing hook must not leak the instance
                    log.warning("env pool: cleanup hook failed: %s", err)
                    broken = True
            await asyncio.shield(self.release(item, broken=broken))


class Leases(LeasePool[Sandbox]):
    """Sandbox leases (EnvPool here; remote.RemoteEnvPool for sandboxes on other nodes)."""


class ResourcePool(LeasePool[T]):
    """The pool's machinery (see the module doc), over any Lifecycle."""

    def __init__(self, lifecycle: Lifecycle[T], *, size: int, prewarm: int | None = None,
                 health_timeout_s: float = 5.0, max_failures: int = 5, fix: str = GENERIC_FIX,
                 close_timeout_s: float = 30.0, metrics: PoolMetrics | None = None):
        """`max_failures`: failed creations or health checks in a row before the pool gives up; `fix`
        finishes its error (how to see the failure by hand, what to change); `close_timeout_s` bounds a
        teardown, past which the instance is killed (Lifecycle.kill_now); `metrics`: a PoolMetrics subclass
        with the lifecycle's own counts, if it keeps any."""
        if size < 1:
            raise ValueError(f"{type(self).__name__}: size must be >= 1, got {size}")
        if max_failures < 1:
            raise ValueError(f"{type(self).__name__}: max_failures must be >= 1, got {max_failures}")
        self.lifecycle = lifecycle
        self.size = size
        self.prewarm = size if prewarm is None else min(prewarm, size)
        self.health_timeout_s = health_timeout_s
        self.close_timeout_s = close_timeout_s
        self.max_failures = max_failures
        self.fix = fix
        self.metrics = metrics or PoolMetrics()
        self._failures_in_a_row = 0
        self._idle: deque[T] = deque()
        self._all: dict[int, T] = {}  # every live instance: idle, leased or being reset
        self._creating = 0
        self._changed = asyncio.Condition()  # bound to the running loop when first waited on
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        _open_pools.add(self)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> Self:
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
        # Let in-flight resets and creations finish rather than cancel them: a sandbox's work runs in
        # threads that a cancellation would not stop, and a reset finishing after the teardown would
        # bring a workdir back.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*[self._destroy(item) for item in list(self._all.values())])
        self.destroy_all_now()

    def destroy_all_now(self) -> None:
        """Synchronous kill of every instance (idle or leased); close() ends with it, and it runs at exit."""
        self._closed = True
        for key, item in list(self._all.items()):
            del self._all[key]
            self.metrics.destroyed += 1
            self._kill(item)
        self._idle.clear()
        _open_pools.discard(self)

    @property
    def live(self) -> int:
        return len(self._all) + self._creating

    @property
    def idle(self) -> int:
        return len(self._idle)

    # -- acquire / release --------------------------------------------------------------------------
    async def acquire(self) -> T:
        """A healthy instance. Raises EnvPoolFailed once the pool has given up (see the module doc)."""
        t0 = time.perf_counter()
        while True:
            item = None
            async with self._changed:
                self._check_usable()
                while not self._idle and self.live >= self.size:
                    await self._changed.wait()
                    self._check_usable()
                if self._idle:
                    item = self._idle.popleft()
                else:
                    self._creating += 1  # reserve the slot while it is created outside the lock
            if item is None:
                try:
                    item = await self._create(reserved=True)
                except SandboxError:
                    # Counted in _create; a short pause before the next try (the pool gives up after
                    # max_failures in a row, so this loop is bounded).
                    await asyncio.sleep(0.05 * self._failures_in_a_row)
                    continue
                break  # just made, and checked as it was made
            try:
                health = await self._healthy(item)
            except asyncio.CancelledError:  # the caller gave up while its instance was checked: not lost, idle again
                self._spawn(self._make_idle(item))
                raise
            if health.ok:
                self._failures_in_a_row = 0
                break
            self.metrics.health_failures += 1
            log.warning("env pool: %s failed its health check (%s); replacing it", self.lifecycle.noun,
                        folded(health.detail, 200))
            await self._destroy(item)
            await self._failed("health check", health.detail)
            self._spawn_replacement()
        self.metrics.add_acquire(t0)
        return item

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise SandboxError("env pool is closed")

    async def _failed(self, what: str, detail: str) -> None:
        """One more failure in a row; past max_failures the pool gives up and wakes every waiter."""
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.max_failures and self.failure is None:
            lc = self.lifecycle
            self.failure = EnvPoolFailed(f"{lc.noun} error: {self._failures_in_a_row} {lc.nouns} in a row failed "
                                         f"({what}): {folded(detail)}. Fix: {self.fix}")
            async with self._changed:
                self._changed.notify_all()

    async def release(self, item: T, /, *, broken: bool = False) -> None:
        """Give an instance back: reset in the background, or destroyed and replaced if `broken`."""
        self.metrics.released += 1
        owned = self._all.get(id(item))  # the pool's own instance (not one it already destroyed)
        if owned is None:
            return
        if self._closed:
            await self._destroy(owned)
            return
        if broken:
            self.metrics.kills += 1
            await self._destroy(owned)
            self._spawn_replacement()
        else:
            self._spawn(self._reset(owned))

    # -- internals ----------------------------------------------------------------------------------
    async def _create(self, reserved: bool = False) -> T:
        """A new instance (checked and prepared), or SandboxError; counted in metrics and in the
        failures in a row."""
        if not reserved:
            self._creating += 1
        try:
            try:
                item = await self.lifecycle.create()
            except (OSError, SandboxError) as err:
                self.metrics.create_failures += 1
                await self._failed("creating one", f"{type(err).__name__}: {err}")
                raise SandboxError(f"env pool: creating an instance failed: {err}") from err
            health = Health(ok=False)
            try:
                # Checked once when made, so that a backend that cannot run anything here is found
                # while the pool pre-warms, before the first rollout.
                health = await self._healthy(item)
                if not health.ok:
                    raise SandboxError(health.detail)
                self._failures_in_a_row = 0
                await self.lifecycle.prepare(item)
            except Exception as err:  # noqa: BLE001 - a bad instance is dropped, not handed out
                self.metrics.create_failures += 1
                await self._close(item)
                await self._failed("starting one", health.detail or f"{type(err).__name__}: {err}")
                raise SandboxError(f"env pool: a new instance did not start: {err}") from err
            except BaseException:  # cancelled while it was checked (its acquire gave up): torn down, not leaked
                self._spawn(self._close(item))
                raise
            self._all[id(item)] = item
            self.metrics.created += 1
            return item
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
            item = await self._create(reserved=True)
        except SandboxError as err:
            log.warning("%s", err)
            return
        await self._make_idle(item)

    async def _reset(self, item: T) -> None:
        t0 = time.perf_counter()
        try:
            await self.lifecycle.reset(item)
        except Exception as err:  # noqa: BLE001 - an instance that cannot be reset is replaced
            self.metrics.reset_failures += 1
            log.warning("env pool: reset failed (%s); replacing the %s", err, self.lifecycle.noun)
            await self._destroy(item)
            self._spawn_replacement()
            return
        dt = time.perf_counter() - t0
        self.metrics.resets += 1
        self.metrics.reset_s_total += dt
        self.metrics.reset_s_max = max(self.metrics.reset_s_max, dt)
        await self._make_idle(item)

    async def _make_idle(self, item: T) -> None:
        async with self._changed:
            keep = not self._closed and id(item) in self._all
            if keep:
                self._idle.append(item)
            self._changed.notify_all()
        if not keep:
            await self._destroy(item)

    async def _healthy(self, item: T) -> Health:
        try:
            return await asyncio.wait_for(self.lifecycle.health(item, self.health_timeout_s),
                                          self.health_timeout_s + 1.0)  # the pool's own bound on top of the check's
        except Exception as err:  # noqa: BLE001 - any failure is unhealthy
            return Health(ok=False, detail=f"{type(err).__name__}: {err}")

    async def _destroy(self, item: T) -> None:
        """Forget an instance and tear it down."""
        if self._all.pop(id(item), None) is not None:
            self.metrics.destroyed += 1
        await self._close(item)

    async def _close(self, item: T) -> None:
        """Lifecycle.close, bounded by close_timeout_s; killed when it fails or takes longer."""
        try:
            await asyncio.wait_for(self.lifecycle.close(item), self.close_timeout_s)
        except Exception as err:  # noqa: BLE001 - a teardown that fails still must not leak the instance
            log.warning("env pool: closing a %s failed (%s: %s); killing it", self.lifecycle.noun,
                        type(err).__name__, err)
            self._kill(item)

    def _kill(self, item: T) -> None:
        try:
            self.lifecycle.kill_now(item)
        except Exception as err:  # noqa: BLE001 - at exit, kill the rest
            log.warning("env pool: killing a %s failed: %s", self.lifecycle.noun, err)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class EnvPool(ResourcePool[Sandbox], Leases):
    """Pre-warmed sandboxes (see the module doc)."""

    def __init__(self, factory: Callable[[], PooledSandbox], *, size: int, prewarm: int | None = None,
                 health_timeout_s: float = 5.0, max_failures: int = 5,
                 prepare: Callable[[PooledSandbox], Awaitable[None]] | None = None, fix: str = GENERIC_FIX):
        """`factory` makes one sandbox (it runs in a worker thread); `prepare`, if given, lays out an
        instance's initial state once, before its snapshot is taken (reset restores that state).
        `max_failures`: failed creations or health checks in a row before the pool gives up; `fix`
        finishes its error (how to see the failure by hand, what to change)."""
        super().__init__(SandboxLifecycle(factory, prepare), size=size, prewarm=prewarm,
                         health_timeout_s=health_timeout_s, max_failures=max_failures, fix=fix)
