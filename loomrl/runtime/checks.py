"""What a config cannot check alone: the machine and the environment it runs with. `load_config` (loomrl/config/) validates
the recipe itself, every rule across sections included, so that a RunConfig built in code and one loaded from a recipe
agree; `check_config` then asks what only this machine and the run's environment know (the environment's families and
sandbox limits, its data files, the devices, the packages an engine or a sink needs, the agent's files), and
`load_checked` does both, as every command that runs something does (cli.py). Each refusal is a ConfigError of one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from loomrl.config import VLLM_MISSING, ConfigError, RunConfig, load_config
from loomrl.config.metrics import WANDB_MISSING
from loomrl.devices import DeviceError, resolve_device, trainer_device
from loomrl.env.api import environment_for
from loomrl.env.registry import check_env_config

if TYPE_CHECKING:
    import torch


def check_config(config: RunConfig) -> None:
    """Refuse, at load and before any model loads, what this machine or the run's environment cannot do."""
    check_env_config(config.env, config.data)  # env.families, env.sandbox_limits, data: refused here, not minutes later in a worker
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
    if config.agent.kind == "blackbox" and not environment_for(config.env).takes_blackbox:
        raise ConfigError(f"config error: agent.kind=blackbox: env.name={config.env.name} takes no black-box "
                          "agents (its Environment has no answer_of to read a program's final answer; the "
                          "calculator has one)")


def load_checked(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """load_config, then check_config: the config a run can start with, or a ConfigError of one line."""
    config = load_config(path, overrides)
    check_config(config)
    return config


def check_run_devices(cfg: RunConfig) -> None:
    """Refuse, at config time, devices this machine lacks, a trainer on vLLM's GPU without colocation, and a sync
    run whose engine model could not be the trainer's. Ray runs are checked where their actors load the model (the
    driver may have no GPU); their GPUs are Ray's to share out (loomrl/config/ checks ray.*.num_gpus)."""
    if cfg.runtime.backend != "local":
        return
    model = resolve_device(cfg.model.device, "model.device")
    trainer = trainer_device(cfg.trainer)
    if cfg.runtime.weight_transport == "cuda_ipc" and cfg.runtime.mode == "async" and trainer.type != "cuda":
        raise DeviceError(f"config error: 'runtime.weight_transport': cuda_ipc shares the trainer's GPU memory with "
                          f"the engine, but trainer.device is {trainer}; put the trainer on the engine's GPU "
                          "(trainer.device=cuda:N) or use runtime.weight_transport=shm")
    check_shared_gpu(cfg, trainer)
    if cfg.runtime.mode != "sync":
        return
    # Sync mode trains the engine's model object in place (runtime/local.py shares it; no weight copy between
    # steps), so it is the trainer's float32 master copy on trainer.device: an engine dtype or device of its own
    # would need a second copy of the weights, which is what async mode keeps.
    if cfg.model.dtype not in ("auto", "float32"):
        raise DeviceError(f"config error: 'model.dtype': a sync run (runtime.mode=sync) serves the trainer's own "
                          f"float32 model, so it cannot be {cfg.model.dtype}; set model.dtype=float32 (or auto), or "
                          f"use runtime.mode=async to serve a {cfg.model.dtype} copy")
    if model != trainer:
        raise DeviceError(f"config error: 'model.device': a sync run (runtime.mode=sync) shares one model between the "
                          f"engine and the trainer, so model.device ({model}) must equal trainer.device ({trainer}); "
                          "set them to the same device, or use runtime.mode=async")


def check_shared_gpu(cfg: RunConfig, trainer: torch.device) -> None:
    """Refuse a local run whose trainer would share a GPU with vLLM in this process without colocation
    (engine.sleep_while_training): vLLM takes engine.vllm.gpu_memory_utilization of each GPU it runs on (its workers
    on cuda:0 to cuda:tp-1 of the visible ones), where the trainer's ranks (cuda:i to cuda:i+world_size-1 from
    trainer.device's i) would then run out of memory, or vLLM would not start. Servers over HTTP (SGLang, vLLM with
    base_url) are not checked: their GPUs are their own flags', unknown here; the built-in engine is not either (it
    takes only what its model and engine.kv_budget_tokens need)."""
    import torch

    e = cfg.engine
    if e.kind != "vllm" or e.vllm.base_url or e.sleep_while_training or trainer.type != "cuda":
        return
    tp, ranks = e.vllm.tensor_parallel_size, cfg.trainer.world_size
    if trainer.index >= tp:  # ranks count up from trainer.device's index (train_pool/ranks.py)
        return
    vllm = "cuda:0" if tp == 1 else f"cuda:0 to cuda:{tp - 1}"
    fix = "set engine.sleep_while_training=true (vLLM sleeps while the trainer steps)"
    if cfg.runtime.weight_transport != "cuda_ipc" and torch.cuda.device_count() >= tp + ranks:
        fix += f", or trainer.device=cuda:{tp} to give the trainer a GPU of its own"
    rank_gpus = f" and its ranks to cuda:{trainer.index + ranks - 1}" if ranks > 1 else ""
    raise DeviceError(f"config error: 'trainer.device': the trainer ({trainer}{rank_gpus}) would share a GPU with vLLM "
                      f"(engine.kind=vllm in this process, on {vllm}) without colocation; {fix}")
