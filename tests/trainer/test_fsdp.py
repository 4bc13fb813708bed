"""FSDP2 (fully_shard over gloo, CPU) trainer ranks against one process: the same losses, grad norms, entropies,
logprob gaps and weights after 3 steps, on an uneven split and with a rank that gets no sample; tree merge on and off, in
sub-tries and depth-first; the KL reference sharded too."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from dist_launch import launch_local

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.model.loader import build_tiny_model
from loomrl.train_pool.distributed import DataParallelTrainer, Gather
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

STEPS = 3
CASES = [{}, {"tree_merge": "on"},
         # the depth-first tree pass: each rank's trie (and so its forwards and backwards) differs, with no
         # collective inside it (trainer/fsdp.py whole_for_pass); budget 20 splits each rank's samples in sub-tries
         {"tree_merge": "on", "tree_token_budget": 20, "tree_merge_memory": "depth_first"},
         {"loss": {"kind": "decoupled_ppo", "kl": "k3", "kl_coef": 0.1}},
         # the KL reference's shards in host memory (on this CPU-only machine the offload moves nothing: this checks
         # that the offloaded reference gives the same logprobs, not the memory it saves on a GPU)
         {"loss": {"kind": "ppo_clip", "kl": "k3", "kl_coef": 0.1}, "parallel": "fsdp", "kl_reference_offload": True}]


def _model(vocab: int, eos: int) -> torch.nn.Module:
    return build_tiny_model(ModelConfig(kind="tiny"), vocab, eos)


def _samples(vocab: int) -> list[TrainingSample]:
    """Two GRPO groups of 4 with a shared prompt each, of different lengths."""
    rng = random.Random(0)
    out = []
    for g in range(2):
        prompt = [rng.randrange(vocab) for _ in range(5 + 3 * g)]
        for i in range(4):
            ids = prompt + [rng.randrange(vocab) for _ in range(4 + 3 * i)]
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            adv = 1.0 if (i + g) % 2 else -1.0
            out.append(TrainingSample(trajectory_id=f"s{g}{i}", group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                                      behaviour_logprobs=[-10.8 * m for m in mask], versions=[0] * len(ids),
                                      advantages=[adv * m for m in mask]))
    return out


def _cfg(options: dict) -> TrainerConfig:
    return TrainerConfig(lr=1e-4, micro_batch_size=2, **options)


def _rank(rank: int, world: int, vocab: int, eos: int, samples: list[TrainingSample], splits: list[int]) -> list:
    out = []
    for options in CASES:
        for split in splits:  # rank 0 takes samples[:split], rank 1 the rest (none when split == len)
            trainer = Trainer(_model(vocab, eos), _cfg(options), shard=fsdp_shard)
            dp = DataParallelTrainer(trainer)
            shard = samples[:split] if rank == 0 else samples[split:]
            stats = [dp.train_step(copy.deepcopy(shard)) for _ in range(STEPS)]
            weights = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
            out.append(([s.loss for s in stats], [s.grad_norm for s in stats], weights, _recorded(stats)))
    return out


def _recorded(stats: list) -> list[tuple[float, float, float]]:
    """What a step records for the viewer: the mean entropy and the logprob gap's mean and max (through FSDP's root
    forward, whose inputs it rebuilds: the entropies must still reach the trainer)."""
    return [(s.entropy, s.logprob_gap_mean, s.logprob_gap_max) for s in stats]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_two_fsdp_ranks_equal_one_process(tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    samples = _samples(vocab)
    splits = [3, len(samples)]  # uneven (3 vs 5 samples: 2 vs 3 micro-batches), and rank 1 empty
    ranks = launch_local(_rank, 2, (vocab, eos, samples, splits), timeout_s=300, threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = []
        for options in CASES:
            trainer = Trainer(_model(vocab, eos), _cfg(options))
            stats = [trainer.train_step(copy.deepcopy(samples)) for _ in range(STEPS)]
            refs.append(([s.loss for s in stats], [s.grad_norm for s in stats],
                         {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, _recorded(stats)))
    finally:
        torch.set_num_threads(threads)
    k = 0
    for c, options in enumerate(CASES):
        losses, norms, weights, recorded = refs[c]
        assert all(e > 1.0 and 0 < g <= m for e, g, m in recorded)
        for split in splits:
            for r in ranks:
                got_losses, got_norms, got_weights, got_recorded = r[k]
                for got, want in zip(got_recorded, recorded):
                    assert got == pytest.approx(want, rel=1e-4), (options, split)
                # relative to the run's loss scale: a step's loss can come close to 0 (the terms cancel)
                scale = max(abs(x) for x in losses)
                for a, b in zip(got_losses, losses):
                    assert abs(a - b) <= 1e-4 * scale, (options, split)
                for a, b in zip(got_norms, norms):
                    assert _rel(a, b) < 1e-4, (options, split)
                for name, want in weights.items():
                    assert float((got_weights[name] - want).abs().max()) < 1e-5, (options, split, name)
            k += 1


def _resume_rank(rank: int, world: int, run_dir: str, options: dict) -> tuple[list[float], list[float], dict]:
    """Per rank: 3 steps straight, and 2 steps + a checkpoint (the model folder from rank 0's gathered
    weights, the AdamW state in parts with torch.distributed.checkpoint) + fresh trainers from it + 1 step."""
    import torch.distributed as dist

    from loomrl.config import RunConfig
    from loomrl.model.loader import load_run_model
    from loomrl.train_pool.ranks import build_trainer
    from loomrl.trainer.checkpoint import latest_checkpoint, save_checkpoint
    from loomrl.trainer.fsdp import save_sharded_optimizer

    cfg = RunConfig.model_validate({"model": {"kind": "tiny"}, "runtime": {"mode": "async"}, "output_dir": run_dir,
                                    "trainer": {"lr": 1e-4, "micro_batch_size": 2, "parallel": "fsdp", **options}})
    model, tok = load_run_model(cfg.model, None)
    samples = _samples(len(tok))
    mine = samples[:3] if rank == 0 else samples[3:]

    def steps(dp: DataParallelTrainer, n: int) -> list[float]:
        return [dp.train_step(copy.deepcopy(mine)).loss for _ in range(n)]

    def full(dp: DataParallelTrainer) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in dp.trainer.model.named_parameters()}

    device = torch.device("cpu")
    straight = DataParallelTrainer(build_trainer(cfg.trainer, cfg.model, device, model, None))
    want = steps(straight, 3)
    first = DataParallelTrainer(build_trainer(cfg.trainer, cfg.model, device, load_run_model(cfg.model, None)[0], None))
    got = steps(first, 2)
    t = first.trainer
    everything = Gather(None, 1 << 12, everything=True)  # small buckets: the model folder is written in several files
    if rank == 0:
        save_checkpoint(cfg.run_dir, 2, model=t.model, tokenizer=tok, optimizer=t.optimizer, scheduler=t.scheduler,
                        state={}, weights=first.gathered(everything),
                        shards=lambda folder: save_sharded_optimizer(t, folder))
        files = list((cfg.run_dir / "checkpoints" / "step_000002" / "model").glob("model-*.safetensors"))
        assert len(files) > 2, files
    else:  # rank 0's save_checkpoint gathers the model folder, then writes this rank's part into this folder
        for _ in first.gathered(everything).buckets():
            pass
        save_sharded_optimizer(t, cfg.run_dir / "checkpoints" / ".tmp_step_000002" / "optimizer")
    dist.barrier()  # renamed into place by rank 0
    ckpt = latest_checkpoint(cfg.run_dir)
    resumed = DataParallelTrainer(build_trainer(cfg.trainer, cfg.model, device, load_run_model(cfg.model, ckpt)[0],
                                                ckpt))
    assert resumed.trainer.step == 2
    got += steps(resumed, 1)
    return want, got, {"straight": full(straight), "resumed": full(resumed)}


@pytest.mark.parametrize("options", [{}, {"loss": {"kind": "decoupled_ppo", "kl": "k3", "kl_coef": 0.1}}])
def test_fsdp_checkpoint_resume_equals_the_uninterrupted_run(tmp_path, options):
    for rank, (want, got, weights) in enumerate(launch_local(_resume_rank, 2, (str(tmp_path), options),
                                                             timeout_s=300, threads=1)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), rank
        for name, w in weights["straight"].items():
            assert float((weights["resumed"][name] - w).abs().max()) < 1e-6, (rank, name)
