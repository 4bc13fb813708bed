"""Reward actors (ray.reward.count > 0): the run's reward pool in an actor of its own, which rollout actors score on
through reward/actor.py RemoteRewardPool. Here, beside the rollout worker, because the pool is the run's (its reward,
terms and judge: rollout/worker.py reward_pool_for), which the environment's reward is part of."""

from __future__ import annotations

from loomrl.actor_support import Placed
from loomrl.config import RolloutPoolConfig
from loomrl.rollout.worker import reward_pool_for
from loomrl.types import Task, Trajectory


class RewardActor(Placed):
    """A reward worker (ray.reward.count > 0): the run's reward function on its own threads, on
    whatever node ray.reward.resources picks, shared by every rollout actor. Stateless, so Ray itself
    restarts it when it dies (max_restarts) and retries the calls it was running on the fresh one
    (max_task_retries); calls that still fail reach RemoteRewardPool as errors."""

    def __init__(self, pool_json: str):
        """`pool_json`: the rollout pool's config (RolloutPoolConfig) as JSON: its reward, agent and env sections and
        the run's length make the reward (rollout/worker.py reward_fn_for)."""
        self.pool = reward_pool_for(RolloutPoolConfig.model_validate_json(pool_json))

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        return await self.pool.score(traj, task)

    def metrics(self) -> dict[str, float]:
        """Its pool's counters so far (an LLM judge's): the driver reads them each step (runtime/ray_backend.py)."""
        return self.pool.metrics()
