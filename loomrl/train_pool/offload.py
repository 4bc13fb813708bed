"""The trainer's state in host memory while a colocated engine generates (engine.sleep_while_training with the trainer
on the engine's GPU: the seed's hybrid engine). Between steps the GPU belongs to the engine; around each step the
engine sleeps (frees its K/V cache and weights), the trainer's state comes back (`onload`), the step trains, the new
version is published, and the state goes back to the host (`offload`) before the engine wakes and loads it.

What moves: the trained model's parameters (under FSDP2 each rank's shards: FSDPModule.to moves the local shards and
re-registers them), the KL reference unless FSDP already keeps it in host memory (trainer.kl_reference_offload), and
every AdamW state tensor (exp_avg, exp_avg_sq; `step` stays where AdamW keeps it, on the CPU unless capturable).
Gradients are dropped (zero_grad(set_to_none=True): each step makes its own). Then the allocator's cached blocks are
given back (torch.cuda.empty_cache), or the memory freed would stay reserved by this process and vLLM's wake-up could
not have it.

What this is not: a cap on the step's own peak (the step runs with everything on the GPU, as without colocation) or a
way to share the GPU with an engine that does not sleep.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from loomrl.trainer.trainer import Trainer


@dataclass(slots=True)
class Moved:
    bytes: int
    seconds: float


def _modules(trainer: Trainer) -> list[torch.nn.Module]:
    """The modules whose parameters are the trainer's state: the sharded roots under FSDP (their `to` moves the shards
    and keeps FSDP's records of them), else the models."""
    trained = trainer.forward if trainer.sharded else trainer.model
    out: list[torch.nn.Module] = [trained] if isinstance(trained, torch.nn.Module) else [trainer.model]
    if trainer.ref_model is not None and not trainer.cfg.kl_reference_offload:
        ref = trainer.ref_forward if trainer.sharded else trainer.ref_model
        out.append(ref if isinstance(ref, torch.nn.Module) else trainer.ref_model)
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p  # this rank's shard: what it holds


def move_state(trainer: Trainer, device: torch.device) -> Moved:
    """Every parameter and optimizer state tensor of `trainer` to `device`; gradients dropped."""
    start = time.perf_counter()
    trainer.optimizer.zero_grad(set_to_none=True)
    moved = 0
    with torch.no_grad():
        for module in _modules(trainer):
            moved += sum(_local(p).numel() * p.element_size() for p in module.parameters() if p.device != device)
            module.to(device)
        for state in trainer.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != device:
                    moved += _local(value).numel() * value.element_size()  # this rank's shard of the state
                    state[key] = value.to(device, non_blocking=device.type == "cpu")
    if device.type == "cpu" and trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)  # the non-blocking copies have landed before the memory is reused
    return Moved(moved, time.perf_counter() - start)


def offload(trainer: Trainer) -> Moved:
    """The trainer's state to host memory and the GPU's cached blocks freed (a no-op for a trainer on the CPU)."""
    if trainer.device.type == "cpu":
        return Moved(0, 0.0)
    moved = move_state(trainer, torch.device("cpu"))
    torch.cuda.empty_cache()
    return moved


def onload(trainer: Trainer) -> Moved:
    """The trainer's state back on trainer.device (a no-op for a trainer on the CPU)."""
    if trainer.device.type == "cpu":
        return Moved(0, 0.0)
    return move_state(trainer, trainer.device)


def drop_gradients(trainer: Trainer) -> None:
    """The step's gradients dropped and the allocator's cached blocks returned, before a colocated engine takes its
    weights' memory back on this GPU for the push (train_pool/push.py): the next step makes its own gradients."""
    trainer.optimizer.zero_grad(set_to_none=True)
    if any(p.device.type == "cuda" for p in trainer.params):
        torch.cuda.empty_cache()
