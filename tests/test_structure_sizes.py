"""Sizes the design holds to (issue 44): the training step cut at its seams and the vLLM adapter kept readable.

- No function in the step's math (loomrl/trainer/) or the pool's plumbing around it (loomrl/train_pool/) is over 50
  lines: a step that grows again is cut at a seam (step_plan, loss_inputs, step_loss, selection), not lengthened.
- VLLMEngine (loomrl/engine/vllm/engine.py) is under 300 lines: its control calls, start, arguments, weights and
  translation live in the modules beside it.

Read with ast, so nothing scanned is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 50
MAX_VLLM_ENGINE_LINES = 300


def long_functions(folder: Path, root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}: {lines} lines")
    return found


def class_lines(path: Path, name: str) -> int:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"no class {name} in {path}")


def test_no_function_of_the_trainer_or_its_pool_is_over_50_lines():
    assert long_functions(ROOT / "loomrl" / "trainer") + long_functions(ROOT / "loomrl" / "train_pool") == []


def test_the_vllm_engine_is_under_300_lines():
    assert class_lines(ROOT / "loomrl" / "engine" / "vllm" / "engine.py", "VLLMEngine") < MAX_VLLM_ENGINE_LINES


def test_the_scan_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # 50 lines of body + the def line
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\nasync def long():\n{body}\n")
    assert long_functions(tmp_path, root=tmp_path) == [f"m.py:5 long: {MAX_FUNCTION_LINES + 1} lines"]
