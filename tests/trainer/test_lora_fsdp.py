"""LoRA under FSDP2 (trainer.lora with trainer.parallel=fsdp; trainer/lora.py, trainer/fsdp.py,
train_pool/distributed.py) on 2 gloo ranks on the CPU, against one process: the dense and tree-merged steps of one process and the FSDP2 steps
(dense, tree-merged, activation-checkpointed) give the same adapter gradients and the same adapters after the step; the
merged weights FSDP2 publishes (gathered from every rank) equal one process's; and an adapter checkpoint written under
FSDP2 (the adapter gathered to rank 0, the AdamW state in parts) resumes bit for bit.

Tiny float32 Llama models from a config, their matrices redrawn at std 0.2 and the adapters' B drawn non-zero (PEFT
starts B at zero, where A's gradient is zero): the adapters start from one saved adapter folder, which every variant
loads (`Lora.load`, under FSDP2 each rank cutting its own shards). Nothing is mocked.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from dist_launch import launch_local
from tiny_lora_models import spread_tiny

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.config.trainer import LoraConfig
from loomrl.model.adapter import ADAPTER
from loomrl.train_pool.distributed import DataParallelTrainer, shard_samples
from loomrl.trainer.adapter_publish import AdapterSource
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.fsdp import fsdp_shard
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample

pytestmark = pytest.mark.integration  # starts processes: not in `make test-fast`

LORA = LoraConfig(rank=4, alpha=8, publish="merged")
LR = 1e-2
# The KL term is on: its reference is the base with the adapters switched off, through the sharded forward too.
OPTIONS = dict(lora=LORA, lr=LR, grad_clip=1e9, micro_batch_size=2, loss={"kind": "ppo_clip", "kl": "k3",
                                                                           "kl_coef": 0.1})
RANK_VARIANTS = {"fsdp": {}, "fsdp_tree": {"tree_merge": "on"}, "fsdp_checkpointed": {"activation_checkpointing": True}}
# Gradients: the same sums in another order (a rank's shard, a tree's shared prefix, FSDP's reduce-scatter), float32:
# test_lora.py's bound for the dense and tree paths of one process.
GRAD_RTOL = 1e-5
# Adapters after one AdamW step from the same start: AdamW's first update is lr x g / (|g| + eps) per element, so a
# gradient that differs by dg moves an element by at most lr x dg x eps / (|g| + eps)^2 <= lr x dg / (4 eps) apart;
# with dg <= GRAD_RTOL x |grad| that is far below lr x 1e-3 except for an element whose gradient is within a few eps of
# zero, and for those the update itself is at most lr. The bound: 1e-3 of the step size.
ADAPTER_ATOL = LR * 1e-3


def _tiny(vocab: int, eos: int) -> torch.nn.Module:
    # qwen2: its q/k/v biases are published beside the merged weights (GatheredMerged gathers them too)
    return spread_tiny(vocab, eos, "qwen2")


def _start_adapter(vocab: int, eos: int, folder: Path) -> Trainer:
    """The adapters every variant starts from (B non-zero), saved to `folder`; the trainer holding them."""
    trainer = Trainer(_tiny(vocab, eos), TrainerConfig(**OPTIONS))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in trainer.lora.layers.values():
            b = layer.lora_B[ADAPTER].weight
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    trainer.lora.save(folder)
    return trainer


def _samples(model: torch.nn.Module, vocab: int) -> list[TrainingSample]:
    """Two groups of 3 sharing their prompts (tree merge has something to merge; each FSDP rank takes a group),
    behaviour logprobs the LoRA model's own (PPO's ratios start at 1), advantages of both signs."""
    rng, out = random.Random(0), []
    for g in range(2):
        prompt = [rng.randrange(vocab) for _ in range(7)]
        for i in range(3):
            ids = prompt + [rng.randrange(vocab) for _ in range(rng.randrange(3, 7))]
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            adv = 1.0 if (g + i) % 2 else -0.5
            out.append(TrainingSample(trajectory_id=f"t{g}{i}", group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                                      behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                                      advantages=[adv * m for m in mask]))
    for s, lp in zip(out, token_logprobs(model, out, with_grad=False)):
        at = iter(lp.tolist())
        s.behaviour_logprobs = [next(at) if m else 0.0 for m in s.loss_mask]
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The adapters, whole (under FSDP2 gathered: a collective of every rank)."""
    return {n: _whole(p) for n, p in trainer.model.named_parameters() if "lora_" in n}


