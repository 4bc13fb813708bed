"""EnvPool over real sandboxes (bwrap when installed, else the process backend): pre-warm, health
checks, reset to the snapshot, broken instances destroyed and replaced, waiting at capacity, cleanup."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from loomrl.env.pool import EnvPool, pool_size_for
from loomrl.env.sandbox import make_sandbox


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
            shutil.rmtree(victim.workdir)  # sabotage: the instance can no longer run anything in /work
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
    from loomrl.env.sandbox.base import SandboxError
    from loomrl.runtime.ray_actors import EnvActor

    cfg = RunConfig.model_validate({"env": {"name": "codefix", "pool_size": 2}, "output_dir": str(tmp_path)})

    async def scenario():
        actor = EnvActor(cfg.model_dump_json(), concurrency=2)
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
