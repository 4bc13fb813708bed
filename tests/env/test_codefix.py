"""The codefix environment over real pooled sandboxes: the golden path, hidden tests invisible while
the agent acts, perturbations, timeouts that retire a sandbox, clean state between episodes, and task
validation."""

from __future__ import annotations

import asyncio
import json

import pytest

from loomrl.env.pool import EnvPool
from loomrl.env.sandbox import make_sandbox
from loomrl.env.tasks.codefix import PASSED, CodefixEnv, as_task, validate_task
from loomrl.env.tasks.codefix_types import CodefixTask

MARKER = "HIDDEN_MARKER_7f3a"
BUGGY = "def clamp(x, lo, hi):\n    return max(hi, min(lo, x))\n"
FIXED = "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"
TESTS = (f"# {MARKER}\nimport unittest\nfrom geom.clamp import clamp\n\n\nclass T(unittest.TestCase):\n"
         "    def test_inside(self):\n        self.assertEqual(clamp(2, 0, 3), 2)\n\n"
         "    def test_above(self):\n        self.assertEqual(clamp(5, 0, 3), 3)\n")


def spec(**perturbations) -> CodefixTask:
    return CodefixTask(task_id="codefix-clamp-t", family="clamp", issue="clamp(5, 0, 3) returns 0, expected 3",
                       files={"geom/__init__.py": "", "geom/clamp.py": BUGGY, "README.md": "geometry helpers\n"},
                       golden_patch={"geom/clamp.py": FIXED},
                       hidden_tests={"tests_hidden/__init__.py": "", "tests_hidden/test_clamp.py": TESTS},
                       perturbations=perturbations)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def episode(actions: list[str], task_spec: CodefixTask | None = None, size: int = 1, after=None):
    """Run scripted actions through one episode; returns (step results, env, pool metrics)."""
    task_spec = task_spec or spec()

    async def go():
        pool = await EnvPool(lambda: make_sandbox("auto"), size=size).start()
        try:
            env = CodefixEnv(pool, {task_spec.task_id: task_spec}, command_timeout_s=2.0)
            obs = await env.reset(as_task(task_spec, "train"))
            steps = []
            for action in actions:
                steps.append(await env.step(action))
                if steps[-1].done:
                    break
            await env.close()
            extra = await after(pool, task_spec) if after else None
            return obs, steps, env, pool.metrics, extra
        finally:
            await pool.close()

    return asyncio.run(go())


def test_golden_path_reads_edits_and_passes_the_hidden_tests():
    obs, steps, env, metrics, _ = episode([
        call("read_file", path="geom/clamp.py"),
        call("str_replace", path="geom/clamp.py", old_str="max(hi, min(lo, x))", new_str="max(lo, min(hi, x))"),
        "bash(python3 -c 'from geom.clamp import clamp; print(clamp(5, 0, 3))')",
        call("submit"),
    ])
    assert "clamp(5, 0, 3) returns 0" in obs.messages[-1]["content"] and "bash(command)" in obs.messages[0]["content"]
    assert "max(hi, min(lo, x))" in steps[0].observation[0]["content"]
    assert steps[1].observation[0]["content"] == "edited geom/clamp.py"
    assert steps[2].observation[0]["content"].split() == ["exit", "code", "0", "3"]
    assert steps[3].done and steps[3].reward == 1.0 and steps[3].info["final_answer"] == PASSED
    assert metrics.kills == 0


def test_unfixed_repository_fails_and_a_reply_without_a_tool_call_ends_the_episode():
    _, steps, *_ = episode(["I think it is fine."])
    assert steps[0].done and steps[0].reward == 0.0 and not steps[0].info["submitted"]
    assert "FAILED" in steps[0].info["test_output"]


@pytest.mark.integration  # starts processes: not in `make test-fast`
def test_hidden_tests_are_invisible_while_the_agent_acts():
    _, steps, *_ = episode([
        f"bash(grep -rl {MARKER} / 2>/dev/null; find / -name 'test_clamp*' 2>/dev/null; ls -a)",
        call("submit"),
    ])
    seen = steps[0].observation[0]["content"]
    assert MARKER not in seen and "test_clamp" not in seen and "tests_hidden" not in seen
    assert steps[1].done  # and at the end they are there and ran
    assert "Ran 2 tests" in steps[1].info["test_output"]


def test_perturbations_env_vars_disabled_tools_src_layout_broken_dependency():
    task_spec = spec(env={"APP_MODE": "test"}, disable_tools=["write_file"], layout="src",
                     broken_dependency="fastjson")
    obs, steps, *_ = episode([
        "bash(echo $APP_MODE; pwd; ls)",
        call("write_file", path="geom/clamp.py", content=FIXED),
        "bash(python3 -c 'import fastjson')",
        call("str_replace", path="geom/clamp.py", old_str="max(hi, min(lo, x))", new_str="max(lo, min(hi, x))"),
        call("submit"),
    ], task_spec)
    assert "src/ folder" in obs.messages[-1]["content"] and "write_file" not in obs.messages[0]["content"]
    out = steps[0].observation[0]["content"].split()
    assert out[3:6] == ["test", "/work/src", "README.md"]
    assert "unknown tool 'write_file'" in steps[1].observation[0]["content"]
    assert "broken in this environment" in steps[2].observation[0]["content"]
    assert steps[4].reward == 1.0  # solvable under every perturbation


