"""B9: throughput vs bias for strict in-order, Forge's sliding windows and greedy first-finished.

SIMULATED (discrete-event, no model, no engine): the real samplers of loomrl.buffer.samplers decide
which finished GRPO groups each training batch takes; durations and the trainer's step time are drawn
or fixed numbers, not measured.

Model. Tasks come in a fixed order (submission index i); a fraction p of them is "hard". Task i's
group takes d_i seconds, lognormal with mean m (easy) or k*m (hard) and log-sd s. At most C groups
are launched and not yet consumed (running, or finished and waiting in the sampler), as with the
runtime's admission limit: a new group is launched whenever one is taken. The trainer, when idle,
takes a batch of B groups once the sampler has B ready, and spends T seconds per step; the policy
version is the number of steps done. A run ends after S steps. Every arm sees the same tasks and
durations for a seed (the i-th launched group is task i in every arm); medians over the seeds.

Arms: window W = 1 (strict in-order), 2, 4, 8, 16, 32, 64; greedy first-finished ("fifo", = W=inf,
what Buffer does today); oldest_first and freshest_first (never wait either, differ in which ready
groups they take). Each arm runs twice: without any staleness drop, and dropping a taken group whose
policy lag exceeds L (default C // B, the most strict order ever reaches here), as Buffer.take does;
the trainer then takes more to fill its batch.

Throughput = groups trained per second = S*B / (time the S-th step ends). ratio = arm / strict
in-order (W=1). Bias: share of hard tasks in the trained batches, over the first K steps and over
all S steps, minus the share in the population (the first S*B tasks, the ones strict order trains);
see batch_bias. Lag: steps between a group's launch and the step that trains it (its policy lag),
for hard and easy groups.

Bound. The ideal arm launches a new group whenever one FINISHES (the buffer never holds a slot: a
zero-wait consumer), trains in completion order and drops nothing. On every sample path its k-th
launch and k-th finish are no later than under any arm here (a group is taken only after it finishes,
launches follow takes, and order statistics are monotone), and any arm's step s starts no earlier than
its (s*B)-th finish, so the ideal's throughput bounds every arm's: bound = ideal / strict, efficiency =
greedy ratio / bound = greedy / ideal (headline: no-drop runs). Also printed, analytic:
X <= min(C / E[d], B / T) with E[d] = m*(1 - p + p*k) (Little's law on the C slots; the trainer's
rate), which a finite run cannot reach exactly (fill at the start, variance).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bound_tolerance, efficiency, machine, median, report  # noqa: E402

from loomrl.buffer.samplers import make_sampler  # noqa: E402

ARMS = [("strict W=1", "window", 1), ("W=2", "window", 2), ("W=4", "window", 4), ("W=8", "window", 8),
        ("W=16", "window", 16), ("W=32", "window", 32), ("W=64", "window", 64), ("greedy W=inf (fifo)", "fifo", None),
        ("oldest_first", "oldest_first", None), ("freshest_first", "freshest_first", None)]


@dataclass(frozen=True, slots=True)
class Bias:
    """An attribute's mean in the consumed batches vs in the population.

    With 0/1 attributes (e.g. 1 = hard task) the means are shares. difference = batch - population
    (0 = unbiased; < 0: the batches under-represent the attribute); ratio = batch / population
    (1 = unbiased; 1.0 when both are 0, inf when only the population's is 0)."""

    batch_mean: float
    population_mean: float
    difference: float
    ratio: float
    n_batch: int
    n_population: int


def batch_bias(batch_attrs, population_attrs) -> Bias:
    """Bias of the consumed groups' attribute (iterable of numbers or bools, one per group taken)
    against the submitted population's (one per group submitted). Raises ValueError if either is empty."""
    batch = [float(x) for x in batch_attrs]
    population = [float(x) for x in population_attrs]
    if not batch or not population:
        raise ValueError(f"batch_bias needs non-empty inputs (got {len(batch)} batch, {len(population)} population)")
    b, p = sum(batch) / len(batch), sum(population) / len(population)
    ratio = b / p if p != 0 else (1.0 if b == 0 else math.inf)
    return Bias(batch_mean=b, population_mean=p, difference=b - p, ratio=ratio, n_batch=len(batch),
                n_population=len(population))


def draw_tasks(seed: int, n: int, p_hard: float, mean: float, hard_factor: float, sigma: float):
    rng = random.Random(seed)
    hard, dur = [], []
    for _ in range(n):
        h = rng.random() < p_hard
        m = mean * (hard_factor if h else 1.0)
        hard.append(h)
        dur.append(rng.lognormvariate(math.log(m) - sigma * sigma / 2, sigma))
    return hard, dur


def simulate(sampler, hard, dur, C: int, B: int, T: float, S: int, release_on_finish: bool = False,
             max_lag: int | None = None):
    """One run. The trainer, when idle, takes a batch once B groups are ready. With max_lag, a group whose
    policy lag (steps since its launch) exceeds it when taken is dropped, as Buffer.take does, and the
    trainer takes more (again once as many as it lacks are ready) to fill its batch. Returns throughput and
    the records of what was trained and dropped."""
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = group finished / 1 = step done, index)
    launched_version: list[int] = []
    nxt = 0
    version = 0
    busy = False
    batch: list[int] = []
    trained: list[tuple[int, int]] = []  # (index, step at which it was trained)
    dropped: list[int] = []

    def launch(t: float, count: int) -> None:  # task `nxt` is the nxt-th launch in every arm
        nonlocal nxt
        if nxt + count > len(dur):
            if not release_on_finish:
                raise RuntimeError(f"ran out of drawn tasks ({len(dur)}): draw more")
            count = len(dur) - nxt  # the ideal arm: tasks past S*B + C finish after the S*B-th finish
        for _ in range(count):
            sampler.submitted(nxt)
            launched_version.append(version)
            heapq.heappush(events, (t + dur[nxt], 0, nxt))
            nxt += 1

    def try_step(t: float) -> None:
        nonlocal busy
        if busy:
            return
        if max_lag is None:
            if sampler.takeable() < B:
                return
            batch.extend(i for i, _ in sampler.take(B))
            freed = B
        else:
            freed = 0  # take what the batch lacks once that many are ready; dropped ones are replaced
            while len(batch) < B and sampler.takeable() >= B - len(batch):
                for i, _ in sampler.take(B - len(batch)):
                    freed += 1
                    (dropped if version - launched_version[i] > max_lag else batch).append(i)
        if not release_on_finish:
            launch(t, freed)
        if len(batch) == B:
            trained.extend((i, version) for i in batch)
            batch.clear()
            busy = True
            heapq.heappush(events, (t + T, 1, -1))

    launch(0.0, C)
    t = 0.0
    while version < S:
        t, kind, i = heapq.heappop(events)
        if kind == 0:
            sampler.finished(i, None)
            if release_on_finish:
                launch(t, 1)
        else:
            busy = False
            version += 1
            if version == S:
                break
        try_step(t)
    lags = [v - launched_version[i] for i, v in trained]
    return {"groups_per_s": S * B / t, "seconds": t, "trained": trained, "lags": lags, "dropped": dropped,
            "launched": nxt, "trainer_busy": S * T / t}


