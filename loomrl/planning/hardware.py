"""What a run's hours are counted in: GPU-hours for a run that holds GPUs, machine-hours for one that runs on CPUs.

Read from the run's config (a recipe, or a run folder's config.yaml), never from a guess:

- backend ray: the GPUs the actors reserve: ray.trainer.num_gpus per trainer rank (trainer.world_size ranks), and
  ray.engine.num_gpus per engine actor (or ray.rollout.num_gpus per rollout actor when engines live in them);
- backend local: trainer.device (world_size ranks, one GPU each on CUDA) and the rollout engine's device: the built-in
  engine's model.device, an in-process vLLM engine's tensor_parallel_size GPUs where CUDA is. A device "auto" is
  CUDA where this machine has it (what it resolved to on the run's machine is not in the run folder), and the
  report says so. An engine server reached by URL (engine.*.base_url) holds GPUs this run does not, and is not
  counted.

What it is not: a device check (loomrl/devices.py refuses a device a machine lacks) or a price list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loomrl.config import RunConfig


@dataclass(slots=True, kw_only=True, frozen=True)
class Hardware:
    """The devices a run holds, for its device-hours."""

    inference_gpus: int  # the rollout engines' GPUs
    train_gpus: int  # the trainer's GPUs
    gpus: int  # all of the run's GPUs, one shared by engine and trainer counted once; 0: a CPU run
    basis: str  # what it was read from, printed beside the hours

    @property
    def unit(self) -> str:
        """GPU-hours, or machine-hours for a run on CPUs (its hours are one machine's)."""
        return "GPU-hours" if self.gpus else "machine-hours"

    @property
    def count(self) -> int:
        """Devices the wall hours are multiplied by: the GPUs, or the one machine."""
        return self.gpus or 1

    @classmethod
    def given(cls, gpus: int) -> Hardware:
        """GPUs the user named on the command line (--gpus)."""
        return cls(inference_gpus=gpus, train_gpus=gpus, gpus=gpus, basis="--gpus")


@cache
def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _on_cuda(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and _cuda_here())


def _ray(cfg: RunConfig) -> Hardware:
    r = cfg.ray
    train = math.ceil(r.trainer.num_gpus * cfg.trainer.world_size)
    engines = r.engine.count * r.engine.num_gpus if r.engine.count else r.rollout.count * r.rollout.num_gpus
    inference = math.ceil(engines)
    # a fraction of a GPU shared by engine and trainer (sleep_while_training) is one GPU, not two
    total = math.ceil(r.trainer.num_gpus * cfg.trainer.world_size + engines)
    return Hardware(inference_gpus=inference, train_gpus=train, gpus=total,
                    basis="ray.trainer.num_gpus x trainer.world_size + ray.engine/rollout num_gpus")


def _engine_gpus(cfg: RunConfig) -> tuple[set[str], str]:
    """The engine's CUDA devices in this process tree, and the field they were read from."""
    e = cfg.engine
    if e.kind == "builtin":
        return ({_name(cfg.model.device)} if _on_cuda(cfg.model.device) else set()), f"model.device {cfg.model.device}"
    server = e.vllm.base_url if e.kind == "vllm" else e.sglang.base_url
    if server or e.kind == "sglang":  # a server reached by URL: its GPUs are not this run's to count
        return set(), f"engine.{e.kind} server (not counted)"
    tp = e.vllm.tensor_parallel_size
    return ({f"vllm:{i}" for i in range(tp)} if _cuda_here() else set()), f"vLLM in-process, tensor_parallel_size {tp}"


def _name(device: str) -> str:
    return "cuda:0" if device in ("auto", "cuda") else device


def run_hardware(cfg: RunConfig) -> Hardware:
    """The GPUs `cfg` holds (module docstring); none: a CPU run, counted in machine-hours."""
    if cfg.runtime.backend == "ray":
        return _ray(cfg)
    engine, engine_basis = _engine_gpus(cfg)
    first = _name(cfg.trainer.device)
    trainer = ({f"cuda:{int(first.partition(':')[2] or 0) + rank}" for rank in range(cfg.trainer.world_size)}
               if _on_cuda(cfg.trainer.device) else set())
    gpus = len(trainer | engine)  # the built-in engine on trainer.device's GPU shares it; vLLM's are its own
    auto = f"; auto: {'CUDA' if _cuda_here() else 'no CUDA'} on this machine" if "auto" in (
        cfg.trainer.device, cfg.model.device) else ""
    return Hardware(inference_gpus=len(engine), train_gpus=len(trainer), gpus=gpus,
                    basis=f"trainer.device {cfg.trainer.device} x {cfg.trainer.world_size}, {engine_basis}{auto}")
