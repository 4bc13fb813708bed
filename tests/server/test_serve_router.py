"""`loomrl serve` with engine.instances=2: runtime/serve.py builds its engine with make_engine, so a Router over two
built-in engines answers the OpenAI-compatible API (real HTTP, the real `openai` client, serve() itself in a thread)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.engine.router import Router

pytestmark = pytest.mark.integration  # starts a server: not in `make test-fast`

openai = pytest.importorskip("openai")
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def test_serve_with_two_instances_answers_through_the_router(monkeypatch):
    import uvicorn

    from loomrl.runtime.serve import serve
    from loomrl.server import app as app_module

    engines, servers = [], []
    real_create, real_startup = app_module.create_app, uvicorn.Server.startup

    def create_app(engine, tokenizer, model_name):  # a spy: the engine serve() built
        engines.append(engine)
        return real_create(engine, tokenizer, model_name)

    async def startup(self, sockets=None):  # a spy: the server, to stop it
        servers.append(self)
        await real_startup(self, sockets)

    monkeypatch.setattr(app_module, "create_app", create_app)
    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    cfg = load_config(RECIPE, ["engine.instances=2", "engine.router=round_robin", "runtime.mode=async"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    thread = threading.Thread(target=serve, args=(cfg, None, "127.0.0.1", port, "tiny"), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not (servers and servers[0].started):
        assert thread.is_alive() and time.time() < deadline, "serve() did not start"
        time.sleep(0.05)
    try:
        (router,) = engines
        assert isinstance(router, Router) and len(router.instances) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for prompt in ("The capital of France is", "Two plus two is"):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0,
                                            extra_body={"return_token_ids": True})
            assert len(out.choices[0].model_extra["token_ids"]) == out.usage.completion_tokens > 0
        assert router.placement.placements == {"round_robin": 2}
        assert [e.metrics.requests for e in router.instances] == [1, 1]  # each instance answered one
    finally:
        servers[0].should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert all(e._closed for e in router.instances)  # serve() closed the router, and so every instance
