"""Data-parallel training on torch.distributed (gloo on CPU, NCCL on CUDA): N ranks, one model replica each, the same
optimizer step as one process training on the whole batch.

Each rank trains on its shard of the step's samples. Two things make the step equal the single-process
one (up to float summation order):
- denominators: the loss is aggregated with step-level denominators (losses.aggregate), so every rank
  must use the global ones. The ranks all-reduce their counts first and each passes the other ranks'
  sampled tokens and sequences to Trainer.train_step as idle_tokens / idle_seqs: tokens that count in
  the denominator but are not trained here. token_sum_norm without a norm_constant also needs the
  global longest sample; the step runs with that constant set (see `_global_norm`).
- gradients: after this rank's last backward pass and before clipping, gradients are summed over the
  ranks (all_reduce SUM, one flat buffer per dtype) through Trainer's grad hook. Every rank then clips
  the same gradient and takes the same AdamW and scheduler step, so the replicas stay identical.

Why not torch DDP: DDP all-reduces inside each backward pass, so every rank must run the same number of backward passes,
and shards here are uneven (3 samples are fewer micro-batches than 5); it prepares its reducer in the wrapper's forward,
while the trainer calls the decoder and the head directly; and it averages gradients, while per-rank losses over global
denominators must be summed. One all-reduce after the last backward moves the same bytes and only gives up DDP's overlap
of communication with the backward pass (worth it on GPUs, little on CPU).

Sharded ranks (trainer/fsdp.py, FSDP2; trainer.parallel=fsdp): parameters, gradients and AdamW state split over the
ranks; FSDP reduces gradients inside every backward, so the ranks run one shared plan of micro-batches (Trainer pads
the shorter ones). Full parameters exist only a bucket at a time (`GatheredSource`): to publish a version or write the
checkpoint's model folder every rank gathers one bucket's parameters (`full_tensor()`, on the ranks' device: NCCL on
GPUs), rank 0 casts them to the engine's dtype there and hands them to the publisher, and the bucket is dropped before
the next; no rank ever holds a whole-model copy, on the GPU or in host memory. The followers are paced a bucket at a
time by a host-side barrier (`PACE_TIMEOUT_S`), so none runs ahead of rank 0 while rank 0 hands a bucket on. The
optimizer state is checkpointed in parts with torch.distributed.checkpoint (fsdp.py). Under trainer.lora the same
gathering serves the adapter (its checkpoint, adapter publishing: the trained parameters are exactly the adapters) and
the merged weights (`GatheredMerged`: each targeted linear's W, A and B gathered, merged on rank 0), read through the
Lora's `LoraGathering`. What is not here: elastic membership. A rank that fails makes the others fail:
the run's rank group (train_pool/ranks.py) stops them all; elsewhere the process group's timeout does.
"""

from __future__ import annotations

import os
import socket
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomrl.collectives import bounded_nccl
from loomrl.model.adapter import ADAPTER
from loomrl.trainer.lora import Lora
from loomrl.trainer.moe_step import MoeStats
from loomrl.trainer.trainer import StepStats, Trainer
from loomrl.types import TrainingSample
from loomrl.weights.source import DictSource, Entry, TensorSpec, WeightSource, dtype_name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" = every interface; another process could take it before rank
    0 binds it: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, *, master_port: int, master_addr: str = "127.0.0.1",
                       device: torch.device | None = None, timeout_s: float = 60.0) -> None:
    """Join the default process group: NCCL when this rank trains on a CUDA `device` (made the current one, where
    FSDP and NCCL put their buffers), else gloo; `timeout_s` bounds every collective, so a dead peer is an error
    (on NCCL too: loomrl/collectives.py). No `device_id`: a default group bound to a device makes torch split every
    later group's communicator from it, a collective of all trainer ranks, and the weight broadcast's group
    (weights/group.py) is made by rank 0 alone."""
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        bounded_nccl()
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def shard_samples(samples: list[TrainingSample], world_size: int, *,
                  keep_groups: bool = False) -> list[list[TrainingSample]]:
    """Split a step's samples over ranks (`shard_positions`)."""
    return [[samples[i] for i in shard] for shard in shard_positions(samples, world_size, keep_groups=keep_groups)]


