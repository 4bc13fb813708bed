"""Composite rewards (loomrl/reward/composite.py, process.py): term weights and gates, the process terms on trajectories
recorded from a real environment's steps, completion_time against the group, and reward.terms through the reward pool
and the config."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from loomrl.config import ConfigError, load_config
from loomrl.env import EpisodeContext
from loomrl.env.api import environment_for
from loomrl.reward.composite import Composite, Gate, Term
from loomrl.rollout.worker import reward_pool_for
from loomrl.types import RolloutStatus, Task, Trajectory, Turn

TASK = Task(task_id="t", prompt="What is 6*7?", answer="42")


def _traj(*acts: str, wall: float = 1.0, calls: list[list[dict]] | None = None) -> Trajectory:
    calls = calls or [[] for _ in acts]
    traj = Trajectory(task_id="t", trajectory_id="tr", group_id="g", status=RolloutStatus.COMPLETED,
                      turns=[Turn(act=a, tool_calls=c) for a, c in zip(acts, calls)])
    traj.metadata.wall_time = wall
    return traj


def _terms(**spec: tuple[float, str | None]) -> Composite:
    return Composite({name: Term(name, w, Gate.parse(g) if g else None) for name, (w, g) in spec.items()})


def test_weights_and_gates():
    gated = _terms(format=(1.0, "correct"))
    right = gated.score(_traj("a"), {"correct": 1.0, "format": 0.1})
    wrong = gated.score(_traj("a"), {"correct": 0.0, "format": 0.1})
    assert right.total_reward == pytest.approx(1.1) and wrong.total_reward == 0.0
    assert wrong.reward_components == {"correct": 0.0, "format": 0.1}  # stored raw, gate or not
    only_wrong = _terms(format=(-0.5, "not correct"))  # e.g. a penalty that applies to wrong answers only
    assert only_wrong.score(_traj("a"), {"correct": 1.0, "format": 1.0}).total_reward == pytest.approx(1.0)
    assert only_wrong.score(_traj("a"), {"correct": 0.0, "format": 1.0}).total_reward == pytest.approx(-0.5)
    threshold = _terms(bonus=(2.0, "judge >= 0.5"))
    assert threshold.score(_traj("a"), {"judge": 0.5, "bonus": 1.0}).total_reward == pytest.approx(2.5)
    assert threshold.score(_traj("a"), {"judge": 0.4, "bonus": 1.0}).total_reward == pytest.approx(0.4)
    # a reward function's own weight multiplies in; unnamed components count with weight 1
    both = _terms(b=(3.0, None)).score(_traj("a"), {"a": 1.0, "b": 1.0}, weights={"a": 0.5, "b": 2.0})
    assert both.total_reward == pytest.approx(0.5 + 6.0)


def test_a_gate_on_a_missing_component_is_closed_and_said_once(caplog):
    c = _terms(format=(1.0, "corect"))
    with caplog.at_level(logging.WARNING, logger="loomrl.reward.composite"):
        for _ in range(3):
            assert c.score(_traj("a"), {"correct": 1.0, "format": 0.1}).total_reward == 1.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "reward.terms.format.gate" in said[0] and "'corect'" in said[0]
    assert "correct, format" in said[0]


def _recorded(actions: list[str]) -> Trajectory:
    """Actions played against a real environment (the test tool environment: tools that work, raise, or are called
    badly): each turn keeps the tool-call records the environment's step returned, as the agent loop keeps them."""
    cfg = load_config(None, ["env.name=custom_envs_for_tests:make_lookup", "env.args.table={k: 7}"])
    env = environment_for(cfg.env).episode(EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=2.0))

    async def play() -> list[Turn]:
        await env.reset(TASK)
        turns = []
        for a in actions:
            step = await env.step(a)
            turns.append(Turn(act=a, tool_calls=step.info.get("tool_calls", []), done=step.done))
        return turns

    traj = _traj()
    traj.turns = asyncio.run(play())
    return traj


