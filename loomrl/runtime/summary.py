"""The run's summary: one record per segment (the first `loomrl train` and each `--resume`), and `summary.json`, which
covers the whole run.

A segment ends `finished` (trained to trainer.total_steps and evaluated), `stopped: <why>` (a RunError) or
`interrupted` (Ctrl-C, SIGTERM, a crash); each appends its record to `segments.jsonl` in the run folder, whatever
the ending. `summary.json` (run_folder.Summary) is rewritten at the end of every segment from all of them:
- held-out success before (restored from the checkpoint when resumed) and after (the last segment's evaluation);
- `steps`: the policy version reached; `ledger`: what the model consumed over the whole run (ledger.jsonl);
- summed over segments: wall time, episodes (`rollouts`, training and evaluation apart: `launched`, and `ended` by
  status, which sums to launched; beside that sum `among_ended`, ended episodes counted again by a trait
  (reward_failed), and `retried_attempts`, attempts, not episodes: rollout/worker.py EpisodeCounts), trainer
  restarts, steps that trained nothing (`untrained_steps`: steps, where the ledger counts trajectories), the sandbox
  pools' counters, and `accounting`: each segment settles the trajectories it launched (launched = trained + skipped
  + stale + discarded + unconsumed + failed + cancelled, accounting.py), so the sum holds the same identity; a
  trajectory left buffered by one segment and trained by the next counts as unconsumed where it was launched;
- `ledger`: trajectories the model consumed (trained, skipped by reason, stale) over `steps` steps;
- `segments`: each segment's steps, ending, wall time and accounting.

What it is not: the per-step history (metrics.jsonl) or the per-trajectory one (the trajectory store, the ledger).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loomrl.run_folder import (
    Fates,
    LedgerEntry,
    LedgerTotals,
    RunFolder,
    Segment,
    SegmentBrief,
    Summary,
    append_line,
    read_segments,
    read_summary,
)
from loomrl.types import EvalRecord

FINISHED = "finished"


def append_segment(run_dir: Path, segment: Segment) -> list[Segment]:
    """Record a segment; every segment of the run so far, this one last."""
    append_line(RunFolder(run_dir).segments, segment)
    return read_segments(run_dir)


def finished_at(run_dir: Path) -> int | None:
    """The step a run finished at (its last segment trained to its total and was evaluated), or None."""
    segments = read_segments(run_dir)
    if segments:
        return segments[-1].to_step if segments[-1].ended == FINISHED else None
    legacy = read_summary(run_dir)  # a run from before segments were recorded: it wrote this on finishing
    return legacy.steps if legacy is not None else None


def split_summary(before: EvalRecord | None, after: EvalRecord | None) -> dict[str, dict[str, float | int | None]]:
    """Before and after scores of each held-out split (None where none of its episodes was scored)."""
    out: dict[str, dict[str, float | int | None]] = {}
    for label, record in (("before", before), ("after", after)):
        for split, score in (record.splits if record else {}).items():
            row = out.setdefault(split, {"n": score.n, "success_before": None, "stderr_before": None,
                                         "success_after": None, "stderr_after": None})
            if score.n:
                row[f"success_{label}"], row[f"stderr_{label}"] = round(score.success, 4), round(score.stderr, 4)
    return out


def _add(into: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Counters summed (nested ones too); `*_max` fields take the larger; lists joined."""
    for k, v in values.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        elif isinstance(v, list):
            into[k] = [*into.get(k, []), *v]
        elif k.endswith("_max"):
            into[k] = max(into.get(k, v), v)
        else:
            into[k] = into.get(k, 0) + v
    return into


def ledger_totals(ledger: Sequence[LedgerEntry]) -> LedgerTotals:
    """What the model consumed over the whole run: trajectories trained, skipped by reason, dropped as stale."""
    skipped: dict[str, int] = {}
    for entry in ledger:
        _add(skipped, {reason: len(ids) for reason, ids in entry.skipped.items()})
    return LedgerTotals(steps=len(ledger), trained=sum(len(e.trained) for e in ledger), skipped=skipped,
                        stale=sum(len(e.stale) for e in ledger))


def whole_run(run_dir: Path, segments: list[Segment], before: EvalRecord | None, after: EvalRecord | None,
              steps: int, ledger: Sequence[LedgerEntry]) -> Summary:
    """summary.json: the run over all its segments (module docstring)."""
    last = segments[-1]
    latest = after or before  # n_heldout: the latest evaluation's count
    named = [replace(seg.accounting, violations=[f"segment {i + 1}: {v}" for v in seg.accounting.violations])
             for i, seg in enumerate(segments)]  # each violation names its segment
    accounting = Fates.total(named)
    env_pool: dict[str, float] = {}
    rollouts: dict[str, dict[str, Any]] = {}
    for seg in segments:
        _add(env_pool, seg.env_pool)
        _add(rollouts, seg.rollouts)
    return Summary(
        success_before=before.success if before else None, success_after=after.success if after else None,
        n_heldout=latest.n if latest is not None else 0,
        stderr_before=before.stderr if before else None, stderr_after=after.stderr if after else None,
        # by held-out split (heldout: new numbers on training templates; heldout_templates: templates training never
        # used)
        heldout_splits=split_summary(before, after),
        # how the held-out episodes ended (EvalRecord.statuses): only completed and truncated ones count in a rate
        eval_ended={label: r.statuses for label, r in (("before", before), ("after", after)) if r is not None},
        steps=steps, ended=last.ended, run_dir=str(run_dir),
        wall_s=round(sum(s.wall_s for s in segments), 1),
        rollouts=rollouts,
        ledger=ledger_totals(ledger),  # trajectories, over its `steps` steps
        accounting=accounting,
        trainer_restarts=sum(s.trainer_restarts for s in segments),
        untrained_steps=sum(s.untrained_steps for s in segments),  # steps (every group left out)
        positions_failed=last.positions_failed,  # earlier segments' failed positions ran again on resume
        env_pool={k: round(v, 4) if isinstance(v, float) else v for k, v in env_pool.items()},
        segments=[SegmentBrief(from_step=s.from_step, to_step=s.to_step, ended=s.ended, wall_s=s.wall_s,
                               accounting=s.accounting) for s in segments],
        extra=last.extra,
    )
