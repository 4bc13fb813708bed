"""The optimiser step: per-token logprobs of a batch of samples, the configured policy loss (losses.py: PPO clip by
default, GSPO, decoupled PPO, CISPO; IS corrections, KL, aggregation), AdamW, grad clipping.

Cost notes (CPU): logits are computed only at positions whose next token is trained (the 49k-wide LM head is a large
share of a small model's FLOPs), and `freeze_layers` keeps the embeddings and the bottom N blocks fixed so that backward
stops above them. With `tree_merge`, micro-batches are cut from the samples in lexicographic order (a group's samples
stay together) and forwarded as one prefix tree each (tree.py), so a shared prompt or history is computed once (once per
step, across micro-batches, with `tree_merge_memory=depth_first`).

A step, at its seams: its plan (step_plan.py: micro-batches, merge flags, padding, pair counts), the loss config with
the step's denominators and each micro-batch's typed loss inputs (loss_inputs.py), the loss of each micro-batch with
its stats and gaps (step_loss.py); here, the forwards and backwards that run the plan, and the optimizer step.

Device and precision (loomrl/devices.py): the model's parameters, gradients and AdamW state are float32 on
trainer.device; forwards and backwards run under autocast to trainer.precision; every tensor a step makes is made
on the model's device.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.devices import place, trainer_device
from loomrl.trainer.forward import Logprobs, compute_context, enable_activation_checkpointing, forward_of, routed
from loomrl.trainer.fsdp import whole_for_pass
from loomrl.trainer.head import Entropies
from loomrl.trainer.lora import Lora
from loomrl.trainer.loss_inputs import step_loss_config
from loomrl.trainer.moe_step import MoeStats, MoeStep
from loomrl.trainer.rank0_load import copy_shards, fill_from_rank0, take_whole_state
from loomrl.trainer.replay import Routing, replayed_recompute
from loomrl.trainer.step_loss import StepLoss
from loomrl.trainer.step_plan import PADDING, StepPlan, plan_step
from loomrl.trainer.tree import decoder_layers, depth_first_backward, input_embedding_weight, tree_attention
from loomrl.types import TrainingSample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def lr_factor(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (from 0) over trainer.lr: a linear ramp over warmup_steps, then
    lr_schedule over the remaining total_steps, from 1 down to lr_min_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = cfg.total_steps - cfg.warmup_steps - 1
    progress = min(1.0, (step - cfg.warmup_steps) / span) if span > 0 else 1.0
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress
    return cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * shape


@dataclass(slots=True)
class StepStats:
    loss: float
    grad_norm: float
    clip_frac: float
    ratio_mean: float
    approx_kl: float
    tokens: int
    loss_tokens: int
    seconds: float
    lr: float
    ess: float = 1.0  # effective sample size of the importance weights (1 without a correction)
    tree_ratio: float = 1.0  # tokens of the step / tokens forwarded (tree merge computes shared ones once)
    attn_pairs_dense: int = 0  # attention (query, key) pairs of the step's samples, each on its own
    attn_pairs: int = 0  # ... of the forwards actually run (fewer with tree merge)
    # mean entropy (nats) of the policy's temperature-scaled distribution at the trained tokens, from the training
    # forward's own logits (trainer/head.py)
    entropy: float = 0.0
    # |trainer logprob - engine logprob| of the trained tokens: the trainer's under the weights before this step's
    # update (every micro-batch's forward runs before the one optimizer step), the engine's as sampled. It mixes the
    # engines' numerics with policy lag: a token sampled by an older version differs by that version's change too.
    logprob_gap_mean: float = 0.0
    logprob_gap_max: float = 0.0
    # per sample given to train_step (same order), the gap of each of its loss-masked tokens; None: trained on
    # another rank that did not report it. Not a metric: the service writes it to RUN/train_records.jsonl.
    gaps: list[list[float] | None] = field(default_factory=list)
    # mixture-of-experts models with trainer.router_replay or moe_aux_loss_coef: moe/* (trainer/moe_step.py)
    moe: MoeStats | None = None

    def metrics(self) -> dict[str, float]:
        """The step's scalar metrics (every field but the per-sample gaps; moe's as moe/<name>)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("gaps", "moe")}
        return out | (self.moe.metrics() if self.moe is not None else {})


