"""EnvPool over real sandboxes (bwrap when installed, else the process backend): pre-warm, health
checks, reset to the snapshot, broken instances destroyed and replaced, waiting at capacity, cleanup."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.env.pool import EnvPool, EnvPoolFailed, ResourcePool, pool_size_for
from loomrl.env.sandbox import SandboxError, make_sandbox
from loomrl.env.sandbox.base import Health
from loomrl.env.sandbox.bwrap import bwrap_available
from loomrl.env.sandbox.quota import unmount

# integration: each test starts a pool of sandbox processes (make test-fast leaves them out; make test runs them)
pytestmark = pytest.mark.integration


async def _prepare(sb):
    sb.write_file("repo/main.py", "print('v1')\n")


def _pool(size=2, **kw) -> EnvPool:
    return EnvPool(lambda: make_sandbox("auto"), size=size, prepare=_prepare, **kw)


def test_prewarm_reset_and_reuse():
    async def go():
        pool = await _pool(size=2).start()
        try:
            assert pool.metrics.created == 2 and pool.idle == 2
            sb = await pool.acquire()
            res = await sb.exec([sb.python, "-c", "open('repo/main.py','w').write('broken'); open('junk','w').write('x')"],
                                timeout=10)
            assert res.returncode == 0, res.stderr
            await pool.release(sb)
            for _ in range(50):  # the reset runs in the background
                if pool.idle == 2:
                    break
                await asyncio.sleep(0.02)
            assert pool.metrics.resets == 1 and pool.metrics.reset_s_max > 0
            again = [await pool.acquire(), await pool.acquire()]
            assert sb in again  # reused after its reset ...
            assert sb.read_file("repo/main.py") == "print('v1')\n"  # ... in its initial state
            assert not (sb.workdir / "junk").exists()
            assert pool.metrics.created == 2  # nothing new was made
        finally:
            await pool.close()

    asyncio.run(go())


def test_broken_instance_is_destroyed_and_replaced():
    async def go():
        pool = await _pool(size=1).start()
        try:
            sb = await pool.acquire()
            workdir = sb.workdir
            await pool.release(sb, broken=True)
            fresh = await pool.acquire()
            assert fresh is not sb and not workdir.exists()
            assert fresh.read_file("repo/main.py") == "print('v1')\n"
            assert pool.metrics.kills == 1 and pool.metrics.created == 2 and pool.metrics.destroyed == 1
        finally:
            await pool.close()

    asyncio.run(go())


def test_unhealthy_instance_is_replaced_before_hand_out():
    async def go():
        pool = await _pool(size=1).start()
        try:
            victim = pool._idle[0]
            # sabotage: the instance can no longer run anything in /work (a bwrap workdir is the mount point of
            # its disk quota: unmounted first)
            unmount(victim.workdir)
            shutil.rmtree(victim.workdir)
            sb = await pool.acquire()
            assert sb is not victim and pool.metrics.health_failures == 1
            assert (await sb.exec(["/usr/bin/echo", "fine"], timeout=10)).stdout.strip() == "fine"
        finally:
            await pool.close()

    asyncio.run(go())


def test_acquire_waits_at_capacity_and_lease_marks_errors_broken():
    async def go():
        pool = await _pool(size=1).start()
        hooks = []
        try:
            first = await pool.acquire()

            async def later():
                await asyncio.sleep(0.2)
                await pool.release(first)

            waiter = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # nothing idle and the pool is at its size
            await later()
            second = await waiter
            assert second is first and pool.metrics.acquire_wait_s_max >= 0.1
            await pool.release(second)

            with pytest.raises(TimeoutError):
                async with pool.lease(cleanup=[lambda sb: hooks.append(sb.workdir)]) as leased:
                    await asyncio.wait_for(leased.exec(["/usr/bin/sleep", "30"], timeout=60), 0.2)
            assert hooks and pool.metrics.kills == 1  # the deadline made it broken; the hook still ran
            assert not hooks[0].exists()
        finally:
            await pool.close()

    asyncio.run(go())


def test_close_leaves_nothing_behind():
    async def go():
        pool = await _pool(size=3).start()
        leased = await pool.acquire()
        dirs = [sb.workdir for sb in pool._all.values()]
        assert len(dirs) == 3
        await pool.close()
        assert not any(d.exists() for d in dirs) and leased.closed

    asyncio.run(go())


def test_pool_size_for_concurrency():
    assert pool_size_for(8) == 10 and pool_size_for(1) == 2
    with pytest.raises(ValueError, match="concurrency"):
        pool_size_for(0)


def test_process_backend_runs_in_its_workdir():
    async def go():
        sb = make_sandbox("process")
        try:
            res = await sb.exec(["pwd"], timeout=10)
            return res.stdout.strip(), str(sb.workdir)
        finally:
            sb.close()

    cwd, workdir = asyncio.run(go())
    assert cwd == workdir


def test_env_actor_leases_of_a_dead_owner_or_a_cancelled_acquire_are_reclaimed(tmp_path):
    """The Ray env actor's lease table, run in-process (a plain class; its Ray wrapping is not needed
    to test the bookkeeping): a rollout actor that died has its sandboxes destroyed and replaced
    (release_owner), may lease no more, and a lease given up before its acquire finished (a cancelled
    caller) is released as soon as the acquire completes, so the pool never shrinks."""
    import asyncio

    from loomrl.config import RunConfig
    from loomrl.env.remote import EnvActor
    from loomrl.env.sandbox.base import SandboxError

    cfg = RunConfig.model_validate({"env": {"name": "codefix", "pool_size": 2}, "output_dir": str(tmp_path)})

    async def scenario():
        actor = EnvActor(cfg.env.model_dump_json(), concurrency=2, agent_kind=cfg.agent.kind)
        await actor.start()
        await actor.acquire("rollout-1", "a1")
        await actor.acquire("rollout-2", "b1")
        await actor.write_file("a1", "x.txt", "from rollout-1")
        # the pool is full: this acquire waits; its caller gives up (release before acquire returns)
        waiting = asyncio.ensure_future(actor.acquire("rollout-2", "b2"))
        await asyncio.sleep(0.2)
        await actor.release("b2")
        assert await actor.release_owner("rollout-1") == 1  # rollout-1 died holding a1
        with pytest.raises(SandboxError, match="given up"):
            await waiting  # got a1's replacement, released it at once
        with pytest.raises(SandboxError, match="rollout-1 is gone"):
            await actor.acquire("rollout-1", "a2")
        with pytest.raises(SandboxError, match="no sandbox under lease a1"):
            await actor.read_file("a1", "x.txt")
        info = await asyncio.wait_for(actor.acquire("rollout-2", "b3"), timeout=30)  # nothing leaked
        assert info["lease"] == "b3" and set(actor.leases) == {"b1", "b3"}
        metrics = await actor.close()
        assert metrics["kills"] == 1 and metrics["created"] == metrics["destroyed"] == 3

    asyncio.run(scenario())


# -- bounded failure (a sandbox backend that cannot work here must not hang the run) ----------------

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not installed (make test installs it)")


class _Gated:
    """A Lifecycle of plain objects whose health check waits until `healthy` is set, so that an acquire can be cancelled
    while its instance is checked, every time (a real sandbox's check is over too soon to land in reliably)."""

    noun, nouns = "thing", "things"

    def __init__(self):
        self.healthy = asyncio.Event()
        self.closed: list[object] = []

    async def create(self) -> object:
        return object()

    async def health(self, item, timeout):
        await self.healthy.wait()
        return Health(ok=True)

    async def prepare(self, item) -> None:
        pass

    async def reset(self, item) -> None:
        pass

    async def close(self, item) -> None:
        self.closed.append(item)

    def kill_now(self, item) -> None:
        pass


def test_an_acquire_cancelled_while_its_instance_is_checked_loses_nothing():
    """What an episode whose reset is cancelled mid-lease (its deadline; an env actor closing it) must not do: leave
    the pool one instance short for good. A new instance is torn down; an idle one goes back to the idle ones."""

    async def cancelled_acquire(pool) -> None:
        acquire = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.05)  # in the health check now
        acquire.cancel()
        await asyncio.gather(acquire, return_exceptions=True)
        await asyncio.sleep(0.05)  # the background work it left

    async def go():
        lifecycle = _Gated()
        pool = await ResourcePool(lifecycle, size=1, prewarm=0).start()
        await cancelled_acquire(pool)  # a new instance
        assert pool.live == 0 and len(lifecycle.closed) == 1
        lifecycle.healthy.set()
        item = await pool.acquire()
        await pool.release(item)
        await asyncio.sleep(0.05)  # its reset, in the background
        lifecycle.healthy.clear()
        await cancelled_acquire(pool)  # an idle instance
        assert pool.idle == 1 and pool.live == 1
        lifecycle.healthy.set()
        assert await pool.acquire() is item
        await pool.close()

    asyncio.run(go())


