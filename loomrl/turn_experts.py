"""The engine's routed experts along a trajectory (mixture-of-experts models, trainer.router_replay): each turn keeps
the rows its generation recorded beyond what its context's earlier turns did; a context's record is their
concatenation, aligned with the context's token_ids, UNKNOWN where no turn recorded a row.

Why per turn and not one record per context: a turn's generation records every row of its prompt again (its prompt is
the whole context so far), so keeping each turn's whole record would cost the square of the context's length. The
first record of a row wins: it is the routing the row's K/V was computed with when the tokens sampled right after it
were (a prefix-cache hit reports that same routing again; a recompute under newer weights may not, and the earlier
turn's tokens, whose logprobs the engine gave, were computed with the first).

Rows no turn recorded (UNKNOWN; the trainer routes them itself): the last sampled token of the context (never fed
back), an observation appended after the last turn, rows whose K/V came from another instance's shared pool.
What it is not: the record's format (routed_experts.py) or the replay (trainer/replay.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from loomrl.routed_experts import RoutedExperts
from loomrl.types import Turn


def recorded_rows(turns: Sequence[Turn]) -> int:
    """How many rows of a context, from 0, its turns' records cover (the end of the furthest one)."""
    return max((t.routed_start + t.routed_experts.tokens for t in turns if t.routed_experts is not None), default=0)


def new_rows(record: RoutedExperts | None, start: int) -> RoutedExperts | None:
    """Rows [start, record.tokens) of `record` (None: none beyond `start`, or no record)."""
    if record is None or record.tokens <= start:
        return None
    per = record.bytes_per_token
    return RoutedExperts(data=record.data[start * per :], dtype=record.dtype, tokens=record.tokens - start,
                         layers=record.layers, top_k=record.top_k, num_experts=record.num_experts)


def context_experts(turns: Sequence[Turn], tokens: int) -> RoutedExperts | None:
    """The record of a context of `tokens` tokens from its turns' rows, UNKNOWN where none recorded a row (rows past
    `tokens` dropped); None when no turn recorded any."""
    parts = [t for t in turns if t.routed_experts is not None]
    if not parts:
        return None
    first = parts[0].routed_experts
    assert first is not None
    per = first.bytes_per_token
    data = bytearray(b"\xff" * (tokens * per))  # UNKNOWN is the dtype's largest value: every byte 0xff
    for turn in parts:
        rec = turn.routed_experts
        assert rec is not None
        if (rec.layers, rec.top_k, rec.dtype) != (first.layers, first.top_k, first.dtype):
            raise ValueError(f"routed experts: a context's turns recorded different shapes ({first.layers}, "
                             f"top_k {first.top_k}, {first.dtype} vs {rec.layers}, top_k {rec.top_k}, {rec.dtype})")
        end = min(turn.routed_start + rec.tokens, tokens)
        if end > turn.routed_start:
            data[turn.routed_start * per : end * per] = rec.data[: (end - turn.routed_start) * per]
    return RoutedExperts(data=bytes(data), dtype=first.dtype, tokens=tokens, layers=first.layers, top_k=first.top_k,
                         num_experts=first.num_experts)
