"""Speculative decoding in the built-in engine: how many draft tokens each sequence verifies in a step, and the
rule that accepts them without changing what is sampled.

A decoding sequence normally feeds one token per step. With a draft of k tokens (drafter.py) it feeds its last token
and the k drafts; the step's one flattened forward (runner.py) returns the logits of all k + 1 positions, and
`verify` emits between 1 and k + 1 tokens by sampling each position as decoding would and comparing: y_j is drawn from
p_j (the distribution after the j-th fed token, temperature, top-k and top-p applied first: sampling.py distributions;
greedy: its argmax) with the sequence's next uniform, and the drafts are accepted while y_j equals them; the first y_j
that differs, or y_k after k acceptances, is the last token emitted. The emitted tokens are then exactly those that
decoding one token at a time would draw with the same uniforms (each y_j ~ p_j given the tokens before it), so the
distribution is unchanged; a draft x is accepted with probability p(x), on rejection the token is distributed as p
without x renormalised, which is the standard rejection rule (Leviathan et al. 2023) for a draft with no
probabilities of its own (a point mass). The uniform of the token at sequence position p is its request's seed's at
p (seeds.py uniform_at), whoever drafted, so a request draws the same tokens with speculation on or off (up to float
rounding: the logits come from other batch shapes). Each emitted token's logprob is log p(token) and its version the step's.

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
from loomrl.seeds import uniform_at


@dataclass(slots=True)
class Verified:
    """What one sequence emits from a step: tokens, their logprobs, how many of its drafts were accepted."""

    tokens: list[int]
    logprobs: list[float]
    accepted: int


def verify(logits: torch.Tensor, params: list, drafts: list[list[int]],
           streams: list[tuple[int, int]]) -> list[Verified]:
    """Accept or reject each sequence's drafts. logits: [sum(1 + len(draft)), V], a sequence's 1 + k rows in order
    (row j: the distribution after its j-th fed token); params and streams: one per sequence, a stream being (its
    seed, the sequence position of the token its first row samples): row j draws with uniform_at(seed, position + j)."""
    sizes = [1 + len(d) for d in drafts]
    row_params = [p for p, n in zip(params, sizes) for _ in range(n)]
    logprobs, greedy = distributions(logits, row_params)
    uniforms = torch.tensor([uniform_at(seed, at + j) for (seed, at), n in zip(streams, sizes) for j in range(n)],
                            dtype=torch.float32, device="cpu")  # the default device may be another
    drawn = draw(logprobs, greedy, uniforms)
    lps = logprobs.gather(1, drawn.unsqueeze(1)).squeeze(1).tolist()
    drawn_ids = drawn.tolist()
    result, at = [], 0
    for d in drafts:
        a = 0
        while a < len(d) and drawn_ids[at + a] == d[a]:
            a += 1
        result.append(Verified(drawn_ids[at : at + a + 1], lps[at : at + a + 1], a))
        at += len(d) + 1
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
    """Recent acceptance: the chance that a draft token is accepted given the ones before it were (accepted drafts
    over accept tests, each rejection ending a test run), decayed, and read against a prior (a sequence's: the
    engine's overall acceptance, so a new sequence of a policy whose drafts are accepted is not held back by a fixed
    guess)."""

    accepted: float = 0.0
    tests: float = 0.0
    PRIOR = 0.6  # the engine's own prior, before any draft was verified: drafting is tried
    decay: float = 0.8  # per step
    PRIOR_WEIGHT = 2.0

    def rate(self, prior: float = PRIOR) -> float:
        return (self.accepted + prior * self.PRIOR_WEIGHT) / (self.tests + self.PRIOR_WEIGHT)

    def update(self, drafted: int, accepted: int) -> None:
        """After a step: `drafted` tokens verified (0: none sent), `accepted` of them. A step without drafts decays
        the evidence toward the prior, so a sequence whose early drafts failed is tried again later."""
        self.accepted = self.accepted * self.decay + accepted
        self.tests = self.tests * self.decay + accepted + (1 if accepted < drafted else 0)


class DraftPolicy:
    """How many of its proposed draft tokens each sequence sends this step."""

    def __init__(self, cost: StepCost):
        self.cost = cost
        # every sequence's drafts: the prior of each sequence's own rate (decays slower: it pools many sequences)
        self.overall = Acceptance(decay=0.98)

    def rate(self, own: Acceptance) -> float:
        """A sequence's acceptance: its own evidence over the engine's overall rate."""
        return own.rate(self.overall.rate())

    def verified(self, own: Acceptance, drafted: int, accepted: int) -> None:
        own.update(drafted, accepted)
        if drafted:
            self.overall.update(drafted, accepted)

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
