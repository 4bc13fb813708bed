"""Typed records that flow between the pools: tasks, turns, trajectories, training samples.

These are plain dataclasses (no torch) so that they pickle cheaply between processes and
serialise to the trajectory store as they are. Token-level fields are lists of ints/floats:
the token ids are the exact ids the engine sampled (token fidelity), never re-tokenized text.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loomrl.routed_experts import RoutedExperts


class RolloutStatus(enum.StrEnum):
    """How a trajectory ended. Errors are data: every trajectory ends with one of these."""

    COMPLETED = "completed"  # the agent gave a final answer (right or wrong)
    TRUNCATED = "truncated"  # max turns or max context reached before a final answer
    ENV_ERROR = "env_error"  # the environment or one of its tools crashed
    ENGINE_ERROR = "engine_error"  # the inference engine failed while generating for it
    TIMEOUT = "timeout"  # a tool call or the whole trajectory ran past its deadline
    ABORTED = "aborted"  # cancelled by the runtime (shutdown, interrupt)


# Endings that say the episode could not be played out (the environment, the engine or the clock failed it), not how
# well the policy did: such an episode has no reward and no success, never a 0 (training leaves it out, buffer/
# filters.py; evaluation and the rollout metrics count it apart by status).
UNSCORED = frozenset({RolloutStatus.ENV_ERROR, RolloutStatus.ENGINE_ERROR, RolloutStatus.TIMEOUT,
                      RolloutStatus.ABORTED})


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
    # The opening chat messages when the task brings its own (a dataset's system prompt, few-shot turns and prompt
    # messages: loomrl/data/); None: the environment builds them from `prompt`. `prompt` is then the last user text.
    messages: list[dict[str, Any]] | None = None


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
    # this turn's own reward terms, weighted (the per-turn process terms: a failed tool call, a malformed call, a
    # repeated action): already part of the trajectory's total_reward, kept here to place them at their turn
    # (Trajectory.turn_rewards, per-turn credit)
    reward_terms: dict[str, float] = field(default_factory=dict)
    # seconds this turn's generation took (queueing in the engine included) and its env.step (what `loomrl plan` reads)
    gen_s: float = 0.0
    env_s: float = 0.0
    # The engine's routed experts (mixture-of-experts models, asked for by trainer.router_replay) of the rows of its
    # context this turn's generation computed beyond what the context's earlier turns recorded: rows
    # [routed_start, routed_start + routed_experts.tokens) of the context's token_ids (turn_experts.py).
    routed_experts: RoutedExperts | None = None
    routed_start: int = 0


class _TokenContext:
    """Per-token views of one context (token_ids with turns whose act_spans index into it)."""

    __slots__ = ()
    token_ids: list[int]
    turns: list[Turn]

    def sampled_mask(self) -> list[int]:
        """1 where the token was sampled by the policy, 0 for prompt and observation tokens."""
        return _spans_fill(len(self.token_ids), self.turns, 0, lambda t: [1] * (t.act_span.end - t.act_span.start))

    def token_logprobs(self) -> list[float]:
        return _spans_fill(len(self.token_ids), self.turns, 0.0, lambda t: t.logprobs)

    def token_versions(self) -> list[int]:
        """Policy version per token; -1 for tokens the policy did not sample."""
        return _spans_fill(len(self.token_ids), self.turns, -1, lambda t: t.versions)


@dataclass(slots=True, kw_only=True)
class ContextSegment(_TokenContext):
    """An earlier, closed context of a trajectory. The model's context was started anew (a context
    strategy discarded or rewrote history, or a black-box agent sent a history that does not extend
    what it was given), so these tokens are what the model saw until then. Each segment is trained
    as its own sample; its turns' spans index into its own token_ids."""

    reason: str
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


def _spans_fill(n: int, turns: list[Turn], fill, values) -> list:
    """A per-token list of length n: `fill`, overwritten on each turn's act_span by values(turn)."""
    out = [fill] * n
    for turn in turns:
        if turn.act_span is not None:
            out[turn.act_span.start : turn.act_span.end] = values(turn)
    return out


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
    attempts: int = 1  # > 1: earlier attempts failed for the environment's sake and were retried
    retry_errors: list[str] = field(default_factory=list)  # why each earlier attempt failed
    reset_s: float = 0.0  # seconds env.reset took (a sandbox leased and set up), of the last attempt
    reward_s: float = 0.0  # seconds the reward pool took to score it (loomrl plan's reward latency)


REWARD_FAILED = "reward_failed"  # the component of a trajectory whose reward could not be computed


