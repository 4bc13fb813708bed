"""Staleness (B3): what a larger policy lag buys in throughput, and what it costs in learning, with naive
PPO (ratio against the behaviour policy) against decoupled PPO (AReaL: ratio against the proximal
policy, the trainer's weights before the step, with the behaviour/proximal importance weight).

Runs: async training of the tiny model for the same number of steps at buffer.max_policy_lag in
{0, 1, 2, 4, 8}, each with both losses, same seed. The task is learnable by a random tiny model within
a few steps: the reward is 1 when the first sampled token id is even (it starts near 0.5). Environment
steps wait a simulated lognormal latency (declared below) so that rollouts take time worth overlapping.

Throughput: training steps per second between the first and the last step (metrics.jsonl times).
Bound: at lag 0 the next step's rollouts cannot start before the weights they need, so a step costs
rollout R + training T. With lag L, admission lets (L + 1) steps' groups run at once: their
(latency-bound) rollouts overlap each other and training, so a step costs at least max(R / (L + 1), T).
From the lag-0 run's own numbers (T = the trainer's measured seconds per step, R = step period - T):
    bound(L) = (R + T) / max(R / (L + 1), T);  ratio = steps/s at the largest lag / steps/s at lag 0.
(The engine's own compute is inside R and does not parallelise; with the tiny model it is small, which
is what makes R / (L + 1) reachable here.)
Learning: mean rollout reward over the last half of the steps, per lag and loss.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def even_first_token(traj, task) -> dict[str, float]:
    """The learnable reward: 1 when the first sampled token id is even."""
    turn = traj.turns[0] if traj.turns else None
    return {"even": float(turn is not None and turn.act_span is not None and turn.act_span.end > turn.act_span.start
                          and traj.token_ids[turn.act_span.start] % 2 == 0)}


def run(out: Path, lag: int, loss: str, args) -> dict:
    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.local import LocalRun

    name = f"lag{lag}-{loss}"
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={out}", f"name={name}", "progress=false", "seed=0", "runtime.mode=async",
        f"buffer.max_policy_lag={lag}", f"trainer.loss={loss}", f"trainer.total_steps={args.steps}",
        f"trainer.groups_per_step={args.groups}", f"trainer.group_size={args.group_size}", "trainer.lr=1e-3",
        "sampling.max_tokens=6", "agent.max_turns=1", f"env.step_latency_s={args.latency}",
        f"env.step_latency_sigma={args.sigma}", "reward.function=staleness:even_first_token", "eval.n_tasks=0",
        "checkpoint_every=0"])
    LocalRun(cfg).train()
    steps = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train" and m.get("step", 0) > 0]
    period = (steps[-1]["time"] - steps[0]["time"]) / max(len(steps) - 1, 1)
    train_s = median([m["train/seconds"] for m in steps if "train/seconds" in m] or [0.0])
    rewards = [m["rollout/reward_mean"] for m in steps if "rollout/reward_mean" in m]
    late = rewards[len(rewards) // 2:] or rewards
    return {"lag": lag, "loss": loss, "steps_per_s": 1.0 / period, "step_s": period, "train_s": train_s,
            "reward_late": sum(late) / len(late), "reward_first": rewards[0] if rewards else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lags", default="0,1,2,4,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--latency", type=float, default=0.3, help="mean simulated env step latency (s)")
    ap.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the env latency")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lags = [int(x) for x in args.lags.split(",")]
    out = Path(tempfile.mkdtemp(prefix="loomrl-staleness-"))
    rows = []
    try:
        for lag in lags:
            for loss in ("ppo_clip", "decoupled_ppo"):
                rows.append(run(out, lag, loss, args))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = [r for r in rows if r["lag"] == lags[0] and r["loss"] == "ppo_clip"][0]
    top = [r for r in rows if r["lag"] == lags[-1] and r["loss"] == "ppo_clip"][0]
    T = base["train_s"]
    R = max(base["step_s"] - T, 1e-9)
    bound = (R + T) / max(R / (lags[-1] + 1), T)
    ratio = top["steps_per_s"] / base["steps_per_s"]
    details = [f"lag {r['lag']} {r['loss']}: {r['steps_per_s']:.3f} steps/s ({r['steps_per_s'] / base['steps_per_s']:.2f}x "
               f"lag {lags[0]}), reward first step {r['reward_first']:.3f}, last half {r['reward_late']:.3f}"
               for r in rows]
    details.append(f"bound from the lag-{lags[0]} run: R = {R:.2f}s rollout, T = {T:.2f}s training per step; "
                   f"(R + T) / max(R / {lags[-1] + 1}, T) = {bound:.2f}")
    details.append(f"simulated: every env step waits a lognormal time, mean {args.latency}s, sigma {args.sigma}; "
                   "model, engine, sandboxes and training are real (tiny random model, 2 cores)")
    report({
        "name": "staleness",
        "machine": machine(),
        "workload": f"async, {args.steps} steps x {args.groups} groups x {args.group_size}, tiny model, lags {lags}",
        "ratio": round(ratio, 3),
        "ratio_of": f"steps/s at lag {lags[-1]} over lag {lags[0]} (ppo_clip)",
        "bound": round(bound, 3),
        "efficiency": round(ratio / bound, 3),
        "arms": {f"lag{r['lag']}-{r['loss']}": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                 for r in rows},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
