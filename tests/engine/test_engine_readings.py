"""The engine's step metrics (engine/readings.py): the built-in engine's busy fraction, queue depth and prefix-cache
hit rate measured on a tiny random model, and the pooling of several engines' readings (Ray's engine actors) with
counters an engine does not measure left out."""

from __future__ import annotations

import asyncio
import time

import pytest

from loomrl.engine.base import EngineMetrics, GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.readings import EngineDelta, counter_changes, engine_step_metrics, read_engine


def _generate(engine, prompts, max_tokens=8):
    async def go():
        return await asyncio.gather(*[
            engine.generate(GenerationRequest(prompt_ids=p, program_id=f"p{i}",
                                              sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                      ignore_eos=True)))
            for i, p in enumerate(prompts)])

    return asyncio.run(go())


@pytest.fixture
def make_engine(tiny_model, tokenizer):
    made = []

    def make(**kw):
        made.append(BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, **kw))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_busy_fraction_is_the_share_of_the_interval_spent_computing(make_engine, tokenizer):
    engine = make_engine()
    delta = EngineDelta(engine.metrics)
    time.sleep(0.3)  # idle: part of the interval, not of the busy time
    _generate(engine, [tokenizer.encode("the engine computes for a while")], max_tokens=16)
    m = delta.take()
    assert 0 < m["engine/busy_frac"] < 1
    assert m["engine/busy_s"] > 0 and m["engine/steps"] >= 16
    time.sleep(0.05)
    assert delta.take()["engine/busy_frac"] == 0  # nothing ran since the last reading


def test_prefix_hit_rate_is_high_for_a_repeated_prompt_and_about_zero_for_disjoint_ones(make_engine, tokenizer):
    engine = make_engine()
    delta = EngineDelta(engine.metrics)
    prompt = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question: what is 2 + 2?")
    _generate(engine, [prompt])
    assert delta.take()["engine/prefix_hit_rate"] == 0  # first time: nothing cached
    _generate(engine, [prompt])
    assert delta.take()["engine/prefix_hit_rate"] > 0.9  # all but the last token, which is always computed
    _generate(engine, [tokenizer.encode("zebra quantum violin"), tokenizer.encode("Mountains erode slowly.")])
    assert delta.take()["engine/prefix_hit_rate"] < 0.2
    assert "engine/prefix_hit_rate" not in delta.take()  # no prompt in the interval: no rate, not 0


def test_queue_depth_counts_requests_waiting_for_a_full_batch(make_engine, tokenizer):
    prompts = [tokenizer.encode(f"request number {i} asks something") for i in range(8)]
    depth = {}
    for max_running in (2, 64):
        engine = make_engine(max_running=max_running)
        delta = EngineDelta(engine.metrics)
        _generate(engine, prompts, max_tokens=12)
        depth[max_running] = delta.take()["engine/queue_depth"]
    # 8 requests, 2 at a time: 6 wait, then 4, then 2, through most of the interval
    assert depth[2] > 1
    assert 0 <= depth[64] < depth[2] / 4  # all admitted at the first step


def test_readings_of_several_engines_pool_and_unmeasured_counters_are_left_out():
    def reading(up_s, **counters):
        return {**read_engine(EngineMetrics(**counters)), "up_s": up_s}

    builtin = counter_changes(reading(10.0, busy_s=1.0, queue_s=2.0, prompt_tokens=100, reused_tokens=10),
                              reading(20.0, busy_s=6.0, queue_s=32.0, prompt_tokens=300, reused_tokens=110))
    sglang = counter_changes(reading(5.0, prompt_tokens=0, reused_tokens=0),
                             reading(15.0, prompt_tokens=200, reused_tokens=100))  # measures no busy time or queue
    m = engine_step_metrics([builtin, sglang])
    assert m["engine/busy_frac"] == 0.5  # only the engine that measures it: 5 s of 10
    assert m["engine/queue_depth"] == 3.0  # 30 request-seconds over 10 s
    assert m["engine/prefix_hit_rate"] == 200 / 400  # pooled over both
    assert m["engine/prompt_tokens"] == 400 and "engine/started" not in m
    alone = engine_step_metrics([sglang])
    assert "engine/busy_frac" not in alone and "engine/queue_depth" not in alone and "engine/busy_s" not in alone
    # a restarted engine (its clock went back) counts from its start, not a negative change
    restarted = counter_changes(reading(100.0, busy_s=50.0, queue_s=0.0), reading(4.0, busy_s=1.0, queue_s=0.0))
    assert engine_step_metrics([restarted])["engine/busy_frac"] == 0.25
