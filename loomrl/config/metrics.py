"""The `metrics:` section: which sinks a run's metric records go to besides metrics.jsonl (always written).

    metrics:
      tensorboard: true              # RUN/tensorboard/
      prometheus: {port: 9464}       # gauges at http://127.0.0.1:9464/metrics while the run trains
      wandb: {project: my-project, mode: offline}   # pip install 'loomrl[wandb]'

It imports nothing of loomrl: the config package holds it without importing any sink (loomrl/metrics/ has them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WANDB_MISSING = "W&B logging needs the wandb package: pip install 'loomrl[wandb]' (or remove metrics.wandb)"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PrometheusConfig(_Section):
    port: int = Field(9464, ge=0, le=65535)  # 0: any free port (the log says which)
    host: str = "127.0.0.1"  # 0.0.0.0 for a Prometheus server on another machine


class WandbConfig(_Section):
    project: str = Field("loomrl", min_length=1)
    entity: str | None = None  # W&B's default: the logged-in user's
    # offline: everything under dir/wandb/, uploaded later with `wandb sync`; online needs `wandb login` and the
    # network; disabled: no W&B at all (a recipe can keep its section). None: W&B's own choice, WANDB_MODE or online
    # (a cluster's nodes without network often set WANDB_MODE=offline; a mode given here wins over it)
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None  # where wandb/ goes; None: the run folder
    name: str | None = None  # the W&B run's display name; None: the run's name
    tags: list[str] = Field(default_factory=list)


class MetricsConfig(_Section):
    tensorboard: bool = True
    prometheus: PrometheusConfig | None = None
    wandb: WandbConfig | None = None
