"""Colocation's trainer half (train_pool/offload.py): between steps the trainer's whole state leaves the GPU, and a step
beside a sleeping engine runs onload -> train -> publish -> settle -> offload. This CPU machine has no second device to
move to, so the state is moved to the meta device instead: what is left behind on the trainer's device is what an
offload to the host would leave on the GPU (a missed optimizer state, a KL reference)."""

from __future__ import annotations

import copy

import pytest
import torch

from loomrl.config import ModelConfig, RunConfig, TrainerConfig
from loomrl.model.loader import build_tiny_model
from loomrl.train_pool import process
from loomrl.train_pool.distributed import DataParallelTrainer
from loomrl.train_pool.offload import Moved, move_state
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer
from loomrl.trainer_boundary import TrainStep
from tests.dist_launch import launch_local
from tests.trainer.test_fsdp import _samples

KL = {"loss": {"kind": "ppo_clip", "kl": "k3", "kl_coef": 0.1}}


def _left_behind(trainer: Trainer) -> list[str]:
    """Every tensor of the trainer's state that is not on the meta device."""
    out = [f"param {n}" for n, p in trainer.model.named_parameters() if not p.is_meta]
    out += [f"grad {n}" for n, p in trainer.model.named_parameters() if p.grad is not None]
    if trainer.ref_model is not None:
        out += [f"reference {n}" for n, p in trainer.ref_model.named_parameters() if not p.is_meta]
    for i, state in enumerate(trainer.optimizer.state.values()):
        out += [f"optimizer {i} {k}" for k, v in state.items() if k != "step" and not v.is_meta]
    return out


