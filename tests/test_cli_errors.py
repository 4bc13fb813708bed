"""What a new user mistypes in the first hour, through the real `loomrl` command line: each mistake is refused
with one line (no traceback) naming the field, the bad value and what to write instead, before any model is
loaded; overrides may follow a flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loomrl import cli
from loomrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "examples" / "calculator_tiny.yaml")


def _one_line(capsys, argv: list[str]) -> str:
    """Run `loomrl argv`; it must exit 2 with exactly one line on stderr, which is returned."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_unknown_calculator_family_names_the_field_the_name_and_the_choices(capsys, tmp_path):
    line = _one_line(capsys, ["train", RECIPE, "env.families=[distract_add, nope]", f"output_dir={tmp_path}"])
    assert line == ("config error: env.families: unknown calculator family 'nope'; choose from add, add_add, "
                    "add_sub, distract_add, distract_mul, distract_sub, div, expr, mul, mul_add, sub")
    line = _one_line(capsys, ["train", RECIPE, "env.args.heldout_families=[add, plus]"])
    assert line.startswith("config error: env.args.heldout_families: unknown calculator family 'plus'; ")


def test_an_unknown_gym_game_names_env_families_and_the_games(capsys, tmp_path):
    line = _one_line(capsys, ["train", RECIPE, "env.name=gym", "env.families=[chess]", f"output_dir={tmp_path}"])
    assert line == ("config error: env.families: unknown gym game 'chess'; choose from blackjack, cliffwalking, "
                    "frozenlake, frozenlake_random, taxi")


def test_learning_rate_in_a_recipe_is_told_lr(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  learning_rate: 1.0e-5\n")
    line = _one_line(capsys, ["train", str(recipe)])
    assert line == "config error: unknown field 'trainer.learning_rate'; did you mean 'lr'?"


@pytest.mark.parametrize(("backend", "known"), [
    ("bwrap", "address_space_mb, cpu_s, disk_mb, file_size_mb, nproc, tmp_mb"),
    ("process", "disk_mb"),
    ("docker", "cpus, disk_mb, memory_mb, nproc, tmp_mb"),
])
def test_an_unknown_sandbox_limit_is_refused_at_load(capsys, backend, known):
    line = _one_line(capsys, ["train", RECIPE, f"env.sandbox={backend}", "env.sandbox_limits.cpu_seconds=5"])
    assert line == (f"config error: env.sandbox_limits: unknown key 'cpu_seconds' for the {backend} sandbox; "
                    f"valid keys: {known}")


def test_auto_sandbox_limits_are_checked_against_the_backend_auto_picks(capsys):
    from loomrl.env.sandbox.factory import resolve_backend

    line = _one_line(capsys, ["train", RECIPE, "env.sandbox_limits.disk_gb=1"])
    assert line.startswith(f"config error: env.sandbox_limits: unknown key 'disk_gb' for the {resolve_backend('auto')} "
                           f"sandbox (env.sandbox=auto picks {resolve_backend('auto')} here); valid keys: ")


@pytest.mark.parametrize("argv", [
    ["train", RECIPE, "--resume", "trainer.lrr=1"],
    ["train", RECIPE, "name=x", "--resume", "trainer.lrr=1"],
    ["eval", RECIPE, "--checkpoint", "runs/x", "trainer.lrr=1"],
    ["serve", RECIPE, "--port", "8001", "trainer.lrr=1"],
])
def test_overrides_after_a_flag_are_overrides(capsys, argv):
    """The override after the flag reaches the config (its misspelling is what is reported), where argparse
    said `unrecognized arguments`."""
    assert _one_line(capsys, argv) == "config error: unknown field 'trainer.lrr'; did you mean 'lr'?"


def test_overrides_keep_their_order_and_other_leftovers_are_refused(capsys):
    args = cli._parse_args(["train", RECIPE, "trainer.lr=1", "--resume", "trainer.lr=2", "name=y"])
    assert args.resume and args.overrides == ["trainer.lr=1", "trainer.lr=2", "name=y"]  # the last one wins
    with pytest.raises(SystemExit):
        cli._parse_args(["train", RECIPE, "--resume", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli._parse_args(["validate-tasks", "x=1"])  # no overrides there


def _import_reward_as_the_console_script(tmp_path: Path, spec: str) -> subprocess.CompletedProcess:
    """Import `spec` the way `loomrl` (a console script in the venv's bin/) runs: sys.path[0] is the script's
    folder, not the current directory (`python -m` and `python -c` would put the current directory there)."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir(parents=True)
    work.mkdir()
    (work / "my_rewards.py").write_text("def score(trajectory, task):\n    return {'correct': 1.0}\n")
    launcher = bin_dir / "loomrl-reward"
    launcher.write_text("import sys\nfrom loomrl.config import ConfigError\nfrom loomrl.reward.pool import import_reward\n"
                        f"try:\n    print(import_reward({spec!r}).__name__)\nexcept ConfigError as err:\n"
                        "    sys.exit(str(err))\n")
    return subprocess.run([sys.executable, str(launcher)], cwd=work, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


@pytest.mark.integration  # starts the console script in a python process
def test_a_reward_module_in_the_current_directory_imports_from_the_console_script(tmp_path):
    run = _import_reward_as_the_console_script(tmp_path, "my_rewards:score")
    assert run.returncode == 0 and run.stdout.strip() == "score", run.stderr


@pytest.mark.integration  # starts the console script in a python process
def test_a_reward_function_that_does_not_import_says_where_it_was_looked_up(tmp_path):
    run = _import_reward_as_the_console_script(tmp_path, "my_reward:score")
    assert run.returncode == 1
    line, = run.stderr.strip().splitlines()
    work = tmp_path / "work"
    assert line == (f"config error: reward.function=my_reward:score: no module named 'my_reward'; modules are "
                    f"imported with the current directory ({work}), then PYTHONPATH ({ROOT}: `loomrl` adds the "
                    "recipe's folder) on sys.path; give "
                    "package.module:function, e.g. reward.function=my_rewards:score for a file my_rewards.py there "
                    "defining score(trajectory, task) or score(prompts, completions, **kwargs)")
    run = _import_reward_as_the_console_script(tmp_path / "b", "my_rewards:scor")
    line, = run.stderr.strip().splitlines()
    assert line.startswith(f"config error: reward.function=my_rewards:scor: module 'my_rewards' "
                           f"({tmp_path / 'b' / 'work' / 'my_rewards.py'}) has no attribute 'scor'; modules are imported")


def test_a_reward_module_that_fails_to_import_names_its_own_error(tmp_path, monkeypatch):
    from loomrl.config import ConfigError
    from loomrl.reward.pool import import_reward

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_reward.py").write_text("def score(:\n")
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_here\n")
    with pytest.raises(ConfigError) as syntax:
        import_reward("broken_reward:score")
    assert str(syntax.value) == ("config error: reward.function=broken_reward:score: importing 'broken_reward' raised "
                                 "SyntaxError: invalid syntax (broken_reward.py, line 1)")
    with pytest.raises(ConfigError) as dep:
        import_reward("needs_dep:score")
    assert str(dep.value) == ("config error: reward.function=needs_dep:score: importing 'needs_dep' failed: No module "
                              "named 'no_such_dependency_here' (an import inside it; install that package)")
