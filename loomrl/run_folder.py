"""The run folder (output_dir/name): every name inside it, and the typed records its JSON-lines files hold.

Layout, as the writers make it (each writer and reader takes its path from here):

    config.yaml            the resolved config the run last ran with (runtime/run.py)
    metrics.jsonl          one record per step and evaluation (metrics/jsonl.py)
    ledger.jsonl           per step, every trajectory it consumed, by fate: LedgerEntry (train_pool/service.py)
    train_records.jsonl    per trajectory trained, its advantages and logprob gaps (trainer/records.py)
    groups.jsonl           per group attempt that ended, its lifecycle (runtime/group_log.py)
    segments.jsonl         per `loomrl train` / `--resume`, what it did: Segment (runtime/summary.py)
    summary.json           the whole run over its segments (runtime/summary.py whole_run, written by the driver)
    trajectories/          the training rollouts' trajectory store (store/)
    evaluations/<label>-step<N>/   each held-out evaluation's store
    checkpoints/step_NNNNNN/{model/, optimizer.pt, optimizer/, state.pt}, checkpoints/latest (trainer/checkpoint.py)
    tensorboard/           TensorBoard event files (metrics/tensorboard.py)
    wandb_run_id           the W&B run a resume logs to (metrics/wandb.py; wandb/ itself is W&B's own folder)
    weights/               the file weight transport's published versions (train_pool/process.py)

Records: LedgerEntry (a line of ledger.jsonl), Segment (a line of segments.jsonl, its accounting Fates) and Summary
(summary.json), each read back into its type and written from it; the JSON on disk is `asdict(record)`, keys in
field order, as it always was, so old run folders read as they did.
What it is not: a writer of any of these files' contents beyond a record's line, or a reader of checkpoints' tensors
(trainer/checkpoint.py). It imports nothing of loomrl: every layer may use it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LEDGER = "ledger.jsonl"
TRAIN_RECORDS = "train_records.jsonl"
GROUPS = "groups.jsonl"
SEGMENTS = "segments.jsonl"
SUMMARY = "summary.json"
TRAJECTORIES = "trajectories"  # the training store; also its name among the viewer's stores
EVALUATIONS = "evaluations"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
WANDB_RUN_ID = "wandb_run_id"
WEIGHTS = "weights"

# inside checkpoints/
LATEST = "latest"  # names the newest complete checkpoint folder
LATEST_TMP = "latest.tmp"  # written, then renamed over LATEST
STEP_PREFIX = "step_"
TMP_STEP_PREFIX = ".tmp_step_"  # a checkpoint being written (renamed into place when complete)
# inside one checkpoint
MODEL = "model"  # an HF model folder (config, safetensors, tokenizer)
OPTIMIZER = "optimizer.pt"  # the scheduler, and the whole optimizer state of an unsharded trainer
OPTIMIZER_SHARDS = "optimizer"  # a sharded trainer's optimizer state, each rank its part
STATE = "state.pt"  # step, RNG states, the runtime's state (buffer, positions, ledger facts)


@dataclass(slots=True, frozen=True)
class CheckpointFolder:
    """One checkpoint: RUN/checkpoints/step_NNNNNN (or any folder laid out as one)."""

    path: Path

    @property
    def model(self) -> Path:
        return self.path / MODEL

    @property
    def optimizer(self) -> Path:
        return self.path / OPTIMIZER

    @property
    def optimizer_shards(self) -> Path:
        return self.path / OPTIMIZER_SHARDS

    @property
    def state(self) -> Path:
        return self.path / STATE

    @property
    def step(self) -> int:
        """The step it was saved at, from its name."""
        return int(self.path.name.removeprefix(STEP_PREFIX))


@dataclass(slots=True, frozen=True)
class RunFolder:
    """The paths of one run folder (module docstring); building one touches no file."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def ledger(self) -> Path:
        return self.path / LEDGER

    @property
    def train_records(self) -> Path:
        return self.path / TRAIN_RECORDS

    @property
    def groups(self) -> Path:
        return self.path / GROUPS

    @property
    def segments(self) -> Path:
        return self.path / SEGMENTS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def trajectories(self) -> Path:
        return self.path / TRAJECTORIES

    @property
    def evaluations(self) -> Path:
        return self.path / EVALUATIONS

    def evaluation(self, label: str, step: int) -> Path:
        """The store of the held-out evaluation `label` (before, after) taken at `step`."""
        return self.evaluations / f"{label}-step{step}"

    def store(self, name: str) -> Path:
        """A store by the name the viewer lists it under: TRAJECTORIES, or evaluations/<label>-step<N>."""
        return self.path / name

    def store_names(self) -> list[str]:
        """The stores: the training rollouts, then each evaluation, by name (store())."""
        evals = sorted(p.name for p in self.evaluations.glob("*") if p.is_dir())
        return [TRAJECTORIES, *(f"{EVALUATIONS}/{e}" for e in evals)]

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint(self, step: int) -> CheckpointFolder:
        return CheckpointFolder(self.checkpoints / f"{STEP_PREFIX}{step:06d}")

    def checkpoint_in_progress(self, step: int) -> CheckpointFolder:
        """Where the checkpoint of `step` is written before it is renamed into place."""
        return CheckpointFolder(self.checkpoints / f"{TMP_STEP_PREFIX}{step:06d}")

    def saved_checkpoints(self) -> list[CheckpointFolder]:
        """Every complete checkpoint folder, oldest first."""
        return [CheckpointFolder(p) for p in sorted(self.checkpoints.glob(f"{STEP_PREFIX}*"))]

    @property
    def latest(self) -> Path:
        """The file naming the newest complete checkpoint."""
        return self.checkpoints / LATEST

    @property
    def latest_tmp(self) -> Path:
        return self.checkpoints / LATEST_TMP

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def wandb_run_id(self) -> Path:
        return self.path / WANDB_RUN_ID

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_line(path: Path, record: LedgerEntry | Segment) -> None:
    """Append a record as one JSON line: its fields in order."""
    with path.open("a") as f:
        f.write(json.dumps(asdict(record)) + "\n")


