"""How an error reads in one line: the one helper every part uses to cut an exception (or a process's error output)
down to what a log line, a trajectory's error field or a run's stop message can hold. Imports nothing of loomrl, so
that any layer may use it."""

from __future__ import annotations

from pathlib import Path


def _lines(err: BaseException | str) -> list[str]:
    return [line for line in str(err).strip().splitlines() if line.strip()]


def error_line(err: BaseException | str, *, end: bool = False) -> str:
    """The first line of an error's message (`end`: the last, where a traceback keeps its cause); an exception with no
    message reads as its type's name, never as an empty string or an IndexError."""
    lines = _lines(err)
    if not lines:
        return type(err).__name__ if isinstance(err, BaseException) else ""
    return lines[-1] if end else lines[0]


def error_tail(err: BaseException | str, n: int = 3) -> str:
    """The last `n` lines of an error's message (Ray's errors begin with where the actor ran and end with the cause)."""
    lines = _lines(err)
    return "\n".join(lines[-n:]) if lines else error_line(err)


def folded(text: str, limit: int = 400) -> str:
    """Error output folded onto one line, at most `limit` characters (the end kept: that is where the cause usually
    is)."""
    flat = " | ".join(line.strip() for line in _lines(text))
    return flat if len(flat) <= limit else "..." + flat[-limit:]


def named_line(err: BaseException, limit: int | None = None) -> str:
    """"Type: first line" of an exception (its type alone when it has no message), the line cut at `limit`
    characters."""
    lines = _lines(err)
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0][:limit]}"


def with_frames(line: str, err: BaseException, n: int = 3) -> str:
    """`line`, then the last `n` frames of `err`'s traceback ("  at rewards.py:12 in score: return x[0]"), so that a
    trajectory's error says where a user's function failed, not only what it raised (error_line still reads `line`)."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)[-n:]
    where = [f"  at {Path(f.filename).name}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames]
    return "\n".join([line, *where])
