"""runtime.backend=ray without ray.address: the one-machine cluster loomrl starts offers what the run's actors reserve
(its CPUs too, not os.cpu_count()), and a run this machine cannot place stops at once with one line, before any actor
is made, instead of waiting ray.placement_timeout_s and then pointing at `ray status` for a cluster already shut down.
Real `loomrl train` processes on real local Ray clusters (about 30 s each here). The check's arithmetic and its messages
are tested without Ray in test_ray_resources.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"

pytestmark = pytest.mark.ray


def _train(tmp_path: Path, *overrides: str) -> tuple[int, str, float]:
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", "name=placed",
            "progress=false", "reward.function=rewards_for_tests:parity_reward", "eval.n_tasks=0",
            "trainer.total_steps=1", "checkpoint_every=0", "runtime.backend=ray", "ray.placement_timeout_s=60",
            *overrides]
    t0 = time.monotonic()
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


def test_a_run_reserving_more_cpus_than_cores_runs_on_the_cluster_loomrl_starts(tmp_path):
    """One rollout actor reserving every core and a trainer reserving one more: what the defaults ask on a 2-core
    machine (two rollout actors and a trainer, one CPU each). The cluster used to offer os.cpu_count() CPUs, and the
    trainer waited for one until ray.placement_timeout_s."""
    cores = os.cpu_count() or 1
    code, out, _ = _train(tmp_path, "ray.rollout.count=1", f"ray.rollout.num_cpus={cores}", "engine.threads=1")
    assert code == 0, out[-3000:]
    assert f"the actors reserve {cores + 1} CPUs; the one-machine cluster offers them on {cores} cores" in out


def test_a_run_this_machine_cannot_place_stops_at_once_in_one_line(tmp_path):
    """A trainer asking for a GPU on a machine without one (Ray counts the GPUs; loomrl does not invent them)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, took = _train(tmp_path, "ray.trainer.num_gpus=1")
    said = [line for line in out.splitlines() if line.startswith("run error:")]
    offered = max(os.cpu_count() or 1, 3)  # the 3 CPUs the actors reserve, or the cores
    assert code == 2 and said == [
        "run error: the run asks Ray for {CPU: 3, GPU: 1} in all (ray.rollout 2 x {CPU: 1}, ray.trainer 1 x "
        f"{{CPU: 1, GPU: 1}}), but this machine's one-node Ray (started by loomrl) has {{CPU: {offered}, GPU: 0}}; "
        "lower ray.trainer.num_gpus, or trainer.world_size"], out[-3000:]
    assert "ray status" not in out and "Traceback" not in out
    assert took < 50  # at once: not after ray.placement_timeout_s (60 s)
