"""A colocated trainer rank's half of the streamed route (runtime.weight_transport=cuda_ipc on Ray with
engine.sleep_while_training; weights/bucket.py says why): it hands the engine actor on its GPU each version a bucket at a
time through one reused buffer, while the engine's K/V cache still sleeps and the rank's state is still on the GPU.

Order, per rank and version (train_pool/process.py colocated_step calls it between the step and the offload):
open_buckets (the engine checks the names and shapes, takes its weights' memory back and opens vLLM's update) ->
for each bucket: fill the buffer, load_bucket (returns once the engine's worker loaded it, so the buffer is free) ->
close_buckets with the rank's fingerprint of the version (the engine finishes the update and confirms it). Every call
is bounded by `timeout_s`; a failure mid-version closes the engine's update as failed (it refuses requests until a
whole version loads) and raises VersionNotDelivered, which the run reads as an engine lost (a version goes once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from loomrl.errors import error_line
from loomrl.weights.bucket import BucketBuffer
from loomrl.weights.fingerprint import Tap
from loomrl.weights.handle import VersionNotDelivered
from loomrl.weights.source import WeightSource


@dataclass(slots=True, kw_only=True)
class PushReport:
    """One version pushed by one rank, for the step's metrics."""

    version: int
    buckets: int
    bytes: int  # the version's, in the engine's dtype
    buffer_bytes: int  # what the rank held for it: one bucket's room, not the version
    push_s: float  # open to close, the engine's loads included
    confirm_s: float
    fingerprinted: int  # tensors the engine's fingerprint was compared on


def bucket_buffer(device: torch.device) -> BucketBuffer:
    """The buffer for a rank on `device`: GPU memory mapped through CUDA IPC, or on a CPU (the tests' form of the same
    route) a shared-memory segment."""
    if device.type == "cuda":
        from loomrl.weights.ipc import CudaBucketBuffer

        return CudaBucketBuffer(device)
    from loomrl.weights.shm import ShmBucketBuffer

    return ShmBucketBuffer()


class EnginePusher:
    """Pushes versions to one engine actor (`engine`, an EngineActor handle on this rank's GPU) through `buffer`."""

    def __init__(self, engine: Any, buffer: BucketBuffer, *, timeout_s: float, label: str):
        self.engine, self.buffer, self.timeout_s, self.label = engine, buffer, timeout_s, label

    def push(self, source: WeightSource, version: int) -> PushReport:
        """`source` (read to the end: a sharded rank's is a collective) as `version`; the buffer is freed after it
        (the GPU is the engine's until the next step)."""
        try:
            return self._push(source, version)
        finally:
            self.buffer.close()

    def _push(self, source: WeightSource, version: int) -> PushReport:
        start = time.perf_counter()
        tap = Tap(source)
        plan = tap.plan()
        self.buffer.prepare(plan)
        held = self.buffer.capacity
        self._call(self.engine.open_buckets.remote(version, {s.name: list(s.shape) for s in source.specs}), "open")
        count = 0
        try:
            for entries, bucket in zip(plan, tap.buckets(), strict=True):
                ref = self.buffer.fill(entries, bucket)
                self._call(self.engine.load_bucket.remote(ref), f"bucket {count + 1} of {len(plan)}")
                count += 1
        except BaseException as err:
            # the engine's update ends failed (bounded: a dead engine does not hold the rank)
            try:
                self._call(self.engine.close_buckets.remote(version, None, error_line(err)), "close")
            except VersionNotDelivered:
                pass
            if isinstance(err, VersionNotDelivered):
                raise
            raise VersionNotDelivered(f"weight sync: {self.label}: version {version} stopped at bucket {count + 1} of "
                                      f"{len(plan)}: {error_line(err)}") from err
        pushed = time.perf_counter()
        done = self._call(self.engine.close_buckets.remote(version, tap.fingerprint()), "close")
        return PushReport(version=version, buckets=count, bytes=source.nbytes, buffer_bytes=held,
                          push_s=pushed - start, confirm_s=done["confirm_s"], fingerprinted=done["fingerprinted"])

    def _call(self, ref: Any, what: str) -> Any:
        import ray
        import ray.exceptions

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise VersionNotDelivered(f"weight sync: {self.label} did not answer {what} within "
                                      f"{self.timeout_s:.0f} s (engine.vllm.update_timeout_s)") from None
        except ray.exceptions.RayError as err:
            raise VersionNotDelivered(f"weight sync: {self.label}: {what} failed: {error_line(err, end=True)}") from None
