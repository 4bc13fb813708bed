"""The `eval:` section: held-out evaluation before and after training."""

from __future__ import annotations

from pydantic import Field

from loomrl.config.base import Section


class EvalConfig(Section):
    n_tasks: int = Field(100, ge=0)
    """episodes per held-out split (heldout, heldout_templates)"""
    before: bool = True
    """evaluate before training (restored, not run again, on resume)"""
    after: bool = True
    """evaluate after the last step"""
    temperature: float = Field(0.0, ge=0.0)
    """sampling temperature of evaluation (0: greedy)"""
    max_inflight: int = Field(0, ge=0)
    """Episodes evaluated at once (0: all of them, within runtime.max_inflight_trajectories). Black-box agents are
    programs of their own: on a small machine, hundreds at once share its cores and run past agent.trajectory_timeout_s.
    Long white-box episodes do too: 134 of 200 gym episodes of up to 12 turns, all in flight on 2 cores."""
