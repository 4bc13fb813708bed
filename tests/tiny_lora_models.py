"""The tiny model the LoRA and tree tests share (tests/trainer/test_lora.py, test_lora_fsdp.py, test_lora_publish.py,
test_tree.py): a tiny
random model from a config with its matrices redrawn at std 0.2, so that a wrong merge, a missing adapter or a stale
one moves logprobs far beyond the tolerances (at the config's init, std 0.02, they would hide in float noise). A module,
not a fixture: the FSDP tests build it inside spawned ranks."""

from __future__ import annotations

import torch

from loomrl.config import ModelConfig
from loomrl.model.loader import build_tiny_model


def spread_tiny(vocab: int, eos: int, arch: str = "llama") -> torch.nn.Module:
    model = build_tiny_model(ModelConfig(kind="tiny", tiny={"arch": arch}), vocab, eos)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model
