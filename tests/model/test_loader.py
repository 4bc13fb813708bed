"""The loader's devices and dtypes (loomrl/model/loader.py): the engine's model in model.dtype (tiny models cast, HF
folders loaded in it), the trainer's always float32, and a float32 checkpoint never rounded on its way to the trainer."""

from __future__ import annotations

import torch

from loomrl.config import ModelConfig, TinyModelConfig, TrainerConfig
from loomrl.model.loader import load_model, load_run_model

TINY = ModelConfig(kind="tiny", tiny=TinyModelConfig(init_std=0.1, seed=3))


def test_a_tiny_model_in_bfloat16_is_the_float32_one_rounded():
    fp32, _ = load_model(TINY)
    bf16, _ = load_model(TINY.model_copy(update={"dtype": "bfloat16"}))
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in bf16.parameters())
    ref = dict(fp32.named_parameters())
    assert all(torch.equal(p, ref[n].to(torch.bfloat16)) for n, p in bf16.named_parameters())
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32 and not bf16.training


def test_an_hf_folder_round_trips_in_bfloat16(tmp_path):
    """Saved from a bfloat16 model and loaded with model.dtype=bfloat16: the same bits, the same buffers' dtypes as
    the tiny model cast by the loader; loaded for the trainer: the same values in float32."""
    model, tokenizer = load_model(TINY.model_copy(update={"dtype": "bfloat16"}))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    folder = ModelConfig(kind="hf", path=str(tmp_path), dtype="bfloat16")
    again, _ = load_model(folder)
    saved = model.state_dict()
    assert saved.keys() == again.state_dict().keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, saved[n]) for n, t in again.state_dict().items())
    assert {n: b.dtype for n, b in again.named_buffers()} == {n: b.dtype for n, b in model.named_buffers()}
    trainer, _ = load_run_model(folder, None, trainer=TrainerConfig())
    assert all(t.dtype == torch.float32 and torch.equal(t, saved[n].float()) for n, t in trainer.state_dict().items())


def test_the_trainer_loads_a_float32_checkpoint_unrounded_whatever_model_dtype_says(tmp_path):
    """Resume: the trainer's masters come back bit for bit, though the engine serves bfloat16 (model.dtype)."""
    model, tokenizer = load_model(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3)  # bits below bf16's
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cfg = TINY.model_copy(update={"dtype": "bfloat16"})
    trainer, _ = load_run_model(cfg, tmp_path, trainer=TrainerConfig())
    engine, _ = load_run_model(cfg, tmp_path)
    ref = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 and torch.equal(p, ref[n]) for n, p in trainer.named_parameters())
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, ref[n].to(torch.bfloat16))
               for n, p in engine.named_parameters())
    assert any(not torch.equal(p.float(), ref[n]) for n, p in engine.named_parameters())  # bf16 did round


def test_the_gguf_conversion_cache_is_keyed_by_content_not_path(tmp_path):
    """Two venvs' copies of one GGUF share one converted folder; a different file gets its own."""
    import os

    from loomrl.model.loader import _cache_key

    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (c, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(b, (1, 1))  # another mtime too
    assert _cache_key(a) == _cache_key(b) != _cache_key(c)
