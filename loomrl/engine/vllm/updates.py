"""What a weight update hands vLLM's worker (engine/vllm/worker.py's kinds), for the in-process adapter: tensors in
buckets of the loomrl_inline wire format, a handle the worker opens itself (a trainer's shm segment, CUDA IPC handles,
a broadcast over the trainer's group), or a version streamed a bucket at a time from a colocated trainer's buffer.
Names and shapes are checked against the served model first, so that a mismatch is refused before vLLM is touched.

What it is not: the load itself (engine/vllm/control.py runs it on the adapter's loop) or a transport.
"""

from __future__ import annotations

import base64
import concurrent.futures
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loomrl.engine.base import EngineFault
from loomrl.engine.bucket_feed import BucketFeed
from loomrl.engine.vllm.served import ServedModel
from loomrl.engine.vllm.weights import checked_weights, to_wire, weight_buckets
from loomrl.errors import named_line
from loomrl.weights.bucket import BucketRef
from loomrl.weights.handle import Transport, WeightHandle
from loomrl.weights.shm import shm_views


def tensor_updates(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int,
                   skip: list[str]) -> Iterator[dict[str, Any]]:
    """One inline update per bucket of `named` (checked), cast to `dtype`; `skip`: names the worker must not load."""
    return ({**to_wire(bucket), "skip": skip} for bucket in weight_buckets(named, dtype, bucket_bytes))


def checked_names(shapes: dict[str, list[int]], model: ServedModel, broken: str | None) -> list[str]:
    """The names of a version given by its shapes that the served model loads (tied aliases left out), checked as
    update_weights checks tensors (EngineFault before vLLM is touched)."""
    metas = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    return [n for n, _ in checked_weights(metas, model.shapes, model.aliases, broken)]


def handle_update(handle: WeightHandle, model: ServedModel, broken: str | None,
                  opens: frozenset[Transport]) -> dict[str, Any]:
    """The update for a handle vLLM's worker reads itself: a shm segment through views of its mapping (here: the
    header only), CUDA IPC handles mapped on its GPU, a broadcast over the trainer's group (every bucket is received, a
    collective); each loads `names` only (no tied alias)."""
    if handle.transport is Transport.SHM:
        with shm_views(handle) as views:
            named = checked_weights(views, model.shapes, model.aliases, broken)
        return {"segment": handle.location, "version": handle.version, "names": [n for n, _ in named]}
    if handle.transport not in opens:
        raise EngineFault(f"update_from: vLLM's worker does not read {handle.transport} handles (opens: "
                          f"{sorted(opens)})")
    p = handle.payload
    keep = checked_names(dict(zip(p["names"], p["shapes"])), model, broken)
    if handle.transport is Transport.BROADCAST:
        return {"broadcast": p, "names": keep, "version": handle.version}
    return {"ipc": base64.b64encode(pickle.dumps(p)).decode("ascii"), "names": keep, "version": handle.version}


@dataclass(slots=True, kw_only=True)
class Stream:
    """A version streamed a bucket at a time (base.StreamsBuckets): its feed, which the load on the loop reads, the
    names it loads, and that load's future."""

    feed: BucketFeed
    names: frozenset[str]
    future: concurrent.futures.Future

    def __post_init__(self) -> None:
        feed = self.feed
        self.future.add_done_callback(lambda f: feed.stop(_why_ended(f)))

    def put(self, ref: BucketRef, skip: list[str]) -> None:
        """Hand one bucket to the load; returns once it is loaded (the trainer may overwrite its buffer)."""
        wanted = [n for n in ref.names if n in self.names]  # tied aliases left out, as update_from leaves them
        if ref.kind is Transport.SHM:
            update: dict[str, Any] = {"segment": ref.location, "version": ref.seq, "names": wanted}
        else:
            update = {"ipc": base64.b64encode(pickle.dumps(ref.payload)).decode("ascii"), "names": wanted}
        try:
            self.feed.put({**update, "copy": True, "skip": skip})
        except (RuntimeError, TimeoutError) as err:
            raise EngineFault(f"load_bucket {ref.seq}: {err}") from None


def _why_ended(future: concurrent.futures.Future) -> str:
    """How an update's future ended, for its BucketFeed: "" when it did not fail."""
    err = None if future.cancelled() else future.exception()
    return "" if err is None else named_line(err)
