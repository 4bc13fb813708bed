"""checkpoint_keep and checkpoint_keep_optimizer (trainer/checkpoint.py Retention): which checkpoints a run keeps,
and which of those keep their optimizer state. Before they existed the two newest were kept, hard-coded, so
`loomrl eval --checkpoint` of an older one failed once a later save had deleted it."""

from __future__ import annotations

import pytest

from loomrl.config import ModelConfig, TrainerConfig, load_config
from loomrl.model.loader import load_model
from loomrl.trainer.checkpoint import Retention, save_checkpoint
from loomrl.trainer.trainer import Trainer


def _save_steps(tmp_path, tokenizer, steps, retention):
    model, _ = load_model(ModelConfig(kind="tiny"))
    trainer = Trainer(model, TrainerConfig())
    for step in steps:
        save_checkpoint(tmp_path, step, model=model, tokenizer=tokenizer, optimizer=trainer.optimizer,
                        scheduler=trainer.scheduler, state={}, retention=retention)
    root = tmp_path / "checkpoints"
    return {p.name: (p / "optimizer.pt").is_file() for p in sorted(root.glob("step_*"))}, root


def test_older_checkpoints_are_kept_for_eval_without_their_optimizer_state(tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    kept, root = _save_steps(tmp_path, tokenizer, [2, 4, 6, 8], Retention(keep=3, keep_optimizer=1))
    assert kept == {"step_000004": False, "step_000006": False, "step_000008": True}
    assert (root / "latest").read_text() == "step_000008"  # --resume reads the newest: it is whole
    for name in kept:  # what `loomrl eval --checkpoint` loads is there in each
        assert (root / name / "model" / "config.json").is_file() and (root / name / "state.pt").is_file()


def test_keep_zero_keeps_every_checkpoint_and_the_default_keeps_two_whole(tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    every, _ = _save_steps(tmp_path / "all", tokenizer, [1, 2, 3], Retention(keep=0, keep_optimizer=2))
    assert every == {"step_000001": False, "step_000002": True, "step_000003": True}
    default, _ = _save_steps(tmp_path / "default", tokenizer, [1, 2, 3], None)
    assert default == {"step_000002": True, "step_000003": True}


def test_the_settings_are_read_and_checked_at_load():
    cfg = load_config(None, ["checkpoint_keep=5", "checkpoint_keep_optimizer=1"])
    assert (cfg.checkpoint_keep, cfg.checkpoint_keep_optimizer) == (5, 1)
    with pytest.raises(ValueError, match="checkpoint_keep_optimizer"):  # the newest must stay resumable
        load_config(None, ["checkpoint_keep_optimizer=0"])
