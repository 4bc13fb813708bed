"""The dtype an engine serves in, resolved on this machine: the trainer casts every version to it where it publishes
(on the GPU: cuda_ipc, broadcast), an engine loads its model in it. Config only: nothing here starts an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loomrl.config import WeightRoute


def engine_dtype(name: str, model_dtype: str) -> str:
    """engine.vllm.dtype resolved: auto is model.dtype when set, else bfloat16 with CUDA, float32 without."""
    if name != "auto":
        return name
    if model_dtype != "auto":
        return model_dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


def serving_dtype(engine_kind: str, dtype: str, engine_device: str) -> Any:
    """The torch dtype the engine serves in, from its name (config/pools.py serving_dtype_name) as this machine
    resolves "auto": the built-in engine's on model.device (bfloat16 on CUDA, float32 elsewhere), vLLM's bfloat16
    with CUDA and float32 without. Each version is published in it, cast a bucket at a time on the trainer's device
    (half the bytes of float32 masters for a bfloat16 engine, whatever the transport)."""
    from loomrl.devices import dtype_named, resolve_device, resolve_dtype

    if engine_kind == "builtin":
        return resolve_dtype(dtype, resolve_device(engine_device, "model.device"))
    return dtype_named(engine_dtype(dtype, "auto"))


def route_dtype(route: WeightRoute) -> torch.dtype:
    """serving_dtype of `route`'s engine: resolved once in the trainer's process, which publishes every version in it."""
    return serving_dtype(route.engine_kind, route.dtype, route.engine_device)
