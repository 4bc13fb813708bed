"""The `reward:` section: reward functions, named terms with weights and gates, workers, the judge (loomrl/reward/; docs/rewards.md)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from loomrl.config.base import Section
from loomrl.config.judge import JudgeConfig
from loomrl.config.terms import PROCESS_TERMS, Gate


class RewardTermConfig(Section):
    """One of reward.functions."""

    function: str
    """`package.module:function`: loomrl's (trajectory, task) or TRL's (prompts, completions, **columns)"""
    weight: float = Field(1.0, allow_inf_nan=False)
    """of its components in the total (each component is stored and logged unweighted); negative for a penalty"""
    name: str | None = None
    """a TRL-style function's component name (default: the function's own name)"""


class TermConfig(Section):
    """One of reward.terms: how a component of the reward counts in the total (loomrl/reward/composite.py)."""

    weight: float = Field(1.0, allow_inf_nan=False)
    """multiplies the component in the total; negative: a penalty"""
    gate: str | None = None
    """when it counts: a component's name (`correct`: when correct > 0), `not correct`, or `correct >= 0.5`"""

    @field_validator("gate")
    @classmethod
    def _readable(cls, gate: str | None) -> str | None:
        if gate is not None:
            Gate.parse(gate)  # a ValueError that says how to write one
        return gate


class RewardConfig(Section):
    function: str | None = None
    """`module:function` of a custom reward, loomrl's (trajectory, task) -> {component: value} or TRL's (prompts,
    completions, **columns) -> [float | None] (docs/rewards.md); default: the environment's own reward"""
    functions: list[RewardTermConfig] = Field(default_factory=list)
    """several reward functions, each with a weight: the total is their weighted sum (None: that function has no opinion
    on the trajectory, left out, never a 0). Replaces function and the environment's reward."""
    terms: dict[str, TermConfig] = Field(default_factory=dict)
    """named terms, each with a weight and a gate: any component of the reward (the environment's, a function's, the
    judge's) and the built-in ones, computed only when named here: the process terms tool_error, malformed_call,
    repeated_action, language_mixing (per turn; give a negative weight) and completion_time (against the group)"""
    workers: int = Field(2, gt=0)
    """reward worker processes (or threads, for an environment's own reward) per rollout side"""
    timeout_s: float = Field(30.0, gt=0.0)
    """a reward call runs at most this long: one that raises or runs past it marks its trajectory reward_failed (stored,
    never trained) and the run goes on"""
    judge: JudgeConfig | None = None
    """an LLM judge over an OpenAI-compatible endpoint (reward/judge.py, docs/rewards.md "LLM judge"): its score is the
    `judge` component, added after the others; None: no judge"""

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if self.function and self.functions:
            raise ValueError("give reward.function or reward.functions, not both (reward.functions takes one "
                             "function with a weight too)")
        for name, term in self.terms.items():
            if name in PROCESS_TERMS and term.weight > 0:
                raise ValueError(f"terms.{name}.weight: {name} counts the turns that went wrong: a penalty, give it a "
                                 f"negative weight (e.g. -0.1), not {term.weight:g}")
        return self
