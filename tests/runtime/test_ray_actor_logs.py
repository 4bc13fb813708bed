"""An actor's stderr reaches the driver while it starts (ray.init's log_to_driver, runtime/ray_resources.py): one whose
constructor fails, and one that hangs in it, are seen from the driver's terminal, not only in the worker log files of
the node it ran on. A real one-machine Ray cluster started as loomrl starts it (RayCluster.connect), in a process of
its own whose stderr the test reads (about 15 s here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray

DRIVER = textwrap.dedent("""
    import sys, time
    from loomrl.config import Placement, load_config
    from loomrl.actor_support import failure_line
    from loomrl.runtime.ray_backend import RayCluster

    class Broken:
        def __init__(self):
            print("broken-actor: cannot load the model on cuda:0", file=sys.stderr, flush=True)
            raise RuntimeError("no model")
        def ping(self):
            return 1

    class Joins:
        def join(self):
            raise RuntimeError("rank 1 could not join 10.0.0.1:29500")

    class Stuck:
        def __init__(self):
            print("stuck-actor: waiting for the NCCL rendezvous", file=sys.stderr, flush=True)
            time.sleep(600)
        def ping(self):
            return 1

    cluster = RayCluster(load_config(None, ["runtime.backend=ray", "ray.rollout.count=1"]))
    cluster.connect()
    ray = cluster.ray
    broken = cluster.actor(Broken, Placement(num_cpus=0)).remote()
    stuck = cluster.actor(Stuck, Placement(num_cpus=0)).remote()
    try:
        ray.get(broken.ping.remote(), timeout=120)
    except ray.exceptions.RayActorError as err:
        print("driver: the broken actor failed", file=sys.stderr, flush=True)
        print(f"constructor failure: {failure_line(err)}", file=sys.stderr, flush=True)
    try:
        ray.get(cluster.actor(Joins, Placement(num_cpus=0)).remote().join.remote(), timeout=120)
    except ray.exceptions.RayTaskError as err:
        print(f"method failure: {failure_line(err)}", file=sys.stderr, flush=True)
    ready, _ = ray.wait([stuck.ping.remote()], timeout=5)
    print(f"driver: stuck actor ready={bool(ready)}", file=sys.stderr, flush=True)
    time.sleep(2)  # Ray's log monitor forwards the workers' lines every few hundred ms
    ray.shutdown()
""")


def test_a_failing_and_a_hanging_actor_are_heard_from_the_driver():
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300)
    err = res.stdout + res.stderr
    assert res.returncode == 0, err[-3000:]
    assert "driver: the broken actor failed" in err and "driver: stuck actor ready=False" in err, err[-3000:]
    # Ray prefixes each forwarded line with the actor's class and pid: "(Broken pid=123) broken-actor: ..."
    assert any("Broken" in line and "broken-actor: cannot load the model on cuda:0" in line
               for line in err.splitlines()), err[-3000:]
    assert any("Stuck" in line and "stuck-actor: waiting for the NCCL rendezvous" in line
               for line in err.splitlines()), err[-3000:]
    # what loomrl says when a trainer rank fails to start (runtime/ray_backend.py): the cause, not Ray's header line
    # ("ray::Joins.join() (pid=..., ip=...)"), which is what error_line gave
    assert "constructor failure: RuntimeError: no model" in err, err[-3000:]
    assert "method failure: RuntimeError: rank 1 could not join 10.0.0.1:29500" in err, err[-3000:]
