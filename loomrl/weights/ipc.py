"""The "cuda_ipc" transport: snapshots on the trainer's GPU in the engine's dtype, mapped by the engine through CUDA IPC."""

from __future__ import annotations

from typing import Any

import torch

from loomrl.weights.handle import (
    Transport,
    WeightHandle,
    WeightPublisher,
    nbytes,
)
from loomrl.weights.source import WeightSource

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


def ipc_tensors(payload: dict[str, Any], device_index: int | None = None) -> dict[str, Tensor]:
    """The tensors of an `ipc_payload`, mapped in this process on the GPU they live on (`device_index`: this
    process's index of that GPU; default its current device). Views of the trainer's memory: clone to keep."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.cuda.current_device() if device_index is None else device_index
    uuid_ = str(torch.cuda.get_device_properties(index).uuid)
    out = {}
    for name, handle in zip(payload["names"], payload["ipc_handles"]):
        if uuid_ not in handle:
            raise RuntimeError(f"weight sync: cuda_ipc weights are on GPU {list(handle)}, this process on {uuid_}; "
                               "CUDA IPC needs the trainer and the engine on the same GPU")
        args = list(handle[uuid_])
        args[6] = index  # the reader's index of the GPU
        out[name] = rebuild_cuda_tensor(*args)
    return out


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
