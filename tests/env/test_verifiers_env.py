"""verifiers environments (`env.name: verifiers:<id>`, loomrl/env/adapters/verifiers.py) on the tiny environment that
ships with the tests (tests/verifiers_envs/vf_wordcount: a tool, a scripted follow-up turn, a rubric): found by its
id, its tasks, one episode driven by a scripted engine (the random tiny model never writes a tool call) with the tool
run and the rubric as the reward, what the adapter does not support refused in one line, and two training steps on
the tiny model whose trained tokens are exactly the tokens the engine sampled."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import random
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from engine_checks import Recording  # noqa: E402
from ledger_checks import check_run  # noqa: E402
from scripted_engine import ScriptedEngine  # noqa: E402
from tool_template_for_tests import rendering_tools  # noqa: E402

from loomrl.agent.loop import AgentLoop  # noqa: E402
from loomrl.config import ConfigError, load_config  # noqa: E402
from loomrl.engine.base import SamplingParams  # noqa: E402
from loomrl.env.api import EpisodeContext, TaskSetup, make_environment, resolve_factory  # noqa: E402
from loomrl.model.chat import ChatRenderer  # noqa: E402
from loomrl.types import RolloutStatus  # noqa: E402

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
PATHS = [str(ROOT / "tests" / "verifiers_envs" / "vf_wordcount")]
SETUP = TaskSetup(families=None, n_train=6, n_heldout=4, seed=0, heldout_template_share=0.0, sandbox="process")
CALL = '<tool_call>{"name": "wordcount_count", "arguments": {"text": "%s"}}</tool_call>'


def _environment(env_id: str = "vf-wordcount", **args):
    factory, extra = resolve_factory(f"verifiers:{env_id}")
    return make_environment(factory, {"paths": PATHS, **args, **extra}, f"verifiers:{env_id}")


@pytest.fixture(scope="module")
def wordcount():
    return _environment()


def test_the_environment_is_found_by_its_id_and_brings_its_tasks(wordcount):
    train, heldout = wordcount.tasks(SETUP)
    assert (len(train), len(heldout)) == (6, 4) and {t.split for t in heldout} == {"heldout"}
    assert {t.data["vf"]["idx"] for t in train}.isdisjoint(t.data["vf"]["idx"] for t in heldout)
    again = _environment().tasks(SETUP)
    assert [t.task_id for t in again[0]] == [t.task_id for t in train]  # the same for a seed
    other = wordcount.tasks(dataclasses.replace(SETUP, seed=1))
    assert [t.task_id for t in other[0]] != [t.task_id for t in train]
    task = train[0]
    assert task.prompt.startswith("How many words are in") and task.answer.isdigit()
    assert pickle.loads(pickle.dumps(task)) == task and len(pickle.dumps(task)) < 1000
    assert wordcount.version.startswith("verifiers-0.4.0:vf_wordcount")
    # held out from a taskset of its own: env.args.heldout_args over env_args.taskset
    own = _environment(env_args={"taskset": {"repeat": 1}}, heldout_args={"repeat": 2})
    train2, heldout2 = own.tasks(TaskSetup(families=None, n_train=12, n_heldout=20, seed=0,
                                           heldout_template_share=0.0, sandbox="process"))
    assert len(train2) == 12 and len(heldout2) == 20


def _play(environment, task, turns: list[str], tokenizer):
    engine = ScriptedEngine(tokenizer, turns)
    loop = AgentLoop(engine, ChatRenderer(tokenizer), sampling=SamplingParams(temperature=1.0, max_tokens=64),
                     max_turns=8, max_context_tokens=4096)
    env = environment.episode(EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=5.0))

    async def go():
        try:
            return await loop.run(env, task)
        finally:
            await env.close()

    return asyncio.run(go())


def test_an_episode_runs_the_tool_and_the_protocol_and_is_scored_by_the_rubric(wordcount, tokenizer):
    task = wordcount.tasks(SETUP)[0][0]
    sentence = task.prompt.split('"')[1]
    traj = _play(wordcount, task, [CALL % sentence, "I counted them.", f"<answer>{task.answer}</answer>"], tokenizer)
    assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 3
    first, second, third = traj.turns
    assert first.tool_calls[0]["name"] == "wordcount_count" and first.tool_calls[0]["output"] == task.answer
    assert first.obs == task.answer  # the tool's result, appended as tokens
    assert second.obs == "Give your final answer as <answer>NUMBER</answer>."  # the env's own follow-up turn
    assert third.done and traj.final_answer == f"<answer>{task.answer}</answer>"
    reward = wordcount.reward(traj, task)
    assert reward == {"correct": 1.0, "used_tool": pytest.approx(0.1), "concise": pytest.approx(0.01 / 2)}
    traj.reward_components, traj.total_reward = reward, sum(reward.values())
    assert wordcount.success(traj, task)
    trace = traj.env_record["trace"]
    assert trace["stop_condition"] == "user_closed" and traj.env_record["state"]["tool_calls"] == 1
    assert [n["message"]["role"] for n in trace["nodes"]] == ["system", "user", "assistant", "tool", "assistant",
                                                               "user", "assistant"]


def test_a_stop_hook_ends_the_episode_and_a_wrong_answer_scores_nothing(wordcount, tokenizer):
    task = wordcount.tasks(SETUP)[0][0]
    traj = _play(wordcount, task, [CALL % "a b"], tokenizer)  # it never stops calling the tool
    assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 4  # @vf.stop enough: 4 model turns
    assert traj.env_record["trace"]["stop_condition"] == "enough"
    reward = wordcount.reward(traj, task)
    assert reward["correct"] == 0.0 and reward["used_tool"] == pytest.approx(0.1)
    broken = _play(wordcount, task, ['<tool_call>{"name": "wordcount_count", "arguments": {"txt": 1}}</tool_call>',
                                     '<tool_call>{"name": "nope"}</tool_call>', "<tool_call>{oops</tool_call>",
                                     "<answer>0</answer>"], tokenizer)
    outputs = [t.tool_calls[0]["output"] for t in broken.turns[:3]]
    assert outputs[0].startswith("Error executing tool count:") and "text" in outputs[0]
    assert outputs[1] == "error: unknown tool 'nope'" and outputs[2].startswith("error: malformed tool call")
    assert wordcount.reward(broken, task)["correct"] == 0.0


def test_verifiers_single_agent_env_is_one_segment(tokenizer):
    plain = _environment(env_args={"id": "single-agent"})  # the taskset's own Env left out: verifiers' default one
    task = plain.tasks(SETUP)[0][0]
    traj = _play(plain, task, ["I think it is 3.", "never asked"], tokenizer)  # no follow-up turn: one reply, done
    assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 1 and traj.final_answer == "I think it is 3."
    assert traj.env_record["trace"]["stop_condition"] == "agent_completed"
    assert plain.reward(traj, task)["correct"] == 0.0


WARNED = "renders no tool schemas"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]


def test_a_template_that_renders_no_tools_gets_them_described_in_the_system_prompt(tokenizer, caplog):
    """SmolLM2's chat template drops tool schemas: the opening system prompt says the tools and the call format in
    words (as ToolEnv's does), and loading warns once, in one line naming the environment and the model."""
    environment = _environment()
    with caplog.at_level(logging.WARNING, logger="loomrl.env.adapters.verifiers"):
        environment.use_tokenizer(tokenizer)
        environment.use_tokenizer(tokenizer)  # a second rollout side in the process: no second warning
    assert _warnings(caplog) == [f"env.name=verifiers:vf-wordcount: the chat template of {tokenizer.name_or_path} "
                                 f"{WARNED}: the tools are described in the system prompt instead"]
    task = environment.tasks(SETUP)[0][0]
    sentence = task.prompt.split('"')[1]
    traj = _play(environment, task, [CALL % sentence, f"<answer>{task.answer}</answer>"], tokenizer)
    prompt = tokenizer.decode(traj.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou count words. Use the tool when you can.\n\nTools:\n"
                             "- wordcount_count(text: string): Count the words of a text (separated by spaces).\n"
                             'Call a tool with <tool_call>{"name": "wordcount_count", "arguments": {...}}</tool_call>'
                             ), prompt
    assert prompt.count("Tools:") == 1
    assert traj.turns[0].tool_calls[0]["output"] == task.answer and traj.final_answer == f"<answer>{task.answer}</answer>"
    # the trace keeps verifiers' own system prompt: the words are loomrl's rendering, as a template's would be
    assert traj.env_record["trace"]["nodes"][0]["message"]["content"] == "You count words. Use the tool when you can."


def test_a_template_that_renders_tools_does_not_get_them_twice(tokenizer, caplog):
    own = rendering_tools(tokenizer)  # SmolLM2's template with the tools' JSON in a system turn
    environment = _environment()
    with caplog.at_level(logging.WARNING, logger="loomrl.env.adapters.verifiers"):
        environment.use_tokenizer(own)
    assert _warnings(caplog) == []
    task = environment.tasks(SETUP)[0][0]
    traj = _play(environment, task, [f"<answer>{task.answer}</answer>"], own)
    prompt = own.decode(traj.prompt_ids)
    assert '"name": "wordcount_count"' in prompt  # the template's rendering
    assert "Tools:" not in prompt and "<tool_call>" not in prompt, prompt


@pytest.mark.parametrize(("env_args", "names"), [
    ({"agent": {"harness": {"id": "bash"}}}, "harness 'bash'"),
    ({"agent": {"model": "openai/gpt-5"}}, "agent.model"),
    ({"agent": {"max_total_tokens": 100}}, "agent.max_total_tokens"),
    ({"id": "user-sim"}, "multi-agent environment"),
    ({"id": "best-of-n"}, "BestOfNEnv.finalize"),
    ({"taskset": {"task": {"tools": {"runtime": {"type": "docker"}}}}}, "asks for a docker runtime"),
    ({"taskset": {"task": {"tools": {"url": "http://localhost:1/mcp"}}}}, "remote MCP server"),
    ({"taskset": {"task": {"judges": [{"id": "reference"}]}}}, "LLM judges"),
    ({"taskset": {"task": {"rewards": {"box": {"fn": "vf_wordcount.taskset:needs_runtime"}}}}}, "reward 'box'"),
    ({"taskset": {"repeats": 2}}, "env.args.env_args.taskset.repeats"),
])
def test_what_is_not_supported_is_refused_at_load_in_one_line(env_args, names):
    with pytest.raises(ConfigError) as err:
        _environment(env_args=env_args)
    message = str(err.value)
    assert names in message and "\n" not in message, message


def test_an_environment_that_is_not_installed_is_named():
    with pytest.raises(ConfigError, match=r"no verifiers environment 'vf-nothing' is installed \(no module "
                                          r"'vf_nothing'\).*env.args.paths"):
        _environment("vf-nothing")


def test_the_example_recipe_trains_two_steps_on_exactly_the_sampled_tokens(tmp_path, monkeypatch):
    from loomrl.engine import factory
    from loomrl.runtime.run import train
    from loomrl.store import read_rows

    engines: list[Recording] = []
    monkeypatch.setattr("loomrl.rollout.actor.make_engine",
                        lambda *a, **k: engines.append(Recording(factory.make_engine(*a, **k))) or engines[-1])
    monkeypatch.chdir(ROOT)  # the recipe's env.args.paths is relative to the repository's root
    cfg = load_config(ROOT / "examples" / "verifiers" / "train.yaml",
                      [f"output_dir={tmp_path}", "progress=false", "trainer.total_steps=2", "env.n_train=8",
                       "env.n_heldout=2", "eval.n_tasks=2", "sampling.max_tokens=8"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    check_run(cfg.run_dir, summary, 2)
    rows = read_rows(cfg.run_dir / "trajectories")
    assert {r["env_version"] for r in rows} == {"verifiers-0.4.0:vf_wordcount-local"}
    sampled = {k: v for e in engines for k, v in e.sampled.items()}
    for row in rows:
        assert set(row["reward_components"]) == {"correct", "used_tool", "concise"}
        trained = [tok for tok, m in zip(row["token_ids"], row["loss_mask"]) if m]
        assert trained == sampled[row["trajectory_id"]]  # the exact ids, in order: nothing re-tokenized
    assert any(r["n_turns"] > 1 for r in rows)  # the env's follow-up turn: multi-turn episodes
