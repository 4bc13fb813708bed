"""The `agent:` section: how an episode is driven, white-box or black-box, and its context management (loomrl/agent/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomrl.config.base import Section


class ContextConfig(Section):
    strategy: Literal["none", "discard_all", "keep_last", "clear_thinking", "summarize"] = "none"
    """context management as an action (see loomrl/agent/context.py)"""
    threshold: float = Field(0.8, gt=0.0, le=1.0)
    """share of agent.max_context_tokens that triggers it"""
    keep_last: int = Field(2, gt=0)
    """keep_last: turns kept"""
    summary_max_tokens: int = Field(64, gt=0)
    """summarize: the summary turn's token budget"""


class AgentConfig(Section):
    kind: Literal["whitebox", "blackbox"] = "whitebox"
    """whitebox: loomrl's own agent loop drives the env; blackbox: an unmodified program speaking the OpenAI API runs in
    a sandbox per rollout against loomrl's gateway (see docs/agents.md)"""
    command: list[str] = Field(default_factory=list)
    """blackbox: the program, e.g. [python3, agent.py]"""
    files: list[str] = Field(default_factory=list)
    """blackbox: files copied into its workdir (recipe-relative)"""
    max_turns: int = Field(4, gt=0)
    """blackbox: the call budget"""
    max_context_tokens: int = Field(1024, gt=0)
    """the longest context a turn may see; an episode that would pass it ends truncated (or is summarised:
    agent.context)"""
    trajectory_timeout_s: float = Field(300.0, gt=0.0)
    """wall-clock budget of an episode (white-box: every turn, queueing for the engine included) or a black-box program
    """
    context: ContextConfig = Field(default_factory=ContextConfig)
    """whitebox only"""
    reward_from_agent: bool = False
    """blackbox: the program may report its own reward (POST /v1/reward); it is used instead of the task's verifier.
    Only for tasks whose programs can be trusted to judge themselves."""
    retry_on: list[Literal["env_error", "engine_error", "timeout"]] = Field(default_factory=list)
    """Supervision: a trajectory that ends with one of these statuses is run again, up to max_retries more times, after
    retry_backoff_s x 2^k (with jitter); the kept attempt records the earlier ones' errors. env_error: a dead sandbox, a
    crashed tool, any exception in the loop; engine_error: the engine failed a generation (a step raised, or its weights
    failed to load); timeout: a hung tool or the episode deadline (trajectory_timeout_s), which a slow policy can hit
    too."""
    max_retries: int = Field(0, ge=0)
    """an episode that ended env_error, engine_error or timeout is run again up to this many times (agent.retry_on says
    which)"""
    retry_backoff_s: float = Field(0.5, ge=0.0)
    """seconds before the first retry of an episode, doubled after each (with jitter)"""
