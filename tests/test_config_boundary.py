"""Each component sees only its own config (issue 44): the whole recipe, `RunConfig`, is named only where a run is
assembled.

Allowed: loomrl/config/ (it defines it and makes each pool's part: config/pools.py), loomrl/runtime/ (which builds
the pools), loomrl/cli.py, and the commands that load a whole recipe: `loomrl plan` (loomrl/planning/) and `loomrl
view` (loomrl/view/); `loomrl serve` is runtime/serve.py. Everywhere else a component takes its section
(TrainerConfig, EnvConfig, ...) or its pool's record (TrainPoolConfig, RolloutPoolConfig, EngineSetup), and an actor
or process is sent that record's JSON.

Read with ast: any use of the name counts (an import, an annotation, a call, a string annotation, an import for type
checking only): a component that names it depends on the whole recipe's shape.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("loomrl/config/", "loomrl/runtime/", "loomrl/planning/", "loomrl/view/", "loomrl/cli.py")
NAME = "RunConfig"


def _named(tree: ast.AST) -> list[int]:
    """Lines where NAME is used: a name, an attribute, an import, or inside a string annotation."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == NAME or isinstance(node, ast.Attribute) and node.attr == NAME:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom | ast.Import) and any(a.name == NAME for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() == NAME:
            lines.append(node.lineno)  # a string annotation: "RunConfig"
    return lines


def named_outside(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "loomrl").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED):
            continue
        found += [f"{rel}:{line}" for line in _named(ast.parse(path.read_text(), rel))]
    return found


def test_the_whole_recipe_is_named_only_where_a_run_is_assembled():
    assert named_outside(ROOT) == []


def test_the_check_sees_each_way_of_naming_it(tmp_path):
    """The scan itself: each form a component could depend on the whole recipe by is found, prose is not."""
    package = tmp_path / "loomrl"
    (package / "rollout").mkdir(parents=True)
    (package / "runtime").mkdir()
    (package / "rollout" / "uses.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from loomrl.config import RunConfig\n"  # line 4
        "import loomrl.config as c\n"
        "def f(cfg: 'RunConfig') -> None:\n"  # line 6
        "    return c.RunConfig.model_validate_json(cfg)\n"  # line 7
        "def g() -> None:\n"
        "    '''Takes no RunConfig: prose.'''\n")
    (package / "runtime" / "run.py").write_text("from loomrl.config import RunConfig\n")
    assert named_outside(tmp_path) == ["loomrl/rollout/uses.py:4", "loomrl/rollout/uses.py:6",
                                       "loomrl/rollout/uses.py:7"]
