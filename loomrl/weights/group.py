"""A process group of the trainer and an engine's workers, over which each published version is broadcast
(runtime.weight_transport=broadcast): NCCL when the tensors are on GPUs (trainer and engine on different GPUs), gloo
when they are on CPUs (what the tests run). Rank 0 is the trainer's publisher; ranks 1.. are the engine's processes
(vLLM's workers, one per tensor-parallel rank, an SGLang server's, or the process holding a built-in engine); with
several engines (Ray engine actors) each engine's processes take the ranks from its payload's "rank_offset" on.

How the two sides meet: the publisher opens the group on its first publish, under a name and a port of its own, and
puts them in every handle (`GroupAddress`); a receiver joins when it sees a handle of a group it has not joined (a
restarted trainer is a new group: the old one is dropped). The TCPStore rendezvous and every broadcast are bounded by
`timeout_s`.

The wire: both sides cut the same buckets from the version's names, dtypes and shapes (`plan_buckets`); each bucket is
one flat uint8 tensor of about `bucket_bytes`, so a version costs a few collectives, not one per tensor. For an SGLang
server the wire is "tensors", one broadcast per tensor in its dtype: what /update_weights_from_distributed receives. The
server takes one such call per bucket (engine/sglang.py; it allocates every tensor a call names before receiving, so a
whole-model call would need a second copy of the model); the sender broadcasts a bucket's tensors and waits until they
are received (the server's call for that bucket is running) before it reads the next bucket, so neither side holds more
than a bucket. That wait is bounded by `timeout_s`, on NCCL too (where a broadcast returns before it completes).

A sharded trainer's version is fingerprinted only as it is sent (weights/fingerprint.py), so on the "buckets" wire the
publisher's sums of the tensors meta["trailer"] names follow the last bucket as one more broadcast ([n, 2] float64:
`send_sums` / `receive_sums`), for the receiving engine to report beside its own (the "tensors" wire, SGLang's, carries
none: SGLang would not receive it).

The group itself is made as torch's tcp:// rendezvous and _new_process_group_helper make one, which is what SGLang's
/init_weights_update_group does (init_custom_process_group), so both engines join the same kind of group. The sender
casts to the engine's dtype as it packs, reading the live parameters: the trainer must not step them until the
broadcast is over (BroadcastPublisher.settle, weights/broadcast.py).

What it is not: a transport across trainer ranks (a sharded trainer's ranks gather each bucket for rank 0 first:
train_pool/distributed.py GatheredSource, read on the publisher's thread) or fault tolerant (a receiver that dies mid-version leaves the sender to time out; the run then stops).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loomrl.collectives import bounded_nccl
from loomrl.weights.fingerprint import Fingerprint, TensorSum
from loomrl.weights.source import Entry, WeightSource, bucket_size, dtype_name, plan_buckets

Tensor = torch.Tensor


@dataclass(slots=True, kw_only=True)
class GroupAddress:
    """Where and under what name a publisher's group meets; travels in each handle (plain fields: picklable)."""

    host: str
    port: int
    world_size: int  # the publisher and every receiving process
    name: str  # unique per publisher: a new trainer process is a new group
    timeout_s: float
    backend: str  # "nccl" (CUDA tensors) or "gloo" (CPU tensors): every rank's


