"""The optimiser step: per-token logprobs of a batch of samples, the GRPO loss, AdamW, grad clipping.

Cost notes (CPU): logits are computed only at positions whose next token is trained (the 49k-wide
LM head is a large share of a small model's FLOPs), and `freeze_layers` keeps the embeddings and the
bottom N blocks fixed so that backward stops above them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from loomrl.config import TrainerConfig
from loomrl.trainer.grpo import clipped_policy_loss
from loomrl.types import TrainingSample


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


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = getattr(model, "model", None) or model.get_decoder()
    return base, model.get_output_embeddings()


def freeze_bottom(model: torch.nn.Module, n_layers: int) -> None:
    """Fix the input embeddings and the bottom `n_layers` transformer blocks (tied head included)."""
    if n_layers <= 0:
        return
    base, _ = _decoder_and_head(model)
    base.get_input_embeddings().weight.requires_grad_(False)
    for layer in base.layers[:n_layers]:
        for p in layer.parameters():
            p.requires_grad_(False)


def token_logprobs(model: torch.nn.Module, samples: list[TrainingSample], *, with_grad: bool) -> list[torch.Tensor]:
    """Logprob of each sample's loss-masked tokens under `model` (at the sample's temperature)."""
    base, head = _decoder_and_head(model)
    width = max(len(s.token_ids) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids)
        attn[i, : len(s.token_ids)] = 1
    with torch.set_grad_enabled(with_grad):
        hidden = base(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H]
        out = []
        for i, s in enumerate(samples):
            targets = [t for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
            if not targets:
                out.append(hidden.new_zeros(0))
                continue
            pos = torch.tensor(targets)
            logits = head(hidden[i, pos - 1]).float()  # [N, V]
            if s.temperature > 0:
                logits = logits / s.temperature
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[i, pos].unsqueeze(1)).squeeze(1)
            out.append(logp)
    return out


class Trainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig):
        self.model = model
        self.cfg = cfg
        freeze_bottom(model, cfg.freeze_layers)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self.step = 0

    def train_step(self, samples: list[TrainingSample]) -> StepStats:
        """One optimiser step over `samples`, in micro-batches; loss = mean over all sampled tokens."""
        start = time.perf_counter()
        self.model.train()
        total_loss_tokens = sum(sum(s.loss_mask) for s in samples)
        if total_loss_tokens == 0:
            raise ValueError("train_step: no sampled tokens in the batch")
        # Micro-batches of similar length waste less padding.
        ordered = sorted(samples, key=lambda s: len(s.token_ids))
        mb = self.cfg.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clip = ratio = kl = 0.0
        for i in range(0, len(ordered), mb):
            chunk = ordered[i : i + mb]
            logps = token_logprobs(self.model, chunk, with_grad=True)
            losses = []
            for s, logp in zip(chunk, logps):
                if logp.numel() == 0:
                    continue
                idx = [t for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
                behaviour = torch.tensor([s.behaviour_logprobs[t] for t in idx])
                adv = torch.tensor([s.advantages[t] for t in idx])
                loss, stats = clipped_policy_loss(logp, behaviour, adv, self.cfg.clip_eps)
                losses.append(loss.sum())
                clip += float(stats["clip_frac"])
                ratio += float(stats["ratio"])
                kl += float(stats["approx_kl"])
            if losses:
                chunk_loss = torch.stack(losses).sum() / total_loss_tokens
                chunk_loss.backward()
                loss_sum += float(chunk_loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.model.eval()
        return StepStats(
            loss=loss_sum,
            grad_norm=grad_norm,
            clip_frac=clip / total_loss_tokens,
            ratio_mean=ratio / total_loss_tokens,
            approx_kl=kl / total_loss_tokens,
            tokens=sum(len(s.token_ids) for s in samples),
            loss_tokens=total_loss_tokens,
            seconds=time.perf_counter() - start,
            lr=self.scheduler.get_last_lr()[0],
        )
