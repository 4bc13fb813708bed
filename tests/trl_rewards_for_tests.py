"""TRL-style reward functions, written as for TRL's GRPOTrainer (prompts, completions, **columns) -> list[float | None],
for tests/reward/test_reward_terms.py and the end-to-end run there. `seen` records every call's arguments."""

from __future__ import annotations

import time

seen: list[dict] = []


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_answer(prompts, completions, answer, **kwargs):
    seen.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    return [1.0 if a in _text(c) else 0.0 for c, a in zip(completions, answer)]


def length_penalty(completions, **kwargs):
    return [-len(_text(c)) / 100 for c in completions]


def only_level_two(completions, level, **kwargs):
    """An opinion on level-2 tasks only (TRL: None for the others)."""
    return [1.0 if lv == 2 else None for lv in level]


def no_opinion(completions, **kwargs):
    return [None for _ in completions]


def too_many(completions, **kwargs):
    return [0.0, 1.0]


def raises(completions, **kwargs):
    raise ValueError("the judge is down")


def hangs(completions, **kwargs):
    time.sleep(30)
    return [1.0]


def first_token_parity(prompts, completions, completion_ids, **kwargs):
    """The smoke recipe's parity reward in TRL's form: 1 when the first sampled token id is even."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]
