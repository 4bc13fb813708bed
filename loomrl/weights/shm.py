"""The "shm" transport: POSIX shared-memory segments, rewritten under flock (the layout and locking below)."""

from __future__ import annotations

import _posixshmem
import contextlib
import fcntl
import json
import math
import mmap
import os
import uuid
from collections.abc import Generator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import torch

from loomrl.weights.bucket import BucketBuffer, BucketRef
from loomrl.weights.handle import (
    StaleWeights,
    Transport,
    WeightHandle,
    WeightPublisher,
    copy_into,
)
from loomrl.weights.source import Entry, WeightSource, bucket_size

Tensor = torch.Tensor

_ALIGN = 64  # every tensor starts on a cache line
_MAGIC = "loomrl-weights-1"


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

    def __init__(self, *, keep: int = 2, spares: int = 1, dtype: torch.dtype | None = None,
                 bucket_bytes: int = 64 << 20):
        super().__init__(keep, dtype=dtype, bucket_bytes=bucket_bytes)
        self._spares: list[_Segment] = []  # out of the window, to be rewritten
        self._max_spares = spares
        self._prefix = f"loomrl-w-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # no clash with a crashed run's leftovers
        self._count = 0

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        # The layout comes from the specs, so the segment is sized before any tensor exists; each bucket is then copied
        # (and cast, on the trainer's device) straight into its place: no other host copy of the version.
        entries, offset = [], 0
        for spec in source.specs:
            entries.append([spec.name, str(spec.dtype), list(spec.shape), offset])
            offset = _align(offset + spec.nbytes)
        header = json.dumps({"magic": _MAGIC, "version": version, "tensors": entries}).encode()
        data_start = _align(8 + len(header))
        size = max(data_start + offset, 1)
        seg = self._take_spare(size)
        if seg is None:
            self._count += 1
            seg = _create_segment(f"{self._prefix}-{self._count}", size)
        try:
            self._write(seg, header, data_start, entries, source)
        except BaseException:
            _free(seg)
            raise
        fcntl.flock(seg.fd, fcntl.LOCK_UN)  # a rewritten spare: readers may look now
        return seg, WeightHandle(transport=self.transport, version=version, nbytes=source.nbytes, location=seg.name)

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
    def _write(seg: _Segment, header: bytes, data_start: int, entries: list, source: WeightSource) -> None:
        views = _views(seg.mem, data_start, entries)
        try:
            with torch.no_grad():
                for bucket in source.buckets():
                    _copy_bucket(views, bucket)
        finally:
            views.clear()  # no exported buffers may remain when the segment is closed
        seg.mem[8 : 8 + len(header)] = header
        seg.mem[:8] = len(header).to_bytes(8, "little")

    def close(self) -> None:
        super().close()
        while self._spares:
            _free(self._spares.pop())


def _copy_bucket(views: dict[str, Tensor], bucket: list[tuple[str, Tensor]]) -> None:
    for name, t in bucket:
        views[name].copy_(t)  # device to host here when the trainer is on a GPU


@contextlib.contextmanager
def shm_views(handle: WeightHandle) -> Generator[dict[str, Tensor], None, None]:
    """The segment's tensors as views (no copy), valid inside the block, during which the publisher cannot rewrite
    the segment (a shared flock). Used by `load_weights` and, inside vLLM's worker, by engine/vllm/worker.py."""
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


def load_shm(handle: WeightHandle, into: dict[str, Tensor] | None) -> dict[str, Tensor]:
    with shm_views(handle) as views:
        if into is not None:
            return copy_into(into, views)
        return {name: v.clone() for name, v in views.items()}  # owned: the segment is rewritten later


class ShmBucketBuffer(BucketBuffer):
    """The CPU form of the colocated route's buffer (weights/bucket.py): one segment, laid out as the publisher's (a
    header naming the bucket's tensors and `seq` in place of a version, then the tensors), rewritten for each bucket
    under an exclusive flock taken without waiting: the reader (shm_views, in the engine's worker) holds a shared one
    while it copies, and the protocol fills only after it said it was done, so a busy segment is an error, not a wait."""

    kind = Transport.SHM

    def __init__(self) -> None:
        super().__init__()
        self._seg: _Segment | None = None
        self._prefix = f"loomrl-b-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._count = 0
        self._header_room = 0

    def _grow(self, nbytes: int, plan: list[list[Entry]]) -> None:
        # the longest header any bucket of the plan needs, with room for a 20-digit seq
        self._header_room = max(len(self._header(b, 10**19)) for b in plan) if plan else 64
        self.close()
        self._count += 1
        self._seg = _create_segment(f"{self._prefix}-{self._count}", _align(8 + self._header_room) + nbytes)

    @staticmethod
    def _header(entries: list[Entry], seq: int) -> bytes:
        tensors = [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]
        return json.dumps({"magic": _MAGIC, "version": seq, "tensors": tensors}).encode()

    def _fill(self, entries: list[Entry], bucket: list[tuple[str, Tensor]]) -> BucketRef:
        seg = self._seg
        assert seg is not None, "ShmBucketBuffer.prepare first"
        header = self._header(entries, self.seq)
        if len(header) > self._header_room:
            raise ValueError("weight sync: a bucket's header is longer than the plan's (prepare with this plan)")
        try:
            fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"weight sync: the engine still reads bucket {self.seq - 1} of segment {seg.name} "
                               "while the trainer fills the next") from None
        try:
            tensors = [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]
            views = _views(seg.mem, _align(8 + self._header_room), tensors)
            try:
                with torch.no_grad():
                    _copy_bucket(views, bucket)
            finally:
                views.clear()
            # the header's length field says where the data starts for the reader: the room, not this header's length
            seg.mem[8 : 8 + self._header_room] = header.ljust(self._header_room)
            seg.mem[:8] = self._header_room.to_bytes(8, "little")
        finally:
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
        return BucketRef(kind=self.kind, seq=self.seq, names=[e.name for e in entries],
                         nbytes=bucket_size(entries), location=seg.name)

    def close(self) -> None:
        if self._seg is not None:
            _free(self._seg)
            self._seg, self.capacity = None, 0
