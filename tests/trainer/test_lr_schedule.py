"""trainer.lr_schedule (loomrl/trainer/trainer.py lr_factor): warmup, then constant, cosine or linear decay to
lr x lr_min_ratio at the last step; the trainer's AdamW uses it, skipped steps advance it, a resume goes on from it."""

from __future__ import annotations

import math

import pytest

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.model.loader import load_model
from loomrl.trainer.checkpoint import load_optimizer, save_checkpoint
from loomrl.trainer.trainer import Trainer, lr_factor


def test_constant_keeps_the_warmup_ramp_and_then_one():
    cfg = TrainerConfig(warmup_steps=4, total_steps=10)
    assert [lr_factor(cfg, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(TrainerConfig(total_steps=3), 0) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_runs_from_one_after_warmup_to_the_floor_at_the_last_step(schedule):
    cfg = TrainerConfig(warmup_steps=2, total_steps=12, lr_schedule=schedule, lr_min_ratio=0.1)
    got = [lr_factor(cfg, s) for s in range(12)]
    assert got[:3] == [0.5, 1.0, 1.0] and got[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(got[2:], got[3:]))  # falls at every step after warmup
    half = 0.1 + 0.9 * (0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * 0.5)))
    cfg_mid = TrainerConfig(total_steps=11, lr_schedule=schedule, lr_min_ratio=0.1)
    assert lr_factor(cfg_mid, 5) == pytest.approx(half)  # halfway through steps 0..10
    assert lr_factor(cfg, 40) == pytest.approx(0.1)  # past total_steps (a run extended on resume): the floor


def test_min_ratio_out_of_range_names_the_field():
    with pytest.raises(ValueError, match="lr_min_ratio"):
        TrainerConfig(lr_schedule="cosine", lr_min_ratio=1.5)


def test_the_trainer_steps_along_the_schedule_and_a_resume_goes_on_from_it(tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    cfg = TrainerConfig(lr=1e-3, total_steps=6, lr_schedule="cosine", lr_min_ratio=0.2)
    model, _ = load_model(ModelConfig(kind="tiny"))
    trainer = Trainer(model, cfg)
    lrs = []
    for _ in range(3):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.skip_step()
    assert lrs == pytest.approx([1e-3 * lr_factor(cfg, s) for s in range(3)])
    ckpt = save_checkpoint(tmp_path, 3, model=model, tokenizer=tokenizer, optimizer=trainer.optimizer,
                           scheduler=trainer.scheduler, state={})
    resumed = Trainer(load_model(ModelConfig(kind="tiny"))[0], cfg)
    load_optimizer(ckpt, resumed.optimizer, resumed.scheduler)
    after = []
    for _ in range(3):
        after.append(resumed.optimizer.param_groups[0]["lr"])
        resumed.skip_step()
    assert after == pytest.approx([1e-3 * lr_factor(cfg, s) for s in range(3, 6)])
    assert after[-1] == pytest.approx(2e-4)
