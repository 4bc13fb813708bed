"""`loomrl compare` (loomrl/compare/): decisions on synthetic arms with known effects, the plan fixed before any run
(extensions after looking refused, planned looks honoured), and a real comparison of two identical arms of the tiny
recipe, which common random numbers make identical seed by seed."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from loomrl.cli import main
from loomrl.compare.plan import ComparePlan, PlanError, fix_plan
from loomrl.compare.runner import Measured, analyse, run_comparison, run_folders
from loomrl.compare.stats import BETTER, EQUIVALENT, UNDECIDED, WORSE, difference, seeds_needed
from loomrl.store import read_trajectories

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "examples" / "calculator_tiny.yaml")


def _plan(n=10, looks=(), arms=("base", "new"), margin=0.05):
    return ComparePlan(recipe=RECIPE, arms={a: [] for a in arms}, metric="heldout_templates", margin=margin,
                       seeds=list(range(n)), looks=list(looks))


def _synthetic(effect: float, sd_seed: float, sd_pair: float, calls: list | None = None):
    """Arms whose metric on seed s is a shared seed effect (what common random numbers cancel) plus, for the new arm,
    `effect` and its own noise: the baseline gets seed noise only."""
    def run(arm: str, overrides: list[str]) -> float:
        seed = int(next(o for o in overrides if o.startswith("seed="))[5:])
        if calls is not None:
            calls.append((arm, seed))
        shared = random.Random(seed).gauss(0.6, sd_seed)
        own = random.Random(f"{arm}:{seed}").gauss(0, sd_pair) if arm != "base" else 0.0
        return Measured(shared + (effect + own if arm != "base" else 0.0))
    return run


@pytest.mark.parametrize(("effect", "sd_pair", "n", "expected"), [
    (0.10, 0.03, 10, BETTER),  # a true gain of 0.1, twice the margin
    (-0.10, 0.03, 10, WORSE),
    (0.0, 0.01, 10, EQUIVALENT),  # a true equivalence, measured tightly enough
    (0.05, 0.20, 3, UNDECIDED),  # underpowered: 3 seeds at this spread cannot tell
])
def test_synthetic_arms_are_decided_as_their_known_effect_says(tmp_path, effect, sd_pair, n, expected):
    report = run_comparison(_plan(n), tmp_path, _synthetic(effect, 0.1, sd_pair), progress=lambda _: None)
    (d,) = report.differences
    assert d.decision == expected, d
    assert d.low <= effect <= d.high  # the interval covers the truth
    assert (tmp_path / "report.md").read_text().count(expected) == 1
    assert json.loads((tmp_path / "report.json").read_text())["differences"][0]["decision"] == expected


def test_a_spread_of_zero_is_taken_as_the_metrics_resolution():
    """Success rates over 150 tasks move in steps of 1/150; three pairs that all differ by the same step have a sample
    spread of 0, which is no certainty: the interval is as wide as one step's spread makes it."""
    same = difference("new", "base", [0.62, 0.71, 0.55], [0.6133, 0.7033, 0.5433], confidence=0.95, margin=0.05,
                      resolution=1 / 150)
    assert same.stderr == pytest.approx((1 / 150) / 3**0.5) and same.high - same.low > 0.02
    identical = difference("new", "base", [0.6, 0.7, 0.5], [0.6, 0.7, 0.5], confidence=0.95, margin=0.05,
                           resolution=1 / 150)
    assert identical.mean == 0 and identical.decision == EQUIVALENT


def test_pairing_cancels_what_the_seeds_share():
    """Seed effects of sd 0.1 dwarf a 0.1 gain between independent runs, but not between pairs."""
    base = [random.Random(s).gauss(0.6, 0.1) for s in range(8)]
    new = [b + 0.1 + random.Random(f"n{s}").gauss(0, 0.02) for s, b in enumerate(base)]
    paired = difference("new", "base", new, base, confidence=0.95, margin=0.05)
    assert paired.decision == BETTER and paired.stderr < 0.01
    shuffled = difference("new", "base", new, base[1:] + base[:1], confidence=0.95, margin=0.05)  # pairs broken
    assert shuffled.stderr > 3 * paired.stderr


def test_the_error_rates_are_those_planned():
    """500 null comparisons (no true difference) at n = 5: 'better' or 'worse' in at most 5% (+ 3 binomial SE); and
    with a true gain of 2 paired SDs at the seeds seeds_needed says, 'better' in at least 80% (- 3 SE)."""
    wrong = 0
    for trial in range(500):
        rng = random.Random(trial)
        base = [rng.gauss(0.6, 0.1) for _ in range(5)]
        new = [b + rng.gauss(0, 0.05) for b in base]
        wrong += difference("n", "b", new, base, confidence=0.95, margin=0.01).decision in (BETTER, WORSE)
    assert wrong / 500 <= 0.05 + 3 * (0.05 * 0.95 / 500) ** 0.5
    n = seeds_needed(0.05, 0.05)
    assert 8 <= n <= 12  # effect = 1 SD: about 10 pairs for 80% power
    hits = 0
    for trial in range(300):
        rng = random.Random(10_000 + trial)
        diffs = [0.05 + rng.gauss(0, 0.05) for _ in range(n)]
        hits += difference("n", "b", diffs, [0.0] * n, confidence=0.95, margin=0.001).decision == BETTER
    assert hits / 300 >= 0.8 - 3 * (0.8 * 0.2 / 300) ** 0.5


