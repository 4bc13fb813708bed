"""The cluster simulation's records (planning/cluster_sim.py): the workload it runs and the figures one arm gives.

What it is not: the simulation, or its cost model (sim_costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True, frozen=True)
class Workload:
    """`groups` GRPO groups of `group_size` programs; each program runs `turns` turns. The siblings of a group share
    its first prompt (no prefix is shared across groups); each turn's output is `output_tokens` x a uniform factor in
    [1 - output_jitter, 1 + output_jitter], and each observation `obs_tokens`; lengths and tool waits are drawn per
    (program, turn) from `seed`, so every arm sees the same ones."""

    groups: int
    group_size: int = 8
    turns: int = 4
    prompt_tokens: int = 1024
    output_tokens: int = 256
    output_jitter: float = 0.5
    obs_tokens: int = 128
    seed: int = 0


@dataclass(slots=True, kw_only=True)
class SimResult:
    """One arm's figures; `wall_s` is simulated seconds."""

    policy: str  # the router's placement policy (+pool)
    program_policy: str
    instances: int
    programs: int
    kv_budget: int  # tokens of K/V per instance
    requests: int = 0  # turns finished
    programs_done: int = 0  # programs whose last turn finished
    admissions: int = 0  # turns admitted (a preempted turn is admitted again)
    wall_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # served from the instance's own prefix cache
    pool_tokens: int = 0  # fetched from the shared pool
    computed_tokens: int = 0  # prefilled: the prefill tokens recomputed
    decoded_tokens: int = 0
    bound_tokens: int = 0  # what one infinite shared cache would have served
    wall_bound_s: float = 0.0  # the longest program's path alone: its tool waits, decode at batch 1, bound's prefill
    busy_s: float = 0.0  # instance-seconds spent in steps, summed over the instances (GPU time used)
    max_queue: int = 0  # the most requests waiting (not yet admitted) at one instance at once
    placements: dict[str, int] = field(default_factory=dict)  # by Choice.reason
    pauses: int = 0  # the ProgramTables' own count of policy pauses
    restores_pool: int = 0  # turns whose lost prefix the pool served whole
    restores_recompute: int = 0  # turns that recomputed some of their lost prefix (the tables' `restored`)
    restore_tokens: int = 0  # prefix tokens those recomputed (the tables' `recomputed_tokens`)
    preemptions: int = 0  # running turns preempted (lru's way to fit growing turns)
    max_wait_s: float = 0.0  # the longest a turn waited for admission (the tables' max_wait_s)
    max_held: int = 0  # the most K/V one instance held at a step's start
    over_budget: int = 0  # step starts over the budget with more than one turn running (0 by construction)

    @property
    def arm(self) -> str:
        return f"{self.policy} {self.program_policy}"

    @property
    def hit_rate(self) -> float:
        return (self.reused_tokens + self.pool_tokens) / max(self.prompt_tokens, 1)

    @property
    def hit_bound(self) -> float:
        return self.bound_tokens / max(self.prompt_tokens, 1)
