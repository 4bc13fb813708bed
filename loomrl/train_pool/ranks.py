"""Trainer ranks (trainer.world_size > 1, or trainer.parallel=fsdp): data-parallel training inside the training pool.

Rank 0 is the TrainerService (buffer, filters, ledger, checkpoints, weights for the engines). Ranks 1..N-1 are
followers: each holds a replica of the model and optimizer, made from the same checkpoint (or the same initial model).
Every step rank 0 cuts its samples into shards (distributed.shard_samples; a group's samples stay on one rank under tree
merge), sends each follower its shard, trains on its own, and the ranks meet in the process group only inside the step
(train_pool/distributed.py sums gradients and counts there). Work travels outside the process group (queues locally, actor
calls on Ray), so a follower can wait any time for the next step without a collective timing out.

Every rank reads its model first (`load_rank`), then joins the process group (the followers once rank 0 has read its
own, so that no rank waits in the rendezvous while another reads a large model), then builds its trainer the same way
(`build_trainer`): sharded ranks (trainer.parallel=fsdp) shard the model as they build it. After each step every follower answers with its step counter
and a checksum of its parameters; rank 0 compares them with its own, so replicas that drifted apart stop the run
instead of training on silently (sharded ranks hold different parts: no checksum). A checkpoint of sharded ranks is
written by all of them (RankGroup.save_shards), and every version they publish, like the checkpoint's model folder, is
gathered by all of them a bucket at a time (RankGroup.gathered). A follower that dies, or a collective that fails, raises RankLost: the runtime restarts the
whole trainer (all ranks) from the latest checkpoint, as it does when rank 0 dies.

Launchers: local (`spawn_local_followers`: processes of this machine, gloo over loopback) and Ray
(train_pool/actor.py TrainerRankActor, gloo between nodes).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loomrl.collectives import collective_failed
from loomrl.config import ModelConfig, TrainerConfig, TrainPoolConfig
from loomrl.devices import trainer_device
from loomrl.model.loader import loads_from_rank0
from loomrl.run_folder import CheckpointFolder
from loomrl.train_pool.distributed import (
    DataParallelTrainer,
    Gather,
    LoraGathering,
    free_port,
    init_process_group,
    param_checksum,
    shard_positions,
)
from loomrl.train_pool.offload import Moved, drop_gradients, offload, onload
from loomrl.train_pool.push import EnginePusher, PushReport
from loomrl.trainer.checkpoint import load_optimizer, load_state
from loomrl.trainer.forward import compute_dtype
from loomrl.trainer.fsdp import fsdp_shard, load_sharded_optimizer, save_sharded_optimizer
from loomrl.trainer.lora import base_checkpoint
from loomrl.trainer.trainer import StepStats, Trainer, initial_policy
from loomrl.types import TrainingSample
from loomrl.weights.source import WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Bounds each collective of a step: the ranks' skew within one step, not the wait between steps.
COLLECTIVE_TIMEOUT_S = 300.0
JOIN = "join"  # rank 0 -> a local follower: rank 0 has read its model, enter the rendezvous now


class RankLost(RuntimeError):
    """A trainer rank died, failed, or drifted from rank 0; the trainer restarts from a checkpoint."""


@dataclass(slots=True)
class RankWork:
    """One step's work for one follower (rank 0 carries the step's idle counts, see train_step)."""

    samples: list[TrainingSample] = field(default_factory=list)
    skip: bool = False  # a step without signal: advance the schedule only (Trainer.skip_step)
    save: str = ""  # instead: write this rank's part of the optimizer state into this folder (sharded ranks)
    gather: Gather | None = None  # instead: take part in gathering the full parameters (sharded ranks: RankGroup.gathered)
    move: str = ""  # instead: "offload" or "onload" this rank's state (colocated engines: train_pool/offload.py)
    push: Push | None = None  # instead: push the full parameters to this rank's engine (train_pool/push.py)


@dataclass(slots=True, frozen=True)
class Push:
    """A version for every colocated rank to push to the engine on its GPU: the parameters as `gather` asks."""

    version: int
    gather: Gather


@dataclass(slots=True)
class RankReport:
    step: int
    checksum: tuple[int, int] | None  # None: sharded ranks (each holds other parts)
    gaps: list[list[float] | None] = field(default_factory=list)  # a step's: StepStats.gaps of this rank's samples

    @classmethod
    def of(cls, trainer: Trainer, gaps: list[list[float] | None] | None = None) -> RankReport:
        return cls(trainer.step, None if trainer.sharded else param_checksum(trainer.params), gaps or [])


@dataclass(slots=True, frozen=True)
class Reference:
    """KL's reference as a rank loaded it before joining the process group (`load_rank`): None when the run needs no
    model of its own for it (a fresh run copies the policy; LoRA switches its adapters off; no KL term)."""

    model: PreTrainedModel | None


@dataclass(slots=True, frozen=True)
class RankModel:
    """What a trainer rank reads before it joins the process group: its model (model/loader.py load_rank_model), its
    tokenizer and KL's reference. Read first, so that no rank waits in the rendezvous (bounded by
    COLLECTIVE_TIMEOUT_S) while another reads a large model: rank 0 tells the followers to join once it has read its
    own (RankGroup.join)."""

    model: PreTrainedModel
    tokenizer: Any
    reference: Reference


def load_rank(pool: TrainPoolConfig, ckpt: Path | None, device: torch.device, *, rank0: bool) -> RankModel:
    """Rank 0's (`rank0`) or a follower's model, tokenizer and reference, resuming from `ckpt` (None: the configured
    model); under LoRA the base (the checkpoint holds only the adapter)."""
    from loomrl.model.loader import load_rank_model

    model, tokenizer = load_rank_model(pool.model, base_checkpoint(pool.trainer.lora, ckpt), trainer=pool.trainer,
                                       rank0=rank0)
    return RankModel(model, tokenizer, reference_of(pool.trainer, pool.model, device, ckpt, rank0=rank0))


def reference_of(cfg: TrainerConfig, start: ModelConfig, device: torch.device, ckpt: Path | None, *,
                 rank0: bool) -> Reference:
    """KL's reference when resuming from `ckpt`: `start`, the model the run started from (not the checkpoint's)."""
    return Reference(initial_policy(start, cfg, device, ckpt, from_rank0=loads_from_rank0(cfg), rank0=rank0))


def build_trainer(cfg: TrainerConfig, start: ModelConfig, device: torch.device, model: PreTrainedModel,
                  ckpt: Path | None, reference: Reference | None = None) -> Trainer:
    """Every rank's trainer (and a lone one's) of `model` on `device` (trainer.device as the pool's process resolved
    it): sharded with trainer.parallel=fsdp (the process group is up by then). Resuming from `ckpt`: its optimizer
    state and step, and KL's `reference` (None: read now, see reference_of)."""
    sharded = cfg.parallel == "fsdp"
    shard = partial(fsdp_shard, param_dtype=compute_dtype(cfg.precision, device), device=device) if sharded else None
    # several FSDP2 ranks: `model` is rank 0's whole on the CPU or another's skeleton (load_rank_model)
    from_rank0 = loads_from_rank0(cfg)
    if reference is None:
        reference = reference_of(cfg, start, device, ckpt, rank0=not dist.is_initialized() or dist.get_rank() == 0)
    trainer = Trainer(model, cfg, initial_model=reference.model, shard=shard, device=device, from_rank0=from_rank0)
    if ckpt is not None:
        shards = (lambda folder: load_sharded_optimizer(trainer, folder)) if sharded else None
        load_optimizer(ckpt, trainer.optimizer, trainer.scheduler, shards=shards)
        trainer.step = load_state(ckpt)["step"]
        if trainer.lora is not None:  # the model is the base (lora.py base_checkpoint); the adapter is the checkpoint's
            trainer.lora.load(CheckpointFolder(ckpt).model)
    return trainer


