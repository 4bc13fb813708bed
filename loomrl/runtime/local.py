"""The local backend (runtime.backend=local): one machine, one command, no servers to start.

The rollout side is one RolloutSide (rollout/actor.py) in this process: an engine and many agent loops
on one event loop, each group an asyncio task. The trainer is
- sync (hybrid, the seed's time-sharing): a TrainerService in this process sharing the engine's model
  object; it trains on the engine's thread (one OpenMP team per process), weights change in place;
- async (disaggregated): a TrainerService in a process of its own (trainer/process.py); new weights
  come back as handles (runtime.weight_transport) and are loaded into the engine between batches, which then
  confirms them: the version it serves and its weights' fingerprint against the handle's (weights/fingerprint.py; a
  mismatch stops the run). Sync mode moves no weights: the engine serves the trainer's own tensors.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import torch

from loomrl.config import RunConfig
from loomrl.devices import trainer_device
from loomrl.engine.base import EngineFault
from loomrl.engine.common import confirm_weights
from loomrl.engine.readings import EngineDelta
from loomrl.rollout.actor import RolloutSide
from loomrl.runtime.driver import Backend, BackendReport, TrainerState, progress
from loomrl.runtime.failures import EngineLost, TrainerLost
from loomrl.trainer.checkpoint import latest_checkpoint
from loomrl.trainer.process import TrainerProcess, TrainerProcessDied
from loomrl.trainer.ranks import (
    LocalFollowers,
    LocalRankGroup,
    RankLost,
    follower_threads,
    join_watching,
    spawn_local_followers,
)
from loomrl.trainer.service import PositionSet, TrainerService
from loomrl.types import Evaluation, Trajectory
from loomrl.weights.fingerprint import WeightMismatch
from loomrl.weights.handle import WeightHandle, sync_metrics
from loomrl.weights.transports import load_weights


def async_threads(cfg: RunConfig) -> tuple[int, int]:
    """Torch threads of the rollout and trainer processes in async mode: the configured numbers, or
    the machine's cores split between the two (both at torch's default would oversubscribe)."""
    cores = os.cpu_count() or 2
    engine = cfg.engine.threads or max(1, cores // 2)
    trainer = cfg.trainer.threads or max(1, cores - engine)
    return engine, trainer


class LocalBackend(Backend):
    def __init__(self, cfg: RunConfig, checkpoint: Path | None):
        self.cfg, self.ckpt = cfg, checkpoint
        self.sync = cfg.runtime.mode == "sync"
        self.label = cfg.runtime.mode
        self.threads = torch.get_num_threads()  # given back at close: a library call leaves it as it was
        self.service: TrainerService | None = None  # sync: the trainer, in this process
        self.followers: LocalFollowers | None = None  # sync, trainer.world_size > 1
        self.trainer: TrainerProcess | None = None  # async: the client of the trainer process
        self.weights: WeightHandle | None = None  # async: the trainer's latest weights, not yet loaded
        self.sync_metrics: dict[str, float] = {}
        self.reward_last: dict[str, float] = {}  # the reward pool's counters at the last step (judge/...)
        self.rollout: RolloutSide | None = None

    def _side(self) -> RolloutSide:
        """The rollout side; start() makes it, and every call on the rollout side comes after."""
        if self.rollout is None:
            raise RuntimeError("LocalBackend: the rollout side is used before start()")
        return self.rollout

    def _process(self) -> TrainerProcess:
        """The async trainer's process; start_trainer() makes it, stop_trainer() ends it."""
        if self.trainer is None:
            raise RuntimeError("LocalBackend: the trainer process is used before start_trainer() or after stop_trainer()")
        return self.trainer

    async def start(self) -> None:
        cfg = self.cfg
        if not self.sync:
            torch.set_num_threads(async_threads(cfg)[0])
        elif cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        # sync: the engine serves the trainer's own model (float32 on trainer.device; config.load_config refused
        # any other model.dtype or model.device), so it is loaded as the trainer's
        rollout = self.rollout = RolloutSide(cfg, self.ckpt, trainer=cfg.trainer if self.sync else None)
        self.delta = EngineDelta(rollout.engine.metrics)  # busy time, queue, prefix hits: engine/readings.py

    # -- the trainer --------------------------------------------------------------------------------
    async def start_trainer(self, extra: dict[str, Any]) -> TrainerState:
        if self.sync:
            return self._start_sync_trainer(extra)
        trainer = self.trainer = TrainerProcess(self.cfg, extra, latest_checkpoint(self.cfg.run_dir),
                                                async_threads(self.cfg)[1])
        try:
            ready = await trainer.start()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None
        self.weights = ready.weights
        return TrainerState(ready.version, PositionSet(**ready.received), ready.metrics)

    def _start_sync_trainer(self, extra: dict[str, Any]) -> TrainerState:
        """The sync trainer shares the engine's model; it is never restarted (a failure stops the run)."""
        cfg = self.cfg
        ranks = None
        if cfg.trainer.world_size > 1:  # this process is rank 0; a dead follower stops the run (--resume)
            self.followers = spawn_local_followers(cfg, self.ckpt, follower_threads(cfg, os.cpu_count() or 1))
            ranks = LocalRankGroup(cfg.trainer.world_size, trainer_device(cfg.trainer),
                                   *self.followers.channels(), dead=self.followers.dead)
            join_watching(ranks, self.followers)
        rollout = self._side()
        if rollout.model is None:  # only an engine actor (Ray) leaves the rollout side without a model
            raise RuntimeError("LocalBackend: the sync trainer needs the rollout side's model, and it has none")
        service = self.service = TrainerService(cfg, rollout.model, rollout.tokenizer,
                                                resume_from=self.ckpt, ranks=ranks)
        service.extra.update(extra)
        return TrainerState(service.version, service.received, service.last_metrics)

    def stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
            self.trainer = None
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
        if self.service is not None and self.service.ranks is not None:
            self.service.ranks.close()
            self.service.ranks = None

    async def receive(self, position: int, group: list[Trajectory]) -> None:
        if self.service is not None:
            self.service.receive(position, group)
        else:
            self._process().send(position, group)

    async def train_step(self) -> dict[str, Any] | None:
        if self.service is not None:
            if not self.service.ready():
                return None
            try:  # on the engine's thread: one OpenMP team per process
                return await asyncio.wrap_future(self._side().engine.call(self.service.train_step))
            except RankLost as err:  # the sync trainer shares the engine's model: no fresh one can take over
                raise TrainerLost(str(err), restartable=False) from None
        try:
            stepped = await self._process().step()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None
        if stepped.metrics is not None:
            self.weights = stepped.weights
        return stepped.metrics

    async def trainer_ready(self) -> bool:
        if self.service is not None:
            return self.service.ready()
        try:
            return await self._process().ready()
        except TrainerProcessDied as err:
            raise TrainerLost(str(err)) from None

    async def sleep_engines(self) -> None:
        await asyncio.to_thread(self._side().engine.sleep)

    async def wake_engines(self) -> None:
        await asyncio.to_thread(self._side().engine.wake)

    async def publish(self, version: int) -> None:
        engine = self._side().engine
        if self.sync:  # the weights changed in place (shared model)
            engine.update_weights(None, version)
            return
        handle, self.weights = self.weights, None
        if handle is None:  # start_trainer and every train_step with metrics leave a handle to publish
            raise RuntimeError(f"LocalBackend: version {version} is published without new weights from the trainer")
        # Off the event loop: rollouts go on, and the trainer's next step request goes out meanwhile. An engine
        # that opens the handle itself (vLLM's worker: shm, cuda_ipc) reads it where its model is.
        opens = handle.transport in engine.opens
        loaded = None if opens else await asyncio.to_thread(load_weights, handle)
        if self.cfg.runtime.interrupt_on_update:
            engine.interrupt()  # in-flight turns resume under the new weights (AgentLoop._generate)
        t0 = time.perf_counter()
        try:
            if loaded is None:
                await asyncio.to_thread(engine.update_from, handle)
            else:
                await asyncio.to_thread(engine.update_weights, loaded.weights, version)
        except EngineFault as err:  # the trainer's own weights: retrying cannot help
            raise EngineLost(f"the engine could not load the weights of version {version}: {err}") from None
        t1 = time.perf_counter()
        try:  # the engine serves what the trainer published (weights/fingerprint.py)
            checked = await asyncio.to_thread(confirm_weights, engine, self.cfg.engine.kind, version, handle.fingerprint)
        except WeightMismatch as err:  # the same weights would go the same way again
            raise EngineLost(str(err)) from err
        self.sync_metrics = {**sync_metrics(handle, loaded), "weight_sync/apply_s": t1 - t0,
                             "weight_sync/confirm_s": time.perf_counter() - t1, "weight_sync/fingerprinted": checked}

    # -- the rollout side ---------------------------------------------------------------------------
    def dispatch(self, position: int) -> asyncio.Future:
        return asyncio.ensure_future(self._side().worker.run_group(position))

    async def evaluate(self, label: str) -> Evaluation:
        rollout = self._side()
        bar = progress(len(rollout.eval_tasks), f"eval {label}", self.cfg.progress)
        try:
            return await rollout.worker.evaluate(rollout.eval_tasks, progress=bar)
        finally:
            bar.close()  # before an error's message, not after it

    def step_metrics(self) -> dict[str, float]:
        worker = self._side().worker
        reward = worker.reward_metrics()  # counters since the start: this step's share is the change
        out = {**self.delta.take(), **self.sync_metrics, **worker.program_metrics(),
               **{f"env_pool/{k}": v for k, v in worker.pool_metrics().items()},
               **{k: v - self.reward_last.get(k, 0.0) for k, v in reward.items()}}
        self.reward_last = reward
        if self.cfg.runtime.max_inflight_trajectories:
            out["rollout/cap_wait_s_total"] = worker.cap_wait_s
        self.sync_metrics = {}
        return out

    async def close(self) -> BackendReport:
        try:
            rollouts, env_pool = await self.rollout.close() if self.rollout is not None else ({}, {})
        finally:
            torch.set_num_threads(self.threads)
        return BackendReport(rollouts=rollouts, env_pool=env_pool)
