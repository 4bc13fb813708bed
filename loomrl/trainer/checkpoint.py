"""Checkpoints: model (HF folder), optimizer, scheduler, step, RNG states, and the runtime's state
(data position, buffer contents, trained-trajectory ledger) so `--resume` trains nothing twice.

Layout: RUN/checkpoints/step_000010/{model/, optimizer.pt, state.pt}; RUN/checkpoints/latest names the
newest complete one. Under trainer.lora, model/ is the adapter's PEFT folder (trainer/lora.py), not the base model.
Sharded ranks (trainer.parallel=fsdp) write the AdamW state as a torch.distributed.checkpoint
folder, optimizer/, each rank its own part (optimizer.pt then holds the scheduler only), and the model folder
bucket by bucket as the ranks gather them (`write_model_folder`: safetensors shards and their index, as HF's
save_pretrained writes a large model; no whole-model copy on any rank). Each checkpoint is written to a temporary folder and renamed into place, so a
crash mid-save leaves the previous checkpoint intact. Older checkpoints are then pruned (`Retention`: the run's
checkpoint_keep and checkpoint_keep_optimizer): deleted, or kept for evaluation without their optimizer state.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loomrl.run_folder import CheckpointFolder, RunFolder
from loomrl.weights.source import WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(slots=True, frozen=True, kw_only=True)
class RngState:
    """Every random generator a step draws from: Python's, NumPy's, torch's CPU one and, where CUDA was initialized,
    each device's (dropout, sampling on the GPU). A checkpoint's state.pt holds it as the dict it always was ("rng")."""

    python: tuple
    numpy: Any  # what np.random.get_state returns (a tuple, as it has always been saved)
    torch: torch.Tensor
    cuda: list[torch.Tensor] | None = None

    @classmethod
    def now(cls) -> RngState:
        return cls(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                   cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)

    def restore(self) -> None:
        """Set every generator to this state (the CUDA ones where this machine has the devices)."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda[: torch.cuda.device_count()])

    def as_json(self) -> dict[str, Any]:
        """As state.pt saves it: "cuda" only where there was one."""
        out = {"python": self.python, "numpy": self.numpy, "torch": self.torch}
        return out if self.cuda is None else {**out, "cuda": self.cuda}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RngState:
        return cls(python=d["python"], numpy=d["numpy"], torch=d["torch"], cuda=d.get("cuda"))


def write_model_folder(folder: Path, model: PreTrainedModel, source: WeightSource) -> None:
    """An HF model folder from `source` (the full parameters a bucket at a time): config (and generation config), one
    safetensors file per bucket and the index from_pretrained reads. Tied weights appear once (named_parameters lists a
    shared parameter once; from_pretrained ties them again)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:  # as save_pretrained does
        model.generation_config.save_pretrained(folder)
    count = len(source.plan())
    weight_map: dict[str, str] = {}
    for i, bucket in enumerate(source.buckets(), start=1):
        name = f"model-{i:05d}-of-{count:05d}.safetensors"
        save_file({n: t.to("cpu").contiguous() for n, t in bucket}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({n: name for n, _ in bucket})
    index = {"metadata": {"total_size": source.nbytes}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_checkpoint(run_dir: Path, step: int, *, model: PreTrainedModel, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any],
                    retention: Retention | None = None, weights: WeightSource | None = None,
                    shards: Callable[[Path], None] | None = None,
                    adapter: Callable[[Path], None] | None = None) -> Path:
    """`retention`: which older checkpoints stay, whole or without their optimizer state (default: the two newest,
    whole); `weights`: the model's full parameters when the model itself is sharded (a collective of all ranks, read a
    bucket at a time); `shards`: writes every rank's part of the optimizer state into the folder it is given (a
    collective of all ranks); `adapter` (trainer.lora): writes the LoRA adapter into the folder it is given, which then
    holds it (and the tokenizer) instead of the model: the base comes from the run's model config on resume."""
    folder = RunFolder(run_dir)
    final, tmp = folder.checkpoint(step).path, folder.checkpoint_in_progress(step)
    shutil.rmtree(tmp.path, ignore_errors=True)
    tmp.path.mkdir(parents=True)
    if adapter is not None:
        adapter(tmp.model)
    elif weights is None:
        model.save_pretrained(tmp.model)
    else:
        write_model_folder(tmp.model, model, weights)
    tokenizer.save_pretrained(tmp.model)
    blob = {"scheduler": scheduler.state_dict()}
    if shards is not None:
        shards(tmp.optimizer_shards)
    else:
        blob["optimizer"] = optimizer.state_dict()
    torch.save(blob, tmp.optimizer)
    torch.save({"step": step, "rng": RngState.now().as_json(), **state}, tmp.state)
    shutil.rmtree(final, ignore_errors=True)
    tmp.path.rename(final)
    folder.latest_tmp.write_text(final.name)
    folder.latest_tmp.rename(folder.latest)
    prune(folder, retention or Retention())
    return final


@dataclass(slots=True, frozen=True)
class Retention:
    """How many of the newest checkpoints stay (`keep`, 0: all) and how many of those keep their optimizer state
    (`keep_optimizer`, at least the newest: --resume needs it); the others keep model/ and state.pt, enough for
    `loomrl eval --checkpoint` and `loomrl serve --checkpoint`."""

    keep: int = 2
    keep_optimizer: int = 2


def prune(folder: RunFolder, retention: Retention) -> None:
    """Delete the checkpoints of the run `folder` that `retention` does not keep, and the optimizer state of those it
    keeps for evaluation only."""
    saved = folder.saved_checkpoints()
    if retention.keep:
        for old in saved[:-retention.keep]:
            shutil.rmtree(old.path, ignore_errors=True)
        saved = saved[-retention.keep:]
    for old in saved[:-retention.keep_optimizer]:
        old.optimizer.unlink(missing_ok=True)
        shutil.rmtree(old.optimizer_shards, ignore_errors=True)  # a sharded trainer's parts


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = RunFolder(run_dir).latest
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint folder (step_NNNNNN) was saved at."""
    return CheckpointFolder(Path(ckpt)).step


def load_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(CheckpointFolder(ckpt).state, weights_only=False, map_location="cpu")


def load_optimizer(ckpt: Path, optimizer: torch.optim.Optimizer, scheduler: Any,
                   shards: Callable[[Path], None] | None = None) -> None:
    """`shards`: reads every rank's part of a sharded optimizer state from the folder it is given."""
    blob = torch.load(CheckpointFolder(ckpt).optimizer, weights_only=False, map_location="cpu")  # load_state_dict moves it
    if ("optimizer" in blob) == (shards is not None):
        kinds = ("whole", "sharded") if shards else ("sharded", "whole")
        raise ValueError(f"checkpoint {ckpt}: its optimizer state is {kinds[0]} but this trainer's is {kinds[1]}; "
                         "resume with the trainer.parallel it was saved with")
    if shards is not None:
        shards(CheckpointFolder(ckpt).optimizer_shards)
    else:
        optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
