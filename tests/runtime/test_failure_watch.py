"""A failure that hits every trajectory is shown when it first happens and stops the run (runtime/failure_watch.py):
before, a reward with a typo showed only as counts, its exception only in the trajectory store's error column, and the
run trained nothing to its end and exited 0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.runtime.failure_watch import FailureWatch, failed_step, failure_kind
from loomrl.runtime.failures import RunError
from loomrl.runtime.run import train
from loomrl.types import REWARD_FAILED, RolloutStatus, Trajectory

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def _traj(i: int, status: RolloutStatus = RolloutStatus.COMPLETED, error: str | None = None,
          failed: bool = False) -> Trajectory:
    t = Trajectory(task_id=f"task-{i}", trajectory_id=f"traj-{i}", group_id="g", status=status, error=error)
    t.reward_components = {REWARD_FAILED: 0.0} if failed else {"correct": 1.0}
    return t


def test_the_first_error_of_each_kind_is_told_once_with_where_it_was_raised():
    typo = "reward failed: score raised AttributeError: 'Task' object has no attribute 'expected'\n  at r.py:3 in score"
    watch = FailureWatch()
    first = watch.first_errors([_traj(0, error=typo, failed=True), _traj(1, error=typo, failed=True), _traj(2)])
    assert len(first) == 1 and first[0].startswith("first reward_failed: AttributeError (task task-0, trajectory "
                                                   "traj-0") and first[0].endswith(typo)
    crash = "EnvCrash: the sandbox died"
    again = watch.first_errors([_traj(3, error=typo, failed=True), _traj(4, RolloutStatus.ENV_ERROR, crash)])
    assert len(again) == 1 and "first env_error: EnvCrash" in again[0]  # a new kind; the typo is not told again
    assert watch.counts == {"reward_failed: AttributeError": 3, "env_error: EnvCrash": 1}
    assert failure_kind(_traj(5)) is None


def test_a_step_stops_only_when_none_of_its_trajectories_was_scored():
    typo = "reward failed: score raised AttributeError: no attribute 'expected'"
    all_failed = [[_traj(0, error=typo, failed=True), _traj(1, error=typo, failed=True)],
                  [_traj(2, RolloutStatus.TIMEOUT, "TimeoutError: tool ran past 5s")]]
    line = failed_step(all_failed, 1)
    assert line.startswith("run error: step 1: none of its 3 trajectories could be scored: reward_failed: "
                           "AttributeError 2 (and timeout: TimeoutError 1). The first: " + typo)
    assert "runtime.tolerate_failed_steps=true" in line
    assert failed_step([[_traj(0, error=typo, failed=True), _traj(1)]], 1) is None  # one scored: it trains on that
    assert failed_step([], 1) is None


@pytest.mark.integration
def test_a_reward_that_raises_on_every_call_stops_the_run_at_its_first_step(tmp_path, caplog):
    over = [f"output_dir={tmp_path}", "progress=false", "eval.n_tasks=0", "trainer.total_steps=3",
            "reward.function=rewards_for_tests:reward_with_a_typo"]
    with caplog.at_level(logging.WARNING, logger="loomrl"), pytest.raises(RunError) as stopped:
        train(load_config(RECIPE, [*over, "name=stops"]))
    assert str(stopped.value).startswith("run error: step 1: none of its ")
    assert "reward_failed: AttributeError" in str(stopped.value)
    first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first reward_failed")]
    assert len(first) == 1, caplog.text  # once, however many trajectories fail the same way
    assert "has no attribute 'expected'" in first[0] and "at rewards_for_tests.py:" in first[0]  # where: the frame
    summary = train(load_config(RECIPE, [*over, "name=tolerates", "runtime.tolerate_failed_steps=true"]))
    assert summary["steps"] == 3 and summary["untrained_steps"] == 3  # asked to go on: it does, training nothing


@pytest.mark.integration
def test_a_run_without_a_progress_bar_says_each_step_in_one_line(tmp_path, caplog):
    """progress=false (or stderr in a log file): before, a step said nothing until the run ended."""
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", "eval.n_tasks=0", "trainer.total_steps=2",
                               "reward.function=rewards_for_tests:parity_reward"])
    with caplog.at_level(logging.INFO, logger="loomrl"):
        train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ") and "/2: " in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 1/2", "step 2/2"], caplog.text[-2000:]
    assert "trajectories scored)" in lines[0] and " s (training " in lines[0]
