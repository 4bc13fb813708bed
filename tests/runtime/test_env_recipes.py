"""The codefix and gym recipes load as shipped, with turns long enough for their environment's actions, and one
sync step of each runs end to end on a tiny random model (their own settings otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.runtime.run import train

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("recipe", "env", "min_tokens"), [("codefix_smollm2.yaml", "codefix", 128),
                                                             ("gym_smollm2.yaml", "gym", 24)])
def test_env_recipe_loads_and_one_step_runs(tmp_path, recipe, env, min_tokens):
    shipped = load_config(EXAMPLES / recipe)  # no override needed
    assert shipped.env.name == env and shipped.model.kind == "smollm2"
    assert shipped.sampling.max_tokens >= min_tokens  # a file edit (codefix), a move in either form (gym)
    small = ["env.families=[clamp, chunk]"] if env == "codefix" else ["env.n_train=8", "env.n_heldout=2"]
    cfg = load_config(EXAMPLES / recipe, [f"output_dir={tmp_path}", "progress=false", "model.kind=tiny",
                                          "trainer.total_steps=1", "trainer.groups_per_step=1", "trainer.group_size=2",
                                          "eval.n_tasks=2", "checkpoint_every=0", *small])
    summary = train(cfg)
    assert summary["steps"] == 1 and summary["ended"] == "finished"
    assert {k: v["launched"] for k, v in summary["rollouts"].items()} == {"training": 2, "evaluation": 2 * 2}
