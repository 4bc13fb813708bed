"""OpenEnv environments (`env.name: openenv:<URL or package.module:app>`, loomrl/env/adapters/openenv.py) against real
OpenEnv servers: tests/openenv_env_for_tests.py's environments, written on openenv-core's server API and started by the
adapter as uvicorn processes on loopback ports (openenv-core ships no example environment of its own). The episodes
speak openenv-core's WebSocket protocol for real; only the model is scripted (ScriptedEngine: the random tiny model
never guesses a number or writes a tool call), except in the training run, which samples from the tiny model."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="openenv-core is not installed (pip install 'loomrl[openenv]')")

from engine_checks import Recording  # noqa: E402
from ledger_checks import check_run  # noqa: E402
from scripted_engine import ScriptedEngine  # noqa: E402

from loomrl.agent.loop import AgentLoop  # noqa: E402
from loomrl.config import ConfigError, load_config  # noqa: E402
from loomrl.engine.base import SamplingParams  # noqa: E402
from loomrl.env.api import EpisodeContext, TaskSetup, make_environment, resolve_factory  # noqa: E402
from loomrl.model.chat import ChatRenderer  # noqa: E402
from loomrl.types import RolloutStatus, Task  # noqa: E402

pytestmark = pytest.mark.integration  # starts server processes and a training run: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
TESTS = str(ROOT / "tests")
SETUP = TaskSetup(families=None, n_train=6, n_heldout=2, seed=0, heldout_template_share=0.0, sandbox="process")
PROMPT = "I picked a number from 0 to 9. Guess it: reply with the number only."


def _environment(server: str, **args):
    factory, extra = resolve_factory(f"openenv:{server}")
    return make_environment(factory, {"paths": [TESTS], **args, **extra}, f"openenv:{server}")


@pytest.fixture(scope="module")
def guess():
    environment = _environment("openenv_env_for_tests:app", max_sessions=4, timeout_s=20)
    yield environment
    environment.close()


def _play(environment, task, turns: list[str], tokenizer):
    loop = AgentLoop(ScriptedEngine(tokenizer, turns), ChatRenderer(tokenizer),
                     sampling=SamplingParams(temperature=1.0, max_tokens=64), max_turns=6, max_context_tokens=4096)

    async def go():
        env = environment.episode(EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=5.0))
        try:
            return await loop.run(env, task)
        finally:
            await env.close()

    return asyncio.run(go())


def _target(task: Task) -> int:
    return random.Random(task.data["seed"]).randrange(10)  # what the test environment's reset(seed) picks


def test_an_episode_over_the_real_protocol_gives_the_exact_messages_and_the_env_reward(guess, tokenizer):
    train, heldout = guess.tasks(SETUP)
    assert (len(train), len(heldout)) == (6, 2)
    assert {t.data["seed"] for t in train}.isdisjoint(t.data["seed"] for t in heldout)
    assert [t.task_id for t in guess.tasks(SETUP)[0]] == [t.task_id for t in train]  # the same for a seed
    assert guess.version == "openenv:GuessEnvironment-1.0.0"
    task = train[0]
    target = _target(task)
    low, high = (target + 1) % 10, (target + 9) % 10  # two wrong guesses
    traj = _play(guess, task, [str(low), str(high), str(target)], tokenizer)
    assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 3, traj.error
    assert traj.prompt_ids == ChatRenderer(tokenizer).prompt_ids([{"role": "user", "content": PROMPT}])
    assert [t.obs for t in traj.turns[:2]] == [f"No, {'higher' if g < target else 'lower'}." for g in (low, high)]
    assert [t.reward_step for t in traj.turns] == [0.0, 0.0, 1.0] and traj.final_answer == str(target)
    reward = guess.reward(traj, task)
    assert reward == {"env": 1.0}
    traj.reward_components, traj.total_reward = reward, 1.0
    assert guess.success(traj, task)
    lost = _play(guess, task, [str(low)] * 3, tokenizer)  # three wrong guesses: the server ends it, return 0
    assert lost.status == RolloutStatus.COMPLETED and len(lost.turns) == 3 and guess.reward(lost, task) == {"env": 0.0}


def test_a_running_server_by_url_and_a_data_row_as_reset_arguments(guess, tokenizer):
    by_url = _environment(guess.url)  # openenv:http://127.0.0.1:<port>: the server the fixture started
    assert by_url.server is None and by_url.version == guess.version
    row = Task(task_id="row-0", prompt="Play the game.", answer="4", data={"target": 4},
               messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Play the game."}])
    traj = _play(by_url, row, ["4"], tokenizer)  # the row's `target` column went to reset(target=4)
    assert traj.status == RolloutStatus.COMPLETED and traj.turns[0].reward_step == 1.0, traj.error
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Play the game."},
               {"role": "user", "content": PROMPT}]  # the row's prompt, then the reset observation
    assert traj.prompt_ids == ChatRenderer(tokenizer).prompt_ids(opening)


def test_a_server_that_dies_mid_episode_ends_it_env_error(tokenizer):
    environment = _environment("openenv_env_for_tests:app", timeout_s=10)
    try:
        task = environment.tasks(SETUP)[0][0]
        traj = _play(environment, task, ["die"], tokenizer)  # the reply makes the server process exit
        assert traj.status == RolloutStatus.ENV_ERROR and traj.total_reward == 0.0
        assert "EnvCrash: openenv server http://127.0.0.1:" in traj.error and "closed during step" in traj.error
        assert environment.server.proc.wait(10) == 3
        again = _play(environment, task, ["1"], tokenizer)  # nothing listens any more: connecting fails, bounded
        assert again.status == RolloutStatus.ENV_ERROR and "could not connect (3 attempts)" in again.error
    finally:
        environment.close()


def test_a_server_that_never_gets_healthy_stops_at_load_in_one_line(monkeypatch):
    monkeypatch.setenv("LOOMRL_TEST_OPENENV_HANG", "1")  # its import never finishes
    with pytest.raises(ConfigError) as hung:
        _environment("openenv_env_for_tests:app", start_timeout_s=3)
    line = str(hung.value)
    assert line.startswith("config error: env.name=openenv:openenv_env_for_tests:app: the server at "
                           "http://127.0.0.1:") and "not healthy within env.args.start_timeout_s=3 s" in line
    assert "\n" not in line
    monkeypatch.delenv("LOOMRL_TEST_OPENENV_HANG")
    with pytest.raises(ConfigError) as nobody:  # a URL where nothing listens
        _environment("http://127.0.0.1:9", start_timeout_s=1)
    assert str(nobody.value).startswith("config error: env.name=openenv:http://127.0.0.1:9: the server at "
                                        "http://127.0.0.1:9 was not healthy within env.args.start_timeout_s=1 s "
                                        "(last: URLError")
    with pytest.raises(ConfigError) as missing:
        _environment("openenv_env_for_tests:no_such_app")
    line = str(missing.value)
    assert "the server exited with code 3 before it was healthy" in line  # uvicorn: the app did not import
    assert line.endswith('Attribute "no_such_app" not found in module "openenv_env_for_tests".')
    assert "\n" not in line


def test_an_mcp_environment_takes_tool_calls_and_records_their_failures(tokenizer):
    environment = _environment("openenv_env_for_tests:tools_app", timeout_s=20)
    try:
        assert environment.action_field is None  # its actions are tool calls
        task = environment.tasks(SETUP)[0][0]
        call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
        traj = _play(environment, task, [call % ("add", '{"a": 2, "b": 3}'), call % ("broken", '{"x": "?"}'),
                                         "<tool_call>{oops</tool_call>", call % ("submit", '{"answer": 5}')],
                     tokenizer)
        assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 4, traj.error
        add, broken, malformed = (t.tool_calls[0] for t in traj.turns[:3])
        assert add["output"] == "5" and traj.turns[0].obs == "5"
        assert broken["failure"] == "raised" and "NoneType" in broken["tool_error"]
        assert traj.turns[1].obs == "Error: broken failed (an error inside the tool, not in the call)"
        assert malformed["error"].startswith("malformed tool call") and "tool_error" not in malformed
        assert environment.reward(traj, task) == {"env": 1.0}
        prompt = tokenizer.decode(traj.prompt_ids)
        assert "- add(a: integer, b: integer): Add two integers." in prompt
        assert "What is 2 + 3? Use the tools, then submit the answer." in prompt
    finally:
        environment.close()


def test_two_training_steps_on_an_openenv_server_train_the_sampled_tokens(tmp_path, monkeypatch):
    """The tiny recipe (a random tiny model, calculator_tiny's parity reward so that groups differ) on the guessing
    server: every trained token is one the engine sampled, in order."""
    from loomrl.engine import factory
    from loomrl.env.api import environment_for
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    engines: list[Recording] = []
    monkeypatch.setattr("loomrl.rollout.actor.make_engine",
                        lambda *a, **k: engines.append(Recording(factory.make_engine(*a, **k))) or engines[-1])
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml",
                      [f"output_dir={tmp_path}", "progress=false", "env.name=openenv:openenv_env_for_tests:app",
                       f"env.args={json.dumps({'paths': [TESTS], 'max_sessions': 8})}", "env.families=null",
                       "trainer.total_steps=2", "env.n_train=8", "env.n_heldout=2", "eval.n_tasks=2",
                       "checkpoint_every=0"])
    try:
        summary = train(cfg)
    finally:
        environment_for(cfg.env).close()  # the server this process started (else stopped at exit)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    check_run(cfg.run_dir, summary, 2)
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert {r["env_version"] for r in rows} == {"openenv:GuessEnvironment-1.0.0"}
    assert {r["status"] for r in rows} <= {"completed", "truncated"}
    assert any(r["n_turns"] > 1 for r in rows)  # the server's hints: multi-turn episodes
    sampled = {k: v for e in engines for k, v in e.sampled.items()}
    for row in rows:
        trained = [tok for tok, m in zip(row["token_ids"], row["loss_mask"]) if m]
        assert trained == sampled[row["trajectory_id"]]  # the exact ids, in order: nothing re-tokenized
