"""The LLM judge (reward/judge.py, judge_client.py, task_review.py) through the real `openai` client and real HTTP.

Two servers: a real `loomrl serve` of SmolLM2-135M-Instruct (one per module, in a process of its own), for what a
real judge model does (its replies, its token counts, dying mid-run); and a tiny FastAPI app speaking the
chat-completions JSON, which stands in for a judge model whose reply we must control (a malformed reply, 500s, a slow
reply) and counts at the server what the client sent (requests in flight, when each arrived).
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI, Request  # module level: the app's annotations are resolved in this module's namespace
from fastapi.responses import JSONResponse

from loomrl import cli
from loomrl.config.judge import JudgeConfig, JudgeExample
from loomrl.reward.judge import Judge, parse_score
from loomrl.reward.pool import RewardPool
from loomrl.types import REWARD_FAILED, Task, Trajectory, Turn

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
TASK = Task(task_id="calc-1", prompt="Tom has 3 apples and buys 4 more. His sister has 9 pears. How many apples "
            "does Tom have?", answer="7")
# SmolLM2-135M answers "Score: N" only after worked gradings
SHOTS = [JudgeExample(prompt="Anna has 5 pens and gets 2 more. How many pens?", reference="7",
                      response="She has 7 pens.", score=10),
         JudgeExample(prompt="Bo has 9 cups and breaks 3. How many cups?", reference="6",
                      response="The answer is 12.", score=0)]


def outcome(traj: Trajectory, task: Task) -> dict[str, float]:
    """The environment's part of the reward, computed before the judge's."""
    return {"correct": float(traj.final_answer == task.answer)}


def trajectory(reply: str, i: int) -> Trajectory:
    answer = m.group(0) if (m := re.search(r"\d+", reply)) else None
    return Trajectory(task_id=TASK.task_id, trajectory_id=f"tr-{i}", group_id="g", turns=[Turn(act=reply)],
                      final_answer=answer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def score_all(pool: RewardPool, trajs: list[Trajectory]) -> list[Trajectory]:
    try:
        return list(await asyncio.gather(*(pool.score(t, TASK) for t in trajs)))
    finally:
        await pool.aclose()


# -- a real `loomrl serve` of SmolLM2 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """`loomrl serve` of SmolLM2-135M-Instruct on a free port: (its /v1 URL, its process)."""
    recipe = tmp_path_factory.mktemp("serve") / "judge.yaml"
    recipe.write_text("name: judge\nmodel:\n  kind: smollm2\n")
    proc = subprocess.Popen([sys.executable, "-m", "loomrl", "serve", str(recipe), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 240
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            found = re.search(r"listening on (\S+/v1)", lines.get(timeout=1.0))
            url = found.group(1) if found else None
        except queue.Empty:
            pass
    if url is None:
        proc.kill()
        pytest.fail("loomrl serve did not start within 240 s")
    yield url, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def smollm2_judge(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(base_url=url, model="judge", examples=SHOTS, max_tokens=6,
                       prices={"prompt": 0.15, "completion": 0.6}, **kw)


def test_a_group_of_identical_answers_is_judged_once_with_tokens_and_cost_counted(smollm2):
    replies = ["The answer is 7."] * 6 + ["12", "Tom has 16 apples."]
    pool = RewardPool(outcome, judge=Judge(smollm2_judge(smollm2[0])))
    trajs = asyncio.run(score_all(pool, [trajectory(r, i) for i, r in enumerate(replies)]))
    m = pool.judge.metrics
    assert (m.calls, m.cache_hits, m.requests, m.failures) == (3, 5, 3, 0)  # one call per distinct answer
    assert m.prompt_tokens > 3 * 150 and 0 < m.completion_tokens <= 3 * 6  # the server's own usage counts
    assert m.cost_usd == pytest.approx((m.prompt_tokens * 0.15 + m.completion_tokens * 0.6) / 1e6)
    metrics = pool.metrics()
    assert metrics["judge/calls"] == 3 and metrics["judge/cache_hits"] == 5 and metrics["judge/busy_s"] > 0
    for t in trajs:  # each has the judge's grade, or (a reply off the scale) no judge value and the reply: never a 0
        assert not t.reward_failed and t.reward_components["correct"] == float(t.final_answer == "7")
        if "judge" in t.reward_components:
            assert 0.0 <= t.reward_components["judge"] <= 1.0 and t.error is None
            assert t.total_reward == pytest.approx(t.reward_components["correct"] + t.reward_components["judge"])
        else:
            assert t.error.startswith("judge: no score in its reply") and t.total_reward == t.reward_components["correct"]
    same = [(t.reward_components.get("judge"), t.error) for t in trajs[:6]]
    assert len(set(same)) == 1  # identical answers, one verdict
    assert m.parse_failures == sum(t.error is not None for t in (trajs[0], trajs[6], trajs[7]))


def test_validate_tasks_judge_reviews_codefix_tasks_with_several_real_judges(smollm2, tmp_path, capsys):
    report = tmp_path / "report.json"
    code = cli.main(["validate-tasks", "--families", "clamp", "--limit", "2", "--backend", "process", "--judge",
                     "--judge-url", smollm2[0], "--judge-model", "judge", "--judges", "3", "--report", str(report)])
    tasks = json.loads(report.read_text())["tasks"]
    assert [t["task_id"] for t in tasks] == ["codefix-clamp-1", "codefix-clamp-2"]
    for t in tasks:  # the sandbox checks, and three seeded SmolLM2 reviews of the issue and its golden patch
        r = t["review"]
        assert t["golden_passes"] and t["noop_fails"] and len(r["votes"]) == 3
        assert [v["judge"] for v in r["votes"]] == [0, 1, 2] and r["yes"] + r["no"] + r["abstain"] == 3
        assert r["passed"] == (r["yes"] >= 2) and t["valid"] == r["passed"]
    out = capsys.readouterr().out
    assert all(re.search(rf"^(PASS|FAIL) {t['task_id']}: judges yes \d, no \d, abstain \d$", out, re.M) for t in tasks)
    assert code == (0 if all(t["valid"] for t in tasks) else 1)


def test_a_judge_server_that_dies_mid_run_gives_reward_failed_and_no_zeros(smollm2):
    """Runs last of the SmolLM2 tests: it kills the module's server."""
    url, proc = smollm2
    pool = RewardPool(outcome, judge=Judge(smollm2_judge(url, max_concurrency=2, max_retries=2, retry_backoff_s=0.2)))
    trajs = [trajectory(f"Tom has {n} apples.", i) for i, n in enumerate(range(1, 9))]

    async def run() -> list[Trajectory]:
        scoring = asyncio.ensure_future(score_all(pool, trajs))
        while pool.judge.metrics.completion_tokens == 0:  # the first reply is in; two requests were in flight
            await asyncio.sleep(0.01)
        proc.kill()
        return await scoring

    scored = asyncio.run(run())
    proc.wait()
    failed = [t for t in scored if t.reward_failed]
    judged = [t for t in scored if "judge" in t.reward_components]
    assert judged and len(failed) >= 6 and len(judged) + len(failed) + pool.judge.metrics.parse_failures == 8
    for t in failed:  # no reply after the retries: not trained, and nothing that reads as a 0 from the judge
        assert t.reward_components == {REWARD_FAILED: 0.0} and "judge: no reply from" in t.error
    assert pool.failed == pool.judge.metrics.failures == len(failed) and pool.judge.metrics.retries >= 2 * len(failed)


