"""engine.instances > 1 with vLLM or SGLang servers (engine/replicas.py): the config takes exactly one server per
instance and says which field is wrong otherwise; make_engine builds a Router over one client per server, each the
client engine actor i would build (its own server and weights folder); a client that cannot connect closes the ones
built before it.

The SGLang case runs against two fake SGLang servers (test_sglang_engine.py's FakeSGLang over real HTTP: SGLang is a
GPU build and cannot run here); the vLLM case against real servers is test_router_replicas.py (marked vllm)."""

from __future__ import annotations

import asyncio

import pytest
from test_sglang_engine import FakeSGLang, fake_app

from loomrl.agent.gateway import ServerThread
from loomrl.config import EngineConfig, EngineSetup, ModelConfig, SGLangConfig, VLLMConfig
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams
from loomrl.engine.factory import make_engine
from loomrl.engine.router import Router
from loomrl.engine.sglang import SGLangEngine


def test_instances_take_exactly_one_server_each():
    urls = ["http://a:8000", "http://b:8000"]
    assert EngineConfig(kind="vllm", instances=2, vllm=VLLMConfig(base_url=urls)).instances == 2
    assert EngineConfig(kind="sglang", instances=2, sglang=SGLangConfig(base_url=urls)).instances == 2
    with pytest.raises(ValueError, match=r"engine.instances=2 needs engine.kind=builtin, or engine.vllm.base_url "
                                         r"listing 2 servers .* but engine.vllm.base_url lists 3"):
        EngineConfig(kind="vllm", instances=2, vllm=VLLMConfig(base_url=[*urls, "http://c:8000"]))
    with pytest.raises(ValueError, match=r"but engine.sglang.base_url is 'http://a:8000'"):
        EngineConfig(kind="sglang", instances=2, sglang=SGLangConfig(base_url=urls[0]))
    with pytest.raises(ValueError, match=r"but engine.vllm.base_url is None"):  # vLLM in process: one engine
        EngineConfig(kind="vllm", instances=2)
    # instances 1 with a list keeps its Ray meaning (one server per engine actor): no router asked for
    assert EngineConfig(kind="vllm", vllm=VLLMConfig(base_url=urls)).instances == 1


def test_a_run_config_tells_the_router_from_one_server_per_ray_actor():
    """engine.instances > 1 with a server list: one router in the process fronts them all (any backend, no engine
    actors); engine.instances 1: engine actor i drives server i (Ray only). Both at once would give every engine actor
    a router over every server: refused."""
    from loomrl.config import load_config

    urls = "engine.vllm.base_url=[http://a:1, http://b:1]"
    run = load_config(None, ["engine.kind=vllm", "engine.instances=2", urls, "runtime.mode=async"])
    assert run.engine.instances == 2 and run.runtime.backend != "ray"
    with pytest.raises(ValueError, match=r"one engine actor drives each, so set runtime.backend=ray"):
        load_config(None, ["engine.kind=vllm", urls, "runtime.mode=async"])
    with pytest.raises(ValueError, match=r"engine.instances=2 puts a router over every server .* set "
                                         r"engine.instances=1 \(actor i drives server i\) or ray.engine.count=0"):
        load_config(None, ["engine.kind=vllm", "engine.instances=2", urls, "runtime.mode=async",
                           "runtime.backend=ray", "ray.engine.count=2"])

@pytest.fixture
def two_fakes():
    fakes = [FakeSGLang(), FakeSGLang()]
    servers = [ServerThread(fake_app(f)) for f in fakes]
    yield fakes, [s.url for s in servers]
    for s in servers:
        s.stop()


def _setup(urls, tmp_path) -> EngineSetup:
    return EngineSetup(engine=EngineConfig(kind="sglang", instances=2, router="round_robin", sglang=SGLangConfig(
        base_url=urls, weights_dir=str(tmp_path / "w"), retries=0, context_length=4096)),
        model=ModelConfig(kind="tiny"), seed=0, context_tokens=4096, interrupt_on_update=False, cpus=1)


def test_sglang_servers_sit_behind_the_router_one_client_each(two_fakes, tmp_path, tiny_model, tokenizer):
    fakes, urls = two_fakes
    router = make_engine(_setup(urls, tmp_path), tiny_model, tokenizer, 0)
    try:
        assert isinstance(router, Router) and [type(e) for e in router.instances] == [SGLangEngine] * 2
        assert [e.base_url for e in router.instances] == urls
        assert [e.cfg.weights_dir for e in router.instances] == [str(tmp_path / "w" / f"server{i}") for i in (0, 1)]

        async def two():
            params = SamplingParams(max_tokens=4)
            return await asyncio.gather(*[router.generate(GenerationRequest(prompt_ids=[3, 1, 4], sampling=params))
                                          for _ in range(2)])

        asyncio.run(two())
        assert [len(f.bodies.get("/generate", [])) for f in fakes] == [1, 1]  # round_robin: one each
        router.update_weights(tiny_model.state_dict(), 1)
        assert router.version == 1 and [f.weight_version for f in fakes] == ["1", "1"]  # both servers loaded it
    finally:
        router.close()


def test_a_server_gone_for_good_is_retired_at_the_next_update_and_the_run_serves_on(tmp_path, tiny_model, tokenizer):
    """A replica killed for good (its server stopped) fails the next weight update: the router retires it and the
    other replica serves every later request."""
    fakes = [FakeSGLang(), FakeSGLang()]
    servers = [ServerThread(fake_app(f)) for f in fakes]
    router = make_engine(_setup([s.url for s in servers], tmp_path), tiny_model, tokenizer, 0)
    try:
        servers[1].stop()
        router.update_weights(tiny_model.state_dict(), 1)
        assert router.version == 1 and router.live() == [0] and fakes[0].weight_version == "1"

        async def four():
            params = SamplingParams(max_tokens=4)
            return await asyncio.gather(*[router.generate(GenerationRequest(prompt_ids=[3, 1, 4], sampling=params))
                                          for _ in range(4)])

        assert len(asyncio.run(four())) == 4 and len(fakes[0].bodies["/generate"]) == 4
        assert router.placement.retired == 1 and router.placement.retried == 0
    finally:
        router.close()
        servers[0].stop()

def test_a_server_that_cannot_be_reached_closes_the_clients_built_before_it(two_fakes, tmp_path, tiny_model,
                                                                             tokenizer, monkeypatch):
    _, urls = two_fakes
    closed: list[str] = []
    real_close = SGLangEngine.close

    def spy(self):
        closed.append(self.base_url)
        real_close(self)

    monkeypatch.setattr(SGLangEngine, "close", spy)
    with pytest.raises(EngineFault, match="cannot reach|ConnectError"):
        make_engine(_setup([urls[0], "http://127.0.0.1:9"], tmp_path), tiny_model, tokenizer, 0)
    assert urls[0] in closed  # the first server's client is not left behind (the second closes itself)
