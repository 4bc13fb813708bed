"""Rollout engines behind one small async protocol (see base.py)."""

from loomrl.engine.base import Engine, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "SamplingParams"]