def use_flex(cfg: TrainerConfig, device: torch.device) -> bool:
    """Whether merged micro-batches attend through FlexAttention (trainer.tree_attention)."""
    flex = cfg.tree_attention == "flex" or (cfg.tree_attention == "auto" and device.type == "cuda")
    if flex and device.type != "cuda":
        raise ValueError("trainer.tree_attention=flex needs a CUDA trainer.device (torch's FlexAttention has no "
                         "backward on the CPU); use segments or auto")
    return flex


def freeze_bottom(model: PreTrainedModel, n_layers: int) -> None:
    """Fix the input embeddings and the bottom `n_layers` transformer blocks (tied head included)."""
    if n_layers <= 0:
        return
    input_embedding_weight(model).requires_grad_(False)
    for layer in decoder_layers(model)[:n_layers]:
        for p in layer.parameters():
            p.requires_grad_(False)


class Trainer:
    def __init__(self, model: PreTrainedModel, cfg: TrainerConfig, initial_model: PreTrainedModel | None = None,
                 *, shard: Callable[..., Logprobs] | None = None, device: torch.device | None = None,
                 from_rank0: bool = False):
        """`initial_model`: the policy the run started from, KL's reference; default: a copy of `model`
        (right for a fresh run; a resumed one must pass it, or the reference would be the checkpoint).
        `shard`: turns a model into its sharded forward (train_pool/distributed.py fsdp_shard), after the
        frozen layers are marked and before the optimizer sees the (then sharded) parameters.
        `model` (and `initial_model`) are placed in place on trainer.device with float32 parameters (the
        masters; loomrl/devices.py): a no-op for a model loaded for the trainer, which callers should pass
        (load_run_model(trainer=)): a bfloat16 model cast up here would hold rounded weights. `device`: trainer.device
        as the pool's process resolved it (build_trainer); default: resolved here (a trainer built on its own).
        `from_rank0` (with `shard`): `model` and `initial_model` are rank 0's whole on the CPU or another rank's meta
        skeleton (model/loader.py load_rank_model), not placed: sharded on meta, then filled from rank 0's (rank0_load.py)."""
        if from_rank0 and shard is None:
            raise ValueError("Trainer: from_rank0 fills the shards of a sharded model; pass shard=")
        self.model = model
        self.cfg = cfg
        self.device = device if device is not None else trainer_device(cfg)
        for m in (model, initial_model) if not from_rank0 else ():
            if m is not None:
                place(m, self.device, torch.float32)
        freeze_bottom(model, cfg.freeze_layers)
        # trainer.lora (lora.py): adapters on the frozen base, put into `model` itself; only they train
        self.lora = Lora(model, cfg.lora, cfg.freeze_layers) if cfg.lora is not None else None
        if self.lora is not None and initial_model is not None:
            raise ValueError("Trainer: under trainer.lora KL's reference is the base with its adapters off; pass no "
                             "initial_model")
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        # router replay and the load-balancing term (moe_step.py); a dense model: ValueError naming its class
        self.moe = MoeStep(model, cfg) if cfg.router_replay or cfg.moe_aux_loss_coef > 0 else None
        kl = cfg.loss.kl is not None and cfg.loss.kl_coef > 0
        # rank 0's whole state, taken out of the model after PEFT put its layers in (its fresh adapters included)
        whole = take_whole_state(model) if from_rank0 else None
        self.ref_model, ref_whole = self._reference(initial_model, kl and self.lora is None, from_rank0)
        self.sharded = shard is not None
        self.forward, self.ref_forward = self._forwards(shard, use_flex(cfg, self.device))
        if whole is not None:
            self._fill(whole, ref_whole)
        if kl and self.lora is not None:
            self.ref_forward = self.lora.reference(self.forward)
        # sharded: every rank must run the same number of micro-batches (set by DataParallelTrainer)
        self.shared_plan: Callable[[int], int] | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, cfg))
        self.step = 0
        self.autocast = compute_context(cfg.precision, self.device)
        self.grad_hook: Callable[[], None] | None = None  # train_pool/distributed.py: sums the ranks' gradients

    def _reference(self, initial_model: PreTrainedModel | None, own: bool, from_rank0: bool
                   ) -> tuple[PreTrainedModel | None, dict[str, torch.Tensor] | None]:
        """KL's reference policy as a frozen model of its own, and under from_rank0 rank 0's whole state of
        `initial_model` (None: the reference is the policy's start, filled from the policy's shards). Only when the KL
        term is on and there is no LoRA (then the base with its adapters switched off is the reference)."""
        if not own:
            return None, None
        ref_whole = take_whole_state(initial_model) if from_rank0 and initial_model is not None else None
        # from_rank0: the model is on meta by now on every rank, so its copy is a skeleton too, not a second model
        ref = (initial_model if initial_model is not None else copy.deepcopy(self.model)).eval()
        ref.requires_grad_(False)
        return ref, ref_whole

    def _forwards(self, shard: Callable[..., Logprobs] | None, flex: bool) -> tuple[Logprobs, Logprobs | None]:
        """The policy's forward and the own reference model's (sharded with `shard`; the reference's shards in host
        memory under trainer.kl_reference_offload)."""
        make = shard or forward_of
        ref_make = partial(shard, offload=True) if shard is not None and self.cfg.kl_reference_offload else make
        return make(self.model, flex=flex), ref_make(self.ref_model, flex=flex) if self.ref_model is not None else None

    def _fill(self, whole: dict[str, torch.Tensor], ref_whole: dict[str, torch.Tensor] | None) -> None:
        """from_rank0: every rank's shards filled from rank 0's `whole` state; the reference's copied from the policy's
        shards (no collective, and none into host memory, which NCCL cannot reach), after filling those with the
        reference's own state first when it has one (`ref_whole`: resuming). Each whole state is emptied once its
        shards are filled: on rank 0 it is the only hold on a whole model in host memory, freed before the next
        allocation (an offloaded reference's pinned shards)."""
        ref = self.ref_model
        where = torch.device("cpu") if self.cfg.kl_reference_offload else self.device
        if ref is not None and ref_whole is not None:
            fill_from_rank0(self.model, ref_whole, self.device)
            ref_whole.clear()
            copy_shards(self.model, ref, where, buffers_on=self.device)
        fill_from_rank0(self.model, whole, self.device)
        whole.clear()
        if ref is not None and ref_whole is None:
            copy_shards(self.model, ref, where, buffers_on=self.device)

    def train_step(self, samples: list[TrainingSample], *, idle_tokens: int = 0, idle_seqs: int = 0,
                   idle_longest: int = 0, peer_tokens: int = 0) -> StepStats:
        """One optimiser step over `samples`, in micro-batches, with the configured loss
        (loomrl/trainer/losses.py); aggregation denominators are those of the whole step.

        `idle_tokens`/`idle_seqs`: sampled tokens and sequences of the step that were left out only because they carry
        no signal (groups whose rewards are all equal: zero advantage). They count in the denominators, so leaving them
        out saves compute without changing the gradient; were they dropped from the denominator too, a step with one
        informative group would move the weights as far as a step with six, on a sixth of the evidence. `idle_longest`:
        the most sampled tokens of one idle sequence (token_sum_norm's default constant is the longest x sequences).
        `peer_tokens`: every token (prompt and sampled) of the step's samples that other data-parallel ranks train: the
        load-balancing term weighs each micro-batch by its share of the whole step's tokens, as one process would.
        Exception: with a KL penalty the idle tokens' KL term would have had a gradient; it is not
        trained (their tokens still count in the denominator)."""
        start = time.perf_counter()
        if idle_tokens < 0 or idle_seqs < 0:
            raise ValueError(f"train_step: idle_tokens and idle_seqs must be >= 0, got {idle_tokens}, {idle_seqs}")
        loss_tokens = sum(sum(s.loss_mask) for s in samples)
        # A data-parallel rank may get no samples (fewer than ranks): it still takes the step, with
        # the gradient the other ranks send, so that every replica stays the same.
        if loss_tokens == 0 and self.grad_hook is None and self.shared_plan is None:
            raise ValueError("train_step: no sampled tokens in the batch")
        plan = plan_step(self.cfg, samples, self.shared_plan)
        if self.moe is not None:
            self.moe.start()
        prox, ref = self._reference_logprobs(plan)
        loss_cfg = step_loss_config(self.cfg.loss, samples, idle_tokens=idle_tokens, idle_seqs=idle_seqs,
                                    idle_longest=idle_longest, with_ref=ref is not None)
        losses = StepLoss(plan, loss_cfg, prox=prox, ref=ref, num_seqs=len(samples) + idle_seqs, device=self.device)
        entropy = Entropies()  # the training forwards' per-token entropies
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(plan, losses, entropy, peer_tokens)
        grad_norm = self._optimizer_step()
        mean = losses.means(loss_tokens)
        gaps, gap = losses.sample_gaps(len(samples))
        moe = self.moe.stats(_first_batch_gap(plan, gaps)) if self.moe is not None else None
        ent = entropy.all()
        return StepStats(
            loss=loss, grad_norm=grad_norm, clip_frac=mean.get("clip_frac", 0.0),
            ratio_mean=mean.get("ratio_mean", 0.0), approx_kl=mean.get("approx_kl", 0.0), ess=mean.get("ess", 1.0),
            tokens=sum(len(s.token_ids) for s in samples), loss_tokens=loss_tokens,
            seconds=time.perf_counter() - start, lr=float(self.scheduler.get_last_lr()[0]), tree_ratio=plan.tree_ratio,
            attn_pairs_dense=plan.attn_pairs_dense, attn_pairs=plan.attn_pairs,
            entropy=float(ent.mean()) if ent.numel() else 0.0, logprob_gap_mean=float(gap.mean()) if gap.numel() else 0.0,
            logprob_gap_max=float(gap.max()) if gap.numel() else 0.0, gaps=gaps, moe=moe)

    def _reference_logprobs(self, plan: StepPlan) -> tuple[list[list[torch.Tensor]] | None,
                                                           list[list[torch.Tensor]] | None]:
        """Per micro-batch, per sample, the logprobs of decoupled PPO's proximal policy (the weights before this step)
        and of KL's reference (the initial weights); None where the loss uses none. Both replay the engine's experts under
        trainer.router_replay (KL then compares the two policies on the same expert choice, not on expert flips the
        gradient cannot act on); the no-replay gap probe (moe_step.py) runs here too, before any update. Leaves the
        model in train mode."""
        batches, merged = plan.batches, plan.merged
        self.model.eval()
        with self.autocast():
            prox = self._no_grad(self.forward, batches, merged) if self.cfg.loss.kind == "decoupled_ppo" else None
            ref = self._no_grad(self.ref_forward, batches, merged) if self.ref_forward is not None else None
            # sharded: every rank runs the probe's forward (its collectives), one with only padding too (no figure)
            if self.moe is not None and self.moe.replay and (plan.real or self.sharded):
                self.moe.probe(self.forward, batches[0], merged[0], counted=plan.real > 0)
        self.model.train()
        return prox, ref

    def _forward_backward(self, plan: StepPlan, losses: StepLoss, entropy: Entropies, peer_tokens: int) -> float:
        """Every micro-batch's forward, loss and backward, gradients accumulated in .grad; the summed loss."""
        if plan.depth_first:
            return self._depth_first_pass(plan, losses, entropy)
        loss_sum = 0.0
        tokens = sum(len(s.token_ids) for chunk in plan.batches[: plan.real] for s in chunk) + peer_tokens
        for b, chunk in enumerate(plan.batches):
            routing = self.moe.routing(chunk) if self.moe is not None and b < plan.real else None
            with self.autocast(), routed(routing):  # the padding's entropy is not the policy's at any trained token
                loss = losses(b, self.forward(chunk, plan.merged[b], entropy if b < plan.real else None))
                if routing is not None and self.moe is not None:  # its share of the step's tokens
                    term = self.moe.aux_term(routing, sum(len(s.token_ids) for s in chunk) / tokens)
                    loss = loss + term if loss is not None and term is not None else loss
            if loss is not None:
                with self._recompute(plan.merged[b], routing):
                    loss.backward()
                loss_sum += float(loss.detach())
        return loss_sum

    def _recompute(self, merged: bool, routing: Routing | None) -> contextlib.ExitStack:
        """What a micro-batch's backward needs in place under activation checkpointing, which recomputes each decoder
        layer's forward then: a merged micro-batch's tree attention, and the experts its forward replayed (replay.py
        replayed_recompute)."""
        stack = contextlib.ExitStack()
        if self.cfg.activation_checkpointing:
            if merged:
                stack.enter_context(tree_attention(self.model))
            stack.enter_context(replayed_recompute(self.model, routing))
        return stack

    def _depth_first_pass(self, plan: StepPlan, losses: StepLoss, entropy: Entropies) -> float:
        """tree.py's depth-first pass over the step's trie: shared prefixes computed once, one micro-batch's graph
        alive; the summed loss."""
        if not plan.batches:
            return 0.0
        # sharded: each rank's trie is its own, so no collective may run inside the pass (fsdp.py)
        whole = whole_for_pass(self.forward, [PADDING]) if self.sharded else contextlib.nullcontext()
        with self.autocast(), whole:
            if not plan.real:  # only the shared plan's padding: nothing to share inside the pass
                return 0.0
            return depth_first_backward(self.model, plan.batches[: plan.real], losses, entropy=entropy).loss

    def _optimizer_step(self) -> float:
        """The ranks' gradients summed (sharded), clipped, one AdamW step (skipped on a non-finite norm), the schedule
        advanced; the gradient norm before clipping."""
        if self.grad_hook is not None:
            self.grad_hook()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: over every rank
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.model.eval()
        return grad_norm

    def skip_step(self) -> None:
        """A step whose groups carried no signal: it consumes them and advances the learning-rate
        schedule (as a trained step would) without an optimizer step."""
        self.step += 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def _no_grad(self, forward: Logprobs, batches: list[list[TrainingSample]],
                 merged: list[bool]) -> list[list[torch.Tensor]]:
        """`forward` of every micro-batch without a graph, the engine's experts replayed under router replay."""
        replay = self.moe is not None and self.moe.replay
        out = []
        with torch.no_grad():
            for b, m in zip(batches, merged):
                with routed(self.moe.routing(b) if replay and self.moe is not None else None):
                    out.append(forward(b, m))
        return out


