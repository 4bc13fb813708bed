"""Rewards users already wrote (loomrl/reward/terms.py, pool.py): TRL-style functions used unchanged with plain and
chat prompts (in reward worker processes, as a run calls them), a dataset's columns, None as no opinion, weights, and
the config's one-line errors."""

from __future__ import annotations

import asyncio
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomrl.config import ConfigError, load_config
from loomrl.data import DataConfig, load_splits
from loomrl.reward.pool import RewardPool, load_terms
from loomrl.rollout.worker import reward_fn_for
from loomrl.types import RolloutStatus, Task, TokenSpan, Trajectory, Turn

M = "trl_rewards_for_tests"


def _traj(text="The answer is 42.", think="", obs=None) -> Trajectory:
    """prompt [1, 2], then the reply (sampled [7, 8]); with `obs`, a tool call first, its result, then the reply."""
    turns = [Turn(think=think, act=text, act_span=TokenSpan(start=2, end=4), logprobs=[0.0, 0.0], versions=[0, 0])]
    if obs:
        call = {"name": "lookup", "arguments": {"q": "x"}, "error": None}
        turns = [Turn(act="lookup(x)", act_span=TokenSpan(start=2, end=3), logprobs=[0.0], versions=[0],
                      obs=obs, obs_span=TokenSpan(start=3, end=4), tool_calls=[call]),
                 Turn(act=text, act_span=TokenSpan(start=4, end=5), logprobs=[0.0], versions=[3])]
    traj = Trajectory(task_id="t", trajectory_id="tr", group_id="g", token_ids=[1, 2, 7, 8, 9], turns=turns,
                      status=RolloutStatus.COMPLETED)
    traj.metadata.policy_version_max = 3
    return traj


def _pool(*functions: tuple[str, float], timeout_s: float = 30.0) -> RewardPool:
    terms = ", ".join(f"{{function: {M}:{f}, weight: {w}}}" for f, w in functions)
    cfg = load_config(None, [f"reward.functions=[{terms}]", f"reward.timeout_s={timeout_s}", "trainer.total_steps=9"])
    return RewardPool(reward_fn_for(cfg.rollout_pool()), workers=1, timeout_s=cfg.reward.timeout_s)


def _scored(pool: RewardPool, *pairs: tuple[Trajectory, Task]) -> list[Trajectory]:
    async def go():
        return [await pool.score(traj, task) for traj, task in pairs]

    try:
        return asyncio.run(go())
    finally:
        pool.close()


def test_trl_functions_get_what_trl_passes_plain_and_chat(tmp_path):
    plain = Task(task_id="t", prompt="What is 6*7?", answer="42", data={"level": 2, "record_to": str(tmp_path / "p")})
    chat = Task(task_id="t", prompt="x?", answer="42", data={"answer": 42, "record_to": str(tmp_path / "c")},
                messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "x?"}])
    out = _scored(_pool(("recorded", 1.0)), (_traj(think="6*7"), plain), (_traj(obs="41"), chat))
    assert [t.reward_components for t in out] == [{"recorded": 1.0}] * 2
    call = json.loads((tmp_path / "p").read_text())
    assert call["pid"] != os.getpid()  # it ran in a reward worker process
    # an environment's own task is a chat too: TRL's conversational shape (loomrl/reward/terms.py)
    assert call["prompts"] == [[{"role": "user", "content": "What is 6*7?"}]]
    assert call["completions"] == [[{"role": "assistant", "content": "<think>6*7</think>The answer is 42."}]]
    assert call["completion_ids"] == [[7, 8]] and call["answer"] == ["42"] and call["level"] == [2]
    assert call["trainer_state"] == [3, 9] and call["log_extra"] == "<function>"
    call = json.loads((tmp_path / "c").read_text())
    assert call["prompts"] == [chat.messages]
    assert call["completions"] == [[
        {"role": "assistant", "content": "lookup(x)",
         "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
        {"role": "tool", "content": "41", "name": "lookup"},
        {"role": "assistant", "content": "The answer is 42."}]]
    assert call["completion_ids"] == [[7, 8, 9]]  # after the prompt, the tool's answer (8) too, as TRL's
    assert call["answer"] == [42]  # a dataset's own answer column, as it is, over Task.answer


def test_trl_accuracy_reward_reads_its_solution_column_from_a_dataset(tmp_path):
    """TRL's accuracy_reward(completions, solution): a dataset whose answer column is `solution` passes it so named."""
    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(4)]),
                   path)
    tasks, _ = load_splits(DataConfig(path=str(path), prompt="question", answer="solution", heldout_size=1), seed=0)
    task = tasks[0]
    assert task.data == {"solution": task.answer}
    right, wrong = _scored(_pool(("accuracy_reward", 1.0)), (_traj(f"It is {task.answer}."), task),
                           (_traj("It is 0."), task))
    assert right.reward_components == {"accuracy_reward": 1.0} and wrong.reward_components == {"accuracy_reward": 0.0}


