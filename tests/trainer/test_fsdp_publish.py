"""The sharded trainer's publish path (trainer.parallel=fsdp): a version leaves rank 0 a bucket at a time, gathered by
every rank, already in the engine's dtype; no whole-model copy, and none in float32, is built on the way."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.model.loader import build_tiny_model
from loomrl.train_pool.distributed import DataParallelTrainer, Gather
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer
from loomrl.weights.source import WeightSource
from loomrl.weights.transports import load_weights, make_publisher
from tests.dist_launch import launch_local
from tests.trainer.test_fsdp import _samples

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

BUCKET = 4096  # bytes: the tiny model is cut into many buckets


class _Watched(WeightSource):
    """Records each bucket a publisher reads (sizes, dtypes) and whether the bucket before it is still alive then."""

    def __init__(self, inner: WeightSource):
        super().__init__(inner.specs, inner.bucket_bytes, inner.device)
        self.inner = inner
        self.buckets_seen: list[tuple[int, int, set[torch.dtype]]] = []  # (tensors, bytes, dtypes)
        self.previous_alive: list[bool] = []

    def buckets(self):
        previous: list[weakref.ref] = []
        for bucket in self.inner.buckets():
            gc.collect()
            self.previous_alive.append(any(r() is not None for r in previous))
            self.buckets_seen.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket),
                                      {t.dtype for _, t in bucket}))
            previous = [weakref.ref(t) for _, t in bucket]
            yield bucket
            del bucket


def _rank(rank: int, world: int, vocab: int, eos: int, samples: list, run_dir: str) -> dict:
    trainer = Trainer(build_tiny_model(ModelConfig(kind="tiny"), vocab, eos), TrainerConfig(lr=1e-3),
                      shard=fsdp_shard)
    dp = DataParallelTrainer(trainer)
    dp.train_step(copy.deepcopy(samples[:3] if rank == 0 else samples[3:]))  # the weights move off the initial ones
    gather = Gather("bfloat16", BUCKET)
    out: dict = {"gathered": set()}
    real_full_tensor = DTensor.full_tensor  # records the dtype each all-gather moves

    def full_tensor(self, *args, **kwargs):
        out["gathered"].add(self.dtype)
        return real_full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = full_tensor
    if rank == 0:
        for transport in ("shm", "file", "queue"):
            source = _Watched(dp.gathered(gather))
            publisher = make_publisher(transport, dtype=torch.bfloat16, bucket_bytes=BUCKET,
                                       folder=f"{run_dir}/{transport}")
            try:
                handle = publisher.publish(source, 1)
                got = load_weights(handle).weights
            finally:
                publisher.close()
            out[transport] = {"buckets": source.buckets_seen, "alive": source.previous_alive, "nbytes": handle.nbytes,
                              "got": got}
    else:
        for _ in range(3):
            for _ in dp.gathered(gather).buckets():
                pass
    DTensor.full_tensor = real_full_tensor
    # the reference, gathered whole here only: the trained parameters in the engine's dtype
    want = {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()
            if p.requires_grad}
    out["want"] = want
    return out


def test_the_fsdp_publish_path_sends_buckets_in_the_engines_dtype_and_holds_one_at_a_time(tokenizer, tmp_path):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    ranks = launch_local(_rank, 2, (vocab, eos, _samples(vocab), str(tmp_path)), timeout_s=300, threads=1)
    out = ranks[0]
    want = out["want"]
    # cast on each rank's shard before the all-gather: bf16 moves, never the float32 masters
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == {torch.bfloat16}
    for transport in ("shm", "file", "queue"):
        seen = out[transport]
        assert len(seen["buckets"]) > 3, transport  # several buckets, not one whole-model copy
        for tensors, nbytes, dtypes in seen["buckets"]:
            assert dtypes == {torch.bfloat16}, (transport, dtypes)  # cast on the trainer's side, bucket by bucket
            assert nbytes <= BUCKET or tensors == 1, (transport, nbytes, tensors)  # a larger tensor goes alone
        assert not any(seen["alive"]), transport  # the bucket before was dropped when the next was gathered
        assert seen["nbytes"] == sum(t.numel() * 2 for t in want.values())
        got = seen["got"]
        assert list(got) == list(want)
        assert [n for n in want if not (got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n]))] == []
