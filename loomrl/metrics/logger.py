"""MetricsLogger: one JSON object per line in metrics.jsonl, and the numeric values to TensorBoard."""

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
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
