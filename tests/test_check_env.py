"""`loomrl check-env` (runtime/check_env.py, agent/endpoint.py, runtime/check_report.py) against `loomrl serve`'s
app (server/app.py) on a loopback port, through the real `openai` client, with real environments: the calculator on
the tiny random model, and a lookup ToolEnv whose tool has a bug (tests/check_env_envs_for_tests.py). Where a capable
model is needed (one that calls the tool, then answers with what it gave), CapableEngine stands in for it behind the
same server: the random tiny model never writes a tool call."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from check_env_envs_for_tests import CapableEngine

from loomrl.agent.gateway import ServerThread
from loomrl.cli import main
from loomrl.server.app import create_app

pytestmark = pytest.mark.integration  # starts servers: not in `make test-fast`

pytest.importorskip("openai")
TESTS = Path(__file__).resolve().parent


def recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


LOOKUP = "name: check-lookup\nmodel: {kind: tiny}\nenv:\n  name: check_env_envs_for_tests:Lookup\n  n_train: 3\n" \
         "  n_heldout: 3\nagent: {max_turns: 3}\n"


@pytest.fixture
def capable(tokenizer):
    """`loomrl serve`'s app over CapableEngine, on a free loopback port."""
    server = ServerThread(create_app(CapableEngine(tokenizer), tokenizer, "capable"))
    yield server.url + "/v1"
    server.stop()


