"""RunReader: one run folder as the viewer follows it, while the run writes it and after (its names and records:
loomrl/run_folder.py).

What it reads: metrics.jsonl (from a byte offset: only the lines appended since the last read), ledger.jsonl (which
step trained each trajectory, or why it was left out), train_records.jsonl (per trajectory trained, its advantages
and logprob gaps as the trainer had them: trainer/records.py), groups.jsonl (each group's lifecycle,
runtime/group_log.py), summary.json, config.yaml, and the trajectory stores (store_index.py). Every file may be missing or growing: a run
that has just started has none of them, a live one appends; a line still being written (no newline yet) waits for
the next read.
What it is not: a reader of the trainer's state (checkpoints) or a writer of anything.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loomrl.run_folder import CONFIG, METRICS, TRAJECTORIES, LedgerEntry, RunFolder
from loomrl.view.store_index import StoreIndex

TRAINING_STORE = TRAJECTORIES


class RunFolderError(ValueError):
    """A path given to `loomrl view` is not a run folder; the message says what it should hold."""


@dataclass(slots=True, frozen=True, kw_only=True)
class Fate:
    """What the trainer did with one trajectory (ledger.jsonl): trained at `step`, or left out there and why."""

    step: int
    fate: str  # trained | skipped | stale
    reason: str = ""  # skipped: the filter's reason (zero_variance, incomplete, balance, ...)


class JsonLines:
    """An append-only JSON-lines file read incrementally: each read parses only the complete lines added since."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            if not self.path.is_file():
                return self.records
            st = self.path.stat()
            if st.st_size < self._offset:  # rewritten shorter (a resume cut the ledger): read it anew
                self.records, self._offset = [], 0
            if (st.st_mtime_ns, st.st_size) != self._stamp:
                with self.path.open("rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
                end = chunk.rfind(b"\n") + 1  # a last line without its newline is still being written
                self.records.extend(json.loads(line) for line in chunk[:end].splitlines() if line.strip())
                self._offset += end
                self._stamp = (st.st_mtime_ns, self._offset) if end < len(chunk) else (st.st_mtime_ns, st.st_size)
            return self.records


class RunReader:
    """One run folder: its name, metrics, ledger, group events and stores, each read as it grows."""

    def __init__(self, path: Path):
        self.folder = RunFolder(Path(path))
        self.path = self.folder.path
        if not self.path.is_dir():
            raise RunFolderError(f"loomrl view: '{path}' is not a folder; give a run folder (output_dir/name, the "
                                 f"one holding {CONFIG} and {METRICS})")
        if not self.folder.config.is_file() and not self.folder.metrics.is_file():
            raise RunFolderError(f"loomrl view: '{path}' has no {CONFIG} or {METRICS}; give a run folder "
                                 "(output_dir/name), not its parent or a checkpoint")
        self.name = self.path.name
        self.metrics = JsonLines(self.folder.metrics)
        self.ledger = JsonLines(self.folder.ledger)
        self.group_events = JsonLines(self.folder.groups)
        self.train_records = JsonLines(self.folder.train_records)
        self._stores: dict[str, StoreIndex] = {}
        self._fates: dict[str, Fate] = {}
        self._ledger_seen = 0
        self._records: dict[str, dict[str, Any]] = {}
        self._records_seen = 0
        self._lock = threading.Lock()  # the app answers requests on a thread pool

    def config(self) -> dict[str, Any]:
        path = self.folder.config
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}

    def summary(self) -> dict[str, Any] | None:
        """summary.json: written when a segment of the run ends (None: the run has not ended yet)."""
        path = self.folder.summary
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except json.JSONDecodeError:  # being rewritten right now
            return None

    def live(self) -> bool:
        """Whether the run is (as far as its folder says) still training: no summary.json yet, or metrics written
        after it (a resumed run)."""
        summary, metrics = self.folder.summary, self.folder.metrics
        if not summary.is_file():
            return True
        return metrics.is_file() and metrics.stat().st_mtime > summary.stat().st_mtime

    def store_names(self) -> list[str]:
        """The stores: the training rollouts, then each evaluation (evaluations/<label>-step<N>)."""
        return self.folder.store_names()

    def store(self, name: str = TRAINING_STORE) -> StoreIndex:
        if name not in self._stores:
            if name not in self.store_names():
                raise RunFolderError(f"run {self.name}: no trajectory store '{name}'; it has {self.store_names()}")
            self._stores[name] = StoreIndex(self.folder.store(name))
        return self._stores[name]

    def steps(self) -> list[LedgerEntry]:
        """The ledger's lines so far, one per step trained."""
        return [LedgerEntry.from_json(line) for line in self.ledger.read()]

    def fates(self) -> dict[str, Fate]:
        """trajectory_id -> what the trainer did with it, from the ledger (read incrementally)."""
        with self._lock:
            ledger = self.ledger.read()
            if len(ledger) < self._ledger_seen:  # cut by a resume: joined anew
                self._fates, self._ledger_seen = {}, 0
            for entry in map(LedgerEntry.from_json, ledger[self._ledger_seen:]):
                step = entry.step
                for tid in entry.trained:
                    self._fates[tid] = Fate(step=step, fate="trained")
                for reason, ids in entry.skipped.items():
                    for tid in ids:
                        self._fates[tid] = Fate(step=step, fate="skipped", reason=reason)
                for tid in entry.stale:
                    self._fates[tid] = Fate(step=step, fate="stale", reason="older than buffer.max_policy_lag allows")
            self._ledger_seen = len(ledger)
            return self._fates

    def records(self) -> dict[str, dict[str, Any]]:
        """trajectory_id -> its train record (trainer/records.py: step, advantages per turn, gaps per context); empty
        for a run from before they were written."""
        with self._lock:
            records = self.train_records.read()
            if len(records) < self._records_seen:  # cut by a resume: joined anew
                self._records, self._records_seen = {}, 0
            for r in records[self._records_seen:]:
                self._records[r["trajectory_id"]] = r
            self._records_seen = len(records)
            return self._records