def test_offload_moves_every_parameter_optimizer_state_and_the_kl_reference(tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    trainer = Trainer(build_tiny_model(ModelConfig(kind="tiny"), vocab, eos), TrainerConfig(lr=1e-3, **KL))
    trainer.train_step(copy.deepcopy(_samples(vocab)))  # AdamW's state exists, gradients are set
    params = sum(p.numel() * 4 for p in trainer.model.parameters())
    moved = move_state(trainer, torch.device("meta"))
    assert _left_behind(trainer) == []
    # the model, its KL reference (the same shapes) and AdamW's two moments per trained parameter
    trained = sum(p.numel() * 4 for p in trainer.params)
    assert moved.bytes == 2 * params + 2 * trained


def _sharded_rank(rank: int, world: int, vocab: int, eos: int, samples: list) -> list[str]:
    trainer = Trainer(build_tiny_model(ModelConfig(kind="tiny"), vocab, eos), TrainerConfig(lr=1e-3, **KL),
                      shard=fsdp_shard)
    DataParallelTrainer(trainer).train_step(copy.deepcopy(samples[:3] if rank == 0 else samples[3:]))
    move_state(trainer, torch.device("meta"))
    return _left_behind(trainer)


@pytest.mark.integration
def test_offload_of_fsdp_ranks_moves_every_shard(tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    for left in launch_local(_sharded_rank, 2, (vocab, eos, _samples(vocab)), timeout_s=300, threads=1):
        assert left == []


class _Publisher:
    def __init__(self, calls: list[str]):
        self.calls, self.dtype, self.bucket_bytes = calls, None, 1 << 20

    def publish(self, source, version):
        self.calls.append("publish")
        return f"handle {version}"

    def settle(self):
        self.calls.append("settle")


class _Service:
    def __init__(self, calls: list[str]):
        self.calls, self.trainer, self.version = calls, object(), 1

    def run_step(self):
        self.calls.append("train")
        return TrainStep(version=self.version, trained=True, metrics={}, groups_stale=0)

    def weight_source(self, dtype, bucket_bytes):
        return None

    def onload(self):
        self.calls.append("onload")
        return Moved(0, 0.0)

    def offload(self):
        self.calls.append("offload")
        return Moved(8, 0.0)


def test_a_colocated_step_trains_publishes_and_sends_before_the_state_leaves(monkeypatch):
    """The trainer process's step beside a sleeping engine (train_pool/process.py colocated_step); the service and
    publisher are recording stand-ins, the order is the real function's."""
    calls: list[str] = []

    service, publisher = _Service(calls), _Publisher(calls)
    step, handle = process.colocated_step(service, lambda: process.publish_settled(publisher, service))
    assert calls == ["onload", "train", "publish", "settle", "offload"]
    assert handle == "handle 1" and step.metrics["colocate/offloaded_bytes"] == 8.0 and step.version == 1


def test_colocation_with_a_broadcast_is_refused_in_one_line():
    with pytest.raises(ValueError, match="NCCL puts no two ranks of a group on one GPU"):
        RunConfig.model_validate({"engine": {"sleep_while_training": True, "kind": "vllm"},
                                  "runtime": {"mode": "async", "weight_transport": "broadcast"}})


def test_cuda_ipc_beside_a_colocated_engine_keeps_one_snapshot_on_the_gpu(monkeypatch):
    """Each kept cuda_ipc version is a snapshot on the engine's GPU: colocated, one (it is loaded as the engine wakes,
    before the next step publishes); otherwise the usual window. make_publisher is a recorder (cuda_ipc needs a GPU)."""
    kept = []
    monkeypatch.setattr(process, "make_publisher", lambda transport, **kw: kept.append((transport, kw["keep"])))
    for colocated in (True, False):
        cfg = RunConfig.model_validate({"engine": {"sleep_while_training": colocated},
                                        "runtime": {"mode": "async", "weight_transport": "cuda_ipc"}})
        process.run_publisher(cfg.weight_route(), cfg.run_dir, engines=1, host="127.0.0.1")
    cfg = RunConfig.model_validate({"engine": {"sleep_while_training": True}, "runtime": {"mode": "async"}})
    process.run_publisher(cfg.weight_route(), cfg.run_dir, engines=1, host="127.0.0.1")
    assert kept == [("cuda_ipc", 1), ("cuda_ipc", process.KEEP_VERSIONS), ("shm", process.KEEP_VERSIONS)]


def test_every_rank_moves_its_state_not_only_rank_0(tokenizer, monkeypatch):
    """Colocated engines wake on every trainer rank's GPU, so every rank offloads (RankGroup.offload / onload): rank 0
    tells each follower, moves its own, and waits for their reports. Rank 0's group is real (LocalRankGroup over
    queues); the follower is a real Follower driven by a thread here, its model on the CPU, where offload is a no-op:
    the moves are recorded by stand-ins of offload and onload in train_pool/ranks.py."""
    import queue
    import threading

    from loomrl.train_pool import ranks
    from loomrl.train_pool.ranks import Follower, LocalRankGroup

    moves: list[tuple[str, str]] = []
    monkeypatch.setattr(ranks, "offload", lambda trainer: moves.append(("offload", trainer.name)) or Moved(4, 0.0))
    monkeypatch.setattr(ranks, "onload", lambda trainer: moves.append(("onload", trainer.name)) or Moved(0, 0.0))

    def trainer(name: str) -> Trainer:
        t = Trainer(build_tiny_model(ModelConfig(kind="tiny"), len(tokenizer), tokenizer.eos_token_id),
                    TrainerConfig(lr=1e-3))
        t.name = name
        return t

    rank0, inbox, outbox = trainer("rank 0"), queue.Queue(), queue.Queue()
    follower = Follower.__new__(Follower)  # no process group: only its dispatch of the work is exercised
    follower.dp = type("DP", (), {"trainer": trainer("rank 1")})()
    follower.dp.trainer.model.load_state_dict(rank0.model.state_dict())  # replicas agree (RankGroup._check)

    def serve() -> None:
        while (work := inbox.get()) is not None:
            outbox.put(("report", follower.work(work)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    group = LocalRankGroup(2, torch.device("cpu"), [inbox], [outbox])
    group.trainer = rank0
    try:
        assert group.offload().bytes == 4 and group.onload().bytes == 0
    finally:
        inbox.put(None)
        thread.join(10)
    assert sorted(moves) == sorted([("offload", "rank 0"), ("offload", "rank 1"), ("onload", "rank 0"),
                                    ("onload", "rank 1")])
    assert moves.index(("offload", "rank 1")) < moves.index(("onload", "rank 0"))  # each move waits for every rank
