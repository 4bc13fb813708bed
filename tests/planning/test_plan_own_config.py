"""`loomrl plan` on the unchanged configuration of a real async tiny run predicts the trajectory time the run
measured, and GPU-hours only for a run that held GPUs.

The 2x (issue 43): an async run whose trainer is slower than its rollouts launches one step's groups each time the
trainer frees their positions, so the engine decodes about one step's trajectories at a time, not the whole admission
window (groups_per_step x (1 + max_policy_lag) groups) the model assumed. Where a decode step costs more at a larger
batch, that doubled the engine's predicted time per turn, and with it the trajectory's.

The one fake: the tiny model's decode step on 2 CPU cores is flat in its batch (about 16 ms at any size), so the run's
engine/decode_* sums are also rewritten into a decode step proportional to its batch (2 ms a row: a model whose
step grows with the batch, as SmolLM2 on a CPU or a compute-bound GPU); every other number is the real run's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.planning.measure import measure_run
from loomrl.planning.predict import Shape, plan
from loomrl.runtime.run import train

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
TOLERANCE = 0.15  # the own-config prediction of the trajectory's mean wall time, relative


def _proportional_decode(src: Path, dst: Path, per_row_s: float = 0.002) -> Path:
    shutil.copytree(src, dst)
    records = [json.loads(line) for line in (dst / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for r in records:
        if r.get("kind") == "train" and r.get("engine/decode_steps"):
            r["engine/decode_s"] = per_row_s * r["engine/decode_rows"]
            r["engine/decode_rows_s"] = per_row_s * r["engine/decode_rows_sq"]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("own")
    # the recipe as it is (async, max_policy_lag 1, 2 groups x 4), four steps: the trainer is the slower pool
    train(load_config(RECIPE, [f"output_dir={out}", "name=a", "progress=false", "trainer.total_steps=4"]))
    return {"flat": out / "a", "proportional": _proportional_decode(out / "a", out / "a_prop")}


@pytest.mark.integration  # a four-step async training run (its trainer process), ~8 s
@pytest.mark.parametrize("decode", ["flat", "proportional"])
def test_the_unchanged_config_predicts_the_measured_trajectory_time(runs, decode):
    m = measure_run(runs[decode])
    assert m.mode == "async" and m.train_s > m.rollout_s  # the regime of the 2x: trainer-bound async
    p = plan(m, Shape.of(m))
    measured = m.trajectory.mean  # the agent loop's wall time (store wall_time): reset, turns; scoring is after it
    assert p.own.trajectory_s == pytest.approx(measured, rel=TOLERANCE), (p.own.trajectory_s, measured)
    assert p.target.trajectory_s == pytest.approx(p.own.trajectory_s, rel=1e-9)
    # the engine batch the model predicts is the one the engine measured (the cause of the 2x: the window's 16)
    assert p.own.engine_batch == pytest.approx(m.decode.batch_mean, rel=0.35), (p.own.engine_batch, m.decode)


@pytest.mark.integration  # the same four-step training run
def test_a_larger_window_is_still_predicted_no_faster_per_turn(runs):
    m = measure_run(runs["proportional"])
    own, wider = plan(m, Shape.of(m)), plan(m, Shape.of(m, groups_per_step=4))
    assert wider.target.engine_batch > own.target.engine_batch
    assert wider.target.gen_turn_s > own.target.gen_turn_s  # a proportional step: more rows, longer turns
