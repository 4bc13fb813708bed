"""The colocated route's reused buffer (weights/bucket.py) and the engine side's feed (engine/bucket_feed.py).

The shared-memory buffer is the route's CPU form and runs for real (read back through shm_views, as vLLM's worker
reads it); the CUDA buffer cannot run here, so its layout (weights/ipc.py flat_views, the one the engine's worker
rebuilds the bucket with) is checked on a CPU tensor; its IPC handle is gpu_smoke's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from loomrl.engine.bucket_feed import BucketFeed
from loomrl.weights.handle import StaleWeights, Transport, WeightHandle
from loomrl.weights.ipc import flat_views
from loomrl.weights.shm import ShmBucketBuffer, shm_views
from loomrl.weights.source import DictSource, bucket_size


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(64, 32, generator=g), "norm": torch.randn(32, generator=g),
            "proj": torch.randn(32, 48, generator=g), "head": torch.randn(48, 64, generator=g)}


def _read(ref) -> dict[str, torch.Tensor]:
    handle = WeightHandle(transport=Transport.SHM, version=ref.seq, nbytes=0, location=ref.location)
    with shm_views(handle) as views:
        return {n: v.clone() for n, v in views.items()}


def test_one_segment_holds_one_bucket_at_a_time_and_every_bucket_reads_back_bit_equal():
    weights = _weights()
    source = DictSource(weights, torch.bfloat16, bucket_bytes=4096)
    plan = source.plan()
    assert len(plan) >= 3
    buffer = ShmBucketBuffer()
    buffer.prepare(plan)
    try:
        # the room of the largest bucket, not the version
        assert buffer.capacity == max(bucket_size(b) for b in plan) < source.nbytes / 2
        refs = []
        for entries, bucket in zip(plan, source.buckets(), strict=True):
            ref = buffer.fill(entries, bucket)
            got = _read(ref)
            assert list(got) == [e.name for e in entries] == ref.names
            for name, t in got.items():
                assert t.dtype == torch.bfloat16 and torch.equal(t, weights[name].to(torch.bfloat16)), name
            refs.append(ref)
        assert len({r.location for r in refs}) == 1 and [r.seq for r in refs] == list(range(1, len(plan) + 1))
        with pytest.raises(StaleWeights):  # the segment moved on: an old bucket is not read as the new one
            _read(refs[0])
    finally:
        buffer.close()


def test_a_fill_while_the_engine_still_reads_the_last_bucket_is_refused():
    source = DictSource(_weights(), bucket_bytes=4096)
    plan = source.plan()
    buffer = ShmBucketBuffer()
    buffer.prepare(plan)
    buckets = source.buckets()
    try:
        ref = buffer.fill(plan[0], next(buckets))
        handle = WeightHandle(transport=Transport.SHM, version=ref.seq, nbytes=0, location=ref.location)
        with shm_views(handle):  # the reader's shared lock
            with pytest.raises(RuntimeError, match="still reads bucket 1"):
                buffer.fill(plan[1], next(buckets))
        # the lock was the reader's, released with the block: the next fill goes through
        ref = buffer.fill(plan[1], list(zip([e.name for e in plan[1]], [source.weights[e.name] for e in plan[1]])))
        assert ref.seq == 3 and set(_read(ref)) == {e.name for e in plan[1]}
    finally:
        buffer.close()


def test_a_bucket_larger_than_the_prepared_room_is_refused():
    source = DictSource(_weights(), bucket_bytes=4096)
    buffer = ShmBucketBuffer()
    buffer.prepare(source.plan()[:1])
    try:
        big = max(source.plan(), key=bucket_size)
        with pytest.raises(ValueError, match="prepare it with the version's plan"):
            buffer.fill(big, [(e.name, source.weights[e.name]) for e in big])
    finally:
        buffer.close()


def test_the_flat_layout_the_cuda_buffer_writes_is_the_one_its_reader_rebuilds():
    """CudaBucketBuffer copies each tensor into flat_views of its uint8 buffer; the engine's worker rebuilds the same
    buffer from the IPC handle and reads it through flat_views of the payload's entries (weights/ipc.py)."""
    source = DictSource(_weights(), torch.bfloat16, bucket_bytes=1 << 20)
    [entries] = source.plan()
    layout = [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]
    buffer = torch.zeros(bucket_size(entries), dtype=torch.uint8)
    for bucket in source.buckets():  # one bucket (valid until the next is asked for)
        for name, t in bucket:
            flat_views(buffer, layout)[name].copy_(t)
    read = flat_views(buffer.clone(), layout)
    assert all(e.offset % 64 == 0 for e in entries)
    for name, t in source.weights.items():
        assert torch.equal(read[name], t.to(torch.bfloat16)), name


def test_the_feed_hands_each_bucket_over_and_returns_once_it_is_loaded():
    feed = BucketFeed(timeout_s=10)
    loaded: list[int] = []

    def consume() -> None:
        for item in feed:
            time.sleep(0.05)  # the engine's load
            loaded.append(item)

    t = threading.Thread(target=consume)
    t.start()
    for k in range(3):
        feed.put(k)
        assert loaded == list(range(k + 1))  # put returned only once the bucket was loaded: the buffer is free
    feed.end()
    t.join(5)
    assert not t.is_alive() and loaded == [0, 1, 2]


def test_the_feed_fails_the_update_when_the_trainer_abandons_the_version_or_goes_silent():
    feed = BucketFeed(timeout_s=10)
    feed.end(failed="rank 1 died")
    with pytest.raises(RuntimeError, match="trainer stopped sending the version: rank 1 died"):
        next(iter(feed))
    silent = BucketFeed(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no bucket came from the trainer within"):
        next(iter(silent))


def test_the_trainer_hears_when_the_engine_stops_reading_or_never_loads():
    feed = BucketFeed(timeout_s=10)
    threading.Timer(0.1, feed.stop, args=("EngineFault: vLLM: out of memory",)).start()
    with pytest.raises(RuntimeError, match="engine stopped reading the version's buckets: EngineFault"):
        feed.put("bucket")  # nobody consumes it; the consumer's end wakes the producer at once, not at the timeout
    stuck = BucketFeed(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="did not load bucket 1 within"):
        stuck.put("bucket")


def test_a_bucket_put_before_the_engine_first_asks_is_not_taken_as_loaded():
    """The update starts reading only once vLLM's update is open (the weights' wake, the pause): a bucket the trainer
    put before then must still wait for its load, not count as finished when the first `next` arrives."""
    feed = BucketFeed(timeout_s=10)
    loaded: list[str] = []
    returned = threading.Event()

    def put() -> None:
        feed.put("bucket 1")
        returned.set()

    producer = threading.Thread(target=put)
    producer.start()
    time.sleep(0.2)  # the producer waits in put before the consumer's first call
    items = iter(feed)
    item = next(items)
    assert not returned.wait(0.3), "put returned before the bucket was loaded"
    loaded.append(item)
    feed.end()
    assert list(items) == []  # the call for the next one finishes bucket 1
    assert returned.wait(5) and loaded == ["bucket 1"]
    producer.join(5)