def shard_positions(samples: list[TrainingSample], world_size: int, *, keep_groups: bool = False) -> list[list[int]]:
    """The positions in `samples` each rank trains, balancing tokens (largest first to the least loaded rank).
    `keep_groups`: a group's samples stay on one rank (tree merge then still computes their shared
    prompt once), as long as there are at least as many groups as ranks. With fewer samples than
    ranks some shards are empty; those ranks still take the step (DataParallelTrainer)."""
    by_group: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id, []).append(i)
    units = list(by_group.values()) if keep_groups and len(by_group) >= world_size else [[i] for i in
                                                                                         range(len(samples))]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for unit in sorted(units, key=lambda u: sum(len(samples[i].token_ids) for i in u), reverse=True):
        r = min(range(world_size), key=lambda k: (load[k], len(shards[k]), k))
        shards[r].extend(unit)
        load[r] += sum(len(samples[i].token_ids) for i in unit)
    return shards


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def param_checksum(params: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(sum, sum of squares) of the parameters' bit patterns read as integers, in int64 arithmetic (which wraps: still
    exact and order-free). Equal on bit-identical replicas whatever the thread count (a float sum is not: its rounding
    depends on the reduction order), and almost surely different on replicas that differ in any bit."""
    total = squares = torch.zeros((), dtype=torch.int64, device=params[0].device if params else None)
    for p in params:
        bits = p.detach().contiguous().view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
        total = total + bits.sum()
        squares = squares + (bits * bits).sum()
    return int(total), int(squares)


@dataclass(slots=True, frozen=True)
class Gather:
    """What to gather from sharded ranks: every rank is told the same (RankWork.gather), so their collectives match."""

    dtype: str | None  # the engine's, without "torch." (None: the parameters' own, float32 masters: a checkpoint)
    bucket_bytes: int
    everything: bool = False  # the frozen parameters too (the checkpoint's model folder), else the trained ones
    merged: bool = False  # instead: the LoRA-targeted linears' merged weights (trainer/lora.py; GatheredMerged)


# Pacing of a bucketed gather (GatheredSource): after each bucket every rank meets rank 0 at a barrier of a gloo group
# (host-side: no GPU stream, no NCCL watchdog), which rank 0 enters only once its consumer has handed the bucket on
# (copied it into a snapshot, sent it, written it to the checkpoint's model folder). Without it a follower, whose
# all-gathers return as soon as NCCL has queued them, queued every bucket of a version or of a checkpoint at once: NCCL's
# watchdog counts from that moment, so a checkpoint that rank 0 writes to slow storage in more than the collective
# timeout (train_pool/ranks.py COLLECTIVE_TIMEOUT_S, 300 s) aborted the trainer, and each pending all-gather held its
# output. What a follower holds pending, for the 8-GPU recipe's Qwen2.5-7B (7.62e9 parameters):
#   before (every bucket queued): publish  7.62e9 x 2 B (bf16)    = 15.2 GB
#                                 checkpoint 7.62e9 x 4 B (float32) = 30.5 GB
#   paced (one bucket queued):    publish  engine.weight_bucket_bytes (64 MiB by default)
#                                 checkpoint train_pool/service.py CHECKPOINT_BUCKET_BYTES (2 GiB)
#   (a parameter larger than a bucket is a bucket of its own: the 7B's embeddings, 1.09 GB bf16, 2.18 GB float32)
# The bound below is one bucket's hand-off on rank 0 (a 2 GiB file on slow storage), not the whole version's; and it is
# a separate group even where the training group is gloo too (CPU), so that its timeout is its own.
PACE_TIMEOUT_S = 300.0


def pacing_group() -> dist.ProcessGroup | None:
    """The gloo group that paces bucketed gathers (a collective of every rank of the default group: made once, by
    DataParallelTrainer); None at world size 1."""
    if dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=PACE_TIMEOUT_S))


class _Gathered(WeightSource):
    """Whole tensors of a sharded model, gathered a bucket at a time by every rank (in the same order everywhere), kept
    by the rank that `keep`s them, paced by `pace` (see PACE_TIMEOUT_S and GatheredSource)."""

    def __init__(self, specs: list[TensorSpec], bucket_bytes: int, device: torch.device, *, keep: bool,
                 pace: dist.ProcessGroup | None):
        super().__init__(specs, bucket_bytes, device)
        self.keep, self.pace = keep, pace

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        with torch.no_grad():
            plans = self.plan()
            for k, plan in enumerate(plans):
                bucket = [self._gather(e) for e in plan]
                yield bucket  # rank 0: returns once its reader is done with the bucket
                bucket.clear()  # freed before the next bucket is gathered (WeightSource.buckets)
                self._paced(k, len(plans))

    @abstractmethod
    def _gather(self, e: Entry) -> tuple[str, torch.Tensor]:
        """The entry's whole tensor on the keeping rank, an empty one elsewhere (a collective of every rank)."""

    def _paced(self, k: int, count: int) -> None:
        if self.pace is None:
            return
        try:
            dist.barrier(group=self.pace, timeout=timedelta(seconds=PACE_TIMEOUT_S))
        except RuntimeError as err:  # a peer died, or rank 0 spent longer than the bound on one bucket
            who = "a follower did not reach" if self.keep else "rank 0 did not hand on its bucket and reach"
            raise dist.DistError(f"gathering the parameters: {who} the pacing barrier after bucket {k + 1} of {count} "
                                 f"within {PACE_TIMEOUT_S:.0f} s (gloo): {err}") from err

    def _kept(self, full: torch.Tensor) -> torch.Tensor:
        # not rank 0: a new empty tensor, so that the gathered one is freed now (a view would keep its storage)
        return full if self.keep else torch.empty(0, dtype=full.dtype, device=full.device)


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: gathered from every rank's shard (a collective) where it is a DTensor."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class GatheredSource(_Gathered):
    """A sharded model's parameters, gathered a bucket at a time on every rank (one `full_tensor()` collective per
    parameter, in the same order everywhere); `keep` (rank 0) casts each to the dtype asked on its device and hands it
    on, the other ranks drop theirs. A parameter that is not a DTensor (world size 1 without sharding) is used as it
    is. `pace`: after each bucket every rank waits at this group's barrier, which rank 0 reaches once its reader has
    asked for the next bucket (see PACE_TIMEOUT_S): no rank starts gathering bucket k+1 before rank 0 is done with k."""

    def __init__(self, model: torch.nn.Module, gather: Gather, *, keep: bool, pace: dist.ProcessGroup | None = None):
        self.params = {n: p for n, p in model.named_parameters() if gather.everything or p.requires_grad}
        if not self.params:
            raise ValueError("weight sync: the model has no parameters to gather")
        cast = getattr(torch, gather.dtype) if gather.dtype else None
        specs = [TensorSpec(n, cast or p.dtype, tuple(p.shape)) for n, p in self.params.items()]  # global shapes
        super().__init__(specs, gather.bucket_bytes, next(iter(self.params.values())).device, keep=keep, pace=pace)

    def _gather(self, e: Entry) -> tuple[str, torch.Tensor]:
        # Cast first: the cast is local to each rank's shard, so the all-gather moves (and every rank briefly holds)
        # the parameter in the engine's dtype, half of float32's bytes for bf16; the values are the same either way.
        return e.name, self._kept(_whole(self.params[e.name].detach().to(getattr(torch, e.dtype))))


