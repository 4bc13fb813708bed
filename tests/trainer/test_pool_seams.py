"""The training pool's seams (issue 44 item 4): its builder takes the sections a trainer needs and the device its
process resolved, not the whole recipe, so that scripts/gpu_smoke.py builds its trainers with the library's builder
instead of a copy of it; the device is resolved once where the pool is built and passed down, never again below."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from loomrl.config import ModelConfig, TinyModelConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_build_trainer_trains_on_the_device_it_is_given_not_one_it_resolves_again():
    """trainer.device names a GPU this machine lacks: resolving it again below the pool would refuse it (DeviceError);
    the device the pool's process resolved (here the CPU) is the one the trainer, its reference model and its step use."""
    from loomrl.model.loader import load_model
    from loomrl.train_pool.ranks import build_trainer

    start = ModelConfig(kind="tiny", tiny=TinyModelConfig(num_hidden_layers=1))
    trainer_cfg = TrainerConfig(device="cuda:7", loss={"kl": "k3", "kl_coef": 0.1})
    model = load_model(start, device=torch.device("cpu"), dtype=torch.float32)[0]
    trainer = build_trainer(trainer_cfg, start, torch.device("cpu"), model, None)
    assert trainer.device == torch.device("cpu")
    assert trainer.ref_model is not None and next(trainer.ref_model.parameters()).device.type == "cpu"
    assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}


def test_kls_reference_on_resume_is_loaded_on_the_device_given(tmp_path):
    """Resuming, KL's reference is the run's starting model (not the checkpoint's), loaded on the device the pool's
    process resolved: trainer.device (a GPU this machine lacks) is not resolved again."""
    from loomrl.trainer.trainer import initial_policy

    start = ModelConfig(kind="tiny", tiny=TinyModelConfig(num_hidden_layers=1))
    trainer_cfg = TrainerConfig(device="cuda:7", loss={"kl": "k3", "kl_coef": 0.1})
    ref = initial_policy(start, trainer_cfg, torch.device("cpu"), tmp_path / "checkpoints" / "step_000001")
    assert ref is not None
    assert {(p.device.type, p.dtype) for p in ref.parameters()} == {("cpu", torch.float32)}


def test_gpu_smoke_builds_its_trainers_with_the_librarys_builder():
    """scripts/gpu_smoke.py: no trainer builder of its own (no `def build_trainer`, no `Trainer(...)` call); it calls
    loomrl.train_pool.ranks.build_trainer."""
    tree = ast.parse((ROOT / "scripts" / "gpu_smoke.py").read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "build_trainer" not in defined
    assert "Trainer" not in calls
    assert ("loomrl.train_pool.ranks", "build_trainer") in imported and "build_trainer" in calls
