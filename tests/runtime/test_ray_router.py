"""runtime.backend=ray with engine.instances=2: each rollout actor builds its engine with make_engine, so a Router over
two built-in engines runs inside it (nothing routes across actors), and the driver's reading of the actor's engine
(rollout/actor.py engine_reading, engine/readings.py) carries the router's and the shared K/V pool's counters into the
step metrics. A real `loomrl train` process on the one-machine Ray cluster loomrl starts (as test_ray_placement.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loomrl.metrics.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"

pytestmark = pytest.mark.ray


def test_a_ray_rollout_actor_routes_over_two_instances_and_logs_their_counters(tmp_path):
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", "name=routed",
            "progress=false", "reward.function=rewards_for_tests:parity_reward", "eval.n_tasks=0",
            "trainer.total_steps=2", "checkpoint_every=0", "runtime.backend=ray", "ray.placement_timeout_s=60",
            "ray.rollout.count=1", "engine.instances=2", "engine.kv_pool_bytes=67108864", "engine.threads=1"]
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["steps"] == 2
    steps = [m for m in read_metrics(tmp_path / "routed") if m["kind"] == "train" and "engine/requests" in m]
    assert steps, "no engine reading reached the step metrics"

    def total(prefix):
        return sum(v for m in steps for k, v in m.items() if k.startswith(prefix))

    # one reading holds both: each request is placed (the router) and counted (its instance) in the same call
    assert total("engine/router_placed_") == total("engine/requests") > 0
    assert total("engine/kv_pool_puts") > 0 and total("engine/router_retries") == 0
