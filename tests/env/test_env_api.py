"""The public environment API (loomrl/env/api.py, loomrl/env/tools.py): environments named by module:Factory and by
entry point, env.args checked by the plugin's own model, tool schemas from typed functions, and tools that raise, hang,
get bad arguments or run in a real pool sandbox. Training end to end on them is in tests/runtime/test_custom_env.py."""

from __future__ import annotations

import asyncio
import random
import sys
import time

import pytest

from loomrl.config import ConfigError
from loomrl.env import EnvCrash, EpisodeContext, Tool, ToolEnv, tool
from loomrl.env.api import environment_for, resolve_factory
from loomrl.env.pool import EnvPool
from loomrl.env.sandbox import make_sandbox
from loomrl.runtime.checks import load_checked
from loomrl.types import Task

FACTORY = "custom_envs_for_tests:make_lookup"


def _ctx(pool=None, timeout=2.0) -> EpisodeContext:
    return EpisodeContext(pool=pool, rng=random.Random(0), tool_timeout_s=timeout)


def _episode(pool=None):
    cfg = load_checked(None, [f"env.name={FACTORY}", "env.args.table={k: 7}"])
    return environment_for(cfg.env).episode(_ctx(pool))


def test_schema_from_signature_and_docstring():
    def convert(amount: float, unit: str = "km", exact: bool | None = None) -> str:
        """Convert a distance.

        Args:
            amount: how far
            unit: the unit to convert to
            exact: whether to round
        """
        return ""

    schema = Tool.of(convert).schema
    fn = schema["function"]
    assert fn["name"] == "convert" and fn["description"] == "Convert a distance."
    props = fn["parameters"]["properties"]
    assert props["amount"] == {"type": "number", "description": "how far"}
    assert props["unit"]["type"] == "string" and fn["parameters"]["required"] == ["amount"]
    assert "return" not in fn
    # a sandbox tool's `sandbox` parameter is the runtime's, never shown to the model
    shell = Tool.of(_episode().tools["shell"].fn)
    assert list(shell.schema["function"]["parameters"]["properties"]) == ["command"]


def test_a_tool_without_a_described_parameter_is_refused_in_one_line():
    def bad(x: int) -> int:
        """No Args section."""
        return x

    with pytest.raises(ConfigError, match=r"^tool 'bad': .*no description for the argument 'x'.*Google-style"):
        Tool.of(bad)


def test_tool_calls_that_raise_hang_or_are_wrong_answer_the_agent_and_are_recorded():
    env = _episode()

    async def go():
        obs = await env.reset(Task(task_id="t", prompt="What is k?", answer="7"))
        assert obs.messages[0]["role"] == "system" and "lookup(key: string)" in obs.messages[0]["content"]
        assert obs.messages[-1] == {"role": "user", "content": "What is k?"}
        assert {t["function"]["name"] for t in obs.tools} >= {"lookup", "add", "shell"}
        results = {}
        for action in ['<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>', "lookup(k)",
                       '<tool_call>{"name": "lookup", "arguments": {"key": "zz"}}</tool_call>',
                       '<tool_call>{"name": "add", "arguments": {"x": "two"}}</tool_call>',
                       '<tool_call>{"name": "add", "arguments": {"x": 2, "z": 1}}</tool_call>',
                       '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                       '<tool_call>{"name": "explode", "arguments": {}}</tool_call>',
                       '<tool_call>{"name": "stall", "arguments": {}}</tool_call>',
                       '<tool_call>{"name": "stall_sync", "arguments": {}}</tool_call>',
                       "<tool_call>{not json</tool_call>"]:
            t0 = time.perf_counter()
            step = await env.step(action)
            results[action] = (step, time.perf_counter() - t0)
            assert not step.done and step.observation[0]["role"] == "tool"
        return results

    results = asyncio.run(go())
    out = [(s.observation[0]["content"], s.info["tool_calls"][0]) for s, _ in results.values()]
    assert out[0][0] == "7" and out[0][1]["output"] == "7" and out[0][1]["error"] is None
    assert out[1][0] == "7"  # the plain form of a one-argument tool
    # a tool that raises has a bug: the agent is told only that it failed; the record keeps the exception
    assert out[2][0] == "Error: lookup failed (an error inside the tool, not in the call)" and not out[2][1]["error"]
    assert out[2][1]["tool_error"] == "lookup raised KeyError: 'zz'"
    assert (out[2][1]["failure"], out[2][1]["exception"]) == ("raised", "KeyError")
    assert out[3][0].startswith("Error: add: bad argument x: Input should be a valid integer")
    assert out[3][1]["failure"] == "refused"  # the agent's doing
    assert out[4][0].startswith("Error: add: bad argument z: Extra inputs are not permitted")
    assert out[5][0].startswith("Error: no tool named 'nope'; the tools are lookup, add, explode")
    assert out[6][0] == "Error: explode failed (an error inside the tool, not in the call)"
    assert (out[6][1]["tool_error"], out[6][1]["exception"]) == ("explode raised RuntimeError: boom", "RuntimeError")
    assert out[7][0] == "Error: stall ran past its 0.3 s timeout" and out[7][1]["failure"] == "timeout"
    assert out[8][0] == "Error: stall_sync ran past its 0.3 s timeout"
    assert out[9][0].startswith("Error: malformed tool call") and out[9][1]["error"] and "tool_error" not in out[9][1]
    stall_s = list(results.values())[7][1]
    assert stall_s < 2.0, f"the hung tool held the episode {stall_s:.1f} s"


