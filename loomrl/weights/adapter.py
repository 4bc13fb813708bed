"""AdapterMeta: what a published LoRA adapter version is, beside its tensors, so that an engine can serve it.

Under trainer.lora with `publish: adapter` a version's weights are the adapter's tensors alone (every lora_A and
lora_B, under PEFT's saved names, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, the names
of an adapter folder's adapter_model.safetensors), sent by any transport like full weights, and the handle carries
this record (weights/handle.py `WeightHandle.adapter`). An engine applies them with `Engine.update_adapter`
(engine/base.py): the built-in engine merges them into its weights, vLLM and SGLang load them as an adapter named
`name` (fresh per version, so that a request can never reach a stale adapter under the current name) from a PEFT
folder written from the tensors (`write_folder`).

What it is not: the trainer's side (trainer/lora.py builds the adapters and this record) or an engine's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's file names in an adapter folder
ADAPTER_CONFIG = "adapter_config.json"
NAME_PREFIX = "loomrl-v"


def is_adapter_tensor(name: str) -> bool:
    """Whether `name` is a LoRA adapter's tensor under PEFT's saved names."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(version: int) -> str:
    """The name engines serve weight version `version`'s adapter under: one per version, never reused."""
    return f"{NAME_PREFIX}{version}"


@dataclass(slots=True, frozen=True, kw_only=True)
class AdapterMeta:
    """A published adapter version: `name` (adapter_name of its version) and PEFT's adapter_config.json as a dict
    (`config`: r, lora_alpha, target_modules, ... as PEFT writes it)."""

    name: str
    config: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by: lora_alpha / r (PEFT's scaling without rsLoRA)."""
        return float(self.config["lora_alpha"]) / self.rank

    @property
    def target_modules(self) -> list[str]:
        return sorted(self.config["target_modules"])


def write_folder(folder: Path, meta: AdapterMeta, tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) holding `tensors`: what vLLM's and
    SGLang's adapter loaders read. Written under a temporary name then renamed, so a reader never sees half of it."""
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(meta.config, indent=2, sort_keys=True))
    tmp.replace(folder)
    return folder
