"""A run on the tiny model trained on two weighted TRL-style reward functions (in reward worker processes): each
component stored raw in the trajectory store and its mean logged per step as reward/<name>."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.metrics.logger import read_metrics
from loomrl.runtime.run import train
from loomrl.store import read_rows

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
M = "trl_rewards_for_tests"


def test_a_run_trains_on_two_weighted_trl_functions_and_logs_each(tmp_path):
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={tmp_path}", "progress=false", "trainer.total_steps=2", "eval.n_tasks=2", "reward.function=null",
        f"reward.functions=[{{function: {M}:first_token_parity, weight: 1.0}}, "
        f"{{function: {M}:length_penalty, weight: 0.1}}]"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    rows = read_rows(cfg.run_dir / "trajectories")
    scored = [r for r in rows if r["reward_components"] and "reward_failed" not in r["reward_components"]]
    assert scored and not [r["error"] for r in rows if r["reward_components"] and r not in scored]
    for r in scored:  # raw components; the total their weighted sum
        c = r["reward_components"]
        assert set(c) == {"first_token_parity", "length_penalty"} and c["first_token_parity"] in (0.0, 1.0)
        assert r["total_reward"] == pytest.approx(c["first_token_parity"] + 0.1 * c["length_penalty"])
    # every step whose record has rollout metrics (an async step may receive no new group) has each component's mean
    stepped = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "rollout/reward_mean" in m]
    assert stepped and all("reward/first_token_parity" in m and m["reward/length_penalty"] < 0 for m in stepped)