class Follower:
    """Rank r > 0: a model and optimizer replica (or shard) that trains on the shards rank 0 sends."""

    def __init__(self, pool: TrainPoolConfig, ckpt: Path | None):
        self.pool, self.ckpt = pool, ckpt
        self.device = trainer_device(pool.trainer)  # this rank's, resolved once in its process
        # float32 on trainer.device, or FSDP2's skeleton (filled from rank 0's after sharding); before joining, so
        # that a rank that cannot start fails fast
        self.loaded: RankModel | None = load_rank(pool, ckpt, self.device, rank0=False)
        self.dp: DataParallelTrainer | None = None
        self.pusher: EnginePusher | None = None  # colocated on Ray with a streamed route: this rank's engine

    def join(self, rank: int, world_size: int, addr: str, port: int) -> None:
        loaded, self.loaded = self.loaded, None  # the trainer owns them from here
        assert loaded is not None, "Follower.join once"
        init_process_group(rank, world_size, master_addr=addr, master_port=port, timeout_s=COLLECTIVE_TIMEOUT_S,
                           device=self.device)
        self.dp = DataParallelTrainer(build_trainer(self.pool.trainer, self.pool.model, self.device, loaded.model,
                                                    self.ckpt, loaded.reference))

    def work(self, w: RankWork) -> RankReport:
        assert self.dp is not None, "Follower.join first"
        if w.gather is not None:
            for _ in self.dp.gathered(w.gather).buckets():  # rank 0 keeps them; this rank only takes part
                pass
        elif w.push is not None:
            if self.pusher is None:
                raise RuntimeError("trainer rank: asked to push weights without an engine (a colocated Ray run's)")
            drop_gradients(self.dp.trainer)
            self.pusher.push(self.dp.own_source(w.push.gather), w.push.version)
        elif w.move:
            (offload if w.move == "offload" else onload)(self.dp.trainer)
        elif w.save:
            save_sharded_optimizer(self.dp.trainer, Path(w.save))
        elif w.skip:
            self.dp.trainer.skip_step()
        else:
            return RankReport.of(self.dp.trainer, self.dp.train_step(w.samples).gaps)
        return RankReport.of(self.dp.trainer)


