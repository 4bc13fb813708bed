"""The loss of each micro-batch of one training step, and what the step reports of them: its per-token stats and each
sample's engine-vs-trainer logprob gap, taken from the training forward before any update of the step.

A StepLoss is the `loss_fn` the forward/backward passes call once per micro-batch (trainer.py's dense loop and
tree.py's depth_first_backward alike); it keeps each call's results, indexed by the samples' positions in the step.
What it is not: the forwards, the backward or the optimizer step (trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loomrl.config import LossConfig
from loomrl.trainer.loss_inputs import loss_inputs
from loomrl.trainer.losses import compute_loss
from loomrl.trainer.step_plan import StepPlan

# the loss stats reported as a step's mean per sampled token
MEAN_STATS = ("clip_frac", "ratio_mean", "approx_kl", "ess")


class StepLoss:
    def __init__(self, plan: StepPlan, cfg: LossConfig, *, prox: Sequence[Sequence[torch.Tensor]] | None,
                 ref: Sequence[Sequence[torch.Tensor]] | None, num_seqs: int, device: torch.device):
        """`cfg`: the step's loss config (loss_inputs.step_loss_config); `prox` / `ref`: per micro-batch of `plan`,
        each sample's logprobs under the proximal / reference policy (None: the loss uses none)."""
        self.plan, self.cfg, self.prox, self.ref = plan, cfg, prox, ref
        self.num_seqs, self.device = num_seqs, device
        self.stats_sum: dict[str, float] = {}  # MEAN_STATS, each summed over micro-batches weighted by their tokens
        # (position in the step's samples, |trainer - engine| logprob of its trained tokens), in the order computed
        self.gaps: list[tuple[int, torch.Tensor]] = []

    def __call__(self, b: int, logps: list[torch.Tensor]) -> torch.Tensor | None:
        """The loss of micro-batch b given its samples' logprobs (None: no sampled tokens)."""
        plan = self.plan
        if b >= plan.real:  # padding: a forward and a backward for the collectives, no gradient
            return logps[0].sum() * 0.0
        inputs = loss_inputs(plan.batches[b], logps, prox=self.prox[b] if self.prox is not None else None,
                             ref=self.ref[b] if self.ref is not None else None, num_seqs=self.num_seqs,
                             device=self.device)
        if inputs is None:
            return None
        # before any update of this step: the trainer's view of the tokens the engine sampled
        gaps = (inputs.loss.logp.detach().float() - inputs.loss.old_logp).abs()
        for i, g in zip(inputs.samples, torch.split(gaps, inputs.counts)):
            self.gaps.append((plan.index[b][i], g))
        loss, stats = compute_loss(self.cfg, inputs.loss)
        for key in MEAN_STATS:
            if key in stats:
                self.stats_sum[key] = self.stats_sum.get(key, 0.0) + stats[key] * stats["num_tokens"]
        return loss

    def means(self, loss_tokens: int) -> dict[str, float]:
        """The step's MEAN_STATS that its loss reported, per sampled token."""
        return {key: v / max(loss_tokens, 1) for key, v in self.stats_sum.items()}

    def sample_gaps(self, n: int) -> tuple[list[list[float] | None], torch.Tensor]:
        """Per sample of the step (n of them, in the order given; [] for one without trained tokens) its tokens' gaps,
        and every gap in one tensor on the CPU."""
        gap = torch.cat([g for _, g in self.gaps]).cpu() if self.gaps else torch.zeros(0)  # one copy off the device
        out: list[list[float] | None] = [[] for _ in range(n)]  # StepStats.gaps: None is another rank's
        for (i, _), g in zip(self.gaps, torch.split(gap, [g.numel() for _, g in self.gaps])):
            out[i] = g.tolist()
        return out, gap
