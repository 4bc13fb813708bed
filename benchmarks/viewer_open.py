"""Time for `loomrl view` to open a run of 10,000 trajectories: the first useful paint.

The run folder is synthetic but in the real formats: 10,000 trajectories written by TrajectoryStore (parts of 64
rows, as a run flushes them; 3 turns and ~700 tokens each, with loss mask, logprobs and versions), the ledger, the
group log and metrics.jsonl of the steps that consumed them, and a config.yaml. What is timed, each open in a fresh
process (nothing of the viewer cached; the files in the OS page cache, as on a machine that just wrote them):
  curves         the calls the page makes on open: /api/runs, then /api/metrics (every record)
  trajectories   the trajectory tab's: /api/steps, then /api/groups of the latest step (this indexes the store)
  trajectory     then one trajectory: /api/trajectory (its row group only). The first waits up to 1 s for the
                 run's tokenizer, which /api/groups started loading (a synthetic run has none: it fails, and the
                 trajectory answers with ids and says why); trajectory_next is another one once that has settled
  chromium       with chromium present: the page loaded until its curves are drawn, then until the latest step's
                 groups are shown (?tab=trajectories), in headless chromium
Target (issue 30): open in under 2 s. Nothing here is simulated but the trajectories' contents.

    .venv/bin/python benchmarks/viewer_open.py [--trajectories 10000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, report  # noqa: E402

GROUP, GROUPS_PER_STEP = 8, 16
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

CHILD = r"""
import json, sys, threading, time
t_start = time.perf_counter()
import httpx, uvicorn
from loomrl.view.app import create_app
run, port, chromium = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # chromium "-": the API calls, else the page
server = uvicorn.Server(uvicorn.Config(create_app([run]), host="127.0.0.1", port=port, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.01)
out = {"import_and_start_s": time.perf_counter() - t_start}
base, name = f"http://127.0.0.1:{port}", run.rstrip("/").split("/")[-1]
if chromium == "-":
    with httpx.Client(base_url=base, timeout=60) as c:
        t0 = time.perf_counter()
        c.get("/api/runs").raise_for_status()
        m = c.get("/api/metrics", params={"run": name}).json()
        out["curves_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        steps = c.get("/api/steps", params={"run": name}).json()
        last = steps["steps"][-1]["step"]
        groups = c.get("/api/groups", params={"run": name, "step": last}).json()
        out["trajectories_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tid = groups["groups"][0]["members"][0]["trajectory_id"]
        c.get("/api/trajectory", params={"run": name, "id": tid}).raise_for_status()
        out["trajectory_s"] = time.perf_counter() - t0
        while c.get("/api/trajectory", params={"run": name, "id": tid}).json()["tokenizer_loading"]:
            time.sleep(0.1)  # the tokenizer's load (failing here: a synthetic run has none) has ended
        t0 = time.perf_counter()
        other = groups["groups"][-1]["members"][-1]["trajectory_id"]
        c.get("/api/trajectory", params={"run": name, "id": other}).raise_for_status()
        out["trajectory_next_s"] = time.perf_counter() - t0
        out["stored"], out["records"], out["groups_shown"] = steps["stored"], len(m["records"]), len(groups["groups"])
else:
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(base + "/")
        page.wait_for_function("window.loomrlView && loomrlView.ready && loomrlView.charts.reward")
        out["chromium_curves_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        page.goto(base + "/?tab=trajectories")
        page.wait_for_selector(".group .member")
        out["chromium_trajectories_s"] = time.perf_counter() - t0
        browser.close()
server.should_exit = True
print(json.dumps(out))
"""


def build_run(root: Path, n: int, seed: int = 0) -> Path:
    """A run folder of n trajectories in the store's real format, with its ledger, group log, metrics and config."""
    from loomrl.store import TrajectoryStore
    from loomrl.types import TokenSpan, Trajectory, TrajectoryMetadata, Turn

    rng = random.Random(seed)
    run = root / "synthetic-10k"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: synthetic-10k\nmodel:\n  kind: tiny\n  tokenizer: /nonexistent\n"
                                     f"trainer:\n  total_steps: {n // (GROUP * GROUPS_PER_STEP)}\n  group_size: {GROUP}\n"
                                     f"  groups_per_step: {GROUPS_PER_STEP}\nruntime:\n  mode: async\nenv:\n  name: calculator\n")
    store = TrajectoryStore(run / "trajectories")
    ledger, groups, metrics = [], [], []
    t_run = time.time() - n  # one second a trajectory, for the timeline
    for s in range(n // (GROUP * GROUPS_PER_STEP)):
        step = s + 1
        entry = {"step": step, "trained": [], "skipped": {}, "stale": []}
        for g in range(GROUPS_PER_STEP):
            pos = s * GROUPS_PER_STEP + g
            gid = f"group-{pos:07d}"
            rewards = [float(rng.random() < 0.5) for _ in range(GROUP)]
            trajs = []
            for k in range(GROUP):
                prompt = [rng.randrange(49152) for _ in range(300)]
                ids, turns = list(prompt), []
                for _ in range(3):
                    act = [rng.randrange(49152) for _ in range(100)]
                    obs = [rng.randrange(49152) for _ in range(30)]
                    a0 = len(ids)
                    ids += act
                    o0 = len(ids)
                    ids += obs
                    turns.append(Turn(act="calc(12 * 7)", obs="Result: 84", act_span=TokenSpan(start=a0, end=o0),
                                      obs_span=TokenSpan(start=o0, end=len(ids)),
                                      logprobs=[-rng.random() for _ in act], versions=[max(s - 1, 0)] * len(act),
                                      tool_calls=[{"name": "calc", "arguments": {"expression": "12 * 7"}}]))
                trajs.append(Trajectory(task_id=f"calc-{pos:06d}", trajectory_id=f"traj-{pos:07d}-{k}", group_id=gid,
                                        position=pos, prompt="What is 12 * 7?", answer="84", split="train", turns=turns,
                                        prompt_ids=prompt, token_ids=ids, total_reward=rewards[k],
                                        reward_components={"correct": rewards[k]},
                                        metadata=TrajectoryMetadata(total_steps=3, total_tokens=len(ids),
                                                                    policy_version_min=max(s - 1, 0),
                                                                    policy_version_max=max(s - 1, 0))))
            store.append(trajs)
            ids = [t.trajectory_id for t in trajs]
            if len(set(rewards)) > 1:
                entry["trained"] += ids
            else:
                entry["skipped"].setdefault("zero_variance", []).extend(ids)
            launched = t_run + pos * GROUP
            groups.append({"position": pos, "attempt": 1, "ended": "arrived", "launched": launched,
                           "finished": launched + 3.0, "version_at_launch": max(s - 1, 0), "group_id": gid,
                           "policy_version_min": max(s - 1, 0), "policy_version_max": max(s - 1, 0),
                           "trajectory_ids": ids})
        ledger.append(entry)
        metrics.append({"kind": "train", "step": step, "time": t_run + (s + 1) * GROUP * GROUPS_PER_STEP,
                        "rollout/reward_mean": rng.random(), "train/loss": rng.random(), "train/grad_norm": rng.random(),
                        "train/approx_kl": rng.random() / 100, "staleness_max": 1, "time/step_s": 3.0,
                        "time/train_s": 1.0, "time/rollout_s": 2.0, "engine/busy_s": 1.5, "buffer/depth": 4,
                        **{f"env_pool/{k}": 0 for k in ("created", "destroyed", "kills", "acquire_wait_s_total")}})
    store.flush()
    for name, lines in (("ledger.jsonl", ledger), ("groups.jsonl", groups), ("metrics.jsonl", metrics)):
        (run / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.trajectories, args.repeats = 200, 1
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = build_run(Path(tmp), args.trajectories)
        built_s = time.perf_counter() - t0
        size_mb = sum(p.stat().st_size for p in run.rglob("*") if p.is_file()) / 2**20
        parts = len(list((run / "trajectories").glob("part-*.parquet")))
        # the page arm needs both the browser and playwright's driver; without either it is skipped, and says so
        missing = [what for what, there in (("playwright", importlib.util.find_spec("playwright") is not None),
                                            (f"browser at {CHROMIUM}", Path(CHROMIUM).is_file())) if not there]
        chromium = "-" if missing else CHROMIUM
        runs = []
        for i in range(args.repeats):
            result = {}
            for arm in ["-"] + ([chromium] if chromium != "-" else []):  # each a fresh viewer: nothing cached
                out = subprocess.run([sys.executable, "-c", CHILD, str(run), str(8900 + i), arm], capture_output=True,
                                     text=True, check=True)
                result.update(json.loads(out.stdout.strip().splitlines()[-1]))
            runs.append(result)
    keys = ["curves_s", "trajectories_s", "trajectory_s", "trajectory_next_s"] + (["chromium_curves_s", "chromium_trajectories_s"]
                                                            if chromium != "-" else [])
    med = {k: round(median([r[k] for r in runs]), 3) for k in keys}
    first_paint = med["curves_s"] + med["trajectories_s"]
    result = {
        "name": "viewer_open",
        "machine": machine(),
        "workload": (f"{runs[0]['stored']} trajectories in {parts} parts ({size_mb:.0f} MB on disk, ~700 tokens each), "
                     f"{runs[0]['records']} metric records; medians of {args.repeats} fresh viewer processes"),
        "ratio": round(first_paint / 2.0, 3),
        "ratio_over": "the 2 s target (curves + trajectory tab API calls; below 1 meets it)",
        "arms": med,
        "details": [f"built the run folder in {built_s:.1f} s",
                    *(f"repeat {i + 1}: " + ", ".join(f"{k} {r[k]:.3f}" for k in keys) +
                      f", import+start {r['import_and_start_s']:.2f}" for i, r in enumerate(runs)),
                    "medians: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()),
                    *([f"chromium arm skipped: no {' and no '.join(missing)}"] if missing else [])],
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
