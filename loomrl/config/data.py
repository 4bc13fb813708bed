"""The `data:` section of a recipe: a dataset the user brings (loomrl/data/loader.py reads it; docs/data.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loomrl.config.base import Section


class DataConfig(Section):

    path: str | list[str] | None = None
    """local files: a path, a glob, or a list of them (parquet, JSONL/JSON, CSV, Arrow), or a folder written by
    `datasets`' save_to_disk (a DatasetDict's splits chosen by train_values and heldout_values); relative to the
    recipe's folder"""
    heldout_path: str | list[str] | None = None
    """a separate held-out file (same forms as path); else the held-out split comes from split_column or the seed"""
    hub: str | None = None
    """a Hugging Face hub dataset, read ONLY from the local cache (nothing is downloaded at run time)"""
    hub_config: str | None = None
    """the hub dataset's configuration (subset) name, if it has several"""
    hub_split: str = "train"
    """the hub dataset's split trained on"""
    hub_heldout_split: str | None = None
    """the hub dataset's split held out; None: held out from hub_split by the seed"""
    format: Literal["auto", "parquet", "json", "csv", "arrow"] = "auto"
    """auto: from each file's extension"""
    layout: Literal["auto", "columns", "verl"] = "auto"
    """verl: verl's parquet layout as it is (prompt messages, reward_model.ground_truth, data_source, extra_info); auto:
    verl when the file has `prompt` and `reward_model` columns, else the column mapping below"""
    prompt: str = "prompt"
    """the prompt's column: a string, or a list of chat messages ({role, content})"""
    prompt_template: str | None = None
    """a format string over the row's columns that makes the prompt instead, e.g. "Solve: {question}"."""
    answer: str | None = None
    """the answer's column, dotted into structs; default "answer" (verl: reward_model.ground_truth)"""
    id: str | None = None
    """a column of task ids (default: the file's name and the row)"""
    family: str | None = None
    """a column of task families (default: none; verl: data_source)"""
    system_prompt: str | None = None
    """prepended unless the prompt's messages start with a system message"""
    few_shot: list[dict[str, Any]] = Field(default_factory=list)
    """worked examples before the prompt: {prompt, answer} pairs (a user and an assistant turn each) or chat messages"""
    split_column: str | None = None
    """held-out split from a column: rows whose split_column is in heldout_values are held out, train_values trained on
    """
    train_values: list[str] = Field(default_factory=lambda: ["train"])
    """split_column values whose rows are trained on (also: a save_to_disk DatasetDict's splits trained on)"""
    heldout_values: list[str] = Field(default_factory=lambda: ["test", "heldout", "validation", "val"])
    """split_column values whose rows are held out (also: a save_to_disk DatasetDict's splits held out)"""
    heldout_size: int | None = Field(None, gt=0)
    """else held out from the seed: this many rows (default: env.n_heldout, at most a fifth of the rows)"""
    max_rows: int | None = Field(None, gt=0)
    """use only the first max_rows rows of each split"""
    skip_malformed: bool = False
    """rows that cannot be used (null or empty prompt, null answer, a JSON line that is not a JSON object): stop
    naming the first (false) or leave them out with a warning and a count (true)"""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.path is None) == (self.hub is None):
            raise ValueError("data: give exactly one of data.path (local files) or data.hub (a cached hub dataset)")
        return self
