"""SIGTERM of a resumed run with W&B offline (loomrl issue 43): the run ends with its clean-stop line and exit code
143, and nothing after it: no "terminate called without an active exception" (a process aborting at exit because a
daemon thread was still in torch, see tests/engine/test_engine_close.py), no traceback.

A guard: on the tiny recipe every step is short, so today's code passes; the abort needs a step in flight longer than
the engine's close() waits (a SmolLM2 step on a CPU), which the engine test reproduces deterministically."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loomrl.run_folder import read_ledger

pytestmark = pytest.mark.integration  # two training runs in subprocesses

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"


def _train(tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", "name=r",
            "progress=false", "runtime.mode=async", "checkpoint_every=2", "eval.n_tasks=0",
            "metrics.wandb.mode=offline", *extra]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_sigterm_of_a_resumed_run_with_wandb_offline_ends_with_its_stop_line_only(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "r"
    first = _train(tmp_path, "trainer.total_steps=2")
    out, _ = first.communicate(timeout=180)
    assert first.returncode == 0, out[-3000:]

    proc = _train(tmp_path, "trainer.total_steps=100000", "--resume")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # a child may hold the pipe
    reader.start()
    try:
        deadline = time.time() + 120
        while len(read_ledger(run_dir)) < 3:  # a step past the checkpoint it resumed from
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.time() < deadline, "the resumed run did not reach step 3 in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        proc.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    assert "terminate called" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    last = out.rstrip().splitlines()[-1]
    assert re.fullmatch(r"run stopped by SIGTERM at step \d+ of 100000; continue from its latest checkpoint "
                        r"\(step \d+\) with: loomrl train .* --resume", last), out[-3000:]
    # W&B offline logged both segments: a resumed offline run writes a second folder with the same id
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2, sorted(os.listdir(run_dir / "wandb"))
