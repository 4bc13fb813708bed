"""Server replicas behind the router: engine.instances > 1 with engine.kind vllm (engine.vllm.base_url) or sglang
(engine.sglang.base_url) listing that many servers gives a Router (engine/router.py) over one HTTP client per server.

How the two meanings of a base_url list are told apart: engine.instances > 1 asks for the router here, in the process
that builds the engine, over every server listed; engine.instances = 1 keeps the Ray meaning (engine actor i drives
server i alone: factory.server_of). Each client here is the one engine actor i would build (make_engine with
replica=i), so server i gets the same client, weights folder and settings either way.

What the router gives replicas: weights fan out to every server and the version is reported once all serve it; each
server's fingerprint is checked (vLLM: read in its worker through /collective_rpc; SGLang reports none, so only its
version is); affinity placement uses the router's own prefix index, a model of the servers' prefix caches behind it;
a request whose server fails (EngineFault: refused, reset, killed) runs once more, from its prompt, on another.

What it is not: a launcher or health checker of the servers (the user runs them), or a K/V pool across them (their
own connectors, e.g. vLLM's LMCache or NIXL, are configured on the servers).
"""

from __future__ import annotations

from collections.abc import Callable

from loomrl.config import EngineSetup
from loomrl.engine.base import Engine


def server_replicas(setup: EngineSetup, client: Callable[[EngineSetup, int], Engine]) -> Engine:
    """A Router over `client(one, i)` for each server i of the list, where `one` is `setup` with engine.instances 1
    (so `client`, make_engine, builds the single-server client actor i would); every client built is closed if a
    later one fails to connect."""
    from loomrl.engine.router import Router

    e = setup.engine
    one = setup.model_copy(update={"engine": e.model_copy(update={"instances": 1})})
    built: list[Engine] = []
    try:
        for i in range(e.instances):
            built.append(client(one, i))
    except BaseException:
        for engine in built:  # no client thread left behind
            engine.close()
        raise
    return Router(built, policy=e.router, retire=e.retire_failed_instances)
