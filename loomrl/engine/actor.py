"""The inference pool's Ray half (ray.engine.count > 0): engines as actors of their own, placed by num_gpus (an engine
per GPU group: a vLLM engine's tensor-parallel size is its own setting), each shared by the rollout actors bound to it
(EngineActor); the Engine protocol over one, for a rollout actor's worker and gateway (RemoteEngine); and the gate
that loads published weights into an engine in order (WeightGate, also used by rollout actors that own their
engine). Without engine actors each rollout actor owns its engine (rollout/actor.py).

Routing: a rollout actor is bound to one engine actor (rollout actor i to engine i mod count) and a GRPO group runs
on one rollout actor, so a program's turns and its group's shared prompt reach one engine and its prefix cache.
Weights: the backend sends each published version to every engine actor (runtime/ray_backend.py publish): an ObjectRef
of the trainer's weights, or with runtime.weight_transport=broadcast a handle of the trainer actor's process group,
which every engine's processes join (engine i as ranks 1 + i * n.., n its WeightRoute.receivers), and a
group dispatched after a publish starts once its engine has loaded that version (EngineActor.catch_up, which loads
it itself when the update was lost to a restart). Ray restarts an engine actor that
died (ray.engine.max_restarts); the fresh one loads the latest published version before it serves (WeightBoard), so
that no token is tagged with a version its weights are not. The calls it was running fail as EngineFault (the
agent loop's engine_error: agent.retry_on may run them again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from loomrl.actor_support import Placed
from loomrl.config import EngineSetup
from loomrl.engine.base import (
    Engine,
    EngineFault,
    EngineMetrics,
    GenerationRequest,
    GenerationResult,
    StreamsBuckets,
    TakesTensors,
    apply_loaded,
)
from loomrl.engine.factory import make_engine
from loomrl.engine.readings import Reading, reading_of
from loomrl.errors import error_line
from loomrl.model.loader import load_engine_model
from loomrl.weights.adapter import AdapterMeta
from loomrl.weights.bucket import BucketRef
from loomrl.weights.fingerprint import Fingerprint, confirm_weights, fingerprint_of
from loomrl.weights.group import Receiver, with_rank_offset
from loomrl.weights.handle import Transport, WeightHandle


class WeightGate:
    """Loads published versions into an engine one at a time, in the order they were sent (an asyncio lock is
    FIFO, and `load` takes it before its first await); `settled` returns once the versions sent before it are in.
    `rank_offset`: the first rank of this engine's processes in a broadcast's group; `device`: where a built-in
    engine's model is (a broadcast it receives here lands there); `label`: the engine's name in a WeightMismatch."""

    def __init__(self, engine: Engine, interrupt_on_update: bool, *, rank_offset: int = 1,
                 device: torch.device | None = None, label: str = "engine"):
        self.engine = engine
        self.label = label
        self.interrupt_on_update = interrupt_on_update
        self.rank_offset = rank_offset
        self.device = device or torch.device("cpu")
        self.receiver = Receiver()  # broadcast into an engine that takes tensors
        self._lock = asyncio.Lock()  # bound to the actor's event loop when first waited on

    async def load(self, handle: WeightHandle) -> dict[str, float]:
        """Fetch and apply: transport "ray", an ObjectRef owned by the driver; "broadcast", the trainer's group,
        received by the engine's own processes when it opens the handle (vLLM, SGLang), else here. Then confirmed
        (weights/fingerprint.py confirm_weights): WeightMismatch, naming the engine, when it did not take effect: against
        the publisher's fingerprint (broadcast: in the handle, or the sums a sharded trainer sends after the weights,
        received here or by the engine's own processes), or, for "ray", that of the tensors the object store gave (Ray's
        own transfer is not fingerprinted by the trainer). Returns the version and how long fetching and applying took."""
        async with self._lock:
            t0 = time.perf_counter()
            weights, expected = None, handle.fingerprint
            if handle.transport is Transport.BROADCAST:
                handle = dataclasses.replace(handle, payload=with_rank_offset(handle.payload, self.rank_offset))
                if handle.transport not in self.engine.opens:
                    weights, followed = await asyncio.to_thread(self.receiver.receive_all, handle.payload, self.device)
                    if expected is not None and expected.follows:  # a sharded trainer's sums, received here
                        expected = Fingerprint(sums=followed)
            else:
                weights = await handle.payload
            t1 = time.perf_counter()
            if self.interrupt_on_update:
                self.engine.interrupt()  # in-flight turns resume under the new weights (AgentLoop._generate)
            if weights is None:
                if handle.adapter is not None:  # config.run refuses these (runtime.weight_transport)
                    raise EngineFault(f"{self.label}: adapter {handle.adapter.name} came by a transport the engine "
                                      f"opens itself ({handle.transport}), which carries full weights only")
                await asyncio.to_thread(self.engine.update_from, handle)
            else:
                await asyncio.to_thread(apply_loaded, self.engine, weights, handle)
            if expected is None and handle.transport is Transport.RAY:
                if weights is None:  # a "ray" payload is the published tensors themselves
                    raise ValueError(f"{self.label}: the ray weight handle of version {handle.version} held no tensors")
                expected = fingerprint_of(weights)
            t2 = time.perf_counter()
            checked = await asyncio.to_thread(confirm_weights, self.engine, self.label, handle.version, expected)
        return {"version": handle.version, "load_s": t1 - t0, "apply_s": t2 - t1,
                "confirm_s": time.perf_counter() - t2, "fingerprinted": checked,
                **({"adapter_version": handle.version, "adapter_bytes": handle.nbytes} if handle.adapter else {})}

    async def settled(self) -> None:
        async with self._lock:
            pass


class WeightBoard:
    """The latest published version (its handle), for engine actors that Ray restarts."""

    def __init__(self) -> None:
        self.handle: WeightHandle | None = None

    def post(self, handle: WeightHandle) -> None:
        self.handle = handle

    def latest(self) -> WeightHandle | None:
        return self.handle


class EngineActor(Placed):
    """One inference engine (engine.kind) over the run's model on the node ray.engine places it, serving the rollout
    actors bound to it; `setup_json`: its EngineSetup as JSON; `replica`: its index (with several SGLang or vLLM
    servers, the one it drives); `rank_offset`: the first rank of its processes in a broadcast's group (the backend's
    layout: 1 + replica * WeightRoute.receivers). Async actor: their requests run at once, batched by the engine. It
    holds the model's weights only for the built-in engine (model/loader.py load_engine_model)."""

    def __init__(self, setup_json: str, board: Any, replica: int, rank_offset: int):
        import ray

        setup = EngineSetup.model_validate_json(setup_json)
        torch.set_num_threads(setup.engine.threads or max(1, int(setup.cpus)))
        torch.manual_seed(setup.seed)
        # weights only for the built-in engine; vLLM's and SGLang's own processes hold theirs (a skeleton here)
        model, tokenizer = load_engine_model(setup, None)
        self.engine = make_engine(setup, model, tokenizer, 0, replica)
        # (never a broadcast handle: with broadcast, engine actors are not restarted, runtime/ray_backend.py)
        latest = ray.get(board.latest.remote())
        if latest is not None:  # restarted after a crash: the run's current version before the first request
            apply_loaded(self.engine, ray.get(latest.payload), latest)
        device = next(model.parameters()).device if setup.engine.kind == "builtin" else None  # else meta: not here
        self.gate = WeightGate(self.engine, setup.interrupt_on_update, rank_offset=rank_offset, device=device,
                               label=f"{setup.engine.kind} (engine actor {replica})")

    def info(self) -> tuple[int, int]:
        """(kv_budget, version)."""
        return self.engine.kv_budget, self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.generate(request)

    async def update_weights(self, handle: WeightHandle) -> dict[str, float]:
        return await self.gate.load(handle)

    async def catch_up(self, latest: WeightHandle | None) -> None:
        """Returns once the versions sent before this call are loaded and the engine has `latest` (the backend's
        newest): an update sent while Ray was restarting this actor can fail after the fresh one read the board,
        and the engine would then serve an older version under newer dispatches (stale at consumption)."""
        await self.gate.settled()
        # (a broadcast or a streamed version was sent once: it cannot be received again; with them, engine actors are
        # not restarted)
        once = (Transport.BROADCAST, Transport.CUDA_IPC)
        if latest is not None and latest.transport not in once and self.engine.version < latest.version:
            await self.gate.load(latest)

    async def open_buckets(self, version: int, shapes: dict[str, list[int]]) -> None:
        """The colocated trainer rank's streamed version (train_pool/push.py): StreamsBuckets.open_buckets."""
        await asyncio.to_thread(self._streams().open_buckets, version, shapes)

    async def load_bucket(self, ref: BucketRef) -> None:
        await asyncio.to_thread(self._streams().load_bucket, ref)

    async def close_buckets(self, version: int, expected: Fingerprint | None, failed: str = "") -> dict[str, float]:
        """The version complete (or, `failed`, abandoned: the update fails), then confirmed against `expected`, the
        pushing rank's fingerprint; its timing."""
        await asyncio.to_thread(self._streams().close_buckets, failed)
        t0 = time.perf_counter()
        checked = await asyncio.to_thread(confirm_weights, self.engine, self.gate.label, version, expected)
        return {"version": version, "confirm_s": time.perf_counter() - t0, "fingerprinted": checked}

    def _streams(self) -> StreamsBuckets:
        if not isinstance(self.engine, StreamsBuckets):
            raise EngineFault(f"{self.gate.label} does not load a version bucket by bucket (runtime.weight_transport="
                              "cuda_ipc on Ray needs engine.kind=vllm in process)")
        return self.engine

    def interrupt(self) -> None:
        self.engine.interrupt()

    def release(self, program_id: str) -> None:
        self.engine.release(program_id)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def wake(self) -> None:
        await asyncio.to_thread(self.engine.wake)

    def reading(self) -> Reading:
        """The engine's counters now (engine/readings.py), taken here: their up_s is by this process's clock."""
        return reading_of(self.engine)

    def close(self) -> EngineMetrics:
        self.engine.close()
        return self.engine.metrics