def test_a_reply_without_a_tool_call_is_the_final_answer():
    env = _episode()
    step = asyncio.run(env.step("It is 7."))
    assert step.done and step.info["final_answer"] == "It is 7."


@pytest.mark.integration  # starts a pool sandbox
def test_a_sandbox_tool_runs_in_a_pool_sandbox_and_a_dead_pool_is_an_env_crash():
    async def go():
        pool = await EnvPool(lambda: make_sandbox("auto"), size=1).start()
        try:
            env = _episode(pool)
            step = await env.step('<tool_call>{"name": "shell", "arguments": {"command": "echo hi > f; cat f"}}'
                                  '</tool_call>')
            assert step.observation[0]["content"] == "hi"
        finally:
            await pool.close()
        env = _episode(None)  # no pool: the environment declared none; the run's fault, not the agent's
        with pytest.raises(EnvCrash, match="needs a sandbox"):
            await env.step('<tool_call>{"name": "shell", "arguments": {"command": "true"}}</tool_call>')

    asyncio.run(go())


def test_env_args_are_checked_by_the_plugins_own_model():
    cfg = load_checked(None, [f"env.name={FACTORY}", "env.args.mode=loud"])
    assert environment_for(cfg.env).args.mode == "loud"
    with pytest.raises(ConfigError, match=r"^config error: 'env.args.mode': Input should be 'plain' or 'loud'"):
        load_checked(None, [f"env.name={FACTORY}", "env.args.mode=quiet"])
    with pytest.raises(ConfigError, match=r"^config error: unknown field 'env.args.colour' for env.name="
                                          r"custom_envs_for_tests:make_lookup; known fields: table, mode$"):
        load_checked(None, [f"env.name={FACTORY}", "env.args.colour=red"])


def test_bad_factories_and_names_stop_in_one_line():
    cases = {
        "custom_envs_for_tests:not_an_environment": "the factory returned a str, not a loomrl.env.Environment",
        "custom_envs_for_tests:missing": "has no attribute 'missing'",
        "no_such_module_xyz:Env": "no module named 'no_such_module_xyz'",
        "calculatorr": "unknown environment 'calculatorr'; choose a built-in or installed one (calculator, chat",
        "custom_envs_for_tests:NoTasks": "brings no tasks of its own; add a data: section",
    }
    for name, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_checked(None, [f"env.name={name}"])
        assert message in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    with pytest.raises(ConfigError, match="env.name=gym takes no black-box agents"):
        load_checked(None, ["env.name=gym", "agent.kind=blackbox", "agent.command=[python3, a.py]"])


