"""Writes train.parquet and test.parquet here in verl's parquet layout (as verl's examples/data_preprocess/gsm8k.py
writes GSM8K): data_source, prompt (chat messages), ability, reward_model {style, ground_truth}, extra_info {split,
index, question, answer}. The problems are loomrl's one-step word problems with a distracting quantity
(loomrl/env/tasks/calculator.py, families distract_add/_sub/_mul); the test file holds both held-out kinds: new
numbers on training templates (split heldout) and templates training never sees (split heldout_templates).

    python examples/word_problems/make_data.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loomrl.env.tasks.calculator import make_splits

FAMILIES = ["distract_add", "distract_sub", "distract_mul"]


def rows(tasks, split_file: str) -> pa.Table:
    return pa.Table.from_pylist([{
        "data_source": "loomrl/word_problems", "prompt": [{"role": "user", "content": t.prompt}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": t.answer},
        "extra_info": {"split": t.split, "index": i, "question": t.prompt, "answer": t.answer},
        "split": t.split if split_file == "test" else "train"} for i, t in enumerate(tasks)])


if __name__ == "__main__":
    train, heldout = make_splits(FAMILIES, FAMILIES, 3000, 150, seed=7, heldout_template_share=0.25)
    here = Path(__file__).parent
    pq.write_table(rows(train, "train"), here / "train.parquet")
    pq.write_table(rows(heldout, "test"), here / "test.parquet")
    print(f"{len(train)} train, {len(heldout)} test rows in {here}")
