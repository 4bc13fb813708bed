"""The cluster simulation (planning/cluster_sim.py): deterministic for a seed, exact on a hand-computable case, at the
hit-rate bound under affinity on a grouped workload, and driving the real Placer and SharedKVPool (spies count their
calls; nothing is mocked: the simulation replaces only time)."""

from __future__ import annotations

import pytest

from loomrl.engine.kv_pool import SharedKVPool
from loomrl.engine.placement import BLOCK, Placer
from loomrl.planning.cluster_sim import ClusterSim, CostModel, Workload, assumptions, simulate


def test_same_seed_same_rollout_other_seed_other_one() -> None:
    w = Workload(groups=3, group_size=4, turns=3, prompt_tokens=96, output_tokens=32, obs_tokens=16, seed=5)
    a = simulate(instances=3, policy="affinity", workload=w)
    b = simulate(instances=3, policy="affinity", workload=w)
    assert a == b
    c = simulate(instances=3, policy="affinity", workload=Workload(**{**{f: getattr(w, f) for f in w.__slots__},
                                                                      "seed": 6}))
    assert c.wall_s != a.wall_s


def test_one_instance_no_tool_wait_is_the_formula() -> None:
    """One program, one instance, no tool wait: each turn prefills what the block cache lacks, then decodes its output
    one token a step at batch 1; turns run back to back."""
    cost = CostModel(prefill_tokens_per_s=1000.0, decode_base_s=0.01, decode_per_seq_s=0.002, tool_median_s=0.0)
    p0, out, obs, turns = 64, 16, 16, 3
    w = Workload(groups=1, group_size=1, turns=turns, prompt_tokens=p0, output_tokens=out, output_jitter=0.0,
                 obs_tokens=obs)
    r = simulate(instances=1, policy="affinity", workload=w, cost=cost)
    prompts = [p0 + t * (out + obs) for t in range(turns)]
    # the cache holds each finished turn's prompt + output less its last token, in whole blocks
    computed = [prompts[0]] + [prompts[t] - (prompts[t - 1] + out - 1) // BLOCK * BLOCK for t in range(1, turns)]
    expected = sum(computed) / 1000.0 + turns * out * (0.01 + 0.002 * 1)
    assert r.computed_tokens == sum(computed) == 64 + 32 + 32
    assert r.wall_s == pytest.approx(expected, rel=1e-12)
    assert r.wall_bound_s == pytest.approx(r.wall_s, rel=1e-12)  # alone, a program's path is the wall
    assert r.requests == turns and r.max_queue == 1


def test_affinity_reaches_the_bound_on_a_grouped_workload() -> None:
    w = Workload(groups=6, group_size=4, turns=3, prompt_tokens=128, output_tokens=32, obs_tokens=16)
    aff = simulate(instances=4, policy="affinity", workload=w)
    assert aff.bound_tokens > 0 and aff.reused_tokens == aff.bound_tokens
    assert aff.hit_rate == aff.hit_bound
    assert aff.wall_s >= aff.wall_bound_s > 0
    for policy in ("round_robin", "least_loaded"):  # they scatter programs: below the bound, more recomputed
        other = simulate(instances=4, policy=policy, workload=w)
        assert other.hit_rate < other.hit_bound and other.computed_tokens > aff.computed_tokens


def test_every_placement_is_the_real_placers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    choose = Placer.choose

    def spy(self, request, exclude=frozenset()):
        calls.append(request.program_id)
        return choose(self, request, exclude)

    monkeypatch.setattr(Placer, "choose", spy)
    w = Workload(groups=2, group_size=3, turns=2, prompt_tokens=64, output_tokens=16, obs_tokens=16)
    r = simulate(instances=2, policy="affinity", workload=w)
    assert len(calls) == r.requests == 2 * 3 * 2
    assert sum(r.placements.values()) == len(calls)


def test_the_pool_arm_fetches_from_the_real_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round robin moves each turn away from its K/V: with the pool it fetches what it lacks instead of recomputing
    it, never above the bound."""
    served: list[int] = []
    get = SharedKVPool.get

    def spy(self, tokens, version, held=0):
        n, kv = get(self, tokens, version, held)
        served.append(n)
        return n, kv

    monkeypatch.setattr(SharedKVPool, "get", spy)
    w = Workload(groups=2, group_size=2, turns=3, prompt_tokens=96, output_tokens=32, obs_tokens=16)
    plain = ClusterSim(instances=3, policy="round_robin", workload=w).run()
    pooled = ClusterSim(instances=3, policy="round_robin", workload=w, pool=True).run()
    assert len(served) == pooled.requests and any(served)
    assert pooled.pool_tokens > 0 and pooled.computed_tokens == plain.computed_tokens - pooled.pool_tokens
    assert pooled.hit_rate <= pooled.hit_bound


def test_assumptions_name_every_figure_and_say_simulated() -> None:
    lines = assumptions(CostModel(), Workload(groups=1))
    assert lines[0].startswith("SIMULATED")
    text = "\n".join(lines)
    for name in ("prefill_tokens_per_s", "decode_base_s", "kv_bytes_per_token", "transfer_bytes_per_s",
                 "tool_median_s"):
        assert name in text
    assert "assumed" in text