class RemoteEngine(TakesTensors):
    """The Engine protocol over an EngineActor, in a rollout actor. Weights go to the engine actor from the backend,
    not through here (update_weights refuses). `metrics` counts what this client sent and got back. A request that
    finds the engine actor restarting waits for it, up to `restart_wait_s`; one it was running when it died fails
    (EngineFault: the agent loop's engine_error)."""

    def __init__(self, actor: Any, restart_wait_s: float):
        import ray

        self.actor = actor
        self.restart_wait_s = restart_wait_s
        self.kv_budget, self._version = ray.get(actor.info.remote())
        self.metrics = EngineMetrics()
        self._closed = False

    @property
    def version(self) -> int:
        """The newest version this client has seen tokens of."""
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        import ray
        import ray.exceptions

        if self._closed:
            raise EngineFault("engine: closed")
        m = self.metrics
        m.requests += 1
        m.prompt_tokens += len(request.prompt_ids)
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            try:
                result = await self.actor.generate.remote(request)
                break
            except ray.exceptions.ActorUnavailableError as err:  # restarting: wait for it, bounded
                if time.monotonic() > deadline:
                    m.faults += 1
                    raise EngineFault(f"engine actor unavailable for {self.restart_wait_s:.0f}s "
                                      f"(ray.engine_restart_wait_s): {error_line(err)}") from None
                await asyncio.sleep(0.5)
            except ray.exceptions.RayActorError as err:  # died mid-request (Ray restarts it for the next ones)
                m.faults += 1
                raise EngineFault(f"engine actor died: {error_line(err)}") from None
            except ray.exceptions.RayTaskError as err:  # what the engine raised, as a local engine would raise it
                raise (err.cause or EngineFault(f"engine actor: {error_line(err, end=True)}")) from None
        m.finished += 1
        m.generated_tokens += len(result.token_ids)
        self._version = max([self._version, *result.versions])
        return result

    def update_weights(self, weights: dict | None, version: int) -> None:
        raise RuntimeError("RemoteEngine.update_weights: weights go to the engine actors (runtime/ray_backend.py ActorRoute.publish)")

    def update_adapter(self, weights: dict, adapter: AdapterMeta, version: int) -> None:
        raise RuntimeError("RemoteEngine.update_adapter: adapters go to the engine actors (runtime/ray_backend.py "
                           "ActorRoute.publish)")

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        raise RuntimeError("RemoteEngine.weight_fingerprint: the engine actor confirms its weights (WeightGate.load)")

    def sleep(self) -> None:
        raise RuntimeError("RemoteEngine.sleep: the backend puts the engine actors to sleep (runtime/ray_backend.py ActorRollouts.sleep)")

    def wake(self) -> None:
        raise RuntimeError("RemoteEngine.wake: the backend wakes the engine actors (runtime/ray_backend.py ActorRollouts.wake)")

    def interrupt(self) -> None:
        self.actor.interrupt.remote()

    def release(self, program_id: str) -> None:
        self.actor.release.remote(program_id)

    def close(self) -> None:
        """This client only: the backend closes the engine actors."""
        self._closed = True