def test_an_installed_plugin_is_found_by_its_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "shop_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shop-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[loomrl.envs]\nlookup = custom_envs_for_tests:make_lookup\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    factory, extra = resolve_factory("lookup")
    assert factory.__name__ == "make_lookup" and extra == {}
    cfg = load_checked(None, ["env.name=lookup", "env.args.table={x: 5}"])
    train, held = environment_for(cfg.env).tasks(
        __import__("loomrl.env.api", fromlist=["TaskSetup"]).TaskSetup.of(cfg.env))
    assert train[0].answer == "5" and held[0].split == "heldout"
    assert "custom_envs_for_tests" in sys.modules


class _Mini(ToolEnv):
    @tool
    def ping(self) -> str:
        """Answer pong."""
        return "pong"


def test_tool_env_subclass_with_plain_function_tools():
    def echo(text: str) -> str:
        """Echo the text.

        Args:
            text: what to echo
        """
        return text

    env = _Mini(_ctx(), tools=[echo])
    assert list(env.tools) == ["ping", "echo"]
    step = asyncio.run(env.step("echo(hello there)"))
    assert step.observation == [{"role": "tool", "name": "echo", "content": "hello there"}]


def test_a_tools_own_bug_is_told_apart_from_the_agents_mistake():
    """A tool that raises on every call used to show the model a Python error line each time, and nothing counted
    it: to the policy a bug in a tool looked like its own mistake. Now the call's record says `raised` with the
    exception, the run counts it per tool (tool/* metrics) and warns once the tool fails on most of its calls, the
    process term tool_error leaves it out, and a tool that means to tell the agent something raises ToolError."""
    from loomrl.env.tools import ToolError
    from loomrl.reward.process import tool_error
    from loomrl.rollout.worker import tool_counts
    from loomrl.runtime.failure_watch import FailureWatch
    from loomrl.types import Trajectory, Turn

    class Buggy(ToolEnv):
        @tool
        def find(self, key: str) -> str:
            """Look a key up.

            Args:
                key: the key
            """
            if key == "?":
                raise ToolError("keys are letters; '?' is not one")
            return self.table.group(key)  # a typo: there is no such attribute

    class Shown(Buggy):
        show_tool_exceptions = True

    async def calls(env, keys):
        return [(await env.step(f'<tool_call>{{"name": "find", "arguments": {{"key": "{k}"}}}}</tool_call>'))
                for k in keys]

    steps = asyncio.run(calls(Buggy(_ctx()), ["a"] * 9 + ["?"]))
    records = [s.info["tool_calls"][0] for s in steps]
    assert steps[0].observation[0]["content"] == "Error: find failed (an error inside the tool, not in the call)"
    assert records[0]["failure"] == "raised" and records[0]["exception"] == "AttributeError"
    assert steps[-1].observation[0]["content"] == "Error: keys are letters; '?' is not one"  # meant for the agent
    assert records[-1]["failure"] == "refused"
    shown = asyncio.run(calls(Shown(_ctx()), ["a"]))[0].observation[0]["content"]
    assert shown.startswith("Error: find raised AttributeError: 'Buggy' object has no attribute 'table'") or \
        shown.startswith("Error: find raised AttributeError: 'Shown' object has no attribute 'table'")

    turns = [Turn(act="x", tool_calls=[r]) for r in records]
    assert tool_error(turns) == [0.0] * 9 + [1.0]  # the agent is not penalised for the tool's bug
    traj = Trajectory(task_id="t", trajectory_id="tr", group_id="g", turns=turns)
    assert tool_counts([traj]) == {"tool/find/calls": 10, "tool/find/raised/AttributeError": 9,
                                   "tool/find/refused": 1}
    watch = FailureWatch()
    warned = watch.tool_warnings([traj])
    assert len(warned) == 1 and warned[0].startswith("tool 'find' failed on 9 of its 10 calls so far "
                                                     "(AttributeError 9): a bug in the tool")
    assert watch.tool_warnings([traj]) == []  # once per tool
