"""One bucket at a time through one reused buffer: how a colocated trainer rank hands a version to the engine on its
GPU (runtime.weight_transport=cuda_ipc on Ray with engine.sleep_while_training: runtime/ray_backend.py, train_pool/push.py).

Why: the other routes hold a whole version somewhere on the way (a GPU snapshot for cuda_ipc's publisher, a host copy in
Ray's object store, an shm segment). A colocated rank and its engine share a GPU and a node, so the engine can map the
trainer's memory directly; the trainer then needs only one bucket's room (engine.vllm.weight_bucket_bytes), written,
mapped and loaded by the engine, then overwritten with the next bucket, as verl's hybrid engine does. The writer and the
reader take turns: the trainer fills the buffer only after the engine has said it loaded the previous bucket.

Two buffers, one per device the trainer is on: `CudaBucketBuffer` (weights/ipc.py: one GPU allocation, mapped by the
engine's worker through CUDA IPC, the GPU form) and `ShmBucketBuffer` (weights/shm.py: one POSIX shared-memory
segment, the CPU form, which the tests run). Both hand out a `BucketRef`, a small record the engine's worker reads the
bucket's tensors from (engine/vllm/worker.py: the shm segment's kind, or the IPC handle's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from loomrl.weights.handle import Transport
from loomrl.weights.source import Entry, bucket_size

Tensor = torch.Tensor


@dataclass(slots=True, frozen=True, kw_only=True)
class BucketRef:
    """Where one bucket of a streamed version lies in the trainer's buffer. `seq`: this buffer's count of buckets
    written, which an shm segment's header repeats (a reader that finds another knows the buffer moved on); `names`:
    the bucket's tensors in order; `location`: the shm segment; `payload`: the CUDA IPC handle of the buffer with the
    tensors' places in it (weights/ipc.py flat_payload)."""

    kind: Transport  # SHM or CUDA_IPC
    seq: int
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    location: str = ""
    payload: Any = None


class BucketBuffer(ABC):
    """A buffer reused for every bucket of a version; `prepare` sizes it for the version's plan, `fill` copies one
    bucket into it and says where, `close` frees it (after each version: between steps the GPU is the engine's). The
    caller must not fill again before the reader is done with the last bucket."""

    kind: Transport

    def __init__(self) -> None:
        self.seq = 0
        self.capacity = 0  # bytes of tensor room: the most a rank holds for the route (the tests count it)

    def prepare(self, plan: list[list[Entry]]) -> None:
        """Room for the largest bucket of `plan`."""
        need = max((bucket_size(b) for b in plan), default=1)
        if need > self.capacity:
            self._grow(need, plan)
            self.capacity = need

    def fill(self, entries: list[Entry], bucket: list[tuple[str, Tensor]]) -> BucketRef:
        """Copy `bucket` (its tensors in the order and dtypes of `entries`) into the buffer; complete when this
        returns (a GPU copy synchronised)."""
        if bucket_size(entries) > self.capacity:
            raise ValueError(f"weight sync: a bucket of {bucket_size(entries)} bytes in a buffer of {self.capacity} "
                             "(prepare it with the version's plan first)")
        self.seq += 1
        return self._fill(entries, bucket)

    @abstractmethod
    def _grow(self, nbytes: int, plan: list[list[Entry]]) -> None:
        """A buffer of `nbytes` of tensor room (enough for every bucket of `plan`) in place of the current one."""

    @abstractmethod
    def _fill(self, entries: list[Entry], bucket: list[tuple[str, Tensor]]) -> BucketRef: ...

    @abstractmethod
    def close(self) -> None:
        """Free the buffer."""
