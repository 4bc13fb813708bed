"""SIMULATED: the router's placement policies and the engine's program policies at 8, 64 and 256 GPU instances with 16
programs per instance (thousands at 256), under a K/V budget per instance, through the discrete-event model in
loomrl/planning/cluster_sim.py. Every placement is made by the real Placer (engine/placement.py), every pause by each
instance's real ProgramTable (engine/builtin/programs.py), and the +pool arms' pool is the real SharedKVPool
(engine/kv_pool.py); only time and the K/V tensors are simulated, from a cost model whose figures and sources are
printed first. Nothing here ran on a GPU.

Arms: router policy (round_robin, least_loaded, affinity) x program policy (lru, smallest_first, longest_wait), and
affinity+pool under lru and longest_wait. Figures per (instances, arm), each against its bound: simulated rollout wall
seconds (bound: the longest program alone: its tool waits, its outputs decoded at batch 1, its prompts prefilled less
the hit-rate bound's tokens); busy instance-seconds (GPU time used; bound: the same decode with only the bound's
prefill); prefill tokens recomputed (bound: prompt tokens less what one infinite shared cache would serve); pauses,
restores from the pool and by recompute (bound 0: an unlimited K/V budget pauses nothing); the longest wait of a turn
for admission (bound: about one step, the one under way when it arrives; 16 programs never fill max_batch); prefix
hit rate against its bound; preemptions; the most K/V one instance held against its budget.
--quick: the same path at 2 and 4 instances with a small workload and a 3,000-token budget (figures not results).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, efficiency, machine, report  # noqa: E402

from loomrl.planning.cluster_sim import SimResult, Workload, assumptions, simulate  # noqa: E402
from loomrl.planning.sim_costs import CostModel  # noqa: E402

ROUTERS = ("round_robin", "least_loaded", "affinity")
PROGRAMS = ("lru", "smallest_first", "longest_wait")
ARMS = ([(r, p, False) for r in ROUTERS for p in PROGRAMS] + [("affinity", "lru", True), ("affinity", "longest_wait",
                                                                                            True)])
# a co-located (hybrid) rollout engine: the trainer keeps its state on the same GPU; below verl's example 0.5
MEMORY_FRACTION = 0.3


def _row(n: int, r: SimResult, cost: CostModel, eff: float) -> dict:
    prefill_bound = r.prompt_tokens - r.bound_tokens
    busy_bound = r.busy_s - (r.computed_tokens - prefill_bound) / cost.prefill_tokens_per_s
    return {"instances": n, "arm": r.arm, "programs": r.programs, "requests": r.requests,
            "wall_s": round(r.wall_s, 2), "wall_bound_s": round(r.wall_bound_s, 2), "busy_s": round(r.busy_s, 1),
            "busy_bound_s": round(busy_bound, 1), "prefill_tokens": r.computed_tokens, "prefill_bound": prefill_bound,
            "pauses": r.pauses, "restores_pool": r.restores_pool, "restores_recompute": r.restores_recompute,
            "restore_tokens": r.restore_tokens, "preemptions": r.preemptions, "max_wait_s": round(r.max_wait_s, 3),
            "hit_rate": round(r.hit_rate, 4), "hit_bound": round(r.hit_bound, 4), "efficiency": round(eff, 3),
            "max_held": r.max_held, "kv_budget": r.kv_budget, "pool_tokens": r.pool_tokens}


def _detail(row: dict, took: float) -> str:
    return (f"N={row['instances']:4d} {row['arm']:28s} programs {row['programs']:5d}: wall {row['wall_s']:8.2f} s "
            f"(bound {row['wall_bound_s']:.2f}), busy {row['busy_s']:9.1f} instance-s (bound {row['busy_bound_s']:.1f}), "
            f"prefill recomputed {row['prefill_tokens']:9d} (bound {row['prefill_bound']}), pauses {row['pauses']} "
            f"(bound 0), restores pool {row['restores_pool']} / recompute {row['restores_recompute']} "
            f"({row['restore_tokens']} tokens; bound 0), preemptions {row['preemptions']}, max wait "
            f"{row['max_wait_s']:.3f} s (bound: one step, the one under way at arrival), hit rate {row['hit_rate']:.3f} of bound {row['hit_bound']:.3f} "
            f"(efficiency {row['efficiency']:.3f}), max K/V held {row['max_held']} of {row['kv_budget']} "
            f"[sim took {took:.1f} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--instances", type=int, nargs="*", default=None, help="instance counts (default 8 64 256)")
    ap.add_argument("--programs-per-instance", type=int, default=16)
    ap.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                    help="the GPU memory the engine may use (sets each instance's K/V budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    started = time.perf_counter()
    sizes = args.instances or ([2, 4] if args.quick else [8, 64, 256])
    cost = CostModel(memory_fraction=args.memory_fraction, kv_budget_tokens=3000 if args.quick else 0)
    shape = Workload(groups=1, seed=args.seed, **({"turns": 2, "prompt_tokens": 256, "output_tokens": 64,
                                                   "obs_tokens": 32} if args.quick else {}))
    if args.quick:
        print(QUICK_NOTE)
    print(f"machine (runs the simulation, not the model): {machine()}")
    for line in assumptions(cost, shape):
        print(line)
    print(f"  memory_fraction here {cost.memory_fraction} (assumed: a co-located engine beside a trainer holding its "
          f"state on the GPU, below verl's example 0.5) -> K/V budget {cost.kv_capacity_tokens} tokens per instance"
          + (" (--quick: 3000 set)" if args.quick else ""))
    print(f"  programs = {args.programs_per_instance} x instances, all started at once; instances {sizes}")
    rows, details = [], []
    for n in sizes:
        workload = replace(shape, groups=args.programs_per_instance * n // shape.group_size)
        for router, program_policy, pooled in ARMS:
            t0 = time.perf_counter()
            r = simulate(instances=n, policy=router, workload=workload, cost=cost, pool=pooled,
                         program_policy=program_policy)
            eff = efficiency(r.hit_rate, r.hit_bound, f"sim {r.arm} at {n} instances: hit rate", tolerance=0.0)
            rows.append(_row(n, r, cost, eff))
            details.append(_detail(rows[-1], time.perf_counter() - t0))
    largest = [r for r in rows if r["instances"] == sizes[-1]]

    def arm(name: str) -> dict:
        return next(r for r in largest if r["arm"] == name)

    aff, rr = arm("affinity lru"), arm("round_robin lru")
    lw, sf = arm("affinity longest_wait"), arm("affinity smallest_first")
    report({"name": "router_sim", "machine": machine(), "simulated": True,
            "summary": f"SIMULATED at {sizes[-1]} instances: affinity recomputes {aff['prefill_tokens']} prefill "
                       f"tokens against round_robin's {rr['prefill_tokens']} (bound {aff['prefill_bound']}); under "
                       f"affinity, longest_wait recomputes {lw['prefill_tokens']} with {lw['pauses']} pauses, "
                       f"smallest_first {sf['prefill_tokens']} with {sf['pauses']}, lru {aff['prefill_tokens']}",
            "arms": rows, "details": details}, args.json)
    print(f"affinity efficiency at {sizes[-1]} instances: {aff['efficiency']}")
    print(f"benchmark wall time (this machine): {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
