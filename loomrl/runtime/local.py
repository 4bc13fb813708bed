"""The local parts (runtime.backend=local): one machine, one command, no servers to start.

The rollout side (LocalRollouts) is one RolloutSide (rollout/actor.py) in this process: an engine and many agent
loops on one event loop, each group an asyncio task. The trainer is
- sync (hybrid, the seed's time-sharing): InProcessTrainer, a TrainerService in this process sharing the engine's
  model object; it trains on the engine's thread (one OpenMP team per process), and the weights change in place
  (InPlace: nothing moves);
- async (disaggregated): ProcessTrainer, a TrainerService in a process of its own (train_pool/process.py); new weights
  come back as handles (runtime.weight_transport) and HandleRoute loads them into the engine between batches, which
  then confirms them: the version it serves and its weights' fingerprint against the handle's
  (weights/fingerprint.py; a mismatch is EngineLost, which stops the run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loomrl.config import RunConfig
from loomrl.devices import trainer_device
from loomrl.engine.base import EngineFault, apply_loaded
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.readings import EngineDelta
from loomrl.rollout.actor import RolloutSide
from loomrl.runtime.driver import progress
from loomrl.runtime.failures import EngineLost, TrainerLost
from loomrl.runtime.parts import Parts, RolloutReport, Rollouts, Trainer, TrainerState, WeightRoute
from loomrl.train_pool.process import TrainerProcess, TrainerProcessDied
from loomrl.train_pool.ranks import (
    LocalFollowers,
    LocalRankGroup,
    RankLost,
    follower_threads,
    join_watching,
    reference_of,
    spawn_local_followers,
)
from loomrl.train_pool.service import TrainerService
from loomrl.trainer.checkpoint import latest_checkpoint
from loomrl.trainer_boundary import Carried, PositionSet, TrainStep
from loomrl.types import Evaluation, Trajectory
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights
from loomrl.weights.handle import WeightHandle, sync_metrics
from loomrl.weights.transports import load_weights


def async_threads(cfg: RunConfig) -> tuple[int, int]:
    """Torch threads of the rollout and trainer processes in async mode: the configured numbers, or
    the machine's cores split between the two (both at torch's default would oversubscribe)."""
    cores = os.cpu_count() or 2
    engine = cfg.engine.threads or max(1, cores // 2)
    trainer = cfg.trainer.threads or max(1, cores - engine)
    return engine, trainer


class LocalRollouts(Rollouts):
    """The rollout side in this process."""

    def __init__(self, cfg: RunConfig, checkpoint: Path | None):
        self.cfg, self.ckpt = cfg, checkpoint
        self.sync = cfg.runtime.mode == "sync"
        self.label = cfg.runtime.mode
        self.threads = torch.get_num_threads()  # given back at close: a library call leaves it as it was
        self.reward_last: dict[str, float] = {}  # the reward pool's counters at the last step (judge/...)
        self.rollout: RolloutSide | None = None

    def side(self) -> RolloutSide:
        """The rollout side; start() makes it, and every call on it (and on its engine) comes after."""
        if self.rollout is None:
            raise RuntimeError("LocalRollouts: the rollout side is used before start()")
        return self.rollout

    async def start(self) -> None:
        cfg = self.cfg
        if not self.sync:
            torch.set_num_threads(async_threads(cfg)[0])
        elif cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        # sync: the engine serves the trainer's own model (float32 on trainer.device; config.load_config refused
        # any other model.dtype or model.device), so it is loaded as the trainer's
        # trainer.lora publish=adapter: the engine holds the base (the model config's, not a LoRA checkpoint's merged
        # model), onto which each version's adapter merges; the trainer's start publishes the checkpoint's adapter
        # before any request
        lora = cfg.trainer.lora
        ckpt = None if lora is not None and lora.publish == "adapter" else self.ckpt
        rollout = self.rollout = RolloutSide(cfg.rollout_pool(), ckpt, trainer=cfg.trainer if self.sync else None)
        self.delta = EngineDelta.of(rollout.engine)  # busy time, queue, prefix hits, router/pool: engine/readings.py

    def dispatch(self, position: int) -> asyncio.Future:
        return asyncio.ensure_future(self.side().worker.run_group(position))

    async def evaluate(self, label: str) -> Evaluation:
        rollout = self.side()
        bar = progress(len(rollout.eval_tasks), f"eval {label}", self.cfg.progress)
        try:
            return await rollout.worker.evaluate(rollout.eval_tasks, progress=bar)
        finally:
            bar.close()  # before an error's message, not after it

    async def sleep(self) -> None:
        await asyncio.to_thread(self.side().engine.sleep)

    async def wake(self) -> None:
        await asyncio.to_thread(self.side().engine.wake)

    def step_metrics(self) -> dict[str, float]:
        worker = self.side().worker
        reward = worker.reward_metrics()  # counters since the start: this step's share is the change
        out = {**self.delta.take(), **worker.program_metrics(),
               **{f"env_pool/{k}": v for k, v in worker.pool_metrics().items()},
               **{k: v - self.reward_last.get(k, 0.0) for k, v in reward.items()}}
        self.reward_last = reward
        if self.cfg.runtime.max_inflight_trajectories:
            out["rollout/cap_wait_s_total"] = worker.cap_wait_s
        return out

    async def close(self) -> RolloutReport:
        try:
            rollouts, env_pool = await self.rollout.close() if self.rollout is not None else ({}, {})
        finally:
            torch.set_num_threads(self.threads)
        return RolloutReport(rollouts=rollouts, env_pool=env_pool)


class InProcessTrainer(Trainer):
    """Sync mode: a TrainerService in this process sharing the rollout side's model. It is never restarted (a
    failure stops the run: TrainerLost, not restartable)."""

    def __init__(self, cfg: RunConfig, checkpoint: Path | None, rollouts: LocalRollouts):
        self.cfg, self.ckpt, self.rollouts = cfg, checkpoint, rollouts
        self.service: TrainerService | None = None
        self.followers: LocalFollowers | None = None  # trainer.world_size > 1
        self.on_engine_thread: Callable[[Callable[[], Any]], concurrent.futures.Future] | None = None
        self.own_thread: concurrent.futures.ThreadPoolExecutor | None = None

    def _service(self) -> TrainerService:
        if self.service is None:
            raise RuntimeError("InProcessTrainer: used before start()")
        return self.service

    async def start(self, carried: Carried) -> TrainerState:
        cfg = self.cfg
        train_pool, device = cfg.train_pool(), trainer_device(cfg.trainer)  # resolved once: rank 0's, given below
        ranks = reference = None
        if cfg.trainer.world_size > 1:  # this process is rank 0; a dead follower stops the run (--resume)
            self.followers = spawn_local_followers(train_pool, device, self.ckpt,
                                                   follower_threads(cfg.trainer, os.cpu_count() or 1))
            reference = reference_of(cfg.trainer, cfg.model, device, self.ckpt, rank0=True)  # read before joining
            ranks = LocalRankGroup(cfg.trainer.world_size, device, *self.followers.channels(), dead=self.followers.dead)
            join_watching(ranks, self.followers)
        rollout = self.rollouts.side()
        if rollout.model is None:  # only an engine actor (Ray) leaves the rollout side without a model
            raise RuntimeError("InProcessTrainer: the sync trainer needs the rollout side's model, and it has none")
        # The built-in engine runs all torch work of the process on its thread, between two of its steps (one OpenMP
        # team per process); an engine that runs none of its own (a test's scripted one) leaves a thread of ours.
        engine = rollout.engine
        if isinstance(engine, BuiltinEngine):
            self.on_engine_thread = engine.call
        else:
            pool = self.own_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
            self.on_engine_thread = lambda fn: pool.submit(fn)
        service = self.service = TrainerService(train_pool, rollout.model, rollout.tokenizer, resume_from=self.ckpt,
                                                ranks=ranks, device=device, reference=reference)
        service.carried = carried.filled_from(service.carried)
        return TrainerState(service.version, service.received, service.last_metrics)

    def stop(self) -> None:
        if self.own_thread is not None:
            self.own_thread.shutdown(wait=True)
            self.own_thread = None
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
        if self.service is not None and self.service.ranks is not None:
            self.service.ranks.close()
            self.service.ranks = None

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        self._service().receive(position, group)

    async def has_step(self) -> bool:
        return self._service().has_step()

    async def train_step(self) -> TrainStep | None:
        service = self._service()
        if not service.has_step() or self.on_engine_thread is None:
            return None
        try:  # no weights to refer to: the engine serves the trainer's own tensors (InPlace)
            return await asyncio.wrap_future(self.on_engine_thread(service.run_step))
        except RankLost as err:  # it shares the engine's model: no fresh one can take over
            raise TrainerLost(str(err), restartable=False) from None


class ProcessTrainer(Trainer):
    """Async mode: a TrainerService in a process of its own; each version's weights come back as a handle, the
    `weights` of its TrainStep (of its TrainerState at the start), which the driver hands to HandleRoute."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.process: TrainerProcess | None = None

    def _process(self) -> TrainerProcess:
        if self.process is None:
            raise RuntimeError("ProcessTrainer: used before start() or after stop()")
        return self.process

    async def start(self, carried: Carried) -> TrainerState:
        process = self.process = TrainerProcess(self.cfg.train_pool(), carried, latest_checkpoint(self.cfg.run_dir),
                                                async_threads(self.cfg)[1])
        try:
            started = await process.start()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None
        return TrainerState(started.version, PositionSet.of(started.received), started.metrics, started.weights)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        self._process().send(position, group)

    async def has_step(self) -> bool:
        try:
            return await self._process().has_step()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None

    async def train_step(self) -> TrainStep | None:
        try:
            stepped = await self._process().step()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None
        return stepped.step