class GatheredMerged(_Gathered):
    """A sharded LoRA model's merged weights (trainer/lora.py MergedSource's, by the base model's names): for each
    targeted linear every rank gathers its base W, A and B whole, in float32 (a merge of rounded parts would differ
    from the replicated trainer's), and `keep` (rank 0) merges them (Lora.merge) and casts to the dtype asked."""

    def __init__(self, lora: Lora, gather: Gather, *, keep: bool, pace: dist.ProcessGroup | None = None):
        self.lora = lora
        self.names = lora.published()  # the merged weights, and the targeted linears' biases (Lora.published says why)
        first = next(iter(lora.layers.values())).get_base_layer().weight
        cast = getattr(torch, gather.dtype) if gather.dtype else first.dtype
        specs = [TensorSpec(name, cast, tuple(lora.base_tensor(m, kind).shape)) for name, (m, kind) in self.names.items()]
        super().__init__(specs, gather.bucket_bytes, first.device, keep=keep, pace=pace)

    def _gather(self, e: Entry) -> tuple[str, torch.Tensor]:
        module, kind = self.names[e.name]
        if kind != "weight":
            return e.name, self._kept(_whole(self.lora.base_tensor(module, kind).detach().to(getattr(torch, e.dtype))))
        layer = self.lora.layers[module]
        w, a, b = (_whole(p.detach()) for p in (layer.get_base_layer().weight, layer.lora_A[ADAPTER].weight,
                                                 layer.lora_B[ADAPTER].weight))
        if not self.keep:
            return e.name, self._kept(w)
        return e.name, self.lora.merge(module, w, a, b).to(getattr(torch, e.dtype))


