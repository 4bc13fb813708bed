"""Weight sync: versioned transfer of the trained weights from the trainer to the inference engines.

A publisher snapshots a dict of tensors under a version and returns a `WeightHandle`: a small
picklable record that travels to the engines by whatever channel the runtime already has (a queue,
a Ray actor call); `load_weights(handle)` turns it back into tensors there. Transports:

- "queue": the tensors ride inside the handle (cloned at publish). Sending the handle through a
  multiprocessing queue is today's async path: torch's pickler moves each storage into shared
  memory on the way. The baseline; the handle is as large as the model.
- "shm":  POSIX shared-memory segments holding a header (tensor names, dtypes, shapes, offsets and the version) then the
  tensors' bytes, 64-byte aligned. The handle names the segment. Segments of versions out of the window are rewritten
  for later ones (a new segment costs several times the copy: the kernel allocates and zeroes every page), under flock
  so that no reader is mid-copy (see the section's comment).
- "file": one safetensors file per version in a folder, written under a temporary name, fsynced,
  then renamed into place (os.replace is atomic). Works across machines on a shared filesystem.
- "cuda_ipc": the snapshot stays on the trainer's GPU, cast to the engine's dtype, and the handle carries a CUDA IPC
  handle per tensor (torch's reduce_tensor: vLLM's "ipc" layout, names / dtype_names / shapes / ipc_handles keyed by
  the GPU's UUID), so an engine process on the same GPU maps the tensors without a host round trip. The vLLM engine
  hands them to its worker (engine/vllm_worker.py); `load_weights` rebuilds them for any other engine. CUDA only.
- "broadcast": the trainer broadcasts each version over a process group of its own with the engine's workers
  (trainer/weight_group.py: NCCL between GPUs, gloo on CPUs); the handle carries the group's address and the
  version's names, dtypes and shapes, and the engine's workers receive it (engine.kind=vllm in process, or sglang). Nothing is held:
  the broadcast reads the live parameters, so the trainer settles it (`settle`) before its next step.
- "ray":  no publisher here. The Ray backend (runtime/ray_backend.py publish) puts in the handle's payload the ObjectRef
  of the weights the trainer actor returned with its step (an object in Ray's store, owned by the driver, never
  rewritten, freed by Ray's reference counting); rollout actors await it (rollout/actor.py update_weights) instead of
  calling `load_weights`.

Atomicity (a reader never sees a mix of two versions): every transport writes a version completely before its handle
exists and never writes over a version while it can be read: files are never rewritten; a shm segment is rewritten only
under an exclusive flock that readers hold shared while they copy, and a reader checks the segment's header names its
handle's version. Cleanup: the publisher keeps the last `keep` versions loadable (default 2: the current one and the one
engines may still be loading); older ones are unlinked (file, shm beyond one spare segment). On POSIX, unlinking only
removes the name: a reader that has a file or segment open finishes normally; one that comes later (or finds its
segment rewritten) gets `StaleWeights` and should load the newer handle, which is already on its way (handles are
published in version order). Segments are also unlinked when the publisher closes, and by Python's resource tracker if
the publisher's process dies.

Devices and dtypes: a snapshot is always in host memory (shm, files and queues carry CPU tensors; a trainer on a GPU
is copied out once per version) and keeps the trainer's dtype (float32 masters); the engine casts to its model's dtype
and device as it loads them (BuiltinEngine.update_weights, and `load_weights(into=)` here, copy with a cast).

What this module is not: a channel (handles are sent by the caller) or a policy for when engines
apply weights (engine.update_weights does that). One publisher per process and per folder; publish
is not meant to be called from two threads at once.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import dataclasses
import enum
import fcntl
import json
import math
import mmap
import os
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, NamedTuple

import torch

Tensor = torch.Tensor

_ALIGN = 64  # every tensor starts on a cache line
_MAGIC = "loomrl-weights-1"


class Transport(enum.StrEnum):
    QUEUE = "queue"
    SHM = "shm"
    FILE = "file"
    CUDA_IPC = "cuda_ipc"
    BROADCAST = "broadcast"
    RAY = "ray"


class StaleWeights(RuntimeError):
    """The handle's version was freed (or its segment reused) because newer ones were published: load
    the newer handle."""


class BroadcastFailed(RuntimeError):
    """A version's broadcast did not reach every receiver (one died, or never joined) within the timeout."""


