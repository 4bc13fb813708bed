"""SIMULATED: the router's placement policies at 8, 64 and 256 GPU instances with 16 programs per instance (thousands
at 256), through the discrete-event model in loomrl/planning/cluster_sim.py. Every placement is made by the real Placer
(engine/placement.py) and the +pool arm's pool is the real SharedKVPool (engine/kv_pool.py); only time is simulated,
from a cost model whose figures and sources are printed first. Nothing here ran on a GPU.

Figures per (instances, arm): simulated rollout wall seconds against its bound (the longest program alone: its tool
waits, its outputs decoded at batch 1, its prompts prefilled less the hit-rate bound's tokens); instance busy seconds (GPU time used, summed); prefill
tokens recomputed against its bound (prompt tokens less what one infinite shared cache would serve); prefix hit rate
(instance cache + pool) against that bound (efficiency = rate / bound, a count: above 1 exits); the most requests
waiting at one instance; placements by reason.
--quick: the same path at 2 and 4 instances with a small workload (figures not results).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, efficiency, machine, report  # noqa: E402

from loomrl.planning.cluster_sim import CostModel, Workload, assumptions, simulate  # noqa: E402

ARMS = (("round_robin", False), ("least_loaded", False), ("affinity", False), ("affinity", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--instances", type=int, nargs="*", default=None, help="instance counts (default 8 64 256)")
    ap.add_argument("--programs-per-instance", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = args.instances or ([2, 4] if args.quick else [8, 64, 256])
    cost = CostModel()
    shape = Workload(groups=1, seed=args.seed, **({"turns": 2, "prompt_tokens": 256, "output_tokens": 64,
                                                   "obs_tokens": 32} if args.quick else {}))
    if args.quick:
        print(QUICK_NOTE)
    print(f"machine (runs the simulation, not the model): {machine()}")
    for line in assumptions(cost, shape):
        print(line)
    print(f"  programs = {args.programs_per_instance} x instances, all started at once; instances {sizes}")
    rows, details = [], []
    for n in sizes:
        programs = args.programs_per_instance * n
        workload = Workload(**{**{f: getattr(shape, f) for f in shape.__slots__}, "groups": programs // shape.group_size})
        for policy, pooled in ARMS:
            t0 = time.perf_counter()
            r = simulate(instances=n, policy=policy, workload=workload, cost=cost, pool=pooled)
            eff = efficiency(r.hit_rate, r.hit_bound, f"sim {r.policy} at {n} instances: hit rate", tolerance=0.0)
            rows.append({"instances": n, "arm": r.policy, "programs": r.programs, "requests": r.requests,
                         "wall_s": round(r.wall_s, 2), "wall_bound_s": round(r.wall_bound_s, 2), "busy_s": round(r.busy_s, 1),
                         "prefill_tokens": r.computed_tokens, "prefill_bound": r.prompt_tokens - r.bound_tokens,
                         "hit_rate": round(r.hit_rate, 4), "hit_bound": round(r.hit_bound, 4),
                         "efficiency": round(eff, 3), "max_queue": r.max_queue, "pool_tokens": r.pool_tokens})
            details.append(f"N={n:4d} {r.policy:15s} programs {r.programs:5d}: wall {r.wall_s:8.2f} s (simulated; bound "
                           f"{r.wall_bound_s:.2f}), "
                           f"busy {r.busy_s:9.1f} instance-s, prefill recomputed {r.computed_tokens:10d} (bound "
                           f"{r.prompt_tokens - r.bound_tokens}), hit rate {r.hit_rate:.3f} of bound {r.hit_bound:.3f} "
                           f"(efficiency {eff:.3f}), pool served {r.pool_tokens}, max queue {r.max_queue}, placements "
                           f"{dict(sorted(r.placements.items()))} [sim took {time.perf_counter() - t0:.1f} s]")
    largest = [r for r in rows if r["instances"] == sizes[-1]]
    aff = next(r for r in largest if r["arm"] == "affinity")
    rr = next(r for r in largest if r["arm"] == "round_robin")
    report({"name": "router_sim", "machine": machine(), "simulated": True,
            "summary": f"at {sizes[-1]} instances affinity recomputes {aff['prefill_tokens']} prefill tokens against "
                       f"round_robin's {rr['prefill_tokens']} (bound {aff['prefill_bound']}); hit rate "
                       f"{aff['hit_rate']:.3f} of bound {aff['hit_bound']:.3f}",
            "arms": rows, "details": details}, args.json)
    print(f"affinity efficiency at {sizes[-1]} instances: {aff['efficiency']}")


if __name__ == "__main__":
    main()
