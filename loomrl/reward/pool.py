"""RewardPool: scores finished trajectories off the rollout path, each call bounded by reward.timeout_s.

Rollouts hand a trajectory over and go on; the agent loop never waits on a verifier. The recipe's reward functions
(reward.function, reward.functions: a CombinedReward) run in reward worker processes (reward/workers.py: a hung one is
killed); an environment's own reward (loomrl's verifiers) runs on threads of this process. A reward function that
raises, returns what is not a reward, or runs past the timeout (or, on Ray, a reward actor that keeps dying) does not
crash the run: the trajectory is marked with the `reward_failed` component and the reason in its `error` (errors are
data), and training leaves it out (buffer/filters.py): a missing reward is not a zero reward. Nor is a trajectory
that could not be played out (types.UNSCORED: env_error, engine_error, timeout, aborted) scored at all.

With reward.judge an LLM judge grades each trajectory once the other components are in (_add_judge), before the total
(so that a term's gate may read `judge`): on this event loop, not
in the worker processes (it waits on HTTP, within its own limits and timeout: reward/judge_client.py). Its score is the
`judge` component; a judge with no reply makes the trajectory reward_failed, one whose reply has no score leaves it
without a `judge` component (or reward_failed, per reward.judge.on_parse_failure): never a 0.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from loomrl.config import ConfigError, RewardConfig
from loomrl.errors import with_frames
from loomrl.plugins import import_object
from loomrl.reward.composite import Composite
from loomrl.reward.judge import Judge, JudgeUnavailable
from loomrl.reward.terms import CombinedReward, NoOpinion, RewardTerm, reward_style
from loomrl.reward.workers import RewardError, RewardWorkers
from loomrl.types import REWARD_FAILED, UNSCORED, RewardFn, Task, Trajectory

log = logging.getLogger(__name__)


def mark_reward_failed(traj: Trajectory, why: str) -> Trajectory:
    traj.reward_components = {REWARD_FAILED: 0.0}
    traj.total_reward = 0.0
    traj.error = traj.error or f"reward failed: {why}"
    return traj


def import_reward(spec: str, field: str = "reward.function") -> RewardFn:
    """A reward function from "package.module:function" (loomrl/plugins.py: a ConfigError of one line on failure)."""
    return import_object(spec, field, f"{field}=my_rewards:score for a file my_rewards.py there defining "
                                      "score(trajectory, task) or score(prompts, completions, **kwargs)", "function")


def load_terms(reward: RewardConfig) -> list[RewardTerm]:
    """reward.functions (or reward.function alone), imported: a ConfigError of one line naming the one that fails."""
    single = reward.function
    specs = [(t.function, t.weight, t.name, f"reward.functions[{i}].function")
             for i, t in enumerate(reward.functions)]
    if not specs:
        if single is None:  # callers check first that the config names a reward function
            raise ConfigError("config error: reward.function or reward.functions: no reward function to load")
        specs = [(single, 1.0, None, "reward.function")]
    terms = []
    for spec, weight, name, field in specs:
        fn = import_reward(spec, field)
        try:
            style = reward_style(fn)
        except TypeError as err:
            raise ConfigError(f"config error: {field}: {spec}: {err}") from None
        terms.append(RewardTerm(name=name or getattr(fn, "__name__", spec.rpartition(":")[2]), spec=spec, fn=fn,
                                weight=weight, style=style))
    names = [t.name for t in terms if t.trl]
    if len(names) != len(set(names)):
        raise ConfigError(f"config error: reward.functions: two TRL-style functions named {names}; give each a name")
    return terms


class Scorer(Protocol):
    """What a rollout worker scores trajectories on: a RewardPool in its process, or reward/actor.py's
    RemoteRewardPool over the reward actors."""

    async def score(self, traj: Trajectory, task: Task) -> Trajectory: ...

    def metrics(self) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


class RewardPool:
    """Scores trajectories, `workers` at a time, each call bounded by `timeout_s`. A CombinedReward (the recipe's
    functions) runs in `workers` reward worker processes (reward/workers.py: past the timeout the worker is killed and
    replaced). A plain RewardFn (an environment's own reward) runs on `workers` threads: Python cannot stop a thread,
    so a call past its timeout marks its trajectory reward_failed at once and is abandoned, and the pool goes on with
    fresh threads (a new executor); each abandoned thread is counted (`hung`) and ends when its function returns."""

    def __init__(self, fn: RewardFn | CombinedReward, workers: int = 2, timeout_s: float | None = None,
                 composite: Composite | None = None, judge: Judge | None = None):
        """`composite`: reward.terms (weights, gates, the built-in process terms); default: every component counts
        with weight 1 (a reward function's own weight apart). `judge`: reward.judge, graded after the other
        components (_add_judge)."""
        self.fn = fn
        self.composite = composite or Composite()
        self.judge = judge
        self.workers = workers
        self.timeout_s = timeout_s
        self._executor = self._new_executor()
        # the recipe's functions and the worker processes that run them
        self._combined = (fn, RewardWorkers(fn.terms, workers, timeout_s, fn.max_steps)) \
            if isinstance(fn, CombinedReward) else None
        self.failed = 0
        self.hung = 0

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="loomrl-reward")

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        if traj.status in UNSCORED:  # not played out: no reward at all (stored as null, never trained)
            return traj
        got = await self._components(traj, task)
        if got is None:  # marked reward_failed
            return traj
        components, weights = got
        if self.judge is not None and self.judge.wants(task):
            if not await self._add_judge(self.judge, traj, task, components, weights):
                return traj
        return self.composite.score(traj, components, weights)

    async def _components(self, traj: Trajectory, task: Task) -> tuple[dict[str, float], dict[str, float]] | None:
        """The reward's components and each one's weight where it has one (a reward function's); None when the
        trajectory could not be scored (then it is marked reward_failed)."""
        if self._combined is not None:
            return await self._from_workers(*self._combined, traj, task)
        fn = self.fn
        if isinstance(fn, CombinedReward):  # _combined is set for one: __init__
            raise RuntimeError("a CombinedReward is scored in its worker processes, not on a thread")
        call = asyncio.get_running_loop().run_in_executor(self._executor, fn, traj, task)
        try:
            return await asyncio.wait_for(call, self.timeout_s), {}
        except TimeoutError:
            self.failed += 1
            self.hung += 1
            self._executor.shutdown(wait=False)  # its hung thread is abandoned; later calls get fresh ones
            self._executor = self._new_executor()
            log.warning("the reward ran past reward.timeout_s=%gs; its trajectory is reward_failed (%d abandoned "
                        "reward thread(s) so far)", self.timeout_s, self.hung)
            mark_reward_failed(traj, f"the reward ran past reward.timeout_s={self.timeout_s:g}s")
        except Exception as err:  # noqa: BLE001 - errors are data: a missing reward is not a zero reward
            self.failed += 1
            mark_reward_failed(traj, with_frames(f"{type(err).__name__}: {err}", err))
        return None

    async def _from_workers(self, fn: CombinedReward, processes: RewardWorkers, traj: Trajectory,
                            task: Task) -> tuple[dict[str, float], dict[str, float]] | None:
        if fn.keep_reported and traj.reward_components:  # a black-box agent's own reward (agent.reward_from_agent)
            return dict(traj.reward_components), {}
        # the thread only waits on a worker's pipe, never longer than the timeout per function
        call = asyncio.get_running_loop().run_in_executor(self._executor, processes.evaluate, traj, task)
        try:
            return fn.combine(await call)
        except (RewardError, NoOpinion) as err:
            self.failed += 1
            mark_reward_failed(traj, str(err))
        except Exception as err:  # noqa: BLE001 - errors are data: a missing reward is not a zero reward
            self.failed += 1
            mark_reward_failed(traj, f"{type(err).__name__}: {err}")
        return None

    async def _add_judge(self, judge: Judge, traj: Trajectory, task: Task, components: dict[str, float],
                         weights: dict[str, float]) -> bool:
        """The judge's normalised score as the `judge` component (weight reward.judge.weight, and its reward.terms
        entry's on top), before the total, so that other terms' gates may read it. No reply: reward_failed. A reply
        without a score: no `judge` component and the reply in `error` (or reward_failed, per
        reward.judge.on_parse_failure). Never a 0 for a judgement that did not happen. False when marked failed."""
        try:
            verdict = await judge.grade(traj, task)
        except JudgeUnavailable as err:
            self.failed += 1
            mark_reward_failed(traj, f"judge: {err}")
            return False
        except Exception as err:  # noqa: BLE001 - errors are data: a missing grade is not a zero grade
            self.failed += 1
            mark_reward_failed(traj, f"judge: {type(err).__name__}: {err}")
            return False
        if verdict.score is None:
            note = f"judge: no score in its reply ({verdict.why}): {verdict.reply[:300]!r}"
            if judge.cfg.on_parse_failure == "reward_failed":
                self.failed += 1
                mark_reward_failed(traj, note)
                return False
            traj.error = f"{traj.error}; {note}" if traj.error else note
            return True
        components["judge"] = verdict.score
        weights["judge"] = judge.cfg.weight
        return True

    def metrics(self) -> dict[str, float]:
        """The judge's counters so far (judge/<name>: reward/judge_client.py JudgeMetrics); {} without a judge."""
        return self.judge.metrics.as_dict() if self.judge is not None else {}

    @property
    def restarts(self) -> int:
        """Reward worker processes killed (past the timeout) or found dead, and replaced."""
        return self._combined[1].restarts if self._combined is not None else 0

    async def aclose(self) -> None:
        """close(), and the judge's connections first (they belong to the running loop)."""
        if self.judge is not None:
            await self.judge.aclose()
        self.close()

    def close(self) -> None:
        if self._combined is not None:
            self._combined[1].close()
        self._executor.shutdown(wait=self.hung == 0)  # never wait on an abandoned thread
