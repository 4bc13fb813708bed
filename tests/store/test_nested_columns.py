"""The trajectory store's nested columns: pandas reads turns and reward components as values (no JSON decoding), and
a store written before they were nested (JSON-string columns) still reads, alone or mixed with new parts (a resumed
run), through read_trajectories, the viewer's StoreIndex and `loomrl plan`'s turn reader."""

from __future__ import annotations

import json
from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomrl.store import TrajectoryStore, plain_row, read_rows, read_trajectories, stored_turns
from loomrl.types import ContextSegment, TokenSpan, Trajectory, Turn
from loomrl.view.store_index import StoreIndex

CALL = {"name": "calc", "arguments": {"expression": "2+3", "nested": {"a": [1, 2]}}, "error": None, "output": "5"}
BAD_CALL = {"name": "calc", "arguments": {}, "error": "no JSON object"}
EVENT = {"action": "discard_all", "tokens_before": 40, "tokens_after": 9, "messages_before": 5, "messages_after": 2}


def _trajectory(tid: str = "tr-1") -> Trajectory:
    first = Turn(think="hm", act="<tool_call>", obs="5", act_span=TokenSpan(start=3, end=5),
                 obs_span=TokenSpan(start=5, end=6), logprobs=[-0.25, -1.5], versions=[0, 1], finish_reason="stop",
                 tool_calls=[CALL, BAD_CALL], context_events=[EVENT], reward_terms={"tool_error": -0.05},
                 gen_s=0.5, env_s=0.25)
    last = Turn(act="5", done=True, act_span=TokenSpan(start=3, end=4), logprobs=[-0.125], versions=[1])
    t = Trajectory(task_id="t", trajectory_id=tid, group_id="g", prompt_ids=[1, 2, 3], token_ids=[1, 2, 3, 7],
                   turns=[last], total_reward=1.05, reward_components={"correct": 1.0, "format": 0.1})
    t.segments = [ContextSegment(reason="discard_all", prompt_ids=[1, 2, 3], token_ids=[1, 2, 3, 8, 9, 4],
                                 turns=[first])]
    t.metadata.retry_errors = ["timeout: tool ran past 1s"]
    return t


def _write(root, trajs):
    store = TrajectoryStore(root)
    store.append(trajs)
    store.flush()


def test_pandas_reads_the_nested_columns_as_values(tmp_path):
    pd = pytest.importorskip("pandas")
    _write(tmp_path, [_trajectory()])
    frame = pd.read_parquet(tmp_path)  # the folder, as a user would
    row = frame.iloc[0]
    assert dict(row["reward_components"]) == {"correct": 1.0, "format": 0.1}  # a map: (name, value) pairs
    (turn,) = row["turns"]
    assert turn["act"] == "5" and turn["done"] and dict(turn["act_span"]) == {"start": 3, "end": 4}
    (segment,) = row["segments"]
    seg_turn = segment["turns"][0]
    assert segment["reason"] == "discard_all" and seg_turn["gen_s"] == 0.5 and list(seg_turn["versions"]) == [0, 1]
    assert [c["name"] for c in seg_turn["tool_calls"]] == ["calc", "calc"]
    assert [c["error"] for c in seg_turn["tool_calls"]] == [None, "no JSON object"]
    assert json.loads(seg_turn["tool_calls"][0]["record"]) == CALL  # open shape (free-form arguments): JSON
    assert seg_turn["context_events"][0]["action"] == "discard_all"
    assert dict(seg_turn["reward_terms"]) == {"tool_error": -0.05}
    assert list(row["retry_errors"]) == ["timeout: tool ran past 1s"]
    # DuckDB and polars read them directly too, where installed (neither is in the test environment)
    duckdb = _installed("duckdb")
    if duckdb is not None:
        assert duckdb.sql(f"select reward_components['correct'] from '{tmp_path}/*.parquet'").fetchall() == [(1.0,)]
    pl = _installed("polars")
    if pl is not None:
        assert pl.read_parquet(tmp_path / "*.parquet")["turns"][0][0]["act"] == "5"


