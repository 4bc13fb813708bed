"""Weight sync transports (loomrl/weights/): exact round trips with the version, snapshots
at publish, whole versions only for a reader in another process while the trainer keeps publishing,
and the freeing of old versions. Ray's transfer is the Ray backend's own (tests/runtime/test_ray_runtime.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest
import torch

from loomrl.weights.handle import StaleWeights, Transport, WeightHandle, sync_metrics
from loomrl.weights.transports import load_weights, make_publisher

LOCAL = [Transport.QUEUE, Transport.SHM, Transport.FILE]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "layer.half": torch.randn(5, generator=g).half(),
        "counts": torch.arange(11, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)  # safetensors stores names sorted
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("transport", LOCAL)
def test_round_trip_is_exact_and_a_snapshot(transport, tmp_path):
    pub = make_publisher(transport, folder=tmp_path / "w")
    try:
        live = _weights()
        want = {n: t.clone() for n, t in live.items()}
        handle = pub.publish(live, 7)
        for t in live.values():  # training goes on in place right after publishing
            if t.numel() and t.is_floating_point():
                t.add_(1.0)
        loaded = load_weights(handle)
        assert loaded.version == 7 and handle.version == 7
        _assert_equal(loaded.weights, want)
        assert handle.nbytes == sum(t.numel() * t.element_size() for t in want.values())
        assert set(sync_metrics(handle, loaded)) == {"weight_sync/publish_s", "weight_sync/load_s", "weight_sync/bytes"}
        into = {n: torch.zeros_like(t) for n, t in want.items()}
        assert load_weights(handle, into=into).weights is into
        _assert_equal(into, want)
        with pytest.raises(ValueError, match="not above"):
            pub.publish(want, 7)
    finally:
        pub.close()


def test_into_rejects_a_shape_mismatch():
    pub = make_publisher("shm")
    try:
        handle = pub.publish({"w": torch.ones(4)}, 1)
        with pytest.raises(ValueError, match="shape"):
            load_weights(handle, into={"w": torch.zeros(1, 4)})
        with pytest.raises(KeyError, match="no destination"):
            load_weights(handle, into={})
    finally:
        pub.close()


def _versioned(version: int) -> dict[str, torch.Tensor]:
    """Every element of every tensor names the version: a mix of two versions cannot pass."""
    return {f"t{k}": torch.full((128, 1024), float(version)) for k in range(8)}  # 4 MiB


def _values(weights: dict[str, torch.Tensor]) -> set[float]:
    return {float(x) for t in weights.values() for x in (t.min(), t.max())}


def _reader(transport: str, handles, acks, results) -> None:
    """Another process: load each handle as it arrives, while the publisher writes the next one."""
    loaded, stale = [], 0
    while (handle := handles.get()) is not None:
        acks.put(handle.version)  # the publisher starts the next version now, while we load this one
        try:
            got = load_weights(handle)
        except StaleWeights:
            stale += 1
            continue
        values = _values(got.weights)
        assert values == {float(got.version)}, f"{transport}: version {got.version} holds {sorted(values)}"
        loaded.append(got.version)
    results.put((loaded, stale))


@pytest.mark.parametrize("transport", LOCAL)
@pytest.mark.integration
def test_a_reader_in_another_process_gets_whole_versions(transport, tmp_path):
    ctx = mp.get_context("spawn")
    handles, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(transport, handles, acks, results))
    child.start()
    pub = make_publisher(transport, folder=tmp_path / "w", keep=2)
    versions = list(range(1, 16))
    try:
        for v in versions:
            handles.put(pub.publish(_versioned(v), v))  # overwrites nothing the reader may be loading
            assert acks.get(timeout=60) == v
        handles.put(None)
        loaded, stale = results.get(timeout=60)
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        pub.close()
    # One version ahead at most, with two kept: the version being loaded is never freed under it.
    assert (loaded, stale) == (versions, 0)


@pytest.mark.integration  # seconds of publishing and loading on threads
@pytest.mark.parametrize("transport", [Transport.SHM, Transport.FILE])
def test_concurrent_publish_and_load_in_threads(transport, tmp_path):
    pub = make_publisher(transport, folder=tmp_path / "w", keep=2)
    latest: list = [None]
    done = threading.Event()
    errors: list[str] = []
    counts = {"loaded": 0, "stale": 0}

    def read() -> None:
        while not done.is_set():
            handle = latest[0]
            if handle is None:
                continue
            try:
                got = load_weights(handle)
            except StaleWeights:
                counts["stale"] += 1
                continue
            values = _values(got.weights)
            if values != {float(got.version)}:
                errors.append(f"version {got.version} holds {sorted(values)}")
            counts["loaded"] += 1

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in range(1, 31):
            latest[0] = pub.publish(_versioned(v), v)
    finally:
        done.set()
        for r in readers:
            r.join(timeout=30)
        pub.close()
    assert not errors
    assert counts["loaded"] > 0


def _segments(prefix: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory is not under /dev/shm here")
def test_shm_reuses_old_segments_and_frees_the_rest():
    pub = make_publisher("shm", keep=2)
    handles = [pub.publish({"w": torch.full((3,), float(v))}, v) for v in range(1, 11)]
    prefix = handles[0].location.rsplit("-", 1)[0]
    assert len(_segments(prefix)) == 3  # the two kept versions and one spare, rewritten in turn
    assert [load_weights(h).version for h in handles[-2:]] == [9, 10]
    with pytest.raises(StaleWeights, match="reused"):  # its segment now holds a newer version
        load_weights(next(h for h in handles[:-2] if h.location == handles[-1].location))
    pub.close()
    assert _segments(prefix) == []
    with pytest.raises(StaleWeights, match="freed"):
        load_weights(handles[-1])


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory is not under /dev/shm here")
def test_shm_never_rewrites_a_segment_a_reader_holds():
    import fcntl

    pub = make_publisher("shm", keep=1)
    first = pub.publish({"w": torch.full((4,), 1.0)}, 1)
    pub.publish({"w": torch.full((4,), 2.0)}, 2)  # version 1's segment is now the spare
    fd = os.open(f"/dev/shm/{first.location}", os.O_RDONLY)  # a slow reader, mid-copy
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        third = pub.publish({"w": torch.full((4,), 3.0)}, 3)
        assert third.location != first.location  # a new segment instead
        assert not Path("/dev/shm", first.location).exists()  # unlinked, but still readable by its reader
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read()
        start = (8 + int.from_bytes(raw[:8], "little") + 63) // 64 * 64  # the first tensor, after the header
        assert torch.frombuffer(bytearray(raw[start : start + 16]), dtype=torch.float32).tolist() == [1.0] * 4
    finally:
        os.close(fd)
    assert torch.equal(load_weights(third).weights["w"], torch.full((4,), 3.0))
    pub.close()


def test_file_keeps_the_last_versions_and_frees_the_rest(tmp_path):
    folder = tmp_path / "weights"
    pub = make_publisher("file", folder=folder, keep=2)
    handles = [pub.publish({"w": torch.full((3,), float(v))}, v) for v in range(1, 5)]
    assert sorted(os.listdir(folder)) == [Path(h.location).name for h in handles[2:]]  # no temp files left
    with pytest.raises(StaleWeights):
        load_weights(handles[1])
    assert torch.equal(load_weights(handles[-1]).weights["w"], torch.full((3,), 4.0))
    pub.close()
    assert folder.is_dir() and not os.listdir(folder)  # the caller's folder stays, emptied
    own = make_publisher("file")
    own.publish({"w": torch.ones(2)}, 1)
    own.close()
    assert not own.folder.exists()  # a folder it made itself goes


def test_a_file_version_is_written_a_bucket_at_a_time_and_one_partly_freed_is_stale(tmp_path):
    """runtime.weight_transport=file: a version is a folder with a file per bucket, in the engine's dtype; a reader
    that finds some of its files gone (the publisher frees it file by file) gets StaleWeights, never part of it."""
    weights = {f"w{i}": torch.full((64,), float(i)) for i in range(6)}  # 256 bytes each in float32
    pub = make_publisher("file", folder=tmp_path / "w", dtype=torch.bfloat16, bucket_bytes=300)
    try:
        handle = pub.publish(weights, 1)
        files = sorted(Path(handle.location).iterdir())
        assert len(files) == 3  # two bfloat16 tensors (128 bytes each, aligned) per bucket
        got = load_weights(handle).weights
        assert {n: (t.dtype, float(t[0])) for n, t in got.items()} == {n: (torch.bfloat16, float(i))
                                                                        for i, n in enumerate(weights)}
        assert handle.nbytes == 6 * 64 * 2
        files[1].unlink()
        with pytest.raises(StaleWeights):
            load_weights(handle)
    finally:
        pub.close()


def test_ray_handles_have_no_publisher_and_no_loader_here():
    """The Ray backend's handle (payload: an ObjectRef) is awaited by the rollout actor, not loaded here."""
    with pytest.raises(ValueError, match="no publisher"):
        make_publisher("ray")
    with pytest.raises(ValueError, match="ObjectRef"):
        load_weights(WeightHandle(transport=Transport.RAY, version=1, nbytes=0, payload=object()))


