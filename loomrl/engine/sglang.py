"""SGLangEngine: the Engine protocol over an SGLang server's native HTTP API (`engine.kind: sglang`).

What it is: a client of a server the user runs (`python -m sglang.launch_server`, with the flags docs/engines.md
names), token ids in and out through /generate, weights by a checkpoint folder the server reads, a broadcast over the
trainer's process group, or CUDA IPC handles. Its contract as SGLang 0.5.23's source has it (the routes, logprobs,
sleep and wake, weight-update sessions, per-token versions) is in docs/engines.md, 'The SGLang engine's contract';
the tested range and the torch pairing in engine/sglang_contract.py; its lifecycle (closed state, which aborts are
its own, the control thread) in engine/adapter.py.

Every update flushes the server's cache, so no K/V of the old weights is served. That flush clears HiCache's GPU and
host tiers only; a server with a HiCache storage backend (--enable-hierarchical-cache --hicache-storage-backend, as
/server_info reports at connect) also gets POST /hicache/storage-backend/clear after each update's flush, and a clear
that fails fails the update and keeps the server paused. A backend attached at run time (PUT /hicache/storage-backend)
after connect is not seen.

LoRA adapters (trainer.lora.publish=adapter: `update_adapter`): each version's adapter is written as a PEFT folder and
loaded under its own name (weights/adapter.py adapter_name: fresh per version) by /load_lora_adapter; every /generate
then names it (lora_path) and its tokens carry that version; the previous version's adapter is unloaded. The server
must run with LoRA on (sglang_contract.lora_flags). Its fingerprint is what the server reports: the adapter list of
GET /v1/models must name this version's adapter, loaded from its folder (SGLang reads no adapter tensor back).

What it is not: tested against a running SGLang. SGLang 0.5 ships GPU builds only; the adapter is tested here
against a fake server built from SGLang 0.5.23's own request and response types (tests/engine/test_sglang_engine.py),
and nothing has run against a real server yet.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import pickle
import shutil
import tempfile
import uuid
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from loomrl.config import SGLangConfig
from loomrl.devices import dtype_named
from loomrl.engine.adapter import ControlThread, Lifecycle
from loomrl.engine.adapter_folder import remove_except, write_version
from loomrl.engine.base import EngineFault, EngineMetrics, GenerationRequest, GenerationResult
from loomrl.engine.http import ServerClient
from loomrl.engine.neutral import NEUTRAL_PENALTIES
from loomrl.engine.sglang_contract import (
    DEVICE_ARG,
    LOAD_LORA,
    LORA_UNREAD,
    MODELS,
    UNLOAD_LORA,
    check_lora_server,
    check_nccl,
    check_rebuild,
    check_server,
    trainer_nccl,
)
from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.fingerprint import Fingerprint, WeightMismatch
from loomrl.weights.handle import Transport, WeightHandle
from loomrl.weights.source import bucket_size, plan_buckets

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length"}
# What sleep releases and wake resumes (sglang/srt/constants.py; weights_drafter, a speculative draft model's, stays)
_MEMORY_TAGS = ["kv_cache", "weights", "cuda_graph"]
# Empties HiCache's storage backend (L3), which /flush_cache leaves (SGLang 0.5.23 http_server.py; it has no
# /clear_hicache_storage_backend, the older name)
_CLEAR_STORAGE = "/hicache/storage-backend/clear"


def write_checkpoint(folder: Path, weights: dict[str, torch.Tensor], config: Any, dtype: torch.dtype) -> None:
    """An HF model folder SGLang can load: config.json (when `config` is given) and model.safetensors in `dtype`.
    Tensors that share storage (tied embeddings) are written once, under the first name (SGLang's loaders skip
    lm_head.weight of a tied model)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int | torch.SymInt, tuple[int, ...]]] = set()
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().to(device="cpu", dtype=dtype).contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        config.save_pretrained(str(folder))


class _CudaRebuild:
    """Pickles as a call to torch's rebuild_cuda_tensor(*args): what a CUDA tensor pickles to in torch's multiprocessing
    reductions, built from an ipc_payload's arguments instead of a tensor (so no GPU is needed to write it)."""

    def __init__(self, args: tuple):
        self.args = args

    def __reduce__(self) -> tuple[Callable[..., Any], tuple]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, self.args