@dataclass(slots=True, kw_only=True)
class LedgerEntry:
    """One line of RUN/ledger.jsonl: every trajectory a step consumed, by fate."""

    step: int
    trained: list[str]
    skipped: dict[str, list[str]]  # reason (the filter's: zero_variance, incomplete, balance, ...) -> ids
    stale: list[str]

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> LedgerEntry:
        return cls(step=line["step"], trained=line.get("trained", []), skipped=line.get("skipped", {}),
                   stale=line.get("stale", []))


def read_ledger(run_dir: Path) -> list[LedgerEntry]:
    return [LedgerEntry.from_json(line) for line in read_json_lines(RunFolder(run_dir).ledger)]


@dataclass(slots=True, frozen=True, kw_only=True)
class Fates:
    """The trajectories a segment launched, each by the one fate it met (runtime/accounting.py):
    launched = trained + skipped + stale + discarded + unconsumed + failed + cancelled; `violations` names what breaks
    that (a trajectory with two fates, or a sum that does not hold)."""

    launched: int = 0
    trained: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # by the filter's reason
    stale: int = 0
    discarded: dict[str, int] = field(default_factory=dict)  # by reason (e.g. trainer_restart)
    unconsumed: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by reason (e.g. actor_died)
    cancelled: int = 0
    violations: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fates:
        """A segment's line (a fate it does not name counts 0)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def total(cls, parts: list[Fates]) -> Fates:
        """Each fate summed over `parts` (by reason, reasons in the order they first appear); violations joined."""

        def by_reason(of: list[dict[str, int]]) -> dict[str, int]:
            out: dict[str, int] = {}
            for counts in of:
                for reason, n in counts.items():
                    out[reason] = out.get(reason, 0) + n
            return out

        return cls(launched=sum(p.launched for p in parts), trained=sum(p.trained for p in parts),
                   skipped=by_reason([p.skipped for p in parts]), stale=sum(p.stale for p in parts),
                   discarded=by_reason([p.discarded for p in parts]), unconsumed=sum(p.unconsumed for p in parts),
                   failed=by_reason([p.failed for p in parts]), cancelled=sum(p.cancelled for p in parts),
                   violations=[v for p in parts for v in p.violations])


@dataclass(slots=True, kw_only=True)
class Segment:
    """What one `loomrl train` (or `--resume`) did, from the step it started at to the one it reached (a line of
    RUN/segments.jsonl)."""

    from_step: int
    to_step: int
    ended: str  # "finished", "stopped: <why>" or "interrupted"
    wall_s: float
    rollouts: dict[str, dict[str, Any]]  # episodes by purpose (training, evaluation): EpisodeCounts.as_dict
    trainer_restarts: int
    untrained_steps: int  # steps that took no gradient (every group left out)
    positions_failed: dict[str, str]  # position -> why it was given up
    env_pool: dict[str, float]
    accounting: Fates  # runtime/accounting.py Accounting.settle: the trajectories this segment launched
    extra: dict[str, Any]  # the backend's own section (e.g. "ray": restarts, placement)

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> Segment:
        fields = dict(line)
        accounting = Fates.from_json(fields.pop("accounting", {}))
        segment = cls(**fields, accounting=accounting)
        segment.rollouts = {purpose: episode_counts(c) for purpose, c in segment.rollouts.items()}
        return segment


def episode_counts(counts: dict[str, Any]) -> dict[str, Any]:
    """A segment's episode counts as EpisodeCounts.as_dict gives them; a segment recorded before they were grouped
    kept them in one flat dict, with "reward_failed" and "retried:<status>" beside the endings."""
    if "ended" in counts:
        return counts
    ended = {k: v for k, v in counts.items() if k not in ("launched", "reward_failed") and not k.startswith("retried:")}
    return {"launched": counts.get("launched", 0), "ended": ended,
            "among_ended": {k: counts[k] for k in ("reward_failed",) if k in counts},
            "retried_attempts": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("retried:")}}


def read_segments(run_dir: Path) -> list[Segment]:
    return [Segment.from_json(line) for line in read_json_lines(RunFolder(run_dir).segments)]


@dataclass(slots=True, frozen=True, kw_only=True)
class LedgerTotals:
    """What the model consumed over the whole run (ledger.jsonl): trajectories trained, skipped by reason, dropped as
    stale, over `steps` steps."""

    steps: int = 0
    trained: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    stale: int = 0


@dataclass(slots=True, frozen=True, kw_only=True)
class SegmentBrief:
    """A segment as summary.json lists it: its steps, ending, wall time and accounting."""

    from_step: int
    to_step: int
    ended: str
    wall_s: float
    accounting: Fates

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SegmentBrief:
        return cls(from_step=d["from_step"], to_step=d["to_step"], ended=d["ended"], wall_s=d["wall_s"],
                   accounting=Fates.from_json(d.get("accounting", {})))


@dataclass(slots=True, kw_only=True)
class Summary:
    """summary.json: the whole run over its segments (runtime/summary.py whole_run says what each field sums). On disk
    `as_json()`, `extra` (the backend's own sections, e.g. "ray") beside the fields; a summary written by an older
    loomrl may lack a field, which then reads as its default."""

    success_before: float | None = None
    success_after: float | None = None
    n_heldout: int = 0  # the latest evaluation's episodes
    stderr_before: float | None = None
    stderr_after: float | None = None
    # by held-out split: n, success_before, stderr_before, success_after, stderr_after
    heldout_splits: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    eval_ended: dict[str, dict[str, int]] = field(default_factory=dict)  # label -> EvalRecord.statuses
    steps: int = 0
    ended: str = ""
    run_dir: str = ""
    wall_s: float = 0.0
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # by purpose: EpisodeCounts.as_dict, summed
    ledger: LedgerTotals = field(default_factory=LedgerTotals)
    accounting: Fates = field(default_factory=Fates)  # summed over segments, violations named by segment
    trainer_restarts: int = 0
    untrained_steps: int = 0
    positions_failed: dict[str, str] = field(default_factory=dict)  # the last segment's
    env_pool: dict[str, float] = field(default_factory=dict)
    segments: list[SegmentBrief] = field(default_factory=list)
    # why a rerun with the same config and seed may differ (runtime/reproducibility.py); empty: exact by design
    not_reproducible: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The JSON of summary.json: the fields in order, then each of `extra`'s sections."""
        out = asdict(self)
        extra = out.pop("extra")
        return {**out, **extra}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        known = set(cls.__dataclass_fields__) - {"extra"}
        fields = {k: v for k, v in d.items() if k in known}
        fields["ledger"] = LedgerTotals(**d.get("ledger", {}))
        fields["accounting"] = Fates.from_json(d.get("accounting", {}))
        fields["segments"] = [SegmentBrief.from_json(s) for s in d.get("segments", [])]
        return cls(**fields, extra={k: v for k, v in d.items() if k not in known})


def write_summary(run_dir: Path, summary: Summary) -> None:
    RunFolder(run_dir).summary.write_text(json.dumps(summary.as_json(), indent=2))


def read_summary(run_dir: Path) -> Summary | None:
    """RUN/summary.json (None: no segment of the run has ended yet)."""
    path = RunFolder(run_dir).summary
    return Summary.from_json(json.loads(path.read_text())) if path.is_file() else None
