"""Typed records that flow between the pools: tasks, turns, trajectories, training samples.

These are plain dataclasses (no torch) so that they pickle cheaply between processes and
serialise to the trajectory store as they are. Token-level fields are lists of ints/floats:
the token ids are the exact ids the engine sampled (token fidelity), never re-tokenized text.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any


class RolloutStatus(enum.StrEnum):
    """How a trajectory ended. Errors are data: every trajectory ends with one of these."""

    COMPLETED = "completed"  # the agent gave a final answer (right or wrong)
    TRUNCATED = "truncated"  # max turns or max context reached before a final answer
    ENV_ERROR = "env_error"  # the environment or one of its tools crashed
    TIMEOUT = "timeout"  # a tool call or the whole trajectory ran past its deadline
    ABORTED = "aborted"  # cancelled by the runtime (shutdown, interrupt)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass(slots=True, kw_only=True)
class Task:
    """One problem instance. `answer` is what the verifier checks; `data` is task-specific."""

    task_id: str
    prompt: str
    answer: str
    split: str = "train"
    family: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class TokenSpan:
    """Half-open [start, end) range of positions in the trajectory's token sequence."""

    start: int
    end: int


@dataclass(slots=True, kw_only=True)
class Turn:
    """One agent step: what it thought/did (sampled), what the env answered (appended).

    `act_span` covers the sampled tokens of this turn and `obs_span` the tokens appended for the
    observation; both index into Trajectory.token_ids. `logprobs` and `versions` are aligned with
    the sampled tokens (one per token in act_span).
    """

    think: str = ""
    act: str = ""
    obs: str = ""
    reward_step: float = 0.0
    done: bool = False
    act_span: TokenSpan | None = None
    obs_span: TokenSpan | None = None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    context_events: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class TrajectoryMetadata:
    env_version: str = ""
    total_steps: int = 0
    total_tokens: int = 0
    wall_time: float = 0.0
    truncated: bool = False
    env_errors: int = 0
    policy_version_min: int = -1
    policy_version_max: int = -1


@dataclass(slots=True, kw_only=True)
class Trajectory:
    """A full multi-turn rollout with its exact token sequence (the seed's schema, extended)."""

    task_id: str
    trajectory_id: str
    group_id: str
    position: int = -1  # index of the task's group in the run's data order (for resume)
    turns: list[Turn] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + every turn's act and obs tokens
    temperature: float = 1.0
    total_reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    status: RolloutStatus = RolloutStatus.COMPLETED
    error: str | None = None
    final_answer: str | None = None
    metadata: TrajectoryMetadata = field(default_factory=TrajectoryMetadata)

    def sampled_mask(self) -> list[int]:
        """1 where the token was sampled by the policy, 0 for prompt and observation tokens."""
        mask = [0] * len(self.token_ids)
        for turn in self.turns:
            if turn.act_span is not None:
                for i in range(turn.act_span.start, turn.act_span.end):
                    mask[i] = 1
        return mask

    def token_logprobs(self) -> list[float]:
        out = [0.0] * len(self.token_ids)
        for turn in self.turns:
            if turn.act_span is not None:
                out[turn.act_span.start : turn.act_span.end] = turn.logprobs
        return out

    def token_versions(self) -> list[int]:
        """Policy version per token; -1 for tokens the policy did not sample."""
        out = [-1] * len(self.token_ids)
        for turn in self.turns:
            if turn.act_span is not None:
                out[turn.act_span.start : turn.act_span.end] = turn.versions
        return out


@dataclass(slots=True, kw_only=True)
class TrainingSample:
    """What the trainer consumes: one token sequence with per-token training data.

    All lists have the same length as token_ids. loss_mask is 1 on sampled tokens only.
    behaviour_logprobs are the engine's logprobs at sampling time (0 where masked).
    """

    trajectory_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    advantages: list[float]
    temperature: float = 1.0
    reward: float = 0.0

    @property
    def min_version(self) -> int:
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else -1
