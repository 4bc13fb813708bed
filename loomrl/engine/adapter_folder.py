"""The folder a server engine reads a published adapter version from, written the same way for vLLM (in process and
over HTTP: engine/vllm/lora.py) and SGLang (engine/sglang.py): the version's fresh name checked, only adapter tensors
accepted, an earlier try of the same version replaced, and the folders no longer served removed.

What it is not: the loading itself (each server has its own API) or which versions are still in use (vLLM keeps the
one before the newest while requests admitted under it finish; SGLang keeps only the newest).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from loomrl.engine.base import EngineFault
from loomrl.weights.adapter import AdapterMeta, adapter_name, is_adapter_tensor, write_folder


def write_version(root: Path, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> Path:
    """`root/<adapter.name>`, written from `weights` (PEFT's layout). Refuses, as EngineFault, a name that is not
    version `version`'s fresh one (a stale name is what serves an old adapter silently) and tensors that are not an
    adapter's (full weights go to update_weights)."""
    if adapter.name != adapter_name(version):
        raise EngineFault(f"update_adapter: adapter {adapter.name!r} published as version {version}, whose name is "
                          f"{adapter_name(version)!r} (a fresh name per version)")
    unknown = [n for n in weights if not is_adapter_tensor(n)]
    if unknown or not weights:
        raise EngineFault(f"update_adapter: {adapter.name}: tensors that are no LoRA adapter's ({unknown[:3]}); "
                          "full weights go to update_weights")
    shutil.rmtree(root / adapter.name, ignore_errors=True)  # an earlier try of this version (its load failed)
    return write_folder(root / adapter.name, adapter, weights)


def remove_except(root: Path, keep: Iterable[str]) -> None:
    """Remove every adapter folder under `root` but those named in `keep` (the ones the server still serves)."""
    kept = set(keep)
    for old in root.iterdir() if root.is_dir() else ():
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
