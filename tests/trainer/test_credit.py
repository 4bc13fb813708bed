"""Advantages and per-turn credit (loomrl/trainer/credit.py, grpo.py): the format-credit failure of GRPO's std
division reproduced and gone under std_floor and none; per-turn advantages against a hand-computed group of
episodes of different lengths, laid on the right tokens across a restarted context; the per-turn estimator
unbiased on a two-turn MDP whose exact policy gradient is known (and two biased baselines caught by the same
check); outcome GRPO unchanged; the config fields; the zero-variance filter under turn credit."""

from __future__ import annotations

import math
import random

import pytest
import torch

from loomrl.buffer.filters import usable_group
from loomrl.config import ConfigError, TrainerConfig, load_config
from loomrl.reward.calculator import calculator_reward
from loomrl.trainer.credit import AdvantageRule, group_credit, returns_to_go
from loomrl.trainer.grpo import samples_from_group
from loomrl.trainer.losses import compute_advantages
from loomrl.types import ContextSegment, Task, TokenSpan, Trajectory, Turn

PROMPT = [1, 2, 3]


def episode(tid: str, terms: list[dict[str, float]], total: float, *, restart_after: int | None = None,
            acts: list[str] | None = None) -> Trajectory:
    """An episode of len(terms) turns, each 3 sampled tokens then (but the last) a 2-token observation; turn k's own
    reward terms are terms[k]. restart_after=k: the context was started anew after turn k (turns 0..k in a closed
    segment, the rest in a new context whose prompt is the segment's prompt plus one summary token)."""
    turns, ids, contexts = [], list(PROMPT), []
    for k, own in enumerate(terms):
        start = len(ids)
        ids += [10 + 3 * k, 11 + 3 * k, 12 + 3 * k]
        turn = Turn(act=acts[k] if acts else "", act_span=TokenSpan(start=start, end=start + 3),
                    logprobs=[-1.0] * 3, versions=[0] * 3, reward_terms=dict(own))
        if k < len(terms) - 1:
            turn.obs_span = TokenSpan(start=len(ids), end=len(ids) + 2)
            ids += [40 + k, 41 + k]
        turns.append(turn)
        if restart_after == k:
            contexts.append(ContextSegment(reason="summary", prompt_ids=list(PROMPT), token_ids=ids, turns=turns))
            turns, ids = [], [*PROMPT, 99]
    prompt = [*PROMPT, 99] if contexts else list(PROMPT)
    return Trajectory(task_id="t", trajectory_id=tid, group_id="g", prompt_ids=prompt, token_ids=ids, turns=turns,
                      segments=contexts, total_reward=total)


# ---------------------------------------------------------------- normalisation: the format-credit failure


def calculator_episode(tid: str, acts: list[str], final: str, task: Task) -> Trajectory:
    """A calculator episode scored by the demo's reward with the old format credit (0.1 x well-formed turns)."""
    traj = episode(tid, [{} for _ in acts], 0.0, acts=acts)
    traj.final_answer = final
    traj.total_reward = sum(calculator_reward(traj, task, format_weight=0.1).values())
    return traj


def calculator_groups() -> tuple[list[Trajectory], list[Trajectory]]:
    """Eight answers to 3 + 4: all wrong (two well-formed, one half well-formed, five not), and the same group
    with its first answer correct (and well-formed)."""
    task = Task(task_id="t", prompt="Add 3 and 4 (ignore the 9 apples).", answer="7")
    formed, half, loose = ["calc(3 + 5)", "The answer is 8."], ["calc(3 + 5)", "so it is 8"], ["3 and 5", "8?"]
    wrong = [calculator_episode(f"w{i}", acts, "8", task)
             for i, acts in enumerate([formed, formed, half, loose, loose, loose, loose, loose])]
    correct = calculator_episode("c", ["calc(3 + 4)", "The answer is 7."], "7", task)
    return wrong, [correct, *wrong[1:]]


