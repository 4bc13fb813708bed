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
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from loomrl.config import ConfigError
from loomrl.types import REWARD_FAILED, UNSCORED, RewardFn, Task, Trajectory


def mark_reward_failed(traj: Trajectory, why: str) -> Trajectory:
    traj.reward_components = {REWARD_FAILED: 0.0}
    traj.total_reward = 0.0
    traj.error = traj.error or f"reward failed: {why}"
    return traj


def _on_sys_path(folder: str) -> None:
    """Put `folder` on sys.path (last: a file there never shadows an installed module) unless it is there.
    `python -m loomrl` has the current directory on sys.path already, the `loomrl` console script does not."""
    if folder not in {os.path.abspath(p) for p in sys.path}:
        sys.path.append(folder)


def import_reward(spec: str) -> RewardFn:
    """Load a reward function from "package.module:function", looked up on sys.path with the current directory
    and PYTHONPATH on it; every failure is a ConfigError of one line saying what failed and where it looked."""
    cwd = os.getcwd()
    _on_sys_path(cwd)
    module_name, _, attr = spec.partition(":")
    looked = (f"modules are imported with the current directory ({cwd}) and PYTHONPATH "
              f"({os.environ.get('PYTHONPATH') or 'unset'}) on sys.path; give package.module:function, e.g. "
              f"reward.function=my_rewards:score for a file my_rewards.py there defining score(trajectory, task)")
    if not module_name or not attr:
        raise ConfigError(f"config error: reward.function: expected 'package.module:function', got {spec!r}; {looked}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise ConfigError(f"config error: reward.function={spec}: no module named {err.name!r}; {looked}") from None
        raise ConfigError(f"config error: reward.function={spec}: importing {module_name!r} failed: {err} (an import "
                          f"inside it; install that package)") from None
    except Exception as err:  # its own code failed (a SyntaxError, an exception at import time)
        raise ConfigError(f"config error: reward.function={spec}: importing {module_name!r} raised "
                          f"{type(err).__name__}: {' | '.join(str(err).splitlines())}") from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        where = module.__spec__.origin if module.__spec__ and module.__spec__.origin else "a namespace package"
        raise ConfigError(f"config error: reward.function={spec}: module {module_name!r} ({where}) has no "
                          f"attribute {attr!r}; {looked}") from None
    if not callable(fn):
        raise ConfigError(f"config error: reward.function={spec}: {attr!r} in {module_name!r} is not callable")
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
