"""The reward pool's Ray half, client side: RewardPool's interface over the reward actors (ray.reward.count > 0;
rollout/reward_actor.py), for rollout actors that score remotely."""

from __future__ import annotations

import itertools
from typing import Any

from loomrl.actor_support import constructor_failed
from loomrl.errors import named_line
from loomrl.reward.pool import mark_reward_failed
from loomrl.types import Task, Trajectory


class RemoteRewardPool:
    """RewardPool's interface over the reward actors (round robin). A call that fails even after Ray's
    retries on restarted actors marks the trajectory reward_failed with the reason: it is stored and
    left out of training, and the rollout goes on."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self._next = itertools.cycle(range(len(actors)))
        self.failed = 0

    async def score(self, traj: Trajectory, task: Task) -> Trajectory:
        import ray.exceptions

        i = next(self._next)
        try:
            return await self.actors[i].score.remote(traj, task)
        except ray.exceptions.RayError as err:
            if constructor_failed(err):  # a reward setup that cannot work: fail the rollout, and so the run
                raise
            self.failed += 1
            return mark_reward_failed(traj, f"reward actor {i}: {named_line(err)}")

    def metrics(self) -> dict[str, float]:
        """{}: the reward actors' own counters (an LLM judge's among them) are read by the driver from the actors
        themselves (runtime/ray_backend.py ActorRollouts._reward_metrics), not through each rollout actor."""
        return {}

    async def aclose(self) -> None:
        pass  # the driver owns the reward actors

    def close(self) -> None:
        pass  # the driver owns the reward actors
