"""A recipe's module:attribute names (loomrl/plugins.py) are found beside the recipe, as its data files are: before,
code was looked for only in the current folder, data in the recipe's, and the error did not say so."""

from __future__ import annotations

import os
import sys

from loomrl.plugins import import_object, search_beside


def test_a_reward_module_beside_the_recipe_is_found_from_another_folder(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "my_task"
    recipe_dir.mkdir()
    (recipe_dir / "beside_rewards_xyz.py").write_text("def score(trajectory, task):\n    return {'ok': 1.0}\n")
    (recipe_dir / "train.yaml").write_text("reward:\n  function: beside_rewards_xyz:score\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    search_beside(recipe_dir / "train.yaml")
    fn = import_object("beside_rewards_xyz:score", "reward.function", "")
    assert fn(None, None) == {"ok": 1.0}
    assert os.environ["PYTHONPATH"] == str(recipe_dir)  # the run's child processes find it too
    search_beside(recipe_dir / "train.yaml")
    assert os.environ["PYTHONPATH"] == str(recipe_dir)  # once

