"""The training pool in a process of its own (local async runs): a TrainerService that answers typed
requests on a pair of queues, and the client the local backend drives it with.

The channel carries dataclasses, not tuples: Group (one group and its data position), StepRequest
(train one step if a step's groups are buffered), Stop; answers are Started (after start: the version,
the positions received, the current weights), Stepped (the step's TrainStep, its weights the new version's
handle, or nothing when no step was due) and Failed (the traceback). New weights travel as small handles
(runtime.weight_transport, loomrl/weights/); the trainer keeps its last versions readable until the client has read them.

A trainer that dies (or whose follower rank dies: in async mode the followers are the trainer's
siblings, so the client sees them die) makes every pending call raise TrainerProcessDied with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from loomrl.config import TrainPoolConfig, WeightRoute
from loomrl.devices import trainer_device
from loomrl.run_folder import RunFolder
from loomrl.train_pool.ranks import (
    Child,
    LocalFollowers,
    LocalRankGroup,
    follower_threads,
    name_process,
    spawn_local_followers,
)
from loomrl.train_pool.service import TrainerService
from loomrl.trainer_boundary import Carried, PositionState, TrainStep
from loomrl.types import Trajectory
from loomrl.weights.handle import WeightHandle, WeightPublisher
from loomrl.weights.route import route_dtype
from loomrl.weights.transports import make_publisher

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Group:
    position: int
    group: list[Trajectory]


@dataclass(slots=True, frozen=True)
class StepRequest:
    pass


@dataclass(slots=True, frozen=True)
class Stop:
    pass


@dataclass(slots=True, frozen=True)
class HasStepQuery:
    """Whether a step's groups are buffered (answered HasStep; engine.sleep_while_training asks first)."""


@dataclass(slots=True, frozen=True)
class HasStep:
    has_step: bool


@dataclass(slots=True, frozen=True)
class Started:
    version: int
    received: PositionState
    weights: WeightHandle
    metrics: dict[str, float] | None  # of the step the checkpoint was taken at


@dataclass(slots=True, frozen=True)
class Stepped:
    step: TrainStep | None  # its weights: the new version's handle; None: no step was due


@dataclass(slots=True, frozen=True)
class Failed:
    error: str


class TrainerProcessDied(RuntimeError):
    """The trainer process (or one of its follower ranks) died or failed; the message says how."""


