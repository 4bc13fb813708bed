"""Black-box agents: real programs written with the real `openai` client, run as separate processes in
real sandboxes against the gateway (over its unix socket), on a tiny model; and a few async training
steps of the shipped example agent through `loomrl train`'s code path."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import pytest

from loomrl.agent.blackbox import SITE_INSIDE, BlackBoxRunner, site_packages
from loomrl.agent.gateway import Budget, Gateway, ServerThread
from loomrl.engine.base import SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.env.pool import EnvPool
from loomrl.env.sandbox.bwrap import BwrapSandbox, bwrap_available
from loomrl.trainer.grpo import samples_from_group
from loomrl.types import Task

pytest.importorskip("openai")
pytestmark = [
    pytest.mark.integration,  # starts processes, servers or training runs: not in `make test-fast`
    pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not installed (make test installs it)"),
]
ROOT = Path(__file__).resolve().parents[2]

# A ReAct agent that also prints, as its last line, the token ids the gateway says it sampled.
RECORDING_AGENT = '''
import json
from openai import OpenAI
client = OpenAI(max_retries=0)
task = json.load(open("task.json"))
tools = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
messages = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": task["prompt"]}]
seen = []
for turn in range(3):
    out = client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=6,
                                         extra_body={"return_token_ids": True})
    seen.append(out.choices[0].model_extra["token_ids"])
    messages.append(out.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": f"Result: {turn}. Go on."})
print(json.dumps(seen))
'''

NETWORK_PROBE = '''
import json, socket, sys
from openai import OpenAI
out = {}
for name, addr in [("host_loopback", ("127.0.0.1", int(sys.argv[1]))), ("outside", ("1.1.1.1", 53))]:
    try:
        socket.create_connection(addr, timeout=2).close()
        out[name] = "CONNECTED"
    except OSError as err:
        out[name] = "blocked: " + type(err).__name__
reply = OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3)
out["gateway"] = reply.object
print(json.dumps(out))
'''


SELF_REWARDING_AGENT = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/reward", data=json.dumps({"reward": {"self": 0.7}}).encode(),
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
print(urllib.request.urlopen(req).read().decode())
"""


def run_agent(tiny_model, tokenizer, script: str, args: list[str] | None = None, budget: Budget | None = None,
              agent_reward: bool = False, private: Path | None = None):
    """`private`: a folder only root may enter, holding the gateway socket, the package folder the
    sandbox binds (a link to this environment's site-packages) and the sandboxes' own folders."""
    async def go():
        engine = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer)
        gateway = Gateway(engine, tokenizer, "tiny", allow_agent_reward=agent_reward)
        import tempfile

        folder = tempfile.mkdtemp(prefix="loomrl-gw-test-", dir=private)
        sock = f"{folder}/gw.sock"
        binds = BlackBoxRunner.sandbox_binds(sock)
        if private is not None:
            site = private / "site-packages"
            site.symlink_to(site_packages())
            binds[str(site)] = SITE_INSIDE
        servers = [ServerThread(gateway.app(), uds=sock), ServerThread(gateway.app())]
        pool = await EnvPool(lambda: BwrapSandbox(root=str(private) if private else None, binds=binds), size=2).start()
        try:
            runner = BlackBoxRunner(gateway, pool, ["python3", "agent.py", *(args or [])], gateway_url=servers[1].url,
                                    files={"agent.py": script}, timeout_s=60, budget=budget,
                                    sampling=SamplingParams(temperature=1.0, max_tokens=6))
            task = Task(task_id="t0", prompt="Ana has 3 apples and gets 4 more. How many?", answer="7")
            return await runner.run(task, group_id="g0")
        finally:
            await pool.close()
            for s in servers:
                s.stop()
            engine.close()

    return asyncio.run(go())


