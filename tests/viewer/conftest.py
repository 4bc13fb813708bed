"""The viewer's fixtures: one real short run folder per test module (the tiny recipe, sync, 2 steps), the viewer
served on it by a real uvicorn in a thread, and Debian's headless chromium driven by playwright (the browser tests
skip, saying why, when either is missing: `make test` installs both)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def short_run(output_dir: Path, name: str = "short", *overrides: str) -> Path:
    """A real run of the tiny recipe: sync, 2 steps, 4 held-out tasks; its folder."""
    from loomrl.config import load_config
    from loomrl.runtime.run import train

    cfg = load_config(RECIPE, [f"output_dir={output_dir}", f"name={name}", "progress=false", "runtime.mode=sync",
                               "trainer.total_steps=2", "eval.n_tasks=4", *overrides])
    train(cfg)
    return cfg.run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Viewer:
    """`loomrl view`'s app under a real uvicorn, in a thread of this process."""

    def __init__(self, runs: list[Path]):
        import uvicorn

        from loomrl.view.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(runs), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Viewer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the viewer did not start in 20 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return short_run(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (Debian's package, never a download)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium is not installed (make chromium: apt-get install chromium); the browser tests need it")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def one_split_copy(run_dir: Path, dest: Path) -> Path:
    """A copy of a run as a run with one held-out split logs it: its metrics without `heldout_templates`, the overall
    `eval/success` then being that one split's (the short run has two splits)."""
    import json
    import os

    shutil.copytree(run_dir, dest)
    records = []
    for line in (dest / "metrics.jsonl").read_text().splitlines():
        r = {k: v for k, v in json.loads(line).items() if not k.startswith("eval/heldout_templates/")}
        if "eval/heldout/success" in r:
            r["eval/success"], r["eval/n"] = r["eval/heldout/success"], r["eval/heldout/n"]
        records.append(r)
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    os.utime(dest / "summary.json")  # ended after its metrics: not followed as a live run
    return dest


def add_reward_failed_group(run_dir: Path) -> dict[str, str]:
    """Store a pending group of two, as the rollout worker stores them, the second's reward failed (marked by the
    reward pool's own `mark_reward_failed`); its ids by role."""
    from loomrl.reward.pool import mark_reward_failed
    from loomrl.store.trajectory_store import TrajectoryStore
    from loomrl.types import TokenSpan, Trajectory, Turn

    def member(i: int) -> Trajectory:
        return Trajectory(task_id="calc-train-00001", trajectory_id=f"traj-rf{i}", group_id="group-rf", split="train",
                          prompt="What is 2 + 3?", answer="5", prompt_ids=[1, 2, 3], token_ids=[1, 2, 3, 4, 5, 6],
                          turns=[Turn(act="The answer is 5.", act_span=TokenSpan(start=3, end=6), logprobs=[-0.1] * 3,
                                      versions=[2] * 3, done=True)],
                          total_reward=1.0, reward_components={"parity": 1.0})

    scored, failed = member(0), mark_reward_failed(member(1), "ValueError: no number in the completion")
    store = TrajectoryStore(run_dir / "trajectories")
    store.append([scored, failed])
    store.flush()
    return {"scored": scored.trajectory_id, "failed": failed.trajectory_id, "group": "group-rf"}