def test_weights_make_the_total_and_components_stay_raw():
    out, = _scored(_pool(("exact_answer", 2.0), ("length_penalty", 0.5), ("judged", -1.0)),
                   (_traj(), Task(task_id="t", prompt="q", answer="42")))
    assert out.reward_components == {"exact_answer": 1.0, "length_penalty": pytest.approx(-0.17), "judged": 0.5}
    assert out.total_reward == pytest.approx(2.0 - 0.085 - 0.5)


def test_none_is_no_opinion_and_all_none_is_no_reward():
    level1, level2 = _scored(_pool(("exact_answer", 1.0), ("only_level_two", 3.0)),
                             (_traj(), Task(task_id="t", prompt="q", answer="42", data={"level": 1})),
                             (_traj(), Task(task_id="t", prompt="q", answer="42", data={"level": 2})))
    assert level1.reward_components == {"exact_answer": 1.0} and level1.total_reward == 1.0 and level1.scored
    assert level2.reward_components == {"exact_answer": 1.0, "only_level_two": 1.0} and level2.total_reward == 4.0
    none, = _scored(_pool(("no_opinion", 1.0), ("only_level_two", 1.0), ("nan_reward", 1.0)),
                    (_traj(), Task(task_id="t", prompt="q", answer="42", data={"level": 1})))
    assert none.reward_failed and not none.scored
    assert none.error == "reward failed: every reward function returned None (no opinion)"


def test_reward_config_errors_are_one_line():
    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_terms(load_config(None, list(overrides)).reward)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert error(f"reward.functions=[{{function: {M}:exact_answer}}, {{function: nope_mod:f}}]").startswith(
        "config error: reward.functions[1].function=nope_mod:f: no module named 'nope_mod'")
    assert error(f"reward.functions=[{{function: {M}:nope}}]").startswith(
        f"config error: reward.functions[0].function={M}:nope: module '{M}' (")
    assert error(f"reward.functions=[{{function: {M}:exact_answer, weight: .nan}}]").startswith(
        "config error: 'reward.functions.0.weight': Input should be a finite number (got nan)")
    assert error(f"reward.functions=[{{function: {M}:exact_answer, weight: heavy}}]").startswith(
        "config error: 'reward.functions.0.weight': Input should be a valid number")
    assert "give reward.function or reward.functions, not both" in error(
        f"reward.function={M}:raises", f"reward.functions=[{{function: {M}:exact_answer}}]")
    assert "two TRL-style functions named" in error(
        f"reward.functions=[{{function: {M}:exact_answer}}, {{function: {M}:exact_answer, weight: 2}}]")


def test_verls_compute_score_is_called_as_verl_calls_it():
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info): before, it was called as a
    loomrl-style fn(trajectory, task) and every trajectory was reward_failed (TypeError)."""
    task = Task(task_id="t", prompt="6*7?", answer="42", family="openai/gsm8k",
                data={"data_source": "openai/gsm8k", "extra_info": {"index": 3}})
    wrong = Task(task_id="t", prompt="6*7?", answer="41", data={"data_source": "openai/gsm8k",
                                                               "extra_info": {"index": 3}})
    out = _scored(_pool(("compute_score", 1.0), ("compute_score_dict", 2.0)), (_traj(), task), (_traj(), wrong))
    assert [t.reward_components for t in out] == [{"compute_score": 1.0, "compute_score_dict": 0.5},
                                                  {"compute_score": 0.0, "compute_score_dict": 0.0}]
    assert out[0].total_reward == 2.0 and not out[0].error


def test_a_reward_function_of_no_known_shape_stops_at_load_naming_its_parameters():
    with pytest.raises(ConfigError, match=r"^config error: reward.function: trl_rewards_for_tests:one_argument: it "
                                          r"takes \(completion\); a reward function is fn\(trajectory, task\)"):
        load_terms(load_config(None, [f"reward.function={M}:one_argument"]).reward)
