"""What each pool of a run is given: its own sections of the recipe plus the few facts it shares with the others.

A whole recipe (RunConfig) is seen only where a run is assembled (loomrl/runtime/, the CLI and the commands that load
a recipe); each pool below it, and each actor or process that hosts one, receives its part, made here by RunConfig's
`train_pool()`, `rollout_pool()` and `engine_setup()`, so that what a pool may depend on is written in one place:

- TrainPoolConfig: the training pool (loomrl/trainer/): the model it starts from, its own trainer and buffer
  sections, and the route its weights leave by (WeightRoute: what it must know of the engines that receive them);
- RolloutPoolConfig: the rollout pool (loomrl/rollout/): tasks, agent, environment, rewards, evaluation, the engine
  it drives (EngineSetup), and the step's shape it fills (group size, groups per step, admission);
- EngineSetup: one engine (loomrl/engine/): its section, the model it serves, the seed, the context it must hold.

These are values made from a validated RunConfig (its cross-section rules have run), not sections a recipe spells:
they appear in no recipe and in no docs/configuration.md. Devices and dtypes in them are names, as in the recipe;
each process resolves them once where it loads its model (loomrl/devices.py), since a Ray actor's machine, not the
driver's, decides what "auto" is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomrl.config.agent import AgentConfig
from loomrl.config.base import Section
from loomrl.config.buffer import BufferConfig
from loomrl.config.data import DataConfig
from loomrl.config.engine import EngineConfig
from loomrl.config.env import EnvConfig
from loomrl.config.eval import EvalConfig
from loomrl.config.model import ModelConfig, SamplingConfig
from loomrl.config.reward import RewardConfig
from loomrl.config.trainer import TrainerConfig


def serving_dtype_name(engine: EngineConfig, model: ModelConfig) -> str:
    """The dtype the run's engine serves in, as the recipe names it ("auto" is resolved where the weights are: on
    the trainer's process as it publishes, on the engine's as it loads; weights/route.py serving_dtype)."""
    if engine.kind == "vllm":
        return engine.vllm.dtype if engine.vllm.dtype != "auto" else model.dtype
    if engine.kind == "sglang":
        return engine.sglang.weights_dtype
    return model.dtype


class EngineSetup(Section):
    """One engine: what loomrl/engine/ builds it from (RunConfig.engine_setup)."""

    engine: EngineConfig
    model: ModelConfig
    """the model it serves (a tiny model's config builds vLLM's copy; model.dtype is its serving dtype)"""
    seed: int
    """the run's seed: sampling"""
    context_tokens: int = Field(gt=0)
    """agent.max_context_tokens: the longest context it must hold"""
    interrupt_on_update: bool
    """runtime.interrupt_on_update: in-flight generations are interrupted when new weights arrive"""
    cpus: float = Field(ge=0.0)
    """ray.engine.num_cpus: the torch threads of an engine actor when engine.threads is 0"""
    routed_experts: bool = False
    """trainer.router_replay: the engine records each token's routed experts (GenerationResult.routed_experts)"""
    lora_rank: int | None = None
    """trainer.lora with publish=adapter: the adapters' rank, so that an engine that loads adapters itself (vLLM in
    process) starts with LoRA enabled at that rank; None: no adapters are published"""
    lora_targets: list[str] | None = None
    """trainer.lora.target_modules with publish=adapter: the only modules vLLM wraps for LoRA (else every supported
    one, MoE experts included, each with its buffers)"""


class WeightRoute(Section):
    """The route the training pool publishes its weights by: the facts of the engines at its other end that the
    trainer needs (RunConfig.train_pool)."""

    transport: Literal["shm", "file", "queue", "cuda_ipc", "broadcast"]
    """runtime.weight_transport"""
    host: str
    """runtime.broadcast_host: where a local broadcast's receivers reach the trainer process"""
    engine_kind: Literal["builtin", "vllm", "sglang"]
    """engine.kind: who receives (SGLang's server takes tensor by tensor, the others buckets)"""
    dtype: str
    """the dtype the engine serves in, as named: engine.vllm.dtype (auto: model.dtype), engine.sglang.weights_dtype,
    or the built-in engine's model.dtype; "auto" is resolved in the trainer's process (weights/route.py)"""
    engine_device: str
    """model.device: where the built-in engine's model lives (its "auto" dtype depends on it)"""
    receivers: int = Field(ge=1)
    """processes of one engine joining a broadcast: vLLM's tensor-parallel workers, SGLang's tp_size, else 1"""
    engines: int = Field(ge=0)
    """ray.engine.count: engine actors that join a broadcast on Ray"""
    bucket_bytes: int = Field(gt=0)
    """engine.vllm.weight_bucket_bytes: the size of each bucket the weights are sent in"""
    timeout_s: float = Field(gt=0.0)
    """the receiving engine's update_timeout_s (engine.vllm or engine.sglang)"""
    colocated: bool
    """engine.sleep_while_training: the engines share the trainer's GPUs and sleep while it steps"""


class TrainPoolConfig(Section):
    """The training pool: what loomrl/trainer/ and its actors and processes are given (RunConfig.train_pool)."""

    run_dir: str
    """the run's folder (checkpoints, ledger, weights published as files)"""
    seed: int
    model: ModelConfig
    """the model the run starts from (and KL's reference when it resumes)"""
    trainer: TrainerConfig
    buffer: BufferConfig
    route: WeightRoute
    cpus: float = Field(ge=0.0)
    """ray.trainer.num_cpus: the torch threads of a trainer actor when trainer.threads is 0"""
    checkpoint_every: int = Field(ge=0)
    """checkpoint_every: a checkpoint every this many steps (0: only at the end)"""
    checkpoint_keep: int = Field(ge=0)
    """checkpoint_keep: the newest checkpoints kept (0: every one)"""
    checkpoint_keep_optimizer: int = Field(ge=1)
    """checkpoint_keep_optimizer: the newest kept checkpoints that keep their optimizer state"""


class RolloutPoolConfig(Section):
    """The rollout pool: what loomrl/rollout/ and its actors are given (RunConfig.rollout_pool)."""

    name: str
    """the run's name (a black-box agent's gateway labels its calls with it)"""
    seed: int
    model: ModelConfig
    sampling: SamplingConfig
    engine: EngineSetup
    env: EnvConfig
    data: DataConfig | None
    agent: AgentConfig
    reward: RewardConfig
    eval: EvalConfig
    mode: Literal["sync", "async"]
    """runtime.mode: async admits groups up to max_policy_lag versions ahead"""
    group_size: int = Field(gt=0)
    """trainer.group_size: rollouts per task"""
    groups_per_step: int = Field(gt=0)
    """trainer.groups_per_step"""
    total_steps: int = Field(ge=0)
    """trainer.total_steps: reward terms scheduled over the run read it"""
    max_policy_lag: int = Field(ge=0)
    """buffer.max_policy_lag: how far ahead async admission runs"""
    max_inflight_trajectories: int = Field(ge=0)
    """runtime.max_inflight_trajectories (0: no cap beyond admission)"""
    schedule: Literal["fifo", "seer"]
    """runtime.schedule: the order of engine calls"""
    cpus: float = Field(ge=0.0)
    """ray.rollout.num_cpus: the torch threads of a rollout actor when engine.threads is 0"""
    engine_restart_wait_s: float = Field(gt=0.0)
    """ray.engine_restart_wait_s: how long a rollout actor's request waits for its engine actor to come back"""
