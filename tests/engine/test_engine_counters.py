"""The counters engines keep beyond EngineMetrics (engine/readings.py KeepsCounters) in the step metrics: the router's
placements, the program table's pauses and restores, the shared K/V pool's hits and bytes; summed over the router's
instances with their one pool counted once, and left out for an engine that keeps none."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loomrl.config import EngineConfig, EngineSetup, ModelConfig
from loomrl.engine.base import EngineMetrics, GenerationRequest, SamplingParams
from loomrl.engine.factory import make_engine
from loomrl.engine.readings import Counters, EngineDelta, counter_changes, engine_step_metrics, read_engine
from loomrl.engine.router import Router

ROOT = Path(__file__).resolve().parents[2]


def _run(engine, prompts, program="p"):
    async def go():
        return await asyncio.gather(*[
            engine.generate(GenerationRequest(prompt_ids=p, program_id=f"{program}{i}", group_id="g",
                                              sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
            for i, p in enumerate(prompts)])

    return asyncio.run(go())


def test_peaks_are_maxima_and_counts_changes_and_absent_counters_stay_absent():
    def reading(up_s, paused, wait):
        more = Counters(counts={"programs_paused": paused}, peaks={"programs_max_wait_s": wait})
        return {**read_engine(EngineMetrics(), more), "up_s": up_s}

    a = counter_changes(reading(1.0, 2, 0.5), reading(2.0, 5, 0.7))
    b = counter_changes(reading(1.0, 0, 0.1), reading(2.0, 1, 0.9))
    plain = counter_changes({**read_engine(EngineMetrics()), "up_s": 1.0},
                            {**read_engine(EngineMetrics()), "up_s": 2.0})
    m = engine_step_metrics([a, b, plain])
    assert m["engine/programs_paused"] == 4  # (5 - 2) + (1 - 0)
    assert m["engine/programs_max_wait_s"] == 0.9  # the largest since the start, never a difference
    assert "engine/programs_paused" not in engine_step_metrics([plain])  # an engine that keeps none: no made-up 0


def test_a_router_reports_placements_and_its_instances_counters_with_the_shared_pool_once(tiny_model, tokenizer):
    setup = EngineSetup(engine=EngineConfig(instances=2, router="round_robin", kv_pool_bytes=64 << 20,
                                            program_policy="longest_wait"),
                        model=ModelConfig(kind="tiny"), seed=0, context_tokens=512, interrupt_on_update=False, cpus=1)
    router = make_engine(setup, tiny_model, tokenizer, 0)
    try:
        assert isinstance(router, Router)
        delta = EngineDelta.of(router)
        prompt = tokenizer.encode("A shared prompt, long enough to fill more than one block of the pool's index")
        _run(router, [prompt])
        _run(router, [prompt + [5, 6]])  # round robin: the other instance, which fetches the prefix from the pool
        m = delta.take()
        pool = router.placer.fetch.pool  # type: ignore[union-attr]
        assert m["engine/router_placed_round_robin"] == 2 == m["engine/requests"]
        assert m["engine/kv_pool_puts"] == pool.metrics.puts >= 1  # counted once, not once per instance
        assert m["engine/kv_pool_hits"] == pool.metrics.hits == 1
        assert m["engine/kv_pool_tokens_served"] == pool.metrics.tokens_served > 0
        assert m["engine/kv_pool_bytes_out"] == pool.metrics.bytes_out > 0
        assert m["engine/programs_paused"] == sum(e.programs.metrics.paused for e in router.instances)
        assert "engine/programs_max_wait_s" in m and m["engine/router_retries"] == 0
        assert delta.take()["engine/kv_pool_hits"] == 0  # a step's change
    finally:
        router.close()


def test_an_engine_without_more_counters_adds_none(tiny_model, tokenizer):
    """An engine that is not KeepsCounters (a test's scripted one here) gets only EngineMetrics' keys."""
    from scripted_engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ["a"])
    m = EngineDelta.of(engine).take()
    assert not [k for k in m if k.startswith(("engine/router_", "engine/programs_", "engine/kv_pool_"))]


@pytest.mark.integration
def test_a_local_async_run_logs_router_program_and_pool_counters(tmp_path, monkeypatch):
    """runtime.mode=async, engine.instances=2, a K/V pool, longest_wait: metrics.jsonl carries the router's placements
    (summed: the requests the instances counted), the program table's and the pool's counters, none above the objects'
    own totals at the end of the run."""
    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train

    routers: list[Router] = []
    real_close = Router.close

    def keep(self):  # a spy: the run's router, read after it closed
        routers.append(self)
        real_close(self)

    monkeypatch.setattr(Router, "close", keep)
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={tmp_path}", "progress=false", "name=counters", "runtime.mode=async", "engine.instances=2",
        "engine.kv_pool_bytes=67108864", "engine.program_policy=longest_wait", "engine.router=round_robin",
        "trainer.total_steps=2", "eval.n_tasks=0", "checkpoint_every=0",
        "reward.function=rewards_for_tests:parity_reward"])
    assert train(cfg)["steps"] == 2
    (router,) = routers
    steps = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "engine/requests" in m]
    assert steps

    def total(name):
        return sum(m.get(name, 0) for m in steps)

    placed = sum(total(k) for k in {k for m in steps for k in m if k.startswith("engine/router_placed_")})
    assert placed == total("engine/requests") > 0  # each request placed once (no faults, no retries)
    assert placed <= sum(router.placement.placements.values())
    pool = router.placer.fetch.pool  # type: ignore[union-attr]
    for name in ("hits", "tokens_served", "bytes_in", "bytes_out", "puts"):
        assert 0 <= total(f"engine/kv_pool_{name}") <= getattr(pool.metrics, name)
    # every finished turn is put; hits need a later turn elsewhere sharing more than its instance holds, which a random
    # model's mostly one-turn episodes rarely make (the unit test above checks hits against the pool exactly)
    assert total("engine/kv_pool_puts") > 0 and "engine/kv_pool_hits" in steps[0]
    for name in ("paused", "restored", "recomputed_tokens"):
        assert 0 <= total(f"engine/programs_{name}") <= sum(getattr(e.programs.metrics, name) for e in router.instances)
    assert total("engine/router_retries") == 0
    assert all("engine/programs_max_wait_s" in m for m in steps)