# -- a stand-in judge whose reply we control ----------------------------------------------------------------------------
@dataclass
class Behaviour:
    """What the stand-in answers, and what it saw."""

    reply: Callable[[dict], str] = lambda request: "Score: 7"
    fail_first: int = 0  # answer the first N requests with `fail_status`
    fail_status: int = 500
    delay_s: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each request
    inflight: int = 0
    max_inflight: int = 0


@pytest.fixture(scope="module")
def stand_in():
    import uvicorn

    state = {"b": Behaviour()}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        b, body = state["b"], await request.json()
        b.arrivals.append(time.monotonic())
        b.inflight += 1
        b.max_inflight = max(b.max_inflight, b.inflight)
        try:
            await asyncio.sleep(b.delay_s)
            if len(b.arrivals) <= b.fail_first:
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=b.fail_status)
            reply = b.reply(body)
        finally:
            b.inflight -= 1
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104}}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def with_behaviour(**kw) -> str:
        state["b"] = Behaviour(**kw)
        return f"http://127.0.0.1:{port}/v1"

    yield with_behaviour, state
    server.should_exit = True
    thread.join(timeout=10)


def test_a_malformed_reply_is_a_parse_failure_never_a_zero(stand_in):
    with_behaviour, _ = stand_in
    url = with_behaviour(reply=lambda r: "This answer looks right to me.")
    pool = RewardPool(outcome, judge=Judge(JudgeConfig(base_url=url, model="m")))
    trajs = asyncio.run(score_all(pool, [trajectory("The answer is 7.", i) for i in range(4)]))
    m = pool.judge.metrics
    assert (m.calls, m.cache_hits, m.parse_failures) == (1, 3, 1)
    for t in trajs:  # no judge value: the environment's reward only, the reply kept; still trained
        assert t.reward_components == {"correct": 1.0} and t.total_reward == 1.0 and not t.reward_failed
        assert t.error == "judge: no score in its reply (no 'Score: N' line): 'This answer looks right to me.'"
    url = with_behaviour(reply=lambda r: "Score: 12")
    pool = RewardPool(outcome, judge=Judge(JudgeConfig(base_url=url, model="m", on_parse_failure="reward_failed")))
    [t] = asyncio.run(score_all(pool, [trajectory("7", 0)]))
    assert t.reward_failed and "12 is off the scale [0, 10]" in t.error and pool.failed == 1
    assert parse_score("**Score:** 7.5", (0, 10)).score == 0.75 and parse_score("score = 2", (1, 5)).score == 0.25