def host_store(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's TCPStore on a port the system picks (read it from `.port`); it does not wait for the others here."""
    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@contextlib.contextmanager
def _unbound_default_group() -> Generator[None, None, None]:
    """While a weight group is made: a default group bound to a device (init_process_group(device_id=...), as vLLM's
    workers do with VLLM_DISTRIBUTED_USE_SPLIT_GROUP) would make torch split the new group's NCCL communicator from
    the default group's (distributed_c10d _new_process_group_helper, _get_split_source), a collective of every rank of
    that group, which only this process calls: it would hang. Unbound, the new group makes a communicator of its
    own."""
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    bound = default.bound_device_id if default is not None else None
    if default is None or bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


WATCHDOG_MARGIN = datetime.timedelta(seconds=120)  # the group's own timeout past loomrl's deadline (WeightGroup)


class WeightGroup:
    """One side's handle on the group: rank 0 sends (over `store`, its host_store), the others receive. Making it
    meets the other ranks in the store (raising after timeout_s); NCCL makes its communicator at the first broadcast,
    bounded like every bucket by `_received`'s deadline."""

    def __init__(self, address: GroupAddress, rank: int, device: torch.device, store: Any = None):
        from torch.distributed.distributed_c10d import GroupName, _new_process_group_helper

        self.address = address
        self.rank = rank
        self.device = device
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.world_size, False, timeout=timeout)
        self._store = store  # rank 0 hosts the TCPStore: it lives as long as the group
        # The keys and the group as torch's tcp:// rendezvous and _new_process_group_helper make them, which is what
        # SGLang's init_custom_process_group does on its side (/init_weights_update_group), so that one group
        # implementation serves vLLM's workers (ours) and an SGLang server alike.
        prefixed = dist.PrefixStore(f"tcp://{address.host}:{address.port}", store)
        if address.backend == "nccl":  # a receiver that dies mid-version: an error at both ends, not a teardown
            bounded_nccl()
        # NCCL: the group's own timeout (its watchdog's) outlasts loomrl's per-bucket deadline (`_received`), so a bucket
        # that is late is this code's TimeoutError first, and the group is aborted here then: the watchdog's copy of a
        # work keeps its exception to itself (ProcessGroupNCCL workMetaList_), and after its abort the work reads as
        # completed with none, so a late bucket must never be left to the watchdog.
        with _unbound_default_group():
            self._pg, _ = _new_process_group_helper(address.world_size, rank, [], address.backend, prefixed,
                                                    group_name=GroupName(address.name),
                                                    timeout=timeout + WATCHDOG_MARGIN if address.backend == "nccl"
                                                    else timeout)  # gloo raises in the caller, and meets by it

    def _start(self, tensor: Tensor) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._pg.broadcast([tensor], opts)

    def _broadcast(self, tensor: Tensor, what: str) -> None:
        deadline = time.monotonic() + self.address.timeout_s  # from before the enqueue, as the watchdog counts
        self._received([self._start(tensor)], what, deadline)

    def _received(self, works: list[Any], what: str, deadline: float) -> None:
        """Returns once every broadcast in `works` has completed (every receiver has it), or raises by `deadline`.
        Polled: an NCCL work's wait() only orders the stream, it does not wait for the receivers. Late: the group is
        aborted (its kernels end) and TimeoutError raised; failed: what the work reports (a peer's error NCCL saw)."""
        for work in works:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self._abort()
                    raise TimeoutError(f"{what} was not received within {self.address.timeout_s:.0f}s (did the other "
                                       "end of the weight group stop?); the group is aborted")
                time.sleep(0.001)
            work.wait()  # raises what failed (gloo; NCCL: an error the poll above found)
            if (err := work.exception()) is not None:
                raise RuntimeError(f"{what} failed: {err}")

    def _abort(self) -> None:
        """End the group's pending collectives (NCCL: its communicator), so that nothing waits on a bucket that will
        not come and no later version queues behind it; the run stops on the error (a new trainer, a new group)."""
        with contextlib.suppress(Exception):  # already failed or torn down: nothing left to end
            self._pg.abort()

    def send(self, source: WeightSource, meta: dict[str, Any]) -> None:
        """Broadcast the version `source` gives, as `meta` (describe(source)) says: bucket by bucket, or tensor by
        tensor (wire "tensors": SGLang's /update_weights_from_distributed, one call per bucket, each tensor broadcast on
        its own; a bucket is received whole before the next is read)."""
        if meta["wire"] == "tensors":
            plans = source.plan()
            for k, bucket in enumerate(source.buckets()):
                deadline = time.monotonic() + self.address.timeout_s
                works = [self._start(t.to(self.device).contiguous()) for _, t in bucket]  # each keeps its tensor alive
                self._received(works, f"weight sync: bucket {k + 1} of {len(plans)} ({len(works)} tensors)", deadline)
            return
        with torch.no_grad():
            plans = source.plan()
            for k, (plan, bucket) in enumerate(zip(plans, source.buckets(), strict=True)):
                self._broadcast(self._pack(plan, bucket), f"weight sync: bucket {k + 1} of {len(plans)}")

    def _pack(self, plan: list[Entry], bucket: list[tuple[str, Tensor]]) -> Tensor:
        flat = torch.empty(bucket_size(plan), dtype=torch.uint8, device=self.device)
        for e, (_, t) in zip(plan, bucket, strict=True):
            flat[e.offset:e.offset + e.nbytes].view(t.dtype).view(e.shape).copy_(t)
        return flat

    def receive(self, meta: dict[str, Any]) -> Iterator[list[tuple[str, Tensor]]]:
        """The version `meta` describes, one bucket (or tensor) at a time: views of that bucket's buffer, to be
        consumed (copied out) before the next is asked for."""
        if meta["wire"] == "tensors":
            for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self._broadcast(t, f"weight sync: tensor {name}")
                yield [(name, t)]
            return
        plans = plan_buckets(meta["names"], meta["dtypes"], meta["shapes"], meta["bucket_bytes"])
        for k, bucket in enumerate(plans):
            flat = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=self.device)
            self._broadcast(flat, f"weight sync: bucket {k + 1} of {len(plans)}")
            yield [(e.name, flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape))
                   for e in bucket]

    def send_sums(self, fingerprint: Fingerprint, names: list[str]) -> None:
        """After a version's last bucket: `fingerprint`'s sums of `names` (meta["trailer"]; the publisher's Tap's) to
        every receiver. A name it lacks goes as NaN, which matches nothing (its tensor was never read)."""
        if not names:
            return
        missing = TensorSum("", (), math.nan, math.nan)
        rows = [[fingerprint.sums.get(n, missing).sum, fingerprint.sums.get(n, missing).weighted] for n in names]
        self._broadcast(torch.tensor(rows, dtype=torch.float64, device=self.device), "weight sync: the version's sums")

    def receive_sums(self, meta: dict[str, Any]) -> dict[str, TensorSum]:
        """The publisher's sums that follow the version `meta` describes (after its last bucket), by name, with the
        dtypes and shapes it was published in; empty when its handle carried them (meta["trailer"] empty)."""
        names = meta["trailer"]
        if not names:
            return {}
        rows = torch.empty(len(names), 2, dtype=torch.float64, device=self.device)  # [n, 2]: sum, weighted
        self._broadcast(rows, "weight sync: the version's sums")
        specs = {n: (d, tuple(s)) for n, d, s in zip(meta["names"], meta["dtypes"], meta["shapes"])}
        return {n: TensorSum(specs[n][0], specs[n][1], a, b) for n, (a, b) in zip(names, rows.cpu().tolist())}


