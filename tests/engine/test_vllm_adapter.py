"""The parts of engine.kind=vllm that need no vLLM (these run in the main suite, where vLLM is not installed): its
config, the error that names the install command, the model folder handed to vLLM, per-token versions from vLLM's
weight-version spans and the weights' wire format. The engine itself is tested on a real vLLM in test_vllm_engine.py."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomrl.config import ConfigError, ModelConfig, TinyModelConfig
from loomrl.engine.base import EngineFault
from loomrl.engine.factory import make_engine
from loomrl.engine.vllm.served import served_model
from loomrl.engine.vllm.translate import token_versions
from loomrl.engine.vllm.weights import from_wire, to_wire
from loomrl.model.loader import load_model
from loomrl.runtime.checks import load_checked
from loomrl.weights.route import engine_dtype


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises, find_spec says None: as if not installed


def test_without_vllm_the_config_and_the_engine_name_the_install_command(no_vllm, tiny_model, tokenizer,
                                                                         monkeypatch):
    with pytest.raises(ConfigError, match=r"engine.kind=vllm: vLLM is not installed; run `pip install 'loomrl\[vllm\]'`"):
        load_checked(None, ["engine.kind=vllm", "runtime.mode=async"])
    cfg = load_checked(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray"])  # checked on the actors
    made: list[str] = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])
    with pytest.raises(EngineFault, match=r"pip install 'loomrl\[vllm\]'"):
        make_engine(cfg.engine_setup(), tiny_model, tokenizer, 0)
    assert len(made) == 1 and not Path(made[0]).exists()  # the model folder saved for vLLM is gone again


def test_config_refuses_sync_mode_and_engine_args_loomrl_sets(no_vllm):
    with pytest.raises(ConfigError, match="engine.kind=vllm needs runtime.mode=async"):
        load_checked(None, ["engine.kind=vllm", "runtime.backend=ray"])
    with pytest.raises(ConfigError, match=r"may not set \['logprobs_mode'\]"):
        load_checked(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray",
                           "engine.vllm.engine_args.logprobs_mode=raw_logprobs"])
    cfg = load_checked(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray",
                             "engine.vllm.engine_args.max_num_batched_tokens=8192", "engine.vllm.block_size=32"])
    assert cfg.engine.vllm.engine_args == {"max_num_batched_tokens": 8192} and cfg.engine.vllm.block_size == 32


def test_the_served_folder_is_the_models_own_or_a_temporary_copy(tmp_path, tokenizer):
    tiny, _ = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=32)))
    copy = served_model(tiny, tokenizer)  # built from a config: no folder of its own
    try:
        assert copy.owned and (copy.folder / "config.json").is_file() and (copy.folder / "tokenizer.json").is_file()
        assert "lm_head.weight" in copy.aliases and "lm_head.weight" not in copy.shapes  # tied: sent once
        assert copy.shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
        loaded, _ = load_model(ModelConfig(kind="hf", path=str(copy.folder)))
        own = served_model(loaded, tokenizer)
        assert own.folder == copy.folder and not own.owned and own.shapes == copy.shapes
    finally:
        shutil.rmtree(copy.folder)


def test_a_tiny_models_skeleton_is_served_from_its_seeds_weights(tokenizer):
    """The rollout side of a run holds a skeleton (model/loader.py load_skeleton); a tiny model has no folder, so its
    weights, which are its seed's, are built on the CPU only to be saved for vLLM: the folder holds exactly the
    weights load_model gives (what the trainer starts from). A skeleton with neither is refused in one line."""
    import torch
    from safetensors.torch import load_file

    from loomrl.model.loader import ModelLoadError, build_tiny_model, load_skeleton

    cfg = ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=32))
    skeleton, _ = load_skeleton(cfg, None, dtype=torch.bfloat16)
    real, _ = load_model(cfg)
    copy = served_model(skeleton, tokenizer, lambda: build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id))
    try:
        saved = load_file(str(copy.folder / "model.safetensors"))
        assert copy.owned and set(saved) == set(copy.shapes) and copy.aliases == {"lm_head.weight"}
        assert all(torch.equal(saved[n], p) for n, p in real.named_parameters())
        assert all(p.is_meta for p in skeleton.parameters())  # the skeleton itself stays empty
    finally:
        shutil.rmtree(copy.folder)
    with pytest.raises(ModelLoadError, match=r"^engine.kind=vllm: the model \(LlamaForCausalLM\) has no weights here"):
        served_model(skeleton, tokenizer)


def test_versions_come_from_vllms_spans():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731 - vllm.outputs.WeightVersionSpan
    assert token_versions([span("4", 0, 2), span("5", 2, 5)], 5, 0) == [4, 4, 5, 5, 5]
    assert token_versions([span("default", 0, 3)], 3, 7) == [7, 7, 7]  # a label that is not loomrl's
    assert token_versions(None, 2, 7) == [7, 7] and token_versions([], 0, 7) == []
    assert token_versions([span("4", 0, 2)], 3, 1) == [1, 1, 1]  # spans that do not cover the output
    # the HTTP server sends them as JSON objects
    assert token_versions([{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}], 3, 0) == [
        2, 3, 3]
    assert engine_dtype("auto", "bfloat16") == "bfloat16" and engine_dtype("float16", "auto") == "float16"


@pytest.mark.parametrize("text", [False, True])
def test_the_wire_format_carries_tensors_exactly_as_bytes_or_base64(text):
    """In process the blobs are memoryviews (received as bytes); over HTTP (JSON) base64 strings: both decode."""
    import json

    import torch

    named = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16).view(2, 3))]
    wire = to_wire(named, text=text)
    if text:
        wire = json.loads(json.dumps(wire))
    else:
        wire["blobs"] = [bytes(b) for b in wire["blobs"]]
    back = from_wire(SimpleNamespace(**wire))
    assert [n for n, _ in back] == ["a", "b"]
    assert all(t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(back, named))


def test_with_a_base_url_the_http_engine_needs_no_local_vllm(no_vllm, tiny_model, tokenizer):
    """engine.vllm.base_url: a client of a vLLM server (tested against a real one in test_vllm_http_engine.py); vLLM
    need not be installed here, and a server that does not answer is an EngineFault naming its address."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = load_checked(None, ["engine.kind=vllm", "runtime.mode=async", f"engine.vllm.base_url=http://127.0.0.1:{port}",
                             "engine.vllm.retries=1", "engine.vllm.retry_backoff_s=0.01"])
    with pytest.raises(EngineFault, match=rf"vLLM /health: cannot reach http://127.0.0.1:{port}"):
        make_engine(cfg.engine_setup(), tiny_model, tokenizer, 0)


def test_several_vllm_servers_are_one_per_engine_actor():
    from loomrl.config import ConfigError
    from loomrl.engine.factory import server_of

    urls = ["http://a:8000", "http://b:8000"]
    listed = f"engine.vllm.base_url=[{', '.join(urls)}]"
    with pytest.raises(ConfigError, match="engine.vllm.base_url lists 2 servers: .* ray.engine.count=2"):
        load_checked(None, ["engine.kind=vllm", "runtime.mode=async", listed])
    cfg = load_checked(None, ["engine.kind=vllm", "runtime.mode=async", listed, "runtime.backend=ray",
                             "ray.engine.count=2"])
    assert [server_of(cfg.engine.vllm.base_url, r) for r in range(3)] == [urls[0], urls[1], urls[0]]
    assert server_of("http://one:1", 5) == "http://one:1"
