"""Train records: what one step did to each trajectory it trained, as the run viewer shows it (loomrl/view/).

RUN/train_records.jsonl holds one line per trajectory trained: the step (the ledger's, ledger.jsonl), the advantage
each of its turns' sampled tokens carried in the loss (after credit assignment, trainer/credit.py, and the lag decay;
None for a turn with no sampled token or a context the balance filter left out), and per context (Trajectory.contexts
order: earlier segments first) the |trainer - engine| logprob gap of each loss-masked token (StepStats.gaps; None for
a context not trained, or trained on a data-parallel rank that did not report it), rounded to 4 decimals.
What it is not: a copy of the trajectory (the store has its tokens) or of the step's metrics (metrics.jsonl). Like the
ledger it is cut back to the checkpoint's step on resume, so that it describes what the saved model has seen.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from loomrl.run_folder import RunFolder
from loomrl.types import TrainingSample, Trajectory

GAP_DECIMALS = 4  # 1e-4 nats: below what a colour shows, and it keeps a line short


@dataclass(slots=True, kw_only=True)
class TrainRecord:
    step: int
    trajectory_id: str
    advantages: list[float | None]  # per turn (Trajectory.all_turns order), as the loss used it
    gaps: list[list[float] | None]  # per context, per loss-masked token


def train_records(step: int, trajectories: list[Trajectory], samples: list[TrainingSample],
                  gaps: list[list[float] | None]) -> list[TrainRecord]:
    """The records of `trajectories` trained at `step` on `samples` (gaps[i]: samples[i]'s, StepStats.gaps; empty: the
    trainer reported none, and the records have advantages only)."""
    gaps = gaps or [None] * len(samples)
    if len(gaps) != len(samples):
        raise ValueError(f"train_records: {len(gaps)} gap lists for {len(samples)} samples")
    by_traj: dict[str, list[tuple[TrainingSample, list[float] | None]]] = {}
    for s, g in zip(samples, gaps):
        by_traj.setdefault(s.trajectory_id, []).append((s, g))
    out = []
    for traj in trajectories:
        left = by_traj.get(traj.trajectory_id, [])
        if not left:
            continue  # left out after all (balance filter)
        advantages: list[float | None] = []
        ctx_gaps: list[list[float] | None] = []
        for ctx in traj.contexts():
            # a context's sample is the next one with its tokens (samples keep context order; balance may drop some)
            k = next((k for k, (s, _) in enumerate(left) if s.token_ids == ctx.token_ids), None)
            sample, gap = left.pop(k) if k is not None else (None, None)
            for turn in ctx.turns:
                span = turn.act_span
                trained = sample is not None and span is not None and span.end > span.start
                advantages.append(float(sample.advantages[span.start]) if trained else None)
            ctx_gaps.append(None if gap is None or sample is None else [round(x, GAP_DECIMALS) for x in gap])
        out.append(TrainRecord(step=step, trajectory_id=traj.trajectory_id, advantages=advantages, gaps=ctx_gaps))
    return out


def append_records(run_dir: Path, records: list[TrainRecord]) -> None:
    with RunFolder(run_dir).train_records.open("a") as f:
        f.write("".join(json.dumps(asdict(r)) + "\n" for r in records))


def cut_records(run_dir: Path, step: int | None) -> None:
    """Keep the records of steps <= `step` (None: none): a resume from that checkpoint, or a restart without one."""
    cut_to_step(RunFolder(run_dir).train_records, step)


def cut_to_step(path: Path, step: int | None) -> None:
    """A step-keyed JSONL file (these records, the ledger) cut back to the lines of steps <= `step`; None removes it.
    A last line torn by a kill goes too (its step is after any checkpoint: the lines are written before it)."""
    if not path.is_file():
        return
    if step is None:
        path.unlink()
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n") and json.loads(line)["step"] <= step:
            kept.append(line)
    path.write_text("".join(kept))
