"""Custom environments train end to end on a tiny model: the shipped example (examples/custom_env, named by
package.module:Factory) and a plugin found by its `loomrl.envs` entry point. The tiny random model never solves a task;
the parity reward (tests/rewards_for_tests.py) gives its groups variance so that steps train."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_checks import check_run

from loomrl.config import load_config
from loomrl.runtime.run import train
from loomrl.store import read_trajectories

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.kind=tiny", "progress=false", "trainer.total_steps=2", "trainer.groups_per_step=2",
         "trainer.group_size=4", "trainer.micro_batch_size=8", "trainer.freeze_layers=0", "env.n_train=16",
         "env.n_heldout=4", "eval.n_tasks=4", "reward.function=rewards_for_tests:parity_reward"]


def _run(tmp_path, recipe, *overrides):
    cfg = load_config(recipe, [f"output_dir={tmp_path}", *SMALL, *overrides])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    check_run(cfg.run_dir, summary, 2)
    return cfg, read_trajectories(cfg.run_dir / "trajectories").to_pylist()


def test_the_custom_env_example_trains_from_its_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # env.name is examples.custom_env.shop:Shop, found from the repository's root
    cfg, rows = _run(tmp_path, ROOT / "examples" / "custom_env" / "train.yaml", "name=shop")
    assert {r["env_version"] for r in rows} == {"shop-v1"}
    assert all(r["prompt"].startswith("What does one ") for r in rows)


def test_a_plugin_by_entry_point_trains(tmp_path, monkeypatch):
    dist = tmp_path / "plugins" / "lookup_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lookup-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[loomrl.envs]\nlookup = custom_envs_for_tests:make_lookup\n")
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    cfg, rows = _run(tmp_path, None, "name=lookup", "env.name=lookup", "env.args.table={a: 4, b: 9}",
                     "sampling.max_tokens=8", "agent.max_turns=2")
    assert {r["env_version"] for r in rows} == {"lookup-test-1"}
    assert {r["answer"] for r in rows} <= {"4", "9"}