def _after_step(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The adapters and their gradients after a step, whole (under FSDP2 gathered: a collective of every rank)."""
    adapters, grads = {}, {}
    for n, p in trainer.model.named_parameters():
        if "lora_" in n:
            adapters[n], grads[n] = _whole(p), _whole(p.grad)
    return adapters, grads


def _rank_step(rank: int, world: int, vocab: int, eos: int, folder: str) -> dict:
    """Per rank, each FSDP2 variant: a trainer from the start adapter, one step on this rank's group; the adapters,
    gradients and the merged weights it publishes, whole."""
    out = {}
    for name, extra in RANK_VARIANTS.items():
        trainer = Trainer(_tiny(vocab, eos), TrainerConfig(**OPTIONS, parallel="fsdp", **extra), shard=fsdp_shard)
        dp = DataParallelTrainer(trainer)
        trainer.lora.load(Path(folder))
        samples = _samples(_lora_model(vocab, eos, Path(folder)), vocab)
        mine = shard_samples(samples, world, keep_groups=True)[rank]
        loss = dp.train_step(copy.deepcopy(mine)).loss
        adapters, grads = _after_step(trainer)
        merged = {n: t.clone() for bucket in trainer.lora.merged_source(torch.bfloat16, 1 << 14).buckets()
                  for n, t in bucket}
        source = AdapterSource(trainer.lora, 3, torch.bfloat16, 1 << 14)  # publish=adapter: gathered the same way
        published = {n: t.clone() for bucket in source.buckets() for n, t in bucket}
        out[name] = (loss, adapters, grads, merged, published, source.adapter)
    return out


def _lora_model(vocab: int, eos: int, folder: Path) -> torch.nn.Module:
    """A replicated LoRA model holding the start adapter (the samples' behaviour policy)."""
    trainer = Trainer(_tiny(vocab, eos), TrainerConfig(lora=LORA))
    trainer.lora.load(folder)
    return trainer.model


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rtol: float = 0.0,
                  atol: float = 0.0, what: str) -> None:
    assert got.keys() == want.keys() and want, what
    for n, w in want.items():
        if rtol:  # over the whole tensor (an element near zero may differ relatively more)
            err = float((got[n] - w).norm())
            assert err <= rtol * float(w.norm()) + 1e-9, (what, n, err)
        else:
            assert float((got[n] - w).abs().max()) <= atol, (what, n)


def _rank(rank: int, world: int, vocab: int, eos: int, tokenizer, run_dir: str, folder: str) -> tuple[dict, dict]:
    """Both tests' work on one launch of the ranks (starting them is most of the time)."""
    return (_rank_step(rank, world, vocab, eos, folder),
            _rank_resume(rank, world, vocab, eos, tokenizer, run_dir, folder))


@pytest.fixture(scope="module")
def launched(tokenizer, tmp_path_factory) -> tuple[Path, Path, list[tuple[dict, dict]]]:
    """The start adapter's folder, the resumed run's folder, and what each rank returned (`_rank`)."""
    tmp = tmp_path_factory.mktemp("lora_fsdp")
    start, run_dir = tmp / "start", tmp / "run"
    _start_adapter(len(tokenizer), tokenizer.eos_token_id, start)
    ranks = launch_local(_rank, 2, (len(tokenizer), tokenizer.eos_token_id, tokenizer, str(run_dir), str(start)),
                         timeout_s=180, threads=1)
    return start, run_dir, ranks


def test_dense_tree_and_fsdp2_steps_agree_under_lora(tokenizer, launched):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    start, _, launches = launched
    ranks = [step for step, _ in launches]
    samples = _samples(_lora_model(vocab, eos, start), vocab)
    want = {}
    for name, extra in {"dense": {}, "tree": {"tree_merge": "on"}}.items():
        trainer = Trainer(_tiny(vocab, eos), TrainerConfig(**OPTIONS, **extra))
        trainer.lora.load(start)
        stats = trainer.train_step(copy.deepcopy(samples))
        if name == "tree":
            assert stats.tree_ratio > 1.0  # something was merged
        want[name] = (stats.loss, *_after_step(trainer))
    loss, adapters, grads = want["dense"]
    assert loss != 0.0
    variants = {"tree": want["tree"], **{n: v[:3] for n, v in ranks[0].items()}}
    for name, (v_loss, v_adapters, v_grads) in variants.items():
        assert v_loss == pytest.approx(loss, rel=1e-5, abs=1e-7), name
        _assert_close(v_grads, grads, rtol=GRAD_RTOL, what=f"{name} gradients")
        _assert_close(v_adapters, adapters, atol=ADAPTER_ATOL, what=f"{name} adapters")
        assert any(not torch.equal(v_adapters[n], a) for n, a in _start_state(start).items())  # they trained
    # what FSDP2 publishes (each linear's W, A, B gathered from both ranks, merged on rank 0) is exactly one process's
    # merge of the same adapters
    replica = Trainer(_tiny(vocab, eos), TrainerConfig(**OPTIONS))
    with torch.no_grad():
        for n, p in replica.model.named_parameters():
            if "lora_" in n:
                p.copy_(ranks[0]["fsdp"][1][n])
    merged = {n: t.clone() for bucket in replica.lora.merged_source(torch.bfloat16, 1 << 14).buckets()
              for n, t in bucket}
    _assert_close(ranks[0]["fsdp"][3], merged, what="merged weights")
    assert all(t.numel() == 0 for t in ranks[1]["fsdp"][3].values())  # rank 1 only took part
    # and what it publishes under publish=adapter (each A and B gathered from both ranks) is one process's adapter
    source = AdapterSource(replica.lora, 3, torch.bfloat16, 1 << 14)
    _assert_close(ranks[0]["fsdp"][4], {n: t.clone() for b in source.buckets() for n, t in b}, what="adapter")
    assert ranks[0]["fsdp"][5] == source.adapter and source.adapter.name == "loomrl-v3"
    assert all(t.numel() == 0 for t in ranks[1]["fsdp"][4].values())


def _start_state(folder: Path) -> dict[str, torch.Tensor]:
    """The start adapter by the model's parameter names (its file holds PEFT's saved names)."""
    from safetensors.torch import load_file

    from loomrl.model.adapter import ADAPTER_WEIGHTS

    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    return {n.replace(".weight", f".{ADAPTER}.weight").removeprefix("base_model.model."): t for n, t in saved.items()}


def _rank_resume(rank: int, world: int, vocab: int, eos: int, tokenizer, run_dir: str, folder: str) -> dict:
    """Per rank: two steps straight; and one step, a checkpoint (the adapter gathered to rank 0, which writes it; the
    AdamW state in parts, every rank writing its own), trainers rebuilt from the base and that checkpoint through
    build_trainer (the pool's path), one step. The adapters, whole, at each point."""
    import torch.distributed as dist

    from loomrl.run_folder import RunFolder
    from loomrl.train_pool.ranks import build_trainer
    from loomrl.trainer.checkpoint import latest_checkpoint, save_checkpoint
    from loomrl.trainer.fsdp import save_sharded_optimizer

    cfg = TrainerConfig(**OPTIONS, parallel="fsdp", warmup_steps=3)  # the schedule's position matters too
    samples = _samples(_lora_model(vocab, eos, Path(folder)), vocab)
    mine = shard_samples(samples, world, keep_groups=True)[rank]
    cpu = torch.device("cpu")

    def fresh(ckpt: Path | None) -> DataParallelTrainer:
        dp = DataParallelTrainer(build_trainer(cfg, ModelConfig(kind="tiny"), cpu, _tiny(vocab, eos), ckpt))
        if ckpt is None:
            dp.trainer.lora.load(Path(folder))
        return dp

    straight = fresh(None)
    for _ in range(2):
        straight.train_step(copy.deepcopy(mine))
    first = fresh(None)
    first.train_step(copy.deepcopy(mine))
    t = first.trainer
    if rank == 0:
        save_checkpoint(Path(run_dir), 1, model=t.model, tokenizer=tokenizer, optimizer=t.optimizer,
                        scheduler=t.scheduler, state={}, adapter=t.lora.save,
                        shards=lambda shards: save_sharded_optimizer(t, shards))
    else:  # rank 0's save_checkpoint gathers the adapter, then writes this rank's part of the AdamW state here
        t.lora.save(Path(run_dir) / "not-written")
        save_sharded_optimizer(t, RunFolder(Path(run_dir)).checkpoint_in_progress(1).optimizer_shards)
    dist.barrier()  # renamed into place by rank 0
    saved = _adapters(t)
    resumed = fresh(latest_checkpoint(Path(run_dir)))
    loaded = _adapters(resumed.trainer)
    step = resumed.trainer.step
    resumed.train_step(copy.deepcopy(mine))
    return {"saved": saved, "loaded": loaded, "step": step, "straight": _adapters(straight.trainer),
            "resumed": _adapters(resumed.trainer)}


def test_an_fsdp2_adapter_checkpoint_resumes_bit_for_bit(launched):
    from safetensors.torch import load_file

    from loomrl.model.adapter import ADAPTER_WEIGHTS
    from loomrl.run_folder import CheckpointFolder

    _, run_dir, launches = launched
    ranks = [resume for _, resume in launches]
    model_folder = CheckpointFolder(run_dir / "checkpoints" / "step_000001").model
    assert not list(model_folder.glob("model*.safetensors"))  # the adapter alone, no base model
    assert not (run_dir / "not-written").exists()  # rank 1 took part in the gather and wrote nothing
    on_disk = load_file(str(model_folder / ADAPTER_WEIGHTS))
    want = ranks[0]["saved"]
    assert len(on_disk) == len(want) and all(torch.equal(t, want[n]) for n, t in _start_state(model_folder).items())
    for rank, r in enumerate(ranks):
        assert r["step"] == 1, rank
        assert all(torch.equal(r["loaded"][n], t) for n, t in want.items()), rank
        assert not all(torch.equal(r["straight"][n], t) for n, t in want.items())  # the second step moved them
        assert all(torch.equal(r["resumed"][n], t) for n, t in r["straight"].items()), rank
