"""TRL-style reward functions, written as for TRL's GRPOTrainer (prompts, completions, **columns) -> list[float | None],
for tests/reward/ and the end-to-end run there. They run in reward worker processes, so `recorded` writes what it was
given to the file its task's `record_to` column names, for the test to read."""

from __future__ import annotations

import json
import os
import re
import time


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def recorded(prompts, completions, completion_ids, record_to, trainer_state, log_metric, **kwargs):
    """Writes its arguments (the callables and trainer_state by what they are) to record_to[0]; 1.0."""
    log_metric("seen", 1.0)  # TRL >= 1.0 passes log_metric; a function calling it must run
    with open(record_to[0], "w") as f:
        json.dump({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                   "trainer_state": [trainer_state.global_step, trainer_state.max_steps],
                   "pid": os.getpid(), **kwargs}, f, default=lambda o: f"<{type(o).__name__}>")
    return [1.0 for _ in completions]


def accuracy_reward(completions, solution, **kwargs):
    """TRL's own accuracy_reward's form (trl/rewards/accuracy_rewards.py): conversational completions, the first
    message's content against a `solution` column (an exact match here, where TRL parses LaTeX)."""
    return [float(sol in completion[0]["content"]) for completion, sol in zip(completions, solution)]


def exact_answer(prompts, completions, answer, **kwargs):
    return [1.0 if a in _text(c) else 0.0 for c, a in zip(completions, answer)]


def length_penalty(completions, **kwargs):
    return [-len(_text(c)) / 100 for c in completions]


def only_level_two(completions, level, **kwargs):
    """An opinion on level-2 tasks only (TRL: None for the others)."""
    return [1.0 if lv == 2 else None for lv in level]


def no_opinion(completions, **kwargs):
    return [None for _ in completions]


def nan_reward(completions, **kwargs):
    """NaN: no opinion, as TRL's nansum reads it."""
    return [float("nan") for _ in completions]


def says_one(completions, **kwargs):
    return ["1.0" for _ in completions]


async def judged(prompts, completions, **kwargs):
    """An async reward function (TRL awaits them: an LLM judge)."""
    return [0.5 for _ in completions]


def too_many(completions, **kwargs):
    return [0.0, 1.0]


def not_a_list(completions, **kwargs):
    return 1.0


def raises(completions, **kwargs):
    raise ValueError("the judge is down")


def hangs(completions, hang, **kwargs):
    """Sleeps for good where the task's `hang` column is true; else 1.0."""
    if hang[0]:
        time.sleep(600)
    return [1.0]


def backtracks(completions, hang, **kwargs):
    """Where `hang` is true, a catastrophic regex: about 15 s of C code holding the GIL (a thread's timeout cannot even
    fire meanwhile); else a quick match, 1.0."""
    return [float(not re.match(r"(a+)+$", "a" * (28 if hang[0] else 3) + "b"))]


def exits(completions, **kwargs):
    os._exit(3)  # a verifier that segfaults, or the OOM killer


def first_token_parity(prompts, completions, completion_ids, **kwargs):
    """The smoke recipe's parity reward in TRL's form: 1 when the first sampled token id is even."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature (verl/utils/reward_score: default_compute_score), as a verl user writes one: a number."""
    assert data_source == "openai/gsm8k" and extra_info == {"index": 3}, (data_source, extra_info)
    return 1.0 if solution_str.strip().endswith(f"{ground_truth}.") else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, **kwargs):
    """verl's other return form: a dict whose "score" is the reward (the other keys are verl's extra info)."""
    return {"score": 0.5 if ground_truth in solution_str else 0.0, "acc": True}


def one_argument(completion):
    """No shape loomrl, TRL or verl calls: refused at load."""
    return 1.0