def arm_stats(run, hard, S: int, B: int, K: int) -> dict:
    trained = run["trained"]
    population = hard[: S * B]
    first = batch_bias([hard[i] for i, v in trained if v < K], population)
    overall = batch_bias([hard[i] for i, _ in trained], population)
    lags = sorted(run["lags"])
    hard_lags = [lag for (i, _), lag in zip(trained, run["lags"]) if hard[i]]
    easy_lags = [lag for (i, _), lag in zip(trained, run["lags"]) if not hard[i]]
    dropped = run["dropped"]
    return {"groups_per_s": run["groups_per_s"], "hard_first_k": first.batch_mean, "hard_all": overall.batch_mean,
            "bias_first_k": first.difference, "bias_all": overall.difference, "bias_ratio_first_k": first.ratio,
            "bias_ratio_all": overall.ratio, "population_hard": overall.population_mean,
            "lag_mean": statistics.fmean(lags), "lag_hard": statistics.fmean(hard_lags) if hard_lags else 0.0,
            "lag_easy": statistics.fmean(easy_lags) if easy_lags else 0.0, "lag_max": lags[-1],
            "dropped_share": len(dropped) / (len(dropped) + len(trained)),
            "dropped_hard_share": sum(hard[i] for i in dropped) / len(dropped) if dropped else 0.0,
            "trainer_busy": run["trainer_busy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="S, training steps per run")
    ap.add_argument("--batch", type=int, default=8, help="B, groups per step")
    ap.add_argument("--concurrency", type=int, default=32, help="C, groups launched and not yet consumed")
    ap.add_argument("--step-time", type=float, default=0.4, help="T, trainer seconds per step")
    ap.add_argument("--mean", type=float, default=1.0, help="m, mean duration of an easy group (s)")
    ap.add_argument("--hard-share", type=float, default=0.3, help="p, share of hard tasks")
    ap.add_argument("--hard-factor", type=float, default=3.0, help="k, hard mean / easy mean")
    ap.add_argument("--sigma", type=float, default=0.5, help="s, log-sd of the lognormal")
    ap.add_argument("--first-k", type=int, default=10, help="K, early steps for the early bias")
    ap.add_argument("--max-lag", type=int, default=None,
                    help="L for the drop runs: drop groups staler than L steps (default C // B, which strict order "
                         "never exceeds here)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds = 30, 1
    C, B, T, S, K = args.concurrency, args.batch, args.step_time, args.steps, args.first_k
    if C < B:
        ap.error(f"--concurrency ({C}) must be >= --batch ({B}), or no batch can ever fill")

    L = C // B if args.max_lag is None else args.max_lag
    ideal_key, strict_key, greedy_key = "ideal (slot freed at finish)", "strict W=1", "greedy W=inf (fifo)"
    modes = {"no_drop": None, f"drop_lag_gt_{L}": L}
    t0 = time.perf_counter()
    runs: dict[str, dict[str, list[dict]]] = {m: {name: [] for name, _, _ in ARMS} for m in modes}
    runs["no_drop"][ideal_key] = []
    for seed in range(args.seeds):
        hard, dur = draw_tasks(seed, 4 * S * B + C, args.hard_share, args.mean, args.hard_factor, args.sigma)
        for mode, max_lag in modes.items():
            for name, kind, window in ARMS:
                run = simulate(make_sampler(kind, window), hard, dur, C, B, T, S, max_lag=max_lag)
                runs[mode][name].append(arm_stats(run, hard, S, B, K))
        n = S * B + C
        run = simulate(make_sampler("fifo"), hard[:n], dur[:n], C, B, T, S, release_on_finish=True)
        runs["no_drop"][ideal_key].append(arm_stats(run, hard, S, B, K))
    elapsed = time.perf_counter() - t0

    arms: dict[str, dict[str, dict]] = {}
    for mode, per_arm in runs.items():
        strict_rows = per_arm[strict_key]
        arms[mode] = {}
        for name, rows in per_arm.items():
            a = {k: round(median([r[k] for r in rows]), 4) for k in rows[0] if k != "population_hard"}
            a["ratio"] = round(median([r["groups_per_s"] / s["groups_per_s"] for r, s in zip(rows, strict_rows)]), 4)
            arms[mode][name] = a
    ideal_rows = runs["no_drop"][ideal_key]
    worst = max(r["groups_per_s"] / ideal_rows[k]["groups_per_s"] for per_arm in runs.values()
                for name, rows in per_arm.items() if name != ideal_key for k, r in enumerate(rows))
    base = arms["no_drop"]
    ratio, bound = base[greedy_key]["ratio"], base[ideal_key]["ratio"]
    # simulated, so no noise to allow for: the strict tolerance even in --quick mode
    eff = efficiency(ratio, bound, "window_sampler", bound_tolerance(False))
    efficiency(worst, 1.0, "window_sampler: fastest arm / ideal arm, per seed", bound_tolerance(False))
    mean_d = args.mean * (1 - args.hard_share + args.hard_share * args.hard_factor)
    cap = min(C / mean_d, B / T)
    strict_x = base[strict_key]["groups_per_s"]
    population = median([r["population_hard"] for r in runs["no_drop"][strict_key]])

    details = []
    for mode, table in arms.items():
        details.append("no staleness drop:" if mode == "no_drop" else
                       f"dropping groups whose policy lag exceeds {L} steps when taken (as Buffer.take), trainer "
                       f"takes more to fill B:")
        details.append(f"  {'arm':<29} {'groups/s':>8} {'ratio':>6} {'hard 1st K':>10} {'bias 1st K':>10} "
                       f"{'hard all':>8} {'bias all':>8} {'lag hard':>8} {'lag easy':>8} {'lag max':>7} "
                       f"{'dropped':>7} {'trainer busy':>12}")
        for name, a in table.items():
            details.append(f"  {name:<29} {a['groups_per_s']:>8.2f} {a['ratio']:>6.3f} {a['hard_first_k']:>10.3f} "
                           f"{a['bias_first_k']:>+10.3f} {a['hard_all']:>8.3f} {a['bias_all']:>+8.3f} "
                           f"{a['lag_hard']:>8.2f} {a['lag_easy']:>8.2f} {a['lag_max']:>7.0f} "
                           f"{a['dropped_share']:>7.3f} {a['trainer_busy']:>12.2f}")
    details += [
        f"population: hard share {population:.3f} among the first S*B tasks (nominal "
        f"{args.hard_share}); bias = hard share trained - population share, first K = {K} steps and all {S} steps",
        f"bound (simulated): the ideal arm (a slot freed when its group finishes, completion order, same tasks, no "
        f"drop) trains {base[ideal_key]['groups_per_s']:.2f} groups/s = {bound:.3f}x strict; checked per seed: the "
        f"fastest arm reaches {worst:.3f} of the ideal (must be <= 1)",
        f"bound (analytic): X <= min(C/E[d], B/T) = min({C}/{mean_d:.2f}, {B}/{T:g}) = min({C / mean_d:.2f}, "
        f"{B / T:.2f}) = {cap:.2f} groups/s = {cap / strict_x:.3f}x strict; greedy reaches "
        f"{base[greedy_key]['groups_per_s'] / cap:.3f} of it",
        f"efficiency = greedy ratio / bound = {ratio:.3f} / {bound:.3f} = {eff:.3f}",
        f"simulated in {elapsed:.1f}s",
    ]
    report({
        "name": "window_sampler",
        "machine": machine(),
        "simulated": (f"discrete-event, no model: {args.seeds} seeds x {S} steps of B = {B} groups, at most C = {C} "
                      f"groups launched and not consumed, trainer step T = {T:g}s; group durations lognormal "
                      f"(log-sd {args.sigma:g}), mean {args.mean:g}s easy / {args.mean * args.hard_factor:g}s hard, "
                      f"{args.hard_share:.0%} hard; the real loomrl samplers choose the batches"),
        "ratio_over": "strict in-order (W=1)",
        "ratio": round(ratio, 3),
        "bound": round(bound, 3),
        "efficiency": round(eff, 3),
        "summary_of": "greedy first-finished (fifo, W=inf) vs strict in-order, no staleness drop; bound = the ideal "
                      "zero-wait arm vs strict",
        "analytic_bound": round(cap / strict_x, 3),
        "bound_checked_max_arm_over_ideal": round(worst, 4),
        "greedy_ratio_with_drop": arms[f"drop_lag_gt_{L}"][greedy_key]["ratio"],
        "population_hard_share": round(population, 4),
        "first_k_steps": K,
        "max_lag": L,
        "arms": arms,
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
