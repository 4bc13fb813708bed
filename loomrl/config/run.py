"""RunConfig: a whole recipe, its sections and every rule across them (a validator each, so that RunConfig(...) built in code and load_config agree)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from loomrl.config.agent import AgentConfig
from loomrl.config.base import Section
from loomrl.config.buffer import BufferConfig
from loomrl.config.data import DataConfig
from loomrl.config.engine import EngineConfig
from loomrl.config.env import EnvConfig
from loomrl.config.eval import EvalConfig
from loomrl.config.metrics import MetricsConfig
from loomrl.config.model import ModelConfig, SamplingConfig
from loomrl.config.pools import EngineSetup, RolloutPoolConfig, TrainPoolConfig, WeightRoute, serving_dtype_name
from loomrl.config.reward import RewardConfig
from loomrl.config.runtime import RayConfig, RuntimeConfig
from loomrl.config.trainer import TrainerConfig

# What SGLang lacks for trainer.router_replay (the built-in engine records routed experts itself, and loomrl's vLLM
# engines read vLLM 0.32's: engine/vllm/translate.py routed_experts). SGLang: GenerateReqInput.return_routed_experts
# (python/sglang/srt/managers/io_struct.py).
_SGLANG_NO_ROUTED_EXPERTS = ("loomrl's SGLang adapter does not ask SGLang for them yet (/generate return_routed_experts, "
                             "with the server's --enable-return-routed-experts)")


class RunConfig(Section):
    name: str = "run"
    """the run's name: its folder is output_dir/name"""
    output_dir: str = "runs"
    """where run folders go"""
    seed: int = 0
    """seeds sampling, the model's initialisation and the data order (env.seed seeds the tasks themselves)"""
    checkpoint_every: int = Field(5, ge=0)
    """save a checkpoint every this many steps (0: only at the end); --resume continues from the latest"""
    checkpoint_keep: int = Field(2, ge=0)
    """how many of the newest checkpoints are kept in RUN/checkpoints (0: every one); an older one is deleted when a
    new one is complete"""
    checkpoint_keep_optimizer: int = Field(2, ge=1)
    """how many of the newest kept checkpoints keep their optimizer state (resumable); older kept ones keep the model,
    its tokenizer and the run state only (for `loomrl eval --checkpoint`): about a third of the disk"""
    progress: bool = True
    """show progress bars (train, eval) on stderr"""
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig | None = None
    """a dataset of tasks (loomrl/data/, docs/data.md): replaces the environment's own tasks"""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """where metric records go besides metrics.jsonl: TensorBoard, Prometheus, W&B (loomrl/metrics/, docs/metrics.md)"""

    # Cross-section rules, one validator per concern (pydantic runs them in this order), so that RunConfig(...) built in
    # code and load_config agree.
    @model_validator(mode="after")
    def _sync_shares_one_model(self) -> RunConfig:
        """Sync mode serves the engine from the trainer's own model object and changes its weights in place: nothing
        that shards that object, holds its own copy or sends weights across."""
        if self.runtime.mode != "sync":
            return self
        if self.trainer.parallel == "fsdp":  # FSDP shards that object
            raise ValueError("trainer.parallel=fsdp needs runtime.mode=async (sync mode shares the trainer's model "
                             "with the engine)")
        transport = self.runtime.weight_transport
        if transport in ("cuda_ipc", "broadcast"):
            raise ValueError(f"runtime.weight_transport={transport} needs runtime.mode=async (a trainer beside the "
                             "engine; sync runs share one model)")
        if self.engine.kind == "sglang":
            raise ValueError("engine.kind=sglang needs runtime.mode=async (sync mode shares the trainer's model with "
                             "the engine; an SGLang server holds its own copy and loads each version from disk)")
        if self.engine.instances > 1:
            raise ValueError(f"engine.instances={self.engine.instances} needs runtime.mode=async (sync mode shares the "
                             "trainer's one model with the engine; each instance holds a copy of its own)")
        if self.engine.kind == "vllm":
            raise ValueError("engine.kind=vllm needs runtime.mode=async (sync mode shares the trainer's model with "
                             "the engine; vLLM holds its own copy in its worker process and loads each version sent)")
        return self

    @model_validator(mode="after")
    def _lora_needs_its_own_engine_model(self) -> RunConfig:
        if self.trainer.lora is not None and self.runtime.mode == "sync":
            raise ValueError("trainer.lora needs runtime.mode=async: in sync mode the built-in engine runs the "
                             "trainer's own model, whose linear weights are the base's, so the adapters would never "
                             "reach it (async runs publish the adapter, or the merged weights, to the engine)")
        return self

    @model_validator(mode="after")
    def _adapters_reach_the_engine(self) -> RunConfig:
        """trainer.lora.publish=adapter: each version's adapter is applied by Engine.update_adapter with the tensors in
        hand, so a transport the engine's own processes open (a CUDA IPC handle, a broadcast into vLLM's or SGLang's
        workers) cannot carry one; nor can Ray's object store, whose handle the driver makes without the adapter's
        record."""
        if self.trainer.lora is None or self.trainer.lora.publish != "adapter":
            return self
        transport, kind = self.runtime.weight_transport, self.engine.kind
        if transport == "cuda_ipc" or (transport == "broadcast" and kind != "builtin"):
            raise ValueError(f"runtime.weight_transport={transport} cannot carry a LoRA adapter to engine.kind={kind} "
                             "(trainer.lora.publish=adapter): use shm, file or queue, or trainer.lora.publish=merged")
        if self.runtime.backend == "ray" and transport != "broadcast":
            raise ValueError("runtime.backend=ray sends weights through Ray's object store, which does not carry a LoRA "
                             "adapter (trainer.lora.publish=adapter): set trainer.lora.publish=merged, or "
                             "runtime.weight_transport=broadcast with engine.kind=builtin")
        return self

    @model_validator(mode="after")
    def _routed_experts_recorded(self) -> RunConfig:
        """trainer.router_replay needs the engine to record each token's routed experts: the built-in engine does
        (routed_experts.py); vLLM 0.32 does on a GPU (enable_return_routed_experts), which keeps them by prefix-cache
        block, so the in-process engine needs engine.prefix_cache (a server is checked when the adapter connects); the
        SGLang adapter does not hand them to loomrl yet. Where vLLM runs is not known here (vLLM's platform, or the
        server's): the CPU is refused when the engine starts (engine/vllm/args.py ROUTED_EXPERTS_ON_CPU)."""
        if not self.trainer.router_replay:
            return self
        if self.engine.kind == "sglang":
            raise ValueError(f"trainer.router_replay needs engine.kind=builtin or vllm: {_SGLANG_NO_ROUTED_EXPERTS}")
        if self.engine.kind == "vllm" and not self.engine.vllm.base_url and not self.engine.prefix_cache:
            raise ValueError("trainer.router_replay with engine.kind=vllm needs engine.prefix_cache: vLLM 0.32 keeps "
                             "routed experts by prefix-cache block (engine/vllm/args.py ROUTED_EXPERTS_NO_PREFIX_CACHE)")
        return self

    @model_validator(mode="after")
    def _one_actor_per_engine_server(self) -> RunConfig:
        kind = self.engine.kind
        urls = {"sglang": self.engine.sglang.base_url, "vllm": self.engine.vllm.base_url}.get(kind)
        if not isinstance(urls, list) or len(urls) < 2:
            return self
        if self.engine.instances > 1:  # one router in each process fronts every server (engine/replicas.py)
            if self.runtime.backend == "ray" and self.ray.engine.count:
                raise ValueError(f"engine.instances={self.engine.instances} puts a router over every server in "
                                 f"engine.{kind}.base_url, but ray.engine.count={self.ray.engine.count} gives each "
                                 f"engine actor one server: set engine.instances=1 (actor i drives server i) or "
                                 f"ray.engine.count=0")
            return self
        if self.runtime.backend != "ray" or self.ray.engine.count != len(urls):
            raise ValueError(f"engine.{kind}.base_url lists {len(urls)} servers: one engine actor drives each, so "
                             f"set runtime.backend=ray and ray.engine.count={len(urls)}")
        return self

    @model_validator(mode="after")
    def _weight_transport_fits(self) -> RunConfig:
        """runtime.weight_transport against the backend and the engine that receive it."""
        transport, kind = self.runtime.weight_transport, self.engine.kind
        ray = self.runtime.backend == "ray"
        if transport == "cuda_ipc" and ray and not (self.engine.sleep_while_training and self.ray.engine.count):
            raise ValueError("runtime.weight_transport=cuda_ipc on Ray is for colocated engine actors (engine."
                             "sleep_while_training with ray.engine.count > 0: each trainer rank pushes a version to the "
                             "engine on its GPU); otherwise Ray runs send the weights through Ray's object store, or "
                             "broadcast them")
        if transport == "cuda_ipc" and ray and (kind != "vllm" or self.engine.vllm.base_url
                                                or self.engine.vllm.tensor_parallel_size != 1):
            raise ValueError("runtime.weight_transport=cuda_ipc on Ray needs engine.kind=vllm in process (no "
                             "engine.vllm.base_url) with engine.vllm.tensor_parallel_size=1: the trainer rank's buffer "
                             "is mapped by the one vLLM worker on its GPU")
        if transport == "broadcast" and ray and not self.ray.engine.count:
            raise ValueError("runtime.weight_transport=broadcast on Ray needs engine actors (ray.engine.count > 0), "
                             "whose processes join the trainer actor's process group")
        if transport == "broadcast" and kind == "vllm" and self.engine.vllm.base_url:
            raise ValueError("runtime.weight_transport=broadcast needs vLLM in process (no engine.vllm.base_url): its "
                             "workers join the trainer's process group")
        if transport == "broadcast" and not ray and kind not in ("vllm", "sglang"):
            raise ValueError("runtime.weight_transport=broadcast on runtime.backend=local needs engine.kind=vllm or "
                             "sglang, whose workers join the trainer's process group (the built-in engine receives "
                             "a broadcast on Ray, in its engine actor)")
        if transport == "cuda_ipc" and kind == "sglang" and self.engine.sglang.tp_size != 1:
            raise ValueError(f"runtime.weight_transport=cuda_ipc maps the trainer's GPU memory into the SGLang server, "
                             f"which must then run on that one GPU (engine.sglang.tp_size={self.engine.sglang.tp_size}"
                             "); use runtime.weight_transport=broadcast for a server on other GPUs")
        return self

    @model_validator(mode="after")
    def _colocation_fits(self) -> RunConfig:
        """engine.sleep_while_training: a trainer and an engine sharing GPUs."""
        if not self.engine.sleep_while_training:
            return self
        r = self.ray
        if self.runtime.backend == "ray" and r.engine.count:
            # colocated on Ray (runtime/ray_backend.py): engine actor i shares trainer rank i's GPU
            if r.engine.count != self.trainer.world_size:
                raise ValueError(f"engine.sleep_while_training on Ray puts engine actor i on trainer rank i's GPU: "
                                 f"ray.engine.count ({r.engine.count}) must equal trainer.world_size "
                                 f"({self.trainer.world_size})")
            if r.engine.num_gpus + r.trainer.num_gpus > 1:
                raise ValueError(f"engine.sleep_while_training on Ray: ray.engine.num_gpus ({r.engine.num_gpus:g}) + "
                                 f"ray.trainer.num_gpus ({r.trainer.num_gpus:g}) is more than the one GPU they share "
                                 "(e.g. 0.5 each)")
        if self.runtime.weight_transport == "broadcast":
            raise ValueError("engine.sleep_while_training (a trainer and an engine sharing GPUs) cannot use "
                             "runtime.weight_transport=broadcast: NCCL puts no two ranks of a group on one GPU; use "
                             "cuda_ipc (same GPU) or shm")
        return self

    @model_validator(mode="after")
    def _engine_server_named(self) -> RunConfig:
        if self.engine.kind == "sglang" and not self.engine.sglang.base_url:
            raise ValueError("engine.sglang.base_url: engine.kind=sglang needs the SGLang server's address, e.g. "
                             "engine.sglang.base_url=http://gpu-node:30000")
        return self

    @model_validator(mode="after")
    def _blackbox_agent_runs(self) -> RunConfig:
        if self.agent.kind != "blackbox":
            return self
        if not self.agent.command:
            raise ValueError("agent.command: a black-box agent needs the program to run, e.g. [python3, agent.py]")
        if self.runtime.backend == "ray" and self.ray.env.count:
            raise ValueError("ray.env.count: a black-box agent reaches the gateway through a socket mounted into its "
                             "sandbox, so its sandboxes must run on the rollout actor's node; set ray.env.count=0")
        return self

    @model_validator(mode="after")
    def _vllm_actors_hold_their_gpus(self) -> RunConfig:
        if self.engine.kind == "vllm" and self.runtime.backend == "ray":  # the actors holding the engines
            spec, where = (self.ray.engine, "ray.engine") if self.ray.engine.count else (self.ray.rollout, "ray.rollout")
            tp = self.engine.vllm.tensor_parallel_size
            colocated = self.engine.sleep_while_training and spec.num_gpus < 1 and tp == 1  # a share of one GPU
            if spec.num_gpus and spec.num_gpus != tp and not colocated:
                raise ValueError(f"{where}.num_gpus={spec.num_gpus:g} but engine.vllm.tensor_parallel_size={tp}: each "
                                 f"actor's vLLM engine needs as many GPUs as its tensor-parallel size")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    # What each pool is given (loomrl/config/pools.py): its own sections and the few facts it shares.
    def engine_setup(self) -> EngineSetup:
        lora = self.trainer.lora
        return EngineSetup(engine=self.engine, model=self.model, seed=self.seed,
                           context_tokens=self.agent.max_context_tokens,
                           interrupt_on_update=self.runtime.interrupt_on_update, cpus=self.ray.engine.num_cpus,
                           routed_experts=self.trainer.router_replay,
                           lora_rank=lora.rank if lora is not None and lora.publish == "adapter" else None,
                           lora_targets=list(lora.target_modules) if lora is not None and lora.publish == "adapter"
                           else None)

    def weight_route(self) -> WeightRoute:
        e = self.engine
        receivers, timeout_s = {"vllm": (e.vllm.tensor_parallel_size, e.vllm.update_timeout_s),
                                "sglang": (e.sglang.tp_size, e.sglang.update_timeout_s)}.get(
            e.kind, (1, e.vllm.update_timeout_s))
        return WeightRoute(transport=self.runtime.weight_transport, host=self.runtime.broadcast_host,
                           engine_kind=e.kind, dtype=serving_dtype_name(e, self.model),
                           engine_device=self.model.device, receivers=receivers,
                           engines=self.ray.engine.count, bucket_bytes=e.vllm.weight_bucket_bytes,
                           timeout_s=timeout_s, colocated=e.sleep_while_training)

    def train_pool(self) -> TrainPoolConfig:
        return TrainPoolConfig(run_dir=str(self.run_dir), seed=self.seed, model=self.model, trainer=self.trainer,
                               buffer=self.buffer, route=self.weight_route(), cpus=self.ray.trainer.num_cpus,
                               checkpoint_every=self.checkpoint_every, checkpoint_keep=self.checkpoint_keep,
                               checkpoint_keep_optimizer=self.checkpoint_keep_optimizer)

    def rollout_pool(self) -> RolloutPoolConfig:
        t = self.trainer
        return RolloutPoolConfig(name=self.name, seed=self.seed, model=self.model, sampling=self.sampling,
                                 engine=self.engine_setup(), env=self.env, data=self.data, agent=self.agent,
                                 reward=self.reward, eval=self.eval, mode=self.runtime.mode, group_size=t.group_size,
                                 groups_per_step=t.groups_per_step, total_steps=t.total_steps,
                                 max_policy_lag=self.buffer.max_policy_lag,
                                 max_inflight_trajectories=self.runtime.max_inflight_trajectories,
                                 schedule=self.runtime.schedule, cpus=self.ray.rollout.num_cpus,
                                 engine_restart_wait_s=self.ray.engine_restart_wait_s)
