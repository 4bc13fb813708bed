"""The run folder's names are spelled in one module: loomrl/run_folder.py (issue 44).

The names this test polices, as loomrl/run_folder.py defines them:
- files: config.yaml, metrics.jsonl, ledger.jsonl, train_records.jsonl, groups.jsonl, segments.jsonl, summary.json,
  wandb_run_id, and inside checkpoints/: latest.tmp, optimizer.pt, state.pt;
- folders: trajectories, evaluations, checkpoints, tensorboard;
- prefixes of checkpoint folders: step_, .tmp_step_.
(run_folder.py also owns model, optimizer, latest and weights; as words they are too common to police.)

The rule: in loomrl/**/*.py other than run_folder.py, no string constant used as a value (f-string pieces included)
is one of these names or a path starting with one (`trajectories/...`), or is one of the prefixes alone (an
f-string's `step_{n:06d}`) or as a glob (`step_*`). Docstrings
and comments do not count, and neither do names inside prose (a message's "no metrics.jsonl" is text built around
the name; build it from the constant where the name may change). Read with ast, so the test imports nothing it scans.
"""

from __future__ import annotations

import ast
from pathlib import Path

from loomrl import run_folder

ROOT = Path(__file__).resolve().parents[1]

NAMES = ("config.yaml", "metrics.jsonl", "ledger.jsonl", "train_records.jsonl", "groups.jsonl", "segments.jsonl",
         "summary.json", "wandb_run_id", "latest.tmp", "optimizer.pt", "state.pt",
         "trajectories", "evaluations", "checkpoints", "tensorboard")
PREFIXES = ("step_", ".tmp_step_")

# Spots in files another change is editing now; each moves to run_folder's name when that change lands.
ALLOWED: set[tuple[str, str]] = set()


def _spelled(value: str) -> bool:
    return (any(value == n or value.startswith(n + "/") for n in NAMES)
            or any(value == p or value.startswith(p + "*") for p in PREFIXES))


def spellings(root: Path) -> list[str]:
    """Every `file:line: 'value'` under root/loomrl where a run-folder name is spelled outside run_folder.py."""
    found = []
    for path in sorted((root / "loomrl").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "loomrl/run_folder.py":
            continue
        tree = ast.parse(path.read_text(), rel)
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                    and _spelled(node.value) and (rel, node.value) not in ALLOWED):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_the_policed_names_are_the_run_folder_modules():
    defined = {v for k, v in vars(run_folder).items() if k.isupper() and isinstance(v, str)}
    assert set(NAMES) | set(PREFIXES) <= defined


def test_no_run_folder_name_is_spelled_outside_the_run_folder_module():
    found = spellings(ROOT)
    assert not found, "run-folder names spelled outside loomrl/run_folder.py (import them from there):\n" + \
        "\n".join(found)