def test_concurrency_and_rate_limits_hold_under_a_burst(stand_in):
    with_behaviour, state = stand_in
    url = with_behaviour(delay_s=0.15)
    cfg = JudgeConfig(base_url=url, model="m", max_concurrency=3, requests_per_s=25.0, weight=0.5)
    pool = RewardPool(outcome, judge=Judge(cfg))

    async def burst() -> list[Trajectory]:
        await pool.score(trajectory("warm-up", -1), TASK)  # the client's first request (lazy imports, a connection)
        state["b"] = Behaviour(delay_s=0.15)
        return await score_all(pool, [trajectory(f"{i} apples", i) for i in range(24)])  # 24 distinct, at once

    trajs = asyncio.run(burst())
    b = state["b"]
    assert len(b.arrivals) == 24 and b.max_inflight == 3  # reached, never passed
    gaps = sorted(later - earlier for earlier, later in zip(b.arrivals, b.arrivals[1:]))
    assert gaps[1] > 0.04 - 0.01  # 1/requests_per_s apart, less the HTTP jitter (one gap may take a loop stall's)
    assert 23 / (b.arrivals[-1] - b.arrivals[0]) <= 25.0 * 1.02
    assert max(sum(t <= a < t + 0.2 for a in b.arrivals) for t in b.arrivals) <= 0.2 * 25.0 + 2  # in any 0.2 s
    assert all(t.reward_components["judge"] == 0.7 and t.total_reward == pytest.approx(
        t.reward_components["correct"] + 0.35) for t in trajs)


def test_retries_with_backoff_then_success_and_what_is_not_retried(stand_in):
    with_behaviour, state = stand_in
    url = with_behaviour(fail_first=2, fail_status=500)
    pool = RewardPool(outcome, judge=Judge(JudgeConfig(base_url=url, model="m", retry_backoff_s=0.1)))
    [t] = asyncio.run(score_all(pool, [trajectory("7", 0)]))
    arrivals, m = state["b"].arrivals, pool.judge.metrics
    assert t.reward_components["judge"] == 0.7 and (m.requests, m.retries, m.failures) == (3, 2, 0)
    assert arrivals[1] - arrivals[0] >= 0.1 and arrivals[2] - arrivals[1] >= 0.2  # backoff x 2^k
    url = with_behaviour(fail_first=1, fail_status=429)  # rate-limited: retried too
    pool = RewardPool(outcome, judge=Judge(JudgeConfig(base_url=url, model="m", retry_backoff_s=0.0)))
    assert "judge" in asyncio.run(score_all(pool, [trajectory("7", 0)]))[0].reward_components
    url = with_behaviour(fail_first=5, fail_status=400)  # the request itself is wrong: asking again cannot help
    pool = RewardPool(outcome, judge=Judge(JudgeConfig(base_url=url, model="m", retry_backoff_s=0.0)))
    [t] = asyncio.run(score_all(pool, [trajectory("7", 0)]))
    assert t.reward_failed and "refused the request: HTTP 400" in t.error and pool.judge.metrics.retries == 0


def test_a_request_past_its_timeout_is_retried_then_reward_failed(stand_in):
    with_behaviour, _ = stand_in
    url = with_behaviour(delay_s=3.0)
    cfg = JudgeConfig(base_url=url, model="m", timeout_s=0.3, max_retries=1, retry_backoff_s=0.0)
    pool = RewardPool(outcome, judge=Judge(cfg))
    t0 = time.monotonic()
    [t] = asyncio.run(score_all(pool, [trajectory("7", 0)]))
    assert time.monotonic() - t0 < 1.5 and pool.judge.metrics.timeouts == 2
    assert t.reward_failed and "after 2 attempt(s); the last: timed out after timeout_s=0.3s" in t.error


