"""Filters applied to a group before it becomes training samples (`buffer.filters` picks them; every
trajectory left out is counted by reason in the ledger, and stays in the trajectory store).

- complete: trajectories that ended in `env_error`, `engine_error` or `timeout` are not the policy's doing; they are
  left out of the advantage computation. With `buffer.drop_truncated`, trajectories cut by the turn or
  context budget are left out too.
- repetitive: a trajectory whose sampled tokens repeat one n-gram more than `max_repeats` times is a
  degenerate loop; training on it mostly teaches the loop's tokens.
- near_duplicate: within a group, a trajectory whose actions share at least `threshold` of their n-grams
  (Jaccard) with an earlier kept one adds no new comparison to the group: one copy is kept.
- reward failed (always): a trajectory whose reward function raised (or whose reward worker kept
  dying) has no reward; it is left out rather than trained as if it had scored zero.
- zero variance (always): a group whose rewards are all equal has zero advantage everywhere; training
  on it costs a forward/backward for no gradient, so it is skipped. Under per-turn credit (`trainer.credit: turn`)
  the rewards compared are each episode's per-turn rewards (Trajectory.turn_rewards): episodes with the same return
  may still differ turn by turn, and then their turns' advantages do.
- balance (batch level, `balance_samples`): when positive-advantage samples outnumber negative ones (or
  the reverse) by more than `max_ratio`, the majority is subsampled (seeded) to that ratio.
"""

from __future__ import annotations

import random
from collections import Counter

from loomrl.config import BufferConfig, CreditKind
from loomrl.types import UNSCORED, RolloutStatus, TrainingSample, Trajectory


def _sampled(t: Trajectory) -> list[int]:
    return [tok for ctx in t.contexts() for tok, m in zip(ctx.token_ids, ctx.sampled_mask()) if m]


def _ngrams(tokens: list[int], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def is_repetitive(t: Trajectory, n: int = 4, max_repeats: int = 8) -> bool:
    grams = _ngrams(_sampled(t), n)
    return bool(grams) and max(grams.values()) > max_repeats


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def usable_group(group: list[Trajectory], cfg: BufferConfig | None = None, credit: CreditKind = "outcome",
                 ) -> tuple[list[Trajectory], dict[str, list[str]], str | None]:
    """The trainable part of a group under the buffer's filters (buffer.filters, drop_truncated, ngram,
    max_repeats, duplicate_threshold), the trajectory ids left out by reason, and why nothing of the
    group can be trained (None when something can). `credit` (trainer.credit) says which rewards must differ."""
    cfg = cfg or BufferConfig()
    out: dict[str, list[str]] = {}
    kept = [t for t in group if any(t.all_turns())]
    out["reward_failed"] = [t.trajectory_id for t in kept if t.reward_failed]
    kept = [t for t in kept if not t.reward_failed]
    if "complete" in cfg.filters:
        bad = UNSCORED | {RolloutStatus.TRUNCATED} if cfg.drop_truncated else UNSCORED
        out["incomplete"] = [t.trajectory_id for t in kept if t.status in bad]
        kept = [t for t in kept if t.status not in bad]
    if "repetitive" in cfg.filters:
        out["repetitive"] = [t.trajectory_id for t in kept if is_repetitive(t, cfg.ngram, cfg.max_repeats)]
        kept = [t for t in kept if t.trajectory_id not in out["repetitive"]]
    if "near_duplicate" in cfg.filters:
        unique: list[tuple[Trajectory, set]] = []
        out["near_duplicate"] = []
        for t in kept:
            grams = set(_ngrams(_sampled(t), cfg.ngram))
            if any(_jaccard(grams, g) >= cfg.duplicate_threshold for _, g in unique):
                out["near_duplicate"].append(t.trajectory_id)
            else:
                unique.append((t, grams))
        kept = [t for t, _ in unique]
    out = {k: v for k, v in out.items() if v}
    if len(kept) < 2:
        return [], out, "incomplete"
    if len({_rewards_key(t, credit) for t in kept}) == 1:
        return [], out, "zero_variance"
    return kept, out, None


def _rewards_key(t: Trajectory, credit: CreditKind) -> tuple[float, ...]:
    """What must differ between a group's trajectories for any of their advantages to be non-zero."""
    rewards = t.turn_rewards() if credit == "turn" else [t.total_reward]
    return tuple(round(r, 9) for r in rewards)


def balance_samples(samples: list[TrainingSample], max_ratio: float, seed: int = 0) -> tuple[list[TrainingSample], int]:
    """Subsample the majority sign of advantage to at most `max_ratio` x the minority; (kept, dropped)."""
    sign = [max(s.advantages, key=abs, default=0.0) for s in samples]
    pos = [s for s, a in zip(samples, sign) if a > 0]
    neg = [s for s, a in zip(samples, sign) if a < 0]
    rest = [s for s, a in zip(samples, sign) if a == 0]
    rng = random.Random(seed)
    big, small = (pos, neg) if len(pos) >= len(neg) else (neg, pos)
    cap = max(int(max_ratio * len(small)), 1) if small else len(big)
    if len(big) <= cap:
        return samples, 0
    keep = {id(s) for s in rng.sample(big, cap)} | {id(s) for s in small} | {id(s) for s in rest}
    kept = [s for s in samples if id(s) in keep]
    return kept, len(samples) - len(kept)
