"""The rollout pool's actors are sent their own sections as JSON, not the whole recipe (issue 44): a reward actor is
built from the rollout pool's record (RolloutPoolConfig), an env actor from the env section, and each scores or leases
as the same parts in this process do.

The actor classes are used as the plain classes Ray wraps (starting a Ray cluster costs about 10 s on 2 cores;
tests/runtime/test_ray_runtime.py runs them as actors). Nothing else is faked.
"""

from __future__ import annotations

import asyncio

import pytest

from loomrl.config import EnvConfig, RolloutPoolConfig, load_config
from loomrl.types import RolloutStatus, Task, Trajectory, Turn


def _traj(act: str, answer: str) -> Trajectory:
    traj = Trajectory(task_id="t", trajectory_id="tr", group_id="g", status=RolloutStatus.COMPLETED,
                      turns=[Turn(act=act, tool_calls=[])])
    traj.final_answer = answer  # as the episode sets it
    return traj


def test_a_reward_actor_is_built_from_the_rollout_pools_json_and_scores_as_the_pool_here():
    from loomrl.rollout.reward_actor import RewardActor
    from loomrl.rollout.worker import reward_pool_for

    cfg = load_config("examples/calculator_smollm2.yaml", ["env.args.format_weight=0.1",
                                                           "reward.terms={format: {gate: correct}}"])
    pool = cfg.rollout_pool()
    sent = pool.model_dump_json()
    assert RolloutPoolConfig.model_validate_json(sent) == pool  # what the actor rebuilds is what was sent
    actor, here = RewardActor(sent), reward_pool_for(pool)
    task = Task(task_id="t", prompt="p", answer="27")

    async def score(scorer, answer: str) -> Trajectory:
        return await scorer.score(_traj(f"The answer is {answer}.", answer), task)

    try:
        for answer in ("27", "5"):
            got, want = asyncio.run(score(actor, answer)), asyncio.run(score(here, answer))
            assert got.reward_components == want.reward_components and got.total_reward == want.total_reward
        assert asyncio.run(score(actor, "27")).total_reward == pytest.approx(1.1)
    finally:
        actor.pool.close()
        here.close()


def test_an_env_actor_is_built_from_the_env_sections_json(tmp_path):
    from loomrl.env.remote import EnvActor

    env = EnvConfig.model_validate({"name": "codefix", "pool_size": 3, "sandbox": "process"})
    actor = EnvActor(env.model_dump_json(), 8, "whitebox")
    assert actor.env == env and actor.size == 3  # env.pool_size, whatever the concurrency
    sized = EnvActor(env.model_copy(update={"pool_size": 0}).model_dump_json(), 8, "blackbox")
    assert sized.size >= 8  # a black-box agent holds a sandbox for its whole episode: one each, plus spares
