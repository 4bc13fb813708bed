"""How many environments keep the inference engine busy: docs/planning.md's matching rule.

    N_env x throughput_per_env >= GPU inference throughput

An environment worker alternates between waiting for the engine (`gen_step_s` per step) and waiting for its
environment (`env_step_s` per step), so it offers the engine 1 / (env_step_s + gen_step_s) steps a second; an engine
serving `engine_batch` requests at once completes engine_batch / gen_step_s. Hence

    workers >= engine_batch x (env_step_s + gen_step_s) / gen_step_s

and one worker alone keeps the engine busy gen_step_s / (env_step_s + gen_step_s) of the time. The worked example:
20 steps of 5 s in the environment and 0.2 s on the GPU: utilisation 0.2 / 5.2 = 3.8%, at least 5.2 / 0.2 = 26
workers (one request at a time; a batching engine needs engine_batch times more: "hundreds" per GPU).

The pool: each worker holds one environment; one that finished its trajectory is reset off the
worker's path before it is leased again, so by Little's law the pool also holds the environments being reset:
workers x reset_s / trajectory time of them, trajectory time = turns x (env_step_s + gen_step_s). What it is not:
a model of contention (generation slowing as the batch grows); predict.py calibrates that from a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS = 1e-9  # 5.2 / 0.2 is 25.999999999999996 in floats: the rule's ceiling must not make it 27


@dataclass(slots=True, kw_only=True, frozen=True)
class CapacityInputs:
    env_step_s: float  # the environment's latency per step (tool call, observation)
    gen_step_s: float  # the engine's time to produce one step's action for a request, at engine_batch
    turns: float = 1.0  # steps per trajectory
    engine_batch: int = 1  # requests the engine serves at once within gen_step_s
    reset_s: float = 0.0  # an environment's reset between trajectories


@dataclass(slots=True, kw_only=True, frozen=True)
class CapacityPlan:
    workers: int  # concurrent environment workers so the engine never waits
    pool_size: int  # environments: the workers' plus those being reset
    utilisation_one_worker: float  # engine busy fraction with a single worker (3.8% in the worked example)
    engine_steps_per_s: float  # what the engine can serve
    steps_per_s_per_worker: float  # what one worker offers


def ceil_exact(x: float) -> int:
    """The ceiling of a ratio computed in floats, without their last-bit error pushing an integer up."""
    return math.ceil(x - _EPS * max(1.0, abs(x)))


def required_envs(x: CapacityInputs) -> CapacityPlan:
    """The matching rule (module docstring)."""
    if x.gen_step_s <= 0:
        raise ValueError("gen_step_s must be > 0: the engine's time per step")
    cycle = x.env_step_s + x.gen_step_s
    workers = max(1, ceil_exact(x.engine_batch * cycle / x.gen_step_s))
    resetting = ceil_exact(workers * x.reset_s / (x.turns * cycle)) if x.reset_s > 0 else 0
    return CapacityPlan(workers=workers, pool_size=workers + resetting,
                        utilisation_one_worker=x.gen_step_s / cycle,
                        engine_steps_per_s=x.engine_batch / x.gen_step_s, steps_per_s_per_worker=1 / cycle)
