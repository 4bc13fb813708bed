"""JSON lines checked line by line, to name a malformed line as an editor counts it (1-based) and say what is wrong.

`datasets` reads a JSON lines file whole or not at all: one malformed line fails the file, and its own log names a
position or a 0-based row. This module is called only after `datasets` has failed on a file (a file it reads costs
nothing here); it reads the file once, line by line (memory: 8 bytes per good row), and with data.skip_malformed
writes the good lines once into loomrl's cache for `datasets` to read instead. It also maps a row back to its line
(blank lines are not rows) when a message needs it.

Is not: a JSON reader (the rows are read by `datasets`); a whole-document JSON file (an array) has no lines to name.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_KEEP = 10  # malformed lines named in the warnings; the rest are counted
_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "true or false", type(None): "null"}


@dataclass(frozen=True, slots=True)
class LineScan:
    """What a line-by-line read of a JSON lines file found."""

    bad: list[tuple[int, str]]  # the first few malformed lines: (1-based line, what is wrong)
    n_bad: int
    lines: np.ndarray  # [rows] int64: the 1-based line of each good row, in order


def is_json_lines(path: str) -> bool:
    """A JSON file whose first non-blank character is not '[' (a whole-document array) holds one row a line."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    return not head.startswith(b"[")


def _problem(raw: bytes) -> str | None:
    """What is wrong with one non-blank line, or None."""
    try:
        value = json.loads(raw)
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(value, dict):
        return f"a JSON {_KINDS.get(type(value), type(value).__name__)}, not an object {{...}}"
    return None


def scan(path: str) -> LineScan:
    """Every line of `path` read once; blank lines are skipped (as `datasets` skips them), not counted as bad."""
    good, bad, n_bad = array("q"), [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            text = raw.removeprefix(codecs.BOM_UTF8) if n == 1 else raw
            if not text.strip():
                continue
            why = _problem(text.rstrip(b"\r\n"))
            if why is None:
                good.append(n)
                continue
            n_bad += 1
            if len(bad) < _KEEP:
                bad.append((n, why))
    return LineScan(bad=bad, n_bad=n_bad, lines=np.frombuffer(good, dtype=np.int64) if good else np.zeros(0, np.int64))


def good_lines_copy(path: str, found: LineScan, cache: Path) -> str:
    """A copy of `path` with only its good lines, made once per version of the file (keyed by its path, size and
    mtime) in `cache`; written line by line to a temporary name and renamed, so a reader never sees half of it."""
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache / "jsonl" / f"{Path(path).stem}-{key}.jsonl"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    keep, i = found.lines, 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for n, raw in enumerate(src, 1):
            if i < len(keep) and keep[i] == n:
                dst.write(raw if raw.endswith(b"\n") else raw + b"\n")
                i += 1
    os.replace(tmp, out)
    return str(out)


def line_of(path: str, row: int) -> int:
    """The 1-based line of 0-based `row` in a JSON lines file `datasets` read as it is: the (row+1)-th non-blank
    line. Read up to that line only, when a message needs it."""
    seen = -1
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if (raw.removeprefix(codecs.BOM_UTF8) if n == 1 else raw).strip():
                seen += 1
                if seen == row:
                    return n
    raise ValueError(f"{path} has no row {row + 1}")
