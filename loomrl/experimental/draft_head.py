"""Draft heads: small heads over the policy's last hidden state that guess the tokens after the next one, trained on
the policy's own rollouts to agree with the policy (issue 32; Medusa's heads, kept aligned during RL as Forge's
dynamic MTP keeps its MTP heads).

Head k (1..K) reads h_t, the policy's final hidden state (after its last norm) at position t, whose LM-head
distribution is the policy's for token t+1, and gives a distribution for token t+1+k through the policy's own LM head:

    z_k = h_t + SiLU(W_k h_t + b_k),   q_k = softmax(lm_head(z_k) / T)

W_k and b_k start at zero, so an untrained head drafts what the policy predicts next. Its target is the policy's
distribution for that token at the rollout temperature, p = softmax(lm_head(h_{t+k}) / T): what the engine will sample
there. The loss is the total variation between the two, 1/2 sum |p - q|: a draft x ~ q checked with the standard
rejection rule for drafts with probabilities (accept with min(1, p(x)/q(x))) is accepted with probability
1 - TV(p, q). The built-in engine's verifier today treats a draft as a fixed token (accepted with p(x)), under which
a head's argmax is accepted with p(argmax q) <= 1 - TV; drafting from the heads will need the rule with q. Over a
49k-152k vocabulary the TV is taken over the policy's top `top_k` tokens and one bucket for the rest, a lower bound
of the full TV that equals it where the top k hold the policy's mass (so 1 - that is an upper bound).

Rows are processed in chunks of CHUNK, each with its own backward, so that no more than a [CHUNK, vocab] block of
logits is held at once. The hidden states are detached: the policy is not trained through its draft heads.

Not yet in a run: the trainer's step does not train them and the built-in engine does not draft from them. What is
here is the head, its loss and its training step, tested on a policy's own rollouts (tests/experimental/test_draft_head.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Tensor = torch.Tensor

CHUNK = 128  # rows per block: [128, 49k] float32 logits, as the LM head's (trainer/head.py CPU_CHUNK)


class DraftHeads(nn.Module):
    """K residual blocks over the policy's final hidden state; the LM head they feed is the policy's (not owned)."""

    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        if heads < 1:
            raise ValueError(f"draft heads: heads must be at least 1, got {heads}")
        blocks = [nn.Linear(hidden_size, hidden_size) for _ in range(heads)]
        for block in blocks:  # an untrained head is the identity: it drafts the policy's next token
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)

    @property
    def heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: Tensor, k: int) -> Tensor:
        """Head k's (1-based) hidden state for rows `hidden` [N, H]: feed it to the policy's LM head."""
        return hidden + nn.functional.silu(self.blocks[k - 1](hidden))


@dataclass(frozen=True, slots=True)
class Divergence:
    """Per head (index k-1): the mean top-k total variation to the policy over the rows, and how many rows."""

    tv: list[float]
    rows: list[int]

    @property
    def acceptance(self) -> list[float]:
        """Each head's acceptance of a draft sampled from it under the standard rejection rule with its probabilities,
        1 - TV; an upper bound, the TV being the top-k lower bound."""
        return [1.0 - t for t in self.tv]


def _kept(positions: Tensor, k: int) -> Tensor:
    """The t in `positions` (sorted, unique) with t+1 .. t+k all in it too: the target is then a distribution the
    policy sampled from in the same stretch of its own tokens (the engine drafts within a turn: never across an
    observation, nor past the end)."""
    if positions.numel() <= k:
        return positions[:0]
    return positions[:-k][positions[k:] == positions[:-k] + k]


def _pairs(hidden: Tensor, positions: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The (input, target) hidden rows of head k (_kept)."""
    keep = _kept(positions, k)
    return hidden[keep], hidden[keep + k]


def _lm_head(lm_head: nn.Linear, z: Tensor) -> Tensor:
    """The policy's LM head on `z`, its weights detached: the heads train, the policy's head (tied to its input
    embeddings, perhaps) never gets a gradient here, and no flag of the policy's is touched."""
    weight = lm_head.weight.detach()
    bias = lm_head.bias.detach() if lm_head.bias is not None else None
    return nn.functional.linear(z.to(weight.dtype), weight, bias)


def topk_tv(head_logits: Tensor, policy_logits: Tensor, temperature: float, top_k: int) -> Tensor:
    """Per row: 1/2 (sum over the policy's top_k tokens of |p - q| + |p(rest) - q(rest)|), p the policy's and q the
    head's softmax at `temperature`, in float32."""
    p = torch.softmax(policy_logits.float() / temperature, dim=-1)
    q = torch.softmax(head_logits.float() / temperature, dim=-1)
    p_top, idx = p.topk(min(top_k, p.shape[-1]), dim=-1)
    q_top = q.gather(-1, idx)
    rest = (p_top.sum(-1) - q_top.sum(-1)).abs()  # |(1 - sum p_top) - (1 - sum q_top)|
    return 0.5 * ((p_top - q_top).abs().sum(-1) + rest)


def _rows(heads: DraftHeads, lm_head: nn.Linear, hidden: Tensor, positions: Tensor, k: int):
    """Head k's chunks: (head logits, policy logits) per CHUNK rows; the policy's side without a graph."""
    inputs, targets = _pairs(hidden, positions, k)
    dtype = next(heads.parameters()).dtype
    for i in range(0, inputs.shape[0], CHUNK):
        with torch.no_grad():
            policy = _lm_head(lm_head, targets[i : i + CHUNK])
        yield _lm_head(lm_head, heads(inputs[i : i + CHUNK].to(dtype), k)), policy


def divergence(heads: DraftHeads, lm_head: nn.Linear, sequences: list[tuple[Tensor, Tensor]], *,
               temperature: float = 1.0, top_k: int = 64) -> Divergence:
    """Each head's mean top-k TV to the policy over `sequences`: (final hidden states [L, H], the positions t whose
    next tokens the policy sampled, as a LongTensor: a TrainingSample's sampled positions less one)."""
    tv, rows = [0.0] * heads.heads, [0] * heads.heads
    with torch.no_grad():
        for hidden, positions in sequences:
            for k in range(1, heads.heads + 1):
                for head_logits, policy in _rows(heads, lm_head, hidden.detach(), positions, k):
                    tv[k - 1] += float(topk_tv(head_logits, policy, temperature, top_k).sum())
                    rows[k - 1] += head_logits.shape[0]
    return Divergence(tv=[t / max(n, 1) for t, n in zip(tv, rows)], rows=rows)


def train_step(heads: DraftHeads, lm_head: nn.Linear, optimizer: torch.optim.Optimizer,
               sequences: list[tuple[Tensor, Tensor]], *, temperature: float = 1.0, top_k: int = 64) -> float:
    """One optimizer step of the heads on `sequences` (as `divergence` takes them): the mean top-k TV over every
    head's rows, each chunk's backward run as it is made. The LM head is the policy's and gets no gradient. Returns
    the loss before the step."""
    total = sum(int(_kept(positions, k).numel()) for _, positions in sequences for k in range(1, heads.heads + 1))
    if total == 0:
        return 0.0
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for hidden, positions in sequences:
        for k in range(1, heads.heads + 1):
            for head_logits, policy in _rows(heads, lm_head, hidden.detach(), positions, k):
                loss = topk_tv(head_logits, policy, temperature, top_k).sum() / total
                loss.backward()
                loss_sum += float(loss.detach())
    optimizer.step()
    return loss_sum
