"""A publisher for a transport's name, and the loader that turns any handle back into tensors."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from loomrl.weights.broadcast import BroadcastPublisher
from loomrl.weights.file import FilePublisher, load_file
from loomrl.weights.handle import (
    LoadedWeights,
    Transport,
    WeightHandle,
    WeightPublisher,
    copy_into,
)
from loomrl.weights.ipc import IpcPublisher, ipc_tensors
from loomrl.weights.queue import QueuePublisher
from loomrl.weights.shm import ShmPublisher, load_shm

Tensor = torch.Tensor


def make_publisher(transport: str, *, keep: int = 2, folder: str | Path | None = None,
                   dtype: torch.dtype | None = None, receivers: int = 1, bucket_bytes: int = 64 << 20,
                   timeout_s: float = 600.0, host: str = "127.0.0.1", wire: str = "buckets") -> WeightPublisher:
    """A publisher for `transport`; `keep`: how many recent versions stay loadable; `folder`: file only; `dtype`: the
    engine's, what every version is published in (None: the tensors' own); `bucket_bytes`: the runs the tensors are
    cast, copied and (broadcast) sent in; broadcast: `receivers` (the engine's worker processes), `timeout_s` for the
    rendezvous and each version, `host` the address receivers reach the publisher at, `wire` "buckets" or "tensors"
    (an SGLang server)."""
    kind = Transport(transport)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if kind is Transport.QUEUE:
        return QueuePublisher(dtype=dtype, bucket_bytes=bucket_bytes)
    if kind is Transport.SHM:
        return ShmPublisher(keep=keep, dtype=dtype, bucket_bytes=bucket_bytes)
    if kind is Transport.FILE:
        return FilePublisher(folder, keep=keep, dtype=dtype, bucket_bytes=bucket_bytes)
    if kind is Transport.CUDA_IPC:
        return IpcPublisher(keep=keep, dtype=dtype, bucket_bytes=bucket_bytes)
    if kind is Transport.BROADCAST:
        return BroadcastPublisher(receivers=receivers, dtype=dtype, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                                  host=host, wire=wire)
    raise ValueError("weight sync: the ray transport has no publisher (the Ray backend sends its ObjectRefs itself)")




def load_weights(handle: WeightHandle, into: dict[str, Tensor] | None = None) -> LoadedWeights:
    """The handle's tensors and version. With `into` (e.g. an engine's parameters, by name), the tensors are copied into
    those and `into` is returned: one copy fewer for shm. Raises StaleWeights if the version was freed already."""
    if handle.transport is Transport.RAY:
        raise ValueError("weight sync: a ray handle's payload is an ObjectRef, awaited by the rollout actor")
    if handle.transport is Transport.BROADCAST:
        raise ValueError("weight sync: a broadcast handle is received by the engine's workers (vllm, sglang)")
    start = time.perf_counter()
    if handle.transport is Transport.SHM:
        weights = load_shm(handle, into)
    elif handle.transport is Transport.CUDA_IPC:
        views = ipc_tensors(handle.payload)
        weights = copy_into(into, views) if into is not None else {n: v.clone() for n, v in views.items()}
    else:
        weights = handle.payload if handle.transport is Transport.QUEUE else load_file(handle.location, handle.version)
        if into is not None:
            weights = copy_into(into, weights)
    return LoadedWeights(weights, handle.version, time.perf_counter() - start)