def test_validate_tasks_judge_passes_a_task_on_a_strict_majority(stand_in, tmp_path, capsys):
    with_behaviour, _ = stand_in
    argv = ["validate-tasks", "--env", "calculator", "--limit", "2", "--judge", "--judge-model", "m",
            "--report", str(tmp_path / "r.json")]
    votes = {0: "Verdict: yes", 1: "Verdict: yes", 2: "Verdict: no"}
    url = with_behaviour(reply=lambda r: votes[r["seed"]])  # judge i samples with seed i
    assert cli.main([*argv, "--judge-url", url]) == 0
    assert capsys.readouterr().out.count("judges yes 2, no 1, abstain 0") == 2
    votes[1] = "It depends."  # now one yes, one no, one abstention: no majority
    url = with_behaviour(reply=lambda r: votes[r["seed"]])
    assert cli.main([*argv, "--judge-url", url]) == 1
    tasks = json.loads((tmp_path / "r.json").read_text())["tasks"]
    assert [t["review"]["abstain"] for t in tasks] == [1, 1] and not any(t["valid"] for t in tasks)
    assert tasks[0]["review"]["votes"][1] == {"judge": 1, "model": "m", "vote": "abstain", "reply": "It depends."}
    assert "INVALID calc-train-00000: judges: 1 of 3 said yes" in capsys.readouterr().out


def test_a_run_logs_the_judges_metrics_per_step(stand_in, tmp_path):
    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train
    from loomrl.store import read_rows

    with_behaviour, _ = stand_in
    url = with_behaviour(reply=lambda r: "Score: 4")
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={tmp_path}", "progress=false", "trainer.total_steps=2", "eval.n_tasks=1", "eval.before=false",
        f"reward.judge={{base_url: '{url}', model: m, show: final_answer, prices: {{prompt: 1.0, completion: 2.0}}}}"])
    train(cfg)
    records = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train"]
    steps = [m for m in records if "rollout/reward_mean" in m]
    assert steps and all(m["reward/judge"] == pytest.approx(0.4) for m in steps)
    # each step logs what the judge did since the last one (async: a step's groups may all have been judged before)
    assert sum(m["judge/calls"] for m in records) > 0 and sum(m["judge/cache_hits"] for m in records) > 0
    assert all(m["judge/cost_usd"] == pytest.approx(m["judge/calls"] * (100 * 1.0 + 4 * 2.0) / 1e6) for m in records)
    rows = [r for r in read_rows(cfg.run_dir / "trajectories") if r["split"] == "train"]
    assert rows and all(r["reward_components"]["judge"] == 0.4 for r in rows if r["reward_components"])


def test_config_errors_name_the_field(tmp_path, monkeypatch):
    from loomrl.config import ConfigError, load_config

    judge = ["reward.judge.base_url=http://127.0.0.1:1/v1", "reward.judge.model=m"]
    for override, message in [
            ("reward.judge.scale=[10, 0]", "'reward.judge': reward.judge.scale: [10.0, 0.0] is not [low, high]"),
            ("reward.judge.rubric='Grade {answer}'", "reward.judge.rubric: unknown field(s) ['answer']"),
            ("reward.judge.rubric='Grade it'", "reward.judge.rubric: it never shows the judge the trajectory"),
            ("reward.judge.max_concurency=2", "unknown field 'reward.judge.max_concurency'; did you mean "
                                              "'max_concurrency'?")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [*judge, override])
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Task: {prompt}\nAnswer: {response}\nScore: {low}-{high}")
    cfg = load_config(None, [*judge, f"reward.judge.rubric={rubric}"]).reward.judge
    assert cfg.rubric == rubric.read_text()  # read at load: the resolved config keeps the text
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="reward.judge.api_key_env: the environment variable NO_SUCH_KEY is not set"):
        Judge(cfg.model_copy(update={"api_key_env": "NO_SUCH_KEY"}))


def test_reward_terms_weigh_and_gate_the_judge(stand_in):
    from loomrl.reward.composite import Composite, Gate, Term

    with_behaviour, _ = stand_in
    url = with_behaviour(reply=lambda r: "Score: 7")
    composite = Composite({"judge": Term("judge", weight=2.0, gate=Gate.parse("correct"))})
    pool = RewardPool(outcome, composite=composite, judge=Judge(JudgeConfig(base_url=url, model="m", weight=0.5)))
    right, wrong = asyncio.run(score_all(pool, [trajectory("It is 7.", 0), trajectory("It is 8.", 1)]))
    assert right.reward_components == {"correct": 1.0, "judge": 0.7} and right.total_reward == pytest.approx(1.7)
    assert wrong.reward_components == {"correct": 0.0, "judge": 0.7} and wrong.total_reward == 0.0  # gate closed
    # the judge grades before the total: another term's gate may read it
    by_judge = Composite({"correct": Term("correct", gate=Gate.parse("judge >= 0.75"))})
    pool = RewardPool(outcome, composite=by_judge, judge=Judge(JudgeConfig(base_url=url, model="m")))
    right, = asyncio.run(score_all(pool, [trajectory("It is 7.", 0)]))
    assert right.total_reward == pytest.approx(0.7)  # correct's gate closed at 0.7; the judge's 0.7 counts
