"""runtime.backend=ray on a real two-node Ray cluster on loopback: two `ray start` processes, each its
own node with its own resources (the trainer's node: {trainer: 1}; the rollout node: {rollout: 2}).
The run is a real `loomrl train` process (the driver); the chaos test SIGKILLs actor processes while
it runs. Without ray installed these tests are skipped; the message the CLI gives then is checked."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from ledger_checks import check_each_trajectory_once, check_run
from ray_clusters import kill_tagged, tagged

from loomrl.metrics.logger import read_metrics
from loomrl.run_folder import LedgerEntry, read_ledger
from loomrl.store import read_rows, read_trajectories

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runs(pid: int, needle: str) -> bool:
    """Whether a process below `pid` has `needle` in its command line."""
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                stack.extend(int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split())
        except OSError:
            continue
        if p != pid and needle in _title(p):
            return True
    return False


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def cluster():
    """A head node (trainer) and a second node (rollouts) on loopback; torn down by pid in any case."""
    pytest.importorskip("ray")
    tag = secrets.token_hex(6)
    tmp = tempfile.mkdtemp(prefix="lrray-")  # short: Ray's unix socket paths must stay under 108 bytes
    port = _free_port()
    # A token of our own: Ray enables token auth when ~/.ray/auth_token exists; all three processes
    # (head, node, driver) must then agree, so each gets the same one through the environment.
    env = {**os.environ, "LOOMRL_RAY_TEST": tag, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", f"--temp-dir={tmp}", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    try:
        t0 = time.time()
        # two GPUs that do not exist (Ray only counts them; nothing runs on them): where colocated actors are placed
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", "--num-gpus=2",
                        '--resources={"trainer": 1, "reward": 2, "sandbox": 1, "engine": 1}', *common], env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", '--resources={"rollout": 2}', *common],
                       env=env, check=True, capture_output=True, timeout=120)
        print(f"two-node cluster up in {time.time() - t0:.1f}s")
        yield {"address": f"127.0.0.1:{port}", "env": env, "tag": tag, "tmp": tmp}
    finally:
        kill_tagged(tag, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _train(cluster, tmp_path, name: str, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", f"name={name}",
            "progress=false", "reward.function=rewards_for_tests:parity_reward", "eval.n_tasks=0",
            "runtime.backend=ray", f"ray.address={cluster['address']}", "ray.rollout.count=2",
            "ray.rollout.num_cpus=0", "ray.trainer.num_cpus=0",
            "ray.rollout.resources={rollout: 1}", "ray.trainer.resources={trainer: 1}", *overrides]
    return subprocess.Popen(args, env={**cluster["env"], **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish_with(proc: subprocess.Popen, chaos, timeout_s: float) -> dict:
    """Run `chaos` on a thread while the run goes on; the run's summary (it must have succeeded)."""
    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        killer.join(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.ray
def test_two_node_run_places_trainer_and_rollouts_on_their_nodes(cluster, tmp_path):
    t0 = time.time()
    proc = _train(cluster, tmp_path, "two", "trainer.total_steps=3", "checkpoint_every=2")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and "ledger: launched" in out
    placement = summary["ray"]["placement"]
    assert placement["trainer"] and len(set(placement["rollout"])) == 1
    assert placement["trainer"] not in placement["rollout"], "trainer and rollouts must sit on different nodes"
    run_dir = tmp_path / "two"
    check_run(run_dir, summary, 3)
    assert (run_dir / "checkpoints" / "step_000003" / "model" / "config.json").is_file()
    # weight transfers to the rollout actors are timed (reported by the step after they finish)
    syncs = [m for m in read_metrics(run_dir) if m.get("kind") == "train" and "weight_sync/load_s" in m]
    assert syncs and all(m["weight_sync/load_s"] >= 0 and m["weight_sync/apply_s"] > 0 for m in syncs)
    # the rollout actors' own engines are read each step (engine/readings.py), their readings a step late at most
    engine = [m for m in read_metrics(run_dir) if m.get("kind") == "train" and "engine/busy_frac" in m]
    assert engine and all(0 <= m["engine/busy_frac"] <= 1 and m["engine/queue_depth"] >= 0 for m in engine), engine
    assert any(m["engine/busy_frac"] > 0 for m in engine) and sum(m["engine/requests"] for m in engine) > 0
    _the_viewer_reads_it(run_dir)
    print(f"two-node run: {time.time() - t0:.1f}s")


def _the_viewer_reads_it(run_dir) -> None:
    """`loomrl view` on a Ray run folder: the trainer actor's records (entropy, advantages as trained, per-token
    gaps) and the driver's group lines reach the same API a local run's do."""
    from fastapi.testclient import TestClient

    from loomrl.view.app import create_app

    client = TestClient(create_app([run_dir]))
    curves = client.get("/api/metrics", params={"run": run_dir.name}).json()["records"]
    # every step the trainer ran reaches the viewer with its entropy; a step whose groups all carried no signal
    # (zero reward variance, likely with a random model) is skipped and has none
    trained_steps = [m for m in read_metrics(run_dir) if m.get("kind") == "train" and "train/loss_tokens" in m]
    shown = [m for m in curves if m.get("kind") == "train" and m.get("train/entropy", 0) > 0]
    assert trained_steps and [m["step"] for m in shown] == [m["step"] for m in trained_steps]
    timeline = client.get("/api/timeline", params={"run": run_dir.name}).json()
    assert timeline["recorded"] and all(g["slowest"]["gen_s"] > 0 for g in timeline["groups"] if g["slowest"])
    trained = [t for e in read_ledger(run_dir) for t in e.trained]
    body = client.get("/api/trajectory", params={"run": run_dir.name, "id": trained[0]}).json()
    assert body["advantage_source"].startswith("as trained (step") and body["logprob_gap"].startswith("recorded")
    assert any(g is not None for ctx in body["contexts"] for g in ctx["gap"] or [])


@pytest.mark.ray
def test_colocated_engine_and_trainer_ranks_share_a_gpu_each(cluster, tmp_path):
    """engine.sleep_while_training on Ray: engine actor i and trainer rank i take half of the same GPU (one bundle of a
    placement group each); the run trains, the engines sleeping through each step. The head node's two GPUs are
    Ray's bookkeeping only (this machine has none): what is checked is where Ray put the actors."""
    proc = _train(cluster, tmp_path, "coloc", "trainer.total_steps=2", "checkpoint_every=0", "runtime.mode=async",
                  "trainer.world_size=2", "ray.trainer.resources={}", "ray.trainer.num_gpus=0.5",
                  "ray.engine.count=2", "ray.engine.num_gpus=0.5", "ray.engine.num_cpus=0",
                  "engine.sleep_while_training=true")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    placement = summary["ray"]["placement"]
    engines, trainers = placement["engine_gpus"], placement["trainer_gpus"]
    assert engines == trainers, placement  # rank i beside engine i
    assert sorted(g.split("/")[1] for ids in engines for g in ids) == ["0", "1"], placement  # one GPU each, both used
    check_run(tmp_path / "coloc", summary, 2)


@pytest.mark.ray
def test_chaos_kills_actors_and_the_run_accounts_for_every_trajectory_once(cluster, tmp_path):
    """Two data-parallel trainer ranks and two reward actors. A thread SIGKILLs a random rollout actor
    (four times), the trainer actor (rank 0, twice), the other trainer rank (once) and a reward actor
    (twice), the trainer ranks only after the first checkpoint, as the run advances; the run completes
    and its ledger adds up."""
    steps = 8
    # both trainer ranks on the trainer node (it offers {trainer: 1}), the reward actors too ({reward: 2})
    proc = _train(cluster, tmp_path, "chaos", f"trainer.total_steps={steps}", "checkpoint_every=2",
                  "runtime.retry_backoff_s=0.2", "runtime.max_group_attempts=3", "trainer.world_size=2",
                  "ray.trainer.resources={trainer: 0.5}", "ray.reward.count=2", "ray.reward.num_cpus=0",
                  "ray.reward.resources={reward: 1}")
    run_dir = tmp_path / "chaos"
    killed: list[str] = []
    stop = threading.Event()

    def chaos() -> None:
        # Kills follow the run's progress, not the clock (a fast run must not finish before the kills):
        # each time the ledger gains a step, the next kill of the plan; the trainer only once a
        # checkpoint exists (checkpoint_every=2), so that it has something to resume from.
        rng = random.Random(0)
        plan = ["rollout", "reward", "trainer", "rollout", "trainerrank", "reward", "rollout", "trainer", "rollout"]
        title = {"rollout": "ray::RolloutActor", "trainer": "ray::TrainerActor", "trainerrank": "ray::TrainerRankActor",
                 "reward": "ray::RewardActor"}
        seen = 0
        while not stop.wait(0.25) and proc.poll() is None and plan:
            try:
                n = len(read_ledger(run_dir))
            except ValueError:  # a line being written
                continue
            if n <= seen:
                seen = min(seen, n)  # a restarted trainer cut the ledger back to its checkpoint
                continue
            seen = n
            what = plan[0] if not plan[0].startswith("trainer") or n >= 2 else "rollout"
            actors = {pid: _title(pid) for pid in tagged(cluster["tag"], cluster["tmp"])}
            victims = [p for p, t in actors.items() if t.startswith(title[what])]
            if not victims:
                continue
            try:
                os.kill(rng.choice(victims), signal.SIGKILL)
            except OSError:
                continue
            killed.append(what)
            plan.remove(what)

    killer = threading.Thread(target=chaos, daemon=True)
    t0 = time.time()
    killer.start()
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        killer.join(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    print(f"chaos run: {time.time() - t0:.1f}s, killed {killed}, ray {summary['ray']}, "
          f"accounting {summary['accounting']}")
    assert summary["steps"] == steps
    assert "trainer" in killed and "trainerrank" in killed and killed.count("rollout") >= 2, killed
    assert summary["trainer_restarts"] >= 2 and summary["ray"]["rollout_restarts"] >= 1
    placement = summary["ray"]["placement"]
    assert placement["trainer_ranks"] == [placement["trainer"]]  # the second rank on the trainer node
    assert placement["trainer_bundles"] == [{"trainer": 0.5}] * 2  # both ranks reserved in one placement group
    assert placement["reward"] == [placement["trainer"]] * 2
    assert killed.count("reward") == 2 and summary["ray"]["reward_restarts"] >= 1  # Ray restarted them
    assert summary["rollouts"]["training"]["among_ended"].get("reward_failed", 0) == 0  # ... and ran their calls again
    assert "ledger: launched" in out
    check_run(run_dir, summary, steps)
    assert summary["accounting"]["failed"].get("actor_died", 0) > 0


@pytest.mark.ray
def test_a_reward_actor_that_stays_dead_marks_trajectories_reward_failed_and_the_run_goes_on(cluster, tmp_path):
    """One reward actor whose reward function kills the actor on the 6th call, with Ray's restarts
    off: the scoring calls fail, their trajectories are stored as reward_failed with the reason and
    left out of training (skipped: reward_failed), and the run completes (asked to go on past steps none of whose
    trajectories could be scored: runtime.tolerate_failed_steps; without it such a step stops the run)."""
    proc = _train(cluster, tmp_path, "noreward", "trainer.total_steps=3", "checkpoint_every=0",
                  "runtime.tolerate_failed_steps=true",
                  "reward.function=rewards_for_tests:reward_that_kills_its_actor", "ray.reward.count=1",
                  "ray.reward.num_cpus=0", "ray.reward.resources={reward: 1}", "ray.reward.max_restarts=0")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["rollouts"]["training"]["among_ended"]["reward_failed"] > 0
    run_dir = tmp_path / "noreward"
    check_each_trajectory_once(run_dir, 3)
    assert summary["accounting"]["violations"] == []
    ledger = read_ledger(run_dir)
    skipped = [t for e in ledger for t in e.skipped.get("reward_failed", [])]
    assert skipped, ledger
    rows = {r["trajectory_id"]: r for r in read_rows(run_dir / "trajectories")}
    for tid in skipped:
        assert rows[tid]["error"].startswith("reward failed: reward actor 0: "), rows[tid]["error"]
        assert rows[tid]["reward_components"] == {"reward_failed": 0.0}
    trained = {t for e in ledger for t in e.trained}
    assert not trained & set(skipped)


def _stand_in_judge() -> tuple[str, list[int], object]:
    """A stand-in for a judge model whose reply the test must control: an OpenAI-style /v1/chat/completions that
    always says "Score: 7" and reports 10 + 2 tokens, counting its requests. (The judge against a real `loomrl serve`
    is tested in tests/reward/test_judge.py.)"""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests: list[int] = []

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            requests.append(1)
            body = json.dumps({"id": "j", "object": "chat.completion", "created": 0, "model": "m",
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": "Score: 7"}}],
                               "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1", requests, server


@pytest.mark.ray
def test_the_judges_counts_reach_the_step_metrics_from_the_actors(cluster, tmp_path):
    """reward.judge on Ray: the judge runs in the rollout actors' reward pools; the driver reads their counters each
    step, so judge/calls, tokens and cost are logged, and they add up to what the judge was asked."""
    url, requests, server = _stand_in_judge()
    try:
        proc = _train(cluster, tmp_path, "judged", "trainer.total_steps=3", "checkpoint_every=0",
                      f"reward.judge={{base_url: '{url}', model: m, cache: false, "
                      "prices: {prompt: 1.0, completion: 2.0}}")
        out, _ = proc.communicate(timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, out[-3000:]
    train = [m for m in read_metrics(tmp_path / "judged") if m["kind"] == "train"]
    calls = sum(m.get("judge/calls", 0) for m in train)
    assert calls > 0 and any("judge/calls" in m for m in train), train
    # read a step late at most: what the last step had not yet read stays in the actors
    assert calls <= len(requests)
    # a snapshot may catch a call in flight: counted as a call, its tokens not yet in (they come at a later step)
    prompt = sum(m.get("judge/prompt_tokens", 0) for m in train)
    completion = sum(m.get("judge/completion_tokens", 0) for m in train)
    assert 0 < prompt <= 10 * calls and completion == prompt / 5
    assert sum(m.get("judge/cost_usd", 0) for m in train) == pytest.approx((prompt * 1.0 + completion * 2.0) / 1e6)
    rows = read_rows(tmp_path / "judged" / "trajectories")
    assert rows and all(r["reward_components"].get("judge") == 0.7 for r in rows if r["total_reward"]
                        is not None)


@pytest.mark.ray
def test_env_actors_run_the_sandboxes_on_their_node_and_survive_a_kill(cluster, tmp_path):
    """env.name=codefix (every episode leases a sandbox, writes a repository into it and runs the
    hidden tests there, whatever the tiny model says) with the sandboxes in an env actor on the head
    node and the engines on the other node. The env actor is SIGKILLed mid-run while hidden tests run
    in one of its sandboxes: Ray restarts it, and episodes whose sandboxes died end env_error and run
    again (agent.retry_on; 0-8 per run here: none when the kill lands as the busy episode ends and
    the others wait out the restart). Later both rollout actors are SIGKILLed while hidden tests run:
    the env actor reclaims the leases they held (how many depends on timing; the bookkeeping itself is
    tested deterministically in test_env_pool.py). The run completes with every trajectory accounted for."""
    steps = 6
    proc = _train(cluster, tmp_path, "envs", f"trainer.total_steps={steps}", "checkpoint_every=0", "env.name=codefix",
                  "env.families=[clamp, chunk]", "env.n_train=8", "env.n_heldout=4", "reward.function=null",
                  "agent.max_turns=2", "trainer.group_size=2", "ray.env.count=1", "ray.env.num_cpus=0",
                  "ray.env.resources={sandbox: 1}", "agent.retry_on=[env_error]", "agent.max_retries=2",
                  "agent.retry_backoff_s=0.05")
    run_dir = tmp_path / "envs"
    killed = []

    def kill_while_a_sandbox_is_leased() -> None:
        # Kills while an episode's hidden tests run in a sandbox of the env actor, so that an episode
        # surely holds a lease then (health checks and resets run other commands): at step 1-2 the env
        # actor; at step 4-5 both rollout actors (one of them owns that lease). Admission runs at most
        # max_policy_lag + 1 = 2 steps ahead, so the groups the env kill hit (and their retries) are
        # consumed, and stored, by step 4: the rollout kill cannot take them with it, and the last
        # step consumes what the rollout kill made run again.
        deadline = time.time() + 240
        plan = [(1, "ray::EnvActor"), (4, "ray::RolloutActor")]
        while plan and time.time() < deadline and proc.poll() is None:
            after, title = plan[0]
            n = len(read_ledger(run_dir))
            if n >= after:
                actors = {p: _title(p) for p in tagged(cluster["tag"], cluster["tmp"])}
                env = [p for p, t in actors.items() if t.startswith("ray::EnvActor")]
                # when no hidden tests were seen running during the step, at its end anyway
                if (env and _runs(env[0], "unittest")) or n > after:
                    for pid in [p for p, t in actors.items() if t.startswith(title)]:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(title)
                    plan.pop(0)
            time.sleep(0.01)

    summary = _finish_with(proc, kill_while_a_sandbox_is_leased, 400)
    rows = read_trajectories(run_dir / "trajectories").to_pylist()
    retried = [e for r in rows for e in r["retry_errors"]]
    print(f"env actor run: killed {killed}, retried {len(retried)}: {retried[:1]}; rollouts {summary['rollouts']}; "
          f"ray {summary['ray']}")
    placement = summary["ray"]["placement"]
    assert placement["env"] and placement["env"][0] not in placement["rollout"], placement  # another node
    assert killed.count("ray::EnvActor") == 1 and summary["ray"]["env_restarts"] == 1, (killed, summary["ray"])
    assert killed.count("ray::RolloutActor") == 2 and summary["ray"]["rollout_restarts"] == 2, summary["ray"]
    pool = summary["env_pool"]  # the env actor's own pool (the one that ran after the restart)
    assert pool["acquired"] > 0 and pool["created"] == pool["destroyed"], pool
    check_each_trajectory_once(run_dir, steps)
    assert summary["accounting"]["violations"] == []
    assert rows and all(r["status"] in ("completed", "truncated", "env_error") for r in rows)
    # ran in the sandbox: a repository was written and its hidden tests ran (the verdict is the answer)
    assert all(r["final_answer"] in ("tests_passed", "tests_failed") for r in rows if r["status"] != "env_error"), \
        {r["final_answer"] for r in rows}
    # a sandbox call failed (SandboxError, naming the env worker), in a step or in codefix's finalize
    assert all(e.startswith("env_error: ") and "SandboxError: " in e and "env worker" in e for e in retried), retried


def _cpu_s(pid: int) -> float:
    """The CPU seconds `pid` has used (user and system; 0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent, ... up to init (what is readable of it)."""
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        out.append(pid)
    return out


@pytest.mark.ray
def test_web_episodes_run_in_an_env_actor_that_owns_the_browsers_and_survive_its_kill(cluster, tmp_path):
    """env.name=web with ray.env.count=1: every episode runs in the env actor on the head node (its Environment, its
    browser pool, the shop), the rollout actors on the other node drive it through RemoteEnv. While it runs, every
    chromium process of the cluster descends from the env actor's process and none from a rollout actor's. After the
    first step, while the rollout actors generate (so some episode is open in the env actor: its turn is generated
    only after its reset answered), the env actor is stopped (SIGSTOP) for 2 s and SIGKILLed: the episodes it held end
    env_error (EnvWorkerLost, or the restarted actor's "no episode"; stored, never scored or trained;
    runtime.tolerate_failed_steps lets a step of only those pass), resets sent meanwhile wait for the restart, Ray
    restarts it with a fresh environment and browsers, and the run completes with every trajectory accounted for and
    no browser left. (The random model's replies hold no tool call, so each episode is a reset and one step: long
    replies, sampling.max_tokens, keep episodes open while their turn is generated.)"""
    from loomrl.env.browser.chromium import pids_mentioning

    steps = 4
    proc = _train(cluster, tmp_path, "web", f"trainer.total_steps={steps}", "checkpoint_every=0", "env.name=web",
                  "env.args={}", "env.families=[contact, find]", "env.n_train=8", "env.n_heldout=4",
                  "agent.max_turns=2", "agent.max_context_tokens=2048", "sampling.max_tokens=256",
                  "trainer.group_size=2", "trainer.groups_per_step=2", "runtime.tolerate_failed_steps=true",
                  "reward.function=loomrl.reward.smoke:even_token_share",  # graded: a group of 2 seldom ties
                  "env.browser.prewarm=2", "ray.env.count=1", "ray.env.num_cpus=0", "ray.env.resources={sandbox: 1}")
    run_dir = tmp_path / "web"
    seen: dict[int, list[str]] = {}  # browser process (bwrap, chromium) -> the titles of the cluster's processes above
    owners: dict[int, str] = {}  # the pids their dirs name as the owner (chromium.py: loomrl-chromium-<pid>-): titles
    killed = []

    def watch_the_browsers_then_kill_the_env_actor() -> None:
        deadline = time.time() + 400
        busy: list[tuple[float, float]] = []  # (time, the rollout actors' CPU seconds so far)
        while time.time() < deadline and proc.poll() is None:
            actors = {p: _title(p) for p in tagged(cluster["tag"], cluster["tmp"])}
            for pid in pids_mentioning("--loomrl-home="):
                if pid not in seen and any(a in actors for a in _ancestors(pid)):
                    seen[pid] = [actors[a] for a in _ancestors(pid) if a in actors]
                    for o in re.findall(r"loomrl-chromium-(\d+)-", _title(pid)):
                        owners.setdefault(int(o), _title(int(o)))
            if not killed and len(read_ledger(run_dir)) >= 1 and seen:
                busy.append((time.time(), sum(_cpu_s(p) for p, t in actors.items() if t.startswith("ray::RolloutA"))))
                busy = [b for b in busy if b[0] > busy[-1][0] - 1.5]
                if busy[-1][0] - busy[0][0] < 1.0 or busy[-1][1] - busy[0][1] < 0.3:
                    time.sleep(0.1)
                    continue  # not generating (at least 0.3 CPU seconds in the last second or so)
                for pid in [p for p, t in actors.items() if t.startswith("ray::EpisodeActor")]:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(2)
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    t0 = time.time()
    summary = _finish_with(proc, watch_the_browsers_then_kill_the_env_actor, 450)
    rows = read_trajectories(run_dir / "trajectories").to_pylist()
    lost = [r for r in rows if r["status"] == "env_error" and "env worker" in (r["error"] or "")]
    print(f"web env actor run in {time.time() - t0:.0f}s: {len(seen)} browser processes seen, killed {killed}, "
          f"{len(lost)} episodes lost with it; statuses {Counter(r['status'] for r in rows)}; ray {summary['ray']}; "
          f"env_pool {summary['env_pool']}")
    # below the env actor's process (through Playwright's driver and bwrap), made by it, and not below a rollout actor
    assert seen and all(any(t.startswith("ray::EpisodeActor") for t in titles) for titles in seen.values()), seen
    assert not any(t.startswith("ray::RolloutActor") for titles in seen.values() for t in titles), seen
    assert owners and all(t.startswith("ray::EpisodeActor") for t in owners.values()), owners
    placement = summary["ray"]["placement"]
    assert placement["env"] and placement["env"][0] not in placement["rollout"], placement  # another node
    assert len(killed) == 1 and summary["ray"]["env_restarts"] == 1, (killed, summary["ray"])
    assert summary["env_pool"]["browser_acquired"] > 0 and summary["env_pool"]["browser_launches"] >= 1
    stored = check_run(run_dir, summary, steps)
    assert lost, "the episodes the env actor was running when it was killed end env_error"
    trained = {t for e in read_ledger(run_dir) for t in e.trained}
    assert all(r["trajectory_id"] not in trained and r["trajectory_id"] in stored for r in lost)
    assert all(r["status"] in ("completed", "truncated", "env_error") for r in rows)
    assert not [p for o in owners for p in pids_mentioning(f"loomrl-chromium-{o}-")], "a browser outlived the run"


@pytest.mark.ray
def test_an_engine_actor_serves_both_rollout_actors_from_another_node_and_survives_a_kill(cluster, tmp_path):
    """ray.engine.count=1: the two rollout actors (rollout node) generate on one engine actor (head node) and
    get the weights through it. The engine actor is SIGKILLed after step 2: Ray restarts it, it loads the
    latest published weights before it serves (else its tokens would carry version 0, older than their groups'
    admission allows, and make a trajectory's versions go backwards), the requests it was running end engine_error and run
    again (agent.retry_on), and the run completes with every trajectory accounted for."""
    steps = 5
    proc = _train(cluster, tmp_path, "engines", f"trainer.total_steps={steps}", "checkpoint_every=0",
                  "ray.engine.count=1", "ray.engine.num_cpus=0", "ray.engine.resources={engine: 1}",
                  "agent.retry_on=[engine_error]", "agent.max_retries=3", "agent.retry_backoff_s=0.2")
    run_dir = tmp_path / "engines"
    killed = []

    def kill_the_engine_after_step_2() -> None:
        deadline = time.time() + 240
        while not killed and time.time() < deadline and proc.poll() is None:
            if len(read_ledger(run_dir)) >= 2:
                actors = {p: _title(p) for p in tagged(cluster["tag"], cluster["tmp"])}
                for pid in [p for p, t in actors.items() if t.startswith("ray::EngineActor")]:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    summary = _finish_with(proc, kill_the_engine_after_step_2, 400)
    ray_report = summary["ray"]
    print(f"engine actor run: killed {killed}; ray {ray_report}; accounting {summary['accounting']}")
    placement = ray_report["placement"]
    assert len(placement["engine"]) == 1 and placement["engine"][0] not in placement["rollout"], placement
    assert len(killed) == 1 and ray_report["engine_restarts"] == 1, ray_report
    assert ray_report["engines"]["requests"] > 0  # the restarted engine served the rest of the run
    # the engine actor is read each step, not the rollout actors' clients; its restart counts from its start
    engine = [m for m in read_metrics(run_dir) if m.get("kind") == "train" and "engine/busy_frac" in m]
    assert engine and all(0 <= m["engine/busy_frac"] <= 1 and m["engine/requests"] >= 0 for m in engine), engine
    assert any(m["engine/busy_frac"] > 0 for m in engine)
    check_run(run_dir, summary, steps)
    assert not summary["accounting"]["failed"], summary["accounting"]  # positions are then the admission's own
    for row in read_trajectories(run_dir / "trajectories").to_pylist():
        versions = [v for v in row["versions"] if v >= 0]  # sampled tokens (-1: prompt and tool output)
        assert versions == sorted(versions), (row["trajectory_id"], versions)
        # A group is launched at a version that admits its position (groups_per_step 2, max_policy_lag 1) and runs
        # once its engine holds that version, so no token may be older. A restarted engine that served its initial
        # weights, or missed an update sent while it restarted, breaks this. (A group launched before the kill and
        # slowed by it may still turn stale at consumption: that is the bounded-staleness rule at work.)
        assert min(versions, default=row["position"] // 2 - 1) >= row["position"] // 2 - 1, (row["trajectory_id"],
                                                                                            row["position"], versions)


_LOST_UPDATE = """
import json, sys, ray, torch
from loomrl.config import load_config
from loomrl.engine.actor import EngineActor, WeightBoard
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.model.loader import load_run_model
from loomrl.weights.handle import Transport, WeightHandle

ray.init(address=sys.argv[1])
cfg = load_config(sys.argv[2], ["ray.engine.count=1"])
board = ray.remote(WeightBoard).options(num_cpus=0).remote()
engine = ray.remote(EngineActor).options(num_cpus=0, resources={"engine": 1}).remote(
    cfg.engine_setup().model_dump_json(), board, 0, 1)
model, _ = load_run_model(cfg.model, None)
weights = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
handle = WeightHandle(transport=Transport.RAY, version=3, nbytes=0, payload=ray.put(weights))
before = ray.get(engine.info.remote())[1]
ray.get(engine.catch_up.remote(handle))  # no update_weights call: the one the driver sent was lost
request = GenerationRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))
result = ray.get(engine.generate.remote(request))
print(json.dumps({"before": before, "after": ray.get(engine.info.remote())[1], "versions": result.versions}))
"""


@pytest.mark.ray
def test_an_engine_actor_loads_a_published_version_whose_update_was_lost_before_it_serves(cluster):
    """The race the kill test can hit: the driver's update_weights for version v reaches an engine actor that
    died after its restart read the board (version v-1), so it is lost. `ready(latest)`, which every dispatch
    awaits, must then load v itself, or the groups dispatched under v run on v-1 and are stale at consumption."""
    out = subprocess.run([sys.executable, "-c", _LOST_UPDATE, cluster["address"], str(RECIPE)], env=cluster["env"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0 and got["after"] == 3 and got["versions"] == [3] * len(got["versions"]), got


_BROADCAST = """
import asyncio, json, sys, ray, torch
from loomrl.config import load_config
from loomrl.engine.actor import EngineActor, WeightBoard
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.factory import make_engine
from loomrl.model.loader import load_run_model
from loomrl.weights.handle import Transport
from loomrl.weights.transports import make_publisher

ray.init(address=sys.argv[1])
cfg = load_config(sys.argv[2], ["ray.engine.count=2", "runtime.weight_transport=broadcast", "runtime.backend=ray"])
board = ray.remote(WeightBoard).options(num_cpus=0).remote()
cls = ray.remote(EngineActor).options(num_cpus=0, resources={"engine": 0.5})
receivers = cfg.weight_route().receivers  # engine i: ranks 1 + i * receivers.. of the group
engines = [cls.remote(cfg.engine_setup().model_dump_json(), board, i, 1 + i * receivers) for i in range(2)]
model, tokenizer = load_run_model(cfg.model, None)
publisher = make_publisher("broadcast", receivers=2, bucket_bytes=1 << 16, timeout_s=60)  # this script: the trainer
request = GenerationRequest(prompt_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=8, temperature=0.0))  # greedy
out = {"versions": []}
for version in (1, 2):
    g = torch.Generator().manual_seed(version)
    # the parameters as a trainer publishes them (tied ones once: a different lm_head would not be this model)
    weights = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}
    handle = publisher.publish(weights, version)
    assert handle.transport is Transport.BROADCAST
    timings = ray.get([e.update_weights.remote(handle) for e in engines], timeout=120)
    publisher.settle()
    reference = make_engine(cfg.engine_setup(), model, tokenizer, 0)  # a local engine given the same weights directly
    reference.update_weights(weights, version)
    want = asyncio.run(reference.generate(request))
    got = [ray.get(e.generate.remote(request)) for e in engines]
    out["versions"].append([t["version"] for t in timings])
    out[f"v{version}"] = [r.token_ids == want.token_ids and r.versions == [version] * len(r.token_ids) for r in got]
    initial = make_engine(cfg.engine_setup(), load_run_model(cfg.model, None)[0], tokenizer, 0)
    out[f"v{version}_differs_from_init"] = want.token_ids != asyncio.run(initial.generate(request)).token_ids
    initial.close()
    reference.close()
print(json.dumps(out))
"""


@pytest.mark.ray
def test_two_engine_actors_receive_broadcast_versions_exactly_over_one_group(cluster):
    """runtime.weight_transport=broadcast on Ray: two engine actors (built-in engines) join one process group (gloo
    here; NCCL between GPUs) as ranks 1 and 2 (rank_offset 1 + replica), and each version broadcast to them serves
    exactly as an engine given the same weights directly, tagged with that version; the second version reuses the
    group. Fails if the ranks collide (the rendezvous does not complete) or a bucket lands in the wrong place."""
    out = subprocess.run([sys.executable, "-c", _BROADCAST, cluster["address"], str(RECIPE)], env=cluster["env"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["versions"] == [[1, 1], [2, 2]], got
    assert got["v1"] == [True, True] and got["v2"] == [True, True], got
    assert got["v1_differs_from_init"] and got["v2_differs_from_init"], got  # so equality says the update landed


@pytest.mark.ray
def test_a_broadcast_run_on_engine_actors_trains_survives_its_trainer_and_stops_when_an_engine_dies(cluster,
                                                                                                    tmp_path):
    """A Ray run with runtime.weight_transport=broadcast: the trainer actor broadcasts every version to the engine
    actor's process (nothing through the object store); the run trains, each trajectory's token versions rise and the
    last step's groups carry trained versions. A second run survives its trainer actor's SIGKILL (the fresh trainer's
    new group is joined). A third run whose engine actor is SIGKILLed after step 2 stops with a RunError that says why
    (a fresh engine could not get the weights) and how to go on, instead of hanging in the group or serving initial
    weights."""
    steps = 4
    common = ["checkpoint_every=0", "ray.engine.count=1", "ray.engine.num_cpus=0", "ray.engine.resources={engine: 1}",
              "runtime.weight_transport=broadcast", "engine.vllm.update_timeout_s=60"]
    proc = _train(cluster, tmp_path, "broadcast", f"trainer.total_steps={steps}", *common)
    summary = _finish_with(proc, lambda: None, 400)
    run_dir = tmp_path / "broadcast"
    check_run(run_dir, summary, steps)
    rows = read_trajectories(run_dir / "trajectories").to_pylist()
    for row in rows:
        versions = [v for v in row["versions"] if v >= 0]
        assert versions == sorted(versions), (row["trajectory_id"], versions)
    assert max(v for row in rows for v in row["versions"]) >= steps - 2, "the engine never served a broadcast version"

    # The trainer actor SIGKILLed after step 3 (between two broadcasts: a version of this tiny model is sent in
    # milliseconds, right after its step): the fresh one resumes from step 2's checkpoint and opens a group of its
    # own, which the engine actor joins on the next version, and the run completes.
    proc = _train(cluster, tmp_path, "broadcast-trainer", "trainer.total_steps=6", *common[1:], "checkpoint_every=2",
                  "runtime.retry_backoff_s=0.2")
    trainers: list[int] = []

    def kill_the_trainer_after_step_3() -> None:
        deadline = time.time() + 240
        while not trainers and time.time() < deadline and proc.poll() is None:
            if len(read_ledger(tmp_path / "broadcast-trainer")) >= 3:
                time.sleep(0.5)  # past the broadcast that follows the step
                for pid in tagged(cluster["tag"], cluster["tmp"]):
                    if _title(pid).startswith("ray::TrainerActor"):
                        os.kill(pid, signal.SIGKILL)
                        trainers.append(pid)
            time.sleep(0.05)

    summary = _finish_with(proc, kill_the_trainer_after_step_3, 400)
    assert trainers and summary["trainer_restarts"] == 1, summary
    check_run(tmp_path / "broadcast-trainer", summary, 6)

    proc = _train(cluster, tmp_path, "broadcast-kill", "trainer.total_steps=12", *common)
    killed = []

    def kill_the_engine_after_step_2() -> None:
        deadline = time.time() + 240
        while not killed and time.time() < deadline and proc.poll() is None:
            if len(read_ledger(tmp_path / "broadcast-kill")) >= 2:
                for pid in tagged(cluster["tag"], cluster["tmp"]):
                    if not _title(pid).startswith("ray::EngineActor"):
                        continue
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_engine_after_step_2, daemon=True)
    killer.start()
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        killer.join(timeout=10)
    assert killed, "the engine actor was not found to kill"
    assert proc.returncode != 0, out[-3000:]
    assert "an engine actor died, and with runtime.weight_transport=broadcast no fresh one can get" in out, out[-3000:]
    assert "continue with --resume" in out


@pytest.mark.ray
def test_a_rollout_actor_that_cannot_start_stops_the_run_with_the_cause(cluster, tmp_path):
    """A constructor that raises (here: a reward module that imports where the run starts but not in the actors,
    as one whose package the rollout nodes lack) would raise in every fresh actor: the run stops at once and says
    why, instead of replacing actors until its budget ends."""
    t0 = time.time()
    proc = _train(cluster, tmp_path, "nostart", "trainer.total_steps=2",
                  "reward.function=rewards_driver_only:parity_reward", env={"LOOMRL_TEST_DRIVER": "1"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "failed to start" in out and "no_such_package" in out, out[-3000:]
    assert time.time() - t0 < 120


@pytest.mark.ray
def test_a_trainer_the_cluster_cannot_place_stops_the_run_with_what_is_missing(cluster, tmp_path):
    """Two trainer ranks of {trainer: 1} on a cluster with one: the run stops before any actor is made (it used to
    wait ray.placement_timeout_s for the ranks' placement group), with what it asks, what the cluster has and the
    setting to lower."""
    t0 = time.time()
    proc = _train(cluster, tmp_path, "noplace", "trainer.total_steps=1", "trainer.world_size=2",
                  "ray.trainer.resources={trainer: 1}", "ray.trainer_placement=STRICT_PACK",
                  "ray.placement_timeout_s=60")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("run error:")]
    assert said == ["run error: the run asks Ray for {rollout: 2, trainer: 2} in all (ray.rollout 2 x {rollout: 1}, "
                    "ray.trainer 2 x {trainer: 1}), but the Ray cluster at " + cluster["address"] + " has "
                    "{rollout: 2, trainer: 1}; lower ray.trainer.resources.trainer, or trainer.world_size"], out[-3000:]
    assert time.time() - t0 < 50


@pytest.mark.ray
@pytest.mark.parametrize("where", ["rollout_actors", "env_actor"])
def test_sandboxes_that_cannot_work_stop_the_run_with_one_line(cluster, tmp_path, where):
    """Sandboxes that cannot run anything (1 MB of address space), in the rollout actors' own pools or
    in an env actor: the run stops within seconds with one line carrying the sandbox's own error and
    the fix, instead of replacing sandboxes (or retrying leases) forever."""
    t0 = time.time()
    extra = (["ray.env.count=1", "ray.env.num_cpus=0", "ray.env.resources={sandbox: 1}"]
             if where == "env_actor" else [])
    proc = _train(cluster, tmp_path, "nosandbox", "trainer.total_steps=2", "env.sandbox=bwrap",
                  "env.sandbox_limits.address_space_mb=1", *extra)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    # (the output also holds what Ray forwards from the actors' logs, in any order: find the driver's line)
    said = [line for line in out.splitlines() if line.startswith("run error:")]
    assert len(said) == 1 and said[0].startswith("run error: sandbox error: 5 sandboxes in a row failed"), out[-3000:]
    assert "failed to map segment" in said[0] and "env.sandbox_limits" in said[0], said
    assert time.time() - t0 < 120


def test_a_dead_env_actor_is_a_sandbox_error_to_the_environment(monkeypatch):
    """What the environment code sees when an env actor dies mid-call: SandboxError with the reason
    (so the episode ends env_error and agent.retry_on applies), from awaited and blocking calls alike.
    The Ray error is constructed here (no cluster needed): it is what Ray raises for a dead actor; the
    blocking calls' ray.get is replaced by one that raises what a call on that actor would."""
    ray = pytest.importorskip("ray")
    import asyncio

    from loomrl.env.remote import _get, _remote
    from loomrl.env.sandbox.base import SandboxError

    async def dead_call():
        raise ray.exceptions.ActorDiedError()

    with pytest.raises(SandboxError, match="env worker failed: ActorDiedError"):
        asyncio.run(_remote(dead_call()))

    def get_raising(err):
        def get(ref):
            raise err
        return get

    monkeypatch.setattr(ray, "get", get_raising(ray.exceptions.ActorDiedError()))
    with pytest.raises(SandboxError, match="env worker failed: ActorDiedError"):
        _get("a ref")
    monkeypatch.setattr(ray, "get", get_raising(SandboxError("no sandbox under lease x")))
    with pytest.raises(SandboxError, match="no sandbox"):  # the env actor's own SandboxError passes as is
        _get("a ref")


@pytest.mark.integration
def test_ray_backend_without_ray_says_how_to_install_it(tmp_path):
    """With ray not importable, `runtime.backend=ray` stops with the install command, no traceback."""
    code = ("import sys; sys.modules['ray'] = None; from loomrl.cli import main; "
            f"sys.exit(main(['train', {str(RECIPE)!r}, 'runtime.backend=ray', 'output_dir={tmp_path}']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "pip install -e '.[ray]'" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_accounting_flags_a_trajectory_with_two_fates_and_one_with_none():
    from loomrl.runtime.accounting import Accounting, ledger_line

    acc = Accounting(launched=12, returned={"a", "b", "c", "d"}, cancelled=4)
    acc.failed["actor_died"] += 4
    acc.discard(["d"], "trainer_restart")
    ledger = [LedgerEntry(step=1, trained=["a"], skipped={"zero_variance": ["b"]}, stale=[]),
              LedgerEntry(step=2, trained=["zz"], skipped={}, stale=[])]  # zz: an earlier segment's
    out = acc.settle(ledger)
    assert out.violations == [] and out.unconsumed == 1  # c: sent, still buffered at the end
    assert "launched 12 = trained 1 + skipped 1 (zero_variance 1)" in ledger_line(out)
    ledger.append(LedgerEntry(step=3, trained=["a"], skipped={}, stale=["d"]))
    out = acc.settle(ledger)
    assert any(v.startswith("a: trained + trained") for v in out.violations)
    assert any(v.startswith("d: stale + discarded") for v in out.violations)
    acc.launched = 13  # one launched trajectory has no fate at all
    assert any("launched 13 != sum of fates" in v for v in acc.settle(ledger[:2]).violations)


@pytest.mark.ray
def test_fsdp_ranks_restart_together_from_their_sharded_checkpoint(cluster, tmp_path):
    """trainer.parallel=fsdp over two rank actors: the second rank is SIGKILLed after the first
    checkpoint; both ranks restart from it (model folder + the optimizer state in parts) and the run
    completes; every trajectory once."""
    steps = 6
    proc = _train(cluster, tmp_path, "fsdp", f"trainer.total_steps={steps}", "checkpoint_every=2",
                  "runtime.mode=async", "trainer.world_size=2", "trainer.parallel=fsdp",
                  "ray.trainer.resources={trainer: 0.5}")
    run_dir = tmp_path / "fsdp"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(read_ledger(run_dir)) < 3 and proc.poll() is None:
            time.sleep(0.25)
        victims = [p for p in tagged(cluster["tag"], cluster["tmp"]) if _title(p).startswith("ray::TrainerRankActor")]
        assert victims, "no trainer rank actor to kill"
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == steps and summary["trainer_restarts"] == 1, summary
    assert (run_dir / "checkpoints" / f"step_{steps:06d}" / "optimizer").is_dir()  # written in parts
    check_run(run_dir, summary, steps)
    check_each_trajectory_once(run_dir, steps)


@pytest.mark.ray
def test_a_trainer_that_cannot_start_says_why(cluster, tmp_path):
    """A model folder whose config names no architecture transformers knows: the trainer actor's constructor
    raises, and the run stops with the constructor's own error, not only Ray's line saying where it ran."""
    from loomrl.config import ModelConfig
    from loomrl.model.loader import load_tokenizer

    broken = tmp_path / "broken-model"
    load_tokenizer(ModelConfig(kind="tiny")).save_pretrained(broken)  # the tokenizer loads; the model cannot
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    proc = _train(cluster, tmp_path, "notrainer", "trainer.total_steps=2", "model.kind=hf", f"model.path={broken}")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback (most recent call last)" not in out.split("run error:")[-1]
    assert "the trainer failed to start" in out and "no_such_architecture" in out.split("run error:")[-1], out[-3000:]