@pytest.mark.integration  # starts processes: not in `make test-fast`
def test_command_timeout_retires_the_sandbox():
    _, steps, _, metrics, _ = episode(["bash(sleep 30)", call("submit")])
    assert "killed (timeout" in steps[0].observation[0]["content"]
    assert metrics.kills == 1  # destroyed at release, never reused


def test_next_episode_on_the_same_sandbox_starts_clean():
    async def second_episode(pool, task_spec):
        env = CodefixEnv(pool, {task_spec.task_id: task_spec})
        await env.reset(as_task(task_spec, "train"))
        listing = await env.step("bash(ls -a; ls geom)")
        await env.close()
        return listing.observation[0]["content"]

    _, _, _, metrics, listing = episode(["bash(touch junk.txt; mkdir -p cache; python3 -c 'import geom.clamp')",
                                          call("submit")], after=second_episode)
    assert "junk.txt" not in listing and "cache" not in listing and "__pycache__" not in listing
    assert "tests_hidden" not in listing and metrics.resets >= 1


def test_truncated_episode_is_judged_on_what_the_agent_left():
    async def go():
        pool = await EnvPool(lambda: make_sandbox("auto"), size=1).start()
        s = spec()
        env = CodefixEnv(pool, {s.task_id: s})
        await env.reset(as_task(s, "train"))
        await env.step(call("str_replace", path="geom/clamp.py", old_str="max(hi, min(lo, x))",
                            new_str="max(lo, min(hi, x))"))
        verdict = await env.finalize()  # the turn budget ran out before submit
        await env.close()
        await pool.close()
        return verdict

    assert asyncio.run(go()) == PASSED


@pytest.mark.parametrize("case", ["valid", "golden_broken", "noop_passes"])
def test_task_validation(case):
    s = spec()
    if case == "golden_broken":
        s = CodefixTask(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "golden_patch": {"geom/clamp.py": BUGGY}})
    if case == "noop_passes":
        s = CodefixTask(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "files": {**s.files, "geom/clamp.py": FIXED}})

    async def go():
        pool = await EnvPool(lambda: make_sandbox("auto"), size=2).start()
        try:
            return await validate_task(pool, s)
        finally:
            await pool.close()

    result = asyncio.run(go())
    assert result.valid == (case == "valid")
    if case == "golden_broken":
        assert not result.golden_passes and "golden patch fails" in result.detail
    if case == "noop_passes":
        assert not result.noop_fails and "already passes" in result.detail


def test_cli_validate_tasks_writes_a_report(tmp_path, capsys):
    from loomrl.cli import main

    report = tmp_path / "report.json"
    assert main(["validate-tasks", "--families", "clamp", "chunk", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["valid"] == 6 and data["invalid"] == 0 and all(t["golden_passes"] for t in data["tasks"])
    assert "6 tasks: 6 valid, 0 invalid" in capsys.readouterr().out
    assert main(["validate-tasks", "--families", "nonesuch"]) == 2  # a clear config error
    assert "unknown codefix family ['nonesuch']" in capsys.readouterr().err


def test_cli_validate_tasks_report_defaults_to_the_loomrl_cache_not_the_cwd(tmp_path, monkeypatch, capsys):
    from loomrl.cli import main

    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("LOOMRL_CACHE", str(cache))
    assert main(["validate-tasks", "--families", "clamp"]) == 0
    report = cache / "task_validation.json"
    assert json.loads(report.read_text())["valid"] == 3 and not list(cwd.iterdir())
    assert f"report: {report}" in capsys.readouterr().out


def test_validation_is_a_start_up_step_whose_result_is_cached_by_what_decides_it(tmp_path, monkeypatch):
    """CodefixEnvironment.start validates the tasks in real sandboxes once and keeps the report in loomrl's cache
    folder; a fresh environment (another run, another rollout actor) reads it there instead of validating again,
    unless what decides the result changed (here the sandbox limits); `tasks` only reads, and refuses before start."""
    from loomrl.env.api import TaskSetup
    from loomrl.env.tasks import codefix

    monkeypatch.setenv("LOOMRL_CACHE", str(tmp_path))
    setup = TaskSetup(families=["clamp"], n_train=3, n_heldout=1, seed=0, heldout_template_share=0.0, sandbox="auto")
    first = codefix.CodefixEnvironment()
    with pytest.raises(RuntimeError, match="before start"):
        first.tasks(setup)
    asyncio.run(first.start(setup))
    [cached] = (tmp_path / "codefix-validation").iterdir()
    assert json.loads(cached.read_text())["valid"] == 3

    async def no_sandboxes(*args, **kwargs):
        raise AssertionError("validated again")

    monkeypatch.setattr(codefix, "validate_codefix", no_sandboxes)
    second = codefix.CodefixEnvironment()
    asyncio.run(second.start(setup))
    assert second.tasks(setup) == first.tasks(setup) and len(first.tasks(setup)[1]) == 1
    limited = TaskSetup(**{**{f: getattr(setup, f) for f in setup.__dataclass_fields__},
                           "sandbox_limits": {"cpu_seconds": 30}})
    with pytest.raises(AssertionError, match="validated again"):
        asyncio.run(second.start(limited))
    cached.write_text("{not json")  # a report that cannot be read is made again
    with pytest.raises(AssertionError, match="validated again"):
        asyncio.run(codefix.CodefixEnvironment().start(setup))
