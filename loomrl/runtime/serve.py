"""`loomrl serve`: the recipe's engine over a checkpoint's weights (or the recipe's model) behind the OpenAI-compatible
app (server/app.py), under uvicorn. The engine's policy version is the checkpoint's step, so /health, /metrics and every
token's `policy_versions` name the weights served (0: the recipe's model, untrained). Once the socket listens, one line
on stdout says where (URL, model names, engine, policy versions); uvicorn itself logs warnings only.

With adapters (`--adapter NAME=PATH`, repeatable: a LoRA run's checkpoint, its run folder's latest, or a PEFT adapter
folder) one process serves the base and each adapter side by side, a request's `model` choosing: one built-in engine
per adapter over a model that shares every tensor the adapter does not change with the base's (model/adapter.py
shared_adapter_model: only its targeted linears are its own, merged). What each engine holds beside that is its own:
its K/V and prefix cache, and the runner's fused (and on CPU oneDNN-packed) copy of every projection (engine/builtin/
runner.py refresh). An adapter made for another base model is refused at start, naming its folder and the mismatch.

Not here: weights of an engine that holds its own (engine.kind sglang, or vllm with base_url): those servers serve what
they loaded, whatever the checkpoint. Adapters on vLLM (its multi-LoRA) or several instances per adapter: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.config import RunConfig


@dataclass(slots=True, frozen=True, kw_only=True)
class ServedAdapter:
    """One `--adapter NAME=PATH`: the model name requests send, the PEFT adapter folder, and the policy version its
    tokens carry (the checkpoint's step; 0 for a bare adapter folder)."""

    name: str
    folder: Path
    version: int


def served_adapter(name: str, path: Path) -> ServedAdapter:
    """`path` as an adapter: a PEFT adapter folder, a LoRA run's checkpoint, or a run folder (its latest checkpoint);
    CannotStart for anything else."""
    from loomrl.model.adapter import ADAPTER_WEIGHTS, is_adapter_folder
    from loomrl.run_folder import STEP_PREFIX, CheckpointFolder
    from loomrl.runtime.failures import CannotStart
    from loomrl.runtime.run import resolve_checkpoint

    if is_adapter_folder(path):  # a checkpoint's model folder carries its checkpoint's step
        inside = CheckpointFolder(path.parent)
        step = inside.step if path.parent.name.startswith(STEP_PREFIX) and inside.model == path else 0
        return ServedAdapter(name=name, folder=path, version=step)
    try:
        ckpt = resolve_checkpoint(path)
    except CannotStart as err:
        raise CannotStart(f"--adapter {name}={path}: not a PEFT adapter folder (no {ADAPTER_WEIGHTS}), and {err}") from err
    folder = CheckpointFolder(ckpt).model
    if not is_adapter_folder(folder):
        raise CannotStart(f"--adapter {name}={path}: checkpoint {ckpt} holds a whole model, not a LoRA adapter "
                          "(serve it with --checkpoint)")
    return ServedAdapter(name=name, folder=folder, version=CheckpointFolder(ckpt).step)


def _check_adapters(cfg: RunConfig, checkpoint: Path | None, model_name: str, adapters: Sequence[ServedAdapter]):
    """CannotStart when these adapters cannot be served beside the base (before any model is loaded)."""
    from loomrl.model.adapter import is_adapter_folder
    from loomrl.run_folder import CheckpointFolder
    from loomrl.runtime.failures import CannotStart

    names = [model_name, *(a.name for a in adapters)]
    if len(set(names)) < len(names):
        raise CannotStart(f"--adapter: every served model needs a name of its own, got {names} (the first is the "
                          "base's: --model-name or the recipe's name)")
    e = cfg.engine
    if e.kind != "builtin":
        raise CannotStart(f"--adapter needs engine.kind=builtin (got {e.kind}): serving adapters through vLLM's "
                          "multi-LoRA is not wired into `loomrl serve`")
    if e.instances > 1 or e.kv_pool_bytes:
        raise CannotStart("--adapter serves one built-in engine per adapter: engine.instances > 1 would give each "
                          "instance a whole copy of the model, and engine.kv_pool_bytes one K/V pool to engines of "
                          "different weights under one version; set engine.instances=1 engine.kv_pool_bytes=0")
    if checkpoint is not None and is_adapter_folder(CheckpointFolder(checkpoint).model):
        raise CannotStart(f"--checkpoint {checkpoint} is a LoRA adapter: the adapters go over the recipe's model, "
                          "so pass it as one more --adapter NAME=PATH instead")


def _adapter_engines(cfg: RunConfig, base: Any, tokenizer: Any, adapters: Sequence[ServedAdapter]) -> dict[str, Any]:
    """name -> a built-in engine over `base` with that adapter merged (shared_adapter_model). Every adapter is
    checked against the base before any engine is built; CannotStart names the first that does not fit."""
    from loomrl.engine.factory import make_engine
    from loomrl.model.adapter import check_adapter_fits, shared_adapter_model
    from loomrl.runtime.failures import CannotStart

    for a in adapters:
        try:
            check_adapter_fits(base, a.folder)
        except ValueError as err:
            raise CannotStart(f"--adapter {a.name}: {err}") from err
    engines: dict[str, Any] = {}
    try:
        for a in adapters:
            try:
                model = shared_adapter_model(base, a.folder)
            except ValueError as err:  # its target_modules match modules of the base it holds no tensors for
                raise CannotStart(f"--adapter {a.name}: {err}") from err
            engines[a.name] = make_engine(cfg.engine_setup(), model, tokenizer, a.version, share_linears=True)
    except BaseException:
        for engine in engines.values():  # no engine thread left behind
            engine.close()
        raise
    return engines


def serve(cfg: RunConfig, checkpoint: Path | None, host: str, port: int, model_name: str,
          adapters: Sequence[ServedAdapter] = ()) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM: uvicorn's shutdown), then close the engines."""
    import uvicorn

    from loomrl.engine.factory import make_engine
    from loomrl.model.loader import load_engine_model
    from loomrl.server.app import create_app
    from loomrl.trainer.checkpoint import checkpoint_step

    if adapters:
        _check_adapters(cfg, checkpoint, model_name, adapters)
    setup = cfg.engine_setup()
    model, tokenizer = load_engine_model(setup, checkpoint)  # weights only for the built-in engine
    version = checkpoint_step(checkpoint) if checkpoint is not None else 0
    # with adapters, every engine shares the packed linears of the weights its adapter leaves alone (builtin/linears.py)
    engine = make_engine(setup, model, tokenizer, version, share_linears=bool(adapters))
    try:
        extra = _adapter_engines(cfg, model, tokenizer, adapters)
    except BaseException:
        engine.close()
        raise
    weights = f"checkpoint {checkpoint}" if checkpoint is not None else f"model.kind={cfg.model.kind}, untrained"
    also = "".join(f"; adapter {a.name!r}, policy version {a.version}: {a.folder}" for a in adapters)

    class Announcing(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # bound and listening (a bind failure has logged its error and exited instead)
                bound_host, bound_port = self.servers[0].sockets[0].getsockname()[:2]
                where = f"[{bound_host}]" if ":" in bound_host else bound_host
                print(f"loomrl serve: listening on http://{where}:{bound_port}/v1 (model {model_name!r}, engine "
                      f"{cfg.engine.kind}, policy version {version}: {weights}{also})", flush=True)

    try:
        # adapters= only when there are any: with one model, create_app is called as it always was
        app = create_app(engine, tokenizer, model_name, **({"adapters": extra} if extra else {}))
        Announcing(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
    finally:
        engine.close()
        for other in extra.values():
            other.close()
