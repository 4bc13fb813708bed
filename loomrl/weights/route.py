"""What a run's config asks of the weights' route from the trainer to its engines: the dtype the engine serves in
(the trainer casts to it where it publishes on the GPU: cuda_ipc, broadcast) and how many processes of one engine
receive a broadcast. Config only: nothing here starts an engine."""

from __future__ import annotations

from typing import Any

import torch

from loomrl.config import RunConfig


def engine_dtype(name: str, model_dtype: str) -> str:
    """engine.vllm.dtype resolved: auto is model.dtype when set, else bfloat16 with CUDA, float32 without."""
    if name != "auto":
        return name
    if model_dtype != "auto":
        return model_dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


def serving_dtype(cfg: RunConfig) -> Any:
    """The torch dtype the engine serves in, which every version is published in (cast on the trainer's device a
    bucket at a time: half the bytes of float32 masters for a bfloat16 engine, whatever the transport)."""
    from loomrl.devices import dtype_named, resolve_device, resolve_dtype

    if cfg.engine.kind == "vllm":
        return dtype_named(engine_dtype(cfg.engine.vllm.dtype, cfg.model.dtype))
    if cfg.engine.kind == "sglang":
        return dtype_named(cfg.engine.sglang.weights_dtype)
    return resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device, "model.device"))


def weight_receivers(cfg: RunConfig) -> int:
    """The processes of one engine that join a broadcast's group (runtime.weight_transport=broadcast): vLLM's workers
    (one per tensor-parallel rank), an SGLang server's (engine.sglang.tp_size), or the one holding a built-in engine."""
    e = cfg.engine
    if e.kind == "vllm":
        return e.vllm.tensor_parallel_size
    if e.kind == "sglang":
        return e.sglang.tp_size
    return 1
