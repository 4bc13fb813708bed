"""TrajectoryStore: every finished trajectory, one parquet row each, append-only.

A run keeps two kinds: training rollouts in `RUN/trajectories/`, evaluation episodes in `RUN/evaluations/<before|after>/`
(each row with its task's prompt, answer and split).

Rows are buffered and written as numbered part files (`part-000001.parquet`, ...), never rewritten,
so a crash loses at most the unflushed rows and readers (`pyarrow.dataset`, `pandas.read_parquet` on
the folder) always see complete files. Turns, reward components and earlier contexts are nested columns that
pandas, polars and DuckDB read as they are (their types: schema.py); token ids, the loss mask and logprobs are list
columns, for replay and export. A trajectory whose context was started anew keeps its earlier contexts in the
`segments` column. With router replay, each context's routed experts are a binary column (schema.py ROUTED:
layers x top_k bytes a token). Parts written before those columns were nested hold them as JSON strings: `read_trajectories`
reads them in the nested types, so a run folder holding both kinds (an old run resumed) reads as one table.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loomrl.store.schema import NESTED, ROUTED, routed_column, turns_column, upgrade
from loomrl.store.screenshots import stored_env_record
from loomrl.turn_experts import context_experts
from loomrl.types import Trajectory

# Columns copied from the trajectory, and from its metadata, as they are.
_PLAIN = [("trajectory_id", pa.string()), ("task_id", pa.string()), ("group_id", pa.string()),
          ("position", pa.int64()), ("prompt", pa.string()), ("answer", pa.string()), ("split", pa.string()),
          ("error", pa.string()), ("total_reward", pa.float64()),
          ("final_answer", pa.string()), ("temperature", pa.float64()), ("token_ids", pa.list_(pa.int32()))]
_METADATA = [("env_version", pa.string()), ("total_steps", pa.int32()), ("total_tokens", pa.int32()),
             ("wall_time", pa.float64()), ("truncated", pa.bool_()), ("env_errors", pa.int32()),
             ("policy_version_min", pa.int32()), ("policy_version_max", pa.int32()), ("attempts", pa.int32()),
             ("reset_s", pa.float64()), ("reward_s", pa.float64())]
SCHEMA = pa.schema([
    *_PLAIN, *_METADATA,
    ("status", pa.string()),
    ("reward_components", NESTED["reward_components"]),  # term -> raw value
    ("n_turns", pa.int32()),
    ("turns", NESTED["turns"]),
    ("prompt_len", pa.int32()),
    ("loss_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float32())),
    ("versions", pa.list_(pa.int32())),
    ("retry_errors", NESTED["retry_errors"]),  # why each earlier (retried) attempt failed
    ("segments", NESTED["segments"]),  # earlier contexts: reason, prompt_len, token_ids, loss_mask, logprobs, ...
    ("routed_experts", ROUTED),  # the engine's routed experts of token_ids (router replay); null: none recorded
    ("segment_routed_experts", pa.list_(ROUTED)),  # ... of each segment's token_ids
    # what the environment recorded (Trajectory.env_record) as JSON, its screenshots as files (store/screenshots.py)
    ("env_record", pa.string()),
])  # fmt: skip


def _tokens(ctx) -> dict:
    """The per-token columns of one context (the trajectory's current one, or a closed segment)."""
    return {"prompt_len": len(ctx.prompt_ids), "loss_mask": ctx.sampled_mask(), "logprobs": ctx.token_logprobs(),
            "versions": ctx.token_versions(), "token_ids": ctx.token_ids}


def _row(t: Trajectory, root: Path) -> dict:
    return {
        **{name: getattr(t, name) for name, _ in _PLAIN},
        "total_reward": t.total_reward if t.scored else None,  # not played out, or its reward failed: no reward
        **{name: getattr(t.metadata, name) for name, _ in _METADATA},
        **_tokens(t),
        "status": str(t.status),
        "reward_components": list(t.reward_components.items()),
        "n_turns": len(t.all_turns()),
        "turns": turns_column(t.turns),
        "retry_errors": list(t.metadata.retry_errors),
        "segments": [{"reason": seg.reason, **_tokens(seg), "turns": turns_column(seg.turns)} for seg in t.segments],
        "routed_experts": routed_column(context_experts(t.turns, len(t.token_ids))),
        "segment_routed_experts": [routed_column(context_experts(s.turns, len(s.token_ids))) for s in t.segments],
        "env_record": stored_env_record(root, t.trajectory_id, t.env_record),
    }


class TrajectoryStore:
    def __init__(self, root: Path, flush_every: int = 64):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self._rows: list[dict] = []
        existing = sorted(self.root.glob("part-*.parquet"))
        self._next_part = int(existing[-1].stem.split("-")[1]) + 1 if existing else 1
        self.written = 0

    def append(self, trajectories: list[Trajectory]) -> None:
        self._rows.extend(_row(t, self.root) for t in trajectories)
        if len(self._rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows, schema=SCHEMA)
        path = self.root / f"part-{self._next_part:06d}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        tmp.rename(path)  # readers never see a half-written part
        self._next_part += 1
        self.written += len(self._rows)
        self._rows = []


def read_trajectories(root: Path) -> pa.Table:
    """All stored rows as one pyarrow Table in the current nested types (empty table with the schema if none)."""
    parts = sorted(Path(root).glob("part-*.parquet"))
    if not parts:
        return SCHEMA.empty_table()
    # Parts written by an older version may lack newer columns (they read as nulls) or hold JSON strings where the
    # columns are nested now (upgraded).
    return pa.concat_tables([upgrade(pq.read_table(p)) for p in parts], promote_options="default")


def read_rows(root: Path) -> list[dict]:
    """All stored rows as dicts, maps (reward_components, a turn's reward_terms) as dicts."""
    return read_trajectories(root).to_pylist(maps_as_pydicts="strict")