@dataclass(slots=True, kw_only=True)
class Trajectory(_TokenContext):
    """A full multi-turn rollout with its exact token sequence (the seed's schema, extended)."""

    task_id: str
    trajectory_id: str
    group_id: str
    position: int = -1  # index of the task's group in the run's data order (for resume)
    # the task as the rollout worker gave it (for reading the store): its prompt, the answer its verifier checks, its
    # split (train, heldout, heldout_templates)
    prompt: str = ""
    answer: str = ""
    split: str = ""
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
    # Earlier contexts, oldest first; prompt_ids/token_ids/turns above are the last (current) one.
    segments: list[ContextSegment] = field(default_factory=list)
    # What the environment recorded for its own reward (the latest step's StepResult.info["record"]: JSON-able data,
    # e.g. the verifiers adapter's trace, whose rubric reads the whole conversation and the tools' state). Scored on
    # the reward pool, possibly in another process, so the episode must leave it here. Stored as a JSON column, web
    # episodes' screenshots as files beside the store (store/screenshots.py).
    env_record: dict[str, Any] | None = None

    @property
    def reward_failed(self) -> bool:
        """Its reward could not be computed (reward/pool.py marks it): stored, never trained."""
        return REWARD_FAILED in self.reward_components

    @property
    def scored(self) -> bool:
        """It was played out and scored: its reward (and success) mean something."""
        return self.status not in UNSCORED and not self.reward_failed

    @property
    def ending(self) -> str:
        """How it ended, for counts: its status, or "reward_failed" when it could not be scored."""
        return REWARD_FAILED if self.reward_failed else str(self.status)

    def all_turns(self) -> list[Turn]:
        """Every turn of the episode, across its context segments."""
        return [t for seg in self.segments for t in seg.turns] + self.turns

    def turn_rewards(self) -> list[float]:
        """total_reward spread over all_turns(): each turn its own terms (Turn.reward_terms), the last turn also the
        rest (the outcome: what the environment's and the recipe's rewards said of the whole episode). They sum to
        total_reward; [] for an episode without a turn."""
        turns = self.all_turns()
        if not turns:
            return []
        own = [float(sum(t.reward_terms.values())) for t in turns]
        own[-1] += self.total_reward - sum(own)
        return own

    def contexts(self) -> list[ContextSegment | Trajectory]:
        """Every context of the episode, each with token_ids, sampled_mask(), token_logprobs() and
        token_versions(): the closed segments, then the current one (the trajectory itself)."""
        return [*self.segments, self]


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
    # the engine's routed experts of token_ids' rows (UNKNOWN where it recorded none: the trainer routes those
    # itself), what router replay forces (trainer/replay.py); None: no record (a dense model, or replay off)
    routed_experts: RoutedExperts | None = None

    @property
    def min_version(self) -> int:
        return min((v for v, m in zip(self.versions, self.loss_mask) if m), default=-1)


# A reward function: (trajectory, task) -> named components (the total is their weighted sum; see reward/).
RewardFn = Callable[[Trajectory, Task], dict[str, float]]


@dataclass(slots=True, frozen=True)
class Score:
    """A success rate over `n` episodes and its standard error."""

    success: float
    n: int
    stderr: float

    @classmethod
    def of(cls, hits: list[bool]) -> Score:
        n = len(hits)
        p = sum(hits) / n if n else 0.0
        return cls(success=p, n=n, stderr=(p * (1 - p) / n) ** 0.5 if n else 0.0)


@dataclass(slots=True, frozen=True)
class EvalRecord:
    """Held-out success: the rate and its standard error over the `n` episodes that were scored, how every episode
    ended (`statuses`: Trajectory.ending, scored or not), the first error of one that was not, and the same by split
    (`heldout`, `heldout_templates`: see env/registry.py). An episode that could not be played out counts in no
    rate: it is neither a success nor a failure of the policy."""

    success: float
    n: int
    stderr: float
    statuses: dict[str, int]
    splits: dict[str, Score] = field(default_factory=dict)
    first_error: str | None = None

    @property
    def unscored(self) -> dict[str, int]:
        """The endings of episodes that were not scored, by how they ended."""
        return {k: v for k, v in self.statuses.items() if k not in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalRecord:
        """The inverse of dataclasses.asdict (a record saved in a checkpoint)."""
        fields = dict(d)
        fields["splits"] = {k: Score(**v) for k, v in d.get("splits", {}).items()}
        return cls(**fields)


@dataclass(slots=True, kw_only=True)
class Evaluation:
    """An evaluation's score and its episodes (stored apart from training's: runtime/driver.py)."""

    record: EvalRecord
    episodes: list[Trajectory]
