"""`loomrl serve`: the recipe's engine over a checkpoint's weights (or the recipe's model) behind the OpenAI-compatible
app (server/app.py), under uvicorn. The engine's policy version is the checkpoint's step, so /health, /metrics and every
token's `policy_versions` name the weights served (0: the recipe's model, untrained). Once the socket listens, one line
on stdout says where (URL, model name, engine, policy version); uvicorn itself logs warnings only.

Not here: weights of an engine that holds its own (engine.kind sglang, or vllm with base_url): those servers serve what
they loaded, whatever the checkpoint."""

from __future__ import annotations

from pathlib import Path

from loomrl.config import RunConfig


def serve(cfg: RunConfig, checkpoint: Path | None, host: str, port: int, model_name: str) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM: uvicorn's shutdown), then close the engine."""
    import uvicorn

    from loomrl.engine.factory import make_engine
    from loomrl.model.loader import load_engine_model
    from loomrl.server.app import create_app
    from loomrl.trainer.checkpoint import checkpoint_step

    setup = cfg.engine_setup()
    model, tokenizer = load_engine_model(setup, checkpoint)  # weights only for the built-in engine
    version = checkpoint_step(checkpoint) if checkpoint is not None else 0
    engine = make_engine(setup, model, tokenizer, version)
    weights = f"checkpoint {checkpoint}" if checkpoint is not None else f"model.kind={cfg.model.kind}, untrained"

    class Announcing(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # bound and listening (a bind failure has logged its error and exited instead)
                bound_host, bound_port = self.servers[0].sockets[0].getsockname()[:2]
                where = f"[{bound_host}]" if ":" in bound_host else bound_host
                print(f"loomrl serve: listening on http://{where}:{bound_port}/v1 (model {model_name!r}, engine "
                      f"{cfg.engine.kind}, policy version {version}: {weights})", flush=True)

    try:
        Announcing(uvicorn.Config(create_app(engine, tokenizer, model_name), host=host, port=port,
                                  log_level="warning")).run()
    finally:
        engine.close()
