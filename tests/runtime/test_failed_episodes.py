"""An episode that could not be played out (a crashed tool, a failed engine) is no score: evaluation counts only the
episodes it scored and reports the others by how they ended; when none could be scored the run stops with one line;
the rollout metrics average rewards over scored trajectories only. Real sandboxes and env; the scripted engine stands
in for a policy that calls the tool (the random tiny model never would)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine

from loomrl.config import load_config
from loomrl.engine.base import EngineFault
from loomrl.model.chat import ChatRenderer
from loomrl.rollout.worker import RolloutWorker, group_summary
from loomrl.runtime.failures import RunError
from loomrl.runtime.run import train
from loomrl.types import RolloutStatus, Trajectory

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", *overrides])


def test_evaluation_scores_only_the_episodes_played_out(tmp_path, tokenizer):
    from loomrl.env.tasks.calculator import make_splits

    cfg = _cfg(tmp_path, "env.args.crash_rate=0.5")
    _, heldout = make_splits(cfg.env.families, cfg.env.families, 10, 16, cfg.env.seed)
    tasks = [dataclasses.replace(t, answer="5") for t in heldout]  # the scripted policy answers 5, always right
    engine = ScriptedEngine(tokenizer, ["calc(2 + 3)", "The answer is 5."])
    worker = RolloutWorker(cfg.rollout_pool(), engine, ChatRenderer(tokenizer), tasks)

    async def evaluate():
        try:
            return await worker.evaluate(tasks)
        finally:
            await worker.aclose()

    record = asyncio.run(evaluate()).record
    crashed = record.statuses.get("env_error", 0)
    assert 0 < crashed < len(tasks) and record.statuses["completed"] == len(tasks) - crashed
    # every episode that was played out was right: a crash is not a wrong answer
    assert record.success == 1.0 and record.n == len(tasks) - crashed and record.unscored == {"env_error": crashed}
    assert sum(s.n for s in record.splits.values()) == record.n and "exited with status" in record.first_error


class BrokenEngine(ScriptedEngine):
    """Fails every generation, as an engine that cannot run its model does."""

    async def generate(self, request):
        raise EngineFault("engine step failed: RuntimeError: no kernel for this model")


def test_a_run_whose_evaluation_cannot_score_anything_stops_with_one_line(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr("loomrl.rollout.actor.make_engine", lambda cfg, model, tok, version: BrokenEngine(tokenizer, []))
    cfg = _cfg(tmp_path, "runtime.mode=sync", "name=broken")
    with pytest.raises(RunError) as err:
        train(cfg)
    line = str(err.value)
    assert "\n" not in line and "evaluation before training: none of the 8 held-out episodes could be scored" in line
    assert "(engine_error 8)" in line and "no kernel for this model" in line
    summary = json.loads((cfg.run_dir / "summary.json").read_text())  # the segment's record says how it ended ...
    assert summary["ended"].startswith("stopped: run error: evaluation before training")
    assert summary["success_before"] is None and summary["steps"] == 0  # ... and no success rate of 0 is written


def _traj(i: int, status: RolloutStatus, reward: float) -> Trajectory:
    return Trajectory(task_id="t", trajectory_id=f"tr{i}", group_id="g", status=status, total_reward=reward,
                      reward_components={"correct": reward})


def test_rollout_metrics_average_rewards_over_scored_trajectories_only():
    group = [_traj(0, RolloutStatus.COMPLETED, 1.0), _traj(1, RolloutStatus.TRUNCATED, 0.0),
             _traj(2, RolloutStatus.ENV_ERROR, 0.0), _traj(3, RolloutStatus.ENGINE_ERROR, 0.0)]
    failed_reward = _traj(4, RolloutStatus.COMPLETED, 0.0)
    failed_reward.reward_components = {"reward_failed": 0.0}
    m = group_summary([[*group, failed_reward]])
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/correct_rate"] == 0.5
    assert m["rollout/scored"] == 2 and m["rollout/trajectories"] == 5 and m["rollout/status_reward_failed"] == 1
    nothing = group_summary([[_traj(0, RolloutStatus.ENV_ERROR, 0.0)]])
    assert "rollout/reward_mean" not in nothing and nothing["rollout/scored"] == 0


def test_the_store_keeps_no_reward_for_an_unscored_trajectory(tmp_path):
    from loomrl.reward.pool import RewardPool
    from loomrl.store import TrajectoryStore, read_trajectories
    from loomrl.types import Task

    calls = []
    pool = RewardPool(lambda t, task: calls.append(t.trajectory_id) or {"correct": 0.0})
    task = Task(task_id="t", prompt="p", answer="1")
    trajs = [asyncio.run(pool.score(_traj(i, status, 0.0), task))
             for i, status in enumerate([RolloutStatus.COMPLETED, RolloutStatus.TIMEOUT, RolloutStatus.ENV_ERROR])]
    pool.close()
    assert calls == ["tr0"]  # the reward function never sees what could not be played out
    store = TrajectoryStore(tmp_path)
    store.append(trajs)
    store.flush()
    assert [r["total_reward"] for r in read_trajectories(tmp_path).to_pylist()] == [0.0, None, None]
