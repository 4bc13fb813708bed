"""The trainer's device and precision (loomrl/trainer/trainer.py, loomrl/devices.py): float32 masters on
trainer.device whatever the engine's model.dtype, and every tensor a training step makes on the model's device.

The device audit runs on the CPU: with torch's default device set to "meta", a tensor made without an explicit
device= lands on meta, and the first op mixing it with the model's CPU tensors fails; so a step that completes made
each of its tensors where the model is (what a CUDA run needs)."""

from __future__ import annotations

import random

import pytest
import torch

from loomrl.config import ModelConfig, RunConfig, TinyModelConfig, TrainerConfig
from loomrl.model.loader import load_model, load_run_model
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample

TINY = ModelConfig(kind="tiny", tiny=TinyModelConfig(init_std=0.1, seed=3))


def _samples(vocab: int) -> list[TrainingSample]:
    """A GRPO group sharing a prompt (so tree merge has something to merge), two turns of a conversation."""
    rng = random.Random(7)
    prompt = [rng.randrange(vocab) for _ in range(8)]
    out = []
    for k in range(4):
        ids = prompt + [rng.randrange(vocab) for _ in range(3 + k)]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        mask[len(prompt) + 1] = 0 if k == 3 else 1  # a gap: two chunks in one sample
        out.append(TrainingSample(trajectory_id=f"t{k}", group_id="g", token_ids=ids, loss_mask=mask,
                                  behaviour_logprobs=[-10.0 * m for m in mask], versions=[0] * len(ids),
                                  advantages=[(k - 1.5) * m for m in mask], temperature=0.7 if k % 2 else 1.0))
    return out


def test_the_trainer_keeps_float32_masters_when_the_engine_model_is_bfloat16():
    cfg = RunConfig(model=TINY.model_copy(update={"dtype": "bfloat16"}), runtime={"mode": "async"},
                    trainer=TrainerConfig(lr=1e-4, precision="bfloat16", micro_batch_size=2))
    engine, tokenizer = load_run_model(cfg.model, None)
    model, _ = load_run_model(cfg.model, None, trainer=cfg.trainer)
    assert all(p.dtype == torch.bfloat16 for p in engine.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    trainer = Trainer(model, cfg.trainer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = trainer.train_step(_samples(len(tokenizer)))
    assert stats.grad_norm > 0
    for n, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, n
        state = trainer.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, n
    # most of a small step's changes are below bfloat16's resolution: float32 masters keep them, bf16 ones would not
    changed = invisible = 0
    for n, p in model.named_parameters():
        moved = p != before[n]
        changed += int(moved.sum())
        invisible += int((moved & (p.to(torch.bfloat16) == before[n].to(torch.bfloat16))).sum())
    assert changed and invisible > changed // 2
    assert all(p.dtype == torch.bfloat16 for p in engine.parameters())  # the engine's copy is its own


def test_a_bfloat16_model_given_to_the_trainer_is_placed_in_float32():
    """A caller passing a bfloat16 model gets float32 masters (cast up, so rounded: callers load the trainer's
    model with load_run_model(trainer=), which is exact), and the KL reference with them."""
    model, _ = load_model(TINY.model_copy(update={"dtype": "bfloat16"}))
    trainer = Trainer(model, TrainerConfig(loss={"kl": "k3", "kl_coef": 0.1}))
    assert trainer.device == torch.device("cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.ref_model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("options", [
    {},
    {"tree_merge": "on"},
    {"tree_merge": "on", "tree_token_budget": 12, "tree_merge_memory": "depth_first"},
    {"micro_batch_tokens": 30, "loss": {"kind": "decoupled_ppo", "kl": "k3", "kl_coef": 0.1, "is_level": "chunk"}},
    {"precision": "bfloat16", "loss": {"kind": "gspo", "aggregation": "seq_mean_token_mean"}},
], ids=["dense", "tree", "depth_first", "decoupled_kl_chunk", "bf16_gspo"])
def test_a_training_step_makes_every_tensor_on_the_model_device(tokenizer, options):
    model, _ = load_model(TINY)
    trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=2, **options))
    samples = _samples(len(tokenizer))
    reference = Trainer(load_model(TINY)[0], TrainerConfig(lr=1e-3, micro_batch_size=2, **options))
    expected = reference.train_step(samples)
    torch.set_default_device("meta")  # anything made without device= goes there, and breaks the step
    try:
        stats = trainer.train_step(samples)
    finally:
        torch.set_default_device(None)
    assert stats.loss == expected.loss and stats.grad_norm == expected.grad_norm  # and computed the same
    assert all(p.device.type == "cpu" for p in model.parameters())
