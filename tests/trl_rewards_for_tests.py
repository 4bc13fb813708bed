"""TRL-style reward functions, written as for TRL's GRPOTrainer (prompts, completions, **columns) -> list[float | None],
for tests/reward/ and the end-to-end run there. They run in reward worker processes, so `recorded` writes what it was
given to the file its task's `record_to` column names, for the test to read."""

from __future__ import annotations

import asyncio
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


# -- TRL's documented reward functions, verbatim (bodies and signatures as TRL's docs write them; renamed only where
# the docs reuse a name). A TRL user's code, used unchanged: tests/reward/test_trl_documented.py and
# tests/runtime/test_trl_rewards_end_to_end.py check them on every task source.

# TRL docs, docs/source/grpo_trainer.md, "Example 1: Reward longer completions" (there named `reward_func`)
def docs_token_length(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# TRL docs, docs/source/grpo_trainer.md, "Example 1.1: Reward longer completions (based on the number of characters)"
# (there named `reward_func`). On a conversational completion len() counts its messages, in TRL too.
def docs_char_length(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


# TRL docs, docs/source/grpo_trainer.md, "Example 2: Reward completions with a specific format"
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# TRL docs, docs/source/grpo_trainer.md, "Example 5: Asynchronous reward functions"
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# TRL 1.16, trl/rewards/format_rewards.py `think_format_reward` (`from trl.rewards import think_format_reward`; its
# docstring, docs/source/rewards.md, shortened to its first line): its code as TRL ships it, TRL not being installed here
def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    r"""
    Reward function that checks if the reasoning process is enclosed within `"<think>"` and `"</think>"` tags.
    """
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# TRL's tool-agent example, the repository's examples/scripts/grpo_agent.py `correctness_reward` (listed in
# docs/source/example_overview.md): a tool episode's final answer read from `completion[-1]["content"]`, *yes*/*no*
def correctness_reward(completions, answer, **kwargs):
    """
    Reward Yes/No correctness.
    Model must provide final answer enclosed in stars — *yes* or *no*.
    Does not reward informal yes/no buried in text.
    """
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()

        # detect form *yes* or *no*
        match = re.search(r"\*(yes|no)\*", raw)
        guess = match.group(1) if match else None

        reward = 0.0

        if guess is None:
            reward -= 0.5  # invalid format
        elif guess == ans.lower():
            reward += 0.6  # correct under required format
        else:
            reward -= 1.0  # wrong answer

        rewards.append(reward)

    return rewards
