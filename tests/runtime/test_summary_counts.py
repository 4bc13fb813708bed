"""summary.json's count groups sum to what they claim: `rollouts.<purpose>.ended` partitions `launched`, and what is
counted beside it (reward_failed among the ended, retried attempts) sits apart under its own name; the untrained-steps
warnings say their unit (groups, steps) and give the ledger's (trajectories). Segments recorded before the counts were
grouped (a resumed old run) read in the same shape."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.run_folder import Fates, Segment, read_segments
from loomrl.runtime.run import train
from loomrl.runtime.summary import append_segment, whole_run

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


@pytest.mark.integration
def test_episode_counts_sum_to_launched_and_warnings_name_their_unit(tmp_path, caplog):
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", "eval.n_tasks=0", "trainer.total_steps=2",
                               "runtime.mode=sync", "reward.function=rewards_for_tests:reward_with_a_typo",
                               "runtime.tolerate_failed_steps=true", "checkpoint_every=0"])
    with caplog.at_level(logging.WARNING, logger="loomrl"):
        summary = train(cfg)
    training = summary["rollouts"]["training"]
    for purpose, counts in summary["rollouts"].items():
        assert sum(counts["ended"].values()) == counts["launched"], (purpose, counts)
    assert training["launched"] == 2 * 2 * 4 and training["retried_attempts"] == {}
    # every played-out episode's reward failed: counted among the ended, not as one more ending
    played = training["ended"].get("completed", 0) + training["ended"].get("truncated", 0)
    assert training["among_ended"] == {"reward_failed": played} and played > 0
    acc = summary["accounting"]
    assert summary["ledger"]["trained"] == 0 and sum(summary["ledger"]["skipped"].values()) == acc["launched"] == 16
    said = [r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage()]
    assert said[0].startswith("step 1 trained nothing: all 2 of its groups were left out (groups by reason: ")
    assert said[-1].startswith("NOTHING WAS TRAINED: 2 of the 2 steps of this run trained nothing (every group of "
                               "theirs left out; in trajectories, as the ledger counts them: 16 launched, 0 trained, "
                               "16 skipped)")
    assert json.loads((cfg.run_dir / "summary.json").read_text())["rollouts"] == summary["rollouts"]


def _segment(rollouts: dict) -> Segment:
    return Segment(from_step=0, to_step=1, ended="finished", wall_s=1.0, rollouts=rollouts, trainer_restarts=0,
                   untrained_steps=0, positions_failed={}, env_pool={}, accounting=Fates(launched=8), extra={})


def test_a_segment_recorded_with_flat_counts_sums_with_a_grouped_one(tmp_path):
    old = {"training": {"launched": 8, "completed": 6, "env_error": 2, "reward_failed": 3, "retried:timeout": 4}}
    new = {"training": {"launched": 8, "ended": {"completed": 8}, "among_ended": {"reward_failed": 1},
                        "retried_attempts": {"timeout": 1}}}
    append_segment(tmp_path, _segment(old))  # as a run from before wrote it (segments.jsonl)
    segments = append_segment(tmp_path, _segment(new))
    assert read_segments(tmp_path)[0].rollouts == {"training": {
        "launched": 8, "ended": {"completed": 6, "env_error": 2}, "among_ended": {"reward_failed": 3},
        "retried_attempts": {"timeout": 4}}}
    summary = whole_run(tmp_path, segments, None, None, 2, [])
    assert summary.rollouts["training"] == {"launched": 16, "ended": {"completed": 14, "env_error": 2},
                                            "among_ended": {"reward_failed": 4}, "retried_attempts": {"timeout": 5}}
