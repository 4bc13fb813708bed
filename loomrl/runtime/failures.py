"""What a part of a run reports when something fails, as typed facts; what a fact means for the run is decided in one
place, the driver (runtime/driver.py), which alone raises RunError.

- RolloutLost: the rollout worker that ran an attempt died (the backend has replaced it, `replaced`); the driver
  retries the attempt within runtime.max_group_attempts and counts replacements against ray.rollout.max_restarts.
- TrainerLost: the trainer (or one of its ranks) died or failed. `restartable`: whether a fresh trainer from the
  latest checkpoint can take over (the in-process sync trainer cannot: it shares the engine's model); the driver
  restarts it within runtime.max_trainer_restarts or stops the run.
- EngineLost: an engine cannot serve the run's weights (it could not load or confirm a version, could not sleep or
  wake, or died where no fresh one can get the current weights); the same weights would fail the same way again, so
  the driver stops the run.
- CannotStart: a part of the run (a package, the cluster, an actor's constructor, the run folder, a metrics sink)
  cannot start; nothing retried would start either.

A fact's message says what happened and what to do, without the "run error:" the driver puts in front of it.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do. Raised by the driver alone."""


class Fact(Exception):
    """A failure a part of the run reports (the subclasses below); the driver decides what it means."""


class RolloutLost(Fact):
    def __init__(self, why: str, *, replaced: bool = False):
        super().__init__(why)
        self.replaced = replaced  # this loss started a fresh rollout worker (one per death, not per attempt)


class TrainerLost(Fact):
    def __init__(self, why: str, *, restartable: bool = True):
        super().__init__(why)
        self.restartable = restartable


class EngineLost(Fact):
    pass


class CannotStart(Fact):
    pass
