"""Where a dataset's rows come from: local files and `datasets` save_to_disk folders, read into memory-mapped
`datasets.Dataset` parts, and how a message names a part's row (1-based, as editors count, and saying so).

Is: finding the files (a path, a glob, a list); reading parquet, JSON/JSONL, CSV and Arrow files with `datasets` (each
converted once into an Arrow file in loomrl's cache and memory-mapped); reading a save_to_disk folder with
`datasets.load_from_disk` (already Arrow, mapped as it is), a DatasetDict's splits as parts tagged with their split;
naming a malformed JSON line (jsonl.py). Is not: column mappings, checks of rows' values, the choice of splits
(loader.py); the hub (loader.py).
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loomrl.data import jsonl

log = logging.getLogger(__name__)
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
_DICT_FILE, _STATE_FILE, _INFO_FILE = "dataset_dict.json", "state.json", "dataset_info.json"  # datasets.config's


class DataError(ValueError):
    """A dataset that cannot be used as configured: one line saying where and what to do."""


@dataclass(frozen=True, slots=True)
class Part:
    """One file, one save_to_disk Dataset or one split of a DatasetDict: its rows and how to name them."""

    name: str  # what messages call it: the file, the split's folder, hub:NAME[split]
    ds: Any  # datasets.Dataset, memory-mapped
    label: str  # default task ids are f"{label}-{0-based row}"
    split: str | None = None  # the DatasetDict split it is, where the folder holds several
    json_lines: str | None = None  # the JSON lines file its rows came from (messages name its lines)
    lines: np.ndarray | None = None  # [rows] the 1-based line of each row, where lines were left out


def where(part: Part, row: int) -> str:
    """How a message names 0-based `row` of `part`: 'FILE line N' in a JSON lines file, else 'NAME row N (1-based)'."""
    if part.json_lines is None:
        return f"{part.name} row {row + 1} (1-based)"
    line = int(part.lines[row]) if part.lines is not None else jsonl.line_of(part.json_lines, row)
    return f"{part.name} line {line}"


def cache_dir() -> str:
    from loomrl.cache_dir import cache_root

    return str(cache_root() / "datasets")


def _files(spec: str | list[str], base_dir: Path | None) -> list[str]:
    out = []
    for item in [spec] if isinstance(spec, str) else spec:
        pattern = item if os.path.isabs(item) or base_dir is None else str(base_dir / item)
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise DataError(f"data error: no file matches {pattern!r} (data.path is relative to the recipe's folder)")
        out += matched
    return out


def _unreadable(f: str, kind: str, err: Exception) -> DataError:
    return DataError(f"data error: {f}: cannot read it as {kind}: {type(err).__name__}: "
                     f"{' '.join(str(err).split())[:300]}")


def read_local(spec: str | list[str], base_dir: Path | None, fmt: str, *, skip_malformed: bool) -> tuple[list[Part],
                                                                                                         int]:
    """The parts of data.path (or data.heldout_path), and how many malformed JSON lines were left out."""
    import datasets

    datasets.disable_progress_bars()
    parts, skipped = [], 0
    for f in _files(spec, base_dir):
        if os.path.isdir(f):
            parts += _read_folder(f)
            continue
        kind = fmt if fmt != "auto" else _FORMATS.get(Path(f).suffix.lower())
        if kind is None:
            raise DataError(f"data error: {f}: cannot tell the format from the name; set data.format to parquet, json, "
                            "csv or arrow")
        if kind == "json":
            part, left_out = _read_json(f, skip_malformed)
            parts.append(part)
            skipped += left_out
            continue
        try:
            if kind == "arrow":
                ds = datasets.Dataset.from_file(f)
            else:
                reader = {"parquet": datasets.Dataset.from_parquet, "csv": datasets.Dataset.from_csv}[kind]
                ds = reader(f, cache_dir=cache_dir(), keep_in_memory=False)
        except Exception as err:  # noqa: BLE001 - a file datasets cannot read: say which and why, in one line
            raise _unreadable(f, kind, err) from None
        parts.append(Part(name=f, ds=ds, label=Path(f).stem))
    return parts, skipped


def _from_json(f: str):
    import datasets

    return datasets.Dataset.from_json(f, cache_dir=cache_dir(), keep_in_memory=False)


def _read_json(f: str, skip_malformed: bool) -> tuple[Part, int]:
    """A JSON or JSON lines file through `datasets`; where `datasets` fails on JSON lines, the malformed line named
    (jsonl.py), or with data.skip_malformed left out with a warning each and counted."""
    lines_file = f if jsonl.is_json_lines(f) else None
    try:
        return Part(name=f, ds=_from_json(f), label=Path(f).stem, json_lines=lines_file), 0
    except Exception as err:  # noqa: BLE001 - datasets fails a whole file for one bad line: find the line below
        if lines_file is None:
            raise _unreadable(f, "json", err) from None
        failure = err
    found = jsonl.scan(f)
    if not found.n_bad:  # every line is a JSON object: datasets failed for another reason, which it says
        raise _unreadable(f, "json", failure) from None
    line, why = found.bad[0]
    if not skip_malformed:
        raise DataError(f"data error: {f} line {line}: {why}; fix the line or set data.skip_malformed=true to leave "
                        f"such lines out ({found.n_bad} in this file)")
    for line, why in found.bad:
        log.warning("data: %s line %d: %s; left out (data.skip_malformed)", f, line, why)
    if found.n_bad > len(found.bad):
        log.warning("data: %s: %d more malformed lines left out (data.skip_malformed)", f, found.n_bad - len(found.bad))
    try:
        ds = _from_json(jsonl.good_lines_copy(f, found, Path(cache_dir())))
    except Exception as err:  # noqa: BLE001 - the good lines still fail: datasets says why
        raise _unreadable(f, "json", err) from None
    return Part(name=f, ds=ds, label=Path(f).stem, json_lines=f, lines=found.lines), found.n_bad


def _read_folder(folder: str) -> list[Part]:
    """A `datasets` save_to_disk folder: a DatasetDict (a part per split, tagged with its split when there are
    several) or a single Dataset. Any other folder: a line naming what it holds and what loomrl reads."""
    import datasets

    path = Path(folder)
    is_dict = (path / _DICT_FILE).is_file()
    if not is_dict and not ((path / _STATE_FILE).is_file() and (path / _INFO_FILE).is_file()):
        raise DataError(_not_a_dataset_folder(path))
    try:
        loaded = datasets.load_from_disk(folder)
    except Exception as err:  # noqa: BLE001 - a save_to_disk folder datasets cannot read: say why, in one line
        raise DataError(f"data error: {folder}: cannot read it as a `datasets` save_to_disk folder: "
                        f"{type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return [Part(name=folder, ds=loaded, label=path.name)]
    several = len(loaded) > 1
    return [Part(name=str(path / str(split)), ds=ds, label=f"{path.name}-{split}",
                 split=str(split) if several else None) for split, ds in loaded.items()]


def _not_a_dataset_folder(path: Path) -> str:
    entries = sorted(path.iterdir(), key=lambda p: p.name)
    shown = [f"{p.name}/" if p.is_dir() else p.name for p in entries[:8]] + (["..."] if len(entries) > 8 else [])
    hint = ""
    for place in [path, *(p for p in entries if p.is_dir())]:  # data files beside, or one folder down
        exts = sorted({p.suffix.lower() for p in place.iterdir() if p.suffix.lower() in _FORMATS})
        if exts:
            hint = f"; for the files in it set data.path={place}/*{exts[0]}"
            break
    return (f"data error: {path}: not a `datasets` save_to_disk folder (no {_DICT_FILE}, no {_STATE_FILE}); it holds "
            f"{', '.join(shown) or 'nothing'}; loomrl reads a folder written by Dataset.save_to_disk or "
            f"DatasetDict.save_to_disk, or files (parquet, JSONL/JSON, CSV, Arrow) named by a path or a glob{hint}")
