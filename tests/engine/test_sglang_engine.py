"""SGLangEngine against a fake SGLang server: a CONTRACT TEST, not a test against SGLang.

SGLang cannot run here (SGLang 0.5 on PyPI is a GPU build; this machine has no GPU), so the adapter is tested over
real HTTP (uvicorn on a loopback port) against a small FastAPI app that plays an SGLang 0.5.23 server, rebuilt from that
release's own request and response types. Read in the sglang==0.5.23 wheel from PyPI (sglang/_version.py
'0.5.23'; METADATA: torch==2.14.1, transformers==5.19.0), paths under python/sglang/ in sgl-project/sglang:
- srt/entrypoints/http_server.py: the routes /generate, /pause_generation, /continue_generation, /flush_cache (GET or
  POST; 200 "Cache flushed..." or 400), /update_weights_from_disk (200, or 400 with {success, message,
  num_paused_requests}), /init_weights_update_group, /update_weights_from_distributed, /update_weights_from_tensor,
  /begin_weight_update, /end_weight_update (each 200, or 400, with {success, message}), /release_memory_occupation,
  /resume_memory_occupation, GET /server_info (build_server_info: the resolved ServerArgs, flat, e.g.
  enable_memory_saver; plus startup_time, internal_states, "version": sglang's __version__, "frontend") and GET
  /get_server_info, which logs that it is deprecated and answers the same. /generate errors are {"error":
  {"message"}} with status 400. No torch version in any of them. POST /hicache/storage-backend/clear (no body; 0.5.23
  has no /clear_hicache_storage_backend): the scheduler's clear_hicache_storage_wrapped (managers/scheduler.py) empties
  the storage backend (L3) when enable_hierarchical_cache (or LMCache) is on and answers 200, else success false: 400;
  either way the text "Hierarchical cache storage backend cleared.". It does not wait for, or refuse on, running
  requests. /flush_cache leaves L3 alone (mem_cache/unified_radix_cache.py reset: GPU and host tiers only). ServerArgs'
  enable_hierarchical_cache (default False) and hicache_storage_backend (default None: no L3; file, mooncake, ...;
  arg_groups/fields/memory.py) are flat in /server_info.
- srt/managers/io_struct.py (msgspec structs; BaseReq adds rid, http_worker_ipc): GenerateReqInput,
  PauseGenerationReqInput (mode: abort | retract | in_place), ContinueGenerationReqInput (torch_empty_cache),
  UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput (master_address, master_port, rank_offset, world_size,
  group_name, backend), UpdateWeightsFromDistributedReqInput (names, dtypes, shapes, group_name, flush_cache=True,
  abort_all_requests, weight_version, load_format, selector, torch_empty_cache), UpdateWeightsFromTensorReqInput
  (serialized_named_tensors: base64 over HTTP, load_format, flush_cache=True, abort_all_requests, weight_version,
  selector, torch_empty_cache), BeginWeightUpdateReqInput (selector: target | draft | all, default all),
  EndWeightUpdateReqInput (no field of its own), Begin/EndWeightUpdateReqOutput and the update outputs (success,
  message), Release/ResumeMemoryOccupationReqInput (tags). The field sets below are these classes' fields.
- srt/managers/scheduler_components/weight_updater.py SchedulerWeightUpdaterManager: update_weights_from_distributed
  and update_weights_from_tensor return success=False "... must run between begin_weight_update() and
  end_weight_update()" when no session is open (so the route answers 400); begin_weight_update inside an open session
  returns success=False "a weight-update session is already open; call end_weight_update() first"; end_weight_update
  without one returns success=False "no weight-update session is open; ..."; update_weights_from_disk needs no
  session. The issue's wording (begin/end routes, success false, 400) matches the source; the updater lives under
  managers/scheduler_components/, not model_executor/.
- srt/managers/tokenizer_control_mixin.py: begin/end_weight_update and the updates run while paused (is_pause held) or
  under the model-update writer lock; update_weights_from_tensor normalizes each entry from base64
  (utils/common.py normalize_serialized_named_tensor_payloads).
- srt/managers/tp_worker.py deserialize_own_rank: monkey_patch_torch_reductions(), then
  MultiprocessingSerializer.deserialize(serialized_named_tensors[tp_rank]) through utils/common.py SafeUnpickler, whose
  ALLOWED_GLOBALS are exact (module, name) pairs (ALLOWED_GLOBALS below is a subset: the fake allows fewer, never
  more). srt/utils/patch_torch.py: the patched rebuild_cuda_tensor maps argument 6 from a GPU UUID string to the
  server's index of that GPU.
- torch 2.14.1's torch/multiprocessing/reductions.py (the torch==2.14.1 wheel from PyPI; byte-identical to 2.13.0's):
  rebuild_cuda_tensor's 15 arguments, REBUILD_CUDA_TENSOR_ARGS in loomrl/engine/sglang_contract.py.
- srt/managers/tokenizer_manager.py: the answer {text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
  completion_tokens, cached_tokens, weight_version, output_token_logprobs: (logprob, token_id, None) triples}}; an
  aborted request answers finish_reason {"type": "abort", "message"} with its partial output_ids.
- srt/sampling/sampling_params.py: sampling_params names; top_k -1 disables (0 is refused: "top_k must be -1
  (disable) or at least 1"); sampling_seed; no_stop_trim.
- srt/model_executor/model_runner.py and the runners' weight updaters: every tensor a distributed call names is
  allocated, then one broadcast each from rank 0, then loaded; release/resume_memory_occupation with tags (constants.py
  GPU_MEMORY_ALL_TYPES), a no-op without --enable-memory-saver, weights' values kept only with
  --enable-weights-cpu-backup.
- srt/layers/sampler.py: logprobs are log softmax(logits / T) unless SGLANG_RETURN_ORIGINAL_LOGPROB.
- LoRA adapters (tests/engine/test_sglang_lora.py): POST /load_lora_adapter (io_struct.LoadLoRAAdapterReqInput: lora_name,
  lora_path, pinned, lora_id) and /unload_lora_adapter (UnloadLoRAAdapterReqInput: lora_name, lora_id) answer
  LoRAUpdateOutput {success, error_message, loaded_adapters: name -> path}, 200 or 400 (http_server.py). Refusals, in
  order (managers/tokenizer_control_mixin.py load_lora_adapter, lora/lora_manager.py _load_lora_adapter and
  validate_new_adapter, lora/lora_registry.py unregister): "LoRA is not enabled. Please set `--enable-lora` to enable
  LoRA."; a folder that is not a directory goes to huggingface_hub's snapshot_download (lora/lora_config.py), whose
  repo-id check refuses a path; "Failed to load LoRA adapter X because it is already loaded"; an adapter whose rank is
  above --max-lora-rank or whose target modules (normalized: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj) are
  not within --lora-target-modules: "LoRA adapter X with rank R is incompatible with the current LoRA memory pool
  configuration. ..."; an unload of an unknown name: "LoRA with name X does not exist. Loaded LoRAs: dict_keys([...])".
  GET /v1/models: the base model's card, then, with LoRA on, one card per registered adapter {id: name, root: its path,
  parent: the base's name}. /generate's lora_path: with LoRA off, "LoRA adapter 'X' was requested, but LoRA is not
  enabled. ..."; a name not registered but loaded before (TokenizerManager.lora_ref_cache) is loaded again from its
  path ("Failed to implicitly load LoRA adapter X: ..." when that fails); a name never loaded: "Got LoRA adapter that
  has never been loaded: X ..." (tokenizer_manager.py _resolve_lora_path). The ServerArgs (arg_groups/fields/lora.py,
  flat in /server_info): enable_lora, max_lora_rank, lora_target_modules, lora_paths, max_loaded_loras,
  max_loras_per_batch (8), lora_strict_loading (False). With a real model set (FakeSGLang.model), the fake generates
  greedily from it, the named adapter applied by PEFT from the adapter's folder, and reports log softmax(logits).
The fake is stricter than SGLang in one way: a field name outside the recorded ones is refused (400), so that a
misspelt field fails here instead of being ignored by a real server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load_file

from loomrl.agent.gateway import ServerThread
from loomrl.config import ConfigError, SGLangConfig, load_config
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams, generate_resuming
from loomrl.engine.factory import make_engine
from loomrl.engine.sglang import SGLangEngine
from loomrl.engine.sglang_contract import REBUILD_CUDA_TENSOR_ARGS
from loomrl.weights.handle import Transport

# torch 2.14.1's torch/multiprocessing/reductions.py rebuild_cuda_tensor (SGLang 0.5.23's torch), read in its wheel
TORCH_2_14_1_REBUILD_CUDA_TENSOR = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype", "storage_device",
    "storage_handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required")

BASE_REQ = {"rid", "http_worker_ipc"}  # io_struct.BaseReq: every request struct below but GenerateReqInput
GENERATE_FIELDS = {
    "audio_data", "background", "bootstrap_host", "bootstrap_pair_key", "bootstrap_port", "bootstrap_room",
    "cache_salt", "conversation_id", "custom_labels", "custom_logit_processor", "data_parallel_rank", "decode_tp_size",
    "disagg_prefill_dp_rank", "encoder_urls", "external_trace_header", "extra_key", "http_worker_ipc", "image_data",
    "image_max_dynamic_patch", "images_config", "input_embeds", "input_ids", "kv_hints", "log_metrics",
    "logprob_start_len", "lora_id", "lora_path", "max_dynamic_patch", "max_thinking_tokens", "min_dynamic_patch",
    "mm_content_hashes", "mm_hashes", "mm_processor_kwargs", "modalities", "multi_item_delimiter_indices",
    "need_wait_for_mm_inputs", "no_logs", "num_items_assigned", "positional_embed_overrides", "priority",
    "received_time", "require_reasoning", "return_bytes", "return_entropy", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_indexer_topk",
    "return_logprob", "return_prompt_token_ids", "return_routed_experts", "return_sampling_mask",
    "return_text_in_logprobs", "rid", "routed_dp_rank", "routed_experts_start_len", "routing_key",
    "sampling_logprobs_mode", "sampling_params", "session_id", "session_params", "stream", "text", "token_ids_logprob",
    "token_indices_to_pool", "top_logprobs_num", "use_audio_in_video", "video_config", "video_data",
    "video_max_dynamic_patch", "watermark"}
SAMPLING_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "watermark"}
UPDATE_FROM_DISK_FIELDS = BASE_REQ | {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                                      "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
                                      "flush_cache", "manifest"}
PAUSE_FIELDS, CONTINUE_FIELDS = BASE_REQ | {"mode"}, BASE_REQ | {"torch_empty_cache"}
INIT_GROUP_FIELDS = BASE_REQ | {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
FROM_TENSOR_FIELDS = BASE_REQ | {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                 "weight_version", "selector", "torch_empty_cache"}
FROM_DISTRIBUTED_FIELDS = BASE_REQ | {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                      "weight_version", "load_format", "selector", "torch_empty_cache"}
BEGIN_FIELDS, END_FIELDS = BASE_REQ | {"selector"}, BASE_REQ
LOAD_LORA_FIELDS = BASE_REQ | {"lora_name", "lora_path", "pinned", "lora_id"}  # io_struct.LoadLoRAAdapterReqInput
UNLOAD_LORA_FIELDS = BASE_REQ | {"lora_name", "lora_id"}  # UnloadLoRAAdapterReqInput
# lora/utils.py get_normalized_target_modules: the names of SGLang's fused projections
POOL_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}
MEMORY_FIELDS = BASE_REQ | {"tags"}  # Release/ResumeMemoryOccupationReqInput (tags None: every type)
MEMORY_TYPES = ["kv_cache", "weights", "weights_drafter", "cuda_graph"]  # constants.GPU_MEMORY_ALL_TYPES
CONTROL = ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
           "/hicache/storage-backend/clear")
CLEAR = "/hicache/storage-backend/clear"
TOO_LONG, SERVER_ABORT = 666, 667  # first prompt tokens the fake answers with an error / with an abort of its own


def fake_token(context: list[int], weight_version: str) -> tuple[int, float]:
    """The fake's "model": the next token of `context` and its logprob, different under each weight version."""
    w = int(weight_version) if weight_version.isdigit() else 0
    tok = 100 + (sum(context) * 7 + w * 13 + len(context)) % 50
    return tok, -(tok % 5 + 1) / 10


