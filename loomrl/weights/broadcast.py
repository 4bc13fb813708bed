"""The "broadcast" transport: each version broadcast over a process group with the engine's workers (group.py)."""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from typing import Any

import torch

from loomrl.weights.handle import (
    BroadcastFailed,
    Transport,
    WeightHandle,
    WeightPublisher,
)
from loomrl.weights.source import WeightSource

Tensor = torch.Tensor


class BroadcastPublisher(WeightPublisher):
    """Rank 0 of a weight group (group.py). publish returns the handle at once and broadcasts on a
    thread of its own (the first one also waits there for the receivers to join), so the handle can reach the
    engine, whose workers receive meanwhile; `settle` waits for it (bounded by timeout_s) and raises what failed."""

    transport = Transport.BROADCAST
    sends_later = True

    def __init__(self, *, receivers: int, dtype: torch.dtype | None, bucket_bytes: int, timeout_s: float,
                 host: str = "127.0.0.1", wire: str = "buckets"):
        from loomrl.weights.group import GroupAddress, host_store

        super().__init__(keep=1, dtype=dtype, bucket_bytes=bucket_bytes)
        self.wire = wire  # "tensors" for an SGLang server (group.py)
        self._store = host_store(host, receivers + 1, timeout_s)
        self.address = GroupAddress(host=host, port=self._store.port, world_size=receivers + 1, timeout_s=timeout_s,
                                    name=f"loomrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}", backend="gloo")
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        from loomrl.weights.fingerprint import Fingerprint, Tap
        from loomrl.weights.group import describe

        self.settle()
        backend = "nccl" if source.device.type == "cuda" else "gloo"
        if self._group is None:
            self.address.backend = backend  # the first version's tensors decide; later ones are on the same device
        # taken before the thread reads the source (publish's Tap is complete only once the send is)
        fingerprint = source.ahead() if isinstance(source, Tap) else None
        trailer: list[str] = []
        if isinstance(source, Tap) and fingerprint is not None and not fingerprint.sums and self.wire == "buckets":
            # a sharded trainer's: the Tap's sums are sent after the last bucket, which the engine reports (group.py)
            trailer, fingerprint = sorted(source.names), Fingerprint(follows=True)
        meta = describe(source, self.wire, trailer)
        # The source is read on the thread: a sharded trainer's gathers (collectives of every trainer rank) run there,
        # bucket by bucket, as the receivers take each one.
        self._thread = threading.Thread(target=self._send, args=(source, meta), name="loomrl-weight-broadcast",
                                        daemon=True)  # a receiver that never comes must not hold the process
        self._thread.start()
        return None, WeightHandle(transport=self.transport, version=version, nbytes=source.nbytes,
                                  payload={"group": dataclasses.asdict(self.address), **meta}, fingerprint=fingerprint)

    def _send(self, source: WeightSource, meta: dict[str, Any]) -> None:
        from loomrl.weights.fingerprint import Tap
        from loomrl.weights.group import WeightGroup

        try:
            if source.device.type == "cuda":  # this thread's current device is cuda:0 otherwise (NCCL's, the casts')
                torch.cuda.set_device(source.device)
            if self._group is None:
                self._group = WeightGroup(self.address, 0, source.device, store=self._store)
            self._group.send(source, meta)
            if meta["trailer"] and isinstance(source, Tap):  # it has read every bucket now: its sums are complete
                self._group.send_sums(source.fingerprint(), meta["trailer"])
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
