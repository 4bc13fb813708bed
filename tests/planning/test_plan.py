"""`loomrl plan` on a real tiny run folder: finite, sane numbers, its own run predicted as measured, a tighter
concurrency cap predicted slower; machine-hours for this CPU run and GPU-hours for the same run on GPUs (its
config.yaml edited: there is no GPU here); no citation of a document the user does not have; a folder that is not a
run is one line naming it."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from loomrl.cli import main
from loomrl.config import load_config
from loomrl.planning.measure import NotARun, measure_run
from loomrl.planning.predict import Shape, plan
from loomrl.runtime.run import train

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    # env latency (simulated, 20 ms a step) so environment time is measured, not zero
    train(load_config(RECIPE, [f"output_dir={out}", "name=p", "progress=false", "runtime.mode=sync",
                               "trainer.total_steps=2", "env.args.step_latency_s=0.02"]))
    return out / "p"


def test_the_measurements_are_finite_and_sane(run_dir):
    m = measure_run(run_dir)
    assert (m.steps, m.groups_per_step, m.group_size, m.mode) == (2, 2, 4, "sync")
    assert m.trajectory.n == 16 and m.env_step.n >= 16 and m.env_reset.n == 16 and m.reward.n == 16
    assert 0.005 < m.env_step.mean < 1.0  # the simulated 20 ms, and the tool's own work
    assert m.gen_turn.mean > 0 and m.decode.tokens_per_s > 0 and m.trainer_tokens_per_s > 0
    assert 1 <= m.turns <= 3 and 0 < m.tokens_per_turn <= 12  # agent.max_turns, sampling.max_tokens
    assert m.wall_s > m.steps * m.step_s > 0


def test_the_plan_predicts_its_own_run_and_a_tighter_cap_slower(run_dir):
    m = measure_run(run_dir)
    own = plan(m, Shape.of(m))
    assert own.own.wall_s == pytest.approx(m.wall_s, rel=1e-6)  # calibrated on it
    assert own.own.step_s == pytest.approx(m.step_s, rel=1e-6)
    capped = plan(m, Shape.of(m, max_inflight=4))  # one group of 4 at a time: two waves a step
    assert capped.target.inflight == 4 and capped.target.rollout_s > own.target.rollout_s
    for p in (own, capped):
        t = p.target
        values = [t.wall_s, t.step_s, t.trajectory_s, t.staleness, p.groups_1000_wall_s, p.groups_1000_device_hours,
                  *t.shares.values()]
        assert all(math.isfinite(v) and v >= 0 for v in values)
        assert t.bottleneck in t.shares and t.staleness == 0.0  # sync
        assert p.capacity.workers >= 1 and p.capacity.pool_size >= p.capacity.workers
    later = plan(m, Shape.of(m, mode="async", max_policy_lag=1))
    assert 0 <= later.target.staleness <= 1


def test_the_cli_prints_the_plan_and_json(run_dir, capsys):
    assert main(["plan", str(run_dir), "--max-inflight", "4", "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and "per 1,000 groups" in out and "concurrent environment workers" in out
    assert main(["plan", str(run_dir), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["target"]["shape"]["max_inflight"] == 0 and got["capacity"]["workers"] >= 1


def _per_1000(capsys, run: Path) -> str:
    assert main(["plan", str(run)]) == 0
    out = capsys.readouterr().out
    return next(line for line in out.splitlines() if "per 1,000 groups" in line)


def _edited(run_dir: Path, to: Path, **sections: dict) -> Path:
    shutil.copytree(run_dir, to)
    cfg = yaml.safe_load((to / "config.yaml").read_text())
    for section, fields in sections.items():
        cfg[section].update(fields)
    (to / "config.yaml").write_text(yaml.safe_dump(cfg))
    return to


def test_a_cpu_run_counts_machine_hours_and_a_gpu_run_gpu_hours(run_dir, tmp_path, capsys):
    line = _per_1000(capsys, run_dir)  # trained here, on the CPU (model.device and trainer.device auto)
    assert "machine-hours" in line and "GPU" not in line, line
    on_gpu = _edited(run_dir, tmp_path / "gpu", model={"device": "cuda"}, trainer={"device": "cuda"})
    line = _per_1000(capsys, on_gpu)  # engine and trainer on one GPU: one GPU
    assert "GPU-hours" in line and "(1 GPU" in line, line
    on_ray = _edited(run_dir, tmp_path / "ray", runtime={"backend": "ray"}, trainer={"world_size": 2},
                     ray={"trainer": {"num_gpus": 1}, "engine": {"count": 1, "num_gpus": 1}})
    assert "(3 GPUs" in _per_1000(capsys, on_ray)
    assert main(["plan", str(run_dir), "--gpus", "8"]) == 0  # said on the command line
    assert "(8 GPUs" in capsys.readouterr().out


def test_the_plan_cites_only_the_users_docs(run_dir, capsys):
    assert main(["plan", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "docs/planning.md" in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = out + capsys.readouterr().out
    found = re.search(r"seed|DESIGN|§|section \d", text, re.IGNORECASE)
    assert found is None, found


def test_a_folder_that_is_not_a_run_is_one_line_naming_it(tmp_path, capsys):
    for folder in (tmp_path, tmp_path / "missing"):
        assert main(["plan", str(folder)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and str(folder) in lines[0] and lines[0].startswith("loomrl plan: ")
    with pytest.raises(NotARun, match="no metrics.jsonl"):
        (tmp_path / "config.yaml").write_text("name: x\n")
        measure_run(tmp_path)
