"""The "cuda_ipc" transport: snapshots on the trainer's GPU in the engine's dtype, mapped by the engine through CUDA IPC."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from loomrl.weights.bucket import BucketBuffer, BucketRef
from loomrl.weights.handle import (
    Transport,
    WeightHandle,
    WeightPublisher,
    nbytes,
)
from loomrl.weights.source import Entry, WeightSource, bucket_size

Tensor = torch.Tensor


# torch's reduce_tensor gives, for a CUDA tensor, the arguments of rebuild_cuda_tensor: a cudaIpcMemHandle of its
# allocation and where the tensor sits in it. A process on the same GPU that rebuilds it maps the trainer's memory; the
# trainer must keep the tensor alive meanwhile, hence a snapshot per version held for the window (the parameters
# themselves change with the next optimizer step). vLLM's "ipc" engine reads the same layout (rebuild args keyed by the
# GPU's UUID, index 6 the device index, overwritten by the reader).


def ipc_payload(tensors: dict[str, Tensor]) -> dict[str, Any]:
    """names / dtype_names / shapes / ipc_handles of CUDA tensors (vLLM's IPCWeightTransferUpdateInfo fields)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for t in tensors.values():
        uuid_ = str(torch.cuda.get_device_properties(t.device).uuid)
        handles.append({uuid_: reduce_tensor(t)[1]})
    return {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "ipc_handles": handles}


def export_buffer(buffer: Tensor, buffer_id: str) -> dict[str, Any]:
    """A uint8 CUDA `buffer`'s IPC handle, made ONCE per allocation (a colocated route's buffer, weights/bucket.py):
    every export of a storage is a new link torch chains to the last (StorageSharing.cpp shareCuda: an IPC event and a
    ref-counter slot each), freed only with the storage, and each must be matched by one rebuild; so the buffer is
    exported once and the reader maps it once per allocation (`buffer_id`), as vLLM's packed IPC transfer and verl's
    bucketed sender do."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid_ = str(torch.cuda.get_device_properties(buffer.device).uuid)
    return {"buffer": {uuid_: reduce_tensor(buffer)[1]}, "buffer_id": buffer_id}


def flat_views(buffer: Tensor, entries: list[list[Any]]) -> dict[str, Tensor]:
    """Views of a uint8 `buffer` as `entries` ([name, dtype, shape, offset] each, offsets 64-byte aligned) lay it out:
    the writer's (CudaBucketBuffer) and the reader's (ipc_tensors) one layout."""
    out = {}
    for name, dtype_name, shape, offset in entries:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        n = math.prod(shape) * dtype.itemsize
        out[name] = buffer[offset : offset + n].view(dtype).view(shape)
    return out


def ipc_tensors(payload: dict[str, Any], device_index: int | None = None) -> dict[str, Tensor]:
    """The tensors of an `ipc_payload` (a handle per tensor) or a `flat_payload` (one buffer), mapped in this process
    on the GPU they live on (`device_index`: this process's index of that GPU; default its current device). Views of
    the trainer's memory: clone to keep."""
    index = torch.cuda.current_device() if device_index is None else device_index
    if "buffer" in payload:
        return flat_views(mapped_buffer(payload, index), payload["entries"])
    return {name: _rebuild(handle, index) for name, handle in zip(payload["names"], payload["ipc_handles"])}


def mapped_buffer(payload: dict[str, Any], device_index: int) -> Tensor:
    """The exported buffer of a flat payload (`export_buffer`), mapped in this process: map it once per allocation
    (payload["buffer_id"]) and keep it while its buckets come (engine/vllm/worker.py)."""
    return _rebuild(payload["buffer"], device_index)


def _rebuild(handle: dict[str, Any], index: int) -> Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid_ = str(torch.cuda.get_device_properties(index).uuid)
    if uuid_ not in handle:
        raise RuntimeError(f"weight sync: cuda_ipc weights are on GPU {list(handle)}, this process on {uuid_}; "
                           "CUDA IPC needs the trainer and the engine on the same GPU")
    args = list(handle[uuid_])
    args[6] = index  # the reader's index of the GPU
    return rebuild_cuda_tensor(*args)


class IpcPublisher(WeightPublisher):
    transport = Transport.CUDA_IPC
    releases_first = True  # one snapshot on the GPU at keep=1 (WeightPublisher.publish)

    def __init__(self, *, keep: int = 2, dtype: torch.dtype | None = None, bucket_bytes: int = 64 << 20):
        if not torch.cuda.is_available():
            raise RuntimeError("weight sync: runtime.weight_transport=cuda_ipc needs a CUDA GPU (use shm)")
        super().__init__(keep, dtype=dtype, bucket_bytes=bucket_bytes)

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        if source.device.type != "cuda":
            raise ValueError(f"weight sync: cuda_ipc publishes CUDA tensors; the trainer's are on {source.device} "
                             "(trainer.device must be a GPU)")
        snap: dict[str, Tensor] = {}
        with torch.no_grad():  # a copy per tensor, in the engine's dtype: the snapshot held for the window
            for bucket in source.buckets():
                snap.update({name: t.to(source.device, copy=True).contiguous() for name, t in bucket})
        torch.cuda.synchronize()  # the copies are complete before another process reads them
        return snap, WeightHandle(transport=self.transport, version=version, nbytes=nbytes(snap),
                                  payload=ipc_payload(snap))

    def _release(self, snap: dict[str, Tensor]) -> None:
        snap.clear()
        torch.cuda.ipc_collect()  # frees the blocks other processes have stopped mapping


class CudaBucketBuffer(BucketBuffer):
    """The GPU form of the colocated route's buffer (weights/bucket.py): one uint8 allocation on the trainer rank's GPU,
    its CUDA IPC handle made once per allocation (the engine's worker maps it once; torch caches the mapping by
    handle), each bucket copied in (cast already: the source's dtype is the engine's) and synchronised before its
    BucketRef goes out. Not run on a GPU yet (scripts/gpu_smoke.py part b)."""

    kind = Transport.CUDA_IPC

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"weight sync: a CUDA IPC bucket buffer needs the trainer on a GPU, not {device}")
        super().__init__()
        self.device = device
        self._buffer: Tensor | None = None
        self._export: dict[str, Any] = {}
        self._count = 0

    def _grow(self, nbytes: int, plan: list[list[Entry]]) -> None:
        self.close()
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._count += 1
        self._export = export_buffer(self._buffer, f"{os.getpid()}-{id(self)}-{self._count}")

    def _fill(self, entries: list[Entry], bucket: list[tuple[str, Tensor]]) -> BucketRef:
        buffer = self._buffer
        assert buffer is not None, "CudaBucketBuffer.prepare first"
        views = flat_views(buffer, [[e.name, e.dtype, list(e.shape), e.offset] for e in entries])
        with torch.no_grad():
            for name, t in bucket:
                views[name].copy_(t)
        torch.cuda.synchronize(self.device)  # complete before another process reads it
        entries_ = [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]
        return BucketRef(kind=self.kind, seq=self.seq, names=[e.name for e in entries], nbytes=bucket_size(entries),
                         payload={**self._export, "entries": entries_})

    def close(self) -> None:
        """Free the buffer (after each version: the GPU is the engine's between steps); the reader has dropped its
        mapping by then (the update finished), so ipc_collect can release the block."""
        if self._buffer is not None:
            self._buffer, self._export, self.capacity = None, {}, 0
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()  # give the room back to the engine that wakes on this GPU
