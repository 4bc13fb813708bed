"""The trajectory store's nested columns: their Arrow types, how a trajectory's turns become them, how parts written
before they were nested (JSON strings) are read as them, and how a stored row is read back as plain Python.

The nested columns (pandas, polars and DuckDB read them as they are, no JSON decoding):
- `reward_components`: map<string, double>, term -> raw value (pandas: a list of (name, value) pairs; DuckDB:
  `reward_components['correct']`; pyarrow: `to_pylist(maps_as_pydicts="strict")` gives dicts);
- `turns`: list<struct> with the fields of types.Turn; `act_span`/`obs_span` struct<start, end>; `reward_terms` a map
  like reward_components;
- `segments`: list<struct<reason, prompt_len, token_ids, loss_mask, logprobs, versions, turns>>;
- `retry_errors`: list<string>;
- `routed_experts` (the current context's) and `segment_routed_experts` (per segment, in order): ROUTED structs, the
  engine's routed experts of every token (router replay: routed_experts.py's record, its bytes as they are:
  layers x top_k bytes a token); null where none was recorded. Top-level columns, so that parts written before them
  read as nulls.
Where a record's shape is open it stays a JSON string inside its struct: a tool call's `record` (the whole call as
the environment recorded it: free-form `arguments`, and keys that differ by environment: output, tool_error,
failure, exception, an OpenAI-form `function`) beside its `name` and parse `error`; a context event's `record` beside
its `action`.

What it is not: the writer (trajectory_store.py) or a reader of part files.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pyarrow as pa

from loomrl.routed_experts import RoutedExperts
from loomrl.types import Turn

TERMS = pa.map_(pa.string(), pa.float64())
SPAN = pa.struct([("start", pa.int32()), ("end", pa.int32())])
TOOL_CALL = pa.struct([("name", pa.string()), ("error", pa.string()), ("record", pa.string())])
CONTEXT_EVENT = pa.struct([("action", pa.string()), ("record", pa.string())])
TURN = pa.struct([
    ("think", pa.string()), ("act", pa.string()), ("obs", pa.string()), ("reward_step", pa.float64()),
    ("done", pa.bool_()), ("act_span", SPAN), ("obs_span", SPAN), ("logprobs", pa.list_(pa.float64())),
    ("versions", pa.list_(pa.int32())), ("finish_reason", pa.string()), ("tool_calls", pa.list_(TOOL_CALL)),
    ("error", pa.string()), ("context_events", pa.list_(CONTEXT_EVENT)), ("reward_terms", TERMS),
    ("gen_s", pa.float64()), ("env_s", pa.float64()),
])  # fmt: skip
SEGMENT = pa.struct([
    ("reason", pa.string()), ("prompt_len", pa.int32()), ("token_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())), ("versions", pa.list_(pa.int32())),
    ("turns", pa.list_(TURN)),
])  # fmt: skip
ROUTED = pa.struct([
    ("data", pa.binary()), ("dtype", pa.string()), ("tokens", pa.int32()), ("layers", pa.list_(pa.int32())),
    ("top_k", pa.int32()), ("num_experts", pa.int32()),
])  # fmt: skip
# The columns that were JSON strings before they were nested, with their types now.
NESTED = {"reward_components": TERMS, "turns": pa.list_(TURN), "segments": pa.list_(SEGMENT),
          "retry_errors": pa.list_(pa.string())}


def _call_name(call: dict[str, Any]) -> str | None:
    """A tool call's name: ours ({"name", "arguments", ...}) or OpenAI's ({"function": {"name", ...}})."""
    function = call.get("function")
    name = call.get("name") or (function.get("name") if isinstance(function, dict) else None)
    return None if name is None else str(name)


def _call_error(call: dict[str, Any]) -> str | None:
    """Why the call could not be parsed (None: it parsed)."""
    return None if call.get("error") is None else str(call["error"])


def nested_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """One turn (types.Turn as a dict: asdict, or decoded from an old part's JSON) in the TURN struct's shape."""
    return {
        **turn,
        "tool_calls": [{"name": _call_name(c), "error": _call_error(c), "record": json.dumps(c)}
                       for c in turn.get("tool_calls") or []],
        "context_events": [{"action": e.get("action"), "record": json.dumps(e)} for e in turn.get("context_events") or []],
        "reward_terms": list((turn.get("reward_terms") or {}).items()),
    }


def turns_column(turns: list[Turn]) -> list[dict[str, Any]]:
    """The turns in the TURN struct's shape; their routed experts go to the context's ROUTED column instead."""
    out = []
    for turn in turns:
        row = asdict(turn)
        del row["routed_experts"], row["routed_start"]
        out.append(nested_turn(row))
    return out


def routed_column(record: RoutedExperts | None) -> dict[str, Any] | None:
    """A context's routed experts (turn_experts.py context_experts) as a ROUTED value."""
    if record is None:
        return None
    return {"data": record.data, "dtype": record.dtype, "tokens": record.tokens, "layers": list(record.layers),
            "top_k": record.top_k, "num_experts": record.num_experts}


def stored_experts(value: dict[str, Any] | None) -> RoutedExperts | None:
    """A stored ROUTED value as the record (None: none stored, or a part written before the column)."""
    if value is None:
        return None
    return RoutedExperts(data=value["data"], dtype=value["dtype"], tokens=value["tokens"],
                         layers=tuple(value["layers"]), top_k=value["top_k"], num_experts=value["num_experts"])


def _routed_summary(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A ROUTED value without its bytes (JSON-able, what the viewer serves)."""
    return None if value is None else {k: v for k, v in value.items() if k != "data"}


def plain_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """A stored turn (TURN struct as pyarrow gives it) as types.Turn's dict: tool calls and context events as recorded,
    reward_terms a dict, no routed experts (the row's ROUTED columns hold its context's)."""
    terms = turn.get("reward_terms") or {}
    return {
        **turn,
        "tool_calls": [json.loads(c["record"]) for c in turn.get("tool_calls") or []],
        "context_events": [json.loads(e["record"]) for e in turn.get("context_events") or []],
        "reward_terms": dict(terms.items() if isinstance(terms, dict) else terms),
        # a turn's routed experts are stored with its context (the ROUTED columns), not per turn
        "routed_experts": None, "routed_start": 0,
    }


def stored_turns(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A stored `turns` value, nested or an old part's JSON string, as a list of types.Turn dicts."""
    if value is None:
        return []
    if isinstance(value, str):
        return json.loads(value or "[]")
    return [plain_turn(t) for t in value]


def plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """One stored row (either format) with its nested columns as plain Python: reward_components a dict, turns and
    each segment's turns as types.Turn dicts, retry_errors a list, routed experts without their bytes (what the
    viewer serves: JSON)."""
    out = dict(row)
    terms = row.get("reward_components")
    if isinstance(terms, str):
        terms = json.loads(terms or "{}")
    out["reward_components"] = {} if terms is None else dict(terms.items() if isinstance(terms, dict) else terms)
    out["turns"] = stored_turns(row.get("turns"))
    segments = row.get("segments")
    if isinstance(segments, str):  # an older part's JSON: its turns are Turn dicts already
        out["segments"] = json.loads(segments or "[]")
    else:
        out["segments"] = [{**s, "turns": stored_turns(s.get("turns"))} for s in segments or []]
    out["routed_experts"] = _routed_summary(row.get("routed_experts"))
    out["segment_routed_experts"] = [_routed_summary(v) for v in row.get("segment_routed_experts") or []]
    errors = row.get("retry_errors")
    out["retry_errors"] = json.loads(errors or "[]") if isinstance(errors, str) else list(errors or [])
    return out


def _upgraded(name: str, text: str | None) -> Any:
    """One old JSON-string value in its nested column's shape."""
    if text is None:
        return None
    value = json.loads(text or ("{}" if name == "reward_components" else "[]"))
    if name == "reward_components":
        return list(value.items())
    if name == "turns":
        return [nested_turn(t) for t in value]
    if name == "segments":
        return [{**s, "turns": [nested_turn(t) for t in s.get("turns") or []]} for s in value]
    return value


def upgrade(table: pa.Table) -> pa.Table:
    """A part's table with its old JSON-string columns (written before they were nested) as nested columns."""
    for name, type_ in NESTED.items():
        i = table.schema.get_field_index(name)
        if i >= 0 and pa.types.is_string(table.schema.field(i).type):
            values = [_upgraded(name, v) for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(name, type_), pa.array(values, type=type_))
    return table
