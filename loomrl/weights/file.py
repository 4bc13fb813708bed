"""The "file" transport: one safetensors file per version, written under a temporary name, fsynced, renamed."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from loomrl.weights.handle import (
    StaleWeights,
    Transport,
    WeightHandle,
    WeightPublisher,
    nbytes,
)

Tensor = torch.Tensor


def _file_name(version: int) -> str:
    return f"weights-v{version:010d}.safetensors"


class FilePublisher(WeightPublisher):
    transport = Transport.FILE

    def __init__(self, folder: str | Path | None = None, *, keep: int = 2, fsync: bool = True):
        super().__init__(keep)
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="loomrl-weights-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _snapshot(self, weights: dict[str, Tensor], version: int) -> tuple[Any, WeightHandle]:
        from safetensors.torch import save_file

        final = self.folder / _file_name(version)
        tmp = self.folder / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"  # readers never list dot files
        try:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in weights.items()}, str(tmp),
                      metadata={"version": str(version)})
            if self.fsync:  # the bytes are on disk before the name points at them
                _fsync(tmp)
            os.replace(tmp, final)
            if self.fsync:
                _fsync(self.folder)
        finally:
            tmp.unlink(missing_ok=True)
        return final, WeightHandle(transport=self.transport, version=version, nbytes=nbytes(weights),
                                   location=str(final))

    def _release(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def close(self) -> None:
        super().close()
        if self._own_folder:
            for leftover in self.folder.iterdir():
                leftover.unlink(missing_ok=True)
            self.folder.rmdir()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_file(path: str, version: int) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt")
    except FileNotFoundError:
        raise StaleWeights(f"weight sync: version {version} ({path}) was freed; load a newer handle") from None
    # Once open, the file's contents stay readable even if the publisher unlinks it meanwhile.
    found = int((f.metadata() or {}).get("version", -1))
    if found != version:
        raise RuntimeError(f"weight sync: {path} holds version {found}, the handle says {version}")
    return {name: f.get_tensor(name) for name in f.keys()}
