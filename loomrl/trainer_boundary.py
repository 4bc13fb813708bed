"""What crosses the trainer's boundary between the driver (runtime/) and the training pool (trainer/), typed:

- TrainStep: what one training step did, as the trainer answers it (TrainerService.run_step, the trainer process's
  Stepped, the trainer actor's step) and the runtime's Trainer.train_step hands to the driver, which publishes its
  weights through the run's WeightRoute;
- PositionSet: the data positions a trainer has received, and PositionState, its value as a trainer reports it (a
  restarted trainer's Started, the trainer actor's state) and as its checkpoint saves it;
- Carried: the runtime's facts a trainer keeps in its checkpoints so that a resumed run has them (the held-out
  evaluation before training), handed to every trainer the driver starts.

All are plain picklable values: the trainer process's queues and Ray carry them; a checkpoint's state.pt holds them
as JSON-like dicts (as_json / from_json), so that old checkpoints read as they did and a checkpoint never needs these
classes to be unpickled. What it is not: the driver's own books on positions (runtime/positions.py) or the ledger's
records (run_folder.py). Of loomrl it imports only the base types (loomrl/types.py): trainer/ and runtime/ both use
it, neither through the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from loomrl.types import EvalRecord


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


@dataclass(slots=True, frozen=True, kw_only=True)
class PositionState:
    """The positions a trainer has received, as a value: every position below `watermark`, and those in `above`."""

    watermark: int = 0
    above: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """As a checkpoint saves it (the keys it always had)."""
        return {"watermark": self.watermark, "above": list(self.above)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PositionState:
        return cls(watermark=d["watermark"], above=tuple(sorted(d["above"])))


class PositionSet:
    """Positions received so far, kept as a watermark plus the few above it; PositionSet.of(s.state()) copies s."""

    def __init__(self, watermark: int = 0, above: set[int] | None = None):
        self.watermark = watermark  # every position < watermark is in the set
        self.above = set(above or ())

    @classmethod
    def of(cls, state: PositionState) -> PositionSet:
        return cls(state.watermark, set(state.above))

    def add(self, p: int) -> None:
        self.above.add(p)
        while self.watermark in self.above:
            self.above.discard(self.watermark)
            self.watermark += 1

    def __contains__(self, p: int) -> bool:
        return p < self.watermark or p in self.above

    def state(self) -> PositionState:
        return PositionState(watermark=self.watermark, above=tuple(sorted(self.above)))


@dataclass(slots=True, frozen=True, kw_only=True)
class Carried:
    """The runtime's facts a trainer saves in its checkpoints, so that a resumed run has them: the held-out
    evaluation before training (None: not taken, or not yet), which a resume must not take again."""

    eval_before: EvalRecord | None = None

    def filled_from(self, other: Carried) -> Carried:
        """These facts, each one this does not have taken from `other` (a checkpoint's win over the driver's)."""
        return Carried(eval_before=self.eval_before if self.eval_before is not None else other.eval_before)

    def as_json(self) -> dict[str, Any]:
        """As a checkpoint saves it (its "extra": the keys it always had)."""
        return {"eval_before": asdict(self.eval_before)} if self.eval_before is not None else {}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Carried:
        """From a checkpoint's "extra" (absent in one saved before any was carried); keys it does not know are left."""
        before = (d or {}).get("eval_before")
        return cls(eval_before=EvalRecord.from_dict(before) if before is not None else None)
