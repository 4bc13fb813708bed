"""Speculative decoding in the built-in engine: how many draft tokens each sequence verifies in a step, and the
rule that accepts them without changing what is sampled.

A decoding sequence normally feeds one token per step. With a draft of k tokens (drafter.py) it feeds its last token
and the k drafts; the step's one flattened forward (runner.py) returns the logits of all k + 1 positions, and
`verify` emits between 1 and k + 1 tokens:
- greedy: a draft is accepted while it equals the argmax; the first mismatch emits the argmax instead. The tokens are
  those decoding one at a time would emit.
- sampled (T > 0): the drafts carry no probabilities (a draft is one token, q = a point mass), so the standard
  rejection rule (Leviathan et al. 2023; Chen et al. 2023) reduces to: accept draft x with probability p(x); on
  rejection emit a token drawn from p with x removed and the rest renormalised; after k acceptances draw one more from
  the last position's p. Each emitted token is distributed as p exactly (P(x) = p(x) + (1 - p(x)) * 0 for x, and
  (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for y != x), p being the distribution decoding would sample from: temperature,
  top-k and top-p applied first (sampling.py distributions).
Each emitted token's logprob is log p(token) and its version the step's: what decoding without drafts records.

How many drafts pay (`DraftPolicy`): a step costs about a + b * n seconds for n tokens (fitted online from this
engine's own decode steps); a draft token j deep in a sequence whose drafts are accepted with probability alpha each
yields alpha^j tokens in expectation. Drafts are added, best first, while they raise the step's expected tokens per
second. Where a step is compute-bound (a small against b * n) no draft pays and none is sent; where it is
memory-bound (small batches, the tail of a GRPO step) drafts fill it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from loomrl.engine.builtin.sampling import distributions, draw


@dataclass(slots=True)
class Verified:
    """What one sequence emits from a step: tokens, their logprobs, how many of its drafts were accepted."""

    tokens: list[int]
    logprobs: list[float]
    accepted: int


def verify(logits: torch.Tensor, params: list, drafts: list[list[int]],
           generators: list[torch.Generator]) -> list[Verified]:
    """Accept or reject each sequence's drafts. logits: [sum(1 + len(draft)), V], a sequence's 1 + k rows in order
    (row j: the distribution after its j-th fed token); params and generators: one per sequence. Each sequence draws
    k + 1 uniforms from its generator: one per draft's accept test, one for the token drawn after."""
    sizes = [1 + len(d) for d in drafts]
    row_params = [p for p, n in zip(params, sizes) for _ in range(n)]
    logprobs, greedy = distributions(logits, row_params)
    uniforms = [torch.rand(n, generator=g, device="cpu").tolist() for g, n in zip(generators, sizes)]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    draft_rows = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    p_draft: list[float] = []
    best: list[int] = []
    if draft_rows:
        rows = torch.tensor(draft_rows, dtype=torch.long, device=logits.device)
        toks = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=logits.device)
        p_draft = logprobs[rows, toks].exp().tolist()
        best = logprobs[rows].argmax(dim=-1).tolist()
    # Per sequence: how many drafts it accepts, then the row its last token is drawn from (and the token to exclude).
    out_rows, excluded, accepted, at = [], [], [], 0
    greedy_rows = greedy.tolist()
    for seq_i, d in enumerate(drafts):
        g = greedy_rows[starts[seq_i]]
        a = 0
        while a < len(d):
            ok = best[at + a] == d[a] if g else uniforms[seq_i][a] < p_draft[at + a]
            if not ok:
                break
            a += 1
        accepted.append(a)
        out_rows.append(starts[seq_i] + a)
        excluded.append(d[a] if a < len(d) and not g else -1)  # greedy: the argmax is never the rejected draft
        at += len(d)
    rows = torch.tensor(out_rows, dtype=torch.long, device=logits.device)
    last_u = torch.tensor([u[-1] for u in uniforms], dtype=torch.float32, device="cpu")
    last = draw(logprobs[rows], greedy[rows], last_u,
                exclude=torch.tensor(excluded, dtype=torch.long, device=logits.device)).tolist()
    emitted = [[*d[:a], tok] for d, a, tok in zip(drafts, accepted, last)]
    rows = torch.tensor([s + j for s, toks in zip(starts, emitted) for j in range(len(toks))], dtype=torch.long,
                        device=logits.device)
    flat = torch.tensor([t for toks in emitted for t in toks], dtype=torch.long, device=logits.device)
    lps, result = logprobs[rows, flat].tolist(), []
    for toks, a in zip(emitted, accepted):
        result.append(Verified(toks, lps[: len(toks)], a))
        lps = lps[len(toks) :]
    return result


class StepCost:
    """Seconds of a decode step as a + b * tokens, fitted by least squares over recent steps (older ones weigh less)."""

    DECAY = 0.98

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.steps = 0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self.w, self.x, self.y = self.w * d + 1, self.x * d + tokens, self.y * d + seconds
        self.xx, self.xy = self.xx * d + tokens * tokens, self.xy * d + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the steps seen do not tell them apart (too few, or all of one size)."""
        if self.steps < 8:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:
            return None
        b = max((self.xy / self.w - mx * my) / var, 1e-9)
        return max(my - b * mx, 0.0), b


@dataclass(slots=True)
class Acceptance:
    """A sequence's recent acceptance: the chance that a draft token is accepted given the ones before it were
    (accepted drafts over accept tests, each rejection ending a test run), with a prior and a decay."""

    accepted: float = 0.0
    tests: float = 0.0
    PRIOR = 0.6  # before any evidence: drafting is tried
    PRIOR_WEIGHT = 2.0
    DECAY = 0.8

    @property
    def rate(self) -> float:
        return (self.accepted + self.PRIOR * self.PRIOR_WEIGHT) / (self.tests + self.PRIOR_WEIGHT)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted = self.accepted * self.DECAY + accepted
        self.tests = self.tests * self.DECAY + accepted + (1 if accepted < drafted else 0)


class DraftPolicy:
    """How many of its proposed draft tokens each sequence sends this step."""

    def __init__(self, cost: StepCost):
        self.cost = cost

    def worth_drafting(self, emitted: int, tokens: int, best_rate: float) -> bool:
        """Whether a first draft token accepted with probability `best_rate` (the best of the step's sequences) would
        raise the step's tokens per second; when not, no draft is looked up at all (compute-bound steps)."""
        fit = self.cost.fit()
        if fit is None:
            return True
        a, b = fit
        return best_rate * (a + b * tokens) > b * emitted

    def allocate(self, emitted: int, tokens: int, proposals: list[tuple[int, float]]) -> list[int]:
        """emitted: tokens the step samples without drafts (one per decoding sequence and per finished prefill);
        tokens: tokens it computes without drafts; proposals: per decoding sequence, (draft tokens available,
        acceptance rate). Returns how many to send, per proposal."""
        take = [0] * len(proposals)
        fit = self.cost.fit()
        if fit is None:  # still learning the step's cost: send every draft (varied step sizes teach the fit)
            return [n for n, _ in proposals]
        a, b = fit
        expected, seconds = float(emitted), a + b * tokens
        # a max-heap of the next draft token's expected yield per sequence: alpha^(j+1)
        heap = [(-alpha, i) for i, (n, alpha) in enumerate(proposals) if n > 0 and alpha > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain * seconds <= b * expected:  # (E + g) / (C + b) <= E / C: this token and all after cost more
                break
            take[i] += 1
            expected, seconds = expected + gain, seconds + b
            if take[i] < proposals[i][0]:
                heapq.heappush(heap, (-gain * proposals[i][1], i))
        return take