def test_std_floor_and_none_keep_a_small_format_credit_small():
    wrong, mixed = calculator_groups()
    assert [t.total_reward for t in wrong] == pytest.approx([0.1, 0.1, 0.05, 0, 0, 0, 0, 0])
    assert mixed[0].total_reward == pytest.approx(1.1)
    numbers = {}
    for name, overrides in [("std", {}), ("std_floor", {"advantage_norm": "std_floor"}),
                            ("none", {"advantage_norm": "none"})]:
        rule = AdvantageRule.of(TrainerConfig(**overrides))
        formed_wrong = group_credit(wrong, rule).turns[0][0]  # a well-formed wrong answer, all answers wrong
        correct = group_credit(mixed, rule).turns[0][0]  # a correct answer in a mixed group
        numbers[name] = (formed_wrong, correct)
    print({k: (round(a, 4), round(b, 4), round(a / b, 4)) for k, (a, b) in numbers.items()})
    # the failure: GRPO's std (0.043 here) makes a 0.1 format credit as large an advantage as a correct answer's
    formed_wrong, correct = numbers["std"]
    assert formed_wrong > 1.5 and formed_wrong > 0.5 * correct
    # std_floor: the floor (0.2) sets the all-wrong group's scale; the mixed group's std (0.36) is above it, so the
    # correct answer keeps GRPO's full-size advantage exactly
    formed_wrong, correct = numbers["std_floor"]
    assert formed_wrong == pytest.approx(0.06875 / 0.2) and correct == numbers["std"][1]
    assert formed_wrong < 0.15 * correct
    # none (Dr. GRPO): the advantages are the reward differences themselves
    formed_wrong, correct = numbers["none"]
    assert formed_wrong == pytest.approx(0.06875) and correct == pytest.approx(1.1 - 1.25 / 8)
    assert formed_wrong < 0.1 * correct


def test_the_floor_is_counted_and_scales_with_the_reward_range():
    wrong, mixed = calculator_groups()
    rule = AdvantageRule.of(TrainerConfig(advantage_norm="std_floor", std_floor=0.1, reward_range=2.0))
    assert rule.floor == pytest.approx(0.2)
    credit = group_credit(wrong, rule)
    assert credit.floored and credit.scale == pytest.approx(0.2)
    assert not group_credit(mixed, rule).floored


# ---------------------------------------------------------------- outcome credit: GRPO unchanged


def test_outcome_grpo_is_unchanged_bit_for_bit():
    rewards = [1.0, 0.1, 0.05, 0.0, 0.7]
    group = [episode(f"e{i}", [{}] * (1 + i % 3), r) for i, r in enumerate(rewards)]
    for kind in ("grpo", "dr_grpo", "rloo"):
        credit = group_credit(group, AdvantageRule.of(TrainerConfig(advantage=kind)))
        expected = [float(a) for a in compute_advantages(kind, rewards)]
        assert credit.turns == [[a] * len(t.all_turns()) for t, a in zip(group, expected)], kind
    grpo = [float(a) for a in compute_advantages("grpo", rewards)]
    for a, sample in zip(grpo, samples_from_group(group)):  # the default: GRPO, outcome; one context each
        assert sample.advantages == [a * m for m in sample.loss_mask] and a != 0


# ---------------------------------------------------------------- per-turn credit by hand


def hand_group() -> list[Trajectory]:
    """Four episodes of 3, 2, 2 and 1 turns; a -0.1 process term (a failed tool call) on some turns; the outcome on
    the last. a's context was started anew after its first turn."""
    return [episode("a", [{"tool_error": -0.1}, {}, {}], 0.9, restart_after=0),  # turn rewards -0.1, 0, 1.0
            episode("b", [{}, {}], 1.0),  # 0, 1.0
            episode("c", [{"tool_error": -0.1}, {}], -0.1),  # -0.1, 0
            episode("d", [{}], 0.0)]  # 0