class RankGroup(ABC):
    """Rank 0's side: shards a step over the ranks and checks the followers stayed in step. Made and joined
    before rank 0's trainer exists (sharded ranks build it in the process group), then given it (`attach`)."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device  # rank 0's trainer.device
        self.dp: DataParallelTrainer | None = None

    def join(self, addr: str, port: int) -> None:
        """Rank 0 joins the process group, once it has read its model (load_rank); the followers join theirs
        concurrently (local ones when told to: LocalRankGroup.join; Ray's when the driver tells them)."""
        init_process_group(0, self.world_size, master_addr=addr, master_port=port, timeout_s=COLLECTIVE_TIMEOUT_S,
                           device=self.device)

    def attach(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.keep_groups = trainer.cfg.tree_merge != "off"
        self.dp = DataParallelTrainer(trainer)
        if trainer.sharded and trainer.lora is not None:  # its gathers must tell the followers to take part
            trainer.lora.gathering = LoraGathering(self.gathered, keep=True)

    def train_step(self, samples: list[TrainingSample], *, idle_tokens: int, idle_seqs: int,
                   idle_longest: int) -> StepStats:
        assert self.dp is not None, "RankGroup.join first"
        positions = shard_positions(samples, self.world_size, keep_groups=self.keep_groups)
        shards = [[samples[i] for i in shard] for shard in positions]
        self._send([RankWork(samples=s) for s in shards[1:]])
        try:  # rank 0 carries the step's idle counts; the ranks sum them
            stats = self.dp.train_step(shards[0], idle_tokens=idle_tokens, idle_seqs=idle_seqs,
                                       idle_longest=idle_longest)
        except RuntimeError as err:
            if not collective_failed(err):
                raise  # this rank's own error (a bug, out of memory): as with one rank
            # A peer died or timed out. The runtime stops every rank (a follower may still wait in a
            # collective, so no report is awaited here).
            raise RankLost(f"a collective of the data-parallel step failed: {err}") from err
        reports = self._collect()
        self._check(reports)
        # the per-sample gaps back in the order of `samples` (a follower's come in the order of its shard)
        gaps: list[list[float] | None] = [None] * len(samples)
        for shard, shard_gaps in zip(positions, [stats.gaps, *(r.gaps for r in reports)]):
            for i, g in zip(shard, shard_gaps):
                gaps[i] = g
        stats.gaps = gaps
        return stats

    def skip_step(self) -> None:
        self._send([RankWork(skip=True) for _ in range(self.world_size - 1)])
        self.trainer.skip_step()
        self._check(self._collect())

    def gathered(self, gather: Gather) -> WeightSource:
        """The full parameters as `gather` asks, a bucket at a time on rank 0's device, gathered by every rank (the
        followers are told when the source is read, and answer when it is read to the end). The followers are paced
        by rank 0's reader: none gathers bucket k+1 before the reader is done with bucket k (distributed.py
        PACE_TIMEOUT_S), so a slow reader (a checkpoint written to slow storage) bounds one bucket's wait, not the
        NCCL watchdog's wait for the whole version. Read it once, to the end, before the next step (a broadcast reads
        it on its own thread: settle first)."""
        assert self.dp is not None, "RankGroup.attach first"
        return _RankGathered(self, self.dp.gathered(gather), gather)

    def push(self, push: Push, pusher: EnginePusher) -> PushReport:
        """Every rank pushes `push`'s version to the engine on its GPU (rank 0 through `pusher`, the followers through
        their own); sharded ranks gather each bucket together, paced as `gathered` paces them. Rank 0's report."""
        assert self.dp is not None, "RankGroup.attach first"
        self._send([RankWork(push=push) for _ in range(self.world_size - 1)])
        try:
            report = pusher.push(self.dp.own_source(push.gather), push.version)
        except RuntimeError as err:
            # the followers' reports are read (none left for the next call); rank 0's error is the cause: an engine's
            # (VersionNotDelivered), or a collective's, whose failure the followers then report too
            with contextlib.suppress(RankLost):
                self._collect()
            if not collective_failed(err):
                raise
            raise RankLost(f"gathering the parameters from the trainer ranks failed: {err}") from err
        self._check(self._collect())
        return report

    def offload(self) -> Moved:
        """Every rank's state to host memory, its GPU's cache emptied (a colocated engine wakes on each GPU next);
        rank 0's account of what it moved."""
        return self._move("offload", offload)

    def onload(self) -> Moved:
        """Every rank's state back on its GPU, for a step."""
        return self._move("onload", onload)

    def _move(self, move: str, local: Callable[[Trainer], Moved]) -> Moved:
        self._send([RankWork(move=move) for _ in range(self.world_size - 1)])
        try:
            moved = local(self.trainer)
        finally:  # the followers' reports are read even when rank 0's own move failed (none left for the next call)
            reports = self._collect()
        self._check(reports)
        return moved

    def save_shards(self, folder: Path) -> None:
        """Every rank writes its part of the optimizer state into `folder` (a checkpoint of sharded ranks)."""
        self._send([RankWork(save=str(folder)) for _ in range(self.world_size - 1)])
        save_sharded_optimizer(self.trainer, folder)
        self._check(self._collect())

    def _check(self, reports: list[RankReport]) -> None:
        mine = RankReport.of(self.trainer)
        for rank, r in enumerate(reports, start=1):
            if r.step != mine.step or r.checksum != mine.checksum:
                raise RankLost(f"trainer rank {rank} drifted from rank 0 (step {r.step} vs {mine.step}, parameter "
                               f"checksum {r.checksum} vs {mine.checksum}); restarting the ranks from a checkpoint")

    # -- transport (subclasses) -------------------------------------------------------------------
    @abstractmethod
    def _send(self, works: list[RankWork]) -> None: ...

    @abstractmethod
    def _collect(self) -> list[RankReport]:
        """The followers' reports, in rank order; RankLost when one failed or died."""

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _RankGathered(WeightSource):
    """Rank 0's GatheredSource, with the followers told to take part as it is read (each follower reads its own
    GatheredSource in Follower.work, paced bucket by bucket by rank 0's)."""

    def __init__(self, ranks: RankGroup, local: WeightSource, gather: Gather):
        super().__init__(local.specs, local.bucket_bytes, local.device)
        self.ranks, self.local, self.gather = ranks, local, gather

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        ranks = self.ranks
        ranks._send([RankWork(gather=self.gather) for _ in range(ranks.world_size - 1)])
        try:
            yield from self.local.buckets()
        except RuntimeError as err:
            if not collective_failed(err):
                raise
            raise RankLost(f"gathering the parameters from the trainer ranks failed: {err}") from err
        ranks._check(ranks._collect())


# ---------------------------------------------------------------- local processes


class Child:
    """A process the training pool spawned (the trainer process, a follower rank): started on creation. It ends
    when the process that spawned it does, however that one ended (`exit_with_parent`)."""

    def __init__(self, what: str, name: str, target: Callable[..., None], *args: Any):
        self.what = what
        self.proc = mp.get_context("spawn").Process(target=_child_main, name=name, daemon=True,
                                                    args=(os.getpid(), target, *args))
        self.proc.start()

    def dead(self) -> str | None:
        """Why it ended (negative exit code: the signal that killed it), or None while it runs; reaps it."""
        if self.proc.is_alive():
            return None
        code = self.proc.exitcode
        if code is None:  # started in __init__, so not alive means ended, with an exit code
            raise RuntimeError(f"{self.what}: its process has neither run nor ended")
        if code >= 0:
            return f"{self.what} exited with code {code}"
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"{self.what} died from signal {name}" + (" (killed: out of memory, or by an operator)"
                                                          if name == "SIGKILL" else "")

    def stop(self, wait_s: float) -> None:
        """Give it `wait_s` to end (it was asked to), then SIGTERM (its finally blocks run), then SIGKILL."""
        self.proc.join(timeout=wait_s)
        for send in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                send()
                self.proc.join(timeout=10)


@dataclass(slots=True)
class LocalFollowers:
    """Followers spawned on this machine: their processes and the queues to reach them."""

    port: int
    children: list[Child]
    inboxes: list[Any]  # rank 0 -> follower r (index r - 1)
    outboxes: list[Any]  # follower -> rank 0

    def channels(self) -> tuple[list[Any], list[Any]]:
        """What rank 0 needs (picklable: mp queues can be passed to a process it spawns)."""
        return self.inboxes, self.outboxes

    def dead(self) -> str | None:
        """Why a follower is gone, or None while all live."""
        return next((why for c in self.children if (why := c.dead())), None)

    def stop(self) -> None:
        for q in self.inboxes:
            with contextlib.suppress(ValueError, OSError):  # closed already
                q.put(None)
        for c in self.children:
            c.stop(10)


def spawn_local_followers(pool: TrainPoolConfig, device: torch.device, ckpt: Path | None,
                          threads: int) -> LocalFollowers:
    """Start ranks 1..trainer.world_size-1 as processes of this machine (rank 0, on `device`, then joins on
    `port`)."""
    world = pool.trainer.world_size
    ctx = mp.get_context("spawn")
    port = free_port()
    inboxes = [ctx.Queue() for _ in range(world - 1)]
    outboxes = [ctx.Queue() for _ in range(world - 1)]
    children = [Child(f"trainer rank {r}", f"loomrl-trainer-rank{r}", _follower_main,
                      local_rank_config(pool, device, r).model_dump_json(), str(ckpt) if ckpt else None, r, world,
                      port, threads, inboxes[r - 1], outboxes[r - 1])
                for r in range(1, world)]
    return LocalFollowers(port=port, children=children, inboxes=inboxes, outboxes=outboxes)


def local_rank_config(pool: TrainPoolConfig, device: torch.device, rank: int) -> TrainPoolConfig:
    """Local rank r's pool: with CUDA, rank r trains on the r-th GPU counted from rank 0's `device` (trainer.device
    resolved; ranks of Ray actors each see only their own GPU, so there every rank's trainer.device is the same)."""
    if device.type != "cuda" or rank == 0:
        return pool
    trainer = pool.trainer.model_copy(update={"device": f"cuda:{device.index + rank}"})
    return pool.model_copy(update={"trainer": trainer})


def follower_threads(trainer: TrainerConfig, trainer_share: int) -> int:
    """Torch threads of each local follower: trainer.threads, else the trainer's share of the cores
    split over the ranks (the ranks run at the same time)."""
    return trainer.threads or max(1, trainer_share // trainer.world_size)


def join_watching(ranks: RankGroup, followers: LocalFollowers) -> None:
    """Rank 0 joins the process group, giving up as soon as a follower dies on its way there (instead
    of waiting for the rendezvous timeout)."""
    errors: list[BaseException] = []

    def join() -> None:
        try:
            ranks.join("127.0.0.1", followers.port)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    t = threading.Thread(target=join, daemon=True, name="loomrl-rank0-join")
    t.start()
    while t.is_alive():
        t.join(timeout=0.5)
        why = followers.dead() if t.is_alive() else None
        if why:
            raise RankLost(f"{why} before it joined the process group")
    if errors:
        raise errors[0]


class LocalRankGroup(RankGroup):
    """Rank 0 over queues to local follower processes. `dead`: how rank 0 learns that a follower is
    gone while it waits for its report (the followers' parent can tell; in async mode rank 0 is their
    sibling, and the parent stops the whole trainer instead)."""

    def __init__(self, world_size: int, device: torch.device, inboxes: list[Any], outboxes: list[Any],
                 dead: Callable[[], str | None] | None = None):
        super().__init__(world_size, device)
        self.inboxes, self.outboxes, self.dead = inboxes, outboxes, dead

    def join(self, addr: str, port: int) -> None:
        for q in self.inboxes:  # the followers wait for this before they enter the rendezvous (_follower_main)
            q.put(JOIN)
        super().join(addr, port)

    def _send(self, works: list[RankWork]) -> None:
        for q, w in zip(self.inboxes, works):
            q.put(w)

    def _collect(self) -> list[RankReport]:
        reports = []
        for rank, q in enumerate(self.outboxes, start=1):
            while True:
                try:
                    kind, payload = q.get(timeout=0.5)
                    break
                except queue.Empty:
                    why = self.dead() if self.dead else None
                    if why:
                        raise RankLost(why) from None
            if kind == "error":
                raise RankLost(f"trainer rank {rank} failed:\n{payload}")
            reports.append(payload)
        return reports


def name_process(name: str) -> None:
    """Name this process as `ps`, `top` and /proc/PID/comm show it (Linux; 15 characters at most),
    so an operator can tell the spawned trainer ranks apart. Elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def exit_with_parent(parent: int, grace_s: float = 10.0) -> None:
    """End this process once `parent` is gone, whatever ended it (SIGKILL included: nothing else would tell us). A
    thread polls our parent pid, which changes when the parent dies (we are handed to init or a subreaper), then
    sends this process SIGTERM, so that a process that handles it unwinds through its finally blocks (the trainer
    process unlinks its weight segments there), and exits hard if that has not ended it in `grace_s`.
    Not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that spawned us ends, which need not be the process."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="loomrl-parent-watch").start()


def _child_main(parent: int, target: Callable[..., None], *args: Any) -> None:
    """Entry of every Child: watch the parent (pid passed in: it may be gone before this line runs), then work."""
    exit_with_parent(parent)
    target(*args)


def _follower_main(pool_json: str, ckpt: str | None, rank: int, world: int, port: int, threads: int,
                   inbox: Any, outbox: Any) -> None:
    name_process(f"loomrl-rank{rank}")
    try:
        torch.set_num_threads(threads)
        follower = Follower(TrainPoolConfig.model_validate_json(pool_json), Path(ckpt) if ckpt else None)
        if (first := inbox.get()) is None:
            return  # stopped before rank 0 had read its model
        if first != JOIN:
            raise RuntimeError(f"trainer rank {rank}: expected rank 0's word to join, got {first!r}")
        follower.join(rank, world, "127.0.0.1", port)
        while (work := inbox.get()) is not None:
            outbox.put(("report", follower.work(work)))
    except BaseException:  # noqa: BLE001 - rank 0 reads it and stops the step
        outbox.put(("error", traceback.format_exc()))
        outbox.close()
        outbox.join_thread()  # delivered before we exit
        sys.exit(1)  # a failed rank says so in its exit code too (its parent may only see that)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
