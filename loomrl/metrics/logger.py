"""MetricsLogger: one JSON object per line in metrics.jsonl, and the numeric values to TensorBoard.

TensorBoard tags are the metric names, which carry their own namespace (`train/loss`, `rollout/reward_mean`,
`eval/success`); a name without one is put under its record's kind (`groups` of a train record: `train/groups`).
So held-out success before and after training is one curve, `eval/success`, at step 0 and the last step.

A run that goes back to a checkpoint (--resume, or a trainer restarted after a crash) redoes the steps
after it, so their numbers appear twice in the file. A `rollback` record marks where: `read_metrics`
keeps only the train records that the final model's history went through (the file keeps them all).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key if "/" in key else f"{kind}/{key}", value, step)
            self._tb.flush()

    def rollback(self, step: int, reason: str) -> None:
        """The run continues from the checkpoint of `step`: train records of later steps logged so far
        were undone (read_metrics drops them)."""
        self.log(step, {"reason": reason}, kind="rollback")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path, *, superseded: bool = False) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in order; without `superseded`, train records undone by a later
    rollback (steps past the checkpoint the run went back to) are left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if superseded:
        return records
    kept, floor = [], math.inf  # the lowest step a later rollback went back to
    for r in reversed(records):
        if r.get("kind") == "rollback":
            floor = min(floor, r["step"])
        elif r.get("kind") == "train" and r.get("step", 0) > floor:
            continue
        kept.append(r)
    return kept[::-1]