def _pool_modules(modules: Any) -> set[str]:
    if isinstance(modules, str):  # "all" / "all-linear"
        return {"all"}
    return {POOL_MODULES.get(m.rsplit(".", 1)[-1], m.rsplit(".", 1)[-1]) for m in modules}


def model_token(model: Any, context: list[int]) -> tuple[int, float]:
    """The fake's real-model decoding step: the greedy next token of `context` and its log softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1)
    tok = int(logprobs.argmax())
    return tok, float(logprobs[tok])


def peft_applied(model: Any, folder: Path) -> Any:
    """A copy of `model` with the PEFT adapter folder `folder` applied (what the fake serves under its name)."""
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(folder)).eval()


def fake_run(prompt: list[int], n: int, weight_version: str, stop: set[int] = frozenset()) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out.append(fake_token(prompt + out, weight_version)[0])
        if out[-1] in stop:
            break
    return out


class FakeSGLang:
    """The fake server's state; the test thread reads it and sets hold / unavailable / fail_update."""

    def __init__(self):
        self.bodies: dict[str, list[Any]] = {}
        self.calls: list[str] = []
        self.weight_version = "default"  # SGLang's own initial value (server_args.weight_version)
        self.hold: int | None = None  # the next /generate stops after this many tokens until an abort pause
        self.unavailable = 0  # answer this many /generate calls 503 first
        self.fail_update = False
        self.paused = False
        self.inflight: dict[str, asyncio.Event] = {}
        self.resumed: asyncio.Event | None = None
        self.sequences: list[list[int]] = []  # what the radix cache would hold
        self.loaded: dict[str, torch.Tensor] = {}
        self.released = False  # weights and KV cache given up (release_memory_occupation)
        self.offloaded: set[str] = set()  # the scheduler's offload_tags
        # the ServerArgs /server_info reports (SGLang's defaults: no memory saver, no CPU backup)
        self.server_args = {"enable_memory_saver": False, "enable_weights_cpu_backup": False, "context_length": 4096,
                            "weight_version": "default", "enable_hierarchical_cache": False,
                            "hicache_storage_backend": None}
        self.fail_clear = False  # /hicache/storage-backend/clear answers 400 (success false)
        self.weights_ok = True  # the weights hold values (not lost at a release without a CPU backup)
        self.accepted: list[bool] = []  # per /generate that began generating: were the weights there
        self.groups: dict[str, Any] = {}  # group_name -> process group (init_weights_update_group)
        self.rebuilt: list[dict] = []  # rebuild_cuda_tensor's arguments, by name (update_weights_from_tensor)
        self.preferred_sampling_params: dict | None = None  # --preferred-sampling-params (None: SGLang's default)
        self.sampled: list[dict] = []  # each /generate's sampling params as the server applies them
        self.received: list[tuple[list[str], float, float]] = []  # update_weights_from_distributed: names, start, end
        self.held_bytes = 0  # the most tensor bytes one update_weights_from_distributed call allocated
        self.receiving = False
        self.version = "0.5.23"  # /server_info's "version"
        self.missing_routes: set[str] = set()  # answered 404, as by a build without them
        self.session_api = True  # 0.5.23: distributed and tensor updates only inside a begin/end session
        self.session: str | None = None  # the open session's selector (weight_updater's _session)
        # LoRA (ServerArgs' lora fields as /server_info reports them when unset: LoRA off)
        self.server_args.update(enable_lora=False, max_lora_rank=None, lora_target_modules=None, lora_paths=[],
                                max_loaded_loras=None, max_loras_per_batch=8, lora_strict_loading=False)
        self.model: Any = None  # a real HF model: /generate decodes with it (and a named adapter) instead of fake_token
        self.adapters: dict[str, str] = {}  # the LoRA registry: name -> path, in load order
        self.ever_loaded: dict[str, str] = {}  # TokenizerManager.lora_ref_cache: every name loaded since start
        self.adapter_models: dict[str, Any] = {}  # name -> the model with that adapter applied (PEFT)
        self.forget_loads = False  # answer a load success without registering it (an adapter dropped silently)
        self.lora_requests: list[str] = []  # the adapter each /generate that named one was served with


def _refuse_unknown(body: dict, known: set[str], what: str) -> JSONResponse | None:
    extra = sorted(set(body) - known)
    if extra:
        return JSONResponse({"object": "error", "message": f"{what}: unknown fields {extra}", "type": "Bad Request",
                             "code": 400}, status_code=400)
    return None


