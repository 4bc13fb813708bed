"""reasoning-gym as a generated-task source (env.name=reasoning_gym, loomrl/env/tasks/reasoning_gym.py): its dataset
names checked at load, train and held-out tasks generated on demand from disjoint item seeds and the same for a seed,
reasoning-gym's own scorer as the reward, and two training steps on the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import random

import pytest

pytest.importorskip("reasoning_gym")

from ledger_checks import check_run  # noqa: E402

from loomrl.config import ConfigError, load_config  # noqa: E402
from loomrl.env.api import EpisodeContext, TaskSetup, make_environment, resolve_factory  # noqa: E402
from loomrl.types import Trajectory  # noqa: E402

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

SETUP = TaskSetup(families=None, n_train=40, n_heldout=10, seed=0, heldout_template_share=0.0, sandbox="process")


def _environment(**args):
    factory, extra = resolve_factory("reasoning_gym")
    return make_environment(factory, {"tasks": ["basic_arithmetic", "chain_sum"], **args, **extra}, "reasoning_gym")


@pytest.mark.parametrize(("args", "says"), [
    ({"tasks": ["basic_arithmetc"]}, "no reasoning-gym dataset 'basic_arithmetc'; did you mean basic_arithmetic"),
    ({"tasks": ["chain_sum"], "config": {"basic_arithmetic": {}}}, "env.args.config.basic_arithmetic: not one of"),
    ({"tasks": ["chain_sum"], "config": {"chain_sum": {"seed": 3}}}, "env.args.config.chain_sum.seed: set by loomrl"),
    ({"tasks": ["chain_sum"], "config": {"chain_sum": {"min_terms": 5, "max_terms": 2}}}, "env.args.config.chain_sum:"),
    ({"tasks": ["chain_sum"], "config": {"chain_sum": {"terms": 2}}}, "unexpected keyword argument 'terms'"),
    ({"tasks": []}, "env.args.tasks"),
])
def test_dataset_names_and_their_settings_are_checked_at_load(args, says):
    with pytest.raises(ConfigError) as err:
        _environment(**args)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_splits_are_generated_on_demand_disjoint_and_the_same_for_a_seed():
    env = _environment(config={"chain_sum": {"min_digits": 3, "max_digits": 4}})
    train, heldout = env.tasks(SETUP)
    assert (len(train), len(heldout)) == (40, 10) and train[-1].task_id == "rg-train-39"
    assert {t.family for t in train} == {"basic_arithmetic", "chain_sum"} and {t.split for t in heldout} == {"heldout"}
    # held out: each family's items 0..4; training: the items after them (reasoning-gym seeds item i with seed + i)
    index = {s: {(t.family, t.data["entry"]["metadata"]["source_index"]) for t in tasks}
             for s, tasks in (("train", train), ("heldout", heldout))}
    assert index["train"].isdisjoint(index["heldout"])
    assert max(i for _, i in index["heldout"]) < min(i for _, i in index["train"])
    chain = [t.prompt for t in [*train, *heldout] if t.family == "chain_sum"]  # 3-4 digit sums: no repeats
    assert len(set(chain)) == len(chain)
    again_train, again_heldout = _environment(config={"chain_sum": {"min_digits": 3, "max_digits": 4}}).tasks(SETUP)
    assert [t.prompt for t in again_train] == [t.prompt for t in train]
    assert [t.prompt for t in again_heldout] == [t.prompt for t in heldout]
    other, _ = env.tasks(dataclasses.replace(SETUP, seed=1))
    assert [t.prompt for t in other] != [t.prompt for t in train]
    # lazy and small: the split pickles as its settings, a task as its entry
    assert len(pickle.dumps(train)) < 1000 and pickle.loads(pickle.dumps(train))[7] == train[7]
    assert len(pickle.dumps(train[0])) < 1500 and train[2:4] == [train[2], train[3]]


def test_reasoning_gyms_scorer_is_the_reward():
    env = _environment()
    task = env.tasks(SETUP)[0][0]
    episode = env.episode(EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=1.0))

    async def play(reply: str):
        obs = await episode.reset(task)
        return obs, await episode.step(reply)

    obs, right = asyncio.run(play(f"<think>easy</think>So: <answer>{task.answer}</answer>"))
    assert obs.messages[0]["role"] == "system" and "<answer>" in obs.messages[0]["content"]  # reasoning-gym's own
    assert obs.messages[1] == {"role": "user", "content": task.prompt}
    assert right.done and right.info["final_answer"] == task.answer
    hit = Trajectory(task_id=task.task_id, trajectory_id="a", group_id="g", final_answer=right.info["final_answer"])
    assert env.reward(hit, task) == {"score": 1.0} and env.success(hit, task)
    _, wrong = asyncio.run(play(f"<answer>{int(task.answer) + 1}</answer>"))
    miss = Trajectory(task_id=task.task_id, trajectory_id="b", group_id="g", final_answer=wrong.info["final_answer"])
    assert env.reward(miss, task) == {"score": 0.0} and not env.success(miss, task)
    none = Trajectory(task_id=task.task_id, trajectory_id="c", group_id="g", final_answer=None)  # no <answer> tag
    assert env.reward(none, task) == {"score": 0.0}
    # a key of reasoning-gym's SYSTEM_PROMPTS picks that prompt; any other text is the prompt itself
    assert _environment(system_prompt="direct").system_prompt.startswith("Answer the question directly")
    assert _environment(system_prompt="Be brief.").system_prompt == "Be brief."


def test_two_training_steps_on_one_family(tmp_path):
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    cfg = load_config(None, [f"output_dir={tmp_path}", "name=rg", "model.kind=tiny", "progress=false",
                             "trainer.total_steps=2", "trainer.groups_per_step=2", "trainer.group_size=4",
                             "trainer.micro_batch_size=8", "trainer.freeze_layers=0", "env.n_train=16",
                             "env.n_heldout=4", "eval.n_tasks=4", "sampling.max_tokens=8",
                             "reward.function=rewards_for_tests:parity_reward",  # the random model scores 0 anyway
                             "env.name=reasoning_gym", "env.args.tasks=[basic_arithmetic]"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    check_run(cfg.run_dir, summary, 2)
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert {r["env_version"] for r in rows} == {_environment().version}
    assert all(r["prompt"] and r["answer"] for r in rows)