def _installed(name: str):
    try:
        return __import__(name)
    except ImportError:
        return None


def test_read_rows_gives_back_what_was_stored(tmp_path):
    t = _trajectory()
    _write(tmp_path, [t])
    (row,) = read_rows(tmp_path)
    assert row["reward_components"] == {"correct": 1.0, "format": 0.1}  # no json.loads
    assert row["turns"][0]["act_span"] == {"start": 3, "end": 4} and row["turns"][0]["versions"] == [1]
    plain = plain_row(row)  # every Turn field back as types.Turn's dict, tool calls and events as recorded
    assert plain["turns"] == [asdict(turn) for turn in t.turns]
    assert plain["segments"][0]["turns"] == [asdict(turn) for turn in t.segments[0].turns]
    assert plain["retry_errors"] == t.metadata.retry_errors


def _old_part(path, trajs) -> None:
    """A part as loomrl wrote it before the columns were nested: turns, reward_components, segments and
    retry_errors as JSON strings (the old writer's encoding, kept here as a fixture)."""
    rows = [{"trajectory_id": t.trajectory_id, "task_id": t.task_id, "group_id": t.group_id, "status": "completed",
             "total_reward": t.total_reward, "n_turns": len(t.all_turns()), "token_ids": t.token_ids,
             "reward_components": json.dumps(t.reward_components),
             "turns": json.dumps([asdict(turn) for turn in t.turns]),
             "retry_errors": json.dumps(t.metadata.retry_errors),
             "segments": json.dumps([{"reason": s.reason, "prompt_len": len(s.prompt_ids), "token_ids": s.token_ids,
                                      "turns": [asdict(turn) for turn in s.turns]} for s in t.segments])}
            for t in trajs]
    types = {"total_reward": pa.float64(), "n_turns": pa.int32(), "token_ids": pa.list_(pa.int32())}
    schema = pa.schema([(name, types.get(name, pa.string())) for name in rows[0]])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_a_store_written_with_json_string_columns_still_reads(tmp_path):
    old, new = _trajectory("tr-old"), _trajectory("tr-new")
    _old_part(tmp_path / "part-000001.parquet", [old])
    _write(tmp_path, [new])  # a resumed run: the next part, in the nested types
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000001.parquet", "part-000002.parquet"]
    table = read_trajectories(tmp_path)
    assert table.schema.field("turns").type == pa.list_(pq.read_schema(tmp_path / "part-000002.parquet")
                                                         .field("turns").type.value_type)
    rows = {r["trajectory_id"]: r for r in read_rows(tmp_path)}
    assert rows["tr-old"]["reward_components"] == rows["tr-new"]["reward_components"] == {"correct": 1.0,
                                                                                          "format": 0.1}
    assert plain_row(rows["tr-old"])["turns"] == plain_row(rows["tr-new"])["turns"] == [asdict(x) for x in old.turns]
    assert plain_row(rows["tr-old"])["segments"][0]["turns"] == [asdict(x) for x in old.segments[0].turns]
    # the viewer's index and reader, and `loomrl plan`'s turns, read either part alike
    index = StoreIndex(tmp_path)
    assert {r.trajectory_id: r.terms for r in index.rows()} == {"tr-old": {"correct": 1.0, "format": 0.1},
                                                                 "tr-new": {"correct": 1.0, "format": 0.1}}
    viewed = {tid: index.read(tid) for tid in ("tr-old", "tr-new")}
    for name in ("turns", "reward_components", "retry_errors"):
        assert viewed["tr-old"][name] == viewed["tr-new"][name], name
    assert viewed["tr-old"]["segments"][0]["turns"] == viewed["tr-new"]["segments"][0]["turns"]
    old_turns = pq.read_table(tmp_path / "part-000001.parquet", columns=["turns"]).to_pylist()[0]["turns"]
    new_turns = pq.read_table(tmp_path / "part-000002.parquet", columns=["turns"]).to_pylist()[0]["turns"]
    assert stored_turns(old_turns) == stored_turns(new_turns) == [asdict(x) for x in old.turns]