def fake_app(fake: FakeSGLang) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def missing(request: Request, call_next):  # a build without these routes: FastAPI's own 404
        if request.url.path in fake.missing_routes:
            fake.calls.append(request.url.path)
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await call_next(request)

    def record(path: str, body: Any) -> None:
        fake.calls.append(path)
        fake.bodies.setdefault(path, []).append(body)

    async def read(request: Request, path: str, known: set[str], what: str) -> tuple[dict, JSONResponse | None]:
        body = await request.json()
        record(path, body)
        return body, _refuse_unknown(body, known, what)

    async def wait_unpaused() -> None:
        while fake.paused:
            await fake.resumed.wait()

    @app.post("/generate")
    async def generate(request: Request):
        body, bad = await read(request, "/generate", GENERATE_FIELDS, "GenerateReqInput")
        if fake.resumed is None:
            fake.resumed = asyncio.Event()
        if bad := bad or _refuse_unknown(body["sampling_params"], SAMPLING_FIELDS, "SamplingParams"):
            return bad
        if fake.unavailable:
            fake.unavailable -= 1
            return PlainTextResponse("", status_code=503)
        sp, ids = body["sampling_params"], body["input_ids"]
        # TokenizerManager._create_tokenized_object: the server's preferred_sampling_params under the request's own
        fake.sampled.append({**(fake.preferred_sampling_params or {}), **sp})
        assert isinstance(ids, list) and all(isinstance(t, int) for t in ids) and isinstance(body["rid"], str)
        if not (sp.get("top_k", -1) == -1 or sp["top_k"] >= 1):
            return JSONResponse({"error": {"message": f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}."}},
                                status_code=400)
        if ids[0] == TOO_LONG:
            return JSONResponse({"error": {"message": f"The input ({len(ids)} tokens) is longer than the model's "
                                                      "context length (4 tokens)."}}, status_code=400)
        await wait_unpaused()  # TokenizerManager holds new requests while paused
        model = fake.model
        if body.get("lora_path") is not None:
            resolved = resolve_lora(body["lora_path"])
            if isinstance(resolved, JSONResponse):
                return resolved
            model = resolved
        fake.accepted.append(fake.weights_ok)
        cached = max((next((i for i, (a, b) in enumerate(zip(s, ids)) if a != b), min(len(s), len(ids)))
                      for s in fake.sequences), default=0)
        cached = min(cached, len(ids) - 1)
        stop, out, lps = set(sp.get("stop_token_ids") or []), [], []
        finish: dict[str, Any] = {"type": "length", "length": sp["max_new_tokens"]}
        hold, fake.hold = fake.hold, None
        while len(out) < sp["max_new_tokens"]:
            if hold is not None and len(out) == hold:
                aborted = fake.inflight[body["rid"]] = asyncio.Event()
                await aborted.wait()
                finish = {"type": "abort", "message": "Abort in waiting queue"}
                break
            tok, lp = fake_token(ids + out, fake.weight_version) if model is None else model_token(model, ids + out)
            out.append(tok)
            lps.append(lp)
            if tok in stop:
                finish = {"type": "stop", "matched": tok}
                break
        fake.inflight.pop(body["rid"], None)
        if ids[0] == SERVER_ABORT:
            finish = {"type": "abort", "message": "The server aborted it"}
        fake.sequences.append(ids + out)
        output_ids = out[:-1] if finish["type"] == "stop" and not sp.get("no_stop_trim") else out
        meta = {"id": body["rid"], "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                "cached_tokens": cached, "weight_version": fake.weight_version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)]}
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    def lora_error(message: str) -> JSONResponse:  # LoRAUpdateOutput, success false: 400
        return JSONResponse({"success": False, "error_message": message, "loaded_adapters": dict(fake.adapters)},
                            status_code=400)

    def load_adapter(name: str, path: str) -> JSONResponse | None:
        """lora_manager._load_lora_adapter: LoRAConfig(path), validate_new_adapter, the weights; None: loaded."""
        folder = Path(path)
        if not folder.is_dir():  # LoRAConfig -> snapshot_download(path): huggingface_hub's repo-id validation
            return lora_error(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. Use "
                              "`repo_type` argument if needed.")
        config = json.loads((folder / "adapter_config.json").read_text())
        if name in fake.adapters:
            return lora_error(f"Failed to load LoRA adapter {name} because it is already loaded")
        args = fake.server_args
        wanted = _pool_modules(config["target_modules"])
        served = _pool_modules(args["lora_target_modules"] or [])
        if config["r"] > (args["max_lora_rank"] or 0) or not ("all" in served or wanted <= served):
            return lora_error(f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA "
                              "memory pool configuration. Please ensure that the LoRA adapter's rank is within the "
                              "configured `--max-lora-rank` and that the target modules are included in "
                              "`--lora-target-modules`.")
        if fake.model is not None:
            fake.adapter_models[name] = peft_applied(fake.model, folder)
        if not fake.forget_loads:
            fake.adapters[name] = path
            fake.ever_loaded[name] = path
        return None

    def resolve_lora(name: Any) -> Any:
        """TokenizerManager._validate_and_resolve_lora for one name: the model to decode with, or the 400 answer."""
        if not fake.server_args["enable_lora"]:
            return JSONResponse({"error": {"message": f"LoRA adapter '{name}' was requested, but LoRA is not enabled. "
                                           "Please launch the server with --enable-lora flag and preload adapters "
                                           "using --lora-paths or /load_lora_adapter endpoint."}}, status_code=400)
        if name not in fake.adapters:
            if name not in fake.ever_loaded:
                return JSONResponse({"error": {"message": f"Got LoRA adapter that has never been loaded: {name}\nAll "
                                               f"loaded adapters: dict_keys({list(fake.ever_loaded)})."}},
                                    status_code=400)
            if (failed := load_adapter(name, fake.ever_loaded[name])) is not None:  # reloaded from its path
                message = json.loads(failed.body)["error_message"]
                return JSONResponse({"error": {"message": f"Failed to implicitly load LoRA adapter {name}: "
                                               f"{message}"}}, status_code=400)
        fake.lora_requests.append(name)
        return fake.adapter_models.get(name, fake.model)

    @app.post("/load_lora_adapter")
    async def load_lora(request: Request):
        body, bad = await read(request, "/load_lora_adapter", LOAD_LORA_FIELDS, "LoadLoRAAdapterReqInput")
        if bad is not None:
            return bad
        if not fake.server_args["enable_lora"]:
            return lora_error("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if (failed := load_adapter(body["lora_name"], body["lora_path"])) is not None:
            return failed
        return {"success": True, "error_message": "", "loaded_adapters": dict(fake.adapters)}

    @app.post("/unload_lora_adapter")
    async def unload_lora(request: Request):
        body, bad = await read(request, "/unload_lora_adapter", UNLOAD_LORA_FIELDS, "UnloadLoRAAdapterReqInput")
        if bad is not None:
            return bad
        if not fake.server_args["enable_lora"]:
            return lora_error("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if body["lora_name"] not in fake.adapters:
            return lora_error(f"LoRA with name {body['lora_name']} does not exist. Loaded LoRAs: "
                              f"dict_keys({list(fake.adapters)})")
        del fake.adapters[body["lora_name"]]
        fake.adapter_models.pop(body["lora_name"], None)
        return {"success": True, "error_message": "", "loaded_adapters": dict(fake.adapters)}

    @app.get("/v1/models")
    async def models():  # the base model's card, then one per registered adapter (with LoRA on)
        record("/v1/models", None)
        cards = [{"id": "tiny", "object": "model", "created": 0, "owned_by": "sglang", "root": "tiny", "parent": None,
                  "max_model_len": fake.server_args["context_length"]}]
        if fake.server_args["enable_lora"]:
            cards += [{"id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": path,
                       "parent": "tiny", "max_model_len": None} for name, path in fake.adapters.items()]
        return {"object": "list", "data": cards}

    @app.post("/pause_generation")
    async def pause(request: Request):
        body, bad = await read(request, "/pause_generation", PAUSE_FIELDS, "PauseGenerationReqInput")
        if bad is not None:
            return bad
        assert body.get("mode", "abort") in ("abort", "retract", "in_place")
        fake.paused = True
        if fake.resumed is not None:
            fake.resumed.clear()
        if body.get("mode", "abort") == "abort":
            for event in fake.inflight.values():
                event.set()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request):
        body, bad = await read(request, "/continue_generation", CONTINUE_FIELDS, "ContinueGenerationReqInput")
        if bad is not None:
            return bad
        fake.paused = False
        if fake.resumed is not None:
            fake.resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        body, bad = await read(request, "/release_memory_occupation", MEMORY_FIELDS, "ReleaseMemoryOccupationReqInput")
        if bad is not None:
            return bad
        assert fake.paused and not fake.inflight, "released with requests running"
        tags = body.get("tags") or MEMORY_TYPES
        assert set(tags) <= set(MEMORY_TYPES), tags
        fake.offloaded |= set(tags)
        if fake.server_args["enable_memory_saver"]:  # else TorchMemorySaverAdapter is a no-op
            fake.released = True
            if "weights" in tags and not fake.server_args["enable_weights_cpu_backup"]:
                fake.weights_ok = False
        return {}

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        body, bad = await read(request, "/resume_memory_occupation", MEMORY_FIELDS, "ResumeMemoryOccupationReqInput")
        if bad is not None:
            return bad
        tags = body.get("tags") or MEMORY_TYPES
        if set(tags) - fake.offloaded:  # offload_tags.remove(tag): a KeyError, answered 400
            return JSONResponse({"error": {"message": repr(sorted(set(tags) - fake.offloaded))}}, status_code=400)
        fake.offloaded -= set(tags)
        fake.released = bool(fake.offloaded) and fake.released
        return {}

    def info() -> dict:  # build_server_info: the resolved ServerArgs, flat, and the live parts beside them
        return {**fake.server_args, "launch_command": "python -m sglang.launch_server", "kv_events": None,
                "startup_time": 0.0, "internal_states": [{}], "version": fake.version, "frontend": "python"}

    @app.get("/server_info")
    async def server_info():
        record("/server_info", None)
        return info()

    @app.get("/get_server_info")
    async def get_server_info():  # deprecated: logs so, answers as /server_info
        record("/get_server_info", None)
        return info()

    def outside_session(what: str) -> JSONResponse | None:
        """weight_updater: update_weights_from_distributed / _from_tensor with no open session: success false, 400."""
        if not fake.session_api or fake.session is not None:
            return None
        return JSONResponse({"success": False, "message": f"{what} must run between begin_weight_update() and "
                             "end_weight_update()"}, status_code=400)

    @app.post("/begin_weight_update")
    async def begin(request: Request):
        body, bad = await read(request, "/begin_weight_update", BEGIN_FIELDS, "BeginWeightUpdateReqInput")
        if bad is not None:
            return bad
        if fake.session is not None:
            return JSONResponse({"success": False, "message": "a weight-update session is already open; call "
                                 "end_weight_update() first"}, status_code=400)
        fake.session = body.get("selector", "all")
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    async def end(request: Request):
        _, bad = await read(request, "/end_weight_update", END_FIELDS, "EndWeightUpdateReqInput")
        if bad is not None:
            return bad
        if fake.session is None:
            return JSONResponse({"success": False, "message": "no weight-update session is open; call "
                                 "begin_weight_update() first"}, status_code=400)
        fake.session = None
        return {"success": True, "message": "Success"}

    @app.post("/flush_cache")
    async def flush():
        record("/flush_cache", None)
        if fake.inflight and not fake.paused:
            return PlainTextResponse("Cache not flushed: running requests.\n", status_code=400)
        fake.sequences.clear()
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    @app.post("/hicache/storage-backend/clear")
    async def clear_storage():  # no body; the same text whether it cleared or not, the status says which
        record("/hicache/storage-backend/clear", None)
        ok = fake.server_args["enable_hierarchical_cache"] and not fake.fail_clear
        return PlainTextResponse("Hierarchical cache storage backend cleared.\n", status_code=200 if ok else 400)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        body, bad = await read(request, "/update_weights_from_disk", UPDATE_FROM_DISK_FIELDS,
                               "UpdateWeightFromDiskReqInput")
        if bad is not None:
            return bad
        folder = Path(body["model_path"])
        if fake.fail_update or not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
            return JSONResponse({"success": False, "message": f"Failed to get weights iterator: no safetensors "
                                 f"checkpoint in {folder}", "num_paused_requests": 0}, status_code=400)
        fake.loaded = load_file(str(folder / "model.safetensors"))
        fake.weights_ok = True
        if body.get("weight_version") is not None:
            fake.weight_version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights. Weight version updated to "
                f"{fake.weight_version}.", "num_paused_requests": 0}

    def join_group(body: dict) -> Any:
        """As SGLang's ModelRunner.init_weights_update_group (rank = rank_offset + tp_rank; tp_rank 0 here) and
        sglang/srt/utils init_custom_process_group: torch's tcp:// rendezvous, a PrefixStore named by the init
        method, torch's _new_process_group_helper with the group's name, registered in _world so that
        torch.distributed.broadcast takes it."""
        import datetime

        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

        init_method = f"tcp://{body['master_address']}:{body['master_port']}"
        timeout = datetime.timedelta(seconds=60)
        store, rank, world = next(rendezvous(init_method, body["rank_offset"], body["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(world, rank, [], body["backend"], dist.PrefixStore(init_method, store),
                                          group_name=body["group_name"], timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        return pg

    def receive(body: dict) -> dict[str, torch.Tensor]:
        """As ModelRunner.update_weights_from_distributed: every tensor the call names allocated first, one async
        broadcast each from rank 0, all waited for, then loaded. Records the call's (names, start, end) and the most
        bytes it held."""
        import torch.distributed as dist

        start = time.monotonic()
        pg = fake.groups[body["group_name"]]
        out = {name: torch.empty(shape, dtype=getattr(torch, dtype))
               for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"])}
        fake.held_bytes = max(fake.held_bytes, sum(t.numel() * t.element_size() for t in out.values()))
        for work in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in out.values()]:
            work.wait()
        fake.received.append((list(out), start, time.monotonic()))
        return out

    def took(body: dict, tensors: dict[str, torch.Tensor]) -> None:
        """An update's tensors loaded into the model (a call may name some of them): the radix cache flushed (unless
        the request says not: SGLang's default is to flush) and its version taken when it names one."""
        fake.loaded.update(tensors)
        if body.get("weight_version") is not None:  # the version's last call: every tensor loaded
            fake.weights_ok = True
        if body.get("flush_cache", True):
            fake.sequences.clear()
        if body.get("weight_version") is not None:
            fake.weight_version = body["weight_version"]

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body, bad = await read(request, "/init_weights_update_group", INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput")
        if bad is not None:
            return bad
        if body["backend"] == "nccl":  # no GPU here: a group over NCCL cannot form (a real one would fail at init)
            return JSONResponse({"success": False, "message": "Failed to initialize custom process group: NCCL cannot "
                                 "run in this fake"}, status_code=400)
        if body["group_name"] in fake.groups:
            return JSONResponse({"success": False, "message": "Failed to initialize custom process group: Process "
                                 f"group with name {body['group_name']} already exists."}, status_code=400)
        fake.groups[body["group_name"]] = await asyncio.to_thread(join_group, body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        body, bad = await read(request, "/update_weights_from_distributed", FROM_DISTRIBUTED_FIELDS,
                               "UpdateWeightsFromDistributedReqInput")
        if bad is not None:
            return bad
        if refused := outside_session("update_weights_from_distributed"):
            return refused
        if body["group_name"] not in fake.groups:
            return JSONResponse({"success": False, "message": f"Group {body['group_name']} not in "
                                 f"{list(fake.groups)}. Please call `init_weights_update_group` first."},
                                status_code=400)
        if fake.receiving:  # the adapter waits for each call's answer before the next
            return JSONResponse({"success": False, "message": "two update calls at once"}, status_code=400)
        fake.receiving = True
        try:
            took(body, await asyncio.to_thread(receive, body))
        finally:
            fake.receiving = False
        message = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return {"success": True, "message": message}

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        body, bad = await read(request, "/update_weights_from_tensor", FROM_TENSOR_FIELDS,
                               "UpdateWeightsFromTensorReqInput")
        if bad is not None:
            return bad
        if refused := outside_session("update_weights_from_tensor"):
            return refused
        if fake.fail_update:
            return JSONResponse({"success": False, "message": "Failed to update weights: made to fail"},
                                status_code=400)
        # as tp_worker.deserialize_own_rank over HTTP: this TP rank's entry (tp_rank 0), deserialized as SGLang's
        # MultiprocessingSerializer does, then loaded
        took(body, dict(unpickle_named_tensors(body["serialized_named_tensors"][0], fake.rebuilt)))
        return {"success": True, "message": "Succeeded to update model weights."}

    return app


# SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (srt/utils/common.py) are exact (module, name) pairs; these are the
# ones a tensor payload can need (the fake allows fewer than SGLang, never more).
ALLOWED_GLOBALS = {
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list", "set",
                                "str", "tuple")),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch", "Size"), ("torch", "device"),
    ("torch", "dtype"), ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
    *(("torch", n) for n in ("bfloat16", "float16", "float32", "float64", "half", "float", "double", "float8_e4m3fn",
                             "float8_e5m2", "int8", "int16", "int32", "int64", "uint8", "bool")),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
}


def unpickle_named_tensors(entry: str, rebuilt: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """Deserialize one serialized_named_tensors entry (base64 of a pickle) as SGLang 0.5.23 does: an unpickler that
    resolves only ALLOWED_GLOBALS. No GPU here, so rebuild_cuda_tensor is a stand-in: it binds the call's arguments to
    the server's torch 2.14.1 parameter list (a call of another arity fails here as it would there), records them by
    name and returns a CPU tensor of the size and dtype they name."""
    import base64
    import io
    import pickle

    def stand_in(*args):
        assert len(args) == 15, f"torch 2.14.1's rebuild_cuda_tensor takes 15 arguments, got {len(args)}"
        named = dict(zip(TORCH_2_14_1_REBUILD_CUDA_TENSOR, args))
        rebuilt.append(named)
        return torch.zeros(named["tensor_size"], dtype=named["dtype"])

    class SafeUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in ALLOWED_GLOBALS:
                raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return stand_in
            return super().find_class(module, name)

    return SafeUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


@pytest.fixture(scope="module")
def served():
    fake_holder: dict[str, FakeSGLang] = {"fake": FakeSGLang()}

    class Proxy:  # the app reads the current test's FakeSGLang
        def __getattr__(self, name):
            return getattr(fake_holder["fake"], name)

        def __setattr__(self, name, value):
            setattr(fake_holder["fake"], name, value)

    server = ServerThread(fake_app(Proxy()))
    yield server, fake_holder
    server.stop()


@pytest.fixture
def fake(served) -> FakeSGLang:
    served[1]["fake"] = FakeSGLang()
    return served[1]["fake"]


@pytest.fixture
def engine(served, fake, tmp_path, tiny_model):
    eng = SGLangEngine(SGLangConfig(base_url=served[0].url, weights_dir=str(tmp_path / "weights"), retries=1,
                                    retry_backoff_s=0.01, context_length=4096), model_config=tiny_model.config)
    yield eng
    eng.close()


def _generate(engine, prompt, priority=0, **sampling):
    return asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(**sampling),
                                                         priority=priority)))


def test_generate_request_fields_and_parsing(engine, fake):
    prompt = [5, 6, 7]
    # a server started with a model's generation_config as its preferred params (Qwen2.5's): every field the request
    # leaves unset would take them, and a repetition penalty reshapes the distribution the trainer scores
    fake.preferred_sampling_params = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                      "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.1}
    out = _generate(engine, prompt, priority=3, max_tokens=6, temperature=0.7, top_p=0.9, seed=11)
    body = fake.bodies["/generate"][-1]
    assert body["input_ids"] == prompt and body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["priority"] == 3 and body["rid"].startswith("loomrl-") and body["stream"] is False
    assert body["sampling_params"] == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                       "ignore_eos": False, "no_stop_trim": True, "sampling_seed": 11,
                                       "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                       "min_p": 0.0}
    applied = fake.sampled[-1]
    assert (applied["repetition_penalty"], applied["frequency_penalty"], applied["presence_penalty"],
            applied["min_p"], applied["top_k"], applied["top_p"]) == (1.0, 0.0, 0.0, 0.0, -1, 0.9)
    expected = fake_run(prompt, 6, "default")
    assert out.token_ids == expected and out.finish_reason == "length"
    assert out.logprobs == [fake_token(prompt + expected[:i], "default")[1] for i in range(6)]
    assert out.versions == [0] * 6  # the server's weight_version "default" is no integer: the engine's version

    _generate(engine, prompt, top_k=5, stop=["\n"])
    assert fake.bodies["/generate"][-1]["sampling_params"]["top_k"] == 5
    assert fake.bodies["/generate"][-1]["sampling_params"]["stop"] == ["\n"]
    m = engine.metrics
    assert (m.requests, m.finished, m.prompt_tokens, m.generated_tokens) == (2, 2, 6, 6 + 64)
    assert m.reused_tokens == 2 and m.prefill_tokens == 4  # the second prompt's prefix was in the radix cache


def test_stop_token_is_kept_in_the_ids(engine, fake):
    prompt = [9, 8]
    stop = fake_run(prompt, 3, "default")[2]
    out = _generate(engine, prompt, max_tokens=10, stop_token_ids=[stop])
    assert fake.bodies["/generate"][-1]["sampling_params"]["stop_token_ids"] == [stop]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and len(out.token_ids) == len(out.logprobs) == 3


def test_priority_is_negated_for_a_server_ordering_highest_first(served, fake):
    eng = SGLangEngine(SGLangConfig(base_url=served[0].url, low_priority_first=False))
    try:
        _generate(eng, [1, 2], priority=4, max_tokens=2)
    finally:
        eng.close()
    assert fake.bodies["/generate"][-1]["priority"] == -4


def test_update_mid_generation_resumes_under_the_new_weights(engine, fake, tiny_model, tmp_path):
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=8)
    fake.hold = 3  # the request makes 3 tokens, then runs on until the update's abort pause

    async def go():
        task = asyncio.create_task(generate_resuming(engine, prompt, params))
        while not fake.inflight and not task.done():  # a failed request fails the test, not hangs it
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.update_weights, tiny_model.state_dict(), 1)
        return await task

    out, resumed = asyncio.run(go())
    first = fake_run(prompt, 3, "default")
    assert resumed == 1 and out.finish_reason == "length" and engine.version == 1
    assert out.token_ids == first + fake_run(prompt + first, 5, "1") and out.versions == [0] * 3 + [1] * 5
    assert fake.bodies["/generate"][-1]["input_ids"] == prompt + first  # resumed from the partial output
    assert [c for c in fake.calls if c in CONTROL] == ["/pause_generation", "/update_weights_from_disk",
                                                       "/flush_cache", "/continue_generation"]
    assert fake.bodies["/pause_generation"][-1] == {"mode": "abort"}
    update = fake.bodies["/update_weights_from_disk"][-1]
    folder = tmp_path / "weights" / "v000001"
    assert update == {"model_path": str(folder), "load_format": "safetensors", "weight_version": "1"}
    # the checkpoint folder: config.json and the weights in bfloat16, tied tensors once
    assert (folder / "config.json").is_file() and not list((tmp_path / "weights").glob(".*partial"))
    written = load_file(str(folder / "model.safetensors"))
    state = tiny_model.state_dict()
    assert set(written) == set(fake.loaded) and set(written) <= set(state)
    for name, tensor in state.items():
        twin = name if name in written else next(n for n in written if state[n].data_ptr() == tensor.data_ptr())
        assert torch.equal(written[twin], tensor.to(torch.bfloat16)), name
    engine.update_weights(state, 2)  # the older folder goes once the server has read the new one
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000002"] and fake.weight_version == "2"


def test_interrupt_ends_in_flight_requests_as_interrupted_and_they_resume(engine, fake):
    prompt, params = [2, 7, 1, 8], SamplingParams(max_tokens=6)
    fake.hold = 2

    async def go():
        task = asyncio.create_task(generate_resuming(engine, prompt, params))
        while not fake.inflight and not task.done():  # a failed request fails the test, not hangs it
            await asyncio.sleep(0.01)
        engine.interrupt()  # returns at once; the pause runs on the engine's control thread
        return await task

    out, resumed = asyncio.run(go())
    assert resumed == 1 and out.token_ids == fake_run(prompt, 6, "default") and out.versions == [0] * 6
    assert [c for c in fake.calls if c in CONTROL] == ["/pause_generation", "/continue_generation"]
    assert engine.metrics.interrupts == 1 and engine.metrics.faults == 0


def test_server_errors_are_engine_faults_with_the_servers_message(engine, fake, served, tiny_model):
    with pytest.raises(EngineFault, match=r"/generate answered 400: The input \(3 tokens\) is longer"):
        _generate(engine, [TOO_LONG, 1, 2])
    with pytest.raises(EngineFault, match="SGLang aborted the request: The server aborted it"):
        _generate(engine, [SERVER_ABORT, 1], max_tokens=2)  # an abort the engine did not cause is no interrupt
    fake.unavailable = 1  # 503 (starting): tried again
    assert len(_generate(engine, [4, 4], max_tokens=2).token_ids) == 2
    fake.fail_update = True
    with pytest.raises(EngineFault, match="update_weights_from_disk answered 400: Failed to get weights iterator"):
        engine.update_weights(tiny_model.state_dict(), 5)
    assert engine.version == 0 and fake.calls[-1] == "/continue_generation"  # the server is not left paused
    with pytest.raises(EngineFault, match="in-place updates need a model shared with the trainer"):
        engine.update_weights(None, 6)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineFault, match=f"/server_info: cannot reach http://127.0.0.1:{port}"):
        SGLangEngine(SGLangConfig(base_url=f"http://127.0.0.1:{port}", retries=1, retry_backoff_s=0.01))
    gone = SGLangEngine(SGLangConfig(base_url=served[0].url, retries=1, retry_backoff_s=0.01))
    try:
        with pytest.raises(EngineFault, match="engine.sglang.weights_dir is not set"):
            gone.update_weights({}, 1)
    finally:
        gone.close()
    with pytest.raises(EngineFault, match="the engine is closed"):
        _generate(gone, [1, 2])
    with pytest.raises(EngineFault, match="the engine is closed"):
        gone.update_weights({}, 2)


