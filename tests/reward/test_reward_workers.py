"""Reward worker processes (loomrl/reward/workers.py): a reward function that raises, returns what is not a reward,
hangs (in Python, or in C holding the GIL), or kills its process fails its trajectory alone, with the reason and the
function's name, within reward.timeout_s; the same pool then scores the next trajectory; and what a call costs."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from loomrl.config import load_config
from loomrl.reward.pool import RewardPool
from loomrl.rollout.worker import reward_fn_for
from loomrl.types import RolloutStatus, Task, TokenSpan, Trajectory, Turn

# integration: each test starts reward worker processes (make test-fast leaves them out; make test runs them)
pytestmark = pytest.mark.integration

M = "trl_rewards_for_tests"
TASK = Task(task_id="t", prompt="q", answer="42")


def _traj(tokens: int = 4) -> Trajectory:
    turn = Turn(act="The answer is 42.", act_span=TokenSpan(start=2, end=tokens), logprobs=[0.0] * (tokens - 2),
                versions=[0] * (tokens - 2))
    return Trajectory(task_id="t", trajectory_id="tr", group_id="g", token_ids=list(range(tokens)), turns=[turn],
                      status=RolloutStatus.COMPLETED)


def _pool(*functions: str, timeout_s: float = 30.0, workers: int = 1) -> RewardPool:
    terms = ", ".join(f"{{function: {M}:{f}}}" for f in functions)
    cfg = load_config(None, [f"reward.functions=[{terms}]", f"reward.timeout_s={timeout_s}"])
    return RewardPool(reward_fn_for(cfg.rollout_pool()), workers=workers, timeout_s=timeout_s)


def _score(pool: RewardPool, traj: Trajectory, task: Task = TASK) -> tuple[Trajectory, float]:
    t0 = time.perf_counter()
    out = asyncio.run(pool.score(traj, task))
    return out, time.perf_counter() - t0


@pytest.mark.parametrize(("function", "error"), [
    ("raises", "reward failed: raises raised ValueError: the judge is down"),
    ("too_many", "reward failed: too_many returned a list of 2; a TRL-style reward function returns one value per "
                 "completion (a list of 1 here)"),
    ("not_a_list", "reward failed: not_a_list returned float; a TRL-style reward function returns one value per "
                   "completion (a list of 1 here)"),
    ("says_one", "reward failed: says_one returned str '1.0' for says_one, not a number"),
])
def test_a_function_that_raises_or_returns_no_reward_fails_its_trajectory_alone(function, error):
    pool = _pool("exact_answer", function)
    try:
        failed, _ = _score(pool, _traj())
        assert failed.reward_failed and not failed.scored and failed.error.splitlines()[0] == error
        if function == "raises":  # where it was raised: the traceback's last frames, the function's own last
            assert failed.error.splitlines()[-1].startswith("  at trl_rewards_for_tests.py:"), failed.error
        assert pool.failed == 1 and pool.restarts == 0  # the worker lives on
    finally:
        pool.close()


@pytest.mark.parametrize("function", ["hangs", "backtracks"])
def test_a_hung_function_fails_within_its_timeout_and_the_same_pool_scores_the_next(function):
    """`hangs` sleeps; `backtracks` runs a catastrophic regex, C code holding the GIL, that a thread's timeout cannot
    even interrupt (workers.py's doc: 14 s for a 0.5 s timeout). Both are killed at 0.5 s."""
    pool = _pool("exact_answer", function, timeout_s=0.5)
    try:
        hung, took = _score(pool, _traj(), Task(task_id="t", prompt="q", answer="42", data={"hang": True}))
        assert hung.reward_failed and hung.error == (f"reward failed: {function} ran past reward.timeout_s=0.5s (its "
                                                     "worker process was killed and is replaced)")
        assert took < 0.5 + 1.0, took  # the first call starts the worker too (0.1 s) before its clock runs
        assert pool.restarts == 1
        # the pool's one worker was killed: the next trajectory gets a fresh one
        scored, took = _score(pool, _traj(), Task(task_id="t", prompt="q", answer="42", data={"hang": False}))
        assert scored.reward_components == {"exact_answer": 1.0, function: 1.0} and took < 1.5, took
    finally:
        pool.close()


def test_a_function_that_kills_its_process_fails_its_trajectory_and_the_next_is_scored():
    pool = _pool("exits")
    try:
        died, _ = _score(pool, _traj())
        assert died.reward_failed and died.error == "reward failed: exits: its reward worker process died (exit code 3)"
        again, _ = _score(pool, _traj())
        assert again.reward_failed and pool.restarts == 2  # a fresh worker each time
    finally:
        pool.close()


def test_close_ends_a_worker_that_is_still_running_a_function():
    pool = _pool("hangs", timeout_s=60, workers=1)
    processes = pool._combined[1]

    async def start_and_close():
        call = asyncio.ensure_future(pool.score(_traj(), TASK))
        while not processes._all:  # its worker started
            await asyncio.sleep(0.05)
        (worker,) = processes._all
        await asyncio.sleep(0.3)  # in the function
        t0 = time.perf_counter()
        pool.close()
        out = await call
        return worker, out, time.perf_counter() - t0

    worker, out, took = asyncio.run(start_and_close())
    assert worker.proc.poll() is not None and took < 2.0  # killed, not waited on for 60 s
    assert out.reward_failed


def test_what_a_call_in_a_worker_process_costs():
    """A 2,000-token trajectory scored by one TRL-style function, in a worker process and on a thread of this process
    (the same function, called in place): the difference is what isolation costs per call (0.2 ms measured here)."""
    from loomrl.reward.terms import evaluate

    traj = _traj(tokens=2000)
    pool = _pool("length_penalty")
    combined = pool._combined[0]
    in_thread = RewardPool(lambda t, task: combined.combine([evaluate(combined.terms[0], t, task)])[0], workers=1)

    def per_call(p: RewardPool, n: int = 200) -> float:
        async def go():
            for _ in range(n):
                await p.score(traj, TASK)
        asyncio.run(go())  # warm: the worker started
        t0 = time.perf_counter()
        asyncio.run(go())
        return (time.perf_counter() - t0) / n

    try:
        t0 = time.perf_counter()
        fresh = _pool("length_penalty")
        _score(fresh, _traj())
        start = time.perf_counter() - t0
        fresh.close()
        process, thread = per_call(pool), per_call(in_thread)
    finally:
        pool.close()
        in_thread.close()
    print(f"reward call: {process * 1e3:.2f} ms in a worker process, {thread * 1e3:.2f} ms on a thread; a worker "
          f"starts in {start:.2f} s (pid {os.getpid()})")
    assert process - thread < 0.02 and start < 5.0
