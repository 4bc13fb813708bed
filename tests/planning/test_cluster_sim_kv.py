"""The cluster simulation under a K/V budget (planning/cluster_sim.py, sim_instance.py): each instance drives the
engine's own ProgramTable (its pauses and restores are the simulation's), every program finishes exactly once and the
tokens add up, the same inputs give the same numbers, the budget holds at every step, and running decode steps back
to back changes nothing. Nothing is mocked: spies wrap the real methods and only count."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loomrl.engine.builtin.programs import Phase, ProgramTable
from loomrl.engine.placement import block_hashes
from loomrl.planning.cluster_sim import ClusterSim, Workload, simulate
from loomrl.planning.sim_costs import CostModel
from loomrl.planning.sim_instance import SimInstance, extend_hashes

# 3 groups of 4 programs, 4 turns, contexts to ~1k tokens: 12 programs on 2 instances need ~6k tokens each
W = Workload(groups=3, group_size=4, turns=4, prompt_tokens=256, output_tokens=96, obs_tokens=96, seed=3)
TIGHT = CostModel(kv_budget_tokens=3000, tool_median_s=0.5)


def test_extend_hashes_is_block_hashes() -> None:
    tokens = list(range(1000, 1300))
    assert extend_hashes([], tokens) == block_hashes(tokens)
    assert extend_hashes(block_hashes(tokens[:150]), tokens) == block_hashes(tokens)


def test_the_program_tables_are_the_engines_and_their_counts_are_the_simulations(monkeypatch) -> None:
    paused: list[str] = []
    admitted: list[str] = []
    real_paused, real_admitted = ProgramTable.paused, ProgramTable.admitted

    def spy_paused(self, program_id):
        paused.append(program_id)
        return real_paused(self, program_id)

    def spy_admitted(self, request, prompt_tokens, hit, waited_s):
        admitted.append(request.program_id)
        return real_admitted(self, request, prompt_tokens, hit, waited_s)

    monkeypatch.setattr(ProgramTable, "paused", spy_paused)
    monkeypatch.setattr(ProgramTable, "admitted", spy_admitted)
    sim = ClusterSim(instances=2, policy="affinity", workload=W, cost=TIGHT, program_policy="longest_wait")
    r = sim.run()
    assert all(type(node.table) is ProgramTable for node in sim.nodes)
    assert r.pauses == len(paused) > 0  # the budget binds: the table's policy paused programs
    assert len(admitted) == r.admissions
    assert r.restores_recompute == sum(n.table.metrics.restored for n in sim.nodes) > 0
    assert r.restore_tokens == sum(n.table.metrics.recomputed_tokens for n in sim.nodes) > 0
    assert r.max_wait_s == max(n.table.metrics.max_wait_s for n in sim.nodes)


@pytest.mark.parametrize(("router", "program_policy", "pool"), [("affinity", "lru", False),
                                                                ("round_robin", "smallest_first", False),
                                                                ("affinity", "longest_wait", True)])
def test_every_program_finishes_once_and_the_tokens_add_up(router, program_policy, pool) -> None:
    sim = ClusterSim(instances=2, policy=router, workload=W, cost=TIGHT, pool=pool, program_policy=program_policy)
    r = sim.run()
    assert r.programs_done == r.programs == 12 and r.requests == 12 * W.turns
    assert sim.turns_done == [W.turns] * 12
    assert r.prompt_tokens == r.reused_tokens + r.pool_tokens + r.computed_tokens
    outputs = [max(1, round(W.output_tokens * sim._draw(k, t).uniform(1 - W.output_jitter, 1 + W.output_jitter)))
               for k in range(12) for t in range(W.turns)]
    assert r.decoded_tokens == sum(outputs)
    assert r.admissions == r.requests + r.preemptions  # a preempted turn is admitted once more
    for node in sim.nodes:  # nothing left running, every reference counted back, every program acting or released
        assert not node.running and not node.waiting and node.run_tokens == 0 and node.run_full == 0
        assert node.entry_tokens == sum(len(h) for h in node.entries.values()) * 16
        assert all(p.phase is Phase.ACTING and p.in_flight == 0 for p in node.table.programs.values())
    assert r.hit_rate <= r.hit_bound


def test_the_same_inputs_give_the_same_numbers() -> None:
    runs = [simulate(instances=3, policy="affinity", workload=W, cost=TIGHT, pool=True, program_policy="longest_wait")
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].pauses > 0
    other = simulate(instances=3, policy="affinity", workload=replace(W, seed=4), cost=TIGHT, pool=True,
                     program_policy="longest_wait")
    assert (other.wall_s, other.decoded_tokens) != (runs[0].wall_s, runs[0].decoded_tokens)


@pytest.mark.parametrize("program_policy", ["lru", "smallest_first", "longest_wait"])
def test_the_budget_holds_at_every_step(monkeypatch, program_policy) -> None:
    """Checked where the engine checks it: at each step's start, after admissions and preemptions (a program policy
    also keeps held + the running turns' reserved outputs within it)."""
    seen: list[int] = []
    real = SimInstance.preempt_if_needed

    def spy(self) -> None:
        real(self)
        seen.append(self.held())
        assert self.held() <= self.budget
        if self.table.reserves_turns:
            assert self.entry_tokens + self.run_full <= self.budget

    monkeypatch.setattr(SimInstance, "preempt_if_needed", spy)
    r = simulate(instances=2, policy="affinity", workload=W, cost=TIGHT, program_policy=program_policy)
    assert seen and max(seen) <= TIGHT.kv_capacity_tokens and r.max_held <= r.kv_budget and r.over_budget == 0
    assert r.max_held > r.kv_budget * 0.8  # it did bind


def test_decode_steps_run_back_to_back_as_one_by_one() -> None:
    results = []
    for ahead in (True, False):
        sim = ClusterSim(instances=2, policy="affinity", workload=W, cost=TIGHT, program_policy="longest_wait")
        sim.runs_ahead = ahead
        results.append(sim.run())
    fast, slow = results
    assert fast.wall_s == pytest.approx(slow.wall_s, rel=1e-9) and fast.busy_s == pytest.approx(slow.busy_s, rel=1e-9)
    for name in ("computed_tokens", "pauses", "restores_recompute", "preemptions", "requests", "bound_tokens"):
        assert getattr(fast, name) == getattr(slow, name), name


def test_a_larger_budget_pauses_less_and_affinity_recomputes_less_than_round_robin() -> None:
    def run(budget: int, router: str = "affinity"):
        return simulate(instances=2, policy=router, workload=W, program_policy="longest_wait",
                        cost=CostModel(kv_budget_tokens=budget, tool_median_s=0.5))

    tight, roomy, unlimited = run(3000), run(5000), run(1 << 30)
    assert tight.pauses > roomy.pauses >= unlimited.pauses == 0
    assert tight.restore_tokens >= roomy.restore_tokens >= unlimited.restore_tokens == 0
    assert run(3000, "round_robin").computed_tokens > tight.computed_tokens