def test_config_refuses_sglang_without_a_server_and_make_engine_builds_it(served, fake, tiny_model, tokenizer):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.kind=sglang", "runtime.mode=async"])
    assert str(err.value) == ("config error: engine.sglang.base_url: engine.kind=sglang needs the SGLang server's "
                              "address, e.g. engine.sglang.base_url=http://gpu-node:30000")
    with pytest.raises(ConfigError, match="engine.kind=sglang needs runtime.mode=async"):
        load_config(None, ["engine.kind=sglang", "engine.sglang.base_url=http://x:1"])
    cfg = load_config(None, ["engine.kind=sglang", f"engine.sglang.base_url={served[0].url}", "runtime.mode=async",
                             "engine.sglang.context_length=2048"])
    eng = make_engine(cfg.engine_setup(), tiny_model, tokenizer, 3)
    try:
        assert isinstance(eng, SGLangEngine) and eng.kv_budget == 2048 and eng.version == 3
    finally:
        eng.close()


def _sleeping_engine(served, tmp_path, tiny_model) -> SGLangEngine:
    """An engine for engine.sleep_while_training (sleep_mode), connected to the fake as it is now set up."""
    return SGLangEngine(SGLangConfig(base_url=served[0].url, weights_dir=str(tmp_path / "weights"), retries=1,
                                     retry_backoff_s=0.01), model_config=tiny_model.config, sleep_mode=True)


