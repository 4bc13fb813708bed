"""Datasets users bring (the recipe's `data:` section): parquet, JSONL, CSV and Arrow files, `datasets` save_to_disk
folders or cached hub datasets, verl's layout, column mappings and splits, read lazily into tasks. docs/data.md."""

from loomrl.config.data import DataConfig
from loomrl.data.loader import DataError, TaskSource, load_splits

__all__ = ["DataConfig", "DataError", "TaskSource", "load_splits"]
