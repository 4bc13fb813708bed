"""The driver over a scripted in-memory backend: admission under lag, retries and give-up, a trainer restart that
discards what it must, eval, and the accounting identity, in milliseconds (no model, no process, no engine).

The backend is a test double of the whole rollout and trainer side (what cannot run in milliseconds): rollouts
finish after a short asyncio sleep with rewards that differ within a group, the trainer takes a step when it holds
groups_per_step groups, writes the ledger line a real TrainerService writes (train_pool/service.py), answers a TrainStep
whose weights name its version, and "checkpoints" in memory (its version, the positions it received, its buffer). Its script says which attempts die (RolloutLost) and
at which step the trainer dies (TrainerLost). What the driver decides is real: runtime/driver.py runs unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest

from loomrl.config import load_config
from loomrl.run_folder import LedgerEntry, RunFolder, append_line, read_ledger
from loomrl.runtime.driver import Driver
from loomrl.runtime.failures import CannotStart, EngineLost, RolloutLost, RunError, TrainerLost
from loomrl.runtime.parts import Parts, RolloutReport, Rollouts, Trainer, TrainerState, WeightRoute
from loomrl.trainer_boundary import Carried, PositionSet, TrainStep
from loomrl.types import EvalRecord, Evaluation, Trajectory, TrajectoryMetadata


@dataclass
class Checkpoint:
    version: int
    received: PositionSet
    buffer: list[tuple[int, list[Trajectory]]]


@dataclass
class Script:
    """What goes wrong: `dies(position, attempt)` says whether that rollout attempt's worker dies; `trainer_dies_at`:
    the steps whose train_step loses the trainer (each once); `rollout_s` and `train_s`: how long each takes."""

    dies: Callable[[int, int], bool] = lambda position, attempt: False
    trainer_dies_at: set[int] = field(default_factory=set)
    rollout_s: Callable[[int], float] = lambda position: 0.001
    train_s: float = 0.001
    checkpoint_every: int = 2
    eval_success: float | None = 0.5  # None: no held-out episode could be scored
    replaces: bool = False  # each lost attempt's worker was replaced (RolloutLost.replaced)
    trainer_restartable: bool = True  # TrainerLost.restartable
    engine_lost_at: int | None = None  # the version whose publish loses the engine (EngineLost)
    cannot_start: str | None = None  # the rollout side's start raises CannotStart with this
    stale_at: dict[int, int] = field(default_factory=dict)  # step -> groups its trainer drops as stale first


class ScriptedBackend:
    """The whole scripted side in one object; the three parts the driver sees (below) are views of it."""

    def __init__(self, cfg, script: Script):
        self.cfg, self.script = cfg, script
        self.B, self.G = cfg.trainer.groups_per_step, cfg.trainer.group_size
        self.published = -1
        self.weights_published: list[tuple[int, Any]] = []  # (version, the weights its publish was handed)
        self.version = 0
        self.received = PositionSet()
        self.buffer: list[tuple[int, list[Trajectory]]] = []
        self.checkpoint = Checkpoint(0, PositionSet(), [])
        self.attempts: dict[int, int] = {}
        self.dispatched: list[tuple[int, int, float]] = []  # (position, version published then, loop time)
        self.trainer_starts = 0
        self.sent: dict[int, list[str]] = {}  # position -> ids received by the trainer now running
        self.lost: list[str] = []  # ids a dead trainer had received after its checkpoint: never to be trained
        self.calls: list[str] = []

    # the rollout side
    async def start(self) -> None:
        self.calls.append("start")
        if self.script.cannot_start is not None:
            raise CannotStart(self.script.cannot_start)

    def dispatch(self, position: int) -> asyncio.Future:
        attempt = self.attempts[position] = self.attempts.get(position, 0) + 1
        self.dispatched.append((position, self.published, asyncio.get_running_loop().time()))
        return asyncio.ensure_future(self._rollout(position, attempt, self.published))

    async def _rollout(self, position: int, attempt: int, version: int) -> list[Trajectory]:
        await asyncio.sleep(self.script.rollout_s(position))
        if self.script.dies(position, attempt):
            raise RolloutLost(f"rollout worker died running position {position}", replaced=self.script.replaces)
        return [Trajectory(task_id=f"t{position}", trajectory_id=f"p{position}a{attempt}m{i}",
                           group_id=f"p{position}a{attempt}", position=position, total_reward=float(i % 2),
                           metadata=TrajectoryMetadata(policy_version_min=version, policy_version_max=version))
                for i in range(self.G)]

    async def evaluate(self, label: str) -> Evaluation:
        self.calls.append(f"evaluate:{label}:{self.published}")
        if self.script.eval_success is None:
            record = EvalRecord(success=0.0, n=0, stderr=0.0, statuses={"env_error": 4}, first_error="sandbox gone")
        else:
            record = EvalRecord(success=self.script.eval_success, n=4, stderr=0.25, statuses={"completed": 4})
        return Evaluation(record=record, episodes=[])

    async def sleep_engines(self) -> None:
        self.calls.append("sleep")

    async def wake_engines(self) -> None:
        self.calls.append("wake")

    async def publish(self, version: int, weights: Any) -> None:
        if version == self.script.engine_lost_at:
            raise EngineLost(f"the engine could not load the weights of version {version}")
        self.published = version
        self.weights_published.append((version, weights))
        self.calls.append(f"publish:{version}")

    def step_metrics(self) -> dict[str, float]:
        return {"scripted/published": float(self.published)}

    async def close(self) -> RolloutReport:
        return RolloutReport(rollouts={}, env_pool={})

    # the trainer
    async def start_trainer(self, carried: Carried) -> TrainerState:
        self.trainer_starts += 1
        ckpt = self.checkpoint  # what TrainerService does on resume: the checkpoint's state, the ledger cut to it
        self.version, self.received = ckpt.version, PositionSet.of(ckpt.received.state())
        self.buffer = list(ckpt.buffer)
        self.sent = {}
        ledger = [e for e in read_ledger(self.cfg.run_dir) if e.step <= ckpt.version]
        RunFolder(self.cfg.run_dir).ledger.write_text("".join(json.dumps(asdict(e)) + "\n" for e in ledger))
        return TrainerState(version=self.version, received=PositionSet.of(self.received.state()),
                            weights=f"weights of version {self.version}, start {self.trainer_starts}")

    def stop_trainer(self) -> None:
        self.calls.append("stop_trainer")

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        self.received.add(position)
        self.buffer.append((position, group))
        self.sent[position] = [t.trajectory_id for t in group]

    async def trainer_has_step(self) -> bool:
        return len(self.buffer) >= self.B

    async def train_step(self) -> TrainStep | None:
        if len(self.buffer) < self.B:
            return None
        await asyncio.sleep(self.script.train_s)
        step = self.version + 1
        if step in self.script.trainer_dies_at:
            self.script.trainer_dies_at.discard(step)
            self.lost += [t for p, ids in self.sent.items() if p not in self.checkpoint.received for t in ids]
            raise TrainerLost(f"trainer died at step {step}", restartable=self.script.trainer_restartable)
        # as buffer/buffer.py takes: groups in order until groups_per_step fresh ones, the stale ones dropped on the way
        taken, stale = [], []
        while len(taken) < self.B and self.buffer:
            (stale if len(stale) < self.script.stale_at.get(step, 0) else taken).append(self.buffer.pop(0))
        lag = max(step - 1 - min(t.metadata.policy_version_min for _, g in taken for t in g), 0)
        self.version = step
        append_line(RunFolder(self.cfg.run_dir).ledger, LedgerEntry(
            step=step, trained=[t.trajectory_id for _, g in taken for t in g], skipped={},
            stale=[t.trajectory_id for _, g in stale for t in g]))
        if step % self.script.checkpoint_every == 0:
            self.checkpoint = Checkpoint(step, PositionSet.of(self.received.state()), list(self.buffer))
        # the stale count travels as the step's field only (the driver reads no control value out of the metrics)
        return TrainStep(version=step, trained=True, metrics={"groups": len(taken), "train/loss": 0.1,
                                                              "policy_lag_max": lag},
                         groups_stale=len(stale), weights=f"weights of version {step}, start {self.trainer_starts}")


class ScriptedRollouts(Rollouts):
    label = "scripted"

    def __init__(self, backend: ScriptedBackend):
        self.b = backend

    async def start(self) -> None:
        await self.b.start()

    def dispatch(self, position: int) -> asyncio.Future:
        return self.b.dispatch(position)

    async def evaluate(self, label: str) -> Evaluation:
        return await self.b.evaluate(label)

    async def sleep(self) -> None:
        await self.b.sleep_engines()

    async def wake(self) -> None:
        await self.b.wake_engines()

    def step_metrics(self) -> dict[str, float]:
        return self.b.step_metrics()

    async def close(self) -> RolloutReport:
        return await self.b.close()


class ScriptedTrainer(Trainer):
    def __init__(self, backend: ScriptedBackend):
        self.b = backend

    async def start(self, carried: Carried) -> TrainerState:
        return await self.b.start_trainer(carried)

    def stop(self) -> None:
        self.b.stop_trainer()

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        await self.b.receive(position, group)

    async def has_step(self) -> bool:
        return await self.b.trainer_has_step()

    async def train_step(self) -> TrainStep | None:
        return await self.b.train_step()


class ScriptedRoute(WeightRoute):
    def __init__(self, backend: ScriptedBackend):
        self.b = backend

    async def publish(self, version: int, weights: Any) -> None:
        await self.b.publish(version, weights)

    def step_metrics(self) -> dict[str, float]:
        return {}

    async def settle(self, timeout_s: float) -> None:
        self.b.calls.append("settle")


def parts(backend: ScriptedBackend) -> Parts:
    return Parts(ScriptedRollouts(backend), ScriptedTrainer(backend), ScriptedRoute(backend))


def config(tmp_path, *overrides: str):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=scripted", "progress=false", "model.kind=tiny",
                             "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.total_steps=6",
                             "runtime.retry_backoff_s=0.01", "eval.n_tasks=4", *overrides])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return cfg


def run(cfg, script: Script) -> tuple[dict[str, Any], ScriptedBackend]:
    backend = ScriptedBackend(cfg, script)
    summary = Driver(cfg, parts(backend), None, 0.0).run().as_json()  # as summary.json holds it
    return summary, backend


def fates(acc: dict[str, Any]) -> int:
    return sum(sum(v.values()) if isinstance(v, dict) else v for k, v in acc.items()
               if k not in ("launched", "violations"))


def assert_each_step_once(cfg, steps: int) -> list[str]:
    ledger = read_ledger(cfg.run_dir)
    assert [e.step for e in ledger] == list(range(1, steps + 1))
    trained = [t for e in ledger for t in e.trained]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    positions = [t.split("a")[0] for t in trained]
    assert all(positions.count(p) == 4 for p in positions), "a position was trained twice (or in part)"
    return trained


def test_a_sync_run_trains_every_step_once_and_every_trajectory_has_one_fate(tmp_path):
    cfg = config(tmp_path, "runtime.mode=sync")
    summary, backend = run(cfg, Script())
    trained = assert_each_step_once(cfg, 6)
    acc = summary["accounting"]
    assert acc["violations"] == [] and acc["launched"] == fates(acc) == 6 * 2 * 4 == len(trained)
    # sync: a step's groups are all sampled by the current policy (lag 0), never past the last step
    assert all(p // 2 == v for p, v, _ in backend.dispatched)
    assert backend.calls[:3] == ["start", "evaluate:before:-1", "publish:0"]
    assert backend.calls[-2:] == ["evaluate:after:6", "stop_trainer"]
    assert summary["success_before"] == summary["success_after"] == 0.5


@pytest.mark.parametrize("lag", [1, 2])
def test_admission_launches_exactly_as_far_ahead_as_the_lag_allows(tmp_path, lag):
    """Fast rollouts, a slow trainer: the rule p // groups_per_step - version <= max_lag holds at every dispatch,
    and is reached (admission is not tighter than the rule), and nothing past the last step is launched."""
    cfg = config(tmp_path, "runtime.mode=async", f"buffer.max_policy_lag={lag}", "trainer.total_steps=8")
    summary, backend = run(cfg, Script(train_s=0.02))
    assert_each_step_once(cfg, 8)
    ahead = [p // 2 - v for p, v, _ in backend.dispatched]
    assert max(ahead) == lag and all(a <= lag for a in ahead)
    assert sorted(p for p, _, _ in backend.dispatched) == list(range(16))
    acc = summary["accounting"]
    assert acc["violations"] == [] and acc["launched"] == fates(acc) == 64 and acc["trained"] == 64


def test_groups_dropped_as_stale_let_as_many_fresh_positions_in(tmp_path):
    """The trainer drops a group as stale at step 2 and at step 4: admission launches one more position for each, so
    every step still trains, and the run does not wait for groups nobody launched."""
    cfg = config(tmp_path, "runtime.mode=async", "buffer.max_policy_lag=1")
    summary, backend = run(cfg, Script(stale_at={2: 1, 4: 1}))
    ledger = read_ledger(cfg.run_dir)
    assert [e.step for e in ledger] == list(range(1, 7)) and sum(len(e.stale) for e in ledger) == 2 * 4
    assert sorted(p for p, _, _ in backend.dispatched) == list(range(6 * 2 + 2))
    acc = summary["accounting"]
    assert acc["violations"] == [] and acc["launched"] == fates(acc) and acc["stale"] == 2 * 4


def test_each_version_is_published_with_the_weights_the_trainer_gave_with_it(tmp_path):
    """The route is handed each version's weights by the driver, from the trainer's own answer (TrainerState at a
    start, the TrainStep of each step): after a restart the fresh trainer's, never a reference the route fetched from
    the trainer on the side."""
    cfg = config(tmp_path, "runtime.mode=async", "buffer.max_policy_lag=1")
    _, backend = run(cfg, Script(trainer_dies_at={3}))
    assert backend.trainer_starts == 2
    # the first trainer publishes 0, 1, 2 (dies at 3); the second restarts from its checkpoint at 2 and goes on
    assert backend.weights_published == [(v, f"weights of version {v}, start 1") for v in (0, 1, 2)] + [
        (v, f"weights of version {v}, start 2") for v in range(2, 7)]


def test_a_lost_rollout_runs_again_after_its_backoff_and_a_position_that_keeps_dying_is_given_up(tmp_path):
    """Position 1 dies on every attempt: tried runtime.max_group_attempts (3) times, 0.01 s x 2^k apart, then
    recorded as failed; position 2 dies once and is trained from its second attempt; every trajectory launched has
    one fate (the dead ones `failed: actor_died`); the step that lost position 1 takes the next position instead."""
    cfg = config(tmp_path, "runtime.mode=sync", "runtime.retry_backoff_s=0.05")
    script = Script(dies=lambda p, a: p == 1 or (p == 2 and a == 1))
    summary, backend = run(cfg, script)
    assert backend.attempts[1] == 3 and backend.attempts[2] == 2
    times = [t for p, _, t in backend.dispatched if p == 1]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # the backoff doubles
    assert list(summary["positions_failed"]) == ["1"] and "(3 attempts)" in summary["positions_failed"]["1"]
    trained = assert_each_step_once(cfg, 6)
    assert not any(t.startswith("p1a") for t in trained) and any(t.startswith("p2a2") for t in trained)
    acc = summary["accounting"]
    assert acc["failed"] == {"actor_died": 4 * 4}  # 3 attempts of position 1, 1 of position 2
    assert acc["violations"] == [] and acc["launched"] == fates(acc)


def test_a_lost_trainer_restarts_from_its_checkpoint_and_what_it_had_not_kept_is_discarded_and_run_again(tmp_path):
    """The trainer dies at step 3 (its checkpoint is step 2) while positions 6 and 7 are still generating: the
    driver restarts it (one restart), discards the groups it had sent past the checkpoint, cancels what was in flight,
    runs those positions again with the restored weights; the ledger names each step once and every trajectory
    launched has one fate."""
    cfg = config(tmp_path, "runtime.mode=async", "buffer.max_policy_lag=1")
    summary, backend = run(cfg, Script(trainer_dies_at={3}, train_s=0.01,
                                       rollout_s=lambda p: 0.05 if p in (6, 7) else 0.001))
    assert backend.trainer_starts == 2 and backend.lost
    trained = assert_each_step_once(cfg, 6)
    acc = summary["accounting"]
    assert acc["discarded"]["trainer_restart"] >= len(backend.lost)
    assert not set(backend.lost) & set(trained)
    assert acc["cancelled"] >= 2 * 4  # positions 6 and 7, in flight when the trainer died
    assert acc["violations"] == [] and acc["launched"] == fates(acc)
    assert len(trained) == acc["trained"] == 6 * 2 * 4
    versions: dict[int, list[int]] = {}
    for p, v, _ in backend.dispatched:
        versions.setdefault(p, []).append(v)
    assert versions[6][-1] == versions[7][-1] == 2  # run again with the restored (step 2) weights


def test_a_trainer_that_keeps_dying_stops_the_run_with_its_error_and_the_way_to_resume(tmp_path):
    cfg = config(tmp_path, "runtime.mode=sync", "runtime.max_trainer_restarts=1")
    with pytest.raises(RunError, match=r"the trainer failed:\ntrainer died at step 2\n.*--resume"):
        run(cfg, Script(trainer_dies_at=_always({2}), checkpoint_every=100))
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert summary["accounting"]["violations"] == []


def test_an_evaluation_with_no_scored_episode_stops_the_run_and_never_reads_as_zero(tmp_path):
    cfg = config(tmp_path, "runtime.mode=sync")
    with pytest.raises(RunError, match=r"evaluation before training: none of the 4 held-out episodes could be "
                                       r"scored \(env_error 4\); the first error: sandbox gone"):
        run(cfg, Script(eval_success=None))


def test_rollout_workers_replaced_past_their_budget_stop_the_run(tmp_path):
    """Every attempt of position 1 kills its worker, which the backend replaces: with ray.rollout.max_restarts=1 the
    second replacement stops the run (the driver counts them, not the backend), before the retry budget is spent."""
    cfg = config(tmp_path, "runtime.mode=sync", "ray.rollout.max_restarts=1", "runtime.max_group_attempts=5")
    with pytest.raises(RunError, match=r"^run error: rollout workers died 2 times \(last: rollout worker died running "
                                       r"position 1\).*ray.rollout.max_restarts.*--resume"):
        run(cfg, Script(dies=lambda p, a: p == 1, replaces=True))
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert summary["segments"][-1]["ended"].startswith("stopped: run error: rollout workers died 2 times")
    assert summary["accounting"]["violations"] == []


def test_a_trainer_that_cannot_be_restarted_stops_the_run_at_once(tmp_path):
    """The sync trainer shares the engine's model (TrainerLost.restartable false): no restart is tried, whatever
    runtime.max_trainer_restarts allows."""
    cfg = config(tmp_path, "runtime.mode=sync", "runtime.max_trainer_restarts=3")
    script = Script(trainer_dies_at={2}, trainer_restartable=False)
    backend = ScriptedBackend(cfg, script)
    with pytest.raises(RunError, match=r"^run error: trainer died at step 2; continue with the same command and "
                                       r"--resume$"):
        Driver(cfg, parts(backend), None, 0.0).run()
    assert backend.trainer_starts == 1 and backend.calls[-1] == "stop_trainer"


@pytest.mark.parametrize(("script", "said"), [
    (Script(engine_lost_at=2), "run error: the engine could not load the weights of version 2"),
    (Script(cannot_start="runtime.backend=ray needs the ray package"), "run error: runtime.backend=ray needs the ray "
                                                                        "package"),
])
def test_an_engine_lost_or_a_part_that_cannot_start_stops_the_run_with_its_message(tmp_path, script, said):
    cfg = config(tmp_path, "runtime.mode=sync")
    with pytest.raises(RunError) as err:
        run(cfg, script)
    assert str(err.value) == said
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert summary["segments"][-1]["ended"] == f"stopped: {said}"
    assert summary["accounting"]["violations"] == []


class _always(set):
    """A set of steps the trainer dies at every time (discard does nothing)."""

    def discard(self, element) -> None:
        pass


def test_the_last_version_settles_before_the_trainer_stops(tmp_path):
    """On Ray a broadcast version travels from the trainer actor while the run goes on; stopping the trainer at the
    end cut the last one off mid-send when no evaluation waited for it (found by tests/runtime/test_vllm_ray.py)."""
    _, backend = run(config(tmp_path, "eval.n_tasks=0"), Script())
    assert backend.calls[-2:] == ["settle", "stop_trainer"], backend.calls
