"""The optimiser step: per-token logprobs of a batch of samples, the configured policy loss (losses.py: PPO clip by
default, GSPO, decoupled PPO, CISPO; IS corrections, KL, aggregation), AdamW, grad clipping.

Cost notes (CPU): logits are computed only at positions whose next token is trained (the 49k-wide LM head is a large
share of a small model's FLOPs), and `freeze_layers` keeps the embeddings and the bottom N blocks fixed so that backward
stops above them. With `tree_merge`, micro-batches are cut from the samples in lexicographic order (a group's samples
stay together) and forwarded as one prefix tree each (tree.py), so a shared prompt or history is computed once (once per
step, across micro-batches, with `tree_merge_memory=depth_first`).

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

from loomrl.config import RunConfig, TrainerConfig
from loomrl.devices import place, trainer_device
from loomrl.trainer.forward import Logprobs, compute_context, enable_activation_checkpointing, forward_of
from loomrl.trainer.fsdp import whole_for_pass
from loomrl.trainer.head import Entropies
from loomrl.trainer.losses import policy_loss
from loomrl.trainer.tree import (
    compression_ratio,
    decoder_layers,
    dense_attention_pairs,
    depth_first_backward,
    input_embedding_weight,
    plan_tries,
    sampled_positions,
    tree_attention,
    tree_attention_pairs,
    unique_tokens,
)
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

    def metrics(self) -> dict[str, float]:
        """The step's scalar metrics (every field but the per-sample gaps)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gaps"}


def freeze_bottom(model: PreTrainedModel, n_layers: int) -> None:
    """Fix the input embeddings and the bottom `n_layers` transformer blocks (tied head included)."""
    if n_layers <= 0:
        return
    input_embedding_weight(model).requires_grad_(False)
    for layer in decoder_layers(model)[:n_layers]:
        for p in layer.parameters():
            p.requires_grad_(False)


# A micro-batch that trains nothing: ranks of a sharded step with fewer micro-batches than others run it,
# so that every rank joins every forward's and backward's collectives.
_PADDING = TrainingSample(trajectory_id="padding", group_id="padding", token_ids=[0, 0], loss_mask=[0, 1],
                          behaviour_logprobs=[0.0, 0.0], versions=[0, 0], advantages=[0.0, 0.0])


