"""Async three pools vs synchronous generate-then-train (B1), on this machine.

Workload (both arms, one invocation, same seeds): the tiny random model (model.kind=tiny, a real
tokenizer), the calculator environment, trainer.groups_per_step=8 x group_size=8 = 64 trajectories per
step, at most --slots (64) environments in use at once in either arm. Everything is real (the driver,
the built-in engine, the GRPO trainer, the env pool, the trajectory store) except one thing:

  SIMULATED: every env step first waits a lognormal time (env.args.step_latency_s = mean, default 0.5 s;
  env.args.step_latency_sigma = sigma of the underlying normal, default 0.5), standing in for a slow tool
  or remote environment. A random model rarely calls the tool, so most episodes end at their first env
  step (the number of turns is printed).

Arms:
- sync:  runtime.mode=sync, buffer.max_policy_lag=0: generate a step's 64 trajectories, then train on
  them, in one process (train runs on the engine's thread; all cores for both).
- async: runtime.mode=async, buffer.max_policy_lag=--lag (default 1): rollout pool (engine + agent
  loops), environment pool, and a spawned trainer process; rollouts for the next steps run while the
  trainer trains, within the staleness window (lag 1 is loomrl's default). loomrl by itself keeps up to
  64 x (1 + lag) episodes in flight; this benchmark holds both arms to the same --slots environments (a
  semaphore around each episode, one env slot held from reset to reward), so async gets no extra
  environments (--slots 0: no cap).

Throughput: steps/s over the steady part, from the metrics.jsonl "time" of step 1 to that of the last
step: (steps - 1) / (t_last - t_1). This leaves out start-up (process spawn, model load, pool pre-warm)
in both arms, and in async the first step's pipeline fill.

Bound (seconds per step, from this run's own measurements; async can be no faster than its slowest
limit, so bound = min(env-limit, window-limit, CPU-limit) throughput / sync throughput):
  S = sync step time = rollout phase (until the slowest of the step's 64 episodes ends) + train phase
  env limit     E = 64 / slots x l       l = mean time a sync episode holds its env slot (its simulated
                                           waits + its generation); the slots never idle
  window limit  W = S / (lag + 1)        a step's groups are admitted at most lag+1 steps ahead, and each
                                           step still needs its rollout phase and its train phase
  CPU limit     C = max(G', T')          G' = engine busy seconds per step, T' = train/seconds per step,
                                           both in the async run: on 2 cores async_threads (local.py) gives
                                           each process 1 torch thread, so each pool has one core and they
                                           can at best fully overlap (sync's G + T, each on all cores, is
                                           printed for comparison: the split changes both speeds)
  bound = S / max(E, W, C)    ratio = async steps/s / sync steps/s    efficiency = ratio / bound
Measured in one run each (--repeats 1 by default, to keep the benchmark short; medians when more).
The window limit is a property of the configuration (lag), not of a resource; with lag 1 it caps the
ratio at 2 whenever it binds (the line says which limit binds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, median, report  # noqa: E402

from loomrl.config import load_config  # noqa: E402
from loomrl.rollout import actor as rollout_actor  # noqa: E402
from loomrl.rollout.worker import RolloutWorker  # noqa: E402
from loomrl.runtime.local import LocalRollouts, async_threads, local_parts  # noqa: E402
from loomrl.runtime.parts import Parts  # noqa: E402
from loomrl.runtime.run import train  # noqa: E402


def trainer_cpu_s() -> float:
    """CPU seconds of the async trainer process so far (Linux /proc), 0 when there is none."""
    for child in mp.active_children():
        if child.name == "loomrl-trainer":
            try:
                fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def parity_reward(traj, task) -> dict[str, float]:
    """1 when the first sampled token id is even (about half of a random model's samples, so groups
    vary and every step trains); as tests/rewards_for_tests.py."""
    first = traj.turns[0].act_span.start if traj.turns and traj.turns[0].act_span else None
    return {"parity": float(first is not None and traj.token_ids[first] % 2 == 0)}


class SlotWorker(RolloutWorker):
    """RolloutWorker that holds one of `slots` environment slots per episode and records timings."""

    slots = 0  # set by the benchmark before a run; 0 = no cap (loomrl's own admission only)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sem = asyncio.Semaphore(self.slots) if self.slots else None
        self.slot_s = 0.0  # summed seconds episodes held a slot
        self.episodes = 0
        self.turns = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.group_done = 0.0  # wall time the latest group finished

    async def run_one(self, loop, task, group_id, position, stream):
        if self._sem is not None:
            await self._sem.acquire()
        t0 = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            traj = await super().run_one(loop, task, group_id, position, stream)
            self.turns += len(traj.all_turns())
            self.episodes += 1
            self.slot_s += time.perf_counter() - t0
            return traj
        finally:
            self.in_flight -= 1
            if self._sem is not None:
                self._sem.release()

    async def run_group(self, position):
        group = await super().run_group(position)
        self.group_done = time.time()
        return group


class BenchRollouts(LocalRollouts):
    """The local rollout side, adding cumulative engine and env-slot counters to every step's metrics record
    (the runtime logs the engine's counters per step, not summed)."""

    def step_metrics(self):
        side = self.side()
        m = side.engine.metrics
        extra = {"bench/engine_busy_s": m.busy_s or 0.0, "bench/generated_tokens": m.generated_tokens,
                 "bench/cpu_self_s": time.process_time(), "bench/cpu_trainer_s": trainer_cpu_s()}
        worker = side.worker
        if isinstance(worker, SlotWorker):
            extra.update({"bench/group_done": worker.group_done, "bench/slot_s": worker.slot_s,
                          "bench/episodes": worker.episodes, "bench/turns": worker.turns,
                          "bench/max_in_flight": worker.max_in_flight})
        return {**super().step_metrics(), **extra}


def run_arm(args, mode: str, out_dir: str, tag: str) -> dict:
    lag = 0 if mode == "sync" else args.lag
    overrides = [
        f"name=b1-{mode}-{tag}", f"output_dir={out_dir}", f"seed={args.seed}", "progress=false",
        "checkpoint_every=0", "model.kind=tiny", f"sampling.max_tokens={args.max_tokens}",
        f"agent.max_turns={args.max_turns}", "agent.max_context_tokens=512",
        f"env.args.step_latency_s={args.latency}", f"env.args.step_latency_sigma={args.sigma}", "env.n_train=256",
        "env.n_heldout=16", "eval.n_tasks=0", "eval.before=false", "eval.after=false",
        f"trainer.groups_per_step={args.groups}", f"trainer.group_size={args.group_size}",
        f"trainer.total_steps={args.steps}", "trainer.micro_batch_size=16", "trainer.lr=1e-4",
        f"runtime.mode={mode}", f"buffer.max_policy_lag={lag}", "reward.function=async_vs_sync:parity_reward",
    ]
    cfg = load_config(None, overrides)
    SlotWorker.slots = args.slots
    rollout_actor.RolloutWorker = SlotWorker  # the rollout side builds its worker from this name

    def bench_parts(cfg, checkpoint) -> Parts:  # the real local parts, with the counting rollout side
        return local_parts(cfg, checkpoint, BenchRollouts(cfg, checkpoint))

    t0 = time.time()
    summary = train(cfg, parts=bench_parts)
    wall = time.time() - t0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    if len(steps) < 2:
        raise SystemExit(f"{mode}: {len(steps)} step records; need --steps >= 2")
    times = [r["time"] for r in steps]
    n = len(steps) - 1  # intervals in the steady window
    window = times[-1] - times[0]
    busy = [b["bench/engine_busy_s"] - a["bench/engine_busy_s"] for a, b in zip(steps, steps[1:])]
    rollout = [b["bench/group_done"] - a["time"] for a, b in zip(steps, steps[1:])]
    train_phase = [b["time"] - b["bench/group_done"] for b in steps[1:]]
    last = steps[-1]
    episodes = max(last["bench/episodes"] - steps[0]["bench/episodes"], 1)
    cpu_self = (last["bench/cpu_self_s"] - steps[0]["bench/cpu_self_s"]) / n
    cpu_trainer = (last["bench/cpu_trainer_s"] - steps[0]["bench/cpu_trainer_s"]) / n
    return {
        "mode": mode, "lag": lag, "steps": summary["steps"], "wall_s": wall,
        "steps_per_s": n / window, "step_s": window / n,
        "engine_busy_s": statistics.mean(busy),
        "train_s": statistics.mean(r.get("train/seconds", 0.0) for r in steps[1:]),
        "trained_steps": sum(1 for r in steps if "train/seconds" in r),
        # phases exist in sync only (async overlaps them)
        "rollout_phase_s": statistics.mean(rollout) if mode == "sync" else None,
        "train_phase_s": statistics.mean(train_phase) if mode == "sync" else None,
        # episodes finished in the steady window (the first step's wait for the env pool's pre-warm left out)
        "slot_s_per_episode": (last["bench/slot_s"] - steps[0]["bench/slot_s"]) / episodes,
        "turns_per_episode": (last["bench/turns"] - steps[0]["bench/turns"]) / episodes,
        "max_in_flight": last["bench/max_in_flight"],
        "env_busy": (last["bench/slot_s"] - steps[0]["bench/slot_s"]) / (args.slots * window) if args.slots else None,
        "cpu_s_rollout_process": cpu_self, "cpu_s_trainer_process": cpu_trainer,
        "cores_busy": (cpu_self + cpu_trainer) / (window / n),
        "staleness_max": max(r.get("staleness_max", 0) for r in steps),
        "rollouts": summary["rollouts"],
    }


def _rounded(arm: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in arm.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per arm (default 30)")
    ap.add_argument("--latency", type=float, default=0.5, help="simulated env step latency, mean seconds")
    ap.add_argument("--sigma", type=float, default=0.5, help="sigma of the latency's underlying normal")
    ap.add_argument("--lag", type=int, default=1, help="async arm's buffer.max_policy_lag (sync uses 0)")
    ap.add_argument("--slots", type=int, default=64, help="environments in use at once, both arms; 0 = no cap")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved sync/async pairs (default 1: one run "
                    "each, to keep the benchmark short; medians when more)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.groups, args.group_size, args.max_tokens, args.max_turns = 3, 2, 4, 8, 2
        args.latency, args.repeats = 0.1, 1
    logging.basicConfig(level=logging.WARNING)
    out_dir = tempfile.mkdtemp(prefix="loomrl-b1-")
    per_step = args.groups * args.group_size
    syncs, asyncs = [], []
    try:
        for r in range(args.repeats):
            syncs.append(run_arm(args, "sync", out_dir, str(r)))
            asyncs.append(run_arm(args, "async", out_dir, str(r)))
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)

    def med(arms, key):
        return median([a[key] for a in arms])

    S = med(syncs, "step_s")
    ell = med(syncs, "slot_s_per_episode")
    slots = args.slots or per_step * (1 + args.lag)  # uncapped: loomrl's own window holds at most this many
    E = per_step / slots * ell
    W = S / (args.lag + 1)
    G, T = med(syncs, "engine_busy_s"), med(syncs, "train_s")
    G_a, T_a = med(asyncs, "engine_busy_s"), med(asyncs, "train_s")
    C = max(G_a, T_a)
    limits = {"env": E, "window": W, "cpu": C}
    binding = max(limits, key=limits.get)
    bound = divide(S, limits[binding], f"bound S / {binding} limit")
    sync_rate, async_rate = med(syncs, "steps_per_s"), med(asyncs, "steps_per_s")
    ratio = divide(async_rate, sync_rate, "async steps/s / sync steps/s")
    eff = efficiency(ratio, bound, "async_vs_sync", bound_tolerance(args.quick))
    eng_t, tr_t = async_threads(load_config(None, ["runtime.mode=async"]))
    cores = os.cpu_count()
    details = [
        f"simulated: lognormal env step latency, mean {args.latency} s, sigma {args.sigma} (of the underlying "
        "normal), before every env step; everything else real",
        f"bound = S / max(E, W, C) = {S:.3f} / max({E:.3f}, {W:.3f}, {C:.3f}) = {bound:.3f} ({binding} limit binds)",
        f"  S = {S:.3f} s: sync step = rollout phase {med(syncs, 'rollout_phase_s'):.3f} s (until the slowest of "
        f"{per_step} episodes) + train phase {med(syncs, 'train_phase_s'):.3f} s",
        f"  E = {per_step}/{slots} x l = {per_step}/{slots} x {ell:.3f} s: env slots busy all the time (l = mean time a "
        f"sync episode holds its slot, {med(syncs, 'turns_per_episode'):.2f} turns: waits + generation)",
        f"  W = S/(lag+1) = {S:.3f}/{args.lag + 1}: staleness window (a step's groups start at most lag+1 steps "
        "ahead and each step still needs its rollout and train phases)",
        f"  C = max(G', T') = max({G_a:.3f}, {T_a:.3f}): async engine busy s/step ({eng_t} torch thread(s) in the "
        f"rollout process) and async train/seconds per step ({tr_t} in the trainer process); at best they overlap",
        f"CPU and the thread split: sync runs engine and trainer one after the other on all {cores} cores "
        f"(G = {G:.3f} + T = {T:.3f} = {G + T:.3f} s/step); async splits the cores between its two processes "
        f"(async_threads), which makes generation {G_a / G:.2f}x and training {T_a / T:.2f}x the sync seconds per "
        "step (smaller engine batches, one core each, contention)" if G and T else "CPU: no engine/train seconds",
        f"cores busy (process CPU s / wall s, steady window): sync {med(syncs, 'cores_busy'):.2f}, async "
        f"{med(asyncs, 'cores_busy'):.2f} of {cores}; CPU s/step: sync {med(syncs, 'cpu_s_rollout_process'):.3f}, "
        f"async rollout process {med(asyncs, 'cpu_s_rollout_process'):.3f} + trainer process "
        f"{med(asyncs, 'cpu_s_trainer_process'):.3f} (wall busy above > CPU s: waiting for a core, e.g. other load)",
        f"env slots busy: sync {med(syncs, 'env_busy'):.2f}, async {med(asyncs, 'env_busy'):.2f} of {slots}"
        if args.slots else "env slots: uncapped (loomrl's admission window only)",
        f"async max episodes in flight {max(a['max_in_flight'] for a in asyncs)}, max staleness "
        f"{max(a['staleness_max'] for a in asyncs)}; steps trained (with signal): sync "
        f"{syncs[-1]['trained_steps']}, async {asyncs[-1]['trained_steps']}",
    ]
    for i, (s, a) in enumerate(zip(syncs, asyncs)):
        details.append(f"repeat {i + 1}: sync {s['steps_per_s']:.3f} steps/s ({s['wall_s']:.0f} s wall), async "
                       f"{a['steps_per_s']:.3f} steps/s ({a['wall_s']:.0f} s wall), ratio "
                       f"{a['steps_per_s'] / s['steps_per_s']:.2f}")
    if args.quick:
        details.append(QUICK_NOTE)
    report({
        "name": "async_vs_sync",
        "machine": machine(),
        "workload": (f"tiny model, {args.groups}x{args.group_size}={per_step} episodes/step, {args.slots or 'uncapped'} "
                     f"env slots, max_tokens {args.max_tokens}, max_turns {args.max_turns}, {args.steps} steps per "
                     f"arm, async lag {args.lag}, seed {args.seed}, {args.repeats} repeat(s)"),
        "sync_steps_per_s": round(sync_rate, 4),
        "async_steps_per_s": round(async_rate, 4),
        "ratio": round(ratio, 3),
        "bound": round(bound, 3),
        "efficiency": round(eff, 3),
        "anchors": "AReaL 2.77x, ROLL Flash 2.72x (agentic)",
        "limits_s": {k: round(v, 4) for k, v in limits.items()},
        "arms": {"sync": {"steps_per_s": round(sync_rate, 4), "runs": [_rounded(a) for a in syncs]},
                 "async": {"steps_per_s": round(async_rate, 4), "runs": [_rounded(a) for a in asyncs]}},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
