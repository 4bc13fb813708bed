"""The viewer's JSON API on a real short run folder (conftest.py: the tiny recipe, sync, 2 steps), through FastAPI's
test client: what each endpoint says agrees with the run's own files (metrics.jsonl, ledger.jsonl, the store)."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time

import pyarrow.parquet as pq
import pytest
from conftest import add_reward_failed_group
from fastapi.testclient import TestClient

from loomrl.run_folder import read_ledger
from loomrl.view.app import create_app
from loomrl.view.run_folder import JsonLines, RunFolderError, RunReader

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`


@pytest.fixture(scope="module")
def client(run_dir):
    return TestClient(create_app([run_dir]))


def test_runs_lists_the_run_with_its_config_and_summary(client, run_dir):
    (run,) = client.get("/api/runs").json()
    assert run["key"] == run_dir.name and run["path"] == str(run_dir)
    assert run["config"]["total_steps"] == 2 and run["config"]["mode"] == "sync"
    assert run["summary"]["steps"] == 2 and run["live"] is False
    assert run["stores"][0] == "trajectories" and any(s.startswith("evaluations/before") for s in run["stores"])


def test_metrics_are_served_from_a_line_on(client, run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    whole = client.get("/api/metrics", params={"run": run_dir.name}).json()
    assert whole["next"] == len(lines) and [r["kind"] for r in whole["records"]].count("train") == 2
    tail = client.get("/api/metrics", params={"run": run_dir.name, "since": 2}).json()
    assert tail["records"] == whole["records"][2:] and tail["next"] == len(lines)


def test_a_line_still_being_written_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2')
    reader = JsonLines(path)
    assert reader.read() == [{"step": 1}]
    with path.open("a") as f:
        f.write(', "x": 1}\n')
    assert reader.read() == [{"step": 1}, {"step": 2, "x": 1}]


def test_steps_agree_with_the_ledger(client, run_dir):
    ledger = read_ledger(run_dir)
    steps = client.get("/api/steps", params={"run": run_dir.name}).json()
    assert [s["step"] for s in steps["steps"]] == [e.step for e in ledger]
    for s, e in zip(steps["steps"], ledger):
        assert s["trained"] == len(e.trained) and s["skipped"] == {k: len(v) for k, v in e.skipped.items()}
    assert steps["stored"] == 2 * 2 * 4  # steps x groups_per_step x group_size, all consumed
    assert steps["pending"] == 0


def test_a_steps_groups_carry_rewards_advantages_and_the_ledgers_fate(client, run_dir):
    entry = read_ledger(run_dir)[0]
    body = client.get("/api/groups", params={"run": run_dir.name, "step": 1}).json()
    assert body["total"] == 2 and "grpo" in body["advantage_rule"]
    ids = {m["trajectory_id"] for g in body["groups"] for m in g["members"]}
    assert ids == set(entry.trained) | {t for v in entry.skipped.values() for t in v}
    for group in body["groups"]:
        assert len(group["members"]) == 4 and group["step"] == 1
        trained = any(m["fate"] == "trained" for m in group["members"])  # else computed, as GRPO does
        assert group["advantage_source"] == "as trained (step 1)" if trained else "GRPO" in group["advantage_source"]
        advs = [m["advantage"] for m in group["members"]]
        assert abs(sum(advs)) < 1e-6  # centred on the group's mean
        for m in group["members"]:
            assert m["fate_step"] == 1 and m["fate"] in ("trained", "skipped")
            assert m["terms"] and m["reward"] == pytest.approx(sum(m["terms"].values()))
            if m["fate"] == "skipped":
                assert m["fate_reason"] in entry.skipped


def test_filters_by_reward_status_and_task(client, run_dir):
    groups = client.get("/api/groups", params={"run": run_dir.name}).json()["groups"]
    some = groups[0]["members"][0]
    by_task = client.get("/api/groups", params={"run": run_dir.name, "task": some["task_id"]}).json()["groups"]
    assert {g["task_id"] for g in by_task} == {some["task_id"]}
    high = client.get("/api/groups", params={"run": run_dir.name, "min_reward": 0.5}).json()["groups"]
    assert all(any(m["reward"] >= 0.5 for m in g["members"]) for g in high)
    assert client.get("/api/groups", params={"run": run_dir.name, "status": "timeout"}).json()["total"] == 0
    assert client.get("/api/groups", params={"run": run_dir.name, "step": -1}).json()["total"] == 0  # all consumed


def test_a_trajectory_opens_with_turns_tokens_and_its_ledger_line(client, run_dir):
    entry = read_ledger(run_dir)[0]
    tid = entry.trained[0]
    deadline = time.monotonic() + 60
    while (body := client.get("/api/trajectory", params={"run": run_dir.name, "id": tid}).json())["tokenizer_loading"]:
        assert body["contexts"][0]["pieces"] is None and "loading" in body["tokenizer"]  # ids at once meanwhile
        assert time.monotonic() < deadline, "the run's tokenizer did not load in 60 s"
    assert body["trajectory"]["trajectory_id"] == tid
    assert body["fate"] == {"step": 1, "fate": "trained", "reason": ""}
    (ctx,) = body["contexts"]
    n = len(ctx["token_ids"])
    assert n > 0 and len(ctx["loss_mask"]) == len(ctx["logprobs"]) == len(ctx["versions"]) == n
    assert sum(ctx["loss_mask"]) > 0 and ctx["turns"] and ctx["turns"][0]["act"]
    assert body["tokenizer"] == "decoded with the run's tokenizer" and len(ctx["pieces"]) == n
    sampled = "".join(p for p, m in zip(ctx["pieces"], ctx["loss_mask"]) if m)
    assert ctx["turns"][0]["act"].strip() in sampled
    assert body["advantage"] is not None


def test_an_evaluation_episode_opens_from_its_own_store(client, run_dir):
    store = next(s for s in client.get("/api/runs").json()[0]["stores"] if s.startswith("evaluations/"))
    groups = client.get("/api/groups", params={"run": run_dir.name, "store": store}).json()["groups"]
    tid = groups[0]["members"][0]["trajectory_id"]
    body = client.get("/api/trajectory", params={"run": run_dir.name, "id": tid, "store": store}).json()
    assert body["trajectory"]["split"].startswith("heldout") and body["fate"] is None


def test_the_timeline_joins_group_lifecycles_to_the_steps_that_consumed_them(client, run_dir):
    body = client.get("/api/timeline", params={"run": run_dir.name}).json()
    assert body["recorded"] and len(body["groups"]) == 4
    for g in body["groups"]:
        assert g["ended"] == "arrived" and g["launched"] <= g["finished"]
        assert g["step"] in (1, 2) and g["fate"] in ("trained", "skipped")
        assert g["version_at_launch"] == g["step"] - 1  # sync: a step's groups are sampled by the version before it
        # where the time went: the slowest member's split, recorded from its trajectory (runtime/group_log.py)
        split = g["slowest"]
        assert set(split) == {"reset_s", "gen_s", "env_s", "reward_s"} and split["gen_s"] > 0
        assert sum(split.values()) <= g["finished"] - g["launched"] + 0.05  # within the group's own lifetime


def test_a_group_lines_split_is_its_slowest_members(run_dir):
    from loomrl.store.trajectory_store import read_trajectories

    def split(row):  # from the stored row: its metadata's reset and reward seconds, its turns' gen_s and env_s
        turns = [t for seg in row["segments"] for t in seg["turns"]] + row["turns"]
        return {"reset_s": row["reset_s"], "gen_s": sum(t["gen_s"] for t in turns),
                "env_s": sum(t["env_s"] for t in turns), "reward_s": row["reward_s"]}

    stored = {r["trajectory_id"]: split(r) for r in read_trajectories(run_dir / "trajectories").to_pylist()}
    for line in map(json.loads, (run_dir / "groups.jsonl").read_text().splitlines()):
        members = [stored[i] for i in line["trajectory_ids"]]
        assert len(members) == 4 and line["slowest"] == max(members, key=lambda m: sum(m.values()))
        assert any(m != line["slowest"] for m in members)  # a real choice: the members' times differ


def test_engine_metrics_are_logged_per_step(client, run_dir):
    train = [r for r in client.get("/api/metrics", params={"run": run_dir.name}).json()["records"]
             if r["kind"] == "train"]
    for r in train:  # the built-in engine measures all three (engine/readings.py)
        assert 0 < r["engine/busy_frac"] <= 1
        assert r["engine/queue_depth"] >= 0
        assert 0 <= r["engine/prefix_hit_rate"] <= 1


def test_a_timeline_line_without_the_split_is_served_as_it_is(tmp_path, run_dir):
    old = tmp_path / run_dir.name
    shutil.copytree(run_dir, old)
    lines = [json.loads(x) for x in (old / "groups.jsonl").read_text().splitlines()]
    (old / "groups.jsonl").write_text("".join(json.dumps({k: v for k, v in x.items() if k != "slowest"}) + "\n"
                                              for x in lines))
    body = TestClient(create_app([old])).get("/api/timeline", params={"run": old.name}).json()
    assert len(body["groups"]) == len(lines) and all("slowest" not in g for g in body["groups"])


def test_unknown_names_are_404_with_what_there_is(client, run_dir):
    r = client.get("/api/metrics", params={"run": "nope"})
    assert r.status_code == 404 and run_dir.name in r.json()["detail"]
    r = client.get("/api/trajectory", params={"run": run_dir.name, "id": "traj-nope"})
    assert r.status_code == 404 and "traj-nope" in r.json()["detail"]
    r = client.get("/api/groups", params={"run": run_dir.name, "store": "evaluations/x"})
    assert r.status_code == 404 and "trajectories" in r.json()["detail"]


def test_a_folder_that_is_no_run_is_refused_with_what_to_give(tmp_path, run_dir):
    with pytest.raises(RunFolderError, match="give a run folder"):
        RunReader(run_dir.parent)
    with pytest.raises(RunFolderError, match="not a folder"):
        RunReader(tmp_path / "missing")


def test_a_live_runs_new_parts_and_metrics_are_picked_up(tmp_path, run_dir):
    live = tmp_path / run_dir.name
    shutil.copytree(run_dir, live)
    (live / "summary.json").unlink()  # as if still training
    client = TestClient(create_app([live]))
    assert client.get("/api/runs").json()[0]["live"] is True
    before = client.get("/api/steps", params={"run": live.name}).json()
    part = sorted((live / "trajectories").glob("part-*.parquet"))[-1]
    table = pq.read_table(part)
    ids = [f"traj-new{i:04d}" for i in range(table.num_rows)]
    table = table.set_column(table.schema.get_field_index("trajectory_id"), "trajectory_id", [ids])
    table = table.set_column(table.schema.get_field_index("group_id"), "group_id",
                             [[f"group-new{i // 4}" for i in range(table.num_rows)]])
    pq.write_table(table, live / "trajectories" / "part-999999.parquet")
    after = client.get("/api/steps", params={"run": live.name}).json()
    assert after["stored"] == before["stored"] + table.num_rows and after["pending"] == table.num_rows
    pending = client.get("/api/groups", params={"run": live.name, "step": -1}).json()
    assert pending["total"] == table.num_rows // 4
    assert all(m["fate"] == "pending" for g in pending["groups"] for m in g["members"])
    n = client.get("/api/metrics", params={"run": live.name}).json()["next"]
    with (live / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 3, "time": 0.0, "rollout/reward_mean": 0.5}) + "\n")
    more = client.get("/api/metrics", params={"run": live.name, "since": n}).json()
    assert [r["step"] for r in more["records"]] == [3] and more["next"] == n + 1


def _records(run_dir) -> dict[str, dict]:
    lines = (run_dir / "train_records.jsonl").read_text().splitlines()
    return {r["trajectory_id"]: r for r in map(json.loads, lines)}


def test_each_step_logs_the_policys_entropy_and_the_logprob_gap(run_dir):
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert len(train) == 2
    for r in train:
        assert 0 < r["train/entropy"] <= math.log(49152) + 1e-3  # nats, at most uniform over the vocabulary
        # sync: the engine sampled with the weights the trainer starts the step from, so they agree up to numerics
        # (float32 on both sides here: about 1e-6; a token read at the wrong position would be off by nats)
        assert 0 <= r["train/logprob_gap_mean"] <= r["train/logprob_gap_max"] < 1e-3


def test_trained_members_show_the_advantage_they_were_trained_with(client, run_dir):
    records = _records(run_dir)
    ledger = read_ledger(run_dir)
    assert set(records) == {t for e in ledger for t in e.trained}
    assert all(records[t]["step"] == e.step for e in ledger for t in e.trained)
    body = client.get("/api/groups", params={"run": run_dir.name, "step": 1}).json()
    trained = [m for g in body["groups"] for m in g["members"] if m["fate"] == "trained"]
    assert trained
    for group in body["groups"]:
        if any(m["fate"] == "trained" for m in group["members"]):
            assert group["advantage_source"].startswith("as trained (step 1)")
    for m in trained:
        rec = records[m["trajectory_id"]]
        assert m["advantage_source"] == "trained" and m["advantages"] == rec["advantages"]
        assert m["advantage"] == rec["advantages"][0]
    # the tiny recipe trains with GRPO's outcome credit and no lag decay: what the trainer used is GRPO's number
    for group in body["groups"]:
        rewards = [m["reward"] for m in group["members"]]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for m in group["members"]:
            if m["fate"] == "trained":
                assert m["advantage"] == pytest.approx((m["reward"] - mean) / (std + 1e-6), abs=1e-5)


def test_a_trajectory_shows_its_record_and_falls_back_without_one(tmp_path, run_dir):
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    records = _records(copy)
    tid = next(iter(records))
    rec = records[tid]
    (gaps,) = rec["gaps"]  # one context
    rec["advantages"] = [123.0 + k for k in range(len(rec["advantages"]))]  # no rule computes this: read, not derived
    rec["gaps"] = [[round(0.001 * (k + 1), 4) for k in range(len(gaps))]]
    (copy / "train_records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    client = TestClient(create_app([copy]))
    member = next(m for g in client.get("/api/groups", params={"run": copy.name}).json()["groups"]
                  for m in g["members"] if m["trajectory_id"] == tid)
    assert member["advantage"] == 123.0 and member["advantage_source"] == "trained"
    body = client.get("/api/trajectory", params={"run": copy.name, "id": tid}).json()
    assert body["advantage"] == 123.0 and body["advantage_source"] == "as trained (step 1)"
    assert body["advantages"] == rec["advantages"] and body["logprob_gap"].startswith("recorded at step 1")
    (ctx,) = body["contexts"]
    trained = [t for t in range(1, len(ctx["loss_mask"])) if ctx["loss_mask"][t]]
    assert len(ctx["gap"]) == len(ctx["token_ids"]) and [ctx["gap"][t] for t in trained] == rec["gaps"][0]
    assert all(g is None for t, g in enumerate(ctx["gap"]) if t not in trained)

    (copy / "train_records.jsonl").unlink()  # a run from before the records: GRPO's number, said to be computed
    client = TestClient(create_app([copy]))
    card = next(g for g in client.get("/api/groups", params={"run": copy.name}).json()["groups"]
                if any(m["trajectory_id"] == tid for m in g["members"]))
    assert "GRPO" in card["advantage_source"] and not card["advantage_source"].startswith("as trained")
    body = client.get("/api/trajectory", params={"run": copy.name, "id": tid}).json()
    assert body["advantage"] == pytest.approx(member_advantage_computed(card, tid))
    assert body["advantage_source"] == "computed (see the group card)" and body["advantages"] is None
    assert body["contexts"][0]["gap"] is None and body["logprob_gap"].startswith("not recorded")


def member_advantage_computed(card: dict, tid: str) -> float:
    m = next(m for m in card["members"] if m["trajectory_id"] == tid)
    assert m["advantage_source"] == "computed"
    return m["advantage"]


def test_a_member_whose_reward_failed_ends_reward_failed_without_a_marker_term(tmp_path, run_dir):
    """The store keeps such a trajectory `completed` (it was played out) with a `reward_failed` component that marks
    it (reward/pool.py): the viewer shows it as reward_failed, with no term `reward_failed 0.000`, and filters by it."""
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    ids = add_reward_failed_group(copy)
    client = TestClient(create_app([copy]))
    (card,) = client.get("/api/groups", params={"run": copy.name, "step": -1}).json()["groups"]
    members = {m["trajectory_id"]: m for m in card["members"]}
    failed, scored = members[ids["failed"]], members[ids["scored"]]
    assert failed["status"] == "reward_failed" and failed["terms"] == {} and failed["reward"] is None
    assert scored["status"] == "completed" and scored["terms"] == {"parity": 1.0}
    by_status = client.get("/api/groups", params={"run": copy.name, "status": "reward_failed"}).json()
    assert [g["group_id"] for g in by_status["groups"]] == [ids["group"]]
    body = client.get("/api/trajectory", params={"run": copy.name, "id": ids["failed"]}).json()
    assert body["trajectory"]["status"] == "reward_failed" and body["trajectory"]["reward_components"] == {}
    assert "no number in the completion" in body["trajectory"]["error"]
    assert body["trajectory"]["prompt"] == "What is 2 + 3?"  # the task's question travels with the trajectory


def test_opening_the_page_starts_each_runs_tokenizer_one_at_a_time(tmp_path, run_dir, monkeypatch):
    """/api/runs (the page's first call) starts loading every run's tokenizer, so that the tokens are text by the time
    a trajectory is opened; loads run one at a time (two threads importing transformers at once can find it half
    imported). The real loader runs; the wrapper only counts the loads under way."""
    from loomrl.view.tokens import TokenText

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    load, lock = TokenText._load, threading.Lock()
    seen = {"now": 0, "most": 0, "done": 0}

    def counted(self):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            time.sleep(0.2)  # two loads started together overlap here, whatever this machine's speed
            return load(self)
        finally:
            with lock:
                seen["now"] -= 1
                seen["done"] += 1

    monkeypatch.setattr(TokenText, "_load", counted)
    client = TestClient(create_app([run_dir, other]))
    assert len(client.get("/api/runs").json()) == 2  # nothing else asked: no group, no trajectory
    deadline = time.monotonic() + 120
    while seen["done"] < 2:
        assert time.monotonic() < deadline, f"the tokenizers did not load after /api/runs: {seen}"
        time.sleep(0.05)
    assert seen["most"] == 1
    tid = read_ledger(run_dir)[0].trained[0]
    for name in (run_dir.name, other.name):
        body = client.get("/api/trajectory", params={"run": name, "id": tid}).json()
        assert body["tokenizer"] == "decoded with the run's tokenizer" and body["contexts"][0]["pieces"]