class InPlace(WeightRoute):
    """Sync mode moves no weights: the engine serves the trainer's own tensors, changed in place; it is told the
    version."""

    def __init__(self, rollouts: LocalRollouts):
        self.rollouts = rollouts

    async def publish(self, version: int, weights: Any) -> None:
        self.rollouts.side().engine.update_weights(None, version)

    def step_metrics(self) -> dict[str, float]:
        return {}

    async def settle(self, timeout_s: float) -> None:
        """Nothing travels."""


class HandleRoute(WeightRoute):
    """Async mode: the handle the trainer process gave with the version (runtime.weight_transport) loaded into this
    process's engine (or opened by the engine itself where its model lives: vLLM's worker for shm and cuda_ipc), then
    confirmed."""

    def __init__(self, cfg: RunConfig, rollouts: LocalRollouts):
        self.cfg, self.rollouts = cfg, rollouts
        self.metrics: dict[str, float] = {}

    async def publish(self, version: int, weights: Any) -> None:
        engine = self.rollouts.side().engine
        if not isinstance(weights, WeightHandle):  # the trainer process answers its start and every step with one
            raise RuntimeError(f"HandleRoute: version {version} is published without a weight handle from the trainer "
                               f"(got {type(weights).__name__})")
        handle = weights
        # Off the event loop: rollouts go on, and the trainer's next step request goes out meanwhile. An adapter
        # (trainer.lora publish=adapter) is small: loaded here and handed to update_adapter, whatever the engine opens.
        opens = handle.transport in engine.opens and handle.adapter is None
        loaded = None if opens else await asyncio.to_thread(load_weights, handle)
        if self.cfg.runtime.interrupt_on_update:
            engine.interrupt()  # in-flight turns resume under the new weights (AgentLoop._generate)
        t0 = time.perf_counter()
        try:
            if loaded is None:
                await asyncio.to_thread(engine.update_from, handle)
            else:
                await asyncio.to_thread(apply_loaded, engine, loaded.weights, handle)
        except EngineFault as err:  # the trainer's own weights: retrying cannot help
            raise EngineLost(f"the engine could not load the weights of version {version}: {err}") from None
        t1 = time.perf_counter()
        try:  # the engine serves what the trainer published (weights/fingerprint.py)
            checked = await asyncio.to_thread(confirm_weights, engine, self.cfg.engine.kind, version, handle.fingerprint)
        except WeightMismatch as err:  # the same weights would go the same way again
            raise EngineLost(str(err)) from err
        self.metrics = {**sync_metrics(handle, loaded), "weight_sync/apply_s": t1 - t0,
                        "weight_sync/confirm_s": time.perf_counter() - t1, "weight_sync/fingerprinted": checked}
        if handle.adapter is not None:  # confirmed: the engine (every instance of a router) serves this adapter
            self.metrics["weight_sync/adapter_version"] = float(version)

    def step_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    async def settle(self, timeout_s: float) -> None:
        """publish returns once the engine has loaded and confirmed the version: nothing is in flight."""


def local_parts(cfg: RunConfig, checkpoint: Path | None, rollouts: LocalRollouts | None = None) -> Parts:
    """The local run's parts for its mode: sync, a trainer in this process and weights in place; async, a trainer
    process and handles over runtime.weight_transport. `rollouts`: a rollout side of the caller's (a benchmark's that
    counts more), else the plain one."""
    rollouts = rollouts or LocalRollouts(cfg, checkpoint)
    if cfg.runtime.mode == "sync":
        return Parts(rollouts, InProcessTrainer(cfg, checkpoint, rollouts), InPlace(rollouts))
    return Parts(rollouts, ProcessTrainer(cfg), HandleRoute(cfg, rollouts))
