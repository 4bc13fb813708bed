"""ray.address and the arguments ray.init gets (runtime/ray_resources.py), without Ray: a cluster the user started is
joined, not shadowed by a private one; "local" keeps meaning a one-machine cluster loomrl starts; and every actor's
stderr reaches the driver. tests/runtime/test_ray_actor_logs.py shows that last one on a real cluster."""

from __future__ import annotations

from loomrl.config import load_config
from loomrl.runtime.ray_resources import cluster_address, ray_init_kwargs, run_asks

ASKS = run_asks(load_config(None, ["runtime.backend=ray"]), env_actors=False)  # 3 CPUs in all


def test_a_cluster_the_user_started_is_joined_and_local_still_starts_one_here():
    """RAY_ADDRESS (set by `ray job submit`, or by the user for `ray start --head`) used to be ignored: an unset
    ray.address always started a private cluster beside theirs, whose GPUs it then counted twice."""
    assert cluster_address(None, {}) == "local"
    assert cluster_address(None, {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert cluster_address("auto", {}) == "auto"
    assert cluster_address("local", {"RAY_ADDRESS": "10.0.0.1:6379"}) == "local"  # said so: a private one
    assert cluster_address("ray://head:10001", {"RAY_ADDRESS": "other:6379"}) == "ray://head:10001"


def test_joining_passes_no_resources_and_local_offers_what_the_actors_reserve():
    """Ray refuses num_cpus / resources when it joins a cluster; ray.address=local used to be passed to ray.init bare,
    so the one-machine cluster it started offered os.cpu_count() CPUs, not the 3 the default actors reserve."""
    env = {"PYTHONPATH": "/rewards", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^docker,lo", "HOME": "/h"}
    for address in ("auto", "10.0.0.1:6379"):
        kw = ray_init_kwargs(address, ASKS, cores=2, environ=env)
        assert kw["address"] == address and "num_cpus" not in kw and "resources" not in kw
    local = ray_init_kwargs("local", ASKS, cores=2, environ=env)
    assert (local["address"], local["num_cpus"], local["resources"]) == ("local", 3, None)
    # the interfaces the process groups use between nodes reach every actor (docs/ray.md)
    assert local["runtime_env"] == {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": "/rewards",
                                                 "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^docker,lo"}}
    # a recipe's module:Factory or module:function is found from the driver's current directory, so are the actors'
    assert ray_init_kwargs("local", ASKS, cores=2, environ=env, cwd="/proj")["runtime_env"]["env_vars"][
        "PYTHONPATH"] == "/rewards:/proj"


def test_actor_output_reaches_the_driver():
    """log_to_driver was False: an actor failing or hanging in its constructor wrote only to its node's log files."""
    for address in ("local", "auto"):
        assert ray_init_kwargs(address, ASKS, cores=2, environ={})["log_to_driver"] is True


def test_a_private_cluster_beside_one_ray_start_made_is_warned_about():
    """The GPU recipes tell the user to `ray start --head`; with ray.address unset loomrl started a private cluster
    beside it, silently. Now it says so and names the setting (the recipes set ray.address=auto)."""
    from loomrl.runtime.ray_resources import beside_running

    line = beside_running(None, "local", "127.0.0.1:6379")
    assert line is not None and "127.0.0.1:6379" in line and "ray.address=auto" in line
    assert beside_running(None, "local", None) is None  # nothing running here
    assert beside_running("local", "local", "127.0.0.1:6379") is None  # a private one was asked for
    assert beside_running(None, "10.0.0.1:6379", "127.0.0.1:6379") is None  # RAY_ADDRESS named a cluster