def test_process_terms_on_recorded_turns_are_placed_at_their_turn():
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "%s"}}</tool_call>'
    bad = '<tool_call>{"name": "add", "arguments": {"x": "two"}}</tool_call>'
    traj = _recorded([call % "k",  # works
                      bad,  # the tool refuses the arguments: tool_error
                      "<tool_call>{not json</tool_call>",  # malformed_call
                      bad,  # the same action again: repeated_action (and tool_error again)
                      "The answer is 7. 答案是七。"])  # language_mixing; a reply without a call ends the episode
    # (a call the tool itself fails on, lookup of a missing key raising KeyError, is the tool's bug: not tool_error)
    assert _recorded([call % "zz"]).turns[0].tool_calls[0]["failure"] == "raised"
    assert traj.turns[-1].done
    c = _terms(tool_error=(-0.1, None), malformed_call=(-0.2, None), repeated_action=(-0.3, None),
               language_mixing=(-0.4, None))
    c.score(traj, {"correct": 1.0})
    assert traj.reward_components == {"correct": 1.0, "tool_error": 2.0, "malformed_call": 1.0,
                                      "repeated_action": 1.0, "language_mixing": 1.0}
    assert [t.reward_terms for t in traj.turns] == [
        {}, {"tool_error": -0.1}, {"malformed_call": -0.2}, {"tool_error": -0.1, "repeated_action": -0.3},
        {"language_mixing": -0.4}]
    assert traj.total_reward == pytest.approx(1.0 - 0.2 - 0.2 - 0.3 - 0.4)
    # per-turn credit reads them where they were earned; the outcome sits at the last turn
    assert traj.turn_rewards() == pytest.approx([0.0, -0.1, -0.2, -0.4, 1.0 - 0.4])
    assert sum(traj.turn_rewards()) == pytest.approx(traj.total_reward)
    # scored again (a retried reward): the same, not twice the penalties
    c.score(traj, {"correct": 1.0})
    assert traj.total_reward == pytest.approx(1.0 - 1.1)
    # gated: penalties only where the answer is wrong
    wrong_only = _terms(tool_error=(-0.1, "not correct"))
    assert wrong_only.score(traj, {"correct": 1.0}).total_reward == pytest.approx(1.0)
    assert wrong_only.score(traj, {"correct": 0.0}).total_reward == pytest.approx(-0.2)


def test_language_mixing_ignores_a_stray_symbol_and_one_script():
    from loomrl.reward.process import language_mixing

    turns = [Turn(act="The area is π r², café"), Turn(act="答案是七。"), Turn(act="これは答えです"),
             Turn(act="Ответ: seven")]
    assert language_mixing(turns) == [0.0, 0.0, 0.0, 1.0]


def test_completion_time_against_the_group():
    c = _terms(completion_time=(0.5, "correct"))
    group = [_traj("a", wall=w) for w in (1.0, 2.0, 3.0, 10.0)]
    for t, correct in zip(group, (1.0, 1.0, 0.0, 1.0)):
        c.score(t, {"correct": correct})
    failed = _traj("a", wall=0.1)
    failed.status = RolloutStatus.ENV_ERROR  # not played out: no reward, and not in the group's mean
    c.score_group([*group, failed])
    mean = (1.0 + 2.0 + 10.0) / 3  # the right answers' (the gate's) mean wall time
    raws = [min(1.0, max(-1.0, (mean - w) / mean)) for w in (1.0, 2.0, 3.0, 10.0)]
    assert [t.reward_components["completion_time"] for t in group] == pytest.approx(raws)
    assert [t.total_reward for t in group] == pytest.approx([1 + 0.5 * raws[0], 1 + 0.5 * raws[1], 0.0,
                                                              1 + 0.5 * raws[3]])
    assert "completion_time" not in failed.reward_components
    c.score_group(group)  # twice: the same totals
    assert group[0].total_reward == pytest.approx(1 + 0.5 * raws[0])


