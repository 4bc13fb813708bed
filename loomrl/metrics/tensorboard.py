"""TensorBoard event files in RUN/tensorboard/ (metrics.tensorboard): one scalar per number, tagged by its name
(sink.metric_name: `train/loss`, `eval/success`), at the record's step."""

from __future__ import annotations

from pathlib import Path

from loomrl.metrics.sink import Values, numeric
from loomrl.run_folder import RunFolder


class TensorBoardSink:
    name = "metrics.tensorboard"

    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(RunFolder(run_dir).tensorboard))

    def log(self, step: int, kind: str, metrics: Values) -> None:
        for tag, value in numeric(kind, metrics).items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
