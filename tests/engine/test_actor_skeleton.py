"""The processes that drive vLLM or SGLang hold no weights (issue 27): the rollout side (rollout/actor.py RolloutSide,
the local backend's and every RolloutActor's) and the engine actor (engine/actor.py EngineActor) give engine.kind vllm
(in process), vllm with base_url and sglang a meta-device skeleton of the model (model/loader.py load_skeleton), with
the names, shapes, tied names, config and folder those engines need; the built-in engine still gets the weights.

In every test the model is a tiny random Llama saved as a Hugging Face folder (model.kind=hf), as a real run's model
is, and loading or building weights in this process fails the test (load_model and build_tiny_model are made to
raise). What is faked, since the real thing cannot run here, and nothing else:
- vLLM in process: VLLMEngine is replaced by a recorder of what it was handed (vLLM is not installed in the main
  suite's venv; test_vllm_engine.py starts the real one from a skeleton, in .venv-vllm);
- vLLM over HTTP: VLLMHTTPEngine._connect, the first call to the server, answers as a server of max_model_len 2048
  would (no server here; test_vllm_http_engine.py runs a real one);
- SGLang: SGLangEngine._connect, its first call to the server (/server_info), answers as a server without the
  memory saver or a CPU weight backup would (no server here; test_sglang_engine.py has a fake one);
- EngineActor's one Ray call, reading the weight board at start: ray.get returns what it is given (starting a Ray
  cluster costs about 10 s on 2 cores, and the actor class is a plain class Ray wraps).
"""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import pytest
import torch

from loomrl.config import load_config
from loomrl.config.pools import serving_dtype_name
from loomrl.engine.base import EngineMetrics
from loomrl.engine.vllm.weights import parameter_shapes
from loomrl.weights.route import serving_dtype

KINDS = {
    "vllm": ["engine.kind=vllm"],
    "vllm_http": ["engine.kind=vllm", "engine.vllm.base_url=http://127.0.0.1:9"],
    "sglang": ["engine.kind=sglang", "engine.sglang.base_url=http://127.0.0.1:9"],
}


class RecordedVLLM:
    """Stands in for VLLMEngine (vLLM is not installed here): keeps the ServedModel it was handed."""

    made: list[RecordedVLLM] = []

    def __init__(self, cfg, served, **kwargs):
        self.served, self.kv_budget, self.version = served, 2048, kwargs["version"]
        self.metrics = EngineMetrics()
        RecordedVLLM.made.append(self)

    def close(self) -> None:
        if self.served.owned:
            shutil.rmtree(self.served.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_model, tokenizer):
    """The tiny model as a Hugging Face folder (config, safetensors, tokenizer): a real run's model.kind=hf."""
    folder = tmp_path_factory.mktemp("tiny_hf")
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def no_weights_here(monkeypatch):
    """Loading or building a model's weights in this process fails the test; vLLM and its server are faked (above)."""
    from loomrl.engine import sglang
    from loomrl.engine.vllm import engine as vllm_engine
    from loomrl.engine.vllm import http as vllm_http
    from loomrl.model import loader

    def refuse(*args, **kwargs):
        raise AssertionError("a process that drives vLLM or SGLang loaded the model's weights")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(loader, "build_tiny_model", refuse)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", RecordedVLLM)
    monkeypatch.setattr(vllm_http.VLLMHTTPEngine, "_connect", lambda self: 2048)
    monkeypatch.setattr(sglang.SGLangEngine, "_connect", lambda self, sleep_mode: (False, False))
    RecordedVLLM.made.clear()


def run_config(kind: str, folder):
    return load_config(None, [*KINDS[kind], "runtime.mode=async", "runtime.backend=ray", "model.kind=hf",
                              f"model.path={folder}", "env.n_train=8", "env.n_heldout=4"])


def check_served(kind: str, engine, model, tiny_model, folder) -> None:
    """`model` is a skeleton: no parameter or buffer has storage; and `engine` has what it needs of the model."""
    cfg = run_config(kind, folder)
    cfg_dtype = serving_dtype(cfg.engine.kind, serving_dtype_name(cfg.engine, cfg.model), cfg.model.device)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert {p.dtype for p in model.parameters()} == {cfg_dtype}  # the dtype the engine serves
    want = parameter_shapes(tiny_model)  # names -> shapes, and the tied lm_head.weight, of the loaded model
    assert want[1] == frozenset({"lm_head.weight"}) and parameter_shapes(model) == want
    if kind == "vllm":
        served = RecordedVLLM.made[-1].served
        assert served.folder == folder and not served.owned  # vLLM loads the run's own folder
        assert (served.shapes, served.aliases) == want
    elif kind == "vllm_http":
        assert (engine.shapes, engine.aliases) == want  # what updates are checked against before they are sent
    else:  # written as config.json beside each version SGLang loads
        got, real = engine.model_config.to_dict(), tiny_model.config.to_dict()
        assert {k: got[k] for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size",
                                    "tie_word_embeddings")} == {k: real[k] for k in ("architectures", "hidden_size",
                                                                                     "num_hidden_layers", "vocab_size",
                                                                                     "tie_word_embeddings")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_rollout_side_of_vllm_or_sglang_holds_no_weights(kind, hf_folder, tiny_model, no_weights_here):
    from loomrl.rollout.actor import RolloutSide

    side = RolloutSide(run_config(kind, hf_folder).rollout_pool(), None)
    try:
        check_served(kind, side.engine, side.model, tiny_model, hf_folder)
        assert side.tokenizer.eos_token_id == tiny_model.config.eos_token_id  # the run's tokenizer all the same
    finally:
        asyncio.run(side.close())


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_engine_actor_of_vllm_or_sglang_holds_no_weights(kind, hf_folder, tiny_model, no_weights_here,
                                                             monkeypatch):
    ray = pytest.importorskip("ray")  # the actor reads its board through Ray (not in .venv-vllm)
    from loomrl.engine import actor as engine_actor
    from loomrl.engine.factory import make_engine

    monkeypatch.setattr(ray, "get", lambda ref: ref)  # the board's read (see the module docstring)
    board = SimpleNamespace(latest=SimpleNamespace(remote=lambda: None))  # nothing published yet
    given = []  # the model the actor hands the (real) factory: it keeps none itself
    monkeypatch.setattr(engine_actor, "make_engine", lambda setup, model, *a: given.append(model) or make_engine(
        setup, model, *a))
    threads = torch.get_num_threads()  # the actor sets its process's threads
    actor = engine_actor.EngineActor(run_config(kind, hf_folder).engine_setup().model_dump_json(), board, 0, 1)
    try:
        check_served(kind, actor.engine, given[0], tiny_model, hf_folder)
        assert actor.gate.device == torch.device("cpu")  # where a broadcast it received itself would land: not meta
    finally:
        actor.close()
        torch.set_num_threads(threads)
