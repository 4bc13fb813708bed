"""The smoke recipe trains (every step takes a gradient), and a run whose steps train nothing says so loudly: the
calculator's own verifier on a random tiny model scores every rollout 0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.metrics.logger import read_metrics
from loomrl.runtime.run import train

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def test_the_smoke_recipe_as_shipped_trains_every_step(tmp_path, caplog):
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", "eval.n_tasks=0"])
    with caplog.at_level(logging.WARNING, logger="loomrl"):
        summary = train(cfg)
    steps = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train"]
    assert len(steps) == cfg.trainer.total_steps and all("train/loss" in m for m in steps)
    assert summary["untrained_steps"] == 0 and summary["accounting"]["trained"] > 0
    assert "trained nothing" not in caplog.text


def test_a_run_that_trains_nothing_says_so_and_why(tmp_path, caplog):
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", "eval.n_tasks=0", "reward.function=null",
                               "trainer.total_steps=2"])
    with caplog.at_level(logging.WARNING, logger="loomrl"):
        summary = train(cfg)
    assert summary["untrained_steps"] == 2 and summary["accounting"]["trained"] == 0
    first = next(r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage())
    assert first.startswith("step 1 trained nothing: all 2 of its groups were left out (groups by reason: "
                            "zero_variance 2; ledger.jsonl names each trajectory and its reason)")
    assert "reward.function" in first
    assert any(r.getMessage().startswith("NOTHING WAS TRAINED: 2 of the 2 steps") for r in caplog.records)
