"""RewardPool: scores finished trajectories on worker threads, off the rollout path.

Rollouts hand a trajectory over and go on; the agent loop never waits on a verifier. A reward
function that raises (or, on Ray, a reward actor that keeps dying) does not crash the run: the
trajectory is marked with the `reward_failed` component and the reason in its `error` (errors are
data), and training leaves it out (buffer/filters.py): a missing reward is not a zero reward. Nor is a trajectory
that could not be played out (types.UNSCORED: env_error, engine_error, timeout, aborted) scored at all.
"""

from __future__ import annotations

import asyncio
import importlib
from concurrent.futures import ThreadPoolExecutor

from loomrl.config import ConfigError
from loomrl.types import REWARD_FAILED, UNSCORED, RewardFn, Task, Trajectory


def mark_reward_failed(traj: Trajectory, why: str) -> Trajectory:
    traj.reward_components = {REWARD_FAILED: 0.0}
    traj.total_reward = 0.0
    traj.error = traj.error or f"reward failed: {why}"
    return traj


def import_reward(spec: str) -> RewardFn:
    """Load a reward function from "package.module:function"."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"config error: reward.function: expected 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"config error: reward.function: cannot import {spec!r}: {err}") from err
    if not callable(fn):
        raise ConfigError(f"config error: reward.function: {spec!r} is not callable")
    return fn


class RewardPool:
    def __init__(self, fn: RewardFn, workers: int = 2):
        self.fn = fn
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loomrl-reward")
        self.failed = 0

    def _score(self, traj: Trajectory, task: Task) -> Trajectory:
        if traj.status in UNSCORED:  # not played out: no reward at all (stored as null, never trained)
            return traj
        try:
            components = self.fn(traj, task)
        except Exception as err:  # noqa: BLE001
            self.failed += 1
            return mark_reward_failed(traj, f"{type(err).__name__}: {err}")
        traj.reward_components = components
        traj.total_reward = float(sum(components.values()))
        return traj

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._score, traj, task)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
