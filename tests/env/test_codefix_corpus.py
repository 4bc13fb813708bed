"""The codefix corpus: shape of every task, and its hidden tests actually run: they must pass on the
golden-patched repository and fail on the buggy one."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loomrl.env.tasks.codefix_corpus import codefix_tasks

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

TASKS = codefix_tasks()
ALLOWED_PERTURBATIONS = {"env", "disable_tools", "layout", "broken_dependency"}


def test_ids_unique_and_corpus_size():
    ids = [t.task_id for t in TASKS]
    assert len(ids) == len(set(ids))
    assert len(TASKS) >= 36
    families = {t.family for t in TASKS}
    assert len(families) >= 12
    for family in families:
        assert sorted(t.task_id for t in TASKS if t.family == family) == [f"codefix-{family}-{v}" for v in (1, 2, 3)]


def test_deterministic():
    assert codefix_tasks() == TASKS


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.task_id)
def test_task_shape(task):
    pkg_inits = [p for p in task.files if p.endswith("/__init__.py")]
    assert len(pkg_inits) == 1 and "README.md" in task.files
    assert 2 <= sum(p.endswith(".py") for p in task.files) <= 4
    assert task.hidden_tests["tests_hidden/__init__.py"] == ""
    assert all(p.startswith("tests_hidden/") for p in task.hidden_tests)
    # The golden patch only rewrites existing files, and only at one small spot.
    assert task.golden_patch
    for path, fixed in task.golden_patch.items():
        assert path in task.files and fixed != task.files[path]
        diff = [line for line in difflib.unified_diff(task.files[path].splitlines(), fixed.splitlines(), n=0)
                if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        assert len(diff) <= 4, diff
        # The issue reports the symptom; it never quotes the fixed code.
        assert not [line for line in diff if line.startswith("+") and line[1:].strip() in task.issue]
    assert pkg_inits[0].split("/")[0] in task.issue


def test_perturbations():
    perturbed = [t for t in TASKS if t.perturbations]
    assert len(TASKS) // 5 <= len(perturbed) <= len(TASKS) // 3
    for task in perturbed:
        assert len(task.perturbations) == 1 and set(task.perturbations) <= ALLOWED_PERTURBATIONS
        module = task.perturbations.get("broken_dependency")
        if module:
            # The package must not import the module the environment breaks.
            sources = "\n".join([*task.files.values(), *task.hidden_tests.values()])
            assert not re.search(rf"^\s*(import|from)\s+{module}\b", sources, re.MULTILINE)
    assert len({repr(t.perturbations) for t in perturbed}) >= 4


def _run_hidden_tests(files: dict[str, str], hidden_tests: dict[str, str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        for rel, content in {**files, **hidden_tests}.items():
            path = Path(tmp, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        return subprocess.run([sys.executable, "-m", "unittest", "discover", "-s", "tests_hidden", "-t", "."],
                              cwd=tmp, capture_output=True, text=True, timeout=60)


def test_hidden_tests_pass_on_golden_and_fail_on_buggy():
    jobs = [(task, "golden", {**task.files, **task.golden_patch}) for task in TASKS]
    jobs += [(task, "buggy", task.files) for task in TASKS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: _run_hidden_tests(job[2], job[0].hidden_tests), jobs))
    problems = []
    for (task, state, _), proc in zip(jobs, results):
        ran = re.search(r"Ran (\d+) tests?", proc.stderr)
        if not ran or not 3 <= int(ran.group(1)) <= 6:
            problems.append(f"{task.task_id} {state}: expected 3-6 tests\n{proc.stderr}")
        elif state == "golden" and proc.returncode != 0:
            problems.append(f"{task.task_id}: hidden tests fail on the golden patch\n{proc.stderr}")
        elif state == "buggy" and proc.returncode == 0:
            problems.append(f"{task.task_id}: hidden tests pass on the buggy repository")
    assert not problems, "\n\n".join(problems)
