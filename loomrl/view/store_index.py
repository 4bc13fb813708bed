"""StoreIndex: the trajectory store (store/trajectory_store.py) as the viewer reads it, never whole.

What it is: per part file, a small index (ids, group, task, status, reward, versions: a few narrow columns, read by
column) cached against the file's mtime and size, so that a live run's new parts are picked up and old ones are not
read again; one trajectory is read from the one row group that holds it, every column of that row group only; a web episode's
screenshots are files beside the parts (loomrl/store/screenshots.py), served one at a time.
What it is not: a query engine (filters run over the index in Python) or a writer (parts are never rewritten).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from loomrl.store.schema import plain_row
from loomrl.store.screenshots import screenshot_path
from loomrl.types import REWARD_FAILED

# What a group card and the filters need; the wide columns (tokens, turns, segments) stay on disk until opened.
INDEX_COLUMNS = ["trajectory_id", "group_id", "task_id", "split", "status", "total_reward", "reward_components",
                 "position", "policy_version_min", "policy_version_max", "n_turns", "total_tokens", "error"]


@dataclass(slots=True, frozen=True, kw_only=True)
class IndexRow:
    """One trajectory as the index knows it."""

    trajectory_id: str
    group_id: str
    task_id: str
    split: str
    status: str  # as stored: a trajectory whose reward failed was played out, so it is stored `completed`
    # How it ended as the viewer shows and filters it: its status, or "reward_failed" when its reward could not be
    # computed (reward/pool.py marks that with a `reward_failed` component, which is no reward term)
    ending: str
    total_reward: float | None  # None: not scored (unscored status or failed reward)
    terms: dict[str, float]  # its reward terms, without the reward_failed marker
    position: int
    policy_version_min: int
    policy_version_max: int
    n_turns: int
    total_tokens: int
    error: str | None
    part: Path  # the part file that holds it
    row_group: int
    row_in_group: int


@dataclass(slots=True, frozen=True, kw_only=True)
class PartIndex:
    path: Path
    stamp: tuple[int, int]  # (mtime_ns, size): a part is never rewritten, but a run folder may be replaced
    rows: list[IndexRow]


def _read_index(path: Path, stamp: tuple[int, int]) -> PartIndex:
    f = pq.ParquetFile(path)
    present = set(f.schema_arrow.names)  # parts of an older version may lack newer columns: they read as nulls
    columns = [c for c in INDEX_COLUMNS if c in present]
    rows: list[IndexRow] = []
    for g in range(f.num_row_groups):
        table = f.read_row_group(g, columns=columns)
        cols = {c: table.column(c).to_pylist() if c in present else [None] * table.num_rows for c in INDEX_COLUMNS}
        for i in range(table.num_rows):
            terms = reward_terms(cols["reward_components"][i])
            status = cols["status"][i] or ""
            rows.append(IndexRow(
                trajectory_id=cols["trajectory_id"][i], group_id=cols["group_id"][i] or "", task_id=cols["task_id"][i] or "",
                split=cols["split"][i] or "", status=status,
                ending=REWARD_FAILED if terms.pop(REWARD_FAILED, None) is not None else status,
                total_reward=cols["total_reward"][i], terms=terms, position=_int(cols["position"][i]),
                policy_version_min=_int(cols["policy_version_min"][i]),
                policy_version_max=_int(cols["policy_version_max"][i]), n_turns=_int(cols["n_turns"][i], 0),
                total_tokens=_int(cols["total_tokens"][i], 0), error=cols["error"][i], part=path, row_group=g,
                row_in_group=i))
    return PartIndex(path=path, stamp=stamp, rows=rows)


def reward_terms(value: Any) -> dict[str, float]:
    """A stored `reward_components` as a dict: a list of (name, value) pairs (how pyarrow gives the store's map
    column), a mapping, or a JSON string (parts written before the column was nested)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = json.loads(value or "{}")
    items = value.items() if isinstance(value, dict) else value
    return {str(k): v for k, v in items if v is not None}


def _int(value: int | None, default: int = -1) -> int:
    return default if value is None else int(value)


class StoreIndex:
    """The index of one store folder (RUN/trajectories or RUN/evaluations/<label>); thread-safe, refreshed on read."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._parts: dict[Path, PartIndex] = {}
        self._rows: list[IndexRow] = []
        self._by_id: dict[str, IndexRow] = {}
        self._order: list[Path] = []
        self._lock = threading.Lock()

    def rows(self) -> list[IndexRow]:
        """Every stored trajectory, in store order, re-indexing only parts that are new or changed."""
        with self._lock:
            paths = sorted(self.root.glob("part-*.parquet"))  # `.tmp` files are parts being written: not yet
            stamps = {p: _stamp(p) for p in paths}
            if paths == self._order and all(self._parts[p].stamp == stamps[p] for p in paths):
                return self._rows
            parts = {}
            for p in paths:
                old = self._parts.get(p)
                parts[p] = old if old is not None and old.stamp == stamps[p] else _read_index(p, stamps[p])
            self._parts, self._order = parts, paths
            self._rows = [r for p in paths for r in parts[p].rows]
            self._by_id = {r.trajectory_id: r for r in self._rows}
            return self._rows

    def get(self, trajectory_id: str) -> IndexRow | None:
        self.rows()
        return self._by_id.get(trajectory_id)

    def read(self, trajectory_id: str) -> dict[str, Any] | None:
        """Every column of one trajectory (turns, reward_components, segments parsed), or None if not stored."""
        row = self.get(trajectory_id)
        if row is None:
            return None
        table = pq.ParquetFile(row.part).read_row_group(row.row_group)
        return plain_row(table.slice(row.row_in_group, 1).to_pylist()[0])  # nested, or an older part's JSON

    def screenshot(self, trajectory_id: str, index: int) -> Path | None:
        """The file of one stored screenshot of a stored trajectory (loomrl/store/screenshots.py), or None."""
        if self.get(trajectory_id) is None or index < 0:
            return None
        path = screenshot_path(self.root, trajectory_id, index)
        return path if path.is_file() else None


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return (st.st_mtime_ns, st.st_size)

