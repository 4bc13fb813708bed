"""Datasets users bring, read through Hugging Face `datasets` into tasks, lazily.

The rows come from parts (parts.py: files, `datasets` save_to_disk folders; the hub here), each memory-mapped Arrow,
so a worker holds no Python copy of the rows and a row becomes a Task only when the run asks for it
(`TaskSource.__getitem__`). Measured by benchmarks/data_loading.py.

Checks, each a DataError of one line naming the file, the row (1-based: "line N" in JSON lines, "row N (1-based)"
elsewhere) and the column and what to do: no file matches; a format that cannot be told from the name; a folder that
is not a save_to_disk folder; a malformed JSON line; a column the mapping names is missing; a split is empty; a row
cannot be used (its prompt or answer is null or empty). The last is checked for every row up front over the two
columns alone (Arrow compute, no Python loop), so that a bad row stops the run at start, not an hour in; with
data.skip_malformed such rows and lines are left out and counted instead (the good rows' indices are kept as one
integer array). A prompt whose messages are wrong is met when its row is read.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # functions made at import time from Arrow's registry: declared nowhere (ty: ignore)

from loomrl.config.data import DataConfig
from loomrl.data.parts import DataError, Part, cache_dir, read_local, where
from loomrl.types import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Columns:
    prompt: str | None  # None: the prompt comes from data.prompt_template
    answer: list[str]  # a dotted path into the row
    id: str | None
    family: str | None


def _offline() -> None:
    """Nothing is downloaded at run time. datasets and huggingface_hub read these variables when they are first
    imported (an import before this one, e.g. by transformers, already has), so their flags are set as well."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _read_hub(cfg: DataConfig, split: str):
    """A hub dataset from the local Hugging Face cache: the snapshot huggingface_hub keeps (found with
    local_files_only, never fetched), read as a local folder by `datasets`, which finds its data files by the repo's
    own conventions (the README's configs, data/<split>-* files)."""
    import datasets
    from huggingface_hub import snapshot_download

    hub = cfg.hub
    if hub is None:  # load_splits reads the hub only when data.hub is given
        raise DataError("data error: data.hub is not given")
    _offline()
    where = f"hub:{hub}[{split}]"
    try:
        folder = snapshot_download(hub, repo_type="dataset", local_files_only=True)
    except Exception as err:  # noqa: BLE001 - not cached, in whatever way huggingface_hub says it
        raise DataError(f"data error: data.hub={cfg.hub} is not in the local Hugging Face cache "
                        f"({type(err).__name__}); download it beforehand (e.g. huggingface-cli download {cfg.hub} "
                        "--repo-type dataset) or give data.path") from None
    try:
        ds = datasets.load_dataset(folder, cfg.hub_config, split=split, cache_dir=cache_dir())
    except Exception as err:  # noqa: BLE001
        raise DataError(f"data error: {where}: cannot read the cached snapshot {folder}: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:200]}; check data.hub_config and data.hub_split") from None
    return [Part(name=where, ds=ds, label=Path(where).stem)]


def _columns(cfg: DataConfig, names: list[str], where: str) -> _Columns:
    verl = cfg.layout == "verl" or (cfg.layout == "auto" and "prompt" in names and "reward_model" in names)
    answer = cfg.answer or ("reward_model.ground_truth" if verl else "answer")
    family = cfg.family or ("data_source" if verl and "data_source" in names else None)
    wanted = {"data.answer": answer.split(".")[0], "data.id": cfg.id, "data.family": family}
    if cfg.prompt_template is None:
        wanted["data.prompt"] = cfg.prompt
    for setting, column in wanted.items():
        if column is not None and column not in names:
            raise DataError(f"data error: {where}: no column {column!r} ({setting}); the columns are "
                            f"{', '.join(names)}; set {setting}=<column>")
    return _Columns(prompt=None if cfg.prompt_template else cfg.prompt, answer=answer.split("."), id=cfg.id,
                    family=family)


def _column(table: pa.Table, path: list[str]) -> pa.ChunkedArray:
    col = table.column(path[0])
    for name in path[1:]:
        col = pc.struct_field(col, name)  # ty: ignore[missing-attribute]
    return col


