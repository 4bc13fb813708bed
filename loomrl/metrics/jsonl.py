"""metrics.jsonl: one JSON object per record, `{"kind", "step", "time", **values}`, and `read_metrics`.

The file is the run's own record of its metrics (the summary, the tests and `loomrl` tooling read it); the other
sinks are views of it. It is always written.

A run that goes back to a checkpoint (--resume, or a trainer restarted after a crash) redoes the steps after it, so
their numbers appear twice in the file. A `rollback` record marks where: `read_metrics` keeps only the train records
that the final model's history went through (the file keeps them all).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from loomrl.metrics.sink import Values
from loomrl.run_folder import METRICS, RunFolder, read_json_lines


class JsonlSink:
    name = METRICS

    def __init__(self, run_dir: Path):
        self.path = RunFolder(run_dir).metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")  # a resumed run appends

    def log(self, step: int, kind: str, metrics: Values) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crashed run keeps every step it logged

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: Path, *, superseded: bool = False) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in order; without `superseded`, train records undone by a later
    rollback (steps past the checkpoint the run went back to) are left out."""
    records = read_json_lines(RunFolder(run_dir).metrics)
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
