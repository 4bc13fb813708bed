"""The "queue" transport: the tensors ride inside the handle (the baseline; the handle is as large as the model)."""

from __future__ import annotations

from typing import Any

import torch

from loomrl.weights.handle import (
    Transport,
    WeightHandle,
    WeightPublisher,
    nbytes,
)
from loomrl.weights.source import WeightSource, host_copy

Tensor = torch.Tensor


class QueuePublisher(WeightPublisher):
    """Nothing held: each handle owns its tensors."""

    transport = Transport.QUEUE

    def __init__(self, *, dtype: torch.dtype | None = None, bucket_bytes: int = 64 << 20) -> None:
        super().__init__(keep=1, dtype=dtype, bucket_bytes=bucket_bytes)

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        # A copy per version: torch pickles a storage when the queue's feeder thread gets to it,
        # later than put(), so sending live parameters could mix two versions.
        payload = host_copy(source)  # host memory, in the engine's dtype
        return None, WeightHandle(transport=self.transport, version=version, nbytes=nbytes(payload), payload=payload)