@dataclass(slots=True, kw_only=True)
class WeightHandle:
    """What travels to the engines. `location`: segment name (shm) or file path (file); `payload`:
    the tensors themselves (queue) or an ObjectRef (ray)."""

    transport: Transport
    version: int
    nbytes: int
    location: str = ""
    payload: Any = None
    publish_s: float = 0.0  # time the publisher spent snapshotting this version


class LoadedWeights(NamedTuple):
    weights: dict[str, Tensor]  # owned by the caller: nothing else writes or frees them
    version: int
    load_s: float


class WeightPublisher(ABC):
    """What every transport shares: strictly increasing versions, the window of the last `keep` still
    held (a version falling out of it goes to `_release`), and the timing of publish."""

    transport: Transport

    def __init__(self, keep: int):
        self.keep = keep
        self._last: int | None = None
        self._held: deque[tuple[int, Any]] = deque()  # (version, what the transport holds for it)

    def publish(self, weights: dict[str, Tensor], version: int) -> WeightHandle:
        """Snapshot `weights` as `version` (the caller may keep training them in place right after)."""
        if self._last is not None and version <= self._last:
            raise ValueError(f"publish: version {version} is not above the last published one ({self._last})")
        start = time.perf_counter()
        resource, handle = self._snapshot(weights, version)
        self._last = version
        self._held.append((version, resource))
        while len(self._held) > self.keep:
            self._release(self._held.popleft()[1])
        handle.publish_s = time.perf_counter() - start
        return handle

    def settle(self) -> None:  # noqa: B027 - a hook: only broadcast sends after publish returns
        """Returns once nothing reads the weights published last (before the trainer changes them)."""

    def close(self) -> None:
        """Free every version still held."""
        while self._held:
            self._release(self._held.popleft()[1])

    @abstractmethod
    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        """Write `version` completely; returns what stays held for it and its handle."""

    def _release(self, resource: Any) -> None:  # noqa: B027 - a hook: not every transport frees anything
        """`resource` is out of the window (nothing to free by default)."""


def make_publisher(transport: str, *, keep: int = 2, folder: str | Path | None = None,
                   dtype: torch.dtype | None = None, receivers: int = 1, bucket_bytes: int = 64 << 20,
                   timeout_s: float = 600.0, host: str = "127.0.0.1", wire: str = "buckets") -> WeightPublisher:
    """A publisher for `transport`; `keep`: how many recent versions stay loadable; `folder`: file only; `dtype`:
    cuda_ipc and broadcast, the engine's (None: the trainer's); broadcast: `receivers` (the engine's worker
    processes), `bucket_bytes` per collective, `timeout_s` for the rendezvous and each version, `host` the address
    receivers reach the publisher at, `wire` "buckets" or "tensors" (an SGLang server)."""
    kind = Transport(transport)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if kind is Transport.QUEUE:
        return QueuePublisher()
    if kind is Transport.SHM:
        return ShmPublisher(keep=keep)
    if kind is Transport.FILE:
        return FilePublisher(folder, keep=keep)
    if kind is Transport.CUDA_IPC:
        return IpcPublisher(keep=keep, dtype=dtype)
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
        weights = _load_shm(handle, into)
    elif handle.transport is Transport.CUDA_IPC:
        views = ipc_tensors(handle.payload)
        weights = _copy_into(into, views) if into is not None else {n: v.clone() for n, v in views.items()}
    else:
        weights = handle.payload if handle.transport is Transport.QUEUE else _load_file(handle.location, handle.version)
        if into is not None:
            weights = _copy_into(into, weights)
    return LoadedWeights(weights, handle.version, time.perf_counter() - start)


