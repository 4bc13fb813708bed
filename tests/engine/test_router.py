"""The router over N built-in engines (engine/router.py, placement.py): outputs identical to one bare engine, program
and group affinity, the prefix index scoped to the weight version, least_loaded and round_robin spreading, a request
whose instance dies mid-generation completing once elsewhere, weights reaching every instance or failing by name, and
request priorities (Seer's, agent/priorities.py) reaching each instance's admission queue in order.
Every engine here is a real BuiltinEngine over the tiny random model; an instance is killed by closing it."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

from loomrl.agent.priorities import ProgramPriorities
from loomrl.config import EngineConfig, EngineSetup, ModelConfig
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.factory import make_engine
from loomrl.engine.placement import BLOCK
from loomrl.engine.router import Router
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights, fingerprint_of


def _setup(instances: int, router: str = "affinity") -> EngineSetup:
    return EngineSetup(engine=EngineConfig(instances=instances, router=router), model=ModelConfig(kind="tiny"), seed=0,
                       context_tokens=4096, interrupt_on_update=False, cpus=1)


def _prompts(tokenizer):
    system = tokenizer.encode("You are a careful calculator. Use the tool, then answer the question asked. Question:")
    return [system + tokenizer.encode(q) for q in (" what is 2 + 2?", " 7 * 8", " apples and pears", " 12 / 4")]


def _req(prompt, program="", group="", **sampling):
    return GenerationRequest(prompt_ids=list(prompt), program_id=program, group_id=group,
                             sampling=SamplingParams(**sampling))


def _all(engine, requests):
    async def go():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    return asyncio.run(go())


def _each(engine, requests):
    """One request at a time (the counters then do not depend on how requests shared steps)."""
    async def go():
        return [await engine.generate(r) for r in requests]

    return asyncio.run(go())


@pytest.fixture
def bare(tiny_model, tokenizer):
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    yield eng
    eng.close()


@pytest.fixture
def router3(tiny_model, tokenizer):
    eng = make_engine(_setup(3), tiny_model, tokenizer, 0)
    assert isinstance(eng, Router) and len(eng.instances) == 3
    yield eng
    eng.close()


def test_one_instance_passes_through_with_the_bare_engines_outputs_and_metrics(tiny_model, tokenizer, bare):
    assert isinstance(make_engine(_setup(1), tiny_model, tokenizer, 0), BuiltinEngine)  # no router for one
    routed = Router([BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)])
    try:
        reqs = [_req(p, program=f"p{i % 2}", temperature=0.0, max_tokens=8) for i, p in enumerate(_prompts(tokenizer))]
        assert [r.token_ids for r in _each(routed, reqs)] == [r.token_ids for r in _each(bare, reqs)]
        for name in ("requests", "finished", "prompt_tokens", "prefill_tokens", "reused_tokens", "generated_tokens"):
            assert getattr(routed.metrics, name) == getattr(bare.metrics, name), name
        assert routed.metrics.hit_rate == bare.metrics.hit_rate
        assert routed.placement.placements == {}  # nothing placed: straight through
    finally:
        routed.close()


def test_greedy_and_seeded_outputs_through_three_instances_equal_the_bare_engines(router3, bare, tokenizer):
    prompts = _prompts(tokenizer) * 2
    greedy = [_req(p, program=f"p{i}", group=f"g{i % 2}", temperature=0.0, max_tokens=10)
              for i, p in enumerate(prompts)]
    assert [r.token_ids for r in _all(router3, greedy)] == [r.token_ids for r in _all(bare, greedy)]
    seeded = [_req(p, program=f"s{i}", temperature=0.9, top_p=0.95, max_tokens=10, seed=100 + i)
              for i, p in enumerate(prompts)]
    routed, plain = _all(router3, seeded), _all(bare, seeded)
    assert [r.token_ids for r in routed] == [r.token_ids for r in plain]
    for a, b in zip(routed, plain):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert sum(e.metrics.requests for e in router3.instances) == router3.metrics.requests == 2 * len(prompts)
    assert len({e.metrics.requests > 0 for e in router3.instances}) == 1  # every instance served some


def test_a_programs_turns_stay_on_its_instance_and_hit_its_prefix(router3, tokenizer):
    prompts = _prompts(tokenizer)[:3]
    contexts = {f"p{i}": list(p) for i, p in enumerate(prompts)}
    homes: dict[str, set[int]] = {pid: set() for pid in contexts}
    for _turn in range(3):
        results = _all(router3, [_req(ctx, program=pid, temperature=0.0, max_tokens=6, ignore_eos=True)
                                 for pid, ctx in contexts.items()])
        for (pid, ctx), r in zip(contexts.items(), results):
            homes[pid].add(router3.placer.programs[pid])
            ctx += r.token_ids + tokenizer.encode(" Result: 4. The tool ran.")
    assert all(len(h) == 1 for h in homes.values()), homes
    assert router3.placement.placements.get("program") == 3 * 2  # every later turn, by its program
    assert router3.metrics.reused_tokens > 0 and router3.placement.expected_prefix_tokens > 0


def test_group_siblings_share_an_instance_until_it_is_overloaded(tiny_model, tokenizer):
    prompt = _prompts(tokenizer)[0]
    router = Router([BuiltinEngine(copy.deepcopy(tiny_model), eos_token_id=tokenizer.eos_token_id) for _ in range(3)],
                    imbalance=2)
    try:
        _all(router, [_req(prompt, program=f"a{s}", group="ga", temperature=0.0, max_tokens=4) for s in range(3)])
        used = {router.placer.programs[f"a{s}"] for s in range(3)}
        assert used == {router.placer.groups["ga"]}  # three siblings: together
        assert router.placement.placements.get("group") == 2
        # six at once: the home holds three in flight above the least loaded one (imbalance 2), so it spills
        _all(router, [_req(prompt, program=f"b{s}", group="gb", temperature=0.0, max_tokens=4) for s in range(6)])
        assert len({router.placer.programs[f"b{s}"] for s in range(6)}) > 1
    finally:
        router.close()


def test_a_new_version_empties_the_index_and_never_routes_on_old_prefixes(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)  # update_weights writes into it
    router = make_engine(_setup(2), model, tokenizer, 0)
    prompt = _prompts(tokenizer)[0]
    try:
        _each(router, [_req(prompt, program="p", temperature=0.0, max_tokens=4)])
        assert any(ix.blocks for ix in router.placer.indexes) and "p" in router.placer.programs

        async def during_update():  # a request in flight across the update adds nothing to the new index
            task = asyncio.ensure_future(router.generate(_req(prompt + [5] * 40, program="q", temperature=0.0,
                                                              max_tokens=60, ignore_eos=True)))
            while router.metrics.generated_tokens < 6:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(router.update_weights, None, 1)
            return await task

        result = asyncio.run(during_update())
        assert 1 in result.versions and router.version == 1
        assert all(not ix.blocks for ix in router.placer.indexes) and not router.placer.programs
        assert router.placement.index_resets == 1
        choice = router.placer.choose(_req(prompt, program="p"))
        assert choice.expected == 0 and choice.reason == "load"
        assert len(prompt) >= BLOCK  # the prompt spans whole blocks: an old entry would have been matched
    finally:
        router.close()


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_load_policies_spread_a_group_over_every_instance(tiny_model, tokenizer, policy):
    router = make_engine(_setup(3, policy), tiny_model, tokenizer, 0)
    try:
        prompt = _prompts(tokenizer)[1]
        _all(router, [_req(prompt, program=f"p{s}", group="g", temperature=0.0, max_tokens=4) for s in range(6)])
        assert [e.metrics.requests for e in router.instances] == [2, 2, 2]
        assert router.placement.placements == {policy: 6}
    finally:
        router.close()


def test_an_instance_killed_mid_generation_loses_no_request(tiny_model, tokenizer, bare):
    router = make_engine(_setup(3), tiny_model, tokenizer, 0)
    prompt = _prompts(tokenizer)[2]
    req = _req(prompt, program="p", temperature=0.9, seed=7, max_tokens=80, ignore_eos=True)
    try:
        async def kill_mid_request():
            task = asyncio.ensure_future(router.generate(req))
            victim = None
            for _ in range(2000):  # its instance is the one decoding it
                victim = next((e for e in router.instances if e.metrics.generated_tokens > 3), None)
                if victim is not None:
                    break
                await asyncio.sleep(0.005)
            assert victim is not None
            await asyncio.to_thread(victim.close)
            return await task, victim

        result, victim = asyncio.run(kill_mid_request())
        assert result.token_ids == _each(bare, [req])[0].token_ids  # whole, and as one instance would have sampled it
        assert router.placement.retried == 1 and router.placement.retry_failed == 0
        assert sum(e.metrics.finished for e in router.instances) == 1  # returned once: the dead one finished nothing
        # the dead instance is avoided: the next request goes elsewhere (or is retried) and completes
        assert _each(router, [_req(prompt, temperature=0.0, max_tokens=4)])[0].token_ids
        assert router.placer.loads[router.instances.index(victim)].faulted_until > time.monotonic()
    finally:
        for e in router.instances:
            e.close()


def test_weights_reach_every_instance_or_the_failure_names_it(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)
    router = make_engine(_setup(3), model, tokenizer, 0)
    try:
        weights = {k: v + 0.01 for k, v in model.state_dict().items()}
        router.update_weights(weights, 1)
        assert router.version == 1 and [e.version for e in router.instances] == [1, 1, 1]
        published = fingerprint_of(weights)
        assert confirm_weights(router, "router", 1, published) > 0  # every instance serves them
        with torch.no_grad():  # one instance's weights drift: the check names it
            next(router.instances[1].model.parameters()).add_(1.0)
        with pytest.raises(WeightMismatch, match="router instance 1"):
            confirm_weights(router, "router", 1, published)
        router.instances[2].close()
        router.retire = False  # as with engine.retire_failed_instances=false
        with pytest.raises(EngineFault, match="instance 2 of 3"):
            router.update_weights(weights, 2)
        assert router.version == 1  # not every instance reached 2
    finally:
        router.close()


def test_an_instance_failing_a_weight_update_is_retired_and_the_rest_serve_on(tiny_model, tokenizer, caplog):
    """engine.retire_failed_instances (default): one lost instance does not stop the run; it is named, counted, never
    placed on again nor checked; every instance failing still fails the update."""
    model = copy.deepcopy(tiny_model)
    router = make_engine(_setup(3, "round_robin"), model, tokenizer, 0)
    try:
        weights = {k: v + 0.01 for k, v in model.state_dict().items()}
        router.instances[1].close()  # gone: its update raises
        with caplog.at_level("WARNING", logger="loomrl"):
            router.update_weights(weights, 1)
        assert router.version == 1 and router.live() == [0, 2] and router.placement.retired == 1
        assert "instance 1 of 3" in caplog.text and "retired" in caplog.text
        assert router.counters().counts["router_retired"] == 1
        assert confirm_weights(router, "router", 1, fingerprint_of(weights)) > 0  # the live ones are checked
        prompt = _prompts(tokenizer)[0]
        done = _each(router, [_req(prompt, temperature=0.0, max_tokens=3) for _ in range(6)])  # round_robin: 0, 2, ...
        assert all(len(r.token_ids) == 3 for r in done) and router.instances[1].metrics.finished == 0
        assert router.placement.retried == 0  # nothing was even tried on the retired one
        router.update_weights(weights, 2)  # later updates leave it out
        assert [router.instances[i].version for i in router.live()] == [2, 2]
        for i in router.live():
            router.instances[i].close()
        with pytest.raises(EngineFault, match="failed on 2 instance"):  # the last ones: the update fails
            router.update_weights(weights, 3)
        with pytest.raises(EngineFault, match="no other instance may run the request|closed"):
            _each(router, [_req(prompt, temperature=0.0, max_tokens=3)])
    finally:
        router.close()


def test_release_goes_to_the_instance_holding_the_program(router3, tokenizer):
    _each(router3, [_req(_prompts(tokenizer)[0], program="p", temperature=0.0, max_tokens=4)])
    home = router3.placer.programs["p"]
    released: list[int] = []
    for i, e in enumerate(router3.instances):
        e.release = lambda pid, i=i: released.append(i)  # records only: the instance keeps running
    router3.release("p")
    assert released == [home] and "p" not in router3.placer.programs


def test_instances_need_the_builtin_engine_and_an_async_run():
    from loomrl.config import RunConfig
    from loomrl.config.runtime import RuntimeConfig

    with pytest.raises(ValueError, match="engine.instances=2 needs runtime.mode=async"):
        RunConfig(engine=EngineConfig(instances=2), runtime=RuntimeConfig(mode="sync"))
    with pytest.raises(ValueError, match="engine.instances=2 needs engine.kind=builtin"):
        EngineConfig(instances=2, kind="vllm")
    RunConfig(engine=EngineConfig(instances=2), runtime=RuntimeConfig(mode="async"))


def test_summed_metrics_are_live(router3, tokenizer):
    held = router3.metrics  # the runtime keeps the record and reads it each step
    before = held.requests
    _each(router3, [_req(_prompts(tokenizer)[0], temperature=0.0, max_tokens=2)])
    assert held.requests == before + 1
    assert held.busy_s is not None and held.started <= min(e.metrics.started for e in router3.instances)
    assert threading.active_count() >= 3  # each instance runs its own engine thread


def test_seer_priorities_reach_each_instances_admission_queue_in_order(tiny_model, tokenizer):
    """engine.instances=2 (round_robin, one running slot each): each instance busy with a long request, six requests
    with Seer's priorities (agent/priorities.py: a new group's probe first, then longest estimate first) queue three
    per instance in another order; each instance admits (so finishes) its three by priority."""
    seer = ProgramPriorities(budget_tokens=100)
    for group, tokens in (("short", 5), ("long", 50)):  # each group's probe finished, its length known
        seer.priority(group, f"{group}0")
        seer.generated(group, f"{group}0", tokens)
        seer.finished(group, f"{group}0")
    asks = [("short", "short1"), ("long", "long1"), ("fresh", "fresh0"), ("short", "short2"), ("long", "long2"),
            ("fresh", "fresh1")]
    prios = [seer.priority(g, p) for g, p in asks]
    setup = EngineSetup(engine=EngineConfig(instances=2, router="round_robin", max_batch_size=1),
                        model=ModelConfig(kind="tiny"), seed=0, context_tokens=4096, interrupt_on_update=False, cpus=1)
    router = make_engine(setup, tiny_model, tokenizer, 0)
    prompt = _prompts(tokenizer)[0]
    try:
        async def go():
            blockers = [asyncio.ensure_future(router.generate(_req(prompt, temperature=0.0, max_tokens=40,
                                                                   ignore_eos=True))) for _ in range(2)]
            while any(e.metrics.generated_tokens == 0 for e in router.instances):
                await asyncio.sleep(0.001)
            order: list[int] = []

            async def one(k):
                await router.generate(GenerationRequest(prompt_ids=prompt, program_id=asks[k][1], group_id=asks[k][0],
                                                        priority=prios[k],
                                                        sampling=SamplingParams(temperature=0.0, max_tokens=2)))
                order.append(k)

            await asyncio.gather(*[one(k) for k in range(6)], *blockers)
            return order

        order = asyncio.run(go())
        for instance in (0, 1):  # round robin after the blockers: request k on instance k % 2
            mine = [k for k in order if k % 2 == instance]
            assert [prios[k] for k in mine] == sorted(prios[k] for k in mine), (instance, order, prios)
        assert prios[2] < prios[1] < prios[0]  # the probe of a fresh group, then long before short
    finally:
        router.close()


@pytest.mark.integration
def test_a_local_async_run_trains_through_two_instances(tmp_path, monkeypatch):
    """runtime.mode=async, engine.instances=2: the rollout side's engine is a router over two built-in engines; each
    version the trainer publishes loads into both and is confirmed, and every stored token carries its version."""
    from pathlib import Path

    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train
    from loomrl.store import read_trajectories

    recipe = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
    cfg = load_config(recipe, [f"output_dir={tmp_path}", "progress=false", "name=router", "runtime.mode=async",
                               "engine.instances=2", "trainer.total_steps=2", "eval.n_tasks=0", "checkpoint_every=0",
                               "reward.function=rewards_for_tests:parity_reward"])
    loaded: list[list[int]] = []  # per update: the instances' versions after it (a spy: the update itself runs)
    real = Router.update_weights

    def spy(self, weights, version):
        real(self, weights, version)
        loaded.append([e.version for e in self.instances])

    monkeypatch.setattr(Router, "update_weights", spy)
    summary = train(cfg)
    assert summary["steps"] == 2
    assert loaded and all(len(v) == 2 and len(set(v)) == 1 for v in loaded)  # each version reached both instances
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert rows and all(len(r["versions"]) == len(r["token_ids"]) for r in rows)
    synced = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "weight_sync/fingerprinted" in m]
    assert synced and all(m["weight_sync/fingerprinted"] > 0 for m in synced)
    steps = [m for m in read_metrics(cfg.run_dir) if m["kind"] == "train" and "engine/requests" in m]
    assert steps and sum(m["engine/requests"] for m in steps) > 0  # the two instances' counters, summed
