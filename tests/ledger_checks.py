"""What every run's ledger, store and accounting must satisfy after crashes and resumes (shared by the
local and the Ray tests)."""

from __future__ import annotations

import json
from pathlib import Path

from loomrl.run_folder import read_ledger
from loomrl.store import read_trajectories


def check_each_trajectory_once(run_dir: Path, steps: int) -> tuple[list[str], list[str], dict[str, dict]]:
    """Each step once, no trajectory trained or consumed twice, everything the ledger names is in the
    store, no data position consumed twice. Returns (trained ids, consumed ids, stored rows by id)."""
    ledger = read_ledger(run_dir)
    assert [e.step for e in ledger] == list(range(1, steps + 1))
    trained = [t for e in ledger for t in e.trained]
    consumed = trained + [t for e in ledger for ids in e.skipped.values() for t in ids] + \
        [t for e in ledger for t in e.stale]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert len(consumed) == len(set(consumed)), "a trajectory was consumed twice"
    stored = {r["trajectory_id"]: r for r in read_trajectories(run_dir / "trajectories").to_pylist()}
    assert set(consumed) <= set(stored), "the ledger names trajectories the store lost"
    by_position: dict[int, set[str]] = {}
    for t in consumed:
        by_position.setdefault(stored[t]["position"], set()).add(stored[t]["group_id"])
    assert all(len(g) == 1 for g in by_position.values()), "a data position was consumed twice"
    # train_records.jsonl (the viewer's) is cut with the ledger on every resume and restart: a line per trained one
    path = run_dir / "train_records.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    assert sorted((r["step"], r["trajectory_id"]) for r in records) == \
        sorted((e.step, t) for e in ledger for t in e.trained), "train_records.jsonl disagrees with the ledger"
    return trained, consumed, stored


def check_run(run_dir: Path, summary: dict, steps: int) -> dict:
    """What every run must satisfy, on either backend: each step once, no trajectory consumed twice,
    everything the ledger names is stored, and launched = the sum of the fates (summary.json
    accounting), every stored trajectory with exactly one."""
    trained, consumed, stored = check_each_trajectory_once(run_dir, steps)
    assert trained, "the parity reward gives groups variance, so something must have been trained"
    acc = summary["accounting"]
    assert acc["violations"] == []
    assert acc["trained"] == len(trained)
    assert acc["trained"] + sum(acc["skipped"].values()) + acc["stale"] == len(consumed)
    fates = (acc["trained"] + sum(acc["skipped"].values()) + acc["stale"] + sum(acc["discarded"].values())
             + acc["unconsumed"])
    assert fates == len(stored), "a stored trajectory has no fate (missing) or two"
    assert acc["launched"] == len(stored) + sum(acc["failed"].values()) + acc["cancelled"]
    return stored


def add_counts(rollouts: dict[str, dict]) -> dict:
    """summary.json's episode counts of training and evaluation together, in their shape (launched; ended, which
    sums to it; among_ended and retried_attempts beside that sum)."""
    out: dict = {"launched": 0, "ended": {}, "among_ended": {}, "retried_attempts": {}}
    for counts in rollouts.values():
        out["launched"] += counts["launched"]
        for group in ("ended", "among_ended", "retried_attempts"):
            for k, v in counts[group].items():
                out[group][k] = out[group].get(k, 0) + v
    return out