def _first_batch_gap(plan: StepPlan, gaps: list[list[float] | None]) -> float:
    """The mean trainer-engine gap of the first micro-batch's trained tokens (moe/logprob_gap: the probe's tokens)."""
    first = [g for i in (plan.index[0] if plan.real else []) for g in (gaps[i] or [])]
    return sum(first) / len(first) if first else 0.0


def initial_policy(start: ModelConfig, trainer: TrainerConfig, device: torch.device,
                   resume_from: Path | None, *, from_rank0: bool = False, rank0: bool = True) -> PreTrainedModel | None:
    """KL's reference when resuming: the run's starting model (`start`), not the checkpoint's, float32 on `device`;
    `from_rank0` (Trainer's): `rank0`'s as model/loader.py load_rank_model loads it on the CPU, another rank's the
    skeleton. Loaded before the rank joins the process group (train_pool/ranks.py load_rank), so that no rank waits in
    the rendezvous while another reads a model."""
    if resume_from is None or trainer.loss.kl is None or trainer.loss.kl_coef <= 0 or trainer.lora is not None:
        return None  # under LoRA the reference is the base with its adapters off (lora.py)
    from loomrl.model.loader import load_model, load_rank_model

    if from_rank0:
        return load_rank_model(start, None, trainer=trainer, rank0=rank0)[0]
    return load_model(start, device=device, dtype=torch.float32)[0]
