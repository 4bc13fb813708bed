"""What every run's ledger and store must satisfy after crashes and resumes (shared by the local
SIGKILL test and the Ray tests)."""

from __future__ import annotations

from pathlib import Path

from loomrl.store import read_trajectories
from loomrl.trainer.service import read_ledger


def check_each_trajectory_once(run_dir: Path, steps: int) -> tuple[list[str], list[str], dict[str, dict]]:
    """Each step once, no trajectory trained or consumed twice, everything the ledger names is in the
    store, no data position consumed twice. Returns (trained ids, consumed ids, stored rows by id)."""
    ledger = read_ledger(run_dir)
    assert [e["step"] for e in ledger] == list(range(1, steps + 1))
    trained = [t for e in ledger for t in e["trained"]]
    consumed = trained + [t for e in ledger for ids in e["skipped"].values() for t in ids] + \
        [t for e in ledger for t in e["stale"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert len(consumed) == len(set(consumed)), "a trajectory was consumed twice"
    stored = {r["trajectory_id"]: r for r in read_trajectories(run_dir / "trajectories").to_pylist()}
    assert set(consumed) <= set(stored), "the ledger names trajectories the store lost"
    by_position: dict[int, set[str]] = {}
    for t in consumed:
        by_position.setdefault(stored[t]["position"], set()).add(stored[t]["group_id"])
    assert all(len(g) == 1 for g in by_position.values()), "a data position was consumed twice"
    return trained, consumed, stored
