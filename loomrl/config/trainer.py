"""The `trainer:` section: the optimiser, the loss and the advantage, the ranks (loomrl/trainer/; docs/training.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config.base import Device, Section

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


class LossConfig(Section):
    """trainer.loss (loomrl/trainer/losses.py policy_loss): the policy loss, its off-policy correction,
    the KL term and the aggregation."""

    kind: LossKind = "ppo_clip"
    """ppo_clip (PPO's clipped ratio), gspo (sequence-level ratio), decoupled_ppo (behaviour and proximal policies
    apart), cispo (clipped importance weights, every token's gradient kept)"""
    clip_low: float | None = Field(None, gt=0.0)
    """clip range below / above 1; None: the kind's default (PPO 0.2 / 0.2, GSPO 3e-4 / 4e-4, CISPO none / 0.28)"""
    clip_high: float | None = Field(None, gt=0.0)
    """e.g. DAPO's clip-higher"""
    is_level: ISLevel = "none"
    """chunk = one turn (between env calls)"""
    is_variant: ISVariant = "truncated"
    """how a large importance weight is kept in bounds: truncated (capped at is_cap), masked (its tokens dropped), none
    """
    is_cap: float = Field(2.0, gt=0.0)
    """the cap of the importance weight (is_variant truncated or masked)"""
    kl: KLKind | None = None
    """KL to the initial policy (keeps a frozen copy of it)"""
    kl_coef: float = Field(0.0, ge=0.0)
    """the KL term's weight in the loss (0 with kl set: measured, not trained on)"""
    aggregation: Aggregation = "token_mean"
    """how token losses become one: token_mean, seq_mean_token_mean, seq_mean_token_sum, token_sum_norm (over
    norm_constant)"""
    norm_constant: float | None = Field(None, gt=0.0)
    """token_sum_norm: default max sampled tokens x sequences"""


# The attention and MLP projections of Llama- and Qwen-shaped decoders: LoRA's usual targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """trainer.lora (loomrl/trainer/lora.py): train low-rank adapters (PEFT's LoRA) on a frozen base model instead of
    every parameter. Each targeted linear layer W gains W + (alpha / rank) x B @ A, B [out, rank] starting at zero so
    that step 0 is the base model."""

    rank: int = Field(8, gt=0)
    """the adapters' rank r: A is [r, in], B [out, r]"""
    alpha: int = Field(16, gt=0)
    """the adapters' scale is alpha / rank"""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """dropout on each adapter's input during the training forward (the base path is not dropped)"""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """names of the linear layers that get adapters, matched against the last part of each module's name (default:
    the attention and MLP projections of Llama/Qwen shapes); a name the model does not have is an error"""
    publish: Literal["adapter", "merged"] = "adapter"
    """what a weight version sends to the engines: the adapter's tensors alone (each engine applies them:
    Engine.update_adapter), or the targeted linears' merged weights (W + scale x B @ A, as full fine-tuning's)"""


class TrainerConfig(Section):
    lr: float = Field(1e-5, gt=0.0)
    """AdamW's learning rate"""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW's decoupled weight decay"""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's (beta1, beta2)"""
    warmup_steps: int = Field(0, ge=0)
    """the learning rate ramps up linearly over this many steps"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """the learning rate after warmup (loomrl/trainer/trainer.py lr_factor): constant, or decayed over the rest of
    total_steps to lr x lr_min_ratio, along a half cosine or a straight line"""
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """the floor of a decaying lr_schedule, as a share of lr"""
    grad_clip: float = Field(1.0, gt=0.0)
    """the gradients' global norm is clipped to this"""
    advantage: AdvantageKind = "grpo"
    """Advantages (loomrl/trainer/credit.py; docs/training.md "Advantages and per-turn credit"). `advantage` is the
    estimator: its baseline (grpo, dr_grpo: the group's mean; rloo: the mean of the others) and its own division"""
    advantage_norm: AdvantageNorm | None = None
    """what a group's centred returns are divided by: std (GRPO's), std_floor (max(std, std_floor x reward_range), so
    that a group whose rewards barely differ, e.g. only by a small format credit, does not get full-size advantages),
    none (Dr. GRPO's and RLOO's); unset: the estimator's own (OWN_NORM)"""
    std_floor: float = Field(0.2, gt=0.0)
    """std_floor's floor in units of reward_range: 0.2 is below the std of a group of up to 23 with one full-range
    success (reward_range x sqrt(G - 1) / G), so GRPO's scale of groups that differ in outcome is kept"""
    reward_range: float = Field(1.0, gt=0.0)
    """the spread of episode returns a task can give, best minus worst (the calculator's: 1.0 for a correct answer, plus
    0.1 format credit, minus 0: 1.1; 1.0 is close enough). Not a multiplier of the rewards"""
    credit: CreditKind = "outcome"
    """outcome: every sampled token of an episode carries its return's advantage; turn: each turn's tokens carry its
    return-to-go's (Trajectory.turn_rewards) against the other episodes' at that turn"""
    loss: LossConfig = Field(default_factory=LossConfig)
    lora: LoraConfig | None = None
    """train LoRA adapters on the frozen base instead of every parameter (loomrl/trainer/lora.py); None: full fine-tuning
    """
    count_idle_groups: bool = True
    """zero-variance groups are not trained (no gradient) but count in the loss denominators, so that a step with few
    informative groups takes a proportionally smaller step; False: mean over trained only"""
    groups_per_step: int = Field(4, gt=0)
    """groups (tasks) consumed by one training step"""
    group_size: int = Field(8, gt=1)
    """rollouts per task: a group, whose rewards GRPO compares"""
    micro_batch_size: int = Field(8, gt=0)
    """samples per forward/backward pass; a step accumulates its micro-batches' gradients"""
    micro_batch_tokens: int | None = Field(None, gt=0)
    """dense micro-batches by size instead: as many samples (sorted by length) as fit in this many padded tokens
    (samples x the longest), so that activation memory is bounded by tokens, not by a count; a sample longer than the
    budget is a micro-batch of its own. None keeps micro_batch_size. With tree merge, tree_token_budget plays this part
    (in unique tokens)"""
    total_steps: int = Field(10, gt=0)
    """training steps in the run (a resumed run goes on to this many)"""
    freeze_layers: int = Field(0, ge=0)
    """keep the bottom N transformer blocks fixed (cheaper steps: the backward stops above them); under trainer.lora
    the bottom N blocks get no adapters"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward pass instead of keeping them: activation memory of one
    layer instead of all, for about one more forward pass of compute (tree merge too, not the depth-first pass)"""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """compute dtype of the trainer's forward and backward (torch.autocast): the weights, their gradients and AdamW's
    state stay float32, and so do the logprobs, the loss and its softmax; auto = bfloat16 on a GPU, float32 on the CPU
    (whose bf16 matmuls are slower than its float32 ones). No float16: it needs loss scaling, which bfloat16 (float32's
    exponent range) does not"""
    device: Device = "auto"
    """where the trainer's float32 weights, gradients and AdamW state live"""
    threads: int = Field(0, ge=0)
    """torch threads of the trainer; 0 = all cores (sync), the rest (async)"""
    world_size: int = Field(1, ge=1)
    """data-parallel trainer ranks (train_pool/ranks.py), each training on a share of every step's samples"""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every rank holds the whole model and AdamW state, gradients are summed after the backward; fsdp: FSDP2
    shards parameters, gradients, AdamW state and the KL reference over the ranks (also at world_size 1), checkpoints
    the optimizer with torch.distributed.checkpoint (train_pool/distributed.py)"""
    kl_reference_offload: bool = False
    """fsdp with a KL term: keep the frozen KL reference's shards in host memory, each layer's brought to the device for
    its forward only (FSDP2's CPUOffloadPolicy): a model's worth of device memory less per world_size, for a
    host-to-device copy of the reference per micro-batch"""
    tree_merge: Literal["off", "on", "auto"] = "off"
    """loomrl/trainer/tree.py: forward a micro-batch as one prefix tree, so tokens its samples share (a group's prompt,
    a conversation's history) are computed once; same logprobs and gradients. "auto": merge a micro-batch when its
    total/unique token ratio is at least tree_merge_min_ratio."""
    tree_merge_min_ratio: float = Field(1.5, ge=1.0)
    """tree_merge=auto merges a micro-batch whose total/unique token ratio is at least this"""
    tree_token_budget: int | None = Field(None, gt=0)
    """with tree merge: micro-batches hold as many adjacent samples as fit in this many unique tokens (instead of
    micro_batch_size samples); None keeps micro_batch_size"""
    tree_merge_memory: Literal["subtries", "depth_first"] = "subtries"
    """with tree_token_budget: "subtries" forwards each micro-batch's trie on its own (a prefix shared by two
    micro-batches is computed in each); "depth_first" computes each node of the step once, keeping a shared prefix's
    activations only while the micro-batches that use it run (with parallel=fsdp each rank holds the whole parameters
    and gradients through that pass: trainer/fsdp.py)"""
    tree_attention: Literal["auto", "segments", "flex"] = "auto"
    """how a merged micro-batch attends: "segments" (SDPA over each run of tokens and its ancestors' keys, any device),
    "flex" (one FlexAttention call with a block mask of the tree; CUDA only: no backward on the CPU), "auto" (flex on
    CUDA, else segments). The depth-first pass always uses segments"""
    router_replay: bool = False
    """mixture-of-experts models: every forward of a step (training, proximal, KL reference) uses the experts the
    engine's router chose for each token (R3, loomrl/trainer/replay.py), routing weights still from its own router;
    the engine records them (layers x top_k bytes a token, kept with the trajectory). Needs an engine that records
    them (engine.kind=builtin) and an MoE model (a dense one: an error naming its class); works with
    activation_checkpointing and parallel=fsdp, not with tree_merge_memory=depth_first. Metrics: moe/* (docs/metrics.md)"""
    moe_aux_loss_coef: float = Field(0.0, ge=0.0)
    """mixture-of-experts models: the load-balancing loss (transformers' load_balancing_loss_func over the step's
    router logits) added to the policy loss with this weight; 0: none"""

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
        self._router_replay_fits(depth_first)
        if self.kl_reference_offload and self.parallel != "fsdp":
            raise ValueError("trainer.kl_reference_offload needs trainer.parallel=fsdp (FSDP2 streams the offloaded "
                             "reference's layers back); with ddp the reference stays on trainer.device")
        return self

    def _router_replay_fits(self, depth_first: bool) -> None:
        """trainer.router_replay against the pass that cannot replay (trainer/replay.py); activation checkpointing and
        FSDP2 replay (tests/trainer/test_router_replay_step.py, test_router_replay_fsdp.py)."""
        if self.router_replay and depth_first:
            # it packs the step's trie by token alone: samples whose recorded experts differ would share a node, and
            # one node can replay only one expert choice
            raise ValueError("trainer.router_replay does not work with trainer.tree_merge_memory=depth_first (with a "
                             "tree_token_budget): its trie merges tokens whose recorded experts differ; use "
                             "tree_merge_memory=subtries")

    @property
    def distributed(self) -> bool:
        """Whether the trainer runs in a process group: several ranks, or FSDP (even on one)."""
        return self.world_size > 1 or self.parallel == "fsdp"
