"""VLLMHTTPEngine: the Engine protocol over a vLLM server the user runs (`engine.kind: vllm` with engine.vllm.base_url).

What it is: a client of vLLM's OpenAI-compatible server, token ids in and out through its token-in-token-out route
(/inference/v1/generate), with the in-process adapter's contract and the shared lifecycle (engine/adapter.py). The
server's flags, the routes each call uses, the metrics and the limits are in docs/engines.md, 'The vLLM-over-HTTP
adapter's contract'; a server started without the flags the contract needs is refused when the adapter connects.

What it is not: a launcher (the user runs the server), a client of several servers (engine/replicas.py puts one client
per server behind the router), or a fast weight path (every byte goes through JSON, base64, and the server's
EngineCore sockets).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loomrl.config import VLLMConfig
from loomrl.config.engine import refused_vllm_connectors
from loomrl.devices import DTYPE_NAMES, dtype_named
from loomrl.engine.adapter import ControlThread, Lifecycle
from loomrl.engine.base import (
    EngineFault,
    EngineMetrics,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TakesTensors,
)
from loomrl.engine.http import ServerClient
from loomrl.engine.neutral import NEUTRAL_PENALTIES
from loomrl.engine.vllm.lora import AdapterFolders, ServedAdapter, adapter_fingerprint
from loomrl.engine.vllm.served import served_fingerprint
from loomrl.engine.vllm.translate import ExpertLayout, finish_reason, routed_experts, token_versions
from loomrl.engine.vllm.weights import checked_weights, to_wire, weight_buckets
from loomrl.weights.adapter import AdapterMeta, is_adapter_tensor
from loomrl.weights.fingerprint import Fingerprint

log = logging.getLogger(__name__)

_NEEDED = {"logprobs_mode": "processed_logprobs", "policy": "priority"}  # server settings the contract rests on
ROUTED_EXPERTS_FLAG = ("start it with --enable-return-routed-experts (vLLM records them on a GPU only, with prefix "
                       "caching on and Model Runner V2)")
LORA_FLAGS = ("start the vLLM server with --enable-lora --max-lora-rank R (trainer.lora.rank or more) --max-loras 2 "
              "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on this machine (it reads the adapter folders written here)")


class VLLMHTTPEngine(TakesTensors):
    """Engine protocol implementation over a vLLM server; generate is awaited from asyncio, the rest is thread-safe."""

    def __init__(self, cfg: VLLMConfig, *, shapes: dict[str, tuple[int, ...]], aliases: frozenset[str],
                 dtype: str | None = None, version: int = 0, routed_experts: ExpertLayout | None = None):
        """`shapes`, `aliases`: the trainer's parameters (engine/vllm/weights.py parameter_shapes); `dtype`: the weights'
        dtype on the wire; None: the server's model dtype; `routed_experts` (trainer.router_replay): the model's MoE
        layers (translate.py recorded_layout), whose routed experts each result carries (the server must record them,
        checked when connecting)."""
        if not cfg.base_url:
            raise EngineFault("engine.vllm.base_url is not set: the vLLM server's address is needed")
        if not isinstance(cfg.base_url, str):  # engine/factory.py picks this engine's server from a list
            raise EngineFault("VLLMHTTPEngine: engine.vllm.base_url must be one server's address here, not a list")
        self.cfg = cfg
        self.shapes, self.aliases = shapes, aliases
        self.metrics = EngineMetrics(busy_s=0.0)  # busy: a request in flight (the server reports no step times)
        self._life = Lifecycle(self.metrics, version)
        self._dtype = dtype_named(dtype) if dtype else None  # set from the server's when None
        self._experts = routed_experts
        self._http = ServerClient("vLLM", cfg.base_url, retries=cfg.retries, backoff_s=cfg.retry_backoff_s)
        self._control = ControlThread("loomrl-vllm-http-control")
        # adapters (update_adapter), in a folder the server reads: made at the first adapter, removed at close
        self._adapters: AdapterFolders | None = None
        try:
            self.kv_budget = self._connect()
        except BaseException:
            self.close()
            raise

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._life.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with self._life.serving(request) as ticket:
            adapter = self._acquire(ticket.version)  # its version's adapter, kept while it runs (lora.py)
            try:
                data = await self._http.apost("/inference/v1/generate", self.generate_body(request, adapter),
                                              self.cfg.timeout_s)
            finally:
                self._release(adapter)
            return self._result(request, data, ticket.version, interrupted=self._life.interrupted(ticket),
                                adapter=adapter is not None)

    def update_weights(self, weights: dict | None, version: int) -> None:
        """Load `weights` (cast to the server's dtype) between two steps and tag later tokens `version`; returns once
        they serve. Raises EngineFault for names or shapes the served model lacks (nothing is sent then) and for a
        load that failed in the server (the engine then refuses requests until a complete update succeeds)."""
        self._life.check_open("update_weights")
        if weights is None:
            raise EngineFault("update_weights(None): in-place updates need a model shared with the trainer; a vLLM "
                              "server holds its own copy (engine.kind=vllm needs runtime.mode=async)")
        named = checked_weights(weights, self.shapes, self.aliases, self._life.broken)
        self._control.call(f"update_weights: version {version}", self.cfg.update_timeout_s, self._load, named, version)

    def update_adapter(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> None:
        """Serve LoRA adapter `adapter` from a folder written here (the server must read this machine's files) through
        /v1/load_lora_adapter; requests admitted from now on name it (`model`) and their tokens are `version`'s. Older
        adapters no request uses are unloaded (/v1/unload_lora_adapter)."""
        self._life.check_open("update_adapter")
        if self._adapters is None:
            self._adapters = AdapterFolders(Path(tempfile.mkdtemp(prefix="loomrl-vllm-adapters-")))
        served = self._adapters.write(weights, adapter, version)
        self._control.call(f"update_adapter: {adapter.name}", self.cfg.update_timeout_s, self._load_adapter, served)

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint of the server's loaded weights, read in its worker (worker.py loomrl_fingerprint, the
        in-process adapter's) through the server's /collective_rpc (a dev-mode route: VLLM_SERVER_DEV_MODE=1, which
        the adapter needs anyway); the router checks each replica's against the published one."""
        self._life.check_open("weight_fingerprint")
        if any(is_adapter_tensor(n) for n in expected.sums):
            return self._control.call("weight_fingerprint", self.cfg.update_timeout_s, self._adapter_fingerprint,
                                      expected)
        return self._control.call("weight_fingerprint", self.cfg.update_timeout_s, served_fingerprint, expected,
                                  self.version, self.shapes, self._rpc)

    def _rpc(self, method: str, *args: Any) -> Any:
        """`method` of worker.py's WorkerExtension on tensor-parallel rank 0's worker (args as JSON)."""
        t = self.cfg.update_timeout_s
        results = self._http.post("/collective_rpc", {"method": method, "args": list(args), "timeout": t}, t).json()
        return results["results"][0]

    def interrupt(self) -> None:
        """Abort every in-flight request (they end "interrupted" with their partial output) and resume at once."""
        if not self._life.closed:
            self._control.submit(self._interrupt)

    def release(self, program_id: str) -> None:
        """Nothing to do: vLLM's prefix cache is keyed by token blocks, not programs, and evicts on its own."""

    def sleep(self) -> None:
        """/sleep?level=1&mode=abort: in-flight requests end "interrupted", new ones wait; on CUDA (a server started
        with --enable-sleep-mode) the weights go to host memory and the K/V cache is freed; on a CPU a pause."""
        self._life.check_open("sleep")
        self._control.call("sleep", self.cfg.update_timeout_s, self._sleep)

    def wake(self) -> None:
        """/wake_up, then /resume: the weights come back (those before sleep, until the next update)."""
        self._life.check_open("wake")
        self._control.call("wake", self.cfg.update_timeout_s, self._wake)

    def close(self) -> None:
        """Stop the client (the server runs on); requests after this fail with EngineFault."""
        if self._life.close():
            self._control.shutdown()
            self._http.close()
            if self._adapters is not None:
                shutil.rmtree(self._adapters.root, ignore_errors=True)

    # -- the wire format --------------------------------------------------------------------------
    @staticmethod
    def generate_body(request: GenerationRequest, adapter: ServedAdapter | None = None) -> dict[str, Any]:
        """The /inference/v1/generate request (token_in_token_out/protocol.py GenerateRequest); `adapter`: the LoRA
        adapter it is served with (its `model`), None for the base model."""
        s: SamplingParams = request.sampling
        # every field the contract depends on is sent, so the server's defaults (its model's generation_config)
        # change nothing; text is made only where stop strings need it
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, **NEUTRAL_PENALTIES,
                    "max_tokens": s.max_tokens, "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop),
                    "seed": s.seed, "ignore_eos": s.ignore_eos, "logprobs": 0, "detokenize": bool(s.stop)}
        body = {"request_id": f"loomrl-{uuid.uuid4().hex}", "token_ids": list(request.prompt_ids),
                "sampling_params": sampling, "priority": request.priority, "stream": False}
        return body if adapter is None else {**body, "model": adapter.name}

    def _result(self, request: GenerationRequest, data: dict[str, Any], version: int, *,
                interrupted: bool, adapter: bool = False) -> GenerationResult:
        """loomrl's result for the server's answer; under an adapter every token is `version`'s (the request named
        that version's adapter throughout; the server's weight-version spans label the base weights only). The routed
        experts: base64 `.npy` bytes the server sends whenever it records them, with no request field to ask
        (token_in_token_out/protocol.py:416 GenerateChoiceBase.routed_experts)."""
        choices = data.get("choices") or []
        if len(choices) != 1:
            raise EngineFault(f"vLLM /inference/v1/generate answered {len(choices)} choices, not 1")
        c = choices[0]
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        if [int(d["token_id"]) for d in content] != ids:
            raise EngineFault(f"vLLM returned {len(content)} logprobs that do not match its {len(ids)} token ids")
        finish = finish_reason(c.get("finish_reason"), c.get("stop_reason"), closed=self._life.closed,
                               interrupted=interrupted)
        n = len(request.prompt_ids)
        experts = routed_experts(None if self._experts is None else npy_array(c.get("routed_experts")),
                                 tokens=n + len(ids), layout=self._experts, interrupted=finish == "interrupted")
        cached = int(((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        with self._life.lock:
            m = self.metrics
            m.finished += 1
            m.prompt_tokens += n
            m.reused_tokens += cached
            m.prefill_tokens += n - cached
            m.generated_tokens += len(ids)
            m.interrupts += finish == "interrupted"
        return GenerationResult(token_ids=ids, logprobs=[float(d["logprob"]) for d in content],
                                versions=token_versions(None if adapter else c.get("weight_versions"), len(ids),
                                                        version),
                                finish_reason=finish, routed_experts=experts)

    # -- control (on the control thread) ----------------------------------------------------------
    def _connect(self) -> int:
        """Check the server's settings, open the weight-transfer engine, label the weights; the max_model_len."""
        t = self.cfg.control_timeout_s
        self._http.get("/health", t)
        try:
            info = self._http.get("/server_info", t, params={"config_format": "json"}).json()["vllm_config"]
        except EngineFault as err:
            raise EngineFault(f"{err} (start the vLLM server with VLLM_SERVER_DEV_MODE=1)") from None
        model, scheduler = info.get("model_config") or {}, info.get("scheduler_config") or {}
        got = {"logprobs_mode": model.get("logprobs_mode"), "policy": scheduler.get("policy")}
        wrong = [f"{k}={got[k]!r} (needs {v!r})" for k, v in _NEEDED.items() if got[k] != v]
        if wrong:
            raise EngineFault(f"the vLLM server at {self.cfg.base_url} runs with {', '.join(wrong)}: start it with "
                              "--logprobs-mode processed_logprobs --scheduling-policy priority")
        if self._experts is not None:
            check_records_experts(info, str(self.cfg.base_url))
        if refused := refused_vllm_connectors(info.get("kv_transfer_config") or {}):
            raise EngineFault(f"the vLLM server at {self.cfg.base_url} runs the K/V connector {refused[0]}, whose "
                              "store keeps the old weights' K/V across the reset at each update (it has no "
                              "reset_cache in vLLM 0.32): start it with one of loomrl.config.engine's "
                              "VLLM_CONNECTORS_RESET or VLLM_CONNECTORS_TRANSFER")
        try:
            self._http.post("/init_weight_transfer_engine", {"init_info": {}}, t)
        except EngineFault as err:
            raise EngineFault(f"{err} (start the vLLM server with --worker-extension-cls "
                              "loomrl.engine.vllm.worker.WorkerExtension --weight-transfer-config "
                              "'{\"backend\": \"loomrl_inline\"}')") from None
        self._http.post("/update_weight_version", {"new_version": str(self._life.version)}, t)
        if self._dtype is None:
            served = str(model.get("dtype")).removeprefix("torch.")
            if served not in DTYPE_NAMES:
                raise EngineFault(f"the vLLM server reports model dtype {served!r}; set engine.vllm.dtype")
            self._dtype = dtype_named(served)
        return int(model["max_model_len"])

    def _interrupt(self) -> None:
        try:
            with self._life.interrupting():  # a request the pause aborts reads it as ours
                self._http.post("/pause", None, self.cfg.control_timeout_s,
                                params={"mode": "abort", "clear_cache": False})
        except EngineFault as err:  # nobody waits for an interrupt: record it and go on
            log.warning("interrupt failed: %s", err)
            with self._life.lock:
                self.metrics.faults += 1
        finally:
            self._resume()

    def _sleep(self) -> None:
        with self._life.interrupting():  # the requests sleep aborts are ours: "interrupted"
            self._http.post("/sleep", None, self.cfg.update_timeout_s, params={"level": 1, "mode": "abort"})

    def _wake(self) -> None:
        try:
            self._http.post("/wake_up", None, self.cfg.update_timeout_s)
        finally:
            self._resume()  # wake_up unpauses; resuming a server that runs is a no-op

    def _load(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        dtype = self._dtype
        if dtype is None:  # given, or read from the server when connecting (__init__)
            raise EngineFault("vLLM over HTTP: the weights' dtype is unknown (the server was never connected to)")
        post, t = self._http.post, self.cfg.update_timeout_s
        post("/pause", None, self.cfg.control_timeout_s, params={"mode": "keep"})
        try:
            with self._life.loading(version):
                post("/start_weight_update", None, t)
                try:
                    for bucket in weight_buckets(named, dtype, self.cfg.weight_bucket_bytes):
                        post("/update_weights", {"update_info": to_wire(bucket, text=True)}, t)
                except Exception:
                    # the worker's reload has finished on a failed bucket (worker.py); this closes the update
                    # session where the failure came before the worker saw the bucket
                    with contextlib.suppress(Exception):
                        post("/finish_weight_update", {}, t)
                    raise
                post("/finish_weight_update", {"weight_version": str(version)}, t)
                # reset_external: the server's K/V connector store (--kv-offloading-size, --kv-transfer-config) holds
                # the old weights' K/V too; a server without a connector reads it as a reset that succeeded
                reset = post("/reset_prefix_cache", None, self.cfg.control_timeout_s,
                             params={"reset_running_requests": True, "reset_external": True}).json()
                if not reset.get("success"):
                    raise RuntimeError("reset_prefix_cache refused to drop the old weights' K/V (from the prefix "
                                       "cache or the K/V connector's store)")
        finally:
            self._resume()

    def _acquire(self, version: int) -> ServedAdapter | None:
        """The adapter a request of `version` is served with, counted in use (None: the base model)."""
        if self._adapters is None:
            return None
        with self._life.lock:
            return self._adapters.acquire(version)

    def _release(self, adapter: ServedAdapter | None) -> None:
        if self._adapters is not None:
            with self._life.lock:
                self._adapters.release(adapter)

    def _load_adapter(self, served: ServedAdapter) -> None:
        """On the control thread: load `served` into the server, then make it the version requests see; unload the
        adapters no request uses any more (vLLM 0.32's unload drops the server's name only, vllm/entrypoints/openai/
        models/serving.py:243; its workers' LRU cache, of --max-loras adapters, evicts the tensors)."""
        adapters, t = self._adapters, self.cfg.update_timeout_s
        if adapters is None:
            raise EngineFault("update_adapter: no adapter folder")
        with self._life.loading(served.version):
            try:
                self._http.post("/v1/load_lora_adapter", {"lora_name": served.name, "lora_path": str(served.folder)},
                                t)
            except EngineFault as err:
                raise EngineFault(f"{err} ({LORA_FLAGS})") from None
            with self._life.lock:  # before loading() makes it the version requests see
                adapters.served[served.version] = served
        with self._life.lock:
            retired = adapters.retired(served.version)
            for old in retired:
                adapters.served.pop(old.version, None)
        for old in retired:
            try:
                self._http.post("/v1/unload_lora_adapter", {"lora_name": old.name}, self.cfg.control_timeout_s)
            except EngineFault as err:  # the server keeps an adapter no request names: memory, not correctness
                log.warning("unloading %s: %s", old.name, err)
            with self._life.lock:
                adapters.forget(old)

    def _adapter_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The fingerprint of the adapter this version's requests name, as the server's worker holds it: none unless
        the server lists it under that name, from that folder (/v1/models); its tensors are those of the adapter
        the server loaded last (the server numbers adapters as it loads them, and the worker knows no names)."""
        served = self._adapters.served.get(self.version) if self._adapters is not None else None
        listed = self._http.get("/v1/models", self.cfg.control_timeout_s).json().get("data") or []
        if served is None or not any(m.get("id") == served.name and m.get("root") == str(served.folder)
                                     for m in listed):
            return Fingerprint()
        return adapter_fingerprint(expected, served, self._rpc, newest=True)

    def _resume(self) -> None:
        try:
            self._http.post("/resume", None, self.cfg.control_timeout_s)
        except EngineFault as err:
            log.warning("resume failed (the server may stay paused): %s", err)
            with self._life.lock:
                self.metrics.faults += 1


def check_records_experts(info: dict[str, Any], base_url: str) -> None:
    """Refuse a server whose config (/server_info's vllm_config, `info`) does not record routed experts: vLLM 0.32
    keeps the option in aux_output_config (vllm/config/aux_output.py:14), and a server without it answers every
    request with no routed experts."""
    if not (info.get("aux_output_config") or {}).get("enable_return_routed_experts"):
        raise EngineFault(f"the vLLM server at {base_url} does not record routed experts, which trainer.router_replay "
                          f"replays: {ROUTED_EXPERTS_FLAG}")


def npy_array(text: str | None) -> np.ndarray | None:
    """The array of vLLM's base64 `.npy` field (vllm/utils/serial_utils.py numpy2base64), None for none."""
    if text is None:
        return None
    try:
        return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as err:
        raise EngineFault(f"vLLM's routed experts are no base64 .npy array: {type(err).__name__}: {err}") from None
