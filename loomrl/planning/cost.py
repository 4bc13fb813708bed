"""The cost of an agent RL run before it starts: docs/planning.md's cost model (inference, training, environments).

    rollout tokens  = tasks x rollouts per task x turns x tokens per turn
    training tokens = rollout tokens x epochs
    wall hours      = tokens / (tokens per second) / 3600;   GPU-hours = wall hours x GPUs (a CPU run: machines)
    environments    = concurrent sandboxes x hours x price per sandbox-hour

The worked example there: 5k tasks x 4 x 20 x 500 = 200M tokens; at 5k tokens/s on 8 GPUs, 11 wall-clock hours and 89
GPU-hours (8 x 11.1: the product is rounded, not its rounded factor). What it is not: a model of a run's own
dynamics (waiting on environments, the long tail, staleness); `loomrl plan` (predict.py) calibrates that from a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, kw_only=True, frozen=True)
class CostInputs:
    tasks: int
    rollouts_per_task: int
    turns: float  # mean turns per trajectory (T-bar)
    tokens_per_turn: float  # mean tokens per turn (L-bar): think + act + observe
    inference_tokens_per_s: float  # the rollout engines' throughput, all of them together
    inference_gpus: int
    train_tokens_per_s: float
    train_gpus: int
    epochs: float = 1.0
    sandboxes: int = 0  # concurrent sandboxes (environment instances)
    sandbox_hours: float | None = None  # how long they run; None: the rollout's wall hours
    sandbox_price_per_hour: float = 0.0  # $ per sandbox-hour
    gpu_price_per_hour: float = 0.0  # $ per GPU-hour (a CPU run: per machine-hour)
    unit: str = "GPU"  # what *_gpus count: "GPU", or "machine" for a run on CPUs (hardware.py)


@dataclass(slots=True, kw_only=True, frozen=True)
class PhaseCost:
    tokens: float
    wall_hours: float
    gpu_hours: float
    usd: float


@dataclass(slots=True, kw_only=True, frozen=True)
class EnvCost:
    sandboxes: int
    hours: float
    sandbox_hours: float
    usd: float


@dataclass(slots=True, kw_only=True, frozen=True)
class CostEstimate:
    inputs: CostInputs
    inference: PhaseCost
    training: PhaseCost
    environments: EnvCost

    @property
    def gpu_usd(self) -> float:
        return self.inference.usd + self.training.usd

    @property
    def total_usd(self) -> float:
        return self.gpu_usd + self.environments.usd


def _phase(tokens: float, tokens_per_s: float, gpus: int, gpu_price: float) -> PhaseCost:
    hours = tokens / tokens_per_s / 3600
    return PhaseCost(tokens=tokens, wall_hours=hours, gpu_hours=hours * gpus, usd=hours * gpus * gpu_price)


def estimate_cost(x: CostInputs) -> CostEstimate:
    """The cost model's estimate; exact (unrounded) numbers, see `round_figure` for their printing."""
    rollout_tokens = x.tasks * x.rollouts_per_task * x.turns * x.tokens_per_turn
    inference = _phase(rollout_tokens, x.inference_tokens_per_s, x.inference_gpus, x.gpu_price_per_hour)
    training = _phase(rollout_tokens * x.epochs, x.train_tokens_per_s, x.train_gpus, x.gpu_price_per_hour)
    hours = inference.wall_hours if x.sandbox_hours is None else x.sandbox_hours
    env = EnvCost(sandboxes=x.sandboxes, hours=hours, sandbox_hours=x.sandboxes * hours,
                  usd=x.sandboxes * hours * x.sandbox_price_per_hour)
    return CostEstimate(inputs=x, inference=inference, training=training, environments=env)


def round_figure(value: float) -> str:
    """A number as docs/planning.md's worked example writes it: whole hours from 10 up (11, 89, 222: each rounded
    from the exact value, half up), one decimal below 10, and tokens in M/B/k with up to 3 significant digits (200M).
    Below 1 it is for the report's own formats (report.py wall_text, hours_text), which never print 0 for a
    nonzero phase."""
    if value >= 1e9:
        return f"{_sig3(value / 1e9)}B"
    if value >= 1e6:
        return f"{_sig3(value / 1e6)}M"
    if value >= 1e4:
        return f"{_sig3(value / 1e3)}k"
    if value >= 10:
        return str(math.floor(value + 0.5))
    return f"{math.floor(value * 10 + 0.5) / 10:g}"


def _sig3(v: float) -> str:
    return f"{float(f'{v:.3g}'):g}"
