"""`loomrl plan` predicts the wall time of a run with a different concurrency cap (issue 30: within 20%).

Workload (both arms, same seeds): examples/calculator_tiny.yaml (the tiny random model, a real tokenizer, the
calculator environment) in sync mode, trainer.groups_per_step=4 x group_size=4 = 16 trajectories a step,
--steps steps, eval.n_tasks=4 (8 held-out episodes before and after). Everything is real except one thing:

  SIMULATED: every env step first waits a lognormal time (env.args.step_latency_s = --latency, mean 0.3 s; sigma
  of the underlying normal 0.5), standing in for a slow tool, so environment time matters.

Arms: A with runtime.max_inflight_trajectories=--cap-a (16: a step's four groups at once), B with --cap-b (4: one
group at a time, four waves a step). Each arm is its own `loomrl train` process. From A's run folder alone,
`loomrl plan`'s model (loomrl/planning/predict.py) predicts B's wall time (summary.json wall_s) and mean step time;
then B runs and the prediction is compared; and the other way round (B predicts A).

error = (predicted - measured) / measured; target |error| <= 0.2 for the wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's loomrl, as the arms' `-m loomrl` use
from _common import machine, report  # noqa: E402

from loomrl.planning.measure import measure_run  # noqa: E402
from loomrl.planning.predict import Shape, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"


def run_arm(out: Path, name: str, cap: int, args) -> dict:
    """One `loomrl train` run; its summary and measured mean step time."""
    cmd = [sys.executable, "-m", "loomrl", "train", str(RECIPE), f"output_dir={out}", f"name={name}", "progress=false",
           "runtime.mode=sync", f"trainer.total_steps={args.steps}", "trainer.groups_per_step=4", "trainer.group_size=4",
           f"env.args.step_latency_s={args.latency}", f"runtime.max_inflight_trajectories={cap}", "eval.n_tasks=4",
           f"seed={args.seed}", f"checkpoint_every={args.steps}"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"arm {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    m = measure_run(out / name)
    return {"cap": cap, "wall_s": summary["wall_s"], "process_s": round(time.perf_counter() - t0, 1),
            "step_s": round(m.step_s, 3), "rollout_s": round(m.rollout_s, 3), "train_s": round(m.train_s, 3),
            "trajectory_s": round(m.trajectory.mean, 3), "env_step_s": round(m.env_step.mean, 3),
            "gen_turn_s": round(m.gen_turn.mean, 3), "turns": round(m.turns, 2)}


def predict(out: Path, source: str, cap: int) -> dict:
    m = measure_run(out / source)
    p = plan(m, Shape.of(m, max_inflight=cap))
    return {"wall_s": round(p.target.wall_s, 1), "step_s": round(p.target.step_s, 3),
            "rollout_s": round(p.target.rollout_s, 3), "own_wall_s": round(p.own.wall_s, 1),
            "bottleneck": p.target.bottleneck}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--latency", type=float, default=0.3)
    ap.add_argument("--cap-a", type=int, default=16)
    ap.add_argument("--cap-b", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.latency = 2, 0.1
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        out = Path(tmp)
        a = run_arm(out, "A", args.cap_a, args)
        a_to_b = predict(out, "A", args.cap_b)  # predicted before B runs
        b = run_arm(out, "B", args.cap_b, args)
        b_to_a = predict(out, "B", args.cap_a)

    def err(pred: float, real: float) -> float:
        return round((pred - real) / real, 3)

    result = {
        "name": "plan_accuracy", "machine": machine(),
        "workload": f"calculator_tiny sync, 4 groups x 4 a step, {args.steps} steps, simulated env step latency "
                    f"{args.latency} s (lognormal, sigma 0.5), eval 8 episodes before and after; A cap {args.cap_a}, "
                    f"B cap {args.cap_b}",
        "wall_error_a_predicts_b": err(a_to_b["wall_s"], b["wall_s"]),
        "wall_error_b_predicts_a": err(b_to_a["wall_s"], a["wall_s"]),
        "step_error_a_predicts_b": err(a_to_b["step_s"], b["step_s"]),
        "step_error_b_predicts_a": err(b_to_a["step_s"], a["step_s"]),
        "ratio": round(b["wall_s"] / a["wall_s"], 3), "ratio_over": "A",
        "target": "|wall error| <= 0.2",
        "arms": {"A": a, "B": b, "A->B": a_to_b, "B->A": b_to_a},
        "details": [f"measured A: {a}", f"measured B: {b}", f"predicted from A for B: {a_to_b}",
                    f"predicted from B for A: {b_to_a}"],
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