@needs_bwrap
def test_every_creation_failing_ends_within_seconds_with_the_cause():
    """A bind source that does not exist: every creation fails; pre-warm gives up after max_failures
    with the sandbox's own error, and so does an acquire on a pool that pre-warms nothing."""
    factory = lambda: make_sandbox("bwrap", binds={"/nonexistent-loomrl/site": "/opt/site"})  # noqa: E731

    async def go():
        t0 = time.perf_counter()
        with pytest.raises(EnvPoolFailed) as prewarmed:
            await EnvPool(factory, size=6, max_failures=3).start()
        lazy = await EnvPool(factory, size=2, prewarm=0, max_failures=3).start()
        waiters = [asyncio.ensure_future(lazy.acquire()) for _ in range(3)]
        errors = await asyncio.gather(*waiters, return_exceptions=True)
        with pytest.raises(EnvPoolFailed):
            await lazy.acquire()  # gave up for good: at once, no more tries
        await lazy.close()
        return time.perf_counter() - t0, prewarmed.value, errors, lazy

    wall, prewarmed, errors, lazy = asyncio.run(go())
    assert wall < 10
    for err in [prewarmed, *errors]:
        assert isinstance(err, EnvPoolFailed), err
        assert "sandboxes in a row failed" in str(err) and "/nonexistent-loomrl/site" in str(err)
        assert "does not exist" in str(err) and "env.sandbox" in str(err)  # the cause and the fix
    assert lazy.metrics.create_failures == 3 and lazy.failure is errors[0]


