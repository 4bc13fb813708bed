"""Where rows come from and how they are named: `datasets` save_to_disk folders (a DatasetDict's splits, a single
Dataset) read as they are; a folder that is neither named with what it holds; a malformed JSON line named by its
1-based line and left out with data.skip_malformed; every row number printed 1-based and saying so."""

from __future__ import annotations

import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomrl.config import ConfigError
from loomrl.data import DataConfig, DataError, load_splits
from loomrl.runtime.checks import load_checked

ROWS = [{"question": f"What is {i} + 1?", "solution": str(i + 1), "level": i % 3} for i in range(20)]


def _dataset_dict(folder, splits):
    datasets.disable_progress_bars()
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(folder))
    return str(folder)


def test_a_save_to_disk_dataset_dict_is_read_with_its_splits(tmp_path):
    """What TRL users keep: DatasetDict.save_to_disk. Its splits are chosen by data.train_values and
    data.heldout_values, as a split column's values are; a split's own folder is a single Dataset."""
    folder = _dataset_dict(tmp_path / "math", {"train": ROWS[:15], "test": ROWS[15:]})
    cfg = DataConfig(path=folder, prompt="question", answer="solution")
    train, held = load_splits(cfg, seed=0)
    assert (len(train), len(held)) == (15, 5)
    assert (train[3].prompt, train[3].answer, train[3].split) == ("What is 3 + 1?", "4", "train")
    assert held[0].answer == "16" and held[0].split == "heldout" and held[0].data["solution"] == "16"
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    # other split names: the settings a split column uses
    other = _dataset_dict(tmp_path / "other", {"dev": ROWS[:4], "fit": ROWS[4:]})
    train, held = load_splits(DataConfig(path=other, prompt="question", answer="solution", train_values=["fit"],
                                         heldout_values=["dev"]), seed=0)
    assert (len(train), len(held)) == (16, 4)
    with pytest.raises(DataError, match=r"^data error: .*other: a DatasetDict with splits dev, fit; none is in "
                                        r"data.train_values \['train'\]; set data.train_values=\[<split>\]$"):
        load_splits(DataConfig(path=other, prompt="question", answer="solution"), seed=0)
    with pytest.raises(DataError, match=r"math: a DatasetDict with splits train, test: its splits choose the held-out "
                                        r"rows \(data.train_values, data.heldout_values\); unset data.split_column"):
        load_splits(cfg.model_copy(update={"split_column": "level"}), seed=0)
    # no held-out split in the folder: held out from the seed, as for a file
    only = _dataset_dict(tmp_path / "only", {"train": ROWS})
    train, held = load_splits(DataConfig(path=only, prompt="question", answer="solution", heldout_size=4), seed=0)
    assert (len(train), len(held)) == (16, 4)
    # one split's folder, and a single Dataset's save_to_disk folder
    train, held = load_splits(DataConfig(path=f"{folder}/train", heldout_path=f"{folder}/test", prompt="question",
                                         answer="solution"), seed=0)
    assert (len(train), len(held)) == (15, 5)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    train, held = load_splits(DataConfig(path=str(tmp_path / "single"), prompt="question", answer="solution",
                                         heldout_size=5), seed=0)
    assert (len(train), len(held)) == (15, 5)


def test_a_save_to_disk_folder_through_a_recipe(tmp_path):
    """The run's own path to its tasks: the recipe's data.path, relative to the recipe's folder, checked at load."""
    from loomrl.env.registry import tasks_for

    _dataset_dict(tmp_path / "math", {"train": ROWS[:15], "test": ROWS[15:]})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env: {name: chat}\ndata: {path: math, prompt: question, answer: solution}\n")
    cfg = load_checked(recipe)
    train, held = tasks_for(cfg.env, cfg.data)
    assert (len(train), len(held)) == (15, 5) and train[0].data == {"solution": "1", "level": 0}


