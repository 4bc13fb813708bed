"""Router replay (R3) and the load-balancing term under FSDP2 (trainer.router_replay with trainer.parallel=fsdp;
trainer/replay.py, trainer/fsdp.py, train_pool/distributed.py) on 2 gloo ranks on the CPU, against one process: the
FSDP2 steps (dense, tree-merged, activation-checkpointed) give one process's loss and gradients, and the step's moe/*
figures are the whole step's on every rank.

A tiny Qwen3-MoE from a config (test_router_replay_step.py `build`), samples whose recorded experts differ from its
own routing on most rows (`recorded_samples`): two groups, of 3 and of 2 samples, one per rank, so that in the
dense variants (one sample a micro-batch) rank 1 runs a padding micro-batch. The micro-batches are those of one
process (one sample each; one group each when tree-merged), since the load-balancing term of a micro-batch depends
on what else is in it. Nothing is mocked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_launch import launch_local
from test_router_replay_step import assert_grads_close, build, recorded_samples, trainer_cfg

from loomrl.train_pool.distributed import DataParallelTrainer, shard_samples
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer

pytestmark = pytest.mark.integration  # starts processes: not in `make test-fast`

GROUPS = (3, 2)
OPTIONS = dict(router_replay=True, moe_aux_loss_coef=0.01)
VARIANTS = {"dense": dict(micro_batch_size=1), "tree": dict(tree_merge="on", micro_batch_size=3),
            "checkpointed": dict(micro_batch_size=1, activation_checkpointing=True)}
# the same sums in another order (a rank's shard, FSDP's reduce-scatter), float32: test_lora_fsdp.py's bound
GRAD_RTOL = 1e-5


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rank(rank: int, world: int) -> dict:
    """Per rank, each variant: one FSDP2 step on this rank's group; its loss, moe/* figures and gradients, whole."""
    out = {}
    for name, extra in VARIANTS.items():
        model = build("moe")
        samples = recorded_samples(model, GROUPS)
        trainer = Trainer(model, trainer_cfg(**OPTIONS, **extra, parallel="fsdp"), shard=fsdp_shard)
        mine = shard_samples(samples, world, keep_groups=True)[rank]
        stats = DataParallelTrainer(trainer).train_step(copy.deepcopy(mine))
        grads = {n: _whole(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        out[name] = (len(mine), stats.loss, stats.moe, grads)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch_local(_rank, 2, timeout_s=120, threads=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_replay_step_equals_one_process(ranks, variant):
    """Loss and gradients (routers and experts included) of the FSDP2 step under replay, with the load-balancing
    term, equal one process's step on all the samples; the moe/* figures are the whole step's on both ranks: router
    agreement over both ranks' choices and the aux loss as one process's, the replayed gap ~0 (the behaviour
    logprobs are the replayed policy's), the gap without replay well above it. Before: TrainerConfig refused
    router_replay with parallel=fsdp."""
    model = build("moe")
    samples = recorded_samples(model, GROUPS)
    one = Trainer(copy.deepcopy(model), trainer_cfg(**OPTIONS, **VARIANTS[variant]))
    want = one.train_step(copy.deepcopy(samples))
    grads = {n: p.grad.clone() for n, p in one.model.named_parameters() if p.grad is not None}
    assert want.moe is not None and 0.0 < want.moe.router_agreement < 0.9  # the records differ from its routing
    assert [r[variant][0] for r in ranks] == list(GROUPS)  # a group a rank; the dense ones pad rank 1
    for rank, r in enumerate(ranks):
        _, loss, moe, got = r[variant]
        assert loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7), rank
        assert_grads_close(got, grads, GRAD_RTOL, f"{variant} rank {rank}")
        assert moe is not None and moe == ranks[0][variant][2]  # the whole step's, the same on every rank
        assert moe.choices == want.moe.choices
        assert moe.router_agreement == pytest.approx(want.moe.router_agreement, abs=1e-12)
        assert moe.aux_loss == pytest.approx(want.moe.aux_loss, rel=1e-5)
        assert moe.logprob_gap < 1e-4 < 0.01 < moe.logprob_gap_no_replay