def test_reward_terms_through_the_config_and_the_pool():
    cfg = load_config("examples/calculator_smollm2.yaml", [
        "env.args.format_weight=0.1", "reward.terms={format: {gate: correct}, malformed_call: {weight: -0.05}}"])
    task = Task(task_id="t", prompt="p", answer="27")
    pool = reward_pool_for(cfg.rollout_pool())

    async def go(*trajs):
        return [await pool.score(t, task) for t in trajs]

    right = _traj("calc(16 + 11)", "The answer is 27.")
    wrong = _traj("calc(16 - 11)", "The answer is 5.")
    bad = _traj("calc(16 +", "The answer is 5.", calls=[[{"name": "calc", "error": "unbalanced parentheses"}], []])
    right.final_answer, wrong.final_answer, bad.final_answer = "27", "5", "5"  # as the episode sets them
    try:
        right, wrong, bad = asyncio.run(go(right, wrong, bad))
    finally:
        pool.close()
    assert right.reward_components == {"correct": 1.0, "format": pytest.approx(0.1), "malformed_call": 0.0}
    assert right.total_reward == pytest.approx(1.1)
    assert wrong.reward_components["format"] == pytest.approx(0.1) and wrong.total_reward == 0.0
    assert bad.reward_components["malformed_call"] == 1.0 and bad.total_reward == pytest.approx(-0.05)
    assert bad.turns[0].reward_terms == {"malformed_call": -0.05}


@pytest.mark.integration
def test_a_run_stores_and_logs_every_term(tmp_path):
    """A tiny run (a random model; its reward the parity of the first token, as in the smoke recipe) with the process
    terms and completion_time: each stored trajectory carries every term raw, its turns their penalties, and each
    step's metrics log every term on its own."""

    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train
    from loomrl.store import read_rows

    cfg = load_config("examples/calculator_tiny.yaml", [
        f"output_dir={tmp_path}", "progress=false", "name=terms", "runtime.mode=sync", "trainer.total_steps=1",
        "eval.n_tasks=1", "reward.terms={completion_time: {weight: 0.1}, malformed_call: {weight: -0.1}, "
        "repeated_action: {weight: -0.1}, parity: {gate: 'parity >= 0'}}"])
    train(cfg)
    rows = [r for r in read_rows(cfg.run_dir / "trajectories") if r["total_reward"] is not None]
    assert len(rows) == 8
    for r in rows:
        comps = r["reward_components"]
        assert set(comps) == {"parity", "completion_time", "malformed_call", "repeated_action"}
        penalties = sum(v for t in r["turns"] for v in t["reward_terms"].values())
        assert penalties == pytest.approx(-0.1 * (comps["malformed_call"] + comps["repeated_action"]))
        assert r["total_reward"] == pytest.approx(comps["parity"] + 0.1 * comps["completion_time"] + penalties)
    # a random model's turns: relative times spread around the group's mean
    times = [r["reward_components"]["completion_time"] for r in rows]
    assert min(times) < 0 < max(times)
    step = next(m for m in read_metrics(cfg.run_dir) if m["kind"] == "train")
    assert {"reward/parity", "reward/completion_time", "reward/malformed_call", "reward/repeated_action"} <= set(step)


@pytest.mark.parametrize("override, said", [
    ("reward.terms={format: {gate: 'correct >'}}", "reward.terms.format.gate"),
    ("reward.terms={tool_error: {weight: 0.1}}", "give it a negative weight"),
    ("reward.terms={format: {weight: .nan}}", "reward.terms.format.weight"),
])
def test_config_errors_name_the_field(override, said):
    with pytest.raises(ConfigError) as err:
        load_config("examples/calculator_smollm2.yaml", [override])
    assert said in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_the_process_terms_a_recipe_may_name_are_the_ones_computed():
    """config/terms.py names the process terms (the config package imports no reward code); reward/process.py computes
    them: the two lists must agree, in order."""
    from loomrl.config.terms import PROCESS_TERMS
    from loomrl.reward.process import CHECKS

    assert tuple(CHECKS) == PROCESS_TERMS
