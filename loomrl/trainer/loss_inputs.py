"""From a micro-batch's samples (and the logprobs its forwards computed) to the policy loss's typed inputs
(losses.py LossInputs): the engine's logprobs and the advantages at the trained tokens, each token's sequence and chunk
(turn) ids; and the loss config of a step, whose denominators are the whole step's.

Pure: no model, no optimizer. What it is not: the loss itself (losses.py) or how the step is cut (step_plan.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loomrl.config import LossConfig
from loomrl.trainer.losses import LossInputs
from loomrl.trainer.tree import sampled_positions
from loomrl.types import TrainingSample


@dataclass(slots=True, kw_only=True)
class MicroBatchInputs:
    """One micro-batch's loss inputs, and which of its samples they cover: `samples` are the positions in the
    micro-batch of those with trained tokens (the others contribute none), in the order of the tokens, and `counts`
    each one's number of trained tokens, to split a per-token result back per sample."""

    loss: LossInputs
    samples: list[int]
    counts: list[int]


def chunk_ids(positions: Sequence[Sequence[int]]) -> list[int]:
    """Per trained token, its chunk (from 0, in order): a chunk is one turn, a run of sampled tokens between two
    environment interactions. `positions`: per sequence, its trained tokens' positions (increasing); a chunk starts
    at each sequence's first one and after every gap (an observation or a prompt in between)."""
    ids, c = [], -1
    for ts in positions:
        for j, t in enumerate(ts):
            c += j == 0 or t != ts[j - 1] + 1
            ids.append(c)
    return ids


def loss_inputs(batch: Sequence[TrainingSample], logps: Sequence[torch.Tensor], *,
                prox: Sequence[torch.Tensor] | None = None, ref: Sequence[torch.Tensor] | None = None,
                num_seqs: int, device: torch.device) -> MicroBatchInputs | None:
    """The loss inputs of micro-batch `batch` given each sample's logprobs at its trained tokens (logps[i], [n_i]) and,
    where the loss uses them, the proximal (`prox`) and reference (`ref`) policies' (same shapes); None when no sample
    has a trained token. Sequence and chunk ids are unique within the micro-batch (the loss sees one at a time);
    `num_seqs` is the step's number of sequences (a sequence mean's denominator)."""
    parts = [i for i, logp in enumerate(logps) if logp.numel()]
    if not parts:
        return None
    idx = [sampled_positions(batch[i]) for i in parts]
    behaviour = torch.tensor([batch[i].behaviour_logprobs[t] for i, ts in zip(parts, idx) for t in ts], device=device)
    adv = torch.tensor([batch[i].advantages[t] for i, ts in zip(parts, idx) for t in ts], device=device)
    seq_ids = torch.tensor([k for k, ts in enumerate(idx) for _ in ts], device=device)
    loss = LossInputs(logp=torch.cat([logps[i] for i in parts]), old_logp=behaviour, advantages=adv, seq_ids=seq_ids,
                      chunk_ids=torch.tensor(chunk_ids(idx), device=device),
                      prox_logp=torch.cat([prox[i] for i in parts]) if prox is not None else None,
                      ref_logp=torch.cat([ref[i] for i in parts]) if ref is not None else None, num_seqs=num_seqs)
    return MicroBatchInputs(loss=loss, samples=parts, counts=[len(ts) for ts in idx])


def step_loss_config(loss: LossConfig, samples: Sequence[TrainingSample], *, idle_tokens: int = 0, idle_seqs: int = 0,
                     idle_longest: int = 0, with_ref: bool = True) -> LossConfig:
    """trainer.loss for one step over `samples`: its aggregation's denominator is the whole step's, idle (zero-signal)
    tokens and sequences included (Trainer.train_step), and without a reference model (`with_ref` False) there is no
    KL term."""
    if loss.aggregation == "token_mean":  # sum / the step's sampled tokens
        aggregation, norm = "token_sum_norm", float(sum(sum(s.loss_mask) for s in samples) + idle_tokens)
    else:
        aggregation = loss.aggregation
        longest = max([idle_longest, *(sum(s.loss_mask) for s in samples)])
        norm = loss.norm_constant or float(longest * (len(samples) + idle_seqs))
    return loss.model_copy(update={"aggregation": aggregation, "norm_constant": norm, **(
        {} if with_ref else {"kl": None, "kl_coef": 0.0})})
