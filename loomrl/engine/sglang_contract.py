"""The SGLang server loomrl's HTTP adapter (engine/sglang.py) was read against, and the checks made when it connects.

What it is: the tested SGLang range (TESTED), the torch and NCCL builds that range's server runs, and the checks that
refuse, with one line each, what is known to break: a server outside the range (its routes and request fields were
read at SGLang 0.5.23 only), a broadcast over NCCL between the trainer's NCCL and a different one in the server (NCCL
refuses a communicator whose ranks differ in version: "Mismatched NCCL version detected", src/init.cc
initTransportsRank), and a trainer torch whose rebuild_cuda_tensor no longer takes the arguments the server's torch
rebuilds a cuda_ipc payload with.

The pairing, from the packages' own metadata and source (nothing here ran a real SGLang or a GPU):
- sglang 0.5.23's wheel requires torch==2.14.1; torch 2.14.1's wheel requires nvidia-nccl-cu13==2.30.7, torch 2.13.0's
  (loomrl's trainer) nvidia-nccl-cu13==2.29.7. So a broadcast over NCCL from a torch 2.13.0 trainer into an SGLang
  0.5.23 server fails when the group forms; over gloo, or by cuda_ipc or from disk, there is no NCCL between them.
- cuda_ipc: torch/multiprocessing/reductions.py is the same file, byte for byte, in torch 2.13.0 and 2.14.1, so
  rebuild_cuda_tensor takes the same 15 arguments (REBUILD_CUDA_TENSOR_ARGS) in the trainer and the server, and every
  global the payload's pickle names is in SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (sglang/srt/utils/common.py).
  What is not checked here: the bytes of the CUDA IPC and ref-counter handles and the GPU UUID's text, which torch's
  C++ makes (StorageSharing.cpp, the CUDA device properties) on each side.

LoRA adapters (engine/sglang.py update_adapter), as sglang 0.5.23's source has them: POST /load_lora_adapter
{lora_name, lora_path, pinned} and POST /unload_lora_adapter {lora_name} (srt/entrypoints/http_server.py; the bodies are
io_struct.LoadLoRAAdapterReqInput and UnloadLoRAAdapterReqInput, the answer LoRAUpdateOutput {success, error_message,
loaded_adapters}, 200 or 400), the /generate field lora_path (GenerateReqInput: a name, or one per prompt), and GET
/v1/models, whose cards list every loaded adapter (id: its name, root: the path it was loaded from, parent: the base).
The server must be started with the flags `lora_flags` names (srt/arg_groups/fields/lora.py; /server_info reports
them flat); `check_lora_server` refuses a server without them before anything is sent. No route reads an adapter's
tensors back: /get_weights_by_name and /weights_checker read the base model's parameters only, and
/load_lora_adapter_from_tensors's expected_checksums checks the tensors as received, not as applied (and needs tensors
pickled for the server's process), so the adapter's fingerprint is its name and folder in /v1/models (LORA_UNREAD).

What it is not: a check of the server's behaviour (tests/engine/test_sglang_engine.py plays the server from 0.5.23's
request and response types), or of anything the server does not report (/server_info carries SGLang's version, not
its torch's: the torch is the one 0.5.23 pins).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from loomrl.engine.base import EngineFault

TESTED = ">=0.5.23,<0.5.24"  # the SGLang whose source the adapter and the fake server were read against
DOCUMENTED = "0.5.23"  # the server README.md tells users to install; scripts/gpu_resolve.py resolves it
SERVER_TORCH = "2.14.1"  # sglang 0.5.23: Requires-Dist torch==2.14.1
SERVER_NCCL = (2, 30, 7)  # torch 2.14.1: Requires-Dist nvidia-nccl-cu13==2.30.7 (torch 2.13.0: 2.29.7)
# torch 2.14.1's torch/multiprocessing/reductions.py rebuild_cuda_tensor, in order (the same in 2.13.0); argument 6 is
# the device, which the payload names by the GPU's UUID for SGLang's patched rebuild (utils/patch_torch.py)
REBUILD_CUDA_TENSOR_ARGS = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype", "storage_device",
    "storage_handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required")
DEVICE_ARG = REBUILD_CUDA_TENSOR_ARGS.index("storage_device")


def check_server(version: Any, base_url: str) -> str:
    """The server's SGLang version (/server_info "version"), or EngineFault, one line, when it is outside TESTED."""
    try:
        found = Version(str(version))
    except InvalidVersion:
        found = None
    if found is None or found not in SpecifierSet(TESTED):
        raise EngineFault(f"engine.kind=sglang: the server at {base_url} runs SGLang {version}; loomrl's adapter is "
                          f"tested with sglang{TESTED} (its weight-update routes and request fields): serve "
                          f"'sglang{TESTED}' (which runs torch {SERVER_TORCH})")
    return str(found)


