"""What a training step adds for mixture-of-experts models: router replay (trainer.router_replay: each forward's
`Routing` from its samples' recorded experts, replay.py), the load-balancing term (trainer.moe_aux_loss_coef), and the
step's `moe/*` figures (MoeStats).

The figures, with replay:
- router_agreement: the share of (sampled token, layer, k) expert choices the engine recorded that the trainer's own
  router (the top-k of its logits in the training forward) also makes: 1.0 with equal weights, lower as routing drifts;
- logprob_gap and logprob_gap_no_replay: the mean |trainer - engine| logprob of the first micro-batch's sampled tokens,
  with replay (the training forward's) and without (one extra no-grad forward of that micro-batch, every step: about a
  third of that micro-batch's forward and backward; the probe sees the same weights as the training forward).
- aux_loss: the step's load-balancing loss (token-weighted over its micro-batches), when its coefficient is > 0.
Over data-parallel ranks (train_pool/distributed.py): agreement over every rank's choices, the gaps the mean of the
ranks that trained samples, aux_loss the sum of the ranks' token-weighted parts (each weighed by the whole step's
tokens: Trainer.train_step's peer_tokens).

What it is not: the forwards (forward.py), the hooks (replay.py), the loss (step_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import cast

import torch

from loomrl.config import TrainerConfig
from loomrl.trainer.forward import Logprobs, routed
from loomrl.trainer.replay import Routing, agreement, aux_loss, moe_routers
from loomrl.types import TrainingSample


@dataclass(slots=True, kw_only=True)
class MoeStats:
    """A step's mixture-of-experts figures (module docstring); emitted as `moe/<field>`."""

    router_agreement: float = 0.0
    logprob_gap: float = 0.0
    logprob_gap_no_replay: float = 0.0
    aux_loss: float = 0.0
    # how many expert choices router_agreement is a share of (data-parallel ranks weigh theirs by it); not a metric
    choices: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"moe/{f.name}": getattr(self, f.name) for f in fields(self) if f.name != "choices"}


class MoeStep:
    """One trainer's MoE additions; a step calls `start`, then `routing` / `aux_term` per forward, then `stats`."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig):
        routers = moe_routers(model)  # a dense model: ValueError naming its class
        self.model, self.replay, self.coef = model, cfg.router_replay, cfg.moe_aux_loss_coef
        self.layers, self.top_k = len(routers), cast(int, routers[0].top_k)  # an int attribute of transformers' router
        self._agree, self._choices, self._aux, self._gap_free = 0, 0, 0.0, 0.0

    def start(self) -> None:
        self._agree, self._choices, self._aux, self._gap_free = 0, 0, 0.0, 0.0

    def experts(self, sample: TrainingSample) -> torch.Tensor:
        """The sample's recorded experts [T, L, k], -1 on rows the engine did not route (all of them without a
        record)."""
        n = len(sample.token_ids)
        rec = sample.routed_experts
        if rec is None:
            return torch.full((n, self.layers, self.top_k), -1, dtype=torch.long)
        ids = rec.tensor()  # [tokens, L, k]
        if ids.shape[0] > n:
            raise ValueError(f"router replay: sample {sample.trajectory_id} has experts for {ids.shape[0]} tokens, "
                             f"{n} tokens")
        return torch.cat([ids, ids.new_full((n - ids.shape[0], *ids.shape[1:]), -1)])

    def routing(self, batch: list[TrainingSample]) -> Routing:
        """A forward's routing over `batch`: its samples' experts replayed (with replay), its router logits kept."""
        return Routing(experts=[self.experts(s) for s in batch] if self.replay else None)

    def aux_term(self, routing: Routing, share: float) -> torch.Tensor | None:
        """After a training forward under `routing`: the loss term it adds (coef x its aux loss x `share`, its part of
        the step's tokens; None without one); its router agreement counted."""
        agree, choices = agreement(routing)
        self._agree, self._choices = self._agree + agree, self._choices + choices
        if self.coef <= 0:
            return None
        aux = aux_loss(self.model, routing)
        self._aux += float(aux.detach()) * share
        return self.coef * share * aux

    def probe(self, forward: Logprobs, batch: list[TrainingSample], merged: bool, *, counted: bool = True) -> None:
        """The no-replay gap of `batch` (the step's first micro-batch): a no-grad forward without replay. Not
        `counted`: a sharded rank's padding, forwarded only for the collectives."""
        with torch.no_grad(), routed(None):
            logps = forward(batch, merged)
        self._gap_free = _mean_gap(batch, logps) if counted else 0.0

    def stats(self, replayed_gap: float) -> MoeStats:
        return MoeStats(router_agreement=self._agree / self._choices if self._choices else 0.0,
                        logprob_gap=replayed_gap, logprob_gap_no_replay=self._gap_free, aux_loss=self._aux,
                        choices=self._choices)


def _mean_gap(batch: list[TrainingSample], logps: list[torch.Tensor]) -> float:
    """Mean |logps - behaviour logprob| over the batch's sampled tokens (logps[i]: sample i's, in order)."""
    gaps = [(lp.detach().float().cpu() - torch.tensor([s.behaviour_logprobs[t] for t in range(1, len(s.token_ids))
                                                        if s.loss_mask[t]])).abs() for s, lp in zip(batch, logps)]
    every = torch.cat(gaps) if gaps else torch.zeros(0)
    return float(every.mean()) if every.numel() else 0.0
