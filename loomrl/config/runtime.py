"""The `runtime:` and `ray:` sections: mode, backend, weight transport, retries, and where each actor goes on Ray (loomrl/runtime/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config.base import Section


class RuntimeConfig(Section):
    mode: Literal["sync", "async"] = "sync"
    """sync: generation and training take turns on one model (the seed's time-sharing); async: a trainer beside the
    engine, groups up to buffer.max_policy_lag versions behind"""
    backend: Literal["local", "ray"] = "local"
    """local: one machine (runtime/local.py); ray: rollout workers and the trainer as Ray actors placed by the `ray:`
    section's resources (runtime/ray_backend.py); one driver for both (runtime/driver.py)"""
    interrupt_on_update: bool = False
    """async: when new weights arrive, interrupt in-flight generations; they resume from their partial output under the
    new weights (AReaL), instead of finishing their turn with the old ones"""
    schedule: Literal["fifo", "seer"] = "fifo"
    """order of engine calls when more wait than the engine runs at once: "fifo" (arrival), or "seer"
    (agent/priorities.py ProgramPriorities: a probe per group first, then longest-estimated first)"""
    max_inflight_trajectories: int = Field(0, ge=0)
    """most training trajectories in flight at once (sandboxes, K/V); 0 = no cap beyond the admission rule (sync: a
    step's groups; async: the groups within buffer.max_policy_lag). Whole groups count. backend=ray: per rollout actor.
    """
    weight_transport: Literal["shm", "file", "queue", "cuda_ipc", "broadcast"] = "shm"
    """async (local): how new weights go from the trainer process to the engine (weights/; benchmarks/weight_sync.py:
    shm ~6x faster than pickling through the queue for SmolLM2-135M). engine.kind=vllm reads shm in its worker process.
    cuda_ipc: trainer and engine on one GPU, the weights never leave it; on Ray, colocated (engine.sleep_while_training
    with vLLM engine actors), each trainer rank pushes each version to the engine on its GPU a bucket at a time through
    one reused buffer (a shared-memory one on a CPU trainer; an engine actor that dies stops the run). broadcast: over
    a process group of the trainer and the engine's workers (engine.kind=vllm in process, or sglang; NCCL between
    GPUs); on Ray from the trainer actor to the engine actors (ray.engine.count > 0; any engine kind; an engine actor
    that dies stops it). On Ray without either: Ray's object store"""
    broadcast_host: str = "127.0.0.1"
    """broadcast, local: the address the engine's workers reach the trainer process at (Ray: the trainer's node's)"""
    max_trainer_restarts: int = Field(5, ge=0)
    """a trainer that dies (async: its process or a rank; ray: its actors) is restarted from the latest checkpoint this
    many times (0: the run stops and says to continue with --resume)"""
    max_group_attempts: int = Field(3, gt=0)
    """a group whose rollout worker died (ray) is dispatched again up to this many times in all, after retry_backoff_s x
    2^k; past that it is recorded as failed with the reason"""
    retry_backoff_s: float = Field(0.5, ge=0.0)
    """seconds before a lost group's first retry, doubled after each"""
    tolerate_failed_steps: bool = False
    """false: a step none of whose trajectories could be scored (every one reward_failed, env_error, engine_error,
    timeout or aborted) stops the run with one line naming the failure and its first error (runtime/failure_watch.py);
    true: such a step trains nothing and the run goes on"""


class Placement(Section):
    """What one Ray actor asks the scheduler for."""

    num_cpus: float = Field(1.0, ge=0.0)
    """CPUs per actor (Ray's num_cpus; 0: the actor reserves none)"""
    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs per actor; a fraction shares one (e.g. 0.5: two per GPU)"""
    resources: dict[str, float] = Field(default_factory=dict)
    """custom resources per actor, e.g. {rollout: 1} to pin to nodes started with `ray start --resources='{"rollout":
    2}'`; CPUs and GPUs go in num_cpus / num_gpus"""

    @model_validator(mode="after")
    def _no_builtin_resources(self) -> Placement:
        for key, field in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
            if key in self.resources:  # Ray refuses them there
                raise ValueError(f"'{key}' cannot be a custom resource: set {field}={self.resources[key]} instead")
        return self


class ActorSpec(Placement):
    """A pool of one kind of Ray actor: how many, and how many deaths are survived (rollout: actors the
    backend replaces; reward, env: restarts Ray makes itself)."""

    count: int = Field(1, ge=0)
    """actors of this kind"""
    max_restarts: int = Field(100, ge=0)
    """deaths survived: rollout actors the driver replaces, or restarts Ray makes itself (reward, env, engine actors)"""


class RayConfig(Section):
    """runtime.backend=ray: where the actors go (runtime/ray_backend.py)."""

    address: str | None = None
    """The cluster (runtime/ray_resources.py cluster_address): "local" starts a one-machine cluster here offering what
    the actors reserve, and shuts it down at the end; "auto" joins the one started on this machine (`ray start --head`);
    "host:port" (or "ray://host:port") joins that one. None: the RAY_ADDRESS environment variable when it is set (`ray
    job submit` sets it), else "local"."""
    rollout: ActorSpec = Field(default_factory=lambda: ActorSpec(count=2))
    """engine + env pool + reward pool each"""
    trainer: Placement = Field(default_factory=Placement)
    """one actor per data-parallel rank (trainer.world_size), reserved together in a placement group (trainer_placement:
    PACK, SPREAD, STRICT_PACK or STRICT_SPREAD); restarts: runtime.max_trainer_restarts"""
    trainer_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray's placement-group strategy for the trainer ranks: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"""
    placement_timeout_s: float = Field(300.0, gt=0.0)
    """then the run stops: the cluster lacks the resources"""
    reward: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    """reward actors shared by all rollout actors (count 0: each rollout actor scores on reward.workers threads of its
    own); each scoring call runs up to max_reward_attempts times in all (Ray retries it on a restarted actor), then the
    trajectory is marked reward_failed (not trained)"""
    max_reward_attempts: int = Field(3, gt=0)
    """a scoring call on a reward actor runs up to this many times in all (Ray retries it on a restarted actor)"""
    env: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    """env actors holding the sandboxes of white-box environments, or running whole episodes of environments with a
    browser (their browser pools live there), shared by all rollout actors (count 0: each rollout actor runs sandboxes
    and browsers on its own node); e.g. resources {sandbox: 1} for CPU nodes"""
    engine: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    """engine actors shared by the rollout actors (count 0: each rollout actor owns its engine); each one engine.kind
    engine, e.g. num_gpus 1 (a vLLM engine of tensor_parallel_size 2: num_gpus 2); rollout actor i uses engine i mod
    count. Ray restarts one that dies (max_restarts); it loads the latest weights first"""
    engine_restart_wait_s: float = Field(300.0, gt=0.0)
    """a request waits this long for a restarting engine actor"""

    @model_validator(mode="after")
    def _one_rollout_actor(self) -> RayConfig:
        if self.rollout.count < 1:
            raise ValueError("ray.rollout.count: at least one rollout actor is needed")
        return self
