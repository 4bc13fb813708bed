"""loomrl's cache folder, shared by every part that keeps something costly between runs (converted models, dataset
caches, codefix task validations). Imports nothing of loomrl, so that any layer may use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(configured: str | None = None) -> Path:
    """loomrl's cache folder: `configured` (model.cache_dir), else $LOOMRL_CACHE, else ~/.cache/loomrl."""
    return Path(configured or os.environ.get("LOOMRL_CACHE") or Path.home() / ".cache" / "loomrl")
