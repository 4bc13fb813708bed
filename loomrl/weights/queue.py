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

Tensor = torch.Tensor


class QueuePublisher(WeightPublisher):
    """Nothing held: each handle owns its tensors."""

    transport = Transport.QUEUE

    def __init__(self) -> None:
        super().__init__(keep=1)

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        # A clone per version: torch pickles a storage when the queue's feeder thread gets to it,
        # later than put(), so sending live parameters could mix two versions.
        payload = {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}  # host memory
        return None, WeightHandle(transport=self.transport, version=version, nbytes=nbytes(payload), payload=payload)