class TrainerProcess:
    """Client of one trainer process: start() it from the run folder's latest checkpoint, feed it
    groups, ask for steps, stop() it. Each call answers in order (one request in flight at a time)."""

    def __init__(self, pool: TrainPoolConfig, carried: Carried, checkpoint: Path | None, threads: int):
        self.pool, self.carried, self.checkpoint, self.threads = pool, carried, checkpoint, threads
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.child: Child | None = None
        self.followers: LocalFollowers | None = None
        self.answers: asyncio.Queue = asyncio.Queue()
        self.stopping = False  # set by stop(): the process ending then is no failure

    async def start(self) -> Started:
        pool = self.pool
        # trainer.distributed: the follower ranks are the trainer's siblings, so that this process
        # sees them die (and stops the whole trainer, which then restarts) and cleans them up.
        if pool.trainer.distributed:  # rank 0's device (the trainer process resolves its own) places the others
            self.followers = spawn_local_followers(pool, trainer_device(pool.trainer), self.checkpoint,
                                                   follower_threads(pool.trainer, self.threads))
        ranks = (self.followers.channels(), self.followers.port) if self.followers else None
        self.child = Child("trainer process", "loomrl-trainer", _trainer_main, pool.model_dump_json(), self.carried,
                           str(self.checkpoint or ""), self.threads, self.inbox, self.outbox, ranks)
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), daemon=True, name="loomrl-trainer-pump").start()
        return await self._answer(Started)

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        """Trainer process -> asyncio, on a thread so that the event loop never blocks."""
        child = self.child
        if child is None:  # start() makes the process before it starts this thread
            raise RuntimeError("the trainer process's pump started before the process")

        def deliver(msg: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting any more
                loop.call_soon_threadsafe(self.answers.put_nowait, msg)

        while not self.stopping:
            try:
                msg = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if self.stopping:
                    return
                why = child.dead() or (self.followers.dead() if self.followers else None)
                if why:  # rank 0 may be waiting on a dead follower in a collective: stop it too
                    child.proc.kill()
                    deliver(Failed(why))
                    return
                continue
            except Exception:  # noqa: BLE001 - e.g. a message that cannot be unpickled
                deliver(Failed(traceback.format_exc()))
                return
            if isinstance(msg, Failed) and self.followers is not None:
                time.sleep(0.5)  # a dead follower reaches rank 0 as a failed collective: name it
                why = self.followers.dead()
                msg = Failed(f"{msg.error}\n{why}") if why else msg
            deliver(msg)
            if isinstance(msg, Failed):
                return

    async def _answer(self, kind: type) -> Any:
        msg = await self.answers.get()
        if isinstance(msg, Failed):
            self.answers.put_nowait(msg)  # every later call fails the same way
            raise TrainerProcessDied(msg.error)
        assert isinstance(msg, kind), f"trainer process answered {type(msg).__name__}, expected {kind.__name__}"
        return msg

    def send(self, position: int, group: list[Trajectory]) -> None:
        self.inbox.put(Group(position, group))

    async def step(self) -> Stepped:
        self.inbox.put(StepRequest())
        return await self._answer(Stepped)

    async def has_step(self) -> bool:
        self.inbox.put(HasStepQuery())
        return (await self._answer(HasStep)).has_step

    def stop(self) -> None:
        """Stop the process (and its followers); a process that does not stop in time is killed."""
        self.stopping = True
        if self.child is not None:
            self.inbox.put(Stop())
            self.child.stop(60)  # SIGTERM before SIGKILL: its finally frees the published weights
        if self.followers is not None:
            self.followers.stop()


KEEP_VERSIONS = 3  # versions an engine may still be loading when the trainer publishes the next


def run_publisher(route: WeightRoute, run_dir: str | Path, *, engines: int, host: str) -> WeightPublisher:
    """The trainer's publisher for `route` (runtime.weight_transport; file: into `run_dir`'s weights folder), in the
    engine's dtype as this process resolves it; broadcast: a group of rank 0 and the worker processes of `engines`
    engines (route.receivers each), reaching this process at `host`."""
    transport = route.transport
    sglang = route.engine_kind == "sglang"  # its server receives tensor by tensor
    # cuda_ipc beside a colocated engine: each kept version is a snapshot on the GPU the engine generates on (15 GB
    # at 7B in bf16). One is enough there: a version is published while the engine sleeps and loaded as it wakes,
    # before the next step can publish another.
    keep = 1 if transport == "cuda_ipc" and route.colocated else KEEP_VERSIONS
    return make_publisher(transport, keep=keep, folder=RunFolder(Path(run_dir)).weights if transport == "file" else None,
                          dtype=route_dtype(route), receivers=engines * route.receivers,
                          bucket_bytes=route.bucket_bytes, host=host, timeout_s=route.timeout_s,
                          wire="tensors" if sglang else "buckets")


def publish(publisher: WeightPublisher, service: TrainerService) -> WeightHandle:
    """The service's current version through `publisher`, in its dtype (the engine's) and bucket size."""
    return publisher.publish(service.weight_source(publisher.dtype, publisher.bucket_bytes), service.version)


def colocated_step(service: TrainerService, publish: Callable[[], T]) -> tuple[TrainStep, T]:
    """A step beside colocated engines, which sleep meanwhile (the driver put them to sleep before asking): every
    rank's state back on its GPU, the step, the new version published by `publish` (done with the parameters when it
    returns: a broadcast settled, a host copy made), every rank's state back to host memory; the engines wake and load
    the version once this returns. The local trainer process's and the Ray trainer actor's."""
    back = service.onload()
    step = service.run_step()
    published = publish()
    away = service.offload()
    return step.with_metrics({"colocate/onload_s": back.seconds, "colocate/offload_s": away.seconds,
                              "colocate/offloaded_bytes": float(away.bytes)}), published


def publish_settled(publisher: WeightPublisher, service: TrainerService) -> WeightHandle:
    """publish, then settle: a broadcast reads the parameters, sent before they move."""
    handle = publish(publisher, service)
    publisher.settle()
    return handle


def _trainer_main(pool_json: str, carried: Carried, checkpoint: str, threads: int, inbox: Any, outbox: Any,
                  ranks: tuple | None) -> None:
    """Entry of the trainer process; `ranks`: the follower ranks' queues and port."""
    # SIGTERM (the rollout side giving up on us) unwinds through `finally`, which frees the weights.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    name_process("loomrl-trainer")
    publisher = None
    try:
        pool = TrainPoolConfig.model_validate_json(pool_json)
        device = trainer_device(pool.trainer)  # resolved once in this process: every rank-0 part is given it
        torch.set_num_threads(threads)
        group = rendezvous = None
        if ranks is not None:  # joined once this rank's model is loaded (from_run), as the followers join theirs
            (inboxes, outboxes), port = ranks
            group = LocalRankGroup(pool.trainer.world_size, device, inboxes, outboxes)
            rendezvous = ("127.0.0.1", port)
        service = TrainerService.from_run(pool, carried, Path(checkpoint) if checkpoint else None, device,
                                          ranks=group, rendezvous=rendezvous)
        publisher = run_publisher(pool.route, pool.run_dir, engines=1, host=pool.route.host)
        colocated = pool.route.colocated  # the GPU is the engine's between steps (train_pool/offload.py)
        first = publish(publisher, service)
        if colocated:
            service.offload()
        outbox.put(Started(service.version, service.received.state(), first, service.last_metrics))
        while not isinstance(msg := inbox.get(), Stop):
            if isinstance(msg, Group):
                service.receive(msg.position, msg.group)
            elif isinstance(msg, HasStepQuery):
                outbox.put(HasStep(service.has_step()))
            elif service.has_step():
                publisher.settle()  # nothing reads the weights any more (broadcast) when the step changes them
                if colocated:
                    step, handle = colocated_step(service, partial(publish_settled, publisher, service))
                else:
                    step = service.run_step()
                    handle = publish(publisher, service)
                outbox.put(Stepped(step.with_weights(handle)))
            else:
                outbox.put(Stepped(None))
    except BaseException:  # noqa: BLE001 - reported to the client, which restarts the trainer or stops
        outbox.put(Failed(traceback.format_exc()))
    finally:
        if publisher is not None:
            publisher.close()