def test_sandboxed_openai_agent_trains_on_exactly_the_tokens_it_was_given(tiny_model, tokenizer):
    run = run_agent(tiny_model, tokenizer, RECORDING_AGENT)
    assert run.returncode == 0, run.stderr[-500:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    traj = run.trajectory
    assert traj.status == "completed" and len(traj.all_turns()) == 3
    sample = samples_from_group([traj, traj])[0]
    trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert trained == [t for ids in seen for t in ids]  # the trained tokens are the sampled tokens, exactly
    assert traj.segments == [] and traj.turns[0].obs_span is not None  # one context: calls merged
    assert all(len(t.versions) == len(t.logprobs) == t.act_span.end - t.act_span.start for t in traj.turns)


def test_agent_runs_when_everything_its_sandbox_binds_lies_under_a_private_folder(tiny_model, tokenizer, tmp_path):
    """The regression behind a hung `make test` in a clone under a 0700 folder (mktemp -d, root's home):
    bwrap ran as the sandbox's uid, which cannot traverse such a folder, and failed with "Can't find
    source path ...: Permission denied". Here the gateway socket, the package folder and the
    sandboxes' workdirs all lie under a 0700 folder, wherever the checkout itself is."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    run = run_agent(tiny_model, tokenizer, RECORDING_AGENT, private=private)
    assert run.returncode == 0, run.stderr[-500:]
    assert run.trajectory.status == "completed" and len(run.trajectory.all_turns()) == 3
    assert oct(private.stat().st_mode & 0o777) == "0o700"  # nothing was loosened to make it work


def test_sandboxed_agent_reaches_the_gateway_and_nothing_else(tiny_model, tokenizer):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        run = run_agent(tiny_model, tokenizer, NETWORK_PROBE, [str(server.getsockname()[1])])
    finally:
        server.close()
    assert run.returncode == 0, run.stderr[-500:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["host_loopback"].startswith("blocked") and out["outside"].startswith("blocked"), out
    assert out["gateway"] == "chat.completion" and not accepted


def test_agent_past_its_budget_gets_an_error_and_the_trajectory_is_truncated(tiny_model, tokenizer):
    run = run_agent(tiny_model, tokenizer, RECORDING_AGENT, budget=Budget(max_calls=2))
    assert run.returncode != 0 and "BadRequestError" in run.stderr and "call budget of 2 calls is spent" in run.stderr
    traj = run.trajectory
    assert traj.status == "truncated" and len(traj.all_turns()) == 2 and "call budget of 2" in traj.error


def test_blackbox_example_trains_asynchronously(tmp_path):
    from loomrl.config import load_config
    from loomrl.run_folder import read_ledger
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    cfg = load_config(ROOT / "examples" / "blackbox_agent" / "train.yaml", [
        f"output_dir={tmp_path}", "progress=false", "model.kind=tiny", "trainer.total_steps=2",
        "trainer.groups_per_step=2", "trainer.group_size=4", "eval.n_tasks=0", "sampling.max_tokens=8",
        "reward.function=rewards_for_tests:parity_reward", "checkpoint_every=0"])
    summary = train(cfg)
    assert summary["steps"] == 2
    counts = summary["rollouts"]["training"]
    assert sum(counts["ended"].values()) == counts["launched"] >= 16, counts
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    white_box_columns = set(rows[0])  # the same store schema as white-box runs
    assert {"token_ids", "loss_mask", "logprobs", "versions", "turns"} <= white_box_columns
    trained = {tid for entry in read_ledger(cfg.run_dir) for tid in entry.trained}
    # parity rewards vary within a group of 4 except with probability 1/8; 4 groups all flat: 1 in 4096
    assert trained and trained <= {r["trajectory_id"] for r in rows}
    for r in rows:
        assert r["status"] in ("completed", "truncated"), r["error"]
        assert len(r["loss_mask"]) == len(r["token_ids"]) == len(r["logprobs"]) and sum(r["loss_mask"]) > 0


def test_agent_reports_its_reward_where_the_task_allows_it(tiny_model, tokenizer):
    run = run_agent(tiny_model, tokenizer, SELF_REWARDING_AGENT, agent_reward=True)
    assert run.returncode == 0 and json.loads(run.stdout) == {"ok": True}
    assert run.trajectory.reward_components == {"self": 0.7}
    refused = run_agent(tiny_model, tokenizer, SELF_REWARDING_AGENT, agent_reward=False)
    assert refused.returncode != 0 and "403" in refused.stderr and refused.trajectory.reward_components == {}
