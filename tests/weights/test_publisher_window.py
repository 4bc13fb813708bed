"""The window of versions a publisher holds (weights/handle.py WeightPublisher.publish), by counted bytes: cuda_ipc's
snapshots live on the trainer's GPU, and with keep=1 a second snapshot taken before the first was released cost the
colocated recipe a whole model's worth (15 GB) at every publish. CUDA cannot run here: a publisher that holds host
copies and counts their bytes stands in for IpcPublisher, releasing first as IpcPublisher declares it does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loomrl.weights.handle import Transport, WeightHandle, WeightPublisher
from loomrl.weights.ipc import IpcPublisher
from loomrl.weights.shm import ShmPublisher
from loomrl.weights.source import WeightSource


class Counting(WeightPublisher):
    """Holds a copy of each version it publishes, counting the bytes held and their peak."""

    transport = Transport.QUEUE

    def __init__(self, keep: int, releases_first: bool):
        super().__init__(keep)
        self.releases_first = releases_first
        self.held_bytes = self.peak_bytes = 0

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        snap = {}
        for bucket in source.buckets():
            for name, t in bucket:
                snap[name] = t.clone()
                self.held_bytes += t.numel() * t.element_size()
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return snap, WeightHandle(transport=self.transport, version=version, nbytes=source.nbytes)

    def _release(self, snap: dict[str, torch.Tensor]) -> None:
        self.held_bytes -= sum(t.numel() * t.element_size() for t in snap.values())
        snap.clear()


WEIGHTS = {"a": torch.ones(256, 64), "b": torch.ones(64)}  # 65,792 bytes in float32
ONE = 256 * 64 * 4 + 64 * 4


@pytest.mark.parametrize(("keep", "peak"), [(1, ONE), (2, 2 * ONE)])
def test_cuda_ipc_never_holds_more_than_keep_snapshots_while_it_takes_the_next(keep, peak):
    pub = Counting(keep, releases_first=True)
    for version in range(1, 5):
        pub.publish(WEIGHTS, version)
        assert pub.held_bytes == min(version, keep) * ONE
    assert pub.peak_bytes == peak  # keep=1: one snapshot, never two
    pub.close()
    assert pub.held_bytes == 0
    assert IpcPublisher.releases_first and not ShmPublisher.releases_first  # shm rewrites its released segment


def test_a_publisher_that_keeps_the_old_version_until_the_new_is_whole_holds_one_more():
    pub = Counting(1, releases_first=False)
    for version in (1, 2):
        pub.publish(WEIGHTS, version)
    assert pub.peak_bytes == 2 * ONE and pub.held_bytes == ONE
