"""`loomrl plan`: a run's wall time, capacity and bottleneck, calibrated from a finished run (measure.py), for its own
configuration or another one (a different concurrency cap, groups per step, mode).

The model, per training step of N = groups_per_step x group_size trajectories, C of them in flight at once
(the admission window within runtime.max_inflight_trajectories, whole groups):

    per turn on the engine   g(B) = k x tokens_per_turn x step_s(B)      step_s(B) = base + per_seq x B (DecodeFit)
    trajectory slot          t    = reset + turns x (g(B) + env_step) + reward
    engine batch             B    = C' x turns x g / t                    (a fixed point: who is generating now)
    running at once          C'   = C (sync, evaluation);  async: min(C, max(N, N x t / train))
    sync step                rollout = (waves - 1) x (t + tail(group_size)) + t + tail(last wave's trajectories)
                             x rho, waves = ceil(groups / group slots);  step = rollout + train + other
    async step               step = max(N x t / C, train) x rho          (rollouts overlap training)
    evaluation pass          ceil(episodes / slots) x t_eval x rho_eval
    wall                     fixed + steps x step + passes x evaluation pass

C' is what the engine serves: an async run whose trainer is slower than its rollouts starts each step's N trajectories
together as the trainer frees their positions, and they finish before the next ones start, so the window C is full of
finished groups waiting to be trained, not of generating ones (issue 43: taking C there predicted a turn, and a
trajectory, twice what a max_policy_lag 1 run measured). tail(n) is the expected longest of n trajectories past the
mean, drawn from the run's own trajectory times (a group waits for its slowest member, a step for its slowest group).
k is calibrated at the batch the model gives the run's own shape, so the unchanged configuration predicts the turn
the run measured (queueing and prefill included) and another shape changes it by the decode line's ratio. rho,
rho_eval and `other` are the measured run's ratio of its own times to the model's (what the model leaves out), and
`fixed` its start-up and checkpoints, all carried over unchanged. The reported trajectory time is t less the scoring,
as the store's wall_time measures it. What it is not: a simulator; it holds when the other configuration stays in the
regime the run measured (the same machine, model, environment and lengths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loomrl.planning.capacity import CapacityInputs, CapacityPlan, required_envs
from loomrl.planning.hardware import Hardware
from loomrl.planning.measure import RunMeasurements


@dataclass(slots=True, kw_only=True, frozen=True)
class Shape:
    """The configuration a prediction is for."""

    mode: str
    groups_per_step: int
    group_size: int
    max_inflight: int  # 0: no cap
    max_policy_lag: int
    steps: int

    @classmethod
    def of(cls, m: RunMeasurements, **changes: int | str | None) -> Shape:
        """The measured run's shape with the given fields changed (None: unchanged)."""
        base = cls(mode=m.mode, groups_per_step=m.groups_per_step, group_size=m.group_size,
                   max_inflight=m.max_inflight, max_policy_lag=m.max_policy_lag, steps=m.steps)
        return replace(base, **{k: v for k, v in changes.items() if v is not None})

    @property
    def window_groups(self) -> int:
        """Groups in flight at once: a step's (sync) or the admission window's (async), within the cap."""
        window = self.groups_per_step * (1 + self.max_policy_lag if self.mode == "async" else 1)
        return min(window, max(1, self.max_inflight // self.group_size)) if self.max_inflight else window


@dataclass(slots=True, kw_only=True, frozen=True)
class Prediction:
    shape: Shape
    inflight: int  # training trajectories in flight
    engine_batch: float  # sequences the engine decodes at once
    gen_turn_s: float
    trajectory_s: float  # reset and turns, as the store's wall_time measures it (scoring comes after)
    rollout_s: float  # a step's rollout (sync), or its share of the rollout stream (async)
    train_s: float
    step_s: float
    eval_pass_s: float
    wall_s: float
    staleness: float  # expected policy lag of a trained trajectory
    shares: dict[str, float]  # seconds of a step by pool: inference, environment, reward, trainer
    bottleneck: str


@dataclass(slots=True, kw_only=True, frozen=True)
class Plan:
    measured: RunMeasurements
    own: Prediction  # the model on the measured run's own shape (its error is the calibration's residue)
    target: Prediction
    capacity: CapacityPlan  # the matching rule from the measured latencies, at the engine's batch limit
    hardware: Hardware  # what the device-hours count: the run's GPUs, or its machine

    @property
    def groups_1000_wall_s(self) -> float:
        return 1000 / self.target.shape.groups_per_step * self.target.step_s

    @property
    def groups_1000_device_hours(self) -> float:
        """GPU-hours (a GPU run) or machine-hours (a CPU run) per 1,000 groups: hardware.unit says which."""
        return self.groups_1000_wall_s / 3600 * self.hardware.count


def _slot_s(m: RunMeasurements, turns: float, gen: float) -> float:
    """Seconds a trajectory holds its slot: reset, its turns (engine, environment), then its scoring."""
    return m.env_reset.mean + turns * (gen + m.env_step.mean) + m.reward.mean


def _concurrent(inflight: int, stream: tuple[int, float] | None, t: float) -> float:
    """Trajectories the engine serves at once. Sync, or evaluation (`stream` None): all of `inflight`. Async
    (`stream` = trajectories a step trains, the trainer's seconds a step): the admission window only while the rollout
    stream is the slower pool; while the trainer is, each step's trajectories start together as it frees their
    positions and finish before the next ones start, so per_step x t / train of them (at least one step's) run at once.
    Assuming the whole window there doubled the engine batch, and so the predicted turn, of a run with max_policy_lag 1
    (issue 43)."""
    if stream is None:
        return float(inflight)
    per_step, train = stream
    return min(float(inflight), max(float(per_step), per_step * t / train)) if train > 0 else float(inflight)


def _batch(concurrent: float, turns: float, gen: float, t: float) -> float:
    """The engine batch: of `concurrent` trajectories, those generating now (a slot's share on the engine)."""
    return max(1.0, concurrent * turns * gen / t) if t > 0 else 1.0


def _gen_scale(m: RunMeasurements, own: Shape) -> float:
    """k: the measured seconds per turn on the engine over the decode line's, at the batch the model gives the measured
    run's own shape. Calibrating at the model's own batch (not the engine's measured mean) makes the unchanged
    configuration predict the turn, and so the trajectory, the run measured; another shape changes it by the decode
    line's ratio between the two batches."""
    gen = m.gen_turn.mean
    t = _slot_s(m, m.turns, gen)
    batch = _batch(_concurrent(own.window_groups * own.group_size, _stream(m, own), t), m.turns, gen, t)
    model = m.tokens_per_turn * m.decode.step_s(batch)
    return gen / model if model > 0 and gen > 0 else 1.0


def _gen(m: RunMeasurements, k: float, batch: float) -> float:
    """Seconds per turn on the engine at `batch`; an engine that counts no steps (a vLLM server over HTTP) gives no
    decode line, and the measured per-turn time is used at every batch."""
    model = m.tokens_per_turn * m.decode.step_s(batch)
    return k * model if model > 0 else m.gen_turn.mean


def _stream(m: RunMeasurements, shape: Shape) -> tuple[int, float] | None:
    """(trajectories a step trains, the trainer's seconds a step) of an async shape; None for sync."""
    if shape.mode != "async":
        return None
    per_step = shape.groups_per_step * shape.group_size
    return per_step, m.train_s * per_step / (m.groups_per_step * m.group_size)


def _trajectory(m: RunMeasurements, inflight: int, turns: float, k: float,
                stream: tuple[int, float] | None = None) -> tuple[float, float, float]:
    """(engine batch, seconds per turn on the engine, slot seconds) with `inflight` trajectories admitted."""
    batch = float(inflight)
    for _ in range(100):  # the fixed point converges fast: g grows with B, B shrinks as g's share does
        gen = _gen(m, k, batch)
        t = _slot_s(m, turns, gen)
        batch = 0.5 * batch + 0.5 * _batch(_concurrent(inflight, stream, t), turns, gen, t)
    gen = _gen(m, k, batch)
    return batch, gen, _slot_s(m, turns, gen)


def tail(times: tuple[float, ...], n: int) -> float:
    """The expected longest of n draws from `times` (sorted) past their mean: E[max] = sum of x_(j) x ((j/N)^n -
    ((j-1)/N)^n) over the order statistics, minus the mean."""
    if not times or n <= 1:
        return 0.0
    count = len(times)
    top = sum(x * ((j / count) ** n - ((j - 1) / count) ** n) for j, x in enumerate(times, start=1))
    return top - sum(times) / count


def _waves(t: float, times: tuple[float, ...], units: int, slots: int, unit_size: int) -> float:
    """Seconds until `units` of `unit_size` trajectories each have passed through `slots` slots: full waves at a
    unit's expected time (its slowest member), the last wave at its slowest trajectory's."""
    waves = math.ceil(units / slots)
    last = units - (waves - 1) * slots
    return (waves - 1) * (t + tail(times, unit_size)) + t + tail(times, last * unit_size)


def _eval_pass(m: RunMeasurements, shape: Shape, k: float) -> float:
    if not m.eval_episodes:
        return 0.0
    slots = min(c for c in (m.eval_inflight, shape.max_inflight, m.eval_episodes) if c)
    _, _, t = _trajectory(m, slots, m.eval_turns or m.turns, k)
    return _waves(t, m.trajectory_times, m.eval_episodes, slots, 1)


def _raw(m: RunMeasurements, shape: Shape, k: float) -> tuple[int, float, float, float, float, float]:
    """The uncalibrated model: (inflight, batch, gen per turn, trajectory s, rollout s, train s) of one step."""
    inflight = shape.window_groups * shape.group_size
    batch, gen, t = _trajectory(m, inflight, m.turns, k, _stream(m, shape))
    per_step = shape.groups_per_step * shape.group_size
    train = m.train_s * per_step / (m.groups_per_step * m.group_size)  # the trainer's time grows with its tokens
    if shape.mode == "sync":
        rollout = _waves(t, m.trajectory_times, shape.groups_per_step, shape.window_groups, shape.group_size)
    else:
        rollout = per_step * t / inflight
    return inflight, batch, gen, t, rollout, train


def _predict(m: RunMeasurements, shape: Shape, k: float) -> Prediction:
    own = Shape.of(m)
    _, _, _, _, own_rollout, own_train = _raw(m, own, k)
    inflight, batch, gen, t, rollout, train = _raw(m, shape, k)
    if m.mode == "sync":
        rho = m.rollout_s / own_rollout if own_rollout > 0 else 1.0
        other = max(m.step_s - m.rollout_s - m.train_s, 0.0)
    else:
        rho = m.step_s / max(own_rollout, own_train) if max(own_rollout, own_train) > 0 else 1.0
        other = 0.0
    if shape.mode == "sync":
        rollout *= rho if m.mode == "sync" else 1.0
        step = rollout + train + other
    else:
        rollout *= rho if m.mode == "async" else 1.0
        step = max(rollout, train * (rho if m.mode == "async" else 1.0))
    own_eval = _eval_pass(m, own, k)
    rho_eval = m.eval_pass_s / own_eval if own_eval > 0 and m.eval_pass_s > 0 else 1.0
    eval_s = _eval_pass(m, shape, k) * rho_eval
    fixed = max(m.wall_s - m.steps * m.step_s - m.eval_passes * m.eval_pass_s, 0.0)
    wall = fixed + shape.steps * step + m.eval_passes * eval_s
    shares = {"inference": rollout * m.turns * gen / t, "environment": rollout * (m.turns * m.env_step.mean
              + m.env_reset.mean) / t, "reward": rollout * m.reward.mean / t, "trainer": train}
    if shape.mode == "async" and train >= rollout:
        bottleneck = "trainer"
    elif shape.mode == "async":
        bottleneck = max(("inference", "environment", "reward"), key=shares.__getitem__)
    else:
        bottleneck = max(shares, key=shares.__getitem__)
    staleness = 0.0 if shape.mode == "sync" else min(float(shape.max_policy_lag), t / step if step > 0 else 0.0)
    return Prediction(shape=shape, inflight=inflight, engine_batch=batch, gen_turn_s=gen,
                      trajectory_s=t - m.reward.mean,
                      rollout_s=rollout, train_s=train, step_s=step, eval_pass_s=eval_s, wall_s=wall,
                      staleness=staleness, shares=shares, bottleneck=bottleneck)


def plan(m: RunMeasurements, target: Shape, gpus: int | None = None) -> Plan:
    """The measured run's own prediction, the target's, and the matching rule's capacity from the measured latencies;
    device-hours on the GPUs the run held (its config), or on `gpus` when given."""
    k = _gen_scale(m, Shape.of(m))
    gen_at_limit = _gen(m, k, m.engine_max_batch)
    capacity = required_envs(CapacityInputs(env_step_s=m.env_step.mean, gen_step_s=max(gen_at_limit, 1e-9),
                                            turns=max(m.turns, 1.0), engine_batch=m.engine_max_batch,
                                            reset_s=m.env_reset.mean))
    return Plan(measured=m, own=_predict(m, Shape.of(m), k), target=_predict(m, target, k), capacity=capacity,
                hardware=m.hardware if gpus is None else Hardware.given(gpus))
