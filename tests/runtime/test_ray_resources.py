"""What a Ray run asks of its cluster, checked before any actor is made (runtime/ray_resources.py), without Ray: the
asks a config makes, the one-machine cluster loomrl starts for them, and the one line a cluster that cannot place them
gets. tests/runtime/test_ray_placement.py runs the same against real one-machine clusters."""

from __future__ import annotations

from loomrl.config import load_config
from loomrl.runtime.ray_resources import Ask, local_cluster, run_asks, shortfall, total_ask

DEFAULTS = run_asks(load_config(None, ["runtime.backend=ray"]), env_actors=False)


def test_the_default_run_asks_three_cpus_and_the_local_cluster_offers_them_on_two_cores():
    """Defaults: two rollout actors and one trainer rank of one CPU each. The cluster loomrl starts on a 2-core
    machine used to offer os.cpu_count() = 2 CPUs, so the trainer waited ray.placement_timeout_s (300 s) for a CPU
    that never came; it now offers what the actors reserve, and the check passes."""
    assert [(a.setting, a.count, a.each) for a in DEFAULTS if a.count] == [
        ("ray.rollout", 2, {"CPU": 1.0}), ("ray.trainer", 1, {"CPU": 1.0})]
    assert total_ask(DEFAULTS) == {"CPU": 3.0}  # no reward, env or engine actors: nothing of theirs
    cpus, custom = local_cluster(DEFAULTS, cores=2)
    assert (cpus, custom) == (3, {})
    assert shortfall(DEFAULTS, {"CPU": 3.0}, [{"CPU": 3.0}], "here") is None
    assert local_cluster(DEFAULTS, cores=16)[0] == 16  # never fewer than the machine's cores
    with_pools = run_asks(load_config(None, ["runtime.backend=ray", "ray.reward.count=2",
                                             "ray.reward.resources={judge: 1}", "ray.env.count=3"]), env_actors=False)
    assert local_cluster(with_pools, cores=2) == (5, {"judge": 2.0})  # env actors: none for a sandbox-free env


def test_a_cluster_short_of_a_resource_is_told_in_one_line_with_what_to_lower():
    said = shortfall(DEFAULTS, {"CPU": 2.0, "memory": 1e9}, [{"CPU": 2.0}], "the Ray cluster at h:1")
    assert said == ("the run asks Ray for {CPU: 3} in all (ray.rollout 2 x {CPU: 1}, ray.trainer 1 x "
                    "{CPU: 1}), but the Ray cluster at h:1 has {CPU: 2}; lower ray.rollout.num_cpus or "
                    "ray.trainer.num_cpus (0 shares the cores), or ray.rollout.count or trainer.world_size")
    gpu = [Ask(setting="ray.trainer", count=1, each={"CPU": 1.0, "GPU": 1.0})]
    assert shortfall(gpu, {"CPU": 2.0}, [{"CPU": 2.0}], "here").endswith(
        "but here has {CPU: 2, GPU: 0}; lower ray.trainer.num_gpus, or trainer.world_size")


def test_an_actor_larger_than_any_node_and_strict_pack_ranks_are_told_per_node():
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    big = [Ask(setting="ray.engine", count=1, each={"GPU": 2.0})]
    assert shortfall(big, {"CPU": 8.0, "GPU": 2.0}, nodes, "the cluster") == (
        "ray.engine: one actor needs {GPU: 2}, but no node of the cluster has that (its nodes: {GPU: 1}, "
        "{GPU: 1}); lower ray.engine's num_cpus, num_gpus or resources")
    packed = [Ask(setting="ray.trainer", count=2, each={"GPU": 1.0}, together=True)]
    said = shortfall(packed, {"CPU": 8.0, "GPU": 2.0}, nodes, "the cluster")
    assert said.startswith("ray.trainer: 2 ranks together (STRICT_PACK) need {GPU: 2}")
    assert said.endswith("or use ray.trainer_placement=PACK")
    assert shortfall([Ask(setting="ray.trainer", count=2, each={"GPU": 1.0})], {"GPU": 2.0}, nodes, "c") is None


def test_colocated_actors_on_the_wrong_gpus_are_named():
    from loomrl.runtime.ray_resources import colocation_mismatch

    assert colocation_mismatch([["a/0"], ["a/1"]], [["a/0"], ["a/1"]]) is None
    assert colocation_mismatch([["a/0"], ["a/1"]], [["a/1"], ["a/0"]]) == (
        "engine actor 0 got GPU ['a/0'] and trainer rank 0 GPU ['a/1']; they must share one")
    assert colocation_mismatch([["a/0"], ["a/0"]], [["a/0"], ["a/0"]]) == (
        "the colocated engines got GPUs ['a/0', 'a/0']: two on one GPU")
    assert colocation_mismatch([["a/0"], ["b/0"]], [["a/0"], ["b/0"]]) is None  # GPU 0 of two nodes: two GPUs
    assert colocation_mismatch([["a/3"]], [["b/3"]]) is not None  # the same index on another node is another GPU
    assert colocation_mismatch([[]], [[]]) is not None  # no GPU at all is not colocation


def test_a_broadcast_load_whose_trainer_died_is_superseded_not_a_run_error():
    """runtime.weight_transport=broadcast: a trainer actor killed mid-broadcast fails its receivers' load ("Connection
    closed by peer"); the fresh trainer's next version replaces it, so the run goes on. The same failure of the live
    trainer's version stops the run. Ray is replaced by a stand-in of the three calls step_metrics makes (wait, get,
    its exception classes): what is tested is the backend's decision, not Ray."""
    from types import SimpleNamespace

    import pytest

    from loomrl.runtime.failures import EngineLost
    from loomrl.runtime.ray_backend import BroadcastRoute

    class RayError(Exception):
        pass

    class RayActorError(RayError):
        pass

    def get(ref):
        raise RayError("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18870")

    ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: (list(refs), []), get=get,
                          exceptions=SimpleNamespace(RayError=RayError, RayActorError=RayActorError))
    # no cluster: only the route's bookkeeping of the loads it sent (RayCluster's fields it reads)
    cluster = SimpleNamespace(ray=ray, trainer_starts=2, sync_sender={"sent by trainer 1": 1},
                              syncs=["sent by trainer 1"])
    route = BroadcastRoute(cluster, SimpleNamespace(engines=["an engine actor"]), None)  # type: ignore[arg-type]
    assert route.step_metrics() == {}  # superseded: logged, not raised
    cluster.sync_sender, cluster.syncs = {"sent by trainer 2": 2}, ["sent by trainer 2"]
    with pytest.raises(EngineLost, match="could not load the trainer's weights"):
        route.step_metrics()
