"""summary.json covers the whole run across `--resume` segments, and resuming a finished run says so instead of
evaluating again and overwriting the summary with the counts of a segment that did nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.run_folder import read_ledger, read_segments
from loomrl.runtime.run import train

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"output_dir={tmp_path}", "progress=false", "name=seg", "runtime.mode=sync",
                                "eval.n_tasks=2", "checkpoint_every=1", *overrides])


def test_a_resumed_run_summarises_every_segment(tmp_path):
    first = train(_cfg(tmp_path, "trainer.total_steps=2"))
    second = train(_cfg(tmp_path, "trainer.total_steps=3"), resume=True)
    run_dir = tmp_path / "seg"
    assert [(s.from_step, s.to_step, s.ended) for s in read_segments(run_dir)] == [(0, 2, "finished"),
                                                                                 (2, 3, "finished")]
    assert second["steps"] == 3 and second["ledger"]["steps"] == 3 and len(second["segments"]) == 2
    assert second["ledger"]["trained"] == sum(len(e.trained) for e in read_ledger(run_dir))
    # the first segment's training episodes are still counted: 2 steps x 2 groups x 4, then 1 step
    assert second["rollouts"]["training"]["launched"] == 2 * 2 * 4 + 1 * 2 * 4
    assert second["accounting"]["launched"] == first["accounting"]["launched"] + 8
    assert second["accounting"]["violations"] == []
    assert second["wall_s"] >= first["wall_s"]
    assert second["success_before"] == first["success_before"]  # restored, not evaluated again
    assert second["eval_ended"]["before"] == first["eval_ended"]["before"]
    assert json.loads((run_dir / "summary.json").read_text()) == second


def test_resuming_a_finished_run_stops_with_one_line_and_keeps_its_summary(tmp_path):
    train(_cfg(tmp_path, "trainer.total_steps=1"))
    before = (tmp_path / "seg" / "summary.json").read_text()
    again = subprocess.run([sys.executable, "-m", "loomrl", "train", str(RECIPE), f"output_dir={tmp_path}", "name=seg",
                            "trainer.total_steps=1", "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert "is finished (1 steps" in line and "trainer.total_steps=2 --resume" in line and "loomrl eval" in line
    assert (tmp_path / "seg" / "summary.json").read_text() == before
