"""`loomrl plan`'s simulated section on a real tiny run folder: it is printed and labelled SIMULATED, in the table and
the JSON, and it moves the right way: a larger K/V budget pauses and recomputes less, affinity placement recomputes
less prefill than round_robin, the pool no more than without it. The run's engine.program_policy is edited in its
config.yaml (the run itself used the default lru)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from loomrl.cli import main
from loomrl.config import load_config
from loomrl.planning.measure import measure_run
from loomrl.planning.sim_plan import sim_inputs, sim_lines, simulate_plan
from loomrl.runtime.run import train

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan_sim")
    train(load_config(RECIPE, [f"output_dir={out}", "name=p", "progress=false", "runtime.mode=sync",
                               "trainer.total_steps=1", "env.args.step_latency_s=0.02"]))
    return out / "p"


def _plan_json(capsys, run: Path, *flags: str) -> dict:
    assert main(["plan", str(run), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["simulated"]


def test_the_plan_prints_a_simulated_section(run_dir, capsys):
    assert main(["plan", str(run_dir), "--instances", "4"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("SIMULATED (not measured), cluster simulation: 4 instances"):]
    for label in ("prefix hit rate", "prefill recomputed", "placement saves", "the pool saves", "K/V pauses",
                  "assumptions", "engine.program_policy lru", "K/V budget 65536 tokens per instance"):
        assert label in section, label
    got = _plan_json(capsys, run_dir, "--instances", "4")
    assert got["simulated"] is True and got["inputs"]["instances"] == 4
    chosen, rr, pooled = got["chosen"], got["round_robin"], got["pooled"]
    assert chosen["policy"] == "affinity" and rr["policy"] == "round_robin" and pooled["policy"] == "affinity+pool"
    assert chosen["computed_tokens"] < rr["computed_tokens"] and pooled["computed_tokens"] <= chosen["computed_tokens"]
    assert chosen["hit_rate"] <= chosen["hit_bound"]


def test_a_larger_budget_pauses_and_recomputes_less(run_dir, tmp_path, capsys):
    """The tiny run's trajectories end after one turn or so (nothing to pause between turns): its measured shape with
    3 turns, under the run's config edited to longest_wait, through the plan's own functions."""
    edited = tmp_path / "lw"
    shutil.copytree(run_dir, edited)
    cfg = yaml.safe_load((edited / "config.yaml").read_text())
    cfg["engine"]["program_policy"] = "longest_wait"
    (edited / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert _plan_json(capsys, edited, "--instances", "1")["chosen"]["program_policy"] == "longest_wait"
    m = measure_run(edited)
    base = sim_inputs(instances=1, router=m.engine.router, program_policy=m.engine.program_policy, pool=False,
                      kv_budget_tokens=m.engine.kv_budget_tokens, inflight=8, group_size=m.group_size, turns=3,
                      prompt_tokens=m.prompt_tokens, output_tokens=m.tokens_per_turn, obs_tokens=m.obs_tokens,
                      tool_median_s=m.env_step.p50)
    tight, roomy = (simulate_plan(replace(base, kv_budget_tokens=b)).chosen for b in (900, 100_000))
    assert tight.program_policy == "longest_wait"
    assert tight.pauses > roomy.pauses == 0
    assert tight.restore_tokens > roomy.restore_tokens == 0 and tight.computed_tokens > roomy.computed_tokens
    text = "\n".join(sim_lines(simulate_plan(replace(base, kv_budget_tokens=900))))
    assert f"K/V pauses         {tight.pauses} under longest_wait" in text
