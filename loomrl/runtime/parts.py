"""The three parts a run is made of, each a small interface the driver (runtime/driver.py) calls, composed once per run
from (runtime.mode, runtime.backend, runtime.weight_transport) by runtime/run.py make_parts:

- Rollouts: where groups are generated and evaluated (engines, agent loops, sandboxes, reward pools): this process
  (runtime/local.py LocalRollouts) or rollout actors (runtime/ray_backend.py ActorRollouts).
- Trainer: where groups are trained: in this process, sharing the engine's model (InProcessTrainer), in a process of
  its own (ProcessTrainer), or trainer actors (ActorTrainer).
- WeightRoute: how a new version reaches the engines: in place (the sync trainer's own tensors), as handles loaded
  into this process's engine (HandleRoute), through Ray's object store or a broadcast to engine actors.

None of them decides what a failure means: each raises a fact (runtime/failures.py) and the driver decides.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from loomrl.trainer_boundary import Carried, PositionSet, TrainStep
from loomrl.types import Evaluation, Trajectory


@dataclass(slots=True, frozen=True)
class TrainerState:
    """What a (re)started trainer holds: its policy version, the data positions it has received, the metrics of
    the step its checkpoint was taken at, and the reference to its weights the driver publishes first (as
    TrainStep.weights: opaque to the driver, its WeightRoute's to read)."""

    version: int
    received: PositionSet
    metrics: dict[str, float] | None = None
    weights: Any = None


@dataclass(slots=True, kw_only=True)
class RolloutReport:
    """What the rollout side tells the summary when it closes."""

    rollouts: dict[str, dict[str, int]]  # episodes by purpose (training, evaluation) and how they ended
    env_pool: dict[str, float]  # the sandbox pools' metrics, teardown included
    extra: dict[str, Any] = field(default_factory=dict)  # its own section (e.g. "ray": restarts, placement)


class Rollouts(ABC):
    """Where groups are generated and held-out tasks evaluated."""

    label: str  # for the progress bar

    @abstractmethod
    async def start(self) -> None:
        """Start engines, pools and workers, ready to evaluate and dispatch."""

    @abstractmethod
    def dispatch(self, position: int) -> asyncio.Future:
        """Start generating the group at `position`; the future gives the scored group, or raises RolloutLost when
        the worker running it died. Cancelling the future gives the attempt up (the work behind it stops)."""

    @abstractmethod
    async def evaluate(self, label: str) -> Evaluation:
        """Held-out success with the latest published weights, and its episodes (RolloutLost: the worker died)."""

    @abstractmethod
    async def sleep(self) -> None:
        """Every engine gives its accelerator memory to the trainer (Engine.sleep; EngineLost if one cannot)."""

    @abstractmethod
    async def wake(self) -> None:
        """Every engine takes it back (Engine.wake)."""

    @abstractmethod
    def step_metrics(self) -> dict[str, float]:
        """Its own metrics since the last call (engines, pools, reward pools, restarts)."""

    @abstractmethod
    async def close(self) -> RolloutReport:
        """Stop everything; what it counted."""


class Trainer(ABC):
    """Where groups are trained. Every method raises TrainerLost when the trainer (or one of its ranks) is gone."""

    @abstractmethod
    async def start(self, carried: Carried) -> TrainerState:
        """A trainer from the run folder's latest checkpoint (none: the configured model), given the runtime's facts
        it is to keep in its checkpoints (trainer_boundary.Carried)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop it (every rank), dead or alive."""

    @abstractmethod
    async def receive(self, position: int, group: list[Trajectory]) -> None:
        """Hand it a group."""

    @abstractmethod
    async def has_step(self) -> bool:
        """Whether it has a step's groups buffered (train_step would train)."""

    @abstractmethod
    async def train_step(self) -> TrainStep | None:
        """One training step (its version, metrics, stale groups and the reference to its weights), or None when it
        has no step's groups buffered."""


class WeightRoute(ABC):
    """How the trainer's current weights reach every engine."""

    @abstractmethod
    async def publish(self, version: int, weights: Any) -> None:
        """Bring the trainer's weights of `version` to every engine; later groups use them (EngineLost: an engine
        could not load or confirm them). `weights`: the reference the trainer gave with that version
        (TrainStep.weights, TrainerState.weights), of this route's backend; the route reads no other."""

    @abstractmethod
    def step_metrics(self) -> dict[str, float]:
        """Its transfers' timings since the last call."""

    @abstractmethod
    async def settle(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, until every published version has been loaded where it was sent; the run calls
        it before it stops the trainer, whose process may still be sending the last one (a broadcast). A route whose
        publish returns only once every engine has the version has nothing to wait for."""


@dataclass(slots=True, frozen=True)
class Parts:
    rollouts: Rollouts
    trainer: Trainer
    weights: WeightRoute