def test_sleep_releases_the_memory_and_wake_serves_again(served, fake, tmp_path, tiny_model):
    """engine.sleep_while_training on a server with --enable-memory-saver --enable-weights-cpu-backup: sleep pauses
    (abort: the request in flight ends interrupted) and releases weights, KV cache and CUDA graphs; a request sent
    while asleep waits; wake resumes the memory (the backup restores the weights) and continues, and
    generate_resuming completes the interrupted request."""
    fake.server_args.update(enable_memory_saver=True, enable_weights_cpu_backup=True)
    engine = _sleeping_engine(served, tmp_path, tiny_model)
    prompt = [3, 4, 5]

    async def scenario():
        fake.hold = 2  # the first request stops after 2 tokens until an abort pause
        first = asyncio.ensure_future(generate_resuming(engine, prompt, SamplingParams(max_tokens=5)))
        while not fake.inflight:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.sleep)
        assert fake.released and fake.paused
        assert fake.bodies["/release_memory_occupation"] == [{"tags": ["kv_cache", "weights", "cuda_graph"]}]
        waiting = asyncio.ensure_future(_agenerate(engine, [7, 8], max_tokens=2))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held while the server sleeps
        await asyncio.to_thread(engine.wake)
        return await first, await waiting

    try:
        (result, resumes), second = asyncio.run(scenario())
    finally:
        engine.close()
    assert not fake.released and not fake.paused and not fake.offloaded
    assert fake.bodies["/resume_memory_occupation"] == [{"tags": ["kv_cache", "weights", "cuda_graph"]}]
    assert fake.calls.index("/release_memory_occupation") < fake.calls.index("/resume_memory_occupation")
    assert resumes == 1 and result.token_ids == fake_run(prompt, 5, "default")  # complete after the wake
    assert second.token_ids == fake_run([7, 8], 2, "default")
    assert fake.accepted and all(fake.accepted)  # every request generated with weights