def test_adding_seeds_after_looking_is_refused_and_a_planned_look_stops_early(tmp_path):
    fix_plan(tmp_path / "a", _plan(5))
    with pytest.raises(PlanError, match="adding seeds after looking at the results is refused.*--first-seed 5"):
        fix_plan(tmp_path / "a", _plan(8))
    with pytest.raises(PlanError, match="margin"):
        fix_plan(tmp_path / "a", _plan(5, margin=0.1))
    assert fix_plan(tmp_path / "a", _plan(5)) == _plan(5)  # the same plan resumes
    calls: list = []
    plan = fix_plan(tmp_path / "b", _plan(10, looks=[4]))
    report = run_comparison(plan, tmp_path / "b", _synthetic(0.2, 0.1, 0.02, calls), progress=lambda _: None)
    assert report.stopped_early and report.look == 4 and len(calls) == 8  # 4 seeds x 2 arms, not 10
    assert report.differences[0].decision == BETTER
    assert report.differences[0].confidence == pytest.approx(1 - 0.05 / 2)  # alpha split over 2 looks
    three = ComparePlan(recipe=RECIPE, arms={"a": [], "b": [], "c": []}, metric="heldout", margin=0.05,
                        seeds=[0, 1, 2, 3], looks=[3])
    assert three.look_confidence == pytest.approx(1 - 0.05 / 4)  # ... and over 2 arms compared with the baseline
    undecided = analyse(plan, {"base": [0.5, 0.6, 0.4, 0.5], "new": [0.6, 0.5, 0.5, 0.4]}, 4)
    assert undecided.differences[0].decision == UNDECIDED


def test_a_bad_plan_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(PlanError, match="at least two arms"):
        ComparePlan(recipe=RECIPE, arms={"a": []}, metric="heldout", margin=0.05, seeds=[0, 1, 2])
    with pytest.raises(PlanError, match="at least 3 distinct seeds"):
        _plan(2)
    (tmp_path / "x" / "base-seed0").mkdir(parents=True)
    (tmp_path / "x" / "base-seed0" / "config.yaml").write_text("name: x\n")
    with pytest.raises(PlanError, match="holds runs but no plan.json"):  # a plan deleted to start over
        fix_plan(tmp_path / "x", _plan(5))
    fix_plan(tmp_path / "y", replace(_plan(5), loomrl="0.1.0 abc"))
    with pytest.raises(PlanError, match="fixed under loomrl '0.1.0 abc'"):
        fix_plan(tmp_path / "y", replace(_plan(5), loomrl="0.1.0 def"))
    with pytest.raises(PlanError, match="--looks"):
        _plan(5, looks=[7])
    with pytest.raises(PlanError, match="--margin"):
        _plan(5, margin=0)


def test_identical_arms_of_the_tiny_recipe_give_identical_results(tmp_path, capsys):
    """Two arms with the same settings, 3 seeds each, one sync step: common random numbers make every pair identical
    (the difference is exactly 0: equivalent within a margin of 0.5, since 6 tasks a split measure in steps of 1/6); the
    same command then reads the finished runs; more seeds are refused."""
    out = tmp_path / "cmp"
    argv = ["compare", RECIPE, "--arm", "base", "--arm", "same", "runtime.mode=sync", "--metric", "heldout",
            "--margin", "0.5", "--seeds", "3", "--out", str(out), "--set", "trainer.total_steps=1",
            "eval.n_tasks=6", "progress=false", "reward.function=rewards_for_tests:parity_reward",
            "runtime.mode=sync"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["values"]["base"] == report["values"]["same"]
    (d,) = report["differences"]
    assert d["mean"] == 0 and d["decision"] == EQUIVALENT
    episodes = {}
    for seed in (0, 1):  # the same episodes, seed by seed; other seeds, other episodes
        base, same = (sorted((r["position"], r["token_ids"], r["total_reward"])
                             for r in read_trajectories(out / f"{arm}-seed{seed}" / "trajectories").to_pylist())
                      for arm in ("base", "same"))
        assert base == same and base
        episodes[seed] = base
    assert episodes[0] != episodes[1]
    assert run_folders(out) == [out / f"{a}-seed{s}" for a in ("base", "same") for s in (0, 1, 2)]  # loomrl view OUT
    capsys.readouterr()
    assert main(argv) == 0  # resumed: nothing to run, the same report
    assert "equivalent" in capsys.readouterr().out
    assert main([*argv[:-1], "runtime.mode=sync", "--seeds", "4"]) == 2
    assert "adding seeds after looking" in capsys.readouterr().err
