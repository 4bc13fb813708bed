"""What a config cannot check alone: the machine and the environment it runs with. `load_config` (loomrl/config/) validates
the recipe itself, every rule across sections included, so that a RunConfig built in code and one loaded from a recipe
agree; `check_config` then asks what only this machine and the run's environment know (the environment's families and
sandbox limits, its data files, the devices, the packages an engine or a sink needs, the agent's files), and
`load_checked` does both, as every command that runs something does (cli.py). Each refusal is a ConfigError of one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loomrl.config import VLLM_MISSING, ConfigError, RunConfig, load_config
from loomrl.config.metrics import WANDB_MISSING
from loomrl.devices import check_run_devices
from loomrl.env.api import environment_for
from loomrl.env.registry import check_env_config


def check_config(config: RunConfig) -> None:
    """Refuse, at load and before any model loads, what this machine or the run's environment cannot do."""
    check_env_config(config)  # env.families, env.sandbox_limits, data: refused here, not minutes later in a worker
    check_run_devices(config)
    if (config.engine.kind == "vllm" and not config.engine.vllm.base_url and config.runtime.backend == "local"
            and importlib.util.find_spec("vllm") is None):
        # Ray runs: their rollout actors' nodes need vLLM, not the driver's; the engine says the same there
        raise ConfigError(f"config error: engine.kind=vllm: {VLLM_MISSING}")
    wandb = config.metrics.wandb
    if wandb is not None and wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"config error: metrics.wandb: {WANDB_MISSING}")
    for f in config.agent.files:
        if not Path(f).is_file():
            raise ConfigError(f"config error: agent.files: {f!r} is not a file (paths are relative to the recipe)")
    if config.agent.kind == "blackbox" and not environment_for(config).takes_blackbox:
        raise ConfigError(f"config error: agent.kind=blackbox: env.name={config.env.name} takes no black-box "
                          "agents (its Environment has no answer_of to read a program's final answer; the "
                          "calculator has one)")


def load_checked(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """load_config, then check_config: the config a run can start with, or a ConfigError of one line."""
    config = load_config(path, overrides)
    check_config(config)
    return config
