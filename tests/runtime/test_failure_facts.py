"""Failure is decided in one place: only the driver raises RunError (runtime/failures.py); every other part reports a
typed fact. Read from the source, so a new `raise RunError` anywhere else fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import loomrl

PACKAGE = Path(loomrl.__file__).parent


def raises_of(path: Path, name: str) -> list[int]:
    """Lines of `raise <name>(...)` (or `raise <name>`) in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id == name:
                out.append(node.lineno)
    return out


def test_only_the_driver_raises_run_error():
    where = {str(p.relative_to(PACKAGE)): lines for p in PACKAGE.rglob("*.py") if (lines := raises_of(p, "RunError"))}
    assert set(where) == {"runtime/driver.py"}, where


def test_the_check_sees_a_raise_it_must_refuse(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    raise RunError('run error: x')\n\ndef g():\n    raise ValueError('y')\n")
    assert raises_of(module, "RunError") == [2]