def test_wake_without_a_cpu_backup_generates_only_after_the_next_update(served, fake, tmp_path, tiny_model):
    """A server with --enable-memory-saver but no --enable-weights-cpu-backup loses its weights' values at sleep. The
    wake then resumes the memory and holds generation (an interrupt meanwhile does not continue it either) until the
    next update has loaded weights: the driver publishes after every wake. The fake records, for each /generate as
    it begins, whether the weights were there."""
    fake.server_args.update(enable_memory_saver=True)
    engine = _sleeping_engine(served, tmp_path, tiny_model)

    async def scenario():
        await asyncio.to_thread(engine.sleep)
        assert not fake.weights_ok
        waiting = asyncio.ensure_future(_agenerate(engine, [7, 8], max_tokens=2))
        await asyncio.to_thread(engine.wake)
        engine.interrupt()  # a pause and continue: the continue must not happen without weights
        await asyncio.sleep(0.3)
        assert not waiting.done() and fake.paused and not fake.released  # memory back, still paused
        await asyncio.to_thread(engine.update_weights, tiny_model.state_dict(), 1)
        return await waiting

    try:
        out = asyncio.run(scenario())
    finally:
        engine.close()
    assert out.token_ids == fake_run([7, 8], 2, "1") and out.versions == [1, 1]
    assert fake.accepted == [True]
    order = [c for c in fake.calls if c != "/pause_generation"]
    assert order == ["/server_info", "/release_memory_occupation", "/resume_memory_occupation", "/generate",
                     "/update_weights_from_disk", "/flush_cache", "/continue_generation"]  # /generate: sent, held


def test_a_server_that_cannot_sleep_is_refused_at_connect(served, fake, tiny_model, tokenizer):
    """engine.sleep_while_training with a server started without --enable-memory-saver: make_engine refuses it with
    one line naming the flag (SGLang would answer release_memory_occupation and free nothing)."""
    cfg = load_config(None, ["engine.kind=sglang", f"engine.sglang.base_url={served[0].url}", "runtime.mode=async",
                             "engine.sleep_while_training=true", "runtime.weight_transport=shm"])
    with pytest.raises(EngineFault) as err:
        make_engine(cfg.engine_setup(), tiny_model, tokenizer, 0)
    assert str(err.value) == (f"engine.sleep_while_training: the SGLang server at {served[0].url} runs without "
                              "--enable-memory-saver, so it cannot give its GPU memory to the trainer; restart it "
                              "with --enable-memory-saver (and --enable-weights-cpu-backup to keep its weights across "
                              "a sleep)")
    assert fake.calls == ["/server_info"]  # nothing else was sent
    fake.server_args["enable_memory_saver"] = True  # the same run on a server that can
    make_engine(cfg.engine_setup(), tiny_model, tokenizer, 0).close()


async def _agenerate(engine, prompt, **sampling):
    return await engine.generate(GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(**sampling)))


def test_several_servers_are_one_per_engine_actor(served, fake, tiny_model, tokenizer):
    urls = [served[0].url, served[0].url.replace("127.0.0.1", "localhost")]  # two names of the one fake server
    with pytest.raises(ConfigError, match="set runtime.backend=ray and ray.engine.count=2"):
        load_config(None, ["engine.kind=sglang", f"engine.sglang.base_url=[{', '.join(urls)}]", "runtime.mode=async"])
    cfg = load_config(None, ["engine.kind=sglang", f"engine.sglang.base_url=[{', '.join(urls)}]", "runtime.mode=async",
                             "runtime.backend=ray", "ray.engine.count=2", "engine.sglang.weights_dir=/shared/w"])
    for replica, url in enumerate(urls):
        eng = make_engine(cfg.engine_setup(), tiny_model, tokenizer, 0, replica)
        try:  # its own server, and its own folder for the versions it writes (two engines never share one)
            assert eng.base_url == url and eng.cfg.weights_dir == f"/shared/w/server{replica}"
        finally:
            eng.close()


