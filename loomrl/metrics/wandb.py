"""Weights & Biases (metrics.wandb): each record's numbers logged to a W&B run, the run's config as its config.

- The x-axis is the training step: every row carries `step` (W&B's define_metric makes it every metric's step
  metric), and W&B's own row counter is left to count rows. A run that goes back to a checkpoint (trainer restart,
  --resume) logs steps again, which W&B's `step=` argument would drop as out of order; against `step` they are
  points at the same x, as in metrics.jsonl. Eval records are rows too (`eval/success` at step 0 and the last step).
- Resume: the W&B run's id is kept in the run folder (run_folder.WANDB_RUN_ID); a resumed run logs to the same W&B run. Offline, a
  resumed run writes a second offline-run folder with the same id; `wandb sync` uploads them in order.
- Offline mode needs no network: everything lies under DIR/wandb/offline-run-*/ (DIR: metrics.wandb.dir, else the
  run folder) until `wandb sync`.

wandb is imported here only, when a run has metrics.wandb.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loomrl.config.metrics import WANDB_MISSING, WandbConfig
from loomrl.metrics.sink import SinkError, Values, numeric
from loomrl.run_folder import RunFolder

log = logging.getLogger("loomrl")

STEP = "step"


class WandbSink:
    name = "metrics.wandb"

    def __init__(self, config: WandbConfig, run_dir: Path, run_name: str, run_config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError:
            raise SinkError(f"metrics.wandb: {WANDB_MISSING}") from None
        id_file = RunFolder(run_dir).wandb_run_id
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        root = Path(config.dir) if config.dir else Path(run_dir)
        mode = config.mode or os.environ.get("WANDB_MODE", "online")
        root.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=config.project, entity=config.entity, name=config.name or run_name, tags=config.tags,
                config=dict(run_config), dir=str(root), mode=config.mode, id=run_id,
                # offline, W&B ignores `resume` (and says so): the id alone names the run `wandb sync` continues
                resume="allow" if run_id and mode == "online" else None,
                # loomrl's output stays the terminal's (W&B's stdout capture would wrap it); a second run in one
                # process (tests, a notebook) is a run of its own
                settings=wandb.Settings(console="off", reinit="create_new"))
        except Exception as err:  # noqa: BLE001 - wandb's own errors (login, network) name no field of ours
            hint = " (no network? metrics.wandb.mode=offline logs to files, for `wandb sync` later)" \
                if mode == "online" else ""
            raise SinkError(f"metrics.wandb: wandb.init failed: {err}{hint}") from None
        if not self._run.disabled:
            id_file.write_text(self._run.id + "\n")
        self._run.define_metric(STEP, hidden=True)
        self._run.define_metric("*", step_metric=STEP)

    def log(self, step: int, kind: str, metrics: Values) -> None:
        values = numeric(kind, metrics)
        if values:  # a rollback's record holds only its reason
            self._run.log({**values, STEP: step})

    def close(self) -> None:
        self._run.finish()
