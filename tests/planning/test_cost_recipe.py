"""`loomrl estimate-cost RECIPE.yaml`: the figures a recipe holds are read from it (flags override), one it cannot hold
is asked for by name in one line; a phase under an hour is not rounded to 0 hours; a CPU recipe counts machine-hours;
and nothing it prints cites a document the user does not have."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loomrl.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = EXAMPLES / "calculator_tiny.yaml"  # 4 steps x 2 groups x 4, max_turns 3, max_tokens 12, a tiny model
RATES = ["--inference-tokens-per-s", "100", "--train-tokens-per-s", "200"]
# what the user never saw: the design notes and their sources
UNSEEN = re.compile(r"seed|DESIGN|§|section \d", re.IGNORECASE)


def _json(capsys, argv: list[str]) -> dict:
    assert main(["estimate-cost", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_recipe_gives_steps_groups_turns_tokens_model_and_devices(capsys):
    out = _json(capsys, [str(TINY), *RATES])
    (est,) = out["estimates"]
    x = est["inputs"]
    assert (x["tasks"], x["rollouts_per_task"], x["turns"], x["tokens_per_turn"]) == (8, 4, 3, 12)  # 4 x 2 groups
    assert est["inference"]["tokens"] == 8 * 4 * 3 * 12
    assert x["unit"] == "machine" and x["inference_gpus"] == x["train_gpus"] == 1  # a CPU recipe: one machine
    # the tiny model's parameters from its config: 49,152 x 64 embedding (tied) + 2 blocks + the last norm
    per_block = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert out["recipe"]["model_params"] == 49152 * 64 + 2 * per_block + 64
    assert "trainer.total_steps" in out["recipe"]["read"]["tasks"]


def test_flags_override_the_recipe(capsys):
    x = _json(capsys, [str(TINY), *RATES, "--turns", "1.5", "--tasks", "100"])["estimates"][0]["inputs"]
    assert (x["tasks"], x["turns"], x["tokens_per_turn"]) == (100, 1.5, 12)


def test_a_figure_no_recipe_holds_is_asked_for_by_name_in_one_line(capsys):
    assert main(["estimate-cost", str(TINY), "--train-tokens-per-s", "200"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--inference-tokens-per-s" in lines[0] and "--train-tokens-per-s" not in lines[0]
    assert lines[0].startswith("loomrl estimate-cost: ")


def test_gpus_come_from_the_ray_sections(capsys):
    # dotted overrides after the recipe, as `loomrl train` takes them: two trainer ranks of one GPU, two engines of one
    x = _json(capsys, [str(TINY), "runtime.backend=ray", "ray.trainer.num_gpus=1", "trainer.world_size=2",
                       "ray.engine.count=2", "ray.engine.num_gpus=1", *RATES])["estimates"][0]["inputs"]
    assert (x["unit"], x["inference_gpus"], x["train_gpus"]) == ("GPU", 2, 2)


def test_a_two_minute_phase_is_not_zero_hours(capsys):
    # by hand: 10 x 4 x 1 x 300 = 12,000 tokens at 100 tokens/s = 120 s = 2 minutes, both phases
    assert main(["estimate-cost", "--tasks", "10", "--rollouts-per-task", "4", "--turns", "1", "--tokens-per-turn",
                 "300", "--inference-tokens-per-s", "100", "--train-tokens-per-s", "100", "--gpus", "1"]) == 0
    rows = {line.split("  ")[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["training"][-4:-1] == ["12k", "2min", "0.033"]  # wall in minutes, GPU-hours to 2 figures
    assert rows["inference (rollout)"][-4:-1] == ["12k", "2min", "0.033"]


def test_the_rule_and_the_help_cite_only_the_users_docs(capsys):
    assert main(["estimate-cost", "--env-step-s", "5", "--gen-step-s", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "26 concurrent environment workers" in out and "docs/planning.md" in out
    with pytest.raises(SystemExit):
        main(["estimate-cost", "--help"])
    text = out + capsys.readouterr().out
    assert not UNSEEN.search(text), UNSEEN.search(text)