@needs_bwrap
def test_every_health_check_failing_ends_within_seconds_with_the_sandboxes_own_stderr():
    """1 MB of address space: the sandboxed `echo` cannot even load libc. The pool gives up with the
    loader's own message, both while pre-warming and in an acquire waiting at capacity when the
    instance it waits for is replaced by broken ones."""
    broken = lambda: make_sandbox("bwrap", limits={"address_space_mb": 1})  # noqa: E731

    async def go():
        t0 = time.perf_counter()
        with pytest.raises(EnvPoolFailed) as prewarmed:
            await EnvPool(broken, size=4, max_failures=3).start()
        made = iter([lambda: make_sandbox("bwrap"), broken, broken, broken, broken])
        pool = await EnvPool(lambda: next(made)(), size=1, max_failures=3).start()
        first = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())  # waits: the pool is at its size
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await pool.release(first, broken=True)  # its replacements cannot start
        with pytest.raises(EnvPoolFailed) as waited:
            await asyncio.wait_for(waiter, 30)
        await pool.close()
        return time.perf_counter() - t0, prewarmed.value, waited.value, pool

    wall, prewarmed, waited, pool = asyncio.run(go())
    assert wall < 15
    for err in (prewarmed, waited):
        assert "3 sandboxes in a row failed" in str(err) and "failed to map segment" in str(err), err
    assert pool.metrics.create_failures == 3 and pool.live == 0


def test_a_healthy_instance_resets_the_failure_count():
    """Failures only count in a row: a flaky backend whose failures are separated by healthy
    instances never trips the pool."""
    flaky = itertools.cycle([True, False, False])  # two failures in a row at most

    def factory():
        if not next(flaky):
            raise SandboxError("flaky backend")
        return make_sandbox("auto")

    async def go():
        pool = await EnvPool(factory, size=1, prewarm=0, max_failures=3).start()
        for _ in range(4):
            sb = await pool.acquire()
            await pool.release(sb, broken=True)
            await asyncio.sleep(0.05)  # the replacement fails in the background (counted too)
        await pool.close()
        return pool

    pool = asyncio.run(go())
    assert pool.failure is None and pool.metrics.create_failures >= 6 and pool.metrics.acquired == 4


@needs_bwrap
def test_a_health_check_cancelled_mid_flight_leaves_no_process():
    """The leak seen after full test runs: an orphaned `bwrap ... echo loomrl-ok`. Cancelled at many
    points (while the process is being started, while it runs), nothing of it may survive."""

    async def go():
        sandboxes = []
        for delay in [0, 0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.03]:
            sb = make_sandbox("bwrap")
            sandboxes.append(sb)
            check = asyncio.ensure_future(sb.health(timeout=5))
            await asyncio.sleep(delay)
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
        await asyncio.sleep(0.3)  # a start that was under way when cancelled finishes (and is killed)
        for sb in sandboxes:
            sb.close()
        return [str(sb.workdir) for sb in sandboxes]

    workdirs = asyncio.run(go())
    time.sleep(0.2)
    assert not processes_mentioning(workdirs)


@needs_bwrap
def test_a_sandbox_dies_with_the_process_that_started_it(tmp_path):
    """SIGKILL of the process that owns a pool (a rollout worker killed by the OOM killer, say): the
    command running in its sandbox goes too (bwrap gets SIGKILL as its parent dies)."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio, sys\n"
        "from loomrl.env.sandbox import make_sandbox\n"
        "async def main():\n"
        "    sb = make_sandbox('bwrap')\n"
        "    print(sb.workdir, flush=True)\n"
        "    await sb.exec(['/usr/bin/sleep', '120'], timeout=300)\n"
        "asyncio.run(main())\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workdir = owner.stdout.readline().strip()
    def started() -> bool:  # setpriv has set the death signal and exec'd bwrap, whose child is up
        return len([c for c in processes_mentioning([workdir]) if c.startswith("bwrap ")]) == 2

    for _ in range(200):
        if started():
            break
        time.sleep(0.05)
    assert started(), "the sandboxed command did not start"
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    for _ in range(100):
        if not processes_mentioning([workdir]):
            break
        time.sleep(0.05)
    assert not processes_mentioning([workdir])
    shutil.rmtree(Path(workdir).parent, ignore_errors=True)


def processes_mentioning(needles: list[str]) -> list[str]:
    """Command lines of live processes that contain one of `needles` (a sandbox's workdir is unique)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(n in cmdline for n in needles):
            found.append(cmdline)
    return found
