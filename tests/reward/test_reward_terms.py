"""Rewards users already wrote (loomrl/reward/terms.py, pool.py): TRL-style functions used unchanged with plain and
chat prompts, None as no opinion, weights, failures and hangs bounded as reward_failed, and a run trained on two
weighted TRL-style functions with each component logged."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import trl_rewards_for_tests as trl

from loomrl.config import ConfigError, load_config
from loomrl.metrics.logger import read_metrics
from loomrl.reward.pool import RewardPool, load_terms
from loomrl.reward.terms import CombinedReward
from loomrl.rollout.worker import reward_fn_for
from loomrl.runtime.run import train
from loomrl.store import read_trajectories
from loomrl.types import RolloutStatus, Task, TokenSpan, Trajectory, Turn

ROOT = Path(__file__).resolve().parents[2]
M = "trl_rewards_for_tests"


def _traj(text="The answer is 42.", think="", obs=None) -> Trajectory:
    turns = [Turn(think=think, act=text, act_span=TokenSpan(start=2, end=4), logprobs=[0.0, 0.0], versions=[0, 0])]
    if obs:
        turns = [Turn(act="lookup(x)", act_span=TokenSpan(start=2, end=3), logprobs=[0.0], versions=[0],
                      obs=obs, obs_span=TokenSpan(start=3, end=4), tool_calls=[{"name": "lookup"}]),
                 Turn(act=text, act_span=TokenSpan(start=4, end=5), logprobs=[0.0], versions=[0])]
    return Trajectory(task_id="t", trajectory_id="tr", group_id="g", token_ids=[1, 2, 7, 8, 9], turns=turns,
                      status=RolloutStatus.COMPLETED)


def _score(pool: RewardPool, traj: Trajectory, task: Task) -> Trajectory:
    return asyncio.run(pool.score(traj, task))


def _pool(*functions: tuple[str, float], timeout_s: float = 30.0) -> RewardPool:
    cfg = load_config(None, [f"reward.functions=[{', '.join(f'{{function: {M}:{f}, weight: {w}}}' for f, w in functions)}]",
                             f"reward.timeout_s={timeout_s}"])
    return RewardPool(reward_fn_for(cfg), workers=1, timeout_s=cfg.reward.timeout_s)


def test_trl_functions_get_what_trl_passes_plain_and_chat():
    trl.seen.clear()
    pool = _pool(("exact_answer", 1.0))
    plain = Task(task_id="t", prompt="What is 6*7?", answer="42", data={"level": 2})
    out = _score(pool, _traj(think="6*7"), plain)
    assert out.reward_components == {"exact_answer": 1.0} and out.total_reward == 1.0
    call = trl.seen[-1]
    assert call["prompts"] == ["What is 6*7?"] and call["completions"] == ["<think>6*7</think>The answer is 42."]
    assert call["answer"] == ["42"] and call["level"] == [2] and call["completion_ids"] == [[7, 8]]
    assert call["trainer_state"] is None
    chat = Task(task_id="t", prompt="x?", answer="42", messages=[{"role": "system", "content": "s"},
                                                                  {"role": "user", "content": "x?"}])
    _score(pool, _traj(obs="41"), chat)
    call = trl.seen[-1]
    assert call["prompts"] == [chat.messages]
    assert call["completions"] == [[{"role": "assistant", "content": "lookup(x)"}, {"role": "tool", "content": "41"},
                                    {"role": "assistant", "content": "The answer is 42."}]]


def test_weights_make_the_total_and_components_stay_raw():
    pool = _pool(("exact_answer", 2.0), ("length_penalty", 0.5))
    out = _score(pool, _traj(), Task(task_id="t", prompt="q", answer="42"))
    assert out.reward_components == {"exact_answer": 1.0, "length_penalty": pytest.approx(-0.17)}
    assert out.total_reward == pytest.approx(2.0 - 0.085)


def test_none_is_no_opinion_and_all_none_is_no_reward():
    pool = _pool(("exact_answer", 1.0), ("only_level_two", 1.0))
    level1 = _score(pool, _traj(), Task(task_id="t", prompt="q", answer="42", data={"level": 1}))
    assert level1.reward_components == {"exact_answer": 1.0} and level1.total_reward == 1.0 and level1.scored
    level2 = _score(pool, _traj(), Task(task_id="t", prompt="q", answer="42", data={"level": 2}))
    assert level2.reward_components == {"exact_answer": 1.0, "only_level_two": 1.0} and level2.total_reward == 2.0
    none = _score(_pool(("no_opinion", 1.0)), _traj(), Task(task_id="t", prompt="q", answer="42"))
    assert none.reward_failed and not none.scored and "every reward function returned None" in none.error


def test_a_raising_or_wrong_length_function_is_reward_failed():
    task = Task(task_id="t", prompt="q", answer="42")
    raised = _score(_pool(("raises", 1.0)), _traj(), task)
    assert raised.reward_failed and "ValueError: the judge is down" in raised.error
    wrong = _score(_pool(("too_many", 1.0)), _traj(), task)
    assert wrong.reward_failed and "too_many returned a list of 2" in wrong.error


def test_a_hung_function_ends_reward_failed_within_its_timeout_and_the_pool_goes_on():
    cfg = load_config(None, [f"reward.functions=[{{function: {M}:hangs}}, {{function: {M}:exact_answer}}]",
                             "reward.timeout_s=0.5"])
    pool = RewardPool(reward_fn_for(cfg), workers=1, timeout_s=0.5)
    hung_only = RewardPool(CombinedReward([t for t in load_terms(cfg) if t.name == "hangs"]), workers=1, timeout_s=0.5)
    task = Task(task_id="t", prompt="q", answer="42")
    t0 = time.perf_counter()
    out = _score(pool, _traj(), task)
    assert out.reward_failed and "ran past reward.timeout_s=0.5s" in out.error
    assert time.perf_counter() - t0 < 2.0
    # the one worker thread is stuck in the hung call; the next trajectory is scored on a fresh one
    ok = _score(RewardPool(CombinedReward([t for t in load_terms(cfg) if t.name == "exact_answer"]), workers=1), _traj(),
                task)
    assert ok.reward_components == {"exact_answer": 1.0}
    _score(hung_only, _traj(), task)
    t0 = time.perf_counter()
    again = _score(hung_only, _traj(), task)  # a second hang: the first's thread did not block it
    assert again.reward_failed and time.perf_counter() - t0 < 2.0 and hung_only.hung == 2
    hung_only.close()
    pool.close()


def test_reward_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"reward.functions\[1\].function=nope_mod:f: no module named 'nope_mod'"):
        load_terms(load_config(None, [f"reward.functions=[{{function: {M}:exact_answer}}, {{function: nope_mod:f}}]"]))
    with pytest.raises(ConfigError, match="'reward.functions.0': weight: nan is not a finite number"):
        load_config(None, [f"reward.functions=[{{function: {M}:exact_answer, weight: .nan}}]"])
    with pytest.raises(ConfigError, match="give reward.function or reward.functions, not both"):
        load_config(None, [f"reward.function={M}:raises", f"reward.functions=[{{function: {M}:exact_answer}}]"])


def test_a_run_trains_on_two_weighted_trl_functions_and_logs_each(tmp_path):
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={tmp_path}", "progress=false", "trainer.total_steps=2", "eval.n_tasks=2", "reward.function=null",
        f"reward.functions=[{{function: {M}:first_token_parity, weight: 1.0}}, "
        f"{{function: {M}:length_penalty, weight: 0.1}}]"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()

    components = [json.loads(r["reward_components"]) for r in rows if r["reward_components"]]
    assert components and all(set(c) == {"first_token_parity", "length_penalty"} for c in components)
    # every step whose record has rollout metrics (an async step may receive no new group) has each component's mean
    stepped = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "rollout/reward_mean" in m]
    assert stepped and all("reward/first_token_parity" in m and "reward/length_penalty" in m for m in stepped)