def _unusable(table: pa.Table, cols: _Columns) -> tuple[np.ndarray, list[tuple[np.ndarray, str]]]:
    """A mask of rows that cannot be used, and each check's own mask with what it says of a row. Arrow compute over
    the two columns, chunk by chunk, copying no strings (a regex match, not a trimmed copy of the column)."""
    bad = np.zeros(table.num_rows, dtype=bool)
    checks = []
    for path, what in [(cols.answer, "answer")] + ([([cols.prompt], "prompt")] if cols.prompt else []):
        try:
            col = _column(table, path)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise DataError(f"data error: no field {'.'.join(path)!r} (data.{what}): {err}") from None
        empty = pc.is_null(col)  # ty: ignore[missing-attribute]
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            empty = pc.or_(empty, pc.match_substring_regex(col, pattern=r"^\s*$"))  # ty: ignore[missing-attribute]
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            empty = pc.or_(empty, pc.equal(pc.list_value_length(col), 0))  # ty: ignore[missing-attribute]
        mask = np.asarray(pc.fill_null(empty, True).to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((mask, f"{'.'.join(path)!r} is null or empty"))
        bad |= mask
    return bad, checks


class TaskSource(Sequence[Task]):
    """The tasks of one split of a dataset, made from its rows on demand (a Sequence: len and index)."""

    def __init__(self, cfg: DataConfig, parts: list[Part], rows: tuple[np.ndarray, np.ndarray], split: str,
                 cols: _Columns):
        self.cfg, self.split, self.cols = cfg, split, cols
        self._parts = parts
        # (file, row) of each task as two integer arrays: 12 bytes a task however wide the rows
        self._part, self._row = rows
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._row)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        part, row = int(self._part[i]), int(self._row[i])
        return self._task(self._parts[part].ds[row], self._parts[part], row)

    def _task(self, row: dict[str, Any], part: Part, index: int) -> Task:
        cfg, cols = self.cfg, self.cols
        at = where(part, index)
        if cols.prompt is None:
            template = cfg.prompt_template
            if template is None:  # _columns leaves no prompt column only where a template is given
                raise DataError(f"data error: {at}: neither data.prompt nor data.prompt_template is given")
            try:
                prompt: Any = template.format(**row)
            except (KeyError, IndexError, ValueError) as err:
                raise DataError(f"data error: {at}: data.prompt_template: {err!r} (the columns are "
                                f"{', '.join(row)})") from None
        else:
            prompt = row[cols.prompt]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                         and m.get("role") in ("system", "user", "assistant")
                                                         for m in prompt):
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise DataError(f"data error: {at}: column {cols.prompt!r} is neither a string nor a list of "
                            "{role, content} messages (each role system, user or assistant); fix the row or set "
                            "data.prompt to another column")
        answer: Any = row
        for key in cols.answer:
            answer = answer.get(key) if isinstance(answer, dict) else None
        opening = _few_shot(cfg.few_shot)
        if messages[0]["role"] == "system":
            opening, messages = [messages[0], *opening], messages[1:]
        elif cfg.system_prompt:
            opening = [{"role": "system", "content": cfg.system_prompt}, *opening]
        # every column but the prompt's, the answer's too, as TRL passes a dataset's columns to reward functions: one
        # written for TRL reads its answer by the column's own name (its accuracy_reward reads `solution`)
        skip = {cols.prompt}
        return Task(task_id=str(row[cols.id]) if cols.id else f"{part.label}-{index}",
                    prompt=next((m["content"] for m in reversed(messages) if m["role"] == "user"), ""),
                    answer=str(answer), split=self.split, family=str(row[cols.family]) if cols.family else "",
                    data={k: v for k, v in row.items() if k not in skip}, messages=[*opening, *messages])