def test_turn_credit_by_hand():
    group = hand_group()
    returns = [[0.9, 1.0, 1.0], [1.0, 1.0], [-0.1, 0.0], [0.0]]
    for traj, want in zip(group, returns):
        assert returns_to_go(traj.turn_rewards()) == pytest.approx(want)
    # turn 0, everyone: G_i0 minus the mean of the three others' G_j0
    #   a: 0.9 - (1.0 - 0.1 + 0)/3 = 0.6; b: 1.0 - (0.9 - 0.1 + 0)/3 = 0.7333; c: -0.1 - (0.9 + 1.0 + 0)/3 = -0.7333;
    #   d: 0 - (0.9 + 1.0 - 0.1)/3 = -0.6
    # turn 1, reached by a, b, c: a: 1.0 - (1.0 + 0)/2 = 0.5; b: 1.0 - (1.0 + 0)/2 = 0.5; c: 0 - (1.0 + 1.0)/2 = -1
    # turn 2, a alone: no other reached it, so the others' episode returns: 1.0 - (1.0 - 0.1 + 0)/3 = 0.7
    expected = [[0.6, 0.5, 0.7], [1.0 - 0.8 / 3, 0.5], [-0.1 - 1.9 / 3, -1.0], [-0.6]]
    credit = group_credit(group, AdvantageRule(norm="none", credit="turn"))
    assert credit.fallback_turns == 1 and credit.scale == 1.0
    for got, want in zip(credit.turns, expected):
        assert got == pytest.approx(want, abs=1e-12)
    # std: divided by the std of the eight G_it pooled: 0.9, 1, 1, 1, 1, -0.1, 0, 0 (mean 0.6, variance 0.2425)
    credit = group_credit(group, AdvantageRule(norm="std", credit="turn"))
    assert credit.scale == pytest.approx(math.sqrt(0.2425) + 1e-6, abs=1e-12)
    for got, want in zip(credit.turns, expected):
        assert got == pytest.approx([w / credit.scale for w in want], abs=1e-12)
    # the tokens: each turn's act_span carries its advantage, in the context it was sampled in; the rest 0
    samples = samples_from_group(group, AdvantageRule(norm="none", credit="turn"))
    assert [s.trajectory_id for s in samples] == ["a", "a", "b", "c", "d"]  # a: its closed segment, then the rest
    a0, a1 = samples[0], samples[1]
    assert a0.advantages == pytest.approx([0, 0, 0, 0.6, 0.6, 0.6, 0, 0])  # prompt, turn 0, its observation
    assert a1.advantages == pytest.approx([0, 0, 0, 0, 0.5, 0.5, 0.5, 0, 0, 0.7, 0.7, 0.7])  # new prompt, turns 1, 2
    assert samples[3].advantages == pytest.approx([0, 0, 0, *[-0.1 - 1.9 / 3] * 3, 0, 0, -1, -1, -1])
    for s in samples:
        assert all((a != 0) <= m for a, m in zip(s.advantages, s.loss_mask))  # never on a token not sampled


def test_turn_credit_with_the_outcome_only_and_equal_lengths_is_rloo():
    rewards = [1.0, 0.0, 0.5, 0.0]
    group = [episode(f"e{i}", [{}, {}, {}], r) for i, r in enumerate(rewards)]
    credit = group_credit(group, AdvantageRule(norm="none", credit="turn"))
    rloo = [float(a) for a in compute_advantages("rloo", rewards)]
    assert credit.fallback_turns == 0
    for got, a in zip(credit.turns, rloo):
        assert got == pytest.approx([a] * 3)


# ---------------------------------------------------------------- per-turn credit is unbiased

# A two-turn MDP. Turn 0: stop (the episode ends, reward 0.3) or go (a -0.1 process term, then turn 1: A, reward
# 1, or B, reward 0). The policy decides how many turns it takes. Tabular softmax policy, logits THETA0 and THETA1.
THETA0, THETA1 = [0.0, -0.6], [0.2, -0.3]  # go: p = 0.35; A: p = 0.62
R_STOP, COST, R_A, R_B = 0.3, -0.1, 1.0, 0.0


def exact_gradient() -> torch.Tensor:
    th0 = torch.tensor(THETA0, dtype=torch.float64, requires_grad=True)
    th1 = torch.tensor(THETA1, dtype=torch.float64, requires_grad=True)
    p0, p1 = th0.softmax(0), th1.softmax(0)
    value = p0[0] * R_STOP + p0[1] * (COST + p1[0] * R_A + p1[1] * R_B)
    value.backward()
    return torch.cat([th0.grad, th1.grad])


