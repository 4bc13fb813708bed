"""What a run asks of a Ray cluster, and whether the cluster has it: checked once, before any actor is made, so that
a run the cluster cannot place stops at once with one line (what is asked, what the cluster has, the setting to
change) instead of waiting ray.placement_timeout_s for a placement group that can never be ready.

What is checked: the sum over all actors alive at once (rollout, trainer ranks, reward, env, engine) against the
cluster's totals, each resource on its own; one actor's (or bundle's) ask against the largest node; a STRICT_PACK
trainer's ranks together against one node. What is not: resources other jobs hold (the placement wait still covers
those), and STRICT_SPREAD's one-node-per-rank rule.

Nothing here imports ray: the backend passes the cluster's numbers in (ray.cluster_resources(), ray.nodes()).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loomrl.config import Placement, RunConfig


@dataclass(slots=True, kw_only=True)
class Ask:
    """`count` actors of one kind, each reserving `each` (Ray's names: CPU, GPU, custom resources)."""

    setting: str  # the config section: ray.rollout, ray.trainer, ...
    count: int
    each: dict[str, float]
    together: bool = False  # all `count` on one node (a STRICT_PACK placement group)


def reserves(spec: Placement) -> dict[str, float]:
    """What one actor of `spec` reserves, as Ray names it; zero amounts left out (Ray reserves nothing for them)."""
    return {k: v for k, v in {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}.items() if v}


def run_asks(cfg: RunConfig, env_actors: bool) -> list[Ask]:
    """The actors a Ray run keeps alive at once (runtime/ray_backend.py makes them); `env_actors`: whether the env
    family uses sandboxes or runs its episodes in env actors (else ray.env.count is ignored)."""
    r = cfg.ray
    return [Ask(setting="ray.rollout", count=r.rollout.count, each=reserves(r.rollout)),
            Ask(setting="ray.trainer", count=cfg.trainer.world_size, each=reserves(r.trainer),
                together=r.trainer_placement == "STRICT_PACK"),
            Ask(setting="ray.reward", count=r.reward.count, each=reserves(r.reward)),
            Ask(setting="ray.env", count=r.env.count if env_actors else 0, each=reserves(r.env)),
            Ask(setting="ray.engine", count=r.engine.count, each=reserves(r.engine))]


def total_ask(asks: list[Ask]) -> dict[str, float]:
    """What all the asks reserve together."""
    out: dict[str, float] = {}
    for a in asks:
        for k, v in a.each.items() if a.count else ():
            out[k] = out.get(k, 0.0) + v * a.count
    return out


def local_cluster(asks: list[Ask], cores: int) -> tuple[int, dict[str, float]]:
    """What a one-machine cluster loomrl starts offers: CPUs for every actor (at least the machine's cores; Ray's CPUs
    are reservations, and actors run engine.threads / trainer.threads torch threads each) and the custom resources
    asked for. GPUs are not offered beyond the machine's (Ray counts them; the check then says what is missing)."""
    need = total_ask(asks)
    return max(cores, math.ceil(need.get("CPU", 0.0))), {k: v for k, v in need.items() if k not in ("CPU", "GPU")}


# The driver's environment variables every actor gets too (Ray's runtime_env), besides those of the `ray start` that
# began its node
FORWARDED_ENV = ("PYTHONPATH", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")


def cluster_address(setting: str | None, environ: Mapping[str, str]) -> str:
    """The address ray.init gets for ray.address: "local" starts a one-machine cluster here; anything else joins a
    running one. Unset: RAY_ADDRESS when it is set (the cluster the user pointed at; `ray job submit` sets it for the
    job), else "local". "auto": the cluster started on this machine (`ray start --head`), as Ray means it."""
    if setting is not None:
        return setting
    return environ.get("RAY_ADDRESS") or "local"


def beside_running(setting: str | None, address: str, running: str | None) -> str | None:
    """A warning when loomrl is about to start a private cluster (`address` "local") although ray.address was left
    unset and `ray start` left one running on this machine (`running`: the address in Ray's ray_current_cluster
    file): its GPUs would be counted twice, by both clusters."""
    if setting is not None or address != "local" or not running:
        return None
    return (f"ray: a Ray cluster started with `ray start` runs on this machine ({running}), but ray.address is unset: "
            "loomrl starts a private one beside it. Set ray.address=auto to join it (or ray.address=local to say "
            "that a private one is meant)")


def ray_init_kwargs(address: str, asks: list[Ask], cores: int, environ: Mapping[str, str],
                    cwd: str | None = None) -> dict[str, Any]:
    """ray.init's arguments. Every actor's stdout and stderr reach the driver (log_to_driver): an actor that fails or
    hangs as it starts (a model that will not load, a GPU it cannot get, NCCL waiting for a peer) says so in the
    driver's stderr, prefixed by Ray with the actor's class and pid, instead of only in the worker log files of
    whichever node it ran on. A one-machine cluster (address "local") offers what the actors reserve (local_cluster);
    one that is joined offers what its nodes were started with, and may not be given num_cpus or resources."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    # PYTHONPATH: e.g. where a custom reward function lives; the rest: which network interface the trainer ranks'
    # and the weight broadcast's process groups use between nodes (docs/ray.md)
    env.update({k: environ[k] for k in FORWARDED_ENV if environ.get(k)})
    if cwd:  # the driver finds a recipe's module:attribute names (env.name, reward.function) from its current
        # directory (loomrl/plugins.py); actors start elsewhere, so it goes on their PYTHONPATH, after the user's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), cwd) if p)
    kwargs: dict[str, Any] = {"address": address, "runtime_env": {"env_vars": env}, "log_to_driver": True,
                              "configure_logging": False}
    if address == "local":
        cpus, custom = local_cluster(asks, cores)
        kwargs.update(include_dashboard=False, num_cpus=cpus, resources=custom or None)
    return kwargs


def colocation_mismatch(engine_gpus: list[list[str]], trainer_gpus: list[list[str]]) -> str | None:
    """Why colocated actors are not where they must be (engine i and trainer rank i on one GPU, that GPU theirs
    alone), else None. Ray places them by bundle and fractions, which it only books: checked on the GPU ids Ray gave
    each actor, so that a placement bug (Ray has had bundle-index ones) stops the run instead of two engines or two
    ranks sharing a GPU that only one of each fits. Ids are "node/index" (actor_support.py gpu_ids): an index names a
    GPU only within its node."""
    for i, (engine, trainer) in enumerate(zip(engine_gpus, trainer_gpus, strict=True)):
        if len(engine) != 1 or engine != trainer:
            return f"engine actor {i} got GPU {engine} and trainer rank {i} GPU {trainer}; they must share one"
    used = [ids[0] for ids in engine_gpus]
    if len(set(used)) != len(used):
        return f"the colocated engines got GPUs {used}: two on one GPU"
    return None


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _change(asks: list[Ask], key: str) -> str:
    """The fields to lower when the cluster lacks `key`: what each actor asks, or how many there are."""
    field = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(key, f"resources.{key}")
    askers = [a for a in asks if key in a.each and a.count]
    each = " or ".join(f"{a.setting}.{field}" for a in askers)
    counts = " or ".join("trainer.world_size" if a.setting == "ray.trainer" else f"{a.setting}.count" for a in askers)
    return f"lower {each}{' (0 shares the cores)' if key == 'CPU' else ''}, or {counts}"


def shortfall(asks: list[Ask], total: dict[str, float], nodes: list[dict[str, float]], where: str) -> str | None:
    """One line, when the cluster cannot place the run: what is asked, what `where` (the cluster, as a user would
    call it) has, and which setting to change; None when it fits."""
    eps = 1e-9
    need = total_ask(asks)
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + eps}
    if short:
        by_kind = ", ".join(f"{a.setting} {a.count} x {_fmt(a.each)}" for a in asks if a.count and a.each)
        has = _fmt({k: total.get(k, 0.0) for k in need})
        change = "; ".join(_change(asks, k) for k in short)
        return (f"the run asks Ray for {_fmt(need)} in all ({by_kind}), but {where} has {has}; "
                f"{change}")
    for a in asks:
        if not a.count or not a.each:
            continue
        one = {k: v * (a.count if a.together else 1) for k, v in a.each.items()}
        if not any(all(v <= node.get(k, 0.0) + eps for k, v in one.items()) for node in nodes):
            what = f"{a.count} ranks together (STRICT_PACK) need" if a.together else "one actor needs"
            biggest = [_fmt({k: node.get(k, 0.0) for k in one}) for node in nodes]
            return (f"{a.setting}: {what} {_fmt(one)}, but no node of {where} has that (its nodes: "
                    f"{', '.join(biggest)}); lower {a.setting}'s num_cpus, num_gpus or resources"
                    + (", or use ray.trainer_placement=PACK" if a.together else ""))
    return None
