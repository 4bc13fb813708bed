"""Staleness (B3): what a larger policy lag buys in throughput, and what it costs in learning, with naive
PPO (ratio against the behaviour policy) against decoupled PPO (AReaL: ratio against the proximal
policy, the trainer's weights before the step, with the behaviour/proximal importance weight).

Runs: async training of the tiny model for the same number of steps at buffer.max_policy_lag in
{0, 1, 2, 4, 8}, each with both losses, same seed. Environment steps wait a simulated lognormal latency
(declared below) so that rollouts take time worth overlapping.

The task must be learnable by a random tiny model in a few steps. "The first token id is even" is not
(tried: the reward stayed ~0.5 at every lag with both losses), nor is any set of half the vocabulary:
at the default weight std (0.02) the tiny model's next-token distribution is uniform to 3 decimals
(entropy 10.79 of a possible 10.80 nats) and 20 GRPO steps moved such a set's probability by 0.05. So
the runs use a peaked tiny model (model.tiny.init_std = 0.3: entropy ~7.9 nats), and the rewarded set
is tied to it: the tokens the *initial* model ranks 2nd to k-th at the first response position
(mean over the run's prompts, from a one-step probe run), k chosen so that the set starts with
probability ~0.4; the favourite is left out. RL can move mass among a few hundred tokens the model
already samples in a few steps. The probe run also checks that the model rebuilt here is the runs'
initial model (its logprobs must equal the ones the engine recorded).

Throughput: training steps per second between the first and the last step (metrics.jsonl times).
Bound: at lag 0 the next step's rollouts cannot start before the weights they need, so a step costs
rollout R + training T. With lag L, admission lets (L + 1) steps' groups run at once: their
(latency-bound) rollouts overlap each other and training, so a step costs at least max(R / (L + 1), T).
From the lag-0 run's own numbers (T = the trainer's measured seconds per step, R = step period - T):
    bound(L) = (R + T) / max(R / (L + 1), T);  ratio = steps/s at the largest lag / steps/s at lag 0.
The rollout side's own CPU work does not overlap with itself: the engine, env and reward code and the
hand-off of groups to the trainer run in this process, on the cores the async split gives it. With C =
this process's CPU seconds per step in the lag-0 run (getrusage; the trainer is another process) over
those cores, a step costs at least C as well:
    bound(L) = (R + T) / max(R / (L + 1), T, C).
Learning, at equal steps: mean rollout reward over the last half of the steps, and the step at which the
reward (mean of 3 steps) first reaches --reach, per lag and loss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, median, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


_TARGET: dict[str, frozenset[int]] = {}


def preferred_first_token(traj, task) -> dict[str, float]:
    """The learnable reward: 1 when the first sampled token is in the target set (file named by
    LOOMRL_B3_TARGET: the initial model's 2nd..k-th ranked first tokens)."""
    path = os.environ["LOOMRL_B3_TARGET"]
    if path not in _TARGET:
        _TARGET[path] = frozenset(json.loads(Path(path).read_text()))
    turn = traj.turns[0] if traj.turns else None
    hit = (turn is not None and turn.act_span is not None and turn.act_span.end > turn.act_span.start
           and traj.token_ids[turn.act_span.start] in _TARGET[path])
    return {"preferred": float(hit)}


def no_reward(traj, task) -> dict[str, float]:
    """The probe run only collects prompts and first-token logprobs."""
    return {"none": 0.0}


def _overrides(out: Path, name: str, args) -> list[str]:
    return [f"output_dir={out}", f"name={name}", "progress=false", "seed=0", f"trainer.total_steps={args.steps}",
            f"trainer.groups_per_step={args.groups}", f"trainer.group_size={args.group_size}", f"trainer.lr={args.lr}", f"model.tiny.init_std={args.init_std}",
            "sampling.max_tokens=6", "agent.max_turns=1", f"env.n_train={args.prompts}", f"env.args.step_latency_s={args.latency}",
            f"env.args.step_latency_sigma={args.sigma}", "eval.n_tasks=0", "checkpoint_every=0"]


def make_target(out: Path, args) -> tuple[Path, float]:
    """Write the target set; returns its path and the initial model's probability of it (mean over prompts)."""
    import torch

    from loomrl.config import load_config
    from loomrl.model.loader import load_run_model
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        *_overrides(out, "probe", args), "runtime.mode=sync", "trainer.total_steps=1",
        "reward.function=staleness:no_reward"])
    train(cfg)
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    model, _ = load_run_model(cfg.model, None)
    prompts = {tuple(r["token_ids"][: r["prompt_len"]]) for r in rows}
    with torch.no_grad():
        last = torch.stack([model(torch.tensor([list(p)])).logits[0, -1] for p in prompts])  # [P, V]
        # The rebuilt model is the runs' initial one: its logprob of each first sampled token equals
        # what the engine recorded at version 0.
        for r in rows:
            t = r["prompt_len"]
            logp = torch.log_softmax(model(torch.tensor([r["token_ids"][:t]])).logits[0, -1] / cfg.sampling.temperature, -1)
            if abs(float(logp[r["token_ids"][t]]) - r["logprobs"][t]) > 1e-3:
                raise RuntimeError("the rebuilt tiny model is not the one the runs start from")
    probs = torch.softmax(last / cfg.sampling.temperature, -1)  # [P, V]
    order = probs.mean(0).argsort(descending=True)
    mass = probs.mean(0)[order]
    # Ranks 2..k, k the first at which their mass reaches args.target_mass (the favourite is left out,
    # so that the reward is not simply "keep doing what you do").
    k = int((mass[1:].cumsum(0) < args.target_mass).sum()) + 2
    target = order[1:k].tolist()
    p0 = float(probs[:, target].sum(-1).mean())
    path = out / "target.json"
    path.write_text(json.dumps(target))
    return path, p0