class Receiver:
    """A receiving process's membership: the group the latest handle names, joined when it first appears (the one
    before is left: its trainer is gone)."""

    def __init__(self) -> None:
        self.group: WeightGroup | None = None

    def group_for(self, address: dict[str, Any], rank: int, device: torch.device) -> WeightGroup:
        addr = GroupAddress(**address)
        if self.group is None or self.group.address.name != addr.name:
            self.group = None  # dropped first: a failed join leaves no stale group behind
            self.group = WeightGroup(addr, rank, device)
        return self.group

    def receive_all(self, payload: dict[str, Any], device: torch.device) -> tuple[dict[str, Tensor],
                                                                                  dict[str, TensorSum]]:
        """A whole version for an engine that takes tensors (the built-in one): joined as rank payload["rank_offset"],
        every bucket received and copied out, by name; and the publisher's sums that followed it (receive_sums)."""
        group = self.group_for(payload["group"], payload["rank_offset"], device)
        weights = {name: t.clone() for bucket in group.receive(payload) for name, t in bucket}
        return weights, group.receive_sums(payload)


def with_rank_offset(payload: dict[str, Any], rank_offset: int) -> dict[str, Any]:
    """A broadcast handle's payload for the engine whose processes are ranks rank_offset.. (engine actor i of a Ray run
    whose engines have n receivers each: 1 + i * n)."""
    return {**payload, "rank_offset": rank_offset}


def describe(source: WeightSource, wire: str = "buckets", trailer: list[str] | None = None) -> dict[str, Any]:
    """names, dtypes (as published), shapes, bucket_bytes, wire ("buckets" or "tensors"), the engine's first rank
    and the names whose sums follow the last bucket (`trailer`: "buckets" only) of a version: what a receiver needs."""
    if trailer and wire != "buckets":
        raise ValueError(f"weight sync: the {wire!r} wire carries no sums after the weights")
    return {"names": [s.name for s in source.specs], "dtypes": [dtype_name(s.dtype) for s in source.specs],
            "shapes": [list(s.shape) for s in source.specs], "bucket_bytes": source.bucket_bytes, "wire": wire,
            "rank_offset": 1,  # the engine's first rank (one engine: 1, after the publisher; with_rank_offset)
            "trailer": list(trailer or [])}