def sampled_groups(n_groups: int, size: int, seed: int) -> list[list[tuple[list[int], Trajectory]]]:
    """Groups of (actions, episode), the episodes carrying their per-turn rewards as Trajectory does."""
    rng = random.Random(seed)
    p_go, p_a = torch.tensor(THETA0).softmax(0)[1].item(), torch.tensor(THETA1).softmax(0)[0].item()
    groups = []
    for g in range(n_groups):
        group = []
        for i in range(size):
            if rng.random() < p_go:
                a1 = 0 if rng.random() < p_a else 1
                group.append(([1, a1], episode(f"{g}-{i}", [{"cost": COST}, {}], COST + (R_A if a1 == 0 else R_B))))
            else:
                group.append(([0], episode(f"{g}-{i}", [{}], R_STOP)))
        groups.append(group)
    return groups


PROBS = [torch.tensor(theta, dtype=torch.float64).softmax(0).tolist() for theta in (THETA0, THETA1)]


def score(actions: list[int]) -> list[list[float]]:
    """d log pi(a_t) / d (THETA0, THETA1) per turn t: onehot(a_t) - pi in the turn's own two logits, 0 elsewhere."""
    probs = PROBS
    out = []
    for t, a in enumerate(actions):
        row = [0.0] * 4
        row[2 * t : 2 * t + 2] = [float(a == k) - probs[t][k] for k in range(2)]
        out.append(row)
    return out