def _receive_versions(handles, out) -> None:
    """A receiving process (an engine's worker would be one): joins the group the handles name, receives each
    version bucket by bucket, copies it out (the views are of a buffer per bucket) and sends it back."""
    from loomrl.weights.group import Receiver

    receiver = Receiver()
    for payload in iter(handles.get, None):
        group = receiver.group_for(payload["group"], 1, torch.device("cpu"))
        got = {n: t.clone() for bucket in group.receive(payload) for n, t in bucket}
        out.put(got)


@pytest.mark.integration  # starts processes: not in `make test-fast`
def test_broadcast_sends_whole_versions_in_the_engines_dtype_to_a_process_that_joins_its_group():
    """runtime.weight_transport=broadcast on the CPU (gloo; NCCL on GPUs): the publisher returns the handle at once
    and sends on its own thread; a receiver in another process joins on the first handle and gets every version
    exactly, cast to the engine's dtype (bfloat16 here), in buckets smaller than the model (several collectives,
    one tensor larger than a bucket alone). A trainer that changes the weights right after `settle` does not
    change what was received."""
    ctx = mp.get_context("spawn")
    handles, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receive_versions, args=(handles, out), daemon=True)
    child.start()
    weights = {n: t for n, t in _weights().items() if t.is_floating_point() and t.dim()}
    pub = make_publisher("broadcast", dtype=torch.bfloat16, bucket_bytes=64, timeout_s=60)
    try:
        for version in (1, 2):
            handle = pub.publish(weights, version)
            assert handle.transport is Transport.BROADCAST and handle.payload["group"]["backend"] == "gloo"
            handles.put(handle.payload)
            pub.settle()
            want = {n: t.to(torch.bfloat16, copy=True) for n, t in weights.items()}
            with torch.no_grad():
                for t in weights.values():
                    t.add_(1.0)  # the trainer's next step, after settle
            got = out.get(timeout=60)
            assert list(got) == list(want), (list(got), list(want))
            assert [n for n in want if not torch.equal(got[n], want[n])] == []
            assert handle.nbytes == sum(t.numel() * 2 for t in want.values())
        with pytest.raises(ValueError, match="received by the engine's workers"):
            load_weights(handle)
    finally:
        handles.put(None)
        pub.close()
        child.join(30)
    from loomrl.weights.group import plan_buckets

    meta = handle.payload
    assert len(plan_buckets(meta["names"], meta["dtypes"], meta["shapes"], 64)) >= 3


@pytest.mark.integration  # starts processes: not in `make test-fast`
def test_a_broadcast_nobody_receives_fails_at_settle_within_its_timeout():
    pub = make_publisher("broadcast", timeout_s=2)
    try:
        pub.publish({"w": torch.ones(4)}, 1)
        with pytest.raises(RuntimeError, match="broadcasting the weights failed"):
            pub.settle()
    finally:
        pub.close()
