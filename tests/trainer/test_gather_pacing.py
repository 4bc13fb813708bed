"""Followers of a bucketed gather (train_pool/distributed.py GatheredSource, what train_pool/ranks.py runs on every rank to
publish a version or write the checkpoint's model folder) are paced a bucket at a time: no follower starts gathering
bucket k+1 before rank 0 has handed bucket k on, so a follower never holds more than one bucket's all-gathers pending.

Two gloo ranks, a tiny FSDP2-sharded model, real `full_tensor()` collectives and the real checkpoint writer
(checkpoint.write_model_folder) behind a slow "storage" (a sleep after each bucket: shared storage cannot run here).
On NCCL a follower's all-gather returns as soon as it is queued, so without pacing it would queue the whole model; gloo
blocks it in bucket k+1's first all-gather instead, which is still ahead of rank 0: the order recorded here tells the
two apart. The order: each follower all-gather's start time, against the time rank 0's consumer was done with each
bucket (CLOCK_MONOTONIC, shared by the processes of one machine)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist_launch import launch_local
from torch.distributed.tensor import DTensor

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.model.loader import build_tiny_model
from loomrl.train_pool.distributed import DataParallelTrainer, Gather
from loomrl.trainer.checkpoint import write_model_folder
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer
from loomrl.weights.source import WeightSource
from tests.trainer.test_fsdp import _samples

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

BUCKET = 4096  # bytes: the tiny model is cut into many buckets
STORAGE_S = 0.05  # rank 0's hand-off of one bucket (a write to slow storage)
GATHERS = {"publish": Gather("bfloat16", BUCKET), "checkpoint": Gather(None, BUCKET, everything=True)}


class _SlowConsumer(WeightSource):
    """Rank 0's reader as the gather sees it: takes `STORAGE_S` per bucket, and records when it was done with each."""

    def __init__(self, inner: WeightSource):
        super().__init__(inner.specs, inner.bucket_bytes, inner.device)
        self.inner = inner
        self.done: list[float] = []

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self.inner.buckets():
            yield bucket
            time.sleep(STORAGE_S)
            self.done.append(time.monotonic())


def _rank(rank: int, world: int, vocab: int, eos: int, samples: list, folder: str) -> dict:
    model = build_tiny_model(ModelConfig(kind="tiny"), vocab, eos)
    trainer = Trainer(model, TrainerConfig(lr=1e-3), shard=fsdp_shard)
    dp = DataParallelTrainer(trainer)
    dp.train_step(copy.deepcopy(samples[:3] if rank == 0 else samples[3:]))
    starts: list[float] = []
    real_full_tensor = DTensor.full_tensor

    def full_tensor(self, *args, **kwargs):  # the moment this rank queues (on gloo: starts) an all-gather
        starts.append(time.monotonic())
        return real_full_tensor(self, *args, **kwargs)

    out: dict = {}
    DTensor.full_tensor = full_tensor
    try:
        for what, gather in GATHERS.items():
            starts.clear()
            source = dp.gathered(gather)
            if rank == 0:
                slow = _SlowConsumer(source)
                if what == "checkpoint":
                    write_model_folder(Path(folder) / "model", model, slow)
                else:
                    for _ in slow.buckets():
                        pass
                out[what] = {"done": slow.done, "sizes": [len(plan) for plan in source.plan()]}
            else:
                for _ in source.buckets():  # as a follower does (train_pool/ranks.py Follower.work)
                    pass
                out[what] = {"starts": list(starts)}
    finally:
        DTensor.full_tensor = real_full_tensor
    return out


def _pending(starts: list[float], sizes: list[int], done: list[float]) -> list[int]:
    """For each bucket j, the buckets the follower had queued but rank 0 had not handed on when the follower queued
    bucket j's first all-gather (j itself included)."""
    firsts, i = [], 0
    for n in sizes:
        firsts.append(starts[i])
        i += n
    assert i == len(starts)  # one all-gather per parameter of the plan, on the follower as on rank 0
    return [j + 1 - sum(t <= first for t in done) for j, first in enumerate(firsts)]


def test_followers_gather_bucket_k_plus_1_only_after_rank_0_handed_bucket_k_on(tokenizer, tmp_path):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    ranks = launch_local(_rank, 2, (vocab, eos, _samples(vocab), str(tmp_path)), timeout_s=300, threads=1)
    for what in GATHERS:
        sizes, done, starts = ranks[0][what]["sizes"], ranks[0][what]["done"], ranks[1][what]["starts"]
        assert len(sizes) > 3 and len(done) == len(sizes), what  # many buckets, each handed on
        pending = _pending(starts, sizes, done)
        firsts = [starts[sum(sizes[:j])] for j in range(len(sizes))]
        early = [j for j in range(1, len(sizes)) if firsts[j] < done[j - 1]]
        assert early == [], f"{what}: the follower started buckets {early} before rank 0 handed the one before on"
        assert max(pending) == 1, f"{what}: the follower held up to {max(pending)} buckets pending: {pending}"
    assert (tmp_path / "model" / "model.safetensors.index.json").is_file()

