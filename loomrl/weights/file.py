"""The "file" transport: a folder of safetensors files per version, written under a temporary name, fsynced, renamed."""

from __future__ import annotations

import os
import shutil
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
)
from loomrl.weights.source import WeightSource

Tensor = torch.Tensor


def _folder_name(version: int) -> str:
    return f"weights-v{version:010d}"


class FilePublisher(WeightPublisher):
    """A version is a folder of safetensors files, one per bucket (written as the buckets come, so that no whole-model
    copy is held), each carrying the version in its metadata; the folder is written under a temporary name, fsynced,
    then renamed into place."""

    transport = Transport.FILE

    def __init__(self, folder: str | Path | None = None, *, keep: int = 2, fsync: bool = True,
                 dtype: torch.dtype | None = None, bucket_bytes: int = 64 << 20):
        super().__init__(keep, dtype=dtype, bucket_bytes=bucket_bytes)
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="loomrl-weights-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        from safetensors.torch import save_file

        final = self.folder / _folder_name(version)
        tmp = self.folder / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"  # readers never list dot folders
        tmp.mkdir()
        try:
            count = str(len(source.plan()))  # a reader that finds fewer files (being freed) knows it
            for i, bucket in enumerate(source.buckets()):
                path = tmp / f"bucket-{i:05d}.safetensors"
                save_file({n: t.to("cpu").contiguous() for n, t in bucket}, str(path),
                          metadata={"version": str(version), "buckets": count})
                if self.fsync:  # the bytes are on disk before the name points at them
                    _fsync(path)
            if self.fsync:
                _fsync(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a crashed run's leftover of this version
            os.replace(tmp, final)
            if self.fsync:
                _fsync(self.folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final, WeightHandle(transport=self.transport, version=version, nbytes=source.nbytes,
                                   location=str(final))

    def _release(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        super().close()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_file(path: str, version: int) -> dict[str, Tensor]:
    """The version a FilePublisher wrote into the folder `path`. StaleWeights if it was freed, even midway (its files
    are unlinked one by one; one already open stays readable)."""
    from safetensors import safe_open

    folder = Path(path)
    try:
        files = sorted(folder.iterdir())
        out = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
                found = int(meta.get("version", -1))
                if found != version:
                    raise RuntimeError(f"weight sync: {file} holds version {found}, the handle says {version}")
                if int(meta.get("buckets", -1)) != len(files):
                    raise FileNotFoundError(file)  # some of its files are gone already: the version is being freed
                out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open is no dict
        if not files:
            raise FileNotFoundError(folder)
    except FileNotFoundError:
        raise StaleWeights(f"weight sync: version {version} ({path}) was freed; load a newer handle") from None
    return out
