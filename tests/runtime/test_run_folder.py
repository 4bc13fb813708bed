"""Where a run lives and what `--resume` continues: the run folder is named at start, a resume names the checkpoint
step it continues from, and a resume goes on with the run's own config (its config.yaml) and the command's overrides
on top, as README "Using it" shows (`name=try2 --resume` after a start with more overrides)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from loomrl.config import load_config
from loomrl.runtime.run import prepare_run_dir, resume_config
from loomrl.trainer.checkpoint import save_checkpoint

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def test_the_run_folder_is_named_at_start_and_a_resume_names_its_checkpoint_step(tmp_path, caplog,
                                                                                 tiny_model_and_tokenizer):
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "name=here"])
    with caplog.at_level(logging.INFO, logger="loomrl"):
        prepare_run_dir(cfg, resume=False)
    assert f"run folder {(tmp_path / 'here').resolve()}" in caplog.text
    model, tokenizer = tiny_model_and_tokenizer
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(cfg.run_dir, 6, model=model, tokenizer=tokenizer, optimizer=optimizer,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), state={})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loomrl"):
        prepare_run_dir(cfg, resume=True)
    assert f"run folder {(tmp_path / 'here').resolve()}: resuming from its checkpoint of step 6" in caplog.text


def test_resume_goes_on_with_the_runs_own_config_and_the_commands_overrides(tmp_path, caplog):
    started = [f"output_dir={tmp_path}", "trainer.lr=2e-5", "runtime.mode=sync", "name=try2"]
    prepare_run_dir(load_config(RECIPE, started), resume=False)  # writes try2/config.yaml
    again = [f"output_dir={tmp_path}", "name=try2", "trainer.total_steps=9"]  # fewer overrides, and a new one
    with caplog.at_level(logging.INFO, logger="loomrl"):
        cfg = resume_config(load_config(RECIPE, again), again)
    assert (cfg.trainer.lr, cfg.runtime.mode, cfg.trainer.total_steps) == (2e-5, "sync", 9)  # the recipe says 1e-4, async
    assert cfg.run_dir == tmp_path / "try2"
    assert "differs from the recipe: runtime.mode=sync, trainer.lr=2e-05" in caplog.text  # the log says what it kept
    fresh = load_config(RECIPE, [f"output_dir={tmp_path}", "name=new"])  # no run folder yet: the recipe's config
    assert resume_config(fresh, []) == fresh
