"""What crosses the trainer's boundary between the driver (runtime/) and the training pool (trainer/), typed:

- TrainStep: what one training step did, as the trainer answers it (TrainerService.run_step, the trainer process's
  Stepped, the trainer actor's step) and the runtime's Trainer.train_step hands to the driver, which publishes its
  weights through the run's WeightRoute;
- PositionSet: the data positions a trainer has received (saved in its checkpoint, read by the driver at a restart).

Both are plain picklable values: the trainer process's queues and Ray carry them. What it is not: the driver's own
books on positions (runtime/positions.py) or the ledger's records (run_folder.py). It imports nothing of loomrl:
trainer/ and runtime/ both use it, neither through the other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(slots=True, frozen=True, kw_only=True)
class TrainStep:
    """One training step: the policy version it left, whether an optimizer step ran (some group had signal; a step
    without one still consumes its groups and advances the version), its numeric metrics (what the driver logs), how
    many of its groups it dropped as stale (each frees its data position's place in the driver's admission), and
    `weights`, the reference to that version's weights as the backend moves them: opaque to the driver, which hands
    it to its WeightRoute's publish (a WeightHandle from the trainer process, an ObjectRef of the weights or of the
    push report on Ray; None where the route needs none: in place, broadcast)."""

    version: int
    trained: bool
    metrics: dict[str, float]
    groups_stale: int
    weights: Any = None

    def with_weights(self, weights: Any) -> TrainStep:
        """This step with the reference to its weights (set where the backend has made it)."""
        return replace(self, weights=weights)

    def with_metrics(self, metrics: dict[str, float]) -> TrainStep:
        """This step with `metrics` added to its own."""
        return replace(self, metrics={**self.metrics, **metrics})


class PositionSet:
    """Positions received so far, kept as a watermark plus the few above it; PositionSet(**s.state()) copies s."""

    def __init__(self, watermark: int = 0, above: set[int] | None = None):
        self.watermark = watermark  # every position < watermark is in the set
        self.above = set(above or ())

    def add(self, p: int) -> None:
        self.above.add(p)
        while self.watermark in self.above:
            self.above.discard(self.watermark)
            self.watermark += 1

    def __contains__(self, p: int) -> bool:
        return p < self.watermark or p in self.above

    def state(self) -> dict[str, Any]:
        return {"watermark": self.watermark, "above": sorted(self.above)}
