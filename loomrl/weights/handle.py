"""What every weight transport shares: the handle that travels to the engines, the errors, and the publisher's base
(strictly increasing versions, the window of versions still held, the timing). Transports: the modules beside this one."""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from loomrl.weights.adapter import AdapterMeta
from loomrl.weights.fingerprint import Fingerprint, Tap
from loomrl.weights.source import WeightSource, as_source

Tensor = torch.Tensor


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


class VersionNotDelivered(RuntimeError):
    """A version sent once (broadcast, or pushed a bucket at a time: train_pool/push.py) did not reach every engine: the
    run reads it as an engine lost, since that version cannot be sent again."""


class BroadcastFailed(VersionNotDelivered):
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
    # checksums of a few tensors as published (weights/fingerprint.py); None: a handle no publisher made (ray)
    fingerprint: Fingerprint | None = None
    # under trainer.lora publish=adapter: the tensors are a LoRA adapter's (weights/adapter.py), applied by
    # Engine.update_adapter; None: full weights (Engine.update_weights)
    adapter: AdapterMeta | None = None


class LoadedWeights(NamedTuple):
    weights: dict[str, Tensor]  # owned by the caller: nothing else writes or frees them
    version: int
    load_s: float


class WeightPublisher(ABC):
    """What every transport shares: strictly increasing versions, the window of the last `keep` still
    held (a version falling out of it goes to `_release`), and the timing of publish."""

    transport: Transport
    sends_later = False  # broadcast: the version is read after publish returns (its handle's fingerprint is its own)
    # cuda_ipc: a version leaving the window is released before the next is snapshotted, so that the trainer's GPU never
    # holds keep + 1 snapshots (at keep=1 one, not two: a whole model's worth). The others keep the old version until
    # the new one is whole (shm rewrites the released segment as a spare, file readers may still be reading it).
    releases_first = False

    def __init__(self, keep: int, *, dtype: torch.dtype | None = None, bucket_bytes: int = 64 << 20):
        """`dtype`: the engine's, what every version is published in (None: the tensors' own); `bucket_bytes`: the
        size of the runs the tensors are cast and copied in (weights/source.py)."""
        self.keep = keep
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self._last: int | None = None
        self._held: deque[tuple[int, Any]] = deque()  # (version, what the transport holds for it)

    def publish(self, weights: dict[str, Tensor] | WeightSource, version: int) -> WeightHandle:
        """Snapshot `weights` as `version` (the caller may keep training them in place right after, except under
        broadcast: `settle` first). A dict is cast to this publisher's dtype bucket by bucket; a WeightSource (a
        sharded trainer's, gathered a bucket at a time) comes in the dtype its maker asked for (`source_for`)."""
        if self._last is not None and version <= self._last:
            raise ValueError(f"publish: version {version} is not above the last published one ({self._last})")
        start = time.perf_counter()
        while self.releases_first and len(self._held) >= self.keep:
            self._release(self._held.popleft()[1])
        source = as_source(weights, self.dtype, self.bucket_bytes)
        tap = Tap(source)  # fingerprints the buckets as they are read
        resource, handle = self._snapshot(tap, version)
        handle.adapter = source.adapter  # an adapter's tensors (trainer.lora publish=adapter) or None: full weights
        if not self.sends_later:
            handle.fingerprint = tap.fingerprint()
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
    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        """Write `version` completely; returns what stays held for it and its handle."""

    def _release(self, resource: Any, /) -> None:  # noqa: B027 - a hook: not every transport frees anything
        """`resource` is out of the window (nothing to free by default). Positional: each transport names its own."""



def copy_into(into: dict[str, Tensor], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Copy `weights` into the tensors of `into` of the same names (cast to their dtype and device); `into`."""
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
    out = {"weight_sync/publish_s": handle.publish_s, "weight_sync/load_s": loaded.load_s if loaded else 0.0,
           "weight_sync/bytes": float(handle.nbytes)}
    if handle.adapter is not None:  # the bytes of an adapter-only version (trainer.lora publish=adapter)
        out["weight_sync/adapter_bytes"] = float(handle.nbytes)
    return out


def nbytes(weights: dict[str, Tensor]) -> int:
    """The bytes of `weights` in their own dtypes."""
    return sum(t.numel() * t.element_size() for t in weights.values())
