"""The `metrics:` section: which sinks a run's metric records go to besides metrics.jsonl (always written).

    metrics:
      tensorboard: true              # RUN/tensorboard/
      prometheus: {port: 9464}       # gauges at http://127.0.0.1:9464/metrics while the run trains
      wandb: {project: my-project, mode: offline}   # pip install 'loomrl[wandb]'

It imports no sink (loomrl/metrics/ has them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomrl.config.base import Section

WANDB_MISSING = "W&B logging needs the wandb package: pip install 'loomrl[wandb]' (or remove metrics.wandb)"


class PrometheusConfig(Section):
    port: int = Field(9464, ge=0, le=65535)
    """0: any free port (the log says which)"""
    host: str = "127.0.0.1"
    """0.0.0.0 for a Prometheus server on another machine"""


class WandbConfig(Section):
    project: str = Field("loomrl", min_length=1)
    """the W&B project"""
    entity: str | None = None
    """W&B's default: the logged-in user's"""
    mode: Literal["online", "offline", "disabled"] | None = None
    """offline: everything under dir/wandb/, uploaded later with `wandb sync`; online needs `wandb login` and the
    network; disabled: no W&B at all (a recipe can keep its section). None: W&B's own choice, WANDB_MODE or online (a
    cluster's nodes without network often set WANDB_MODE=offline; a mode given here wins over it)"""
    dir: str | None = None
    """where wandb/ goes; None: the run folder"""
    name: str | None = None
    """the W&B run's display name; None: the run's name"""
    tags: list[str] = Field(default_factory=list)
    """tags on the W&B run"""


class MetricsConfig(Section):
    tensorboard: bool = True
    """write TensorBoard event files to RUN/tensorboard/"""
    prometheus: PrometheusConfig | None = None
    """serve the latest values as Prometheus gauges while the run trains (none: off)"""
    wandb: WandbConfig | None = None
    """log to Weights & Biases (none: off; pip install 'loomrl[wandb]')"""
