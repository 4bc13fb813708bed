"""`loomrl plan`'s simulated section: the cluster simulation (cluster_sim.py) run on the measured run's own shape (its
group size, turns, prompt, observation and output tokens, tool latency) for its engine config (engine.instances or a
GPU count the user gives, engine.router, engine.program_policy, engine.kv_pool_bytes, engine.kv_budget_tokens),
against round_robin placement and against the same config with the shared K/V pool: predicted prefix hit rate, the
prefill its placement and the pool save, and the K/V pauses and restores its program policy makes.

What it is not: a measurement. Time comes from the GPU cost model (sim_costs.py: Llama-3-8B on an H100, its sources
printed), not from the run; the run gives only the shape. It is kept small (at most MAX_PROGRAMS programs, the run's programs per instance
kept) so it answers in a few seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

from loomrl.engine.builtin.programs import ProgramPolicy
from loomrl.engine.placement import Policy
from loomrl.planning.cluster_sim import simulate
from loomrl.planning.sim_costs import SIMULATED, CostModel
from loomrl.planning.sim_records import SimResult, Workload

# the simulated size: the run's programs per instance (what sets the K/V pressure) kept up to MAX_PER_INSTANCE, the
# instances cut so that at most MAX_PROGRAMS run (the pooled arm costs most: its pool checks every token it serves)
MAX_PROGRAMS = 96
MAX_PER_INSTANCE = 32


@dataclass(slots=True, kw_only=True, frozen=True)
class SimInputs:
    """What the simulated section is run on."""

    instances: int
    router: str
    program_policy: str
    pool: bool
    kv_budget_tokens: int
    programs: int  # trajectories in flight at once, whole groups
    group_size: int
    turns: int
    prompt_tokens: int
    output_tokens: int
    obs_tokens: int
    tool_median_s: float
    cut: bool = False  # instances or programs cut to the simulated size
    instances_asked: int = 0
    inflight_asked: int = 0


@dataclass(slots=True, kw_only=True, frozen=True)
class SimPlan:
    inputs: SimInputs
    chosen: SimResult  # the config as it is
    round_robin: SimResult  # the same, placed round robin without the pool: what placement saves
    pooled: SimResult  # the same with the pool (the chosen arm itself when it has one)
    cost: CostModel


def sim_inputs(*, instances: int, router: str, program_policy: str, pool: bool, kv_budget_tokens: int,
               inflight: int, group_size: int, turns: float, prompt_tokens: float, output_tokens: float,
               obs_tokens: float, tool_median_s: float) -> SimInputs:
    """The run's shape, cut to the simulated size (whole groups, at least one)."""
    per = min(max(1, -(-inflight // max(instances, 1))), MAX_PER_INSTANCE)
    n = max(1, min(instances, MAX_PROGRAMS // per))
    groups = max(1, min(inflight, n * per) // max(group_size, 1))
    cut = n < instances or groups * group_size < inflight
    return SimInputs(cut=cut, instances_asked=instances, inflight_asked=inflight, instances=n, router=router, program_policy=program_policy, pool=pool,
                     kv_budget_tokens=kv_budget_tokens, programs=groups * group_size, group_size=group_size,
                     turns=max(1, round(turns)), prompt_tokens=max(1, round(prompt_tokens)),
                     output_tokens=max(1, round(output_tokens)), obs_tokens=max(0, round(obs_tokens)),
                     tool_median_s=max(0.0, tool_median_s))


def simulate_plan(inputs: SimInputs) -> SimPlan:
    """The chosen arm, round robin, and the chosen arm with the pool (three small simulations)."""
    i = inputs
    cost = CostModel(kv_budget_tokens=i.kv_budget_tokens, tool_median_s=i.tool_median_s)
    w = Workload(groups=i.programs // i.group_size, group_size=i.group_size, turns=i.turns,
                 prompt_tokens=i.prompt_tokens, output_tokens=i.output_tokens, obs_tokens=i.obs_tokens)
    program = cast(ProgramPolicy, i.program_policy)

    def arm(router: str, pool: bool) -> SimResult:
        return simulate(instances=i.instances, policy=cast(Policy, router), workload=w, cost=cost, pool=pool,
                        program_policy=program)

    chosen = arm(i.router, i.pool)
    return SimPlan(inputs=i, chosen=chosen, round_robin=arm("round_robin", False),
                   pooled=chosen if i.pool else arm(i.router, True), cost=cost)


def sim_lines(p: SimPlan) -> list[str]:
    """The plan's simulated section."""
    i, c, rr, pooled = p.inputs, p.chosen, p.round_robin, p.pooled
    saved = rr.computed_tokens - c.computed_tokens
    pool_saved = c.computed_tokens - pooled.computed_tokens
    return [
        f"{SIMULATED}, cluster simulation: {i.instances} instance{'s' if i.instances > 1 else ''}, {i.programs} programs in groups of "
        f"{i.group_size}, {i.turns} turn{'s' if i.turns > 1 else ''} of prompt {i.prompt_tokens} + output {i.output_tokens} + observation "
        f"{i.obs_tokens} tokens, tool {i.tool_median_s:.3g}s median; engine.router {i.router}, "
        f"engine.program_policy {i.program_policy}, pool {'on' if i.pool else 'off'}, K/V budget "
        f"{i.kv_budget_tokens} tokens per instance"
        + (f" (cut from the run's {i.instances_asked} instances and {i.inflight_asked} programs, programs per instance "
           f"kept up to {MAX_PER_INSTANCE}, to answer in seconds; fewer instances scatter round_robin less)"
           if i.cut else ""),
        f"  prefix hit rate    {c.hit_rate:.3f} (bound {c.hit_bound:.3f}; round_robin {rr.hit_rate:.3f})",
        f"  prefill recomputed {c.computed_tokens} tokens (round_robin {rr.computed_tokens}: placement saves "
        f"{saved}; with the pool {pooled.computed_tokens}: the pool saves {pool_saved})",
        f"  K/V pauses         {c.pauses} under {i.program_policy}; restores {c.restores_recompute} by recompute "
        f"({c.restore_tokens} tokens), {c.restores_pool} from the pool; preemptions {c.preemptions}; longest "
        f"admission wait {c.max_wait_s:.3f}s",
        f"  assumptions        time from the GPU cost model (Llama-3-8B, H100; prefill {p.cost.prefill_tokens_per_s:.0f} "
        f"tokens/s, decode step {p.cost.decode_base_s * 1e3:.1f}ms + {p.cost.decode_per_seq_s * 1e3:.2f}ms x batch, "
        f"pool {p.cost.transfer_bytes_per_s / 1e9:.0f} GB/s), not from this run; tool waits lognormal "
        f"(sigma {p.cost.tool_sigma}); every figure's source in loomrl/planning/sim_costs.py",
    ]


def sim_json(p: SimPlan) -> dict[str, Any]:
    def arm(r: SimResult) -> dict[str, Any]:
        return {**asdict(r), "hit_rate": r.hit_rate, "hit_bound": r.hit_bound}

    return {"simulated": True, "inputs": asdict(p.inputs), "chosen": arm(p.chosen),
            "round_robin": arm(p.round_robin), "pooled": arm(p.pooled)}