class Trainer:
    def __init__(self, model: PreTrainedModel, cfg: TrainerConfig, initial_model: PreTrainedModel | None = None,
                 *, shard: Callable[..., Logprobs] | None = None):
        """`initial_model`: the policy the run started from, KL's reference; default: a copy of `model`
        (right for a fresh run; a resumed one must pass it, or the reference would be the checkpoint).
        `shard`: turns a model into its sharded forward (trainer/distributed.py fsdp_shard), after the
        frozen layers are marked and before the optimizer sees the (then sharded) parameters.
        `model` (and `initial_model`) are placed in place on trainer.device with float32 parameters (the
        masters; loomrl/devices.py): a no-op for a model loaded for the trainer, which callers should pass
        (load_run_model(trainer=)): a bfloat16 model cast up here would hold rounded weights."""
        self.model = model
        self.cfg = cfg
        self.device = trainer_device(cfg)
        place(model, self.device, torch.float32)
        if initial_model is not None:
            place(initial_model, self.device, torch.float32)
        freeze_bottom(model, cfg.freeze_layers)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        # KL to the initial policy needs its logprobs: a frozen copy, kept only when the KL term is on.
        kl = cfg.loss.kl is not None and cfg.loss.kl_coef > 0
        self.ref_model = (initial_model if initial_model is not None else copy.deepcopy(model)).eval() if kl else None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        self.sharded = shard is not None
        flex = cfg.tree_attention == "flex" or (cfg.tree_attention == "auto" and self.device.type == "cuda")
        if flex and self.device.type != "cuda":
            raise ValueError("trainer.tree_attention=flex needs a CUDA trainer.device (torch's FlexAttention has no "
                             "backward on the CPU); use segments or auto")
        make = shard or forward_of
        self.forward = make(model, flex=flex)
        ref_make = partial(shard, offload=True) if shard is not None and cfg.kl_reference_offload else make
        self.ref_forward = ref_make(self.ref_model, flex=flex) if self.ref_model is not None else None
        # sharded: every rank must run the same number of micro-batches (set by DataParallelTrainer)
        self.shared_plan: Callable[[int], int] | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, cfg))
        self.step = 0
        self.autocast = compute_context(cfg.precision, self.device)
        self.grad_hook: Callable[[], None] | None = None  # trainer/distributed.py: sums the ranks' gradients

    def train_step(self, samples: list[TrainingSample], *, idle_tokens: int = 0, idle_seqs: int = 0,
                   idle_longest: int = 0) -> StepStats:
        """One optimiser step over `samples`, in micro-batches, with the configured loss
        (loomrl/trainer/losses.py); aggregation denominators are those of the whole step.

        `idle_tokens`/`idle_seqs`: sampled tokens and sequences of the step that were left out only because they carry
        no signal (groups whose rewards are all equal: zero advantage). They count in the denominators, so leaving them
        out saves compute without changing the gradient; were they dropped from the denominator too, a step with one
        informative group would move the weights as far as a step with six, on a sixth of the evidence. `idle_longest`:
        the most sampled tokens of one idle sequence (token_sum_norm's default constant is the longest x sequences).
        Exception: with a KL penalty the idle tokens' KL term would have had a gradient; it is not
        trained (their tokens still count in the denominator)."""
        start = time.perf_counter()
        cfg = self.cfg
        if idle_tokens < 0 or idle_seqs < 0:
            raise ValueError(f"train_step: idle_tokens and idle_seqs must be >= 0, got {idle_tokens}, {idle_seqs}")
        total_loss_tokens = sum(sum(s.loss_mask) for s in samples)
        # A data-parallel rank may get no samples (fewer than ranks): it still takes the step, with
        # the gradient the other ranks send, so that every replica stays the same.
        if total_loss_tokens == 0 and self.grad_hook is None and self.shared_plan is None:
            raise ValueError("train_step: no sampled tokens in the batch")
        batches, merged, tree_ratio = self._micro_batches(samples)
        real = len(batches)  # the rest are padding (a sharded step's shared plan)
        if self.shared_plan is not None:
            pad = self.shared_plan(real) - real
            batches, merged = batches + [[_PADDING]] * pad, merged + [False] * pad
        pairs_dense = [dense_attention_pairs([s.token_ids for s in b]) for b in batches]
        pairs = [tree_attention_pairs([s.token_ids for s in b]) if m else d
                 for b, m, d in zip(batches, merged, pairs_dense)]
        if self._depth_first() and samples:  # one pass over the step's trie: each node attends to its ancestors once
            pairs = [tree_attention_pairs([s.token_ids for s in samples])]
        # Decoupled PPO's proximal policy: the weights before this step; KL's reference: the initial weights.
        self.model.eval()
        with self.autocast():
            prox = self._no_grad(self.forward, batches, merged) if cfg.loss.kind == "decoupled_ppo" else None
            ref = self._no_grad(self.ref_forward, batches, merged) if self.ref_forward is not None else None
        self.model.train()
        if cfg.loss.aggregation == "token_mean":
            aggregation, norm = "token_sum_norm", float(total_loss_tokens + idle_tokens)  # sum / the step's sampled tokens
        else:
            aggregation = cfg.loss.aggregation
            longest = max([idle_longest, *(sum(s.loss_mask) for s in samples)])
            norm = cfg.loss.norm_constant or float(longest * (len(samples) + idle_seqs))
        # the step's loss: its denominators, and no KL term without a reference model
        loss_cfg = cfg.loss.model_copy(update={"aggregation": aggregation, "norm_constant": norm, **(
            {} if ref is not None else {"kl": None, "kl_coef": 0.0})})
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        stats_sum: dict[str, float] = {}
        seq_offset = chunk_offset = 0
        entropy = Entropies()  # the training forwards' per-token entropies
        gap_of: dict[int, torch.Tensor] = {}  # id(sample) -> |trainer - engine| logprob of its trained tokens

        def micro_batch_loss(b: int, logps: list[torch.Tensor]) -> torch.Tensor | None:
            """The loss of micro-batch b given its samples' logprobs (None: no sampled tokens)."""
            nonlocal seq_offset, chunk_offset
            if b >= real:  # padding: a forward and a backward for the collectives, no gradient
                return logps[0].sum() * 0.0
            chunk = batches[b]
            parts = [(i, s, logp) for i, (s, logp) in enumerate(zip(chunk, logps)) if logp.numel()]
            if not parts:
                return None
            idx = [sampled_positions(s) for _, s, _ in parts]
            dev = self.device
            behaviour = torch.tensor([s.behaviour_logprobs[t] for (_, s, _), ts in zip(parts, idx) for t in ts],
                                     device=dev)
            adv = torch.tensor([s.advantages[t] for (_, s, _), ts in zip(parts, idx) for t in ts], device=dev)
            seq_ids = torch.tensor([seq_offset + k for k, ts in enumerate(idx) for _ in ts], device=dev)
            # A chunk is one turn: a run of sampled tokens between two environment interactions.
            chunk_ids, c = [], chunk_offset - 1
            for ts in idx:
                for j, t in enumerate(ts):
                    c += j == 0 or t != ts[j - 1] + 1  # a new sequence, or a gap in its sampled tokens
                    chunk_ids.append(c)
            seq_offset += len(parts)
            chunk_offset = c + 1
            # before any update of this step: the trainer's view of the tokens the engine sampled
            gaps = (torch.cat([logp for _, _, logp in parts]).detach().float() - behaviour).abs()
            for (_, s, _), g in zip(parts, torch.split(gaps, [len(ts) for ts in idx])):
                gap_of[id(s)] = g
            loss, stats = policy_loss(
                loss_cfg, torch.cat([logp for _, _, logp in parts]), behaviour, adv, seq_ids,
                chunk_ids=torch.tensor(chunk_ids, device=dev),
                prox_logp=torch.cat([prox[b][i] for i, _, _ in parts]) if prox is not None else None,
                ref_logp=torch.cat([ref[b][i] for i, _, _ in parts]) if ref is not None else None,
                num_seqs=len(samples) + idle_seqs)
            for key in ("clip_frac", "ratio_mean", "approx_kl", "ess"):
                if key in stats:
                    stats_sum[key] = stats_sum.get(key, 0.0) + stats[key] * stats["num_tokens"]
            return loss

        if self._depth_first() and batches:  # tree.py: shared prefixes computed once, one micro-batch's graph alive
            # sharded: each rank's trie is its own, so no collective may run inside the pass (fsdp.py)
            whole = whole_for_pass(self.forward, [_PADDING]) if self.sharded else contextlib.nullcontext()
            with self.autocast(), whole:
                if real:  # the rest (the shared plan's padding) are left out: nothing to share inside the pass
                    loss_sum = depth_first_backward(self.model, batches[:real], micro_batch_loss,
                                                    entropy=entropy).loss
        else:
            for b, chunk in enumerate(batches):
                with self.autocast():  # the padding's entropy is not the policy's at any trained token
                    loss = micro_batch_loss(b, self.forward(chunk, merged[b], entropy if b < real else None))
                if loss is not None:
                    recompute_merged = merged[b] and cfg.activation_checkpointing
                    with tree_attention(self.model) if recompute_merged else contextlib.nullcontext():
                        loss.backward()
                    loss_sum += float(loss.detach())
        if self.grad_hook is not None:
            self.grad_hook()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: over every rank
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.model.eval()
        mean = {key: v / max(total_loss_tokens, 1) for key, v in stats_sum.items()}  # per sampled token
        ent = entropy.all()
        gap = torch.cat(list(gap_of.values())).cpu() if gap_of else torch.zeros(0)  # one copy off the device
        per_sample = dict(zip(gap_of, (g.tolist() for g in torch.split(gap, [g.numel() for g in gap_of.values()]))))
        return StepStats(
            loss=loss_sum, grad_norm=grad_norm, clip_frac=mean.get("clip_frac", 0.0),
            ratio_mean=mean.get("ratio_mean", 0.0), approx_kl=mean.get("approx_kl", 0.0), ess=mean.get("ess", 1.0),
            tokens=sum(len(s.token_ids) for s in samples), loss_tokens=total_loss_tokens,
            seconds=time.perf_counter() - start, lr=float(self.scheduler.get_last_lr()[0]), tree_ratio=tree_ratio,
            attn_pairs_dense=sum(pairs_dense), attn_pairs=sum(pairs),
            entropy=float(ent.mean()) if ent.numel() else 0.0, logprob_gap_mean=float(gap.mean()) if gap.numel() else 0.0,
            logprob_gap_max=float(gap.max()) if gap.numel() else 0.0,
            gaps=[per_sample.get(id(s), []) for s in samples])

    def skip_step(self) -> None:
        """A step whose groups carried no signal: it consumes them and advances the learning-rate
        schedule (as a trained step would) without an optimizer step."""
        self.step += 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def _micro_batches(self, samples: list[TrainingSample]) -> tuple[list[list[TrainingSample]], list[bool], float]:
        """(micro-batches, whether each is forwarded as a prefix tree, the step's tree_ratio: its tokens /
        the tokens its forwards compute)."""
        cfg = self.cfg
        mb = cfg.micro_batch_size
        if cfg.tree_merge == "off":  # micro-batches of similar length waste less padding
            ordered = sorted(samples, key=lambda s: len(s.token_ids))
        else:  # lexicographic order puts samples that share a prefix next to each other, in one micro-batch
            ordered = sorted(samples, key=lambda s: s.token_ids)
        if cfg.tree_merge != "off" and cfg.tree_token_budget is not None:
            groups = plan_tries([s.token_ids for s in ordered], cfg.tree_token_budget)
            batches = [[ordered[i] for i in g] for g in groups]
        elif cfg.tree_merge == "off" and cfg.micro_batch_tokens is not None:
            batches = []  # ordered by length: a batch's padded size is its count x its last sample's length
            for s in ordered:
                if batches and (len(batches[-1]) + 1) * len(s.token_ids) <= cfg.micro_batch_tokens:
                    batches[-1].append(s)
                else:
                    batches.append([s])
        else:
            batches = [ordered[i : i + mb] for i in range(0, len(ordered), mb)]
        if cfg.tree_merge == "off":
            return batches, [False] * len(batches), 1.0
        if self._depth_first():  # every micro-batch merged; each node of the step forwarded once
            return batches, [True] * len(batches), compression_ratio([s.token_ids for s in ordered])
        merged, tokens, forwarded = [], 0, 0
        for b in batches:
            total, unique = sum(len(s.token_ids) for s in b), unique_tokens([s.token_ids for s in b])
            merged.append(cfg.tree_merge == "on" or total >= cfg.tree_merge_min_ratio * unique)
            tokens += total
            forwarded += unique if merged[-1] else total
        return batches, merged, tokens / max(forwarded, 1)

    def _depth_first(self) -> bool:
        cfg = self.cfg
        return cfg.tree_merge != "off" and cfg.tree_token_budget is not None and cfg.tree_merge_memory == "depth_first"

    @staticmethod
    def _no_grad(forward: Logprobs, batches: list[list[TrainingSample]], merged: list[bool]) -> list[list[torch.Tensor]]:
        with torch.no_grad():
            return [forward(b, m) for b, m in zip(batches, merged)]


def initial_policy(cfg: RunConfig, resume_from: Path | None) -> PreTrainedModel | None:
    """KL's reference when resuming: the run's starting model (cfg.model), not the checkpoint's."""
    t = cfg.trainer
    if resume_from is None or t.loss.kl is None or t.loss.kl_coef <= 0:
        return None
    from loomrl.model.loader import load_model

    return load_model(cfg.model, device=trainer_device(t), dtype=torch.float32)[0]
