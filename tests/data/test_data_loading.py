"""The data: section (loomrl/data/): parquet, JSONL, CSV and Arrow files through HF datasets, column mappings, verl's
layout as it is, splits from a column, a held-out file or the seed, and every bad input named by file, row and column
in one line."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomrl.config import ConfigError
from loomrl.data import DataConfig, DataError, load_splits
from loomrl.runtime.checks import load_checked

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "split": "test" if i % 4 == 0 else "train",
         "level": i % 3} for i in range(20)]


def _parquet(path, rows=ROWS):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_columns_mapping_template_system_prompt_and_few_shot(tmp_path):
    f = _parquet(tmp_path / "q.parquet")
    train, held = load_splits(DataConfig(path=f, prompt="question", system_prompt="Be exact.", heldout_size=5,
                                         few_shot=[{"prompt": "What is 1 + 1?", "answer": "2"}]), seed=0)
    assert (len(train), len(held)) == (15, 5)
    t = train[0]
    assert t.messages[0] == {"role": "system", "content": "Be exact."}
    assert t.messages[1:3] == [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    assert t.messages[-1] == {"role": "user", "content": t.prompt} and t.answer == str(int(t.prompt.split()[2]) + 1)
    assert t.data["level"] in (0, 1, 2) and "question" not in t.data and t.split == "train"
    templ, _ = load_splits(DataConfig(path=f, prompt_template="Q{level}: {question}", heldout_size=2), seed=0)
    assert templ[0].prompt.startswith("Q") and ": What is" in templ[0].prompt
    # splits from the seed: fixed and disjoint
    again_train, again_held = load_splits(DataConfig(path=f, prompt="question", heldout_size=5), seed=0)
    assert [t.task_id for t in again_held] == [t.task_id for t in held]
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    other = load_splits(DataConfig(path=f, prompt="question", heldout_size=5), seed=1)[1]
    assert [t.task_id for t in other] != [t.task_id for t in held]
    pickle.loads(pickle.dumps(train))  # a worker process can be handed the source


def test_jsonl_csv_and_arrow_files_and_a_split_column(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS))
    csv = tmp_path / "q.csv"
    csv.write_text("question,answer,split\n" + "\n".join(f"\"{r['question']}\",{r['answer']},{r['split']}" for r in ROWS))
    arrow = tmp_path / "q.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, pa.Table.from_pylist(ROWS).schema) as w:
        w.write_table(pa.Table.from_pylist(ROWS))
    for f in (jsonl, csv, arrow):
        train, held = load_splits(DataConfig(path=str(f), prompt="question", split_column="split"), seed=0)
        assert (len(train), len(held)) == (15, 5), f
        assert all(t.split == "heldout" for t in held) and held[0].prompt == "What is 0 + 1?" and held[0].answer == "1"


def test_verl_layout_read_as_it_is(tmp_path):
    # as verl's examples/data_preprocess/gsm8k.py writes GSM8K
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q{i} Let's think step by step "
                                                                                     "and output the final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i * 2)},
             "extra_info": {"split": "train", "index": i, "answer": f"... #### {i * 2}", "question": f"Q{i}"}}
            for i in range(10)]
    f = _parquet(tmp_path / "train.parquet", rows)
    h = _parquet(tmp_path / "test.parquet", rows[:3])
    train, held = load_splits(DataConfig(path=f, heldout_path=h), seed=0)
    t = train[4]
    assert (t.answer, t.family, t.split) == ("8", "openai/gsm8k", "train")
    assert t.messages == rows[4]["prompt"] and t.data["extra_info"]["index"] == 4
    assert len(held) == 3 and held[0].split == "heldout"
    # the shipped example in verl's layout, through its recipe: paths relative to the recipe's folder
    cfg = load_checked(ROOT / "examples" / "word_problems" / "train.yaml")
    from loomrl.env.registry import tasks_for

    train, held = tasks_for(cfg.env, cfg.data)
    assert (len(train), len(held)) == (3000, 300) and train[0].family == "loomrl/word_problems"


def test_bad_inputs_name_the_file_row_and_column(tmp_path):
    f = _parquet(tmp_path / "q.parquet")
    cases = [
        (DataConfig(path=str(tmp_path / "nope*.parquet")), "no file matches"),
        (DataConfig(path=f), "q.parquet: no column 'prompt' (data.prompt); the columns are question, answer, split, "
                             "level; set data.prompt=<column>"),
        (DataConfig(path=f, prompt="question", answer="solution"), "no column 'solution' (data.answer)"),
        (DataConfig(path=f, prompt="question", split_column="split", heldout_values=["dev"]),
         "no row has split in data.heldout_values ['dev']; the column holds ['test', 'train']"),
    ]
    (tmp_path / "q.txt").write_text("x")
    cases.append((DataConfig(path=str(tmp_path / "q.txt")), "cannot tell the format from the name; set data.format"))
    for cfg, message in cases:
        with pytest.raises(DataError) as err:
            load_splits(cfg, seed=0)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    bad = [dict(r) for r in ROWS]
    bad[7]["answer"] = None
    bad[11]["question"] = "  "
    g = _parquet(tmp_path / "bad.parquet", bad)
    with pytest.raises(DataError, match=r"bad.parquet row 8 \(1-based\): column 'answer' is null or empty; fix the row "
                                        r"or set data.skip_malformed=true .*\(2 in this file\)"):
        load_splits(DataConfig(path=g, prompt="question"), seed=0)
    train, held = load_splits(DataConfig(path=g, prompt="question", skip_malformed=True, heldout_size=3), seed=0)
    assert len(train) + len(held) == 18 and train.skipped == 2
    # at load, the same line as a config error
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env: {name: chat}\ndata: {path: bad.parquet, prompt: question}\n")
    with pytest.raises(ConfigError, match=r"^data error: .*bad.parquet row 8 \(1-based\): column 'answer'"):
        load_checked(recipe)
    with pytest.raises(ConfigError, match="env.name=chat brings no tasks of its own; add a data: section"):
        load_checked(None, ["env.name=chat"])


def test_a_hub_dataset_is_read_from_the_local_cache_only(tmp_path, monkeypatch):
    """Nothing is downloaded at run time. A cached dataset is laid out as huggingface_hub keeps a snapshot (no hub
    here to fetch one from); one that is not cached is one line, at once, without trying the network."""
    import time

    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "datasets--me--tiny" / "snapshots" / "abc123"
    (snapshot / "data").mkdir(parents=True)
    (tmp_path / "hub" / "datasets--me--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--me--tiny" / "refs" / "main").write_text("abc123")
    pq.write_table(pa.Table.from_pylist(ROWS), snapshot / "data" / "train-00000-of-00001.parquet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    train, held = load_splits(DataConfig(hub="me/tiny", prompt="question", split_column="split"), seed=0)
    assert (len(train), len(held)) == (15, 5) and held[0].answer == "1"
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"^data error: data.hub=nobody/no-such-dataset is not in the local Hugging Face "
                                        r"cache .*give data.path$"):
        load_splits(DataConfig(hub="nobody/no-such-dataset"), seed=0)
    assert time.perf_counter() - t0 < 10, "it tried the network"


def test_a_large_file_is_read_lazily(tmp_path):
    n = 200_000
    f = _parquet(tmp_path / "big.parquet", [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)])
    train, held = load_splits(DataConfig(path=f), seed=0, n_heldout=100)
    assert (len(train), len(held)) == (n - 100, 100)
    assert train[n - 101].answer.isdigit() and train[-1].task_id.startswith("big-")
    # what a split holds per task: two integers, not a row
    assert train._row.nbytes + train._part.nbytes <= 12 * len(train)
