"""What a version publishes under trainer.lora with `publish: adapter`: the LoRA adapter's tensors alone, under PEFT's
saved names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, as an adapter folder's
adapter_model.safetensors holds them), with the `AdapterMeta` (weights/adapter.py) the handle carries to the engines.

What it is: `AdapterSource`, the Lora's adapter tensors (trainer/lora.py adapter_source: the live A and B cast a bucket at
a time to the publisher's dtype, which the publisher copies out before the next step changes them; under FSDP2 gathered
from every rank) that names the adapter it holds, so that every
publisher sets its handle's `adapter` (weights/handle.py) and every path that receives the handle applies it with
`Engine.update_adapter` (engine/base.py apply_loaded).

What it is not: the adapters themselves (trainer/lora.py), nor the merged publishing (`publish: merged`, lora.py
MergedSource), nor how an engine applies them (each engine's update_adapter).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from loomrl.model.adapter import ADAPTER
from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.source import Entry, WeightSource

if TYPE_CHECKING:
    from loomrl.trainer.lora import Lora


def adapter_config(lora: Lora) -> dict[str, Any]:
    """PEFT's config of `lora` as adapter_config.json holds it (sets as sorted lists, enums as their strings)."""
    raw = lora.peft.peft_config[ADAPTER].to_dict()
    plain = {k: sorted(v) if isinstance(v, set) else v for k, v in raw.items()}
    return json.loads(json.dumps(plain, default=str))


class AdapterSource(WeightSource):
    """Version `version`'s adapter tensors in `dtype` (None: the trainer's, float32), named by `adapter`: the Lora's own
    `adapter_source` (the live A and B, or, sharded under FSDP2, gathered by every rank a bucket at a time), the
    version's AdapterMeta beside them."""

    def __init__(self, lora: Lora, version: int, dtype: torch.dtype | None, bucket_bytes: int):
        self.source = lora.adapter_source(dtype, bucket_bytes)
        super().__init__(self.source.specs, bucket_bytes, self.source.device)
        self.adapter = AdapterMeta(name=adapter_name(version), config=adapter_config(lora))

    def plan(self) -> list[list[Entry]]:
        return self.source.plan()

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self.source.buckets()
