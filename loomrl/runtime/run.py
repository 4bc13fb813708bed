"""Wiring: a run folder, the parts for the config (runtime.backend, runtime.mode, runtime.weight_transport), the driver
over them; and held-out evaluation of a checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loomrl.config import RunConfig, load_config, save_resolved
from loomrl.reward.pool import load_terms
from loomrl.run_folder import CheckpointFolder, RunFolder, read_ledger
from loomrl.runtime.checks import check_config
from loomrl.runtime.driver import Driver, checked_eval
from loomrl.runtime.failures import CannotStart
from loomrl.runtime.parts import Parts
from loomrl.runtime.summary import finished_at
from loomrl.trainer.checkpoint import checkpoint_step, latest_checkpoint
from loomrl.types import EvalRecord

log = logging.getLogger("loomrl")


def prepare_run_dir(cfg: RunConfig, resume: bool) -> Path | None:
    """Create the run folder (or find the checkpoint to resume); returns the checkpoint or None. CannotStart when the
    folder and --resume disagree."""
    run_dir = cfg.run_dir
    ckpt = latest_checkpoint(run_dir)
    if resume:
        if ckpt is None:
            raise CannotStart(f"--resume given but '{run_dir}' has no checkpoint; start without --resume")
        done = finished_at(run_dir)
        if done is not None and done >= cfg.trainer.total_steps:
            raise CannotStart(f"the run in '{run_dir}' is finished ({done} steps, trained and evaluated: "
                              f"summary.json); to train it further, resume with a larger total, e.g. "
                              f"trainer.total_steps={done * 2} --resume; to score a checkpoint, loomrl eval RECIPE "
                              f"--checkpoint {run_dir}")
    elif ckpt is not None or RunFolder(run_dir).ledger.exists():
        raise CannotStart(f"'{run_dir}' already holds a run; pass --resume to continue it, or set name=... "
                          "for a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, RunFolder(run_dir).config)
    if ckpt is None:
        log.info("run folder %s", run_dir.resolve())
    else:
        log.info("run folder %s: resuming from its checkpoint of step %d", run_dir.resolve(), checkpoint_step(ckpt))
    return ckpt


def resume_config(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """What `--resume` continues with: the run folder's own config (config.yaml, the resolved config it last ran
    with) and this command's `overrides` on top, so that a run resumed with fewer overrides than it started with
    goes on as it was, not with the recipe's values (README: `name=try2 --resume`); `cfg` (the recipe and the
    overrides) only says where the folder is. A folder without one: `cfg` itself."""
    saved = RunFolder(cfg.run_dir).config
    if not saved.is_file():
        return cfg
    resumed = load_config(saved, overrides)
    # the folder is where it was found, even if it was moved since the run wrote its name into config.yaml
    resumed = resumed.model_copy(update={"output_dir": cfg.output_dir, "name": cfg.name})
    if changed := _differences(cfg.model_dump(mode="json"), resumed.model_dump(mode="json")):
        log.info("resuming with the run's own %s, where it differs from the recipe: %s", saved, ", ".join(changed))
    return resumed


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two config dumps, as field=b's value."""
    out = []
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}={y}")
    return sorted(out)


def make_parts(cfg: RunConfig, checkpoint: Path | None) -> Parts:
    """The run's rollouts, trainer and weight route, composed once from its config (runtime/parts.py)."""
    if cfg.runtime.backend == "ray":
        from loomrl.runtime.ray_backend import ray_parts

        return ray_parts(cfg)
    from loomrl.runtime.local import local_parts

    return local_parts(cfg, checkpoint)


class RunInterrupted(Exception):
    """Ctrl-C stopped a run (the CLI turns SIGTERM and SIGHUP into Ctrl-C) after its cleanup ran: how far the
    trainer got (its ledger's last step) and the checkpoint `--resume` would continue from (None: none yet)."""

    def __init__(self, run_dir: Path, step: int, checkpoint_step: int | None):
        super().__init__(f"run interrupted at step {step} ({run_dir})")
        self.run_dir, self.step, self.checkpoint_step = run_dir, step, checkpoint_step


def train(cfg: RunConfig, resume: bool = False, wall_start: float | None = None,
          parts: Callable[[RunConfig, Path | None], Parts] = make_parts) -> dict[str, Any]:
    """Train as the config says; the summary as RUN/summary.json holds it (run_folder.Summary.as_json: what the CLI
    prints). `parts`: what composes the run's parts from the config and the checkpoint it resumes from (tests wrap the
    real ones this way). RunInterrupted on Ctrl-C."""
    wall_start = wall_start or time.time()
    check_config(cfg)  # this machine and the environment (runtime/checks.py), before any model loads
    if cfg.reward.function or cfg.reward.functions:  # a reward that cannot be imported stops here, before any model
        load_terms(cfg.reward)
    ckpt = prepare_run_dir(cfg, resume)
    try:
        return Driver(cfg, parts(cfg, ckpt), ckpt, wall_start).run().as_json()
    except KeyboardInterrupt:  # the driver's finally has stopped the trainer and flushed the run folder
        latest = latest_checkpoint(cfg.run_dir)
        steps = [entry.step for entry in read_ledger(cfg.run_dir)]
        raise RunInterrupted(cfg.run_dir, max(steps, default=0),
                             None if latest is None else checkpoint_step(latest)) from None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or a run folder's latest checkpoint (CannotStart: neither)."""
    ckpt = path if CheckpointFolder(path).model.is_dir() else latest_checkpoint(path)
    if ckpt is None:
        raise CannotStart(f"'{path}' is neither a checkpoint folder nor a run folder with one")
    return ckpt


def evaluate_checkpoint(cfg: RunConfig, checkpoint: Path) -> dict[str, Any]:
    """Held-out success of a checkpoint folder (or a run folder: its latest checkpoint), on the local
    backend's rollout side."""
    from loomrl.runtime.local import LocalRollouts

    ckpt = resolve_checkpoint(checkpoint)
    rollouts = LocalRollouts(cfg, ckpt)

    async def run_eval() -> EvalRecord:
        try:
            await rollouts.start()
            return (await rollouts.evaluate("checkpoint")).record
        finally:
            await rollouts.close()

    return {"checkpoint": str(ckpt), **asdict(checked_eval(asyncio.run(run_eval()), f"of {ckpt}"))}
