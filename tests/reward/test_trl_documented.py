"""TRL's own documented reward functions (tests/trl_rewards_for_tests.py, as TRL's docs write them) used unchanged on
both task sources, an environment's own task and the same task from a `save_to_disk` dataset: each gets TRL's
conversational shape (loomrl/reward/terms.py states it) and scores what it scores in TRL. They run in reward worker
processes, as a run calls them."""

from __future__ import annotations

import asyncio
import json

import datasets
import pytest
import trl_rewards_for_tests as documented

from loomrl.config import load_config
from loomrl.data import DataConfig, load_splits
from loomrl.reward.pool import RewardPool
from loomrl.reward.terms import RewardStyle, reward_style
from loomrl.rollout.worker import reward_fn_for
from loomrl.types import RolloutStatus, Task, TokenSpan, Trajectory, Turn

M = "trl_rewards_for_tests"
DOCUMENTED = ("docs_token_length", "docs_char_length", "format_reward_func", "async_reward_func", "think_format_reward",
              "correctness_reward")
QUESTION = "Is 4 * 7 equal to the table's value for x? Answer *yes* or *no*."
CALL = '<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>'


def _tool_episode() -> Trajectory:
    """prompt [1, 2]; a reply with a thought and a tool call (7, 8), the tool's answer (9, 10), the final reply (11,
    12): TRL's completion is [assistant with tool_calls, tool, assistant]."""
    call = {"name": "lookup", "arguments": {"q": "x"}, "error": None, "output": "28"}
    turns = [Turn(think="I need the table", act=f"Let me look.\n{CALL}", act_span=TokenSpan(start=2, end=4),
                  logprobs=[0.0, 0.0], versions=[0, 0], obs="28", obs_span=TokenSpan(start=4, end=6),
                  tool_calls=[call]),
             Turn(act="The answer is *yes*.", act_span=TokenSpan(start=6, end=8), logprobs=[0.0, 0.0], versions=[1, 1])]
    return Trajectory(task_id="t", trajectory_id="tr", group_id="g", token_ids=[1, 2, 7, 8, 9, 10, 11, 12],
                      turns=turns, status=RolloutStatus.COMPLETED)


def _one_reply() -> Trajectory:
    turn = Turn(think="4*7 is 28", act="<answer>*yes*</answer>", act_span=TokenSpan(start=2, end=5),
                logprobs=[0.0] * 3, versions=[0] * 3)
    return Trajectory(task_id="t", trajectory_id="tr", group_id="g", token_ids=[1, 2, 7, 8, 9], turns=[turn],
                      status=RolloutStatus.COMPLETED)


def _sources(tmp_path, record_to: str) -> list[Task]:
    """The same task twice: an environment's own (no messages) and a row of a DatasetDict.save_to_disk folder."""
    own = Task(task_id="own", prompt=QUESTION, answer="yes", data={"record_to": record_to + "-own"})
    datasets.disable_progress_bars()
    rows = [{"question": QUESTION, "answer": "yes", "record_to": record_to + "-data"}] * 4
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    train, _ = load_splits(DataConfig(path=str(tmp_path / "ds"), prompt="question", answer="answer", heldout_size=1),
                           seed=0)
    return [own, train[0]]


def _scored(functions, *pairs: tuple[Trajectory, Task]) -> list[Trajectory]:
    terms = ", ".join(f"{{function: {M}:{f}, weight: 1.0}}" for f in functions)
    cfg = load_config(None, [f"reward.functions=[{terms}]", "trainer.total_steps=9"])
    pool = RewardPool(reward_fn_for(cfg.rollout_pool()), workers=1, timeout_s=cfg.reward.timeout_s)

    async def go():
        return [await pool.score(traj, task) for traj, task in pairs]

    try:
        return asyncio.run(go())
    finally:
        pool.close()


def test_trls_documented_functions_score_a_tool_episode_as_trl_does_from_either_source(tmp_path):
    """TRL's tool loop (trl/trainer/grpo_trainer.py _tool_call_loop) makes the completion [assistant turn with
    tool_calls, tool result, final reply]: completion[0] is the tool-call turn (its content the text before the call,
    as TRL's parse_response leaves it) and completion[-1] the final answer, for an environment's own task as for a
    dataset's."""
    tasks = _sources(tmp_path, str(tmp_path / "rec"))
    out = _scored((*DOCUMENTED, "recorded"), *[(_tool_episode(), task) for task in tasks])
    expected = {"docs_token_length": 6.0,  # 7, 8, the tool's 9, 10, then 11, 12
                "docs_char_length": 3.0,  # three messages
                "format_reward_func": 0.0,  # completion[0] is the tool-call turn: no <answer>, in TRL too
                "async_reward_func": 1.0,
                "think_format_reward": 1.0,  # completion[0]'s content starts with its <think>...</think>
                "correctness_reward": 0.6,  # completion[-1]: "The answer is *yes*."
                "recorded": 1.0}
    for traj in out:
        assert traj.error is None and traj.reward_components == expected, (traj.error, traj.reward_components)
    own, data = (json.loads((tmp_path / f"rec-{s}").read_text()) for s in ("own", "data"))
    completion = [{"role": "assistant", "content": "<think>I need the table</think>Let me look.",
                   "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
                  {"role": "tool", "content": "28", "name": "lookup"},
                  {"role": "assistant", "content": "The answer is *yes*."}]
    assert own["completions"] == data["completions"] == [completion]
    assert own["prompts"] == data["prompts"] == [[{"role": "user", "content": QUESTION}]]
    assert own["answer"] == data["answer"] == ["yes"]


def test_trls_documented_functions_score_a_one_reply_episode_from_either_source(tmp_path):
    """One reply: TRL's one-message completion, which its documented functions read as completion[0]["content"]."""
    tasks = _sources(tmp_path, str(tmp_path / "rec"))
    out = _scored(DOCUMENTED, *[(_one_reply(), task) for task in tasks])
    expected = {"docs_token_length": 3.0, "docs_char_length": 1.0, "format_reward_func": 1.0, "async_reward_func": 1.0,
                "think_format_reward": 1.0, "correctness_reward": 0.6}
    for traj in out:
        assert traj.error is None and traj.reward_components == pytest.approx(expected), traj.error


def test_every_documented_trl_function_is_told_trl_style_at_load():
    """TRL's docs' first example, `reward_func(completion_ids, **kwargs)`, takes no `completions`: still TRL's."""
    assert {name: reward_style(getattr(documented, name)) for name in DOCUMENTED} == dict.fromkeys(DOCUMENTED,
                                                                                                  RewardStyle.TRL)