def tensor_update_entry(payload: dict[str, Any]) -> str:
    """One TP rank's serialized_named_tensors entry for /update_weights_from_tensor, from an ipc_payload
    (weights/ipc.py): the device index (argument 6 of rebuild_cuda_tensor) replaced by the GPU's UUID, which
    SGLang's patched rebuild maps to the server's own index of that GPU. The arguments are this torch's reduce_tensor
    output; the server's torch rebuilds them, so this torch's rebuild must take the same ones (sglang_contract)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    check_rebuild(rebuild_cuda_tensor)
    named = []
    for name, handle in zip(payload["names"], payload["ipc_handles"]):
        (uuid_, args), = handle.items()  # one GPU: the trainer's
        args = list(args)
        args[DEVICE_ARG] = uuid_
        named.append((name, _CudaRebuild(tuple(args))))
    return base64.b64encode(pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class SGLangEngine:
    """Engine protocol implementation over HTTP; generate is awaited from asyncio, the rest is thread-safe."""

    def __init__(self, cfg: SGLangConfig, *, version: int = 0, model_config: Any = None, sleep_mode: bool = False):
        """Connects: reads the server's settings (/get_server_info) and refuses, with one line, a server that cannot
        do what the run asks (`sleep_mode`, engine.sleep_while_training: --enable-memory-saver)."""
        if not cfg.base_url:
            raise EngineFault("engine.sglang.base_url is not set: the SGLang server's address is needed")
        if not isinstance(cfg.base_url, str):  # engine/factory.py picks this engine's server from a list
            raise EngineFault("SGLangEngine: engine.sglang.base_url must be one server's address here, not a list")
        self.cfg = cfg
        self.base_url = cfg.base_url.rstrip("/")
        self.model_config = model_config  # written as config.json beside each checkpoint
        self.metrics = EngineMetrics()
        self.kv_budget = cfg.context_length
        self._life = Lifecycle(self.metrics, version)  # SGLang reports no busy time: busy_s stays None
        self._group = ""  # the trainer's weight group the server has joined (broadcast)
        self._sessions: bool | None = None  # the server has /begin_weight_update (None: not asked yet)
        self.server_version = ""  # SGLang's, from /server_info at connect
        self._info: dict[str, Any] = {}  # /server_info at connect: its ServerArgs (the LoRA flags among them)
        # the LoRA adapter every /generate names (update_adapter): (its version, its name, its folder as the server
        # reads it); None: the base model alone. Set under the lifecycle's lock with the version.
        self._lora: tuple[int, str, str] | None = None
        self._lora_tmp: str | None = None  # the adapters' folder where engine.sglang.weights_dir is unset (removed at close)
        self.storage_backend: str | None = None  # HiCache's storage backend (L3), from /server_info at connect
        # Why the server's weights are not ones to generate with (released at sleep without a CPU backup, or an update
        # that failed half way), until the next complete update; while set the server is never continued.
        self._weights_missing: str | None = None
        self._http = ServerClient("SGLang", self.base_url, retries=cfg.retries, backoff_s=cfg.retry_backoff_s)
        self._control = ControlThread("loomrl-sglang-control")
        try:
            self._saver, self._backup = self._connect(sleep_mode)
        except BaseException:
            self.close()
            raise

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._life.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with self._life.serving(request) as ticket:
            with self._life.lock:
                lora = self._lora
            rid = f"loomrl-{uuid.uuid4().hex}"
            body = self.generate_body(request, rid, lora[1] if lora else None)
            data = await self._http.apost("/generate", body, self.cfg.timeout_s)
        # under an adapter the tokens are that adapter's version (the server's weight_version is the base model's)
        result, cached = self.parse_generate(data, lora[0] if lora else ticket.version,
                                             interrupted=self._life.interrupted(ticket), own_version=lora is not None)
        with self._life.lock:
            n = len(request.prompt_ids)
            self.metrics.finished += 1
            self.metrics.prompt_tokens += n
            self.metrics.reused_tokens += cached
            self.metrics.prefill_tokens += n - cached
            self.metrics.generated_tokens += len(result.token_ids)
        return result

    def update_weights(self, weights: dict | None, version: int) -> None:
        """Write `weights` as a checkpoint folder, then pause (abort) -> /update_weights_from_disk -> /flush_cache
        (-> /hicache/storage-backend/clear with a HiCache storage backend: _clear_storage) -> continue; in-flight
        requests end "interrupted" and resume under the new weights."""
        self._life.check_open("update_weights")
        if weights is None:
            raise EngineFault("update_weights(None): in-place updates need a model shared with the trainer; an SGLang "
                              "server holds its own copy (engine.kind=sglang needs runtime.mode=async)")
        if not self.cfg.weights_dir:
            raise EngineFault("update_weights: engine.sglang.weights_dir is not set (a folder the SGLang server can "
                              "read, where each version's checkpoint is written)")
        root = Path(self.cfg.weights_dir)
        name = f"v{version:06d}"
        partial = root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_checkpoint(partial, weights, self.model_config, dtype_named(self.cfg.weights_dtype))
        shutil.rmtree(root / name, ignore_errors=True)
        partial.rename(root / name)  # the server never sees a half-written folder
        server_path = str(Path(self.cfg.server_weights_dir or self.cfg.weights_dir) / name)
        load = functools.partial(self._from_disk, server_path, version)
        self._control.call(f"update_weights: version {version}", None, self._paused_load, version, load)
        for old in root.glob("v*"):  # the server has read the new folder; older ones are not needed again
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    def update_adapter(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> None:
        """Write `weights` as a PEFT adapter folder, then pause (abort) -> /load_lora_adapter under adapter.name ->
        /unload_lora_adapter of the previous version's -> continue: every /generate after this names the new adapter
        (in-flight requests end "interrupted" and resume under it). The folder is written where the server reads it:
        under engine.sglang.weights_dir (the server's name for it: server_weights_dir), else in a temporary folder of
        this machine; on a multi-node cluster weights_dir must be shared storage the server's node mounts. A load the
        server refuses is an EngineFault carrying its message; the previous adapter then keeps serving."""
        self._life.check_open("update_adapter")
        if self._weights_missing:  # an adapter brings no base weights back
            raise EngineFault(f"update_adapter: the SGLang server at {self.base_url} has no base weights ("
                              f"{self._weights_missing}), and an adapter does not restore them; run it with "
                              "--enable-weights-cpu-backup")
        check_lora_server(self._info, adapter.rank, adapter.target_modules, self.base_url)
        local, server = self._adapter_dirs()
        write_version(local, weights, adapter, version)
        path = str(server / adapter.name)
        load = functools.partial(self._load_adapter, adapter.name, path, version)
        self._control.call(f"update_adapter: version {version}", None, self._paused_load, version, load)
        remove_except(local, keep=[adapter.name])  # unloaded: a request naming one would make SGLang reload it

    opens = frozenset({Transport.BROADCAST, Transport.CUDA_IPC})  # the server's workers read them (update_from)

    def update_from(self, handle: WeightHandle) -> None:
        """A broadcast version (runtime.weight_transport=broadcast): pause (abort) -> /init_weights_update_group the
        first time this trainer's group is named -> /begin_weight_update -> one /update_weights_from_distributed per
        bucket, each answered once the server's workers have received its tensors (the last flushes the cache) ->
        /end_weight_update -> continue. A cuda_ipc version: pause (abort) -> /begin_weight_update ->
        /update_weights_from_tensor, answered once the server has copied the tensors out of the trainer's memory (and
        flushed the cache) -> /end_weight_update -> continue. Either way, with a HiCache storage backend,
        /hicache/storage-backend/clear before the continue (_clear_storage)."""
        self._life.check_open("update_weights")
        if handle.transport is Transport.BROADCAST:
            load = functools.partial(self._from_distributed, handle.payload, handle.version)
        elif handle.transport is Transport.CUDA_IPC:
            if self.cfg.tp_size != 1:
                raise EngineFault("update_from: cuda_ipc maps the trainer's GPU memory, so the server must run on that "
                                  f"one GPU (engine.sglang.tp_size={self.cfg.tp_size}; use weight_transport=broadcast)")
            load = functools.partial(self._from_tensor, tensor_update_entry(handle.payload), handle.version)
        else:
            raise EngineFault(f"update_from: an SGLang server reads broadcast and cuda_ipc handles, not "
                              f"{handle.transport}")
        self._control.call(f"update_weights: version {handle.version}", None, self._paused_load, handle.version, load)

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """No tensor to compare: an SGLang server reports no checksum of its weights, nor its adapters' tensors (the
        runtime logs that they are not checked; the version is). Under an adapter, what the server reports is checked:
        its adapter list (GET /v1/models) must name this version's adapter, loaded from the folder it was given, else
        WeightMismatch naming the server (an adapter that never loaded, was dropped, or is an older version's)."""
        with self._life.lock:
            lora, version = self._lora, self._life.version
        if lora is None:
            return Fingerprint(unchecked="an SGLang server reports no checksum of its loaded weights")
        want = adapter_name(version)
        cards = self._http.get(MODELS, self.cfg.control_timeout_s).json().get("data") or []
        listed = {str(c.get("id")): c.get("root") for c in cards if c.get("parent")}  # adapters: cards with a parent
        if lora[1] != want or listed.get(want) != lora[2]:
            found = listed.get(want)
            why = (f"it lists {want} loaded from {found}, not {lora[2]}" if found is not None else
                   f"it lists {sorted(listed) or 'no adapter'}")
            raise WeightMismatch(f"weight sync: the SGLang engine at {self.base_url} does not serve version {version}'s "
                                 f"LoRA adapter {want} (GET {MODELS}: {why}): the adapter did not load, was dropped, or "
                                 "is an older version's")
        return Fingerprint(unchecked=f"{LORA_UNREAD}; its adapter list (GET {MODELS}) names {want}, loaded from "
                                     f"{lora[2]}")

    def interrupt(self) -> None:
        """Pause with mode=abort and continue, on the control thread: in-flight requests end "interrupted" soon."""
        if self._life.closed:
            return
        with self._life.lock:
            self.metrics.interrupts += 1
        self._control.submit(self._interrupt)

    def release(self, program_id: str) -> None:
        """Nothing to do: SGLang's radix cache is keyed by token prefixes, not programs, and evicts on its own."""

    def sleep(self) -> None:
        """Pause (abort: in-flight requests end "interrupted"; new ones wait at the server), then
        /release_memory_occupation (weights, KV cache, CUDA graphs; the server needs --enable-memory-saver). Without
        --enable-weights-cpu-backup the weights are gone until the next update."""
        self._life.check_open("sleep")
        if not self._saver:
            raise EngineFault(self._no_saver())
        self._control.call("sleep", None, self._release_memory)

    def wake(self) -> None:
        """/resume_memory_occupation, then continue once the weights are there: at once with a CPU backup (the server
        restored them), else after the next update (update_weights / update_from), which the run sends after every
        wake; requests sent meanwhile wait at the server."""
        self._life.check_open("wake")
        self._control.call("wake", None, self._resume_memory)

    def close(self) -> None:
        if self._life.close():
            self._control.shutdown()
            self._http.close()
            if self._lora_tmp is not None:
                shutil.rmtree(self._lora_tmp, ignore_errors=True)

    # -- the wire format --------------------------------------------------------------------------
    def generate_body(self, request: GenerationRequest, rid: str, lora: str | None = None) -> dict[str, Any]:
        """The /generate request (io_struct.GenerateReqInput; sampling_params: sampling/sampling_params.py); `lora`:
        the adapter to apply (its name, as loaded by /load_lora_adapter; None: the base model)."""
        s = request.sampling
        sampling: dict[str, Any] = {
            "max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang: -1 = no top-k filter (0 is refused)
            "ignore_eos": s.ignore_eos,
            "no_stop_trim": True,  # keep a matched stop token in output_ids: token fidelity
            **NEUTRAL_PENALTIES,  # not the server's --preferred-sampling-params / the model's generation_config
        }
        if s.stop_token_ids:
            sampling["stop_token_ids"] = list(s.stop_token_ids)
        if s.stop:
            sampling["stop"] = list(s.stop)
        if s.seed is not None:
            sampling["sampling_seed"] = s.seed
        priority = request.priority if self.cfg.low_priority_first else -request.priority
        body = {"rid": rid, "input_ids": list(request.prompt_ids), "sampling_params": sampling,
                "return_logprob": True, "logprob_start_len": -1, "priority": priority, "stream": False}
        if lora is not None:
            body["lora_path"] = lora  # GenerateReqInput.lora_path: an adapter's name (or one per prompt)
        return body

    @staticmethod
    def parse_generate(data: dict[str, Any], version: int, *, interrupted: bool,
                       own_version: bool = False) -> tuple[GenerationResult, int]:
        """A GenerationResult from a /generate answer, and the prompt tokens the server served from its cache.
        `version`: the engine's when the request started (`own_version`: the version of the adapter the request named,
        whatever weight_version the server reports); `interrupted`: an abort of ours happened meanwhile."""
        meta = data.get("meta_info") or {}
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise EngineFault("SGLang /generate answered without meta_info.output_token_logprobs "
                              "(the request asks for return_logprob)")
        ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        sent = data.get("output_ids")
        if sent is not None and [int(t) for t in sent] != ids:
            raise EngineFault(f"SGLang /generate: output_ids {list(sent)[-4:]} (last 4) disagree with the token ids of "
                              f"output_token_logprobs {ids[-4:]}; was no_stop_trim dropped?")
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind == "abort":
            if not interrupted:
                raise EngineFault(f"SGLang aborted the request: {reason.get('message') or reason}")
            finish = "interrupted"
        elif kind in _FINISH:
            finish = _FINISH[kind]
        else:
            raise EngineFault(f"SGLang /generate: unknown finish_reason {reason!r}")
        served = meta.get("weight_version")
        tag = version
        if not own_version and isinstance(served, (int, str)) and str(served).lstrip("-").isdigit():
            tag = int(served)
        result = GenerationResult(token_ids=ids, logprobs=logprobs, versions=[tag] * len(ids), finish_reason=finish)
        return result, int(meta.get("cached_tokens") or 0)

    # -- control ----------------------------------------------------------------------------------
    def _connect(self, sleep_mode: bool) -> tuple[bool, bool]:
        """The server's version, HiCache storage backend, --enable-memory-saver and --enable-weights-cpu-backup
        (/server_info answers its ServerArgs and version); refuses, with one line, a version outside
        sglang_contract.TESTED and a sleep_mode run on a server without the memory saver."""
        try:
            info = self._http.get("/server_info", self.cfg.control_timeout_s).json()
        except EngineFault as err:
            if not _missing_route(err):
                raise
            # a build before /server_info: the route it deprecates (0.5.23 still answers both)
            info = self._http.get("/get_server_info", self.cfg.control_timeout_s).json()
        self.server_version = check_server(info.get("version"), self.base_url)
        self._info = info
        if info.get("enable_hierarchical_cache") and info.get("hicache_storage_backend"):
            self.storage_backend = str(info["hicache_storage_backend"])
        saver, backup = bool(info.get("enable_memory_saver")), bool(info.get("enable_weights_cpu_backup"))
        if sleep_mode and not saver:
            raise EngineFault(self._no_saver())
        if sleep_mode and not backup:
            log.info("SGLang server %s has no --enable-weights-cpu-backup: after each wake it generates only once the "
                     "next weight update has arrived", self.base_url)
        return saver, backup

    def _no_saver(self) -> str:
        return (f"engine.sleep_while_training: the SGLang server at {self.base_url} runs without --enable-memory-saver, "
                "so it cannot give its GPU memory to the trainer; restart it with --enable-memory-saver (and "
                "--enable-weights-cpu-backup to keep its weights across a sleep)")

    def _interrupt(self) -> None:
        try:
            self._pause()
        except EngineFault as err:  # nobody waits for an interrupt: record it and go on
            log.warning("interrupt failed: %s", err)
            with self._life.lock:
                self.metrics.faults += 1
        finally:
            self._continue()

    def _pause(self) -> None:
        with self._life.interrupting():  # a request the pause aborts reads it as ours
            self._http.post("/pause_generation", {"mode": "abort"}, self.cfg.control_timeout_s)

    def _continue(self) -> None:
        if self._weights_missing:  # requests wait at the server until an update brings weights
            log.info("SGLang server %s stays paused: %s", self.base_url, self._weights_missing)
            return
        try:
            self._http.post("/continue_generation", {}, self.cfg.control_timeout_s)
        except EngineFault as err:
            log.warning("continue_generation failed (the server may stay paused): %s", err)
            with self._life.lock:
                self.metrics.faults += 1

    def _release_memory(self) -> None:
        self._pause()
        try:
            self._http.post("/release_memory_occupation", {"tags": _MEMORY_TAGS}, self.cfg.update_timeout_s)
        except EngineFault:
            self._continue()  # not released: serve on rather than stay paused
            raise
        if not self._backup:
            self._weights_missing = "its weights were released at sleep (no --enable-weights-cpu-backup)"

    def _resume_memory(self) -> None:
        """Memory back, then continue if the weights are (a CPU backup restores them with the memory); a resume that
        failed leaves the server paused: there is no memory to generate with."""
        self._http.post("/resume_memory_occupation", {"tags": _MEMORY_TAGS}, self.cfg.update_timeout_s)
        self._continue()

    def _paused_load(self, version: int, load: Callable[[], tuple[int, str, str] | None]) -> None:
        """Pause (abort), `load` (the server's update calls; an adapter's load returns the adapter now served), then
        serve as `version`; the server is never left paused, even after a failed load."""
        try:
            self._pause()
            lora = load()
            # full weights: the old K/V goes, and the base model is whole again (an adapter's K/V is keyed by its
            # lora_id in SGLang's caches, a new one per load: none of it is stale)
            if lora is None:
                self._clear_storage(version)
                self._weights_missing = None
            with self._life.lock:
                self._life.version = version
                self._lora = lora if lora is not None else self._lora
        finally:
            self._continue()

    def _adapter_dirs(self) -> tuple[Path, Path]:
        """Where adapter folders are written, and that folder as the server names it."""
        if self.cfg.weights_dir:
            local = Path(self.cfg.weights_dir) / "adapters"
            server = Path(self.cfg.server_weights_dir or self.cfg.weights_dir) / "adapters"
        else:  # the server on this machine (a server elsewhere needs weights_dir on shared storage)
            if self._lora_tmp is None:
                self._lora_tmp = tempfile.mkdtemp(prefix="loomrl-sglang-adapters-")
            local = server = Path(self._lora_tmp)
        local.mkdir(parents=True, exist_ok=True)
        return local, server

    def _load_adapter(self, name: str, path: str, version: int) -> tuple[int, str, str]:
        """/load_lora_adapter `name` from `path`, then /unload_lora_adapter the previous version's (a failed unload
        is logged: the new adapter serves either way). Returns the adapter now served."""
        try:
            self._http.post(LOAD_LORA, {"lora_name": name, "lora_path": path}, self.cfg.update_timeout_s)
        except EngineFault as err:
            raise EngineFault(f"update_adapter: the SGLang server at {self.base_url} did not load version {version}'s "
                              f"adapter {name} from {path}: {err}") from None
        old = self._lora
        if old is not None and old[1] != name:
            try:
                self._http.post(UNLOAD_LORA, {"lora_name": old[1]}, self.cfg.update_timeout_s)
            except EngineFault as err:
                log.warning("SGLang %s: unloading the previous adapter %s failed (it stays loaded; no request names "
                            "it): %s", self.base_url, old[1], err)
        return version, name, path

    def _clear_storage(self, version: int) -> None:
        """After a version's flush, empty HiCache's storage backend, which the flush leaves; the old weights' K/V in it
        would be fetched for a matching prefix. A failed clear keeps the server paused until an update clears it."""
        if self.storage_backend is None:
            return
        try:
            self._http.post(_CLEAR_STORAGE, None, self.cfg.update_timeout_s)
        except EngineFault as err:
            self._weights_missing = f"its HiCache storage backend was not cleared after version {version}"
            raise EngineFault(f"version {version}: POST {_CLEAR_STORAGE} failed, so the SGLang server's HiCache "
                              f"storage backend ({self.storage_backend}) still holds the old weights' K/V and would "
                              f"serve it; the server stays paused until an update clears it: {err}") from None

    @contextlib.contextmanager
    def _weight_session(self) -> Generator[None]:
        """/begin_weight_update before the first update call, /end_weight_update after the last, and after a failed
        one too, so the server is never left inside a session (SGLang 0.5.23 refuses update_weights_from_distributed
        and _from_tensor outside one, answering 400 success false). A server without the routes (404 to the first
        begin: builds before the session API) is sent the updates without one. Each call is bounded by
        update_timeout_s."""
        opened = self._begin()
        try:
            yield
        except BaseException:
            if opened:
                try:
                    self._http.post("/end_weight_update", {}, self.cfg.update_timeout_s)
                except EngineFault as err:  # the load's error is the one to raise
                    log.warning("SGLang %s: /end_weight_update after a failed update failed too: %s", self.base_url,
                                err)
            raise
        if opened:
            try:
                self._http.post("/end_weight_update", {}, self.cfg.update_timeout_s)
            except EngineFault:  # the session finalizes the loaded weights: without it they are not ones to serve
                self._weights_missing = "its weight-update session did not end"
                raise

    def _begin(self) -> bool:
        """Open a weight-update session; False where the server has none (asked once per engine). A server left inside
        a session (a run that stopped mid-update) refuses the begin: that session is ended and the begin sent once
        more."""
        if self._sessions is False:
            return False
        try:
            self._http.post("/begin_weight_update", {}, self.cfg.update_timeout_s)
        except EngineFault as err:
            if self._sessions is None and _missing_route(err):
                log.info("SGLang %s has no /begin_weight_update: weight updates are sent without a session",
                         self.base_url)
                self._sessions = False
                return False
            log.warning("SGLang %s: /begin_weight_update failed (%s); ending a session left open and beginning again",
                        self.base_url, err)
            try:
                self._http.post("/end_weight_update", {}, self.cfg.update_timeout_s)
            except EngineFault:  # no session to end: the begin's own failure is the cause
                raise err from None
            self._http.post("/begin_weight_update", {}, self.cfg.update_timeout_s)
        self._sessions = True
        return True

    def _join_group(self, payload: dict[str, Any]) -> None:
        """/init_weights_update_group the first time a trainer process's group is named (the server keeps the old
        one); over NCCL only where the trainer's NCCL is the server's (sglang_contract.check_nccl)."""
        group = payload["group"]
        if self._group == group["name"]:
            return
        if group["backend"] == "nccl":
            check_nccl(trainer_nccl(), self.server_version, self.base_url)
        self._http.post("/init_weights_update_group", {
            "master_address": group["host"], "master_port": group["port"], "rank_offset": payload["rank_offset"],
            "world_size": group["world_size"], "group_name": group["name"], "backend": group["backend"]},
            self.cfg.update_timeout_s)
        self._group = group["name"]

    def _from_distributed(self, payload: dict[str, Any], version: int) -> None:
        self._join_group(payload)
        group_name = payload["group"]["name"]
        # One call per bucket of the trainer's plan (the same plan_buckets over the same specs and bucket_bytes), the
        # trainer broadcasting that bucket's tensors meanwhile: the server allocates every tensor a call names before
        # receiving, so a call holds one bucket, not a second copy of the model. The last call flushes the radix cache
        # and sets the version; until it answers the server stays paused, its weights partly new.
        buckets = plan_buckets(payload["names"], payload["dtypes"], payload["shapes"], payload["bucket_bytes"])
        with self._weight_session():
            for k, bucket in enumerate(buckets):
                last = k == len(buckets) - 1
                body: dict[str, Any] = {"names": [e.name for e in bucket], "dtypes": [e.dtype for e in bucket],
                                        "shapes": [list(e.shape) for e in bucket], "group_name": group_name,
                                        "flush_cache": last}
                if last:
                    body["weight_version"] = str(version)
                try:
                    self._http.post("/update_weights_from_distributed", body, self.cfg.update_timeout_s)
                except EngineFault as err:
                    if k:  # the server holds part of the new version: no generating with that
                        self._weights_missing = f"version {version}'s update failed after {k} of {len(buckets)} buckets"
                    raise EngineFault(f"version {version}, bucket {k + 1} of {len(buckets)} ({len(bucket)} tensors, "
                                      f"{bucket_size(bucket)} bytes; engine.sglang.update_timeout_s="
                                      f"{self.cfg.update_timeout_s:g}): {err}") from None

    def _from_tensor(self, entry: str, version: int) -> None:
        with self._weight_session():
            self._http.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [entry], "flush_cache": True, "weight_version": str(version)},
                self.cfg.update_timeout_s)

    def _from_disk(self, path: str, version: int) -> None:
        self._http.post("/update_weights_from_disk", {"model_path": path, "load_format": "safetensors",
                                                 "weight_version": str(version)}, self.cfg.update_timeout_s)
        self._http.post("/flush_cache", None, self.cfg.control_timeout_s)


def _missing_route(err: EngineFault) -> bool:
    """Whether the server answered 404: a route its build does not have (engine/http.py names the status)."""
    return " answered 404:" in str(err)
