"""Where a published version's tensors come from: a `WeightSource` hands them to a publisher bucket by bucket, already
in the engine's dtype, so that no transport needs a whole-model copy in the trainer's dtype on the way.

Two sources: `DictSource`, tensors a process holds whole (a replicated trainer's parameters: each bucket's tensors are
cast as the bucket is asked for, no copy where the dtype already matches), and the sharded trainer's
(train_pool/distributed.py `GatheredSource`): every rank gathers one bucket's parameters at a time (FSDP2's
`full_tensor()`, a collective), rank 0 casts them on its device and hands them on, and the gathered bucket is dropped
before the next. A publisher holds at most one bucket plus what its transport must keep (an shm segment, a file, the
engine's copy on the GPU), all in the engine's dtype.

Buckets: the version's tensors in a fixed order cut into runs of about `bucket_bytes` (`plan_buckets`; a larger tensor
is a bucket alone). Every consumer cuts the same plan from the same specs: a broadcast's receivers, the shm segment's
layout.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from loomrl.weights.adapter import AdapterMeta

Tensor = torch.Tensor


@dataclass(slots=True, frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype  # as published (the engine's)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True, frozen=True)
class Entry:
    name: str
    dtype: str  # without "torch."
    shape: tuple[int, ...]
    offset: int  # bytes into its bucket
    nbytes: int


def plan_buckets(names: list[str], dtypes: list[str], shapes: list[list[int]], bucket_bytes: int) -> list[list[Entry]]:
    """The version's tensors in order, cut into buckets of about `bucket_bytes` (a larger tensor is a bucket alone);
    offsets 64-byte aligned, so each tensor's view is aligned."""
    buckets: list[list[Entry]] = [[]]
    size = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(Entry(name, dtype, tuple(shape), size, nbytes))
        size = (size + nbytes + 63) // 64 * 64
    return [b for b in buckets if b]


def bucket_size(bucket: list[Entry]) -> int:
    return max(1, bucket[-1].offset + bucket[-1].nbytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightSource(ABC):
    """One version's tensors as `specs` describe them (names, dtypes as published, shapes), delivered in buckets of
    about `bucket_bytes` on `device`."""

    # set where the tensors are a LoRA adapter's (trainer.lora publish=adapter: trainer/adapter_publish.py); the
    # publisher puts it in the version's handle, so that the engines apply them as an adapter (Engine.update_adapter)
    adapter: AdapterMeta | None = None

    def __init__(self, specs: list[TensorSpec], bucket_bytes: int, device: torch.device):
        self.specs = specs
        self.bucket_bytes = bucket_bytes
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def plan(self) -> list[list[Entry]]:
        return plan_buckets([s.name for s in self.specs], [dtype_name(s.dtype) for s in self.specs],
                            [list(s.shape) for s in self.specs], self.bucket_bytes)

    @abstractmethod
    def buckets(self) -> Iterator[list[tuple[str, Tensor]]]:
        """Each bucket of `plan()`: its (name, tensor) pairs in the specs' dtypes, valid until the next bucket is asked
        for (copy out what must last; the list is emptied then, so that a bucket is freed before the next is made
        even while the consumer's loop variable still names it: consume each in a function or comprehension). Consume it to the end: a sharded source runs a collective on every rank per
        bucket, and ranks that stop early leave the others waiting (until the group's timeout)."""


class DictSource(WeightSource):
    """Tensors this process holds whole, cast to `dtype` (None: their own) a bucket at a time; a tensor already in
    that dtype is handed on as it is (the live parameter: the consumer copies it)."""

    def __init__(self, weights: dict[str, Tensor], dtype: torch.dtype | None = None, bucket_bytes: int = 64 << 20):
        if not weights:
            raise ValueError("weight sync: nothing to publish (no tensors)")
        self.weights = weights
        specs = [TensorSpec(n, dtype or t.dtype, tuple(t.shape)) for n, t in weights.items()]
        super().__init__(specs, bucket_bytes, next(iter(weights.values())).device)

    def buckets(self) -> Iterator[list[tuple[str, Tensor]]]:
        with torch.no_grad():
            for plan in self.plan():
                bucket = [(e.name, self.weights[e.name].detach().to(getattr(torch, e.dtype))) for e in plan]
                yield bucket
                bucket.clear()  # the consumer's name for it stays bound while the next one is made


def as_source(weights: dict[str, Tensor] | WeightSource, dtype: torch.dtype | None = None,
              bucket_bytes: int = 64 << 20) -> WeightSource:
    return weights if isinstance(weights, WeightSource) else DictSource(weights, dtype, bucket_bytes)


def host_copy(source: WeightSource) -> dict[str, Tensor]:
    """The whole version in host memory, in the published dtypes: for the transports that must hold it (queue, Ray's
    object store). Owned: nothing else writes it."""
    out: dict[str, Tensor] = {}
    for bucket in source.buckets():
        out.update({name: t.to("cpu", copy=True) for name, t in bucket})
    return out
