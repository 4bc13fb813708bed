"""The training pool's Ray half: the TrainerService as an actor (rank 0) and, with trainer.world_size
> 1, the other data-parallel ranks as actors of their own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from loomrl.actor_support import Placed
from loomrl.config import TrainPoolConfig
from loomrl.devices import trainer_device
from loomrl.errors import error_line
from loomrl.train_pool.distributed import Gather
from loomrl.train_pool.offload import drop_gradients
from loomrl.train_pool.process import colocated_step, run_publisher
from loomrl.train_pool.push import EnginePusher, PushReport, bucket_buffer
from loomrl.train_pool.ranks import Follower, Push, RankGroup, RankLost, RankModel, RankReport, RankWork
from loomrl.train_pool.service import TrainerService
from loomrl.trainer.checkpoint import latest_checkpoint
from loomrl.trainer_boundary import Carried, PositionState, TrainStep
from loomrl.types import Trajectory
from loomrl.weights.handle import WeightHandle, WeightPublisher
from loomrl.weights.route import route_dtype
from loomrl.weights.source import dtype_name, host_copy

log = logging.getLogger(__name__)


def engine_pusher(timeout_s: float, device: torch.device, engine: Any, rank: int) -> EnginePusher:
    """runtime.weight_transport=cuda_ipc on Ray (colocated): trainer rank `rank`'s pusher to `engine`, the engine actor
    on its GPU (`device`, the rank's trainer.device), each version delivered within `timeout_s` (the engine's
    update_timeout_s); a CUDA IPC buffer on a GPU, a shared-memory one on a CPU (said once: the tests' form of the
    route)."""
    if device.type != "cuda" and rank == 0:
        log.warning("runtime.weight_transport=cuda_ipc with the trainer on %s: each bucket goes through a shared-memory "
                    "segment instead of GPU memory (the same route, as the tests run it)", device)
    return EnginePusher(engine, bucket_buffer(device), timeout_s=timeout_s, label=f"engine actor {rank}")


class TrainerActor(Placed):
    """The TrainerService on the trainer's node (rank 0 when trainer.world_size > 1). Made from the run folder's latest
    checkpoint when there is one: a fresh run has none, a resumed run or a restart after a crash continues from it."""

    def __init__(self, pool_json: str, carried: Carried):
        pool = TrainPoolConfig.model_validate_json(pool_json)
        torch.set_num_threads(pool.trainer.threads or max(1, int(pool.cpus)))  # as reserved
        self.pool, self.carried, self.ckpt = pool, carried, latest_checkpoint(Path(pool.run_dir))
        # resolved once on this actor's machine (its "auto" is this node's), then handed to every part that needs them
        self.device, self.dtype = trainer_device(pool.trainer), route_dtype(pool.route)
        # trainer.distributed: built once the ranks joined (join_ranks), sharded ranks shard it as they build it
        self.service: TrainerService | None = (
            None if pool.trainer.distributed else TrainerService.from_run(pool, carried, self.ckpt, self.device))
        self.loaded: RankModel | None = None  # trainer.distributed: read by `load`, before the ranks join
        self.pusher: EnginePusher | None = None  # runtime.weight_transport=cuda_ipc: the engine on this GPU (attach)
        self.publisher: WeightPublisher | None = None  # runtime.weight_transport=broadcast: this actor's group
        if pool.route.transport == "broadcast":
            import ray

            # the engine actors' processes reach it at this node's address (a new trainer actor is a new group)
            self.publisher = run_publisher(pool.route, pool.run_dir, engines=pool.route.engines,
                                           host=ray.util.get_node_ip_address())

    def attach_engine(self, engine: Any) -> None:
        """runtime.weight_transport=cuda_ipc (colocated): `engine`, the engine actor on this rank's GPU, which every
        version is pushed to a bucket at a time (train_pool/push.py)."""
        self.pusher = engine_pusher(self.pool.route.timeout_s, self.device, engine, 0)

    def rendezvous(self) -> tuple[str, int, str | None]:
        """Where the other ranks meet this one (this node's address, a free port) and the checkpoint
        they must start from (this rank's)."""
        import ray

        from loomrl.train_pool.distributed import free_port

        return ray.util.get_node_ip_address(), free_port(""), str(self.ckpt) if self.ckpt else None

    def load(self) -> None:
        """trainer.distributed: rank 0 reads its model (and KL's reference) before any rank enters the rendezvous
        (the driver tells the followers to join once this returns: no rank waits there while this one reads)."""
        if self.loaded is not None or self.service is not None:  # a second read would hold two models at once
            raise RuntimeError("TrainerActor.load: loaded already (a restart makes a new trainer actor)")
        self.loaded = TrainerService.load(self.pool, self.ckpt, self.device)

    def join_ranks(self, followers: list[Any], addr: str, port: int) -> None:
        """Rank 0 joins the process group of the follower actors (which read their models as they were made and join
        concurrently), then builds its trainer from what `load` read."""
        if self.loaded is None:
            raise RuntimeError("TrainerActor.join_ranks: load first")
        loaded, self.loaded = self.loaded, None  # the service owns them from here
        ranks = RayRankGroup(len(followers) + 1, self.device, followers)
        self.service = TrainerService.from_run(self.pool, self.carried, self.ckpt, self.device, ranks=ranks,
                                               rendezvous=(addr, port), loaded=loaded)

    def state(self) -> tuple[int, PositionState, dict[str, float] | None]:
        """The policy version, the positions received and that step's metrics (as of the checkpoint it started from)."""
        service = self._trainer()
        return service.version, service.received.state(), service.last_metrics

    def receive(self, position: int, group: list[Trajectory]) -> None:
        self._trainer().receive(position, group)

    def has_step(self) -> bool:
        """Whether a step's groups are buffered (step would train)."""
        return self._trainer().has_step()

    def step(self) -> tuple[TrainStep | None, dict[str, torch.Tensor] | PushReport | None]:
        """One training step when a step's groups are buffered (and the run is not done): its TrainStep
        and the new weights (called with num_returns=2, so that the weights stay in the object store,
        owned by the caller, for the rollout actors to fetch: the caller sets the step's `weights` to that ObjectRef),
        or with runtime.weight_transport=cuda_ipc the report of the ranks' pushes to their engines (made within the
        step); else (None, None)."""
        if not self._trainer().has_step():
            return None, None
        if self.publisher is not None:  # broadcast: the engines have received the last version before it changes
            self.publisher.settle()
            return self._trainer().run_step(), None
        if not self.pool.route.colocated:
            return self._trainer().run_step(), self.weights()
        # colocated (train_pool/offload.py): the engines sleep through this call; the state is on the GPU only for it
        return colocated_step(self._trainer(), self._push if self.pusher is not None else self._host_weights)

    def push_start(self) -> PushReport:
        """runtime.weight_transport=cuda_ipc: the start's version pushed to the engines, then the trainer's state sent
        to host memory, before any engine wakes."""
        report = self._push()
        self._trainer().offload()
        return report

    def _push(self) -> PushReport:
        """The current version, pushed by every rank to the engine on its GPU (runtime.weight_transport=cuda_ipc)."""
        service, pusher = self._trainer(), self.pusher
        if pusher is None:
            raise RuntimeError("TrainerActor: no engine attached (runtime.weight_transport=cuda_ipc: attach_engine)")
        dtype, bucket_bytes = self.dtype, self.pool.route.bucket_bytes
        drop_gradients(service.trainer)  # room for the engine's weights beside the state (the followers drop theirs)
        if service.ranks is not None:
            return service.ranks.push(Push(service.version, Gather(dtype_name(dtype), bucket_bytes)), pusher)
        return pusher.push(service.weight_source(dtype, bucket_bytes), service.version)

    def publish(self, version: int) -> WeightHandle:
        """runtime.weight_transport=broadcast: the handle of `version` (the current weights), which this actor goes
        on broadcasting to the engines' processes on a thread of its own once the call returns (settled by the next
        step)."""
        publisher = self.publisher
        if publisher is None:
            raise RuntimeError("TrainerActor.publish: runtime.weight_transport is not broadcast (no publisher)")
        return publisher.publish(self._trainer().weight_source(publisher.dtype, publisher.bucket_bytes), version)

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights of the current version, in the engine's dtype. Returned (not ray.put here) so that
        the object is owned by the caller and outlives this actor; Ray copies them as it returns. In host memory:
        rollout actors need not sit on a GPU, nor on this one. The one whole copy a Ray run makes (the object store
        needs it), built a bucket at a time. Colocated: the first call (the start's weights) also sends the trainer's
        state to host memory, before any engine wakes."""
        weights = self._host_weights()
        if self.pool.route.colocated:
            self._trainer().offload()
        return weights

    def _trainer(self) -> TrainerService:
        """The service; with trainer.distributed, built once the ranks joined (join_ranks)."""
        if self.service is None:
            raise RuntimeError("TrainerActor: the trainer is not built yet (trainer.distributed: join_ranks first)")
        return self.service

    def _host_weights(self) -> dict[str, torch.Tensor]:
        source = self._trainer().weight_source(self.dtype, self.pool.route.bucket_bytes)
        return host_copy(source)


class TrainerRankActor(Placed):
    """A data-parallel trainer rank r > 0 (train_pool/ranks.py Follower) on some node."""

    def __init__(self, pool_json: str, ckpt: str | None):
        pool = TrainPoolConfig.model_validate_json(pool_json)
        torch.set_num_threads(pool.trainer.threads or max(1, int(pool.cpus)))  # as reserved
        self.follower = Follower(pool, Path(ckpt) if ckpt else None)  # resolves this rank's device
        self.pool = pool

    def attach_engine(self, engine: Any, rank: int) -> None:
        """runtime.weight_transport=cuda_ipc (colocated): the engine actor on this rank's GPU (TrainerActor's)."""
        self.follower.pusher = engine_pusher(self.pool.route.timeout_s, self.follower.device, engine, rank)

    def join(self, rank: int, world_size: int, addr: str, port: int) -> None:
        self.follower.join(rank, world_size, addr, port)

    def work(self, work: RankWork) -> RankReport:
        return self.follower.work(work)


class RayRankGroup(RankGroup):
    """Rank 0 over Ray actor calls to the follower actors."""

    def __init__(self, world_size: int, device: Any, followers: list[Any]):
        super().__init__(world_size, device)
        self.followers = followers
        self.refs: list[Any] = []

    def _send(self, works: list[RankWork]) -> None:
        self.refs = [f.work.remote(w) for f, w in zip(self.followers, works)]

    def _collect(self) -> list[RankReport]:
        import ray
        import ray.exceptions

        reports = []
        for rank, ref in enumerate(self.refs, start=1):
            try:
                reports.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                raise RankLost(f"trainer rank {rank} died: {error_line(err)}") from None
            except ray.exceptions.RayTaskError as err:
                raise RankLost(f"trainer rank {rank} failed: {err}") from None
        return reports