def test_a_folder_that_is_not_save_to_disk_says_what_it_found(tmp_path):
    folder = tmp_path / "exported"
    (folder / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), folder / "data" / "train-00000.parquet")
    (folder / "README.md").write_text("# my data")
    with pytest.raises(DataError) as err:
        load_splits(DataConfig(path=str(folder), prompt="question"), seed=0)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"data error: {folder}: ")
    assert "not a `datasets` save_to_disk folder (no dataset_dict.json, no state.json)" in line, line
    assert "it holds README.md, data/" in line and "loomrl reads" in line, line
    assert f"data.path={folder}/data/*.parquet" in line, line
    # the hint works
    train, held = load_splits(DataConfig(path=f"{folder}/data/*.parquet", prompt="question", answer="solution",
                                         heldout_size=2), seed=0)
    assert len(train) == 18


def test_a_malformed_jsonl_line_is_named_1_based_and_skipped(tmp_path, caplog):
    lines = [json.dumps(r) for r in ROWS[:10]]
    lines[4] = '{"question": "What is 4 + 1?", "solution": '  # line 5: cut short
    lines[7] = '["What is 7 + 1?", "8"]'  # line 8: JSON, but not an object
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(path=str(f), prompt="question", answer="solution", heldout_size=2)
    with pytest.raises(DataError) as err:
        load_splits(cfg, seed=0)
    assert str(err.value) == (f"data error: {f} line 5: not valid JSON (Expecting value at column 44); fix the line or "
                              "set data.skip_malformed=true to leave such lines out (2 in this file)")
    with caplog.at_level(logging.WARNING, logger="loomrl.data"):
        train, held = load_splits(cfg.model_copy(update={"skip_malformed": True}), seed=0)
    assert len(train) + len(held) == 8 and train.skipped == 2
    said = caplog.text
    assert f"{f} line 5: not valid JSON" in said and f"{f} line 8: a JSON array, not an object" in said, said
    assert sorted(t.answer for t in [*train, *held]) == sorted(str(i + 1) for i in range(10) if i not in (4, 7))
    # a later check names the file's own line: blank lines and left-out lines are counted as an editor counts them
    ok = [json.dumps(r) for r in ROWS[:10]]
    ok[2], ok[8] = "", json.dumps({"question": "What is 8 + 1?", "solution": None})
    g = tmp_path / "ok.jsonl"
    g.write_text("\n".join(ok) + "\n")
    with pytest.raises(DataError, match=r"ok.jsonl line 9: column 'solution' is null or empty; fix the row or set "
                                        r"data.skip_malformed=true .*\(1 in this file\)$"):
        load_splits(cfg.model_copy(update={"path": str(g)}), seed=0)
    msgs = [json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)}) for i in range(7)]
    msgs[1], msgs[3] = '{"prompt": [', "  "
    msgs[5] = json.dumps({"prompt": [{"role": "robot", "content": "q5"}], "answer": "5"})
    h = tmp_path / "msgs.jsonl"
    h.write_text("\n".join(msgs) + "\n")
    train, _ = load_splits(DataConfig(path=str(h), heldout_path=str(h), skip_malformed=True), seed=0)
    assert [t.answer for t in train[:3]] == ["0", "2", "4"] and train.skipped == 2
    with pytest.raises(DataError, match=r"msgs.jsonl line 6: column 'prompt' is neither"):
        train[3]


def test_row_numbers_are_1_based_and_say_so(tmp_path):
    bad = [dict(r) for r in ROWS]
    bad[7]["solution"] = None
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(bad), f)
    with pytest.raises(DataError, match=r"bad.parquet row 8 \(1-based\): column 'solution' is null or empty"):
        load_splits(DataConfig(path=str(f), prompt="question", answer="solution"), seed=0)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env: {name: chat}\ndata: {path: bad.parquet, prompt: question, answer: solution}\n")
    with pytest.raises(ConfigError, match=r"^data error: .*bad.parquet row 8 \(1-based\): column 'solution'"):
        load_checked(recipe)
    # a row found wrong only when it is read: the prompt's messages have a role no chat has
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(6)]
    rows[4]["prompt"] = [{"role": "robot", "content": "q4"}]
    g = tmp_path / "msgs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), g)
    train, _ = load_splits(DataConfig(path=str(g), heldout_path=str(g)), seed=0)
    with pytest.raises(DataError, match=r"msgs.parquet row 5 \(1-based\): column 'prompt' is neither"):
        train[4]