def _few_shot(shots: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for i, shot in enumerate(shots):
        if "role" in shot:
            out.append({"role": str(shot["role"]), "content": str(shot.get("content", ""))})
        elif "prompt" in shot and "answer" in shot:
            out += [{"role": "user", "content": str(shot["prompt"])}, {"role": "assistant", "content": str(shot["answer"])}]
        else:
            raise DataError(f"data error: data.few_shot[{i}]: give {{prompt, answer}} or a chat message {{role, content}}")
    return out


Rows = tuple[np.ndarray, np.ndarray]  # (file index, row index) per task


def _usable_rows(cfg: DataConfig, parts: list[Part], cols: _Columns) -> tuple[Rows, int]:
    part_ids, row_ids, skipped = [], [], 0
    for p, part in enumerate(parts):
        bad, checks = _unusable(part.ds.data.table, cols)
        if bad.any() and not cfg.skip_malformed:
            first = int(np.argmax(bad))
            why = next(says for mask, says in checks if mask[first])
            raise DataError(f"data error: {where(part, first)}: column {why}; fix the row or set "
                            f"data.skip_malformed=true to leave such rows out ({int(bad.sum())} in this file)")
        skipped += int(bad.sum())
        good = np.flatnonzero(~bad).astype(np.int64)
        row_ids.append(good)
        part_ids.append(np.full(len(good), p, dtype=np.int32))
    return (np.concatenate(part_ids), np.concatenate(row_ids)), skipped


def _take(rows: Rows, keep: np.ndarray) -> Rows:
    return rows[0][keep], rows[1][keep]


def _split_values(parts: list[Part], rows: Rows, column: str) -> np.ndarray:
    out = np.empty(len(rows[1]), dtype=object)
    for p, part in enumerate(parts):
        here = rows[0] == p
        col = part.ds.data.table.column(column).take(pa.array(rows[1][here]))
        out[here] = np.asarray([str(v) for v in col.to_pylist()], dtype=object)
    return out


def _read_parts(cfg: DataConfig, base_dir: Path | None) -> tuple[list[Part], list[Part] | None, int]:
    """The parts trained on, the parts held out (None: split by data.split_column or the seed) and how many malformed
    JSON lines were left out. A save_to_disk DatasetDict's splits are chosen by data.train_values and
    data.heldout_values, as a split column's values are."""
    if cfg.hub is not None:
        held = _read_hub(cfg, cfg.hub_heldout_split) if cfg.hub_heldout_split else None
        return _read_hub(cfg, cfg.hub_split), held, 0
    if cfg.path is None:  # DataConfig refuses it: exactly one of path and hub
        raise DataError("data error: give data.path (local files) or data.hub (a cached hub dataset)")
    found, skipped = read_local(cfg.path, base_dir, cfg.format, skip_malformed=cfg.skip_malformed)
    parts = _splits(found, cfg.train_values, "train_values")
    held = None
    if any(p.split is not None for p in found):
        if cfg.split_column is not None:
            raise DataError(f"data error: {Path(found[0].name).parent}: a DatasetDict with splits "
                            f"{', '.join(str(p.split) for p in found)}: its splits choose the held-out rows "
                            "(data.train_values, data.heldout_values); unset data.split_column, or set data.path to "
                            "one split's folder")
        held = [p for p in found if p.split in cfg.heldout_values] or None
    if cfg.heldout_path is not None:
        held_found, held_skipped = read_local(cfg.heldout_path, base_dir, cfg.format,
                                              skip_malformed=cfg.skip_malformed)
        held, skipped = _splits(held_found, cfg.heldout_values, "heldout_values"), skipped + held_skipped
    return parts, held, skipped


def _splits(parts: list[Part], values: list[str], setting: str) -> list[Part]:
    """The parts a DatasetDict's split names in `values` (data.<setting>) keeps; parts of no DatasetDict all."""
    kept = [p for p in parts if p.split is None or p.split in values]
    if not kept:
        raise DataError(f"data error: {Path(parts[0].name).parent}: a DatasetDict with splits "
                        f"{', '.join(str(p.split) for p in parts)}; none is in data.{setting} {values}; set "
                        f"data.{setting}=[<split>]")
    return kept


def load_splits(cfg: DataConfig, *, seed: int, base_dir: Path | None = None,
                n_heldout: int = 200) -> tuple[TaskSource, TaskSource]:
    """(train, held-out) tasks of the dataset `cfg` names (see the module's doc). `n_heldout`: the held-out size when
    neither a held-out file, a split column nor data.heldout_size says (at most a fifth of the rows)."""
    parts, held_parts, skipped = _read_parts(cfg, base_dir)
    names = list(parts[0].ds.column_names)
    cols = _columns(cfg, names, parts[0].name)
    for part in parts[1:] + (held_parts or []):
        _columns(cfg, list(part.ds.column_names), part.name)
    rows, bad_rows = _usable_rows(cfg, parts, cols)
    skipped += bad_rows
    sources = ", ".join(part.name for part in parts)
    if held_parts is not None:
        held_rows, held_skipped = _usable_rows(cfg, held_parts, cols)
        train, held = (TaskSource(cfg, parts, rows, "train", cols), TaskSource(cfg, held_parts, held_rows,
                                                                               "heldout", cols))
        skipped += held_skipped
    elif cfg.split_column is not None:
        if cfg.split_column not in names:
            raise DataError(f"data error: {sources}: no column {cfg.split_column!r} (data.split_column); the columns "
                            f"are {', '.join(names)}")
        values = _split_values(parts, rows, cfg.split_column)
        train = TaskSource(cfg, parts, _take(rows, np.isin(values, cfg.train_values)), "train", cols)
        held = TaskSource(cfg, parts, _take(rows, np.isin(values, cfg.heldout_values)), "heldout", cols)
        found = sorted(set(values))[:10]
        for source, setting in ((train, "train_values"), (held, "heldout_values")):
            if not len(source):
                raise DataError(f"data error: {sources}: no row has {cfg.split_column} in data.{setting} "
                                f"{getattr(cfg, setting)}; the column holds {found}")
    else:  # held out from the seed: a fixed random subset, the rest trained on
        n = len(rows[1])
        k = cfg.heldout_size or min(n_heldout, n // 5)
        rng = np.random.default_rng(random.Random(f"{seed}:data:heldout").getrandbits(64))
        held_mask = np.zeros(n, dtype=bool)
        held_mask[rng.choice(n, size=min(k, n), replace=False)] = True
        train = TaskSource(cfg, parts, _take(rows, ~held_mask), "train", cols)
        held = TaskSource(cfg, parts, _take(rows, held_mask), "heldout", cols)
    if cfg.max_rows is not None:
        for source in (train, held):
            source._part, source._row = source._part[: cfg.max_rows], source._row[: cfg.max_rows]
    for source, what in ((train, "training"), (held, "held-out")):
        if not len(source):
            raise DataError(f"data error: {sources}: the {what} split is empty ({len(rows[1])} usable rows, {skipped} "
                            "left out); add rows or change the split settings")
    if skipped:
        log.warning("data: %d malformed row(s) left out (data.skip_malformed)", skipped)
    train.skipped = skipped
    return train, held