def test_loomrl_serve_answers_over_sglang(engine, fake, tokenizer):
    """`loomrl serve`'s app over the SGLang adapter (any Engine serves): a completion through the openai client
    and its stream carry the fake server's tokens."""
    openai = pytest.importorskip("openai")
    from loomrl.server.app import create_app

    server = ServerThread(create_app(engine, tokenizer, "tiny"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompt = [5, 6, 7]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == fake_run(prompt, 4, "default")
        assert fake.bodies["/generate"][-1]["input_ids"] == prompt
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    finally:
        server.stop()


BUCKET_BYTES = 32 << 10  # the tiny model's 21 tensors (12.7 MB in bfloat16) in 8 buckets


def _trainer_process(model_state: dict, handles: Any, done: Any) -> None:
    """The trainer side of the broadcast test, in a process of its own as in a run (a process registers a group
    under its name once: the fake server's side of it lives in the test's process). Reports, per version, when each
    bucket was read from the source (time.monotonic: one clock for every process of the machine)."""
    from loomrl.weights.source import DictSource
    from loomrl.weights.transports import make_publisher

    class Recorded(DictSource):
        def buckets(self):
            for bucket in super().buckets():
                self.read.append(time.monotonic())
                yield bucket

    publisher = make_publisher("broadcast", dtype=torch.bfloat16, wire="tensors", timeout_s=60,
                               bucket_bytes=BUCKET_BYTES)
    try:
        for version in (1, 2):
            source = Recorded({n: t + version for n, t in model_state.items()}, torch.bfloat16, BUCKET_BYTES)
            source.read = []
            handles.put(publisher.publish(source, version))
            publisher.settle()
            done.put((version, source.read))
    finally:
        publisher.close()


@pytest.mark.integration
def test_a_broadcast_goes_to_the_servers_workers_bucket_by_bucket(served, fake, tmp_path, tiny_model, request):
    """runtime.weight_transport=broadcast with SGLang: the trainer's publisher (another process) opens the group;
    the first version makes the adapter call /init_weights_update_group, which the fake answers as SGLang does, by
    joining with torch's own rendezvous and _new_process_group_helper (the real torch calls, so a group our side
    builds differently would hang or fail here). Then one /update_weights_from_distributed per bucket of the trainer's
    plan (plan_buckets at its bucket size), each naming at most a bucket's bytes (a tensor larger than a bucket alone),
    in lock-step with the trainer: the trainer reads bucket k+1 only once the server's call for bucket k is receiving,
    and each call starts after the one before answered. Only the last call flushes the cache and sets the version; the
    server has a HiCache storage backend, cleared after each version's session. The second version reuses the group;
    requests then carry its version."""
    import multiprocessing as mp

    from loomrl.weights.source import bucket_size, plan_buckets

    engine = _hicache_engine(served, tmp_path, tiny_model, "file")
    request.addfinalizer(engine.close)
    assert Transport.BROADCAST in engine.opens
    state = {n: t.detach().clone() for n, t in tiny_model.state_dict().items()}
    plan = plan_buckets(list(state), ["bfloat16"] * len(state), [list(t.shape) for t in state.values()], BUCKET_BYTES)
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_trainer_process, args=(state, handles, done), daemon=True)
    child.start()
    reads = {}
    try:
        for version in (1, 2):
            engine.update_from(handles.get(timeout=120))
            got, reads[version] = done.get(timeout=60)  # the trainer's broadcast ended: settle returned
            assert got == version
    finally:
        child.join(30)
    assert child.exitcode == 0
    n = len(plan)
    assert n == 8 and fake.calls.count("/init_weights_update_group") == 1
    assert fake.calls[:5] == ["/server_info", "/pause_generation", "/init_weights_update_group",
                              "/begin_weight_update", "/update_weights_from_distributed"]
    # each version's buckets inside one weight-update session (SGLang 0.5.23 refuses them outside one)
    assert fake.calls[4:4 + n + 3] == ["/update_weights_from_distributed"] * n + ["/end_weight_update", CLEAR,
                                                                                   "/continue_generation"]
    assert fake.calls[4 + n + 3:] == ["/pause_generation", "/begin_weight_update",
                                      *["/update_weights_from_distributed"] * n, "/end_weight_update", CLEAR,
                                      "/continue_generation"]
    assert fake.session is None and fake.bodies["/begin_weight_update"] == [{}, {}]
    bodies = fake.bodies["/update_weights_from_distributed"]
    assert len(bodies) == 2 * n
    for k, body in enumerate(bodies):
        bucket = plan[k % n]
        assert body["names"] == [e.name for e in bucket] and body["dtypes"] == ["bfloat16"] * len(bucket)
        assert body["shapes"] == [list(e.shape) for e in bucket]
        assert bucket_size(bucket) <= BUCKET_BYTES or len(bucket) == 1
        last = k % n == n - 1
        assert body["flush_cache"] is last and body.get("weight_version") == (str(k // n + 1) if last else None)
    assert fake.held_bytes == max(bucket_size(b) for b in plan) < sum(e.nbytes for b in plan for e in b) / 2
    for version in (1, 2):  # lock-step
        calls, read = fake.received[(version - 1) * n:version * n], reads[version]
        assert len(read) == n
        for k in range(1, n):
            assert read[k] > calls[k - 1][1], f"bucket {k + 1} read before the server's call for bucket {k} began"
            assert calls[k][1] >= calls[k - 1][2]
    init = fake.bodies["/init_weights_update_group"][0]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    assert list(fake.loaded) == list(state)
    assert all(torch.equal(fake.loaded[n], (t + 2).to(torch.bfloat16)) for n, t in state.items())
    assert engine.version == 2 and fake.weight_version == "2"
    assert set(_generate(engine, [5, 6, 7], max_tokens=4).versions) == {2}


def _fake_ipc_payload(state: dict[str, torch.Tensor], gpu: str) -> dict[str, Any]:
    """An ipc_payload (weights/) as a trainer on GPU `gpu` writes it; no GPU here, so each tensor's
    rebuild arguments are made up in reduce_tensor's order (index 6: the trainer's device index, 0)."""
    handles = [{gpu: (torch.Tensor, t.shape, t.stride(), 0, torch.UntypedStorage, torch.bfloat16, 0,
                      f"ipc-{i}".encode(), t.numel() * 2, 0, False, b"ref", 0, b"event", True)}
               for i, t in enumerate(state.values())]
    return {"names": list(state), "dtype_names": ["bfloat16"] * len(state), "shapes": [list(t.shape) for t in
            state.values()], "ipc_handles": handles}


def test_a_cuda_ipc_version_reaches_the_server_as_sglangs_serialized_named_tensors(engine, fake, tiny_model):
    """runtime.weight_transport=cuda_ipc with SGLang: /update_weights_from_tensor carries, for TP rank 0, the pickled
    (name, tensor) list SGLang's MultiprocessingSerializer would make of the trainer's CUDA tensors, with the device as
    the GPU's UUID, inside a weight-update session. CONTRACT TEST: no GPU here, so the IPC handles are made up and the
    fake's rebuild is a stand-in; what is checked is the wire (fields, SGLang 0.5.23's exact unpickler allowlist,
    rebuild_cuda_tensor's arguments bound to the server's torch 2.14.1 parameter list: the trainer's torch 2.13.0
    wrote them), the pause/begin/end/continue around it and the version. Not run against SGLang or on a GPU."""
    from loomrl.weights.handle import WeightHandle

    assert Transport.CUDA_IPC in engine.opens
    state = {n: t for n, t in tiny_model.state_dict().items()}
    gpu = "GPU-5f2c1d7e-0000-4000-8000-000000000001"
    payload = _fake_ipc_payload(state, gpu)
    engine.update_from(WeightHandle(transport=Transport.CUDA_IPC, version=3, nbytes=0, payload=payload))
    assert fake.calls == ["/server_info", "/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                          "/end_weight_update", "/continue_generation"]
    body = fake.bodies["/update_weights_from_tensor"][0]
    assert len(body["serialized_named_tensors"]) == 1 and body["flush_cache"] is True and body["weight_version"] == "3"
    assert list(fake.loaded) == list(state)
    assert all(fake.loaded[n].shape == t.shape and fake.loaded[n].dtype == torch.bfloat16 for n, t in state.items())
    sent = [next(iter(h.values())) for h in payload["ipc_handles"]]
    # rebuilt by torch 2.14.1's argument list: every argument where the trainer's reduce_tensor put it, the device
    # the GPU's UUID (SGLang's patched rebuild maps it), not the trainer's index
    assert [a["storage_device"] for a in fake.rebuilt] == [gpu] * len(state)
    for got, args in zip(fake.rebuilt, sent):
        want = dict(zip(TORCH_2_14_1_REBUILD_CUDA_TENSOR, args))
        assert {k: v for k, v in got.items() if k != "storage_device"} == {
            k: v for k, v in want.items() if k != "storage_device"}
    assert engine.version == 3 and set(_generate(engine, [5, 6, 7], max_tokens=4).versions) == {3}


def test_cuda_ipc_is_refused_for_an_sglang_server_on_several_gpus(served, fake, tiny_model):
    from loomrl.weights.handle import WeightHandle

    base = ["engine.kind=sglang", "engine.sglang.base_url=http://x:1", "runtime.mode=async",
            "runtime.weight_transport=cuda_ipc"]
    with pytest.raises(ConfigError, match=r"must then run on that one GPU \(engine.sglang.tp_size=2\)"):
        load_config(None, [*base, "engine.sglang.tp_size=2"])
    eng = SGLangEngine(SGLangConfig(base_url=served[0].url, tp_size=2, retries=1, retry_backoff_s=0.01))
    try:
        with pytest.raises(EngineFault, match="use weight_transport=broadcast"):
            eng.update_from(WeightHandle(transport=Transport.CUDA_IPC, version=1, nbytes=0,
                                         payload=_fake_ipc_payload({"w": torch.zeros(2)}, "GPU-x")))
    finally:
        eng.close()
    assert "/update_weights_from_tensor" not in fake.calls


def _ipc_handle(version: int, names: tuple[str, ...] = ("w",)):
    from loomrl.weights.handle import WeightHandle

    return WeightHandle(transport=Transport.CUDA_IPC, version=version, nbytes=0,
                        payload=_fake_ipc_payload({n: torch.zeros(2) for n in names}, "GPU-x"))


@pytest.mark.parametrize("version", ["0.5.4", "0.6.0", None])
def test_a_server_outside_the_tested_sglang_range_is_refused_at_connect(served, fake, version):
    """/server_info's "version" outside sglang_contract.TESTED (the routes and fields were read at 0.5.23): one line
    naming the server, its version and the tested range; nothing else is sent."""
    fake.version = version
    with pytest.raises(EngineFault) as err:
        SGLangEngine(SGLangConfig(base_url=served[0].url, retries=0))
    assert str(err.value) == (f"engine.kind=sglang: the server at {served[0].url} runs SGLang {version}; loomrl's "
                              "adapter is tested with sglang>=0.5.23,<0.5.24 (its weight-update routes and request "
                              "fields): serve 'sglang>=0.5.23,<0.5.24' (which runs torch 2.14.1)")
    assert fake.calls == ["/server_info"]


def test_a_server_without_server_info_is_read_through_the_route_it_deprecates(served, fake):
    fake.missing_routes = {"/server_info"}
    eng = SGLangEngine(SGLangConfig(base_url=served[0].url, retries=0))
    eng.close()
    assert fake.calls == ["/server_info", "/get_server_info"] and eng.server_version == "0.5.23"


def test_a_failed_update_ends_its_session_so_the_next_one_can_begin(engine, fake):
    """A cuda_ipc update the server refuses: the session is ended after it (SGLang would refuse every later begin
    otherwise), the server continued, and the next version loads."""
    fake.fail_update = True
    with pytest.raises(EngineFault, match="update_weights_from_tensor answered 400: Failed to update weights"):
        engine.update_from(_ipc_handle(1))
    assert fake.calls[1:] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                              "/end_weight_update", "/continue_generation"]
    assert fake.session is None and not fake.paused and engine.version == 0
    fake.fail_update = False
    engine.update_from(_ipc_handle(2))
    assert engine.version == 2 and fake.weight_version == "2" and fake.session is None


def test_a_session_left_open_is_ended_and_begun_again(engine, fake):
    """A server left inside a session (a run that stopped mid-update) refuses the begin; the adapter ends that
    session and begins once more, then loads."""
    fake.session = "all"
    engine.update_from(_ipc_handle(1))
    assert fake.calls[1:] == ["/pause_generation", "/begin_weight_update", "/end_weight_update",
                              "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
                              "/continue_generation"]
    assert engine.version == 1 and fake.session is None


def test_a_build_without_session_routes_gets_its_updates_without_one(engine, fake):
    """The first begin is the probe: a build without the routes answers 404, and that engine sends its updates
    without sessions from then on (asked once)."""
    fake.missing_routes, fake.session_api = {"/begin_weight_update", "/end_weight_update"}, False
    engine.update_from(_ipc_handle(1))
    engine.update_from(_ipc_handle(2))
    assert fake.calls[1:] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                              "/continue_generation", "/pause_generation", "/update_weights_from_tensor",
                              "/continue_generation"]
    assert engine.version == 2


def test_a_broadcast_over_nccl_across_the_trainers_and_the_servers_torch_is_refused(engine, fake, monkeypatch):
    """SGLang 0.5.23 runs torch 2.14.1 (NCCL 2.30.7), loomrl's trainer torch 2.13.0 (NCCL 2.29.7), and NCCL refuses a
    group whose ranks differ in version. The adapter refuses before the server joins the group, with one line, and
    leaves the server serving. NCCL cannot run here: the trainer's NCCL version (torch.cuda.nccl.version(), absent
    from a CPU build) is given by replacing sglang_contract.trainer_nccl as the adapter sees it."""
    from loomrl.engine import sglang as adapter
    from loomrl.engine.sglang_contract import SERVER_NCCL, check_nccl
    from loomrl.weights.handle import WeightHandle

    monkeypatch.setattr(adapter, "trainer_nccl", lambda: (2, 29, 7), raising=False)
    payload = {"group": {"name": "g1", "host": "127.0.0.1", "port": 1, "world_size": 2, "backend": "nccl"},
               "rank_offset": 1, "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "bucket_bytes": 1 << 20}
    with pytest.raises(EngineFault) as err:
        engine.update_from(WeightHandle(transport=Transport.BROADCAST, version=1, nbytes=4, payload=payload))
    assert str(err.value) == (
        f"runtime.weight_transport=broadcast over NCCL: the SGLang 0.5.23 server at {engine.base_url} runs torch "
        f"2.14.1 with NCCL 2.30.7, this trainer torch {torch.__version__} with NCCL 2.29.7, and NCCL refuses a group "
        "whose ranks differ in version; use runtime.weight_transport=cuda_ipc (trainer and server on one GPU) or shm "
        "(the adapter writes each version for /update_weights_from_disk), or train with torch==2.14.1")
    assert "/init_weights_update_group" not in fake.calls and not fake.paused and engine.version == 0
    check_nccl(SERVER_NCCL, "0.5.23", engine.base_url)  # the same NCCL on both sides: no refusal
    check_nccl(None, "0.5.23", engine.base_url)  # a torch without NCCL: nothing to compare


def test_the_trainers_cuda_ipc_payload_rebuilds_under_the_servers_torch():
    """The pairing for cuda_ipc: the trainer's torch writes rebuild_cuda_tensor's arguments (reduce_tensor), SGLang's
    torch 2.14.1 rebuilds from them. This torch's rebuild takes exactly torch 2.14.1's arguments (recorded above from
    its wheel), the contract records the same list, and a torch whose rebuild takes others is refused in one line."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from loomrl.engine.sglang_contract import check_rebuild

    assert REBUILD_CUDA_TENSOR_ARGS == TORCH_2_14_1_REBUILD_CUDA_TENSOR
    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == TORCH_2_14_1_REBUILD_CUDA_TENSOR
    check_rebuild(rebuild_cuda_tensor)

    def later(*, tensor_cls, tensor_size, storage_handle):  # a torch whose rebuild changed
        raise AssertionError("never called")

    with pytest.raises(EngineFault, match=r"rebuild_cuda_tensor takes 3 arguments .* torch 2.14.1 15: its payload "
                                          "would not rebuild there"):
        check_rebuild(later)


def _hicache_engine(served, tmp_path, tiny_model, backend: str | None) -> SGLangEngine:
    """An engine on a server with HiCache on (--enable-hierarchical-cache) and `backend` as its storage backend."""
    fake = served[1]["fake"]
    fake.server_args.update(enable_hierarchical_cache=True, hicache_storage_backend=backend)
    return SGLangEngine(SGLangConfig(base_url=served[0].url, weights_dir=str(tmp_path / "weights"), retries=0),
                        model_config=tiny_model.config)


def test_a_hicache_storage_backend_is_cleared_after_every_updates_flush(served, fake, tmp_path, tiny_model):
    """With --hicache-storage-backend, /flush_cache (or an update's flush_cache) leaves the storage tier, so after each
    version's flush the adapter posts /hicache/storage-backend/clear, before the server continues: from disk (after
    /flush_cache) and cuda_ipc (after the session that flushed). The broadcast path is checked in
    test_a_broadcast_goes_to_the_servers_workers_bucket_by_bucket."""
    eng = _hicache_engine(served, tmp_path, tiny_model, "file")
    try:
        eng.update_weights(tiny_model.state_dict(), 1)
        eng.update_from(_ipc_handle(2))
    finally:
        eng.close()
    assert fake.calls[1:] == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", CLEAR,
                              "/continue_generation", "/pause_generation", "/begin_weight_update",
                              "/update_weights_from_tensor", "/end_weight_update", CLEAR, "/continue_generation"]
    assert fake.bodies[CLEAR] == [None, None] and eng.version == 2


def test_hicache_without_a_storage_backend_is_not_cleared(served, fake, tmp_path, tiny_model):
    """HiCache on without a storage backend: the flush empties every tier, no clear is sent (nor on a default
    server: the other tests' exact call lists)."""
    eng = _hicache_engine(served, tmp_path, tiny_model, None)
    try:
        eng.update_weights(tiny_model.state_dict(), 1)
        eng.update_from(_ipc_handle(2))
    finally:
        eng.close()
    assert CLEAR not in fake.calls and eng.version == 2


def test_a_failed_storage_clear_fails_the_update_and_keeps_the_server_paused(served, fake, tmp_path, tiny_model):
    """A clear the server refuses fails the update in one line naming the route and why it matters; the server stays
    paused (continuing would let it serve the old weights' K/V from the store) until an update clears it."""
    eng = _hicache_engine(served, tmp_path, tiny_model, "mooncake")
    try:
        fake.fail_clear = True
        with pytest.raises(EngineFault) as err:
            eng.update_from(_ipc_handle(1))
        message = str(err.value)
        assert "\n" not in message.strip() and CLEAR in message and "mooncake" in message
        assert "old weights' K/V" in message and "answered 400" in message
        assert fake.calls[-2:] == ["/end_weight_update", CLEAR] and fake.paused and eng.version == 0
        fake.fail_clear = False
        eng.update_from(_ipc_handle(2))
    finally:
        eng.close()
    assert fake.calls[-2:] == [CLEAR, "/continue_generation"] and not fake.paused and eng.version == 2