def _copy_into(into: dict[str, Tensor], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    missing = sorted(set(weights) - set(into))
    if missing:
        raise KeyError(f"weight sync: no destination for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    with torch.no_grad():
        for name, src in weights.items():
            dst = into[name]
            if dst.shape != src.shape:  # copy_ would broadcast silently
                raise ValueError(f"weight sync: {name} has shape {tuple(src.shape)}, the destination {tuple(dst.shape)}")
            dst.copy_(src)  # cast to the destination's dtype and device (a bfloat16 engine from float32 masters)
    return into


def sync_metrics(handle: WeightHandle, loaded: LoadedWeights | None) -> dict[str, float]:
    """Metrics of one transfer, for the step's log line (`loaded` None: the engine read the handle itself, its
    load is part of applying)."""
    return {"weight_sync/publish_s": handle.publish_s, "weight_sync/load_s": loaded.load_s if loaded else 0.0,
            "weight_sync/bytes": float(handle.nbytes)}


def _nbytes(weights: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# ---------------------------------------------------------------- queue (baseline)


class QueuePublisher(WeightPublisher):
    """Nothing held: each handle owns its tensors."""

    transport = Transport.QUEUE

    def __init__(self) -> None:
        super().__init__(keep=1)

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        # A clone per version: torch pickles a storage when the queue's feeder thread gets to it,
        # later than put(), so sending live parameters could mix two versions.
        payload = {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}  # host memory
        return None, WeightHandle(transport=self.transport, version=version, nbytes=_nbytes(payload), payload=payload)


# ---------------------------------------------------------------- shared memory
#
# Segment layout: [8-byte little-endian header length][JSON header][tensors, each 64-byte aligned].
# A new segment costs more than the copy into it (tmpfs allocates and zeroes every page: 8x to 50x the copy on the
# development machine, benchmarks/weight_sync.py), so segments that fall out of the window are kept as spares and
# rewritten for a later version. A spare may still be read (a slow reader, or one holding an old handle), so access goes
# through flock on the segment: readers hold a shared lock while they check the header's version and copy; the publisher
# rewrites a spare only under an exclusive lock taken without waiting, else it makes a new segment and unlinks the busy
# spare (its reader keeps its mapping). A reader never sees a mix: either the header still names its version and no one
# writes until it is done, or the header names a newer one and it gets StaleWeights.


@dataclass(slots=True)
class _Segment:
    name: str  # without the leading "/"
    fd: int
    mem: mmap.mmap
    size: int


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in a segment header")
    return dtype


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _views(buf: Any, data_start: int, entries: list[list[Any]]) -> dict[str, Tensor]:
    """Tensors viewing `buf` as laid out by `entries` ([name, dtype, shape, offset] each)."""
    out = {}
    for name, dtype_name, shape, offset in entries:
        dtype = _dtype(dtype_name)
        if math.prod(shape) == 0:
            out[name] = torch.empty(shape, dtype=dtype, device="cpu")
            continue
        nbytes = math.prod(shape) * dtype.itemsize
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=data_start + offset)
        out[name] = raw.view(dtype).view(shape)
    return out


def _create_segment(name: str, size: int) -> _Segment:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        mem = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        _posixshmem.shm_unlink("/" + name)
        raise
    resource_tracker.register("/" + name, "shared_memory")  # unlinked for us if this process dies
    return _Segment(name, fd, mem, size)


def _free(seg: _Segment) -> None:
    seg.mem.close()
    os.close(seg.fd)
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + seg.name)
    resource_tracker.unregister("/" + seg.name, "shared_memory")


class ShmPublisher(WeightPublisher):
    transport = Transport.SHM

    def __init__(self, *, keep: int = 2, spares: int = 1):
        super().__init__(keep)
        self._spares: list[_Segment] = []  # out of the window, to be rewritten
        self._max_spares = spares
        self._prefix = f"loomrl-w-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # no clash with a crashed run's leftovers
        self._count = 0

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        entries, offset = [], 0
        for name, t in weights.items():
            entries.append([name, str(t.dtype), list(t.shape), offset])
            offset = _align(offset + t.numel() * t.element_size())
        header = json.dumps({"magic": _MAGIC, "version": version, "tensors": entries}).encode()
        data_start = _align(8 + len(header))
        size = max(data_start + offset, 1)
        seg = self._take_spare(size)
        if seg is None:
            self._count += 1
            seg = _create_segment(f"{self._prefix}-{self._count}", size)
        try:
            self._write(seg, header, data_start, entries, weights)
        except BaseException:
            _free(seg)
            raise
        fcntl.flock(seg.fd, fcntl.LOCK_UN)  # a rewritten spare: readers may look now
        return seg, WeightHandle(transport=self.transport, version=version, nbytes=_nbytes(weights), location=seg.name)

    def _release(self, seg: _Segment) -> None:
        self._spares.append(seg)
        while len(self._spares) > self._max_spares:
            _free(self._spares.pop(0))

    def _take_spare(self, size: int) -> _Segment | None:
        """A spare that fits and that no reader holds, locked exclusively; busy ones are unlinked."""
        for seg in list(self._spares):
            if seg.size < size:
                continue
            self._spares.remove(seg)
            try:
                fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _free(seg)  # its reader keeps its mapping and finishes
                continue
            return seg
        return None

    @staticmethod
    def _write(seg: _Segment, header: bytes, data_start: int, entries: list, weights: dict[str, Tensor]) -> None:
        views = _views(seg.mem, data_start, entries)
        try:
            with torch.no_grad():
                for name, t in weights.items():
                    views[name].copy_(t.detach())
        finally:
            views.clear()  # no exported buffers may remain when the segment is closed
        seg.mem[8 : 8 + len(header)] = header
        seg.mem[:8] = len(header).to_bytes(8, "little")

    def close(self) -> None:
        super().close()
        while self._spares:
            _free(self._spares.pop())


@contextlib.contextmanager
def shm_views(handle: WeightHandle) -> Iterator[dict[str, Tensor]]:
    """The segment's tensors as views (no copy), valid inside the block, during which the publisher cannot rewrite
    the segment (a shared flock). Used by `load_weights` and, inside vLLM's worker, by engine/vllm_worker.py."""
    try:
        fd = _posixshmem.shm_open("/" + handle.location, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        raise StaleWeights(f"weight sync: version {handle.version} (segment {handle.location}) was freed; "
                           "load a newer handle") from None
    mem = None
    views: dict[str, Tensor] = {}
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the publisher rewrites this segment
        # Private (copy-on-write) so that torch gets a writable buffer; we only read it.
        mem = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        size = int.from_bytes(mem[:8], "little")
        header = json.loads(mem[8 : 8 + size])
        if header.get("magic") != _MAGIC:
            raise RuntimeError(f"weight sync: segment {handle.location} is not a weights segment")
        if header.get("version") != handle.version:
            raise StaleWeights(f"weight sync: segment {handle.location} was reused for version "
                               f"{header.get('version')}; load a newer handle than {handle.version}")
        views = _views(mem, _align(8 + size), header["tensors"])
        yield views
    finally:
        views.clear()  # no exported buffers may remain when the mapping is closed
        if mem is not None:
            with contextlib.suppress(BufferError):  # a view still held by a traceback: closed when collected
                mem.close()
        os.close(fd)  # releases the lock


def _load_shm(handle: WeightHandle, into: dict[str, Tensor] | None) -> dict[str, Tensor]:
    with shm_views(handle) as views:
        if into is not None:
            return _copy_into(into, views)
        return {name: v.clone() for name, v in views.items()}  # owned: the segment is rewritten later


# ---------------------------------------------------------------- CUDA IPC
#
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

    def __init__(self, *, keep: int = 2, dtype: torch.dtype | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("weight sync: runtime.weight_transport=cuda_ipc needs a CUDA GPU (use shm)")
        super().__init__(keep)
        self.dtype = dtype

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        off = [n for n, t in weights.items() if not t.is_cuda]
        if off:
            raise ValueError(f"weight sync: cuda_ipc publishes CUDA tensors; {off[:3]} are on "
                             f"{weights[off[0]].device} (trainer.device must be a GPU)")
        with torch.no_grad():
            snap = {n: t.detach().to(dtype=self.dtype or t.dtype, copy=True).contiguous() for n, t in weights.items()}
        torch.cuda.synchronize()  # the copies are complete before another process reads them
        return snap, WeightHandle(transport=self.transport, version=version, nbytes=_nbytes(snap),
                                  payload=ipc_payload(snap))

    def _release(self, snap: dict[str, Tensor]) -> None:
        snap.clear()
        torch.cuda.ipc_collect()  # frees the blocks other processes have stopped mapping


# ---------------------------------------------------------------- broadcast


class BroadcastPublisher(WeightPublisher):
    """Rank 0 of a weight group (trainer/weight_group.py). publish returns the handle at once and broadcasts on a
    thread of its own (the first one also waits there for the receivers to join), so the handle can reach the
    engine, whose workers receive meanwhile; `settle` waits for it (bounded by timeout_s) and raises what failed."""

    transport = Transport.BROADCAST

    def __init__(self, *, receivers: int, dtype: torch.dtype | None, bucket_bytes: int, timeout_s: float,
                 host: str = "127.0.0.1", wire: str = "buckets"):
        from loomrl.trainer.weight_group import GroupAddress, host_store

        super().__init__(keep=1)
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.wire = wire  # "tensors" for an SGLang server (trainer/weight_group.py)
        self._store = host_store(host, receivers + 1, timeout_s)
        self.address = GroupAddress(host=host, port=self._store.port, world_size=receivers + 1, timeout_s=timeout_s,
                                    name=f"loomrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}", backend="gloo")
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        from loomrl.trainer.weight_group import describe

        self.settle()
        backend = "nccl" if next(iter(weights.values())).is_cuda else "gloo"
        if self._group is None:
            self.address.backend = backend  # the first version's tensors decide; later ones are on the same device
        meta = describe(weights, self.dtype, self.bucket_bytes, self.wire)
        self._thread = threading.Thread(target=self._send, args=(weights, meta), name="loomrl-weight-broadcast",
                                        daemon=True)  # a receiver that never comes must not hold the process
        self._thread.start()
        nbytes = sum(math.prod(s) * getattr(torch, d).itemsize for d, s in zip(meta["dtypes"], meta["shapes"]))
        return None, WeightHandle(transport=self.transport, version=version, nbytes=nbytes,
                                  payload={"group": dataclasses.asdict(self.address), **meta})

    def _send(self, weights: dict[str, Tensor], meta: dict[str, Any]) -> None:
        from loomrl.trainer.weight_group import WeightGroup

        try:
            if self._group is None:
                device = next(iter(weights.values())).device
                self._group = WeightGroup(self.address, 0, device, store=self._store)
            self._group.send(weights, meta)
        except BaseException as err:  # noqa: BLE001 - raised by settle, in the trainer's thread
            self._error = err

    def settle(self) -> None:
        if self._thread is not None:
            self._thread.join(self.address.timeout_s + 30)
            if self._thread.is_alive():
                raise BroadcastFailed(f"weight sync: the broadcast of the last version did not end within "
                                      f"{self.address.timeout_s:.0f}s (did the engine receive it?)")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise BroadcastFailed(f"weight sync: broadcasting the weights failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(1.0)  # a receiver that will not come (the run is ending): left to its timeout
        super().close()


# ---------------------------------------------------------------- safetensors files


def _file_name(version: int) -> str:
    return f"weights-v{version:010d}.safetensors"


class FilePublisher(WeightPublisher):
    transport = Transport.FILE

    def __init__(self, folder: str | Path | None = None, *, keep: int = 2, fsync: bool = True):
        super().__init__(keep)
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="loomrl-weights-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        from safetensors.torch import save_file

        final = self.folder / _file_name(version)
        tmp = self.folder / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"  # readers never list dot files
        try:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in weights.items()}, str(tmp),
                      metadata={"version": str(version)})
            if self.fsync:  # the bytes are on disk before the name points at them
                _fsync(tmp)
            os.replace(tmp, final)
            if self.fsync:
                _fsync(self.folder)
        finally:
            tmp.unlink(missing_ok=True)
        return final, WeightHandle(transport=self.transport, version=version, nbytes=_nbytes(weights),
                                   location=str(final))

    def _release(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def close(self) -> None:
        super().close()
        if self._own_folder:
            for leftover in self.folder.iterdir():
                leftover.unlink(missing_ok=True)
            self.folder.rmdir()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_file(path: str, version: int) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt")
    except FileNotFoundError:
        raise StaleWeights(f"weight sync: version {version} ({path}) was freed; load a newer handle") from None
    # Once open, the file's contents stay readable even if the publisher unlinks it meanwhile.
    found = int((f.metadata() or {}).get("version", -1))
    if found != version:
        raise RuntimeError(f"weight sync: {path} holds version {found}, the handle says {version}")
    return {name: f.get_tensor(name) for name in f.keys()}