def run(out: Path, lag: int, loss: str, args) -> dict:
    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.local import async_threads
    from loomrl.runtime.run import train

    name = f"lag{lag}-{loss}"
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        *_overrides(out, name, args), "runtime.mode=async", f"buffer.max_policy_lag={lag}", f"trainer.loss.kind={loss}",
        "reward.function=staleness:preferred_first_token"])
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    train(cfg)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    steps = [m for m in read_metrics(cfg.run_dir) if m.get("kind") == "train" and m.get("step", 0) > 0]
    period = (steps[-1]["time"] - steps[0]["time"]) / max(len(steps) - 1, 1)
    train_s = median([m["train/seconds"] for m in steps if "train/seconds" in m] or [0.0])
    rewards = [m["rollout/reward_mean"] for m in steps if "rollout/reward_mean" in m]
    late = rewards[len(rewards) // 2:] or rewards
    return {"lag": lag, "loss": loss, "steps_per_s": 1.0 / period, "step_s": period, "train_s": train_s,
            "reward_late": sum(late) / len(late), "reward_first": rewards[0] if rewards else None,
            "rewards": [round(r, 3) for r in rewards], "steps_to": _steps_to(rewards, args.reach),
            # this process's CPU per step, over the cores it has (engine threads in the async split)
            "rollout_cpu_s": cpu_s / max(len(steps), 1) / async_threads(cfg)[0],
            "engine_busy_s": median([m.get("engine/busy_s", 0.0) for m in steps])}


def _steps_to(rewards: list[float], level: float, span: int = 3) -> int | None:
    """The first step at which the mean reward of the last `span` steps reaches `level` (None: never)."""
    for i in range(span, len(rewards) + 1):
        if sum(rewards[i - span:i]) / span >= level:
            return i
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lags", default="0,1,2,4,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--reach", type=float, default=0.8, help="learning speed: steps until the reward reaches this")
    ap.add_argument("--prompts", type=int, default=1, help="distinct training prompts (1: the set fits exactly)")
    ap.add_argument("--init-std", type=float, default=0.3, help="tiny model's weight std (peaked, learnable)")
    ap.add_argument("--target-mass", type=float, default=0.4, help="initial probability of the rewarded set")
    ap.add_argument("--latency", type=float, default=0.3, help="mean simulated env step latency (s)")
    ap.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the env latency")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.lags, args.steps, args.groups, args.group_size, args.latency = "0,1", 3, 2, 4, 0.1
    lags = [int(x) for x in args.lags.split(",")]
    out = Path(tempfile.mkdtemp(prefix="loomrl-staleness-"))
    rows = []
    try:
        target, p0 = make_target(out, args)
        os.environ["LOOMRL_B3_TARGET"] = str(target)
        for lag in lags:
            for loss in ("ppo_clip", "decoupled_ppo"):
                rows.append(run(out, lag, loss, args))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = [r for r in rows if r["lag"] == lags[0] and r["loss"] == "ppo_clip"][0]
    top = [r for r in rows if r["lag"] == lags[-1] and r["loss"] == "ppo_clip"][0]
    T = base["train_s"]
    R = max(base["step_s"] - T, 1e-9)
    C = base["rollout_cpu_s"]
    bound = divide(R + T, max(R / (lags[-1] + 1), T, C), "bound (R + T) / max(R / (L + 1), T, C)")
    ratio = divide(top["steps_per_s"], base["steps_per_s"], f"steps/s at lag {lags[-1]} / at lag {lags[0]}")
    eff = efficiency(ratio, bound, "staleness", bound_tolerance(args.quick))
    details = [f"lag {r['lag']} {r['loss']}: {r['steps_per_s']:.3f} steps/s ({r['steps_per_s'] / base['steps_per_s']:.2f}x "
               f"lag {lags[0]}), reward first step {r['reward_first']:.3f}, last half {r['reward_late']:.3f}, "
               f"steps to {args.reach} (3-step mean): {r['steps_to'] if r['steps_to'] is not None else 'not reached'}"
               for r in rows]
    details.append(f"bound from the lag-{lags[0]} run: R = {R:.2f}s rollout, T = {T:.2f}s training, C = {C:.2f}s "
                   f"rollout-side CPU per step (engine busy {base['engine_busy_s']:.2f}s of it); "
                   f"(R + T) / max(R / {lags[-1] + 1}, T, C) = {bound:.2f}; without C: "
                   f"{(R + T) / max(R / (lags[-1] + 1), T):.2f}")
    details.append(f"task: reward 1 when the first sampled token is one the initial model ranks 2nd to k-th "
                   f"(initial probability of the set {p0:.3f}); learning = mean rollout reward over the last half")
    details.append(f"simulated: every env step waits a lognormal time, mean {args.latency}s, sigma {args.sigma}; "
                   "model, engine, sandboxes and training are real (tiny random model, 2 cores)")
    if args.quick:
        details.append(QUICK_NOTE)
    report({
        "name": "staleness",
        "machine": machine(),
        "workload": f"async, {args.steps} steps x {args.groups} groups x {args.group_size}, tiny model, lags {lags}",
        "ratio": round(ratio, 3),
        "ratio_of": f"steps/s at lag {lags[-1]} over lag {lags[0]} (ppo_clip)",
        "bound": round(bound, 3),
        "efficiency": round(eff, 3),
        "arms": {f"lag{r['lag']}-{r['loss']}": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                 for r in rows},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
