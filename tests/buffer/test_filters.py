"""Data filters before a batch: completeness (with and without truncated), repetitive loops, near-
duplicate actions within a group, zero variance, and the balanced positive/negative mix."""

from __future__ import annotations

import pytest

from loomrl.buffer.filters import balance_samples, is_repetitive, usable_group
from loomrl.config import BufferConfig, ConfigError, load_config
from loomrl.types import RolloutStatus, TokenSpan, TrainingSample, Trajectory, Turn


def traj(tid: str, sampled: list[int], reward: float, status=RolloutStatus.COMPLETED) -> Trajectory:
    prompt = [1, 2, 3]
    t = Trajectory(task_id="t", trajectory_id=tid, group_id="g", prompt_ids=prompt, token_ids=prompt + sampled,
                   total_reward=reward, status=status,
                   turns=[Turn(act_span=TokenSpan(start=3, end=3 + len(sampled)), logprobs=[-1.0] * len(sampled),
                               versions=[0] * len(sampled))])
    return t


def test_complete_filter_and_drop_truncated():
    group = [traj("a", [5, 6, 7], 1.0), traj("b", [5, 8, 9], 0.0), traj("c", [9, 9], 0.0, RolloutStatus.ENV_ERROR),
             traj("d", [7, 7, 8], 1.0, RolloutStatus.TRUNCATED)]
    kept, out, reason = usable_group(group)
    assert reason is None and [t.trajectory_id for t in kept] == ["a", "b", "d"] and out == {"incomplete": ["c"]}
    kept, out, _ = usable_group(group, BufferConfig(drop_truncated=True))
    assert [t.trajectory_id for t in kept] == ["a", "b"] and out == {"incomplete": ["c", "d"]}


def test_repetitive_loops_are_left_out():
    loop = [4, 5, 6, 7] * 10
    assert is_repetitive(traj("x", loop, 0.0), n=4, max_repeats=8)
    assert not is_repetitive(traj("y", list(range(40)), 0.0), n=4, max_repeats=8)
    group = [traj("x", loop, 0.0), traj("y", list(range(40)), 1.0), traj("z", list(range(40, 80)), 0.0)]
    kept, out, reason = usable_group(group, BufferConfig(filters=["complete", "repetitive"]))
    assert out == {"repetitive": ["x"]} and [t.trajectory_id for t in kept] == ["y", "z"] and reason is None


def test_near_duplicates_keep_one_copy():
    base = list(range(10, 40))
    group = [traj("a", base, 1.0), traj("b", base[:-1] + [99], 1.0), traj("c", list(range(50, 80)), 0.0)]
    kept, out, _ = usable_group(group, BufferConfig(filters=["complete", "near_duplicate"], duplicate_threshold=0.85))
    assert out == {"near_duplicate": ["b"]} and [t.trajectory_id for t in kept] == ["a", "c"]


def test_zero_variance_after_filtering():
    group = [traj("a", [5, 6], 1.0), traj("b", [7, 8], 1.0), traj("c", [9, 9], 0.0, RolloutStatus.TIMEOUT)]
    assert usable_group(group)[2] == "zero_variance"


def test_balance_subsamples_the_majority_sign():
    def sample(i, adv):
        return TrainingSample(trajectory_id=f"s{i}", group_id="g", token_ids=[1, 2], loss_mask=[0, 1],
                              behaviour_logprobs=[0.0, -1.0], versions=[-1, 0], advantages=[0.0, adv])

    samples = [sample(i, 1.0) for i in range(6)] + [sample(6, -1.0), sample(7, -2.0), sample(8, 0.0)]
    kept, dropped = balance_samples(samples, max_ratio=1.5, seed=0)
    signs = [max(s.advantages, key=abs) for s in kept]
    assert dropped == 3 and sum(a > 0 for a in signs) == 3 and sum(a < 0 for a in signs) == 2 and 0.0 in signs
    assert balance_samples(samples, max_ratio=3.0)[1] == 0


def test_unknown_filter_is_refused():
    with pytest.raises(ConfigError, match="'buffer.filters.1'"):
        load_config(None, ["buffer.filters=[complete, vibes]"])


def test_a_trajectory_whose_reward_failed_is_left_out_not_trained_as_zero():
    """A reward function that raises: the trajectory is marked (component and error) by the real
    RewardPool, and the group trains on the others; its zero is not a score."""
    import asyncio

    from loomrl.reward import RewardPool
    from loomrl.types import Task

    def reward(t: Trajectory, task: Task) -> dict[str, float]:
        if t.trajectory_id == "c":
            raise KeyError("no answer key for this task")
        return {"correct": float(t.trajectory_id == "a")}

    pool = RewardPool(reward, workers=1)
    task = Task(task_id="t", prompt="p", answer="1")
    try:
        group = [asyncio.run(pool.score(traj(tid, [5, i, 7], 0.0), task)) for i, tid in enumerate("abc")]
    finally:
        pool.close()
    c = group[2]
    assert c.reward_components == {"reward_failed": 0.0} and "KeyError" in c.error and pool.failed == 1
    kept, out, reason = usable_group(group)
    assert reason is None and [t.trajectory_id for t in kept] == ["a", "b"] and out == {"reward_failed": ["c"]}