def check(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["check-env", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_calculator_on_the_tiny_model_counts_match_the_episodes(tmp_path, tiny_model, tokenizer, capsys):
    """The calculator (its tool in process sandboxes, its own reward) against the tiny random model served by
    `loomrl serve`'s app: every count of the report agrees with its episodes, and nothing is blamed on the
    environment."""
    from loomrl.engine.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, kv_budget_tokens=4096)
    server = ServerThread(create_app(engine, tokenizer, "tiny"))
    try:
        cfg = recipe(tmp_path, "name: calc\nmodel: {kind: tiny}\nsampling: {max_tokens: 8}\nenv:\n  families: [add]\n"
                     "  n_train: 4\n  n_heldout: 3\n  sandbox: process\nagent: {max_turns: 2}\n")
        rc, out, err = check([cfg, "--base-url", server.url + "/v1", "--n", "5", "--json"], capsys)
    finally:
        server.stop()
        engine.close()
    report = json.loads(out)
    episodes = report["episode_list"]
    assert report["model"] == "tiny" and report["env"] == "calculator"
    # --n 5, but the held-out split has 3 tasks (`add` has no template to hold out): all 3 are played
    assert report["planned"] == report["episodes"] == len(episodes) == 3
    assert sum(report["statuses"].values()) == 3
    assert report["statuses"] == {k: sum(e["ending"] == k for e in episodes) for k in report["statuses"]}
    assert report["turns_mean"] == pytest.approx(sum(e["turns"] for e in episodes) / 3)
    assert 1 <= report["turns_mean"] <= 2  # agent.max_turns=2
    scored = [e for e in episodes if e["success"] is not None]
    assert report["success"]["n"] == len(scored) == 3
    assert report["success"]["success"] == sum(e["success"] for e in scored) / 3
    assert not report["env_failed"] and rc == 0, report["verdict"]
    assert report["verdict"].startswith("VERDICT: the environment")
    assert "check-env" in err  # the progress bar


def test_a_buggy_tool_is_the_environments_failure_not_the_models(tmp_path, capable, capsys):
    """A capable model calls the lookup tool on every task; the tool raises AttributeError every time: the report
    counts each call as raised (AttributeError), the verdict blames the environment and the exit code is 1. With
    the bug fixed, the same model solves every task and the verdict says the environment works."""
    cfg = recipe(tmp_path, LOOKUP)
    rc, out, _ = check([cfg, "--base-url", capable, "--json"], capsys)
    report = json.loads(out)
    assert rc == 1 and report["env_failed"]
    assert report["tools"]["lookup"] == {"calls": 3, "refused": 0, "timeout": 0, "raised": {"AttributeError": 3},
                                         "first_raised": "lookup raised AttributeError: 'NoneType' object has no "
                                                         "attribute 'group'"}
    assert report["statuses"] == {"completed": 3} and report["success"]["n"] == 3
    assert report["success"]["success"] == 0.0 and report["turns_mean"] == 2.0
    assert report["verdict"].startswith("VERDICT: the environment failed: tool 'lookup' raised on 3 of its 3 calls "
                                        "(AttributeError 3)")
    # what the environment parsed: the reply's OpenAI tool call, in the Hermes form it reads
    assert report["episode_list"][0]["replies"][0] == '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}' \
                                                      '</tool_call>'

    rc, text, _ = check([cfg, "--base-url", capable], capsys)
    assert rc == 1
    assert "  lookup         3        0        0  AttributeError 3" in text.splitlines()
    assert text.splitlines()[-1] == report["verdict"]

    rc, out, _ = check([cfg, "env.args.buggy=false", "--base-url", capable, "--json"], capsys)
    fixed = json.loads(out)
    assert rc == 0 and not fixed["env_failed"]
    assert fixed["tools"]["lookup"]["calls"] == 3 and fixed["tools"]["lookup"]["raised"] == {}
    assert fixed["success"] == {"success": 1.0, "n": 3, "stderr": 0.0}
    assert [e["final_answer"] for e in fixed["episode_list"]] == ["11", "22", "33"]
    assert fixed["verdict"].startswith("VERDICT: the environment works")


def test_an_endpoint_that_cannot_serve_stops_in_one_line(tmp_path, capable, capsys):
    """Nothing listens on the port: the check stops after its bounded retries with one line naming the URL and the
    cause, exit code 2, and no report. A model the endpoint does not serve stops the same way; an endpoint that refuses
    every request is reported as the endpoint's failure (engine_error), never the environment's."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = recipe(tmp_path, LOOKUP)
    t0 = time.monotonic()
    rc, out, err = check([cfg, "--base-url", f"http://127.0.0.1:{port}/v1"], capsys)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"check-env: no reply from http://127.0.0.1:{port}/v1 after 3 attempt(s); "
                                        "the last: APIConnectionError: Connection error."]
    assert time.monotonic() - t0 < 10  # 0.5 s + 1 s of backoff

    rc, out, err = check([cfg, "--base-url", capable, "--model", "nope"], capsys)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"check-env: {capable} does not serve --model 'nope'; it serves 'capable'"]

    # a request the endpoint refuses (prompt + max_tokens past its KV budget: a 400) ends that episode engine_error,
    # the endpoint's failure, not the environment's; when it refuses every one, the check could not be made: exit 2
    rc, out, _ = check([cfg, "--base-url", capable, "--max-tokens", str(1 << 21), "--json"], capsys)
    report = json.loads(out)
    assert rc == 2 and report["statuses"] == {"engine_error": 3} and not report["env_failed"]
    assert "exceeds the engine's KV budget" in next(iter(report["first_errors"].values()))
    assert report["verdict"].startswith("VERDICT: no episode was scored; the endpoint refused 3 episode(s)")


class SlowCapable(CapableEngine):
    """CapableEngine with a pause per reply, so that a Ctrl-C lands mid-check."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.served = 0

    async def generate(self, request):
        import asyncio

        await asyncio.sleep(0.2)
        self.served += 1
        return await super().generate(request)


def test_ctrl_c_reports_the_episodes_that_finished(tmp_path, tokenizer):
    """`loomrl check-env` as a process, interrupted (SIGINT) once a few replies were served: it stops with exit
    code 130 and reports the episodes that finished, as interrupted."""
    engine = SlowCapable(tokenizer)
    server = ServerThread(create_app(engine, tokenizer, "capable"))
    cfg = recipe(tmp_path, LOOKUP.replace("n_heldout: 3", "n_heldout: 40"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "loomrl", "check-env", cfg, "--base-url", server.url + "/v1",
                             "--n", "40", "--concurrency", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while engine.served < 5 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert engine.served >= 5, "the check never got going"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.stop()
    assert proc.returncode == 130, err[-2000:]
    head = out.splitlines()[0]
    assert "(interrupted: " in head and head.endswith(" of 40 finished)")
    finished = int(head.split("(interrupted: ")[1].split(" of ")[0])
    assert 2 <= finished < 40
    assert f"completed {finished}" in out and "Traceback" not in err