def trainer_nccl() -> tuple[int, ...] | None:
    """The NCCL this process's torch loads (the trainer's environment: the adapter runs in it), or None where torch
    has no NCCL (a CPU build)."""
    from torch.cuda import nccl

    try:
        found = nccl.version()
    except (AttributeError, RuntimeError):  # a CPU build has no _nccl_version
        return None
    return tuple(int(p) for p in found) if isinstance(found, tuple) else None


def check_nccl(local: tuple[int, ...] | None, server_version: str, base_url: str) -> None:
    """EngineFault, one line, when a broadcast over NCCL would join this NCCL with the server's different one."""
    if local is None or tuple(local) == SERVER_NCCL:
        return
    import torch

    def dotted(v: tuple[int, ...]) -> str:
        return ".".join(map(str, v))

    raise EngineFault(f"runtime.weight_transport=broadcast over NCCL: the SGLang {server_version} server at {base_url} "
                      f"runs torch {SERVER_TORCH} with NCCL {dotted(SERVER_NCCL)}, this trainer torch "
                      f"{torch.__version__} with NCCL {dotted(local)}, and NCCL refuses a group whose ranks differ in "
                      "version; use runtime.weight_transport=cuda_ipc (trainer and server on one GPU) or shm (the "
                      f"adapter writes each version for /update_weights_from_disk), or train with torch=={SERVER_TORCH}")


def check_rebuild(rebuild: Callable[..., Any]) -> None:
    """EngineFault, one line, when this torch's rebuild_cuda_tensor takes other arguments than the server's torch."""
    names = tuple(inspect.signature(rebuild).parameters)
    if names != REBUILD_CUDA_TENSOR_ARGS:
        import torch

        raise EngineFault(f"runtime.weight_transport=cuda_ipc: this torch {torch.__version__}'s rebuild_cuda_tensor "
                          f"takes {len(names)} arguments {names}, the SGLang server's torch {SERVER_TORCH} "
                          f"{len(REBUILD_CUDA_TENSOR_ARGS)}: its payload would not rebuild there")


LOAD_LORA = "/load_lora_adapter"  # {lora_name, lora_path, pinned}: 400 {success false, error_message} when refused
UNLOAD_LORA = "/unload_lora_adapter"  # {lora_name}; waits for the requests using it (lora_registry.wait_for_unload)
MODELS = "/v1/models"  # {data: [{id, root, parent, ...}]}: the base model's card, then one per loaded adapter
LORA_UNREAD = ("SGLang 0.5.23 reads no LoRA adapter's tensors back (/get_weights_by_name and /weights_checker read the "
               "base model's parameters only)")
# lora/utils.py get_normalized_target_modules: the adapter's target modules as the server's LoRA memory pool names them
# (fused projections), compared with --lora-target-modules normalized the same way
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def lora_flags(rank: int, target_modules: list[str]) -> list[str]:
    """The launch_server flags an SGLang server needs to serve loomrl's adapters of `rank` on `target_modules`
    (--lora-strict-loading: a tensor under a name the server does not expect is an error, not a logged skip)."""
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *sorted(target_modules),
            "--lora-strict-loading"]


def _normalized(modules: Any) -> set[str]:
    if isinstance(modules, str):  # "all" / "all-linear": every module the server supports
        return {"all"}
    return {_FUSED.get(m.rsplit(".", 1)[-1], m.rsplit(".", 1)[-1]) for m in modules}


def check_lora_server(info: dict[str, Any], rank: int, target_modules: list[str], base_url: str) -> None:
    """EngineFault, one line, when the server's /server_info says it cannot load an adapter of `rank` on
    `target_modules` (LoRA off, --max-lora-rank below `rank`, a target module outside --lora-target-modules): what
    lora_manager.validate_new_adapter would refuse at the first load. A value the server leaves unresolved (None: it
    infers it from --lora-paths) is left to the load."""
    flags = " ".join(lora_flags(rank, target_modules))
    why = ""
    served = info.get("lora_target_modules")
    if not info.get("enable_lora"):
        why = "runs without --enable-lora"
    elif info.get("max_lora_rank") is not None and int(info["max_lora_rank"]) < rank:
        why = f"has --max-lora-rank {info['max_lora_rank']}, below the adapter's rank {rank}"
    elif served and "all" not in _normalized(served) and not _normalized(target_modules) <= _normalized(served):
        why = f"has --lora-target-modules {sorted(served)}, without all of the adapter's {sorted(target_modules)}"
    if why:
        raise EngineFault(f"trainer.lora.publish=adapter: the SGLang server at {base_url} {why}; restart it with "
                          f"{flags} (or publish merged weights: trainer.lora.publish=merged)")