def estimate(groups, advantages) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-gradient estimate sum_t A_it d log pi(a_it), averaged over each group then over the groups, and its
    standard error (groups are independent; a group's episodes are not, through their baselines)."""
    per_group = []
    for group in groups:
        total = [0.0] * 4
        for (actions, _), adv in zip(group, advantages(group)):
            for a, row in zip(adv, score(actions)):
                total = [x + a * d for x, d in zip(total, row)]
        per_group.append([x / len(group) for x in total])
    per_group = torch.tensor(per_group, dtype=torch.float64)  # [groups, 4]
    return per_group.mean(0), per_group.std(0) / math.sqrt(len(groups))


def including_self(group) -> list[list[float]]:
    """The biased alternative: the baseline of turn t is the mean of G_jt over every episode that reached it,
    this one included (an episode alone at its turn gets no advantage there)."""
    returns = [returns_to_go(t.turn_rewards()) for _, t in group]
    def mean_at(t):
        return sum(r[t] for r in returns if len(r) > t) / sum(len(r) > t for r in returns)
    return [[g - mean_at(t) for t, g in enumerate(r)] for r in returns]


def test_turn_credit_is_unbiased_when_the_policy_picks_the_number_of_turns():
    exact = exact_gradient()
    groups = sampled_groups(6000, 4, seed=0)
    rule = AdvantageRule(norm="none", credit="turn")

    def per_turn(group):
        return group_credit([t for _, t in group], rule).turns

    def divided_by_turns(group):
        return [[a / len(adv) for a in adv] for adv in per_turn(group)]

    got, se = estimate(groups, per_turn)
    print("exact", exact.tolist(), "turn credit", got.tolist(), "se", se.tolist())
    assert float(exact.abs().min()) > 0.02  # every component has something to get right
    assert bool(((got - exact).abs() <= 4 * se).all()), (got, exact, se)
    # the check can fail: a baseline that includes the episode itself, or advantages divided by the episode's number
    # of turns (both depend on the episode's own actions), land many standard errors away from the exact gradient
    for biased in (including_self, divided_by_turns):
        wrong, wrong_se = estimate(groups, biased)
        print(biased.__name__, wrong.tolist())
        assert bool(((wrong - exact).abs() > 8 * wrong_se).any()), biased.__name__


# ---------------------------------------------------------------- config and filters


def test_config_fields_resolve_and_name_a_contradiction():
    assert AdvantageRule.of(TrainerConfig()) == AdvantageRule(kind="grpo", norm="std", floor=0.2, credit="outcome")
    assert AdvantageRule.of(TrainerConfig(advantage="dr_grpo")).norm == "none"  # old configs mean what they meant
    assert AdvantageRule.of(TrainerConfig(advantage="rloo")).norm == "none"
    assert AdvantageRule.of(TrainerConfig(advantage="rloo", advantage_norm="std_floor")).norm == "std_floor"
    cfg = load_config(None, ["trainer.advantage_norm=std_floor", "trainer.std_floor=0.1", "trainer.credit=turn"])
    assert AdvantageRule.of(cfg.trainer) == AdvantageRule(kind="grpo", norm="std_floor", floor=0.1, credit="turn")
    with pytest.raises(ConfigError, match="trainer.advantage_norm=std_floor contradicts trainer.advantage=dr_grpo"):
        load_config(None, ["trainer.advantage=dr_grpo", "trainer.advantage_norm=std_floor"])
    with pytest.raises(ConfigError, match="credit"):
        load_config(None, ["trainer.credit=step"])
    with pytest.raises(ConfigError, match="trainer.credit=turn does not work with trainer.loss.kind=gspo"):
        load_config(None, ["trainer.credit=turn", "trainer.loss.kind=gspo"])
    with pytest.raises(ConfigError, match="std_floor"):
        load_config(None, ["trainer.std_floor=0"])


def test_turn_credit_trains_groups_whose_returns_are_equal_but_whose_turns_differ():
    same_return = [episode("x", [{"tool_error": -0.1}, {}], 1.0), episode("y", [{}, {"tool_error": -0.1}], 1.0)]
    assert usable_group(same_return)[2] == "zero_variance"  # outcome credit: nothing to learn
    kept, _, reason = usable_group(same_return, credit="turn")
    assert reason is None and len(kept) == 2
    turns = group_credit(kept, AdvantageRule(norm="std_floor", floor=0.2, credit="turn")).turns
    assert turns[0][0] == pytest.approx(0.0) and turns[0][1] == pytest.approx(0.1 / 0.2)  # x's turn 1 was better
    identical = [episode("x", [{"tool_error": -0.1}, {}], 1.0), episode("y", [{"tool_error": -0.1}, {}], 1.0)]
    assert usable_group(identical, credit="turn")[2] == "zero_variance"


# ---------------------------------------------------------------- through the trainer service


@pytest.mark.parametrize("tree_merge", ["off", "on"])
def test_turn_credit_through_the_service_with_and_without_tree_merge(tmp_path, tiny_model, tokenizer, tree_merge):
    """The real TrainerService and Trainer on the hand group: the step's metrics show the floor and the fallback,
    and one step moves the weights the same with tree merge on as off (per-token advantages reach the loss either
    way)."""
    import copy

    from loomrl.train_pool.service import TrainerService

    def step(merge: str, name: str):
        cfg = load_config(None, [f"output_dir={tmp_path}", f"name={name}", "model.kind=tiny", "trainer.groups_per_step=1",
                                 "trainer.credit=turn", "trainer.advantage_norm=std_floor", "trainer.std_floor=0.6",
                                 f"trainer.tree_merge={merge}", "trainer.lr=1e-3", "trainer.micro_batch_size=8"])
        cfg.run_dir.mkdir(parents=True)
        model = copy.deepcopy(tiny_model)
        service = TrainerService(cfg.train_pool(), model, tokenizer, device=torch.device("cpu"))
        service.receive(0, hand_group())
        return service.run_step().metrics, model

    metrics, model = step(tree_merge, f"turn-{tree_merge}")
    # the pooled returns' std (0.49) is under the floor (0.6): |A| = |A_none| / 0.6, a mean over equal 3-token turns
    assert metrics["advantage/groups_floored"] == 1 and metrics["advantage/fallback_turns"] == 1
    assert metrics["advantage/scale_mean"] == pytest.approx(0.6)
    by_hand = [0.6, 0.5, 0.7, 1.0 - 0.8 / 3, 0.5, 0.1 + 1.9 / 3, 1.0, 0.6]
    assert metrics["advantage/abs_mean"] == pytest.approx(sum(by_hand) / 8 / 0.6)
    assert metrics["train/loss_tokens"] == 3 * 8
    if tree_merge == "on":
        assert metrics["train/tree_ratio"] > 1.0  # the group's shared prompt was merged
        _, dense = step("off", "turn-dense")
        assert any(not torch.equal(p, q) for p, q in zip(dense.parameters(), tiny_model.parameters()))  # it moved
        for (name, p), q in zip(model.named_parameters(), dense.parameters()):
            assert torch.allclose(p, q, atol=1e-6), name