@dataclass(slots=True, frozen=True)
class LoraGathering:
    """trainer/lora.py `Gathering` over a sharded trainer's gathers (`gathered`: DataParallelTrainer.gathered, or on
    rank 0 of a rank group RankGroup.gathered, which tells the followers to take part)."""

    gathered: Callable[[Gather], WeightSource]
    keep: bool

    def adapter(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        # the trained parameters are the adapters' A and B exactly (Lora marks only them)
        return self.gathered(Gather(dtype_name(dtype) if dtype else None, bucket_bytes))

    def merged(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        return self.gathered(Gather(dtype_name(dtype) if dtype else None, bucket_bytes, merged=True))


class DataParallelTrainer:
    """A Trainer whose steps are data-parallel over the default process group."""

    def __init__(self, trainer: Trainer):
        if not dist.is_initialized():
            raise RuntimeError("DataParallelTrainer: call init_process_group first")
        self.trainer = trainer
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # where the collectives' own tensors live: NCCL reduces CUDA tensors only
        self.device = next(trainer.model.parameters()).device
        self.pace = pacing_group()  # every rank makes its DataParallelTrainer at the same point: a collective
        if trainer.sharded and trainer.lora is not None:  # its adapter and merged weights exist whole only gathered
            trainer.lora.gathering = LoraGathering(self.gathered, keep=self.rank == 0)

    def train_step(self, samples: list[TrainingSample], *, idle_tokens: int = 0, idle_seqs: int = 0,
                   idle_longest: int = 0) -> StepStats:
        """One optimiser step over this rank's shard; `idle_*` are this rank's share of the step's idle
        counts (Trainer.train_step). Stats are the whole step's, the same on every rank."""
        t = self.trainer
        tokens = sum(sum(s.loss_mask) for s in samples)
        longest = max([idle_longest, *(sum(s.loss_mask) for s in samples)])
        every = sum(len(s.token_ids) for s in samples)  # prompt and sampled: the load-balancing term's weights
        counts = torch.tensor([tokens, len(samples), idle_tokens, idle_seqs, every], dtype=torch.int64,
                              device=self.device)
        dist.all_reduce(counts)
        g_tokens, g_seqs, g_idle_tokens, g_idle_seqs, g_every = counts.tolist()
        if g_tokens == 0:  # every rank raises, none is left waiting in a collective
            raise ValueError("data-parallel step: no rank got a sampled token")
        cfg = t.cfg
        if cfg.loss.aggregation == "token_sum_norm" and cfg.loss.norm_constant is None:
            norm = self._global_norm(longest, g_seqs + g_idle_seqs)
            t.cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"norm_constant": norm})})
        if t.sharded:  # FSDP sums gradients in every backward: the ranks run as many as the busiest
            t.shared_plan = self._most
        else:
            t.grad_hook = self._sum_gradients
        try:
            stats = t.train_step(samples, idle_tokens=g_tokens + g_idle_tokens - tokens,
                                 idle_seqs=g_seqs + g_idle_seqs - len(samples), peer_tokens=g_every - every)
        finally:
            t.cfg = cfg
            t.grad_hook = t.shared_plan = None
        return self._global_stats(stats)

    def gathered(self, gather: Gather) -> WeightSource:
        """The model's full parameters (or merged weights) as `gather` asks, a bucket at a time (every rank must read it
        to the end)."""
        return self._gathered(gather, keep=self.rank == 0)

    def own_source(self, gather: Gather) -> WeightSource:
        """The full parameters as `gather` asks, kept on THIS rank (a colocated rank pushes them to the engine on its
        GPU, train_pool/push.py): sharded, gathered by every rank a bucket at a time as `gathered` (every rank must read
        it to the end); replicated, this rank's own parameters."""
        if self.trainer.sharded:
            return self._gathered(gather, keep=True)
        dtype = getattr(torch, gather.dtype) if gather.dtype else None
        return DictSource({n: p.detach() for n, p in self.trainer.model.named_parameters()
                           if gather.everything or p.requires_grad}, dtype, gather.bucket_bytes)

    def _gathered(self, gather: Gather, *, keep: bool) -> WeightSource:
        if not gather.merged:
            return GatheredSource(self.trainer.model, gather, keep=keep, pace=self.pace)
        if self.trainer.lora is None:
            raise ValueError("gathering merged weights: the trainer has no trainer.lora adapters to merge")
        return GatheredMerged(self.trainer.lora, gather, keep=keep, pace=self.pace)

    def _most(self, n: int) -> int:
        m = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return int(m)

    def _global_norm(self, longest: int, seqs: int) -> float:
        """Trainer's token_sum_norm default, max sampled tokens x sequences, over the whole step."""
        m = torch.tensor([longest], dtype=torch.int64, device=self.device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return float(int(m) * seqs)

    def _sum_gradients(self) -> None:
        params = self.trainer.params
        # A parameter no sample of this rank reached has no gradient here but may have one elsewhere.
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        dist.all_reduce(has)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, h in zip(params, has.tolist()):
            if not h:
                continue  # no rank has one: stays None, as in one process (AdamW skips it)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():  # one collective per dtype: latency paid once, not per tensor
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _global_stats(self, s: StepStats) -> StepStats:
        lt = float(s.loss_tokens)
        forwarded = s.tokens / s.tree_ratio if s.tree_ratio else float(s.tokens)
        v = torch.tensor([s.loss, s.clip_frac * lt, s.ratio_mean * lt, s.approx_kl * lt, s.ess * lt, lt,
                          float(s.tokens), forwarded, float(s.attn_pairs_dense), float(s.attn_pairs),
                          s.entropy * lt, s.logprob_gap_mean * lt], dtype=torch.float64, device=self.device)
        dist.all_reduce(v)
        gap_max = torch.tensor([s.logprob_gap_max], dtype=torch.float64, device=self.device)
        dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        loss, clip, ratio, kl, ess, g_lt, tokens, g_forwarded, pairs_dense, pairs, ent, gap = v.tolist()
        moe = self._global_moe(s.moe, trained=s.loss_tokens > 0) if s.moe is not None else None  # None on every rank
        return StepStats(loss=loss, grad_norm=s.grad_norm, clip_frac=clip / g_lt, ratio_mean=ratio / g_lt,
                         approx_kl=kl / g_lt, tokens=int(tokens), loss_tokens=int(g_lt), seconds=s.seconds,
                         lr=s.lr, ess=ess / g_lt, tree_ratio=tokens / max(g_forwarded, 1.0),
                         attn_pairs_dense=int(pairs_dense), attn_pairs=int(pairs), entropy=ent / g_lt,
                         logprob_gap_mean=gap / g_lt, logprob_gap_max=float(gap_max), gaps=s.gaps,  # gaps: this rank's
                         moe=moe)

    def _global_moe(self, m: MoeStats, *, trained: bool) -> MoeStats:
        """The step's moe/* figures over the ranks (trainer/moe_step.py): agreement over every rank's expert choices,
        the first-micro-batch gaps the mean of the ranks that trained samples, the aux loss the sum of the ranks'
        parts (each already weighed by the whole step's tokens)."""
        w = 1.0 if trained else 0.0
        v = torch.tensor([m.router_agreement * m.choices, float(m.choices), m.logprob_gap * w,
                          m.logprob_gap_no_replay * w, w, m.aux_loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(v)
        agree, choices, gap, gap_free, ranks, aux = v.tolist()
        return MoeStats(router_agreement=agree / choices if choices else 0.0, logprob_gap=gap / max(ranks, 1.0),
                        logprob_gap_no_replay=gap_free / max(ranks, 1.0), aux_loss=aux, choices=round(choices))
