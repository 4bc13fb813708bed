"""The `buffer:` section: staleness, sampling order and the filters groups pass before training (loomrl/buffer/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config.base import Section

BatchFilter = Literal["complete", "repetitive", "near_duplicate"]  # buffer.filters


def _default_filters() -> list[BatchFilter]:
    return ["complete"]


class BufferConfig(Section):
    max_policy_lag: int = Field(1, ge=0)
    """groups staler than this are dropped (counted) at consumption"""
    lag_decay: float = Field(0.0, ge=0.0)
    """stale-but-admitted samples weigh exp(-lag_decay * lag) (lag = trainer version - oldest token version)"""
    sampler: Literal["fifo", "oldest_first", "freshest_first", "window"] = "fifo"
    """which finished groups a step takes: fifo (completion order), oldest_first, freshest_first, or window (Forge: any
    finished group within `window` positions of the oldest untaken one)"""
    window: int | None = Field(None, ge=1)
    """sampler=window: how far past the oldest untaken position a finished group may be taken"""

    @model_validator(mode="after")
    def _window_given(self) -> BufferConfig:
        if self.sampler == "window" and self.window is None:
            raise ValueError("buffer.window: the window sampler needs a width, e.g. buffer.window=4")
        return self
    filters: list[BatchFilter] = Field(default_factory=_default_filters)
    """filters before a batch (loomrl/buffer/filters.py): complete, repetitive, near_duplicate"""
    drop_truncated: bool = False
    """complete: also leave out trajectories cut by the turn/context budget"""
    ngram: int = Field(4, gt=0)
    """repetitive, near_duplicate: n-gram size over sampled tokens"""
    max_repeats: int = Field(8, gt=0)
    """repetitive: most repeats of one n-gram allowed"""
    duplicate_threshold: float = Field(0.9, gt=0.0, le=1.0)
    """near_duplicate: Jaccard of n-gram sets"""
    balance_max_ratio: float | None = Field(None, ge=1.0)
    """subsample the majority advantage sign to this ratio"""
