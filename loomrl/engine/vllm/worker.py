"""The half of the vLLM adapter that runs inside vLLM's worker process: a weight-transfer engine for vLLM's RL API.

What it is: the module vLLM's workers import before they build their model (`engine.vllm` starts vLLM with
worker_extension_cls="loomrl.engine.vllm.worker.WorkerExtension"); importing it registers "loomrl_inline" with vLLM's
WeightTransferEngineFactory, whose InlineWeightEngine loads each update AsyncLLM.update_weights hands it (inline
bytes, a trainer's shm segment, CUDA IPC handles or a streamed bucket, a broadcast) inside vLLM's layerwise reload.
It also writes the first error vLLM logs here to the file LOOMRL_VLLM_FAILURE_FILE names, for the adapter's story of a
death (engine/vllm/memory.py). The kinds of update, and why they are loaded so, are in docs/engines.md, 'Inside vLLM's
worker: the loomrl_inline weight-transfer engine'.

What it is not: a trainer-side engine (loomrl's publisher already holds the tensors: weights/) or a path
across machines or GPUs (inline bytes go through EngineCore's sockets; NCCL would be the path between GPUs).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from loomrl.engine.vllm.weights import from_wire
from loomrl.errors import named_line
from loomrl.weights.fingerprint import TensorSum, tensor_sum
from loomrl.weights.group import Receiver
from loomrl.weights.handle import Transport, WeightHandle
from loomrl.weights.ipc import flat_views, ipc_tensors, mapped_buffer
from loomrl.weights.shm import shm_views

BACKEND = "loomrl_inline"
FAILURE_FILE = "LOOMRL_VLLM_FAILURE_FILE"  # environment variable: where a worker writes the first error it logs
# environment variable: the adapter's process, which sets both and writes nothing (what vLLM logs there, such as
# EngineDeadError, is a consequence of a worker's failure, never its cause)
FAILURE_FILE_OWNER = "LOOMRL_VLLM_FAILURE_FILE_OWNER"


@dataclass
class InlineInit(WeightTransferInitInfo):
    pass


@dataclass
class InlineUpdate(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # torch dtype names without "torch."
    shapes: list[list[int]] = field(default_factory=list)
    # the tensors' bytes: sent as memoryviews and received as bytes in process, base64 strings over HTTP
    blobs: list[Any] = field(default_factory=list)
    segment: str = ""  # shm: the segment to read the tensors `names` from (dtypes, shapes and blobs stay empty)
    # shm, cuda_ipc and broadcast: `names` are the tensors the adapter checked (tied aliases left out), loaded alone
    version: int = -1  # shm: the version the segment must hold; broadcast: the version received
    ipc: str = ""  # cuda_ipc: base64 of the pickled ipc_payload, or of a streamed bucket's flat payload (weights/ipc.py)
    # a streamed bucket (weights/bucket.py): its memory is rewritten with the next bucket once this call returns, and
    # vLLM's layerwise reload keeps the tensors it is given until their layer is complete (possibly a later bucket,
    # or finish_weight_update): they are loaded as copies, as vLLM's own packed IPC consumer does
    copy: bool = False
    broadcast: dict[str, Any] | None = None  # broadcast: the group's address and the version's names, dtypes, shapes
    # A test-only seam (VLLMEngine.skip_loading; empty in runs): names received but not loaded, a load that misses a
    # tensor, so that tests prove the fingerprint check catches one without patching vLLM
    skip: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Followed:
    """The publisher's sums that followed this worker's last broadcast version (group.py receive_sums). Kept here,
    once per worker process, because vLLM's worker holds the transfer engine that receives them and the worker
    extension that reports them (`loomrl_published`) as two objects, and reaching one from the other would be another
    vLLM internal."""

    version: int = -1
    sums: dict[str, TensorSum] = field(default_factory=dict)


_FOLLOWED = Followed()


class InlineWeightEngine(WeightTransferEngine[InlineInit, InlineUpdate]):
    """Loads the buckets AsyncLLM.update_weights sends into this worker's model."""

    init_info_cls = InlineInit
    update_info_cls = InlineUpdate
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InlineInit) -> None:
        self.receiver = Receiver()  # broadcast: joins the trainer's group when a handle first names it
        # a streamed version's buffer, mapped once per allocation (its buffer_id) and dropped when the update
        # finishes: each IPC export is matched by one rebuild (weights/ipc.py export_buffer)
        self.mapped: tuple[str, torch.Tensor] | None = None

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the base class syncs unconditionally, which a CPU build cannot
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: InlineUpdate) -> None:
        try:
            if update_info.segment:
                with shm_views(WeightHandle(transport=Transport.SHM, version=update_info.version, nbytes=0,
                                            location=update_info.segment)) as views:
                    # vLLM's loaders copy (and cast) out of the views; `names`: those the adapter checked
                    self._load([(n, _owned(views[n], update_info.copy)) for n in update_info.names], update_info.skip)
            elif update_info.broadcast is not None:
                # the engine's first rank + this worker's tensor-parallel rank; joined on the first handle naming it
                group = self.receiver.group_for(update_info.broadcast["group"],
                                                update_info.broadcast["rank_offset"] + self.parallel_config.rank,
                                                self.device)
                wanted = set(update_info.names)  # every bucket is received: the others are in the collective too
                for bucket in group.receive(update_info.broadcast):
                    self._load([(n, t) for n, t in bucket if n in wanted], update_info.skip)
                # after the last bucket: the publisher's sums, where its handle could not carry them (a sharded trainer)
                _FOLLOWED.version, _FOLLOWED.sums = update_info.version, group.receive_sums(update_info.broadcast)
            elif update_info.ipc:
                payload = pickle.loads(base64.b64decode(update_info.ipc))  # noqa: S301 - our trainer's, same machine
                mapped = self._flat(payload) if "buffer" in payload else ipc_tensors(payload, self.device.index)
                self._load([(n, _owned(mapped[n], update_info.copy)) for n in update_info.names], update_info.skip)
            else:
                self._load(from_wire(update_info), update_info.skip)
        except BaseException:
            self.mapped = None
            finalize_layerwise_reload(self.model, self.model_config)  # no layer left half-way in the reload
            raise

    def _flat(self, payload: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A streamed bucket's tensors in the trainer's buffer, mapped once per buffer (self.mapped)."""
        if self.mapped is None or self.mapped[0] != payload["buffer_id"]:
            self.mapped = (payload["buffer_id"], mapped_buffer(payload, self.device.index))
        return flat_views(self.mapped[1], payload["entries"])

    def _load(self, named: list[tuple[str, torch.Tensor]], skip: list[str]) -> None:
        self.model.load_weights([(n, t) for n, t in named if n not in skip] if skip else named)

    def finish_weight_update(self) -> None:
        self.mapped = None  # the trainer frees its buffer after the version (weights/ipc.py CudaBucketBuffer.close)
        finalize_layerwise_reload(self.model, self.model_config)
        lm_head = getattr(self.model, "lm_head", None)
        if lm_head is not None and getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            lm_head.quant_method.process_weights_after_loading(lm_head)  # re-pack the tied head (see above)

    def shutdown(self) -> None:
        pass


class WorkerExtension:
    """Mixed into vLLM's worker class: importing this module registers the weight-transfer engine and the failure
    log (below); `loomrl_pid` is called through collective_rpc."""

    model_runner: Any  # vLLM's worker class, which this one is mixed into, sets it

    def loomrl_pid(self) -> int:
        """This worker's process id: the adapter watches it, to tell a killed worker from one that failed."""
        return os.getpid()

    def loomrl_fingerprint(self, wanted: dict[str, list]) -> dict[str, Any]:
        """Checksums (weights/fingerprint.py tensor_sum) of this worker's parameters named in `wanted` ({name: [dtype,
        shape, fused]} as published, `fused` as `readable` takes it): {"sums": {name: [sum, weighted]}, "unchecked": why
        the others could not be read}."""
        params = dict(self.model_runner.get_model().named_parameters())
        sums, other = {}, []
        for name, (dtype, shape, fused) in wanted.items():
            p = readable(params, name, getattr(torch, dtype), tuple(shape), fused)
            if p is None:
                other.append(name)
                continue
            s = tensor_sum(p, getattr(torch, dtype))
            sums[name] = [s.sum, s.weighted]
        why = (f"vLLM holds them in another layout: sharded across tensor-parallel ranks (fused ones, in qkv_proj or "
               f"gate_up_proj, too), quantized or packed for the CPU (e.g. {other[0]})") if other else ""
        return {"sums": sums, "unchecked": why}

    def loomrl_adapter_fingerprint(self, lora_id: int | None, wanted: dict[str, list], scale: float) -> dict[str, Any]:
        """Checksums of the LoRA adapter vLLM holds under `lora_id` (None: the highest id, the one a server loaded
        last), by the published names in `wanted` ({name: [dtype, shape]}): {"sums": {name: [shape, sum, weighted]},
        "unchecked": why some could not be read}. An adapter vLLM does not hold (never added, or removed) gives no
        sums. Read from the adapter vLLM's LoRA manager registered (vllm/lora/model_manager.py:1374 get_adapter), whose
        lora_a / lora_b each active slot is copied from; vLLM folds the scale into lora_b (vllm/lora/lora_weights.py:37
        optimize), undone here where `scale` is a power of two (exact in floating point), else those are unchecked."""
        # vLLM's worker LoRA manager (set only when LoRA is enabled) and its model manager, which holds the adapters
        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if manager is not None and lora_id is None:
            lora_id = max(manager.list_adapters(), default=None)
        held = manager.get_adapter(lora_id) if manager is not None and lora_id is not None else None
        if manager is None or held is None:
            return {"sums": {}, "unchecked": ""}
        packed = manager.packed_modules  # {qkv_proj's full name: [q_proj's, k_proj's, v_proj's]}
        # the renames vLLM applied to the names when it loaded the adapter (vllm/lora/worker_manager.py:133)
        mapper = getattr(self.model_runner.get_model(), "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        exact = math.frexp(scale)[0] == 0.5
        sums, scaled = {}, []
        for name, (dtype, _shape) in wanted.items():
            t = adapter_tensor(held.loras, packed, name, mapper)
            if t is None:
                continue  # compared as missing: vLLM holds no such tensor
            if ".lora_B." in name:
                if not exact:
                    scaled.append(name)
                    continue
                t = t / scale
            s = tensor_sum(t, getattr(torch, dtype))
            sums[name] = [list(t.shape), s.sum, s.weighted]
        why = (f"vLLM keeps lora_B multiplied by the adapter's scale {scale}, not a power of two, so it cannot be "
               f"divided back exactly (e.g. {scaled[0]})") if scaled else ""
        return {"sums": sums, "unchecked": why}

    def loomrl_published(self, version: int) -> dict[str, list]:
        """The publisher's sums that followed broadcast version `version` to this worker ({name: [dtype, shape, sum,
        weighted]}); empty when none did (its handle carried them, or this worker received another version last)."""
        if _FOLLOWED.version != version:
            return {}
        return {n: [s.dtype, list(s.shape), s.sum, s.weighted] for n, s in _FOLLOWED.sums.items()}


def adapter_tensor(loras: dict[str, Any], packed: dict[str, list[str]], name: str,
                   mapper: Any = None) -> torch.Tensor | None:
    """The tensor vLLM's loaded adapter (`loras`: LoRAModel.loras, by module) holds for the published `name`, else
    None: under its module (o_proj), or its part of a packed module (q_proj in qkv_proj: `packed`, the manager's
    packed_modules, lists the parts in order)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    module, is_a = parse_fine_tuned_lora_name(name, mapper)
    layer = loras.get(module)
    if layer is not None:
        return layer.lora_a if is_a else layer.lora_b
    for whole, parts in packed.items():
        if module in parts and (layer := loras.get(whole)) is not None:
            return (layer.lora_a if is_a else layer.lora_b)[parts.index(module)]
    return None


def _owned(t: torch.Tensor, copy: bool) -> torch.Tensor:
    return t.clone() if copy else t


def readable(params: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...],
             fused: list | None) -> torch.Tensor | None:
    """The tensor of vLLM's parameters `params` that holds the published tensor `name` as published, else None. Under
    its own name: as it is, or with the rows past the published vocabulary cut (VocabParallelEmbedding pads it; they
    were never loaded). Fused (`fused`: [the fused parameter's name, the first row of this part, the rows of all
    parts], engine/vllm/engine.py fused_slot): q/k/v_proj stacked in qkv_proj, gate/up_proj in gate_up_proj, along dim 0 in
    that order; the part's rows, only where the fused parameter holds all parts whole (one tensor-parallel rank). Not
    readable: a shard of a tensor-parallel rank (another shape), a quantized one (another dtype: fp8 keeps o_proj.weight
    under its name, transposed) and a linear weight packed away on the CPU (the parameter is left empty)."""
    p = params.get(name)
    if p is None and fused is not None:
        whole, first, rows = fused[0], int(fused[1]), int(fused[2])
        p = params.get(whole)
        if p is None or p.dim() != len(shape) or p.dim() == 0 or p.shape[0] != rows or tuple(p.shape[1:]) != shape[1:]:
            return None
        p = p[first:first + shape[0]]
    elif p is not None and p.dim() == len(shape) > 0 and tuple(p.shape[1:]) == shape[1:] and p.shape[0] > shape[0]:
        p = p[: shape[0]]
    if p is None or tuple(p.shape) != shape or p.dtype != dtype:
        return None
    return p


class FirstFailure(logging.Handler):
    """Writes the first exception vLLM logs in this process (e.g. "WorkerProc hit an exception.", with the error a
    model step raised) to the file FAILURE_FILE names, as one line: "Type: message". Later ones are its consequences
    (the engine shutting down), so an existing file is kept; the adapter removes it after a failure it handled."""

    def emit(self, record: logging.LogRecord) -> None:
        path = os.environ.get(FAILURE_FILE)
        err = record.exc_info[1] if record.exc_info else None
        if not path or err is None or os.environ.get(FAILURE_FILE_OWNER) == str(os.getpid()):
            return
        draft = f"{path}.{os.getpid()}"
        try:
            with open(draft, "w") as f:
                f.write(named_line(err))
            os.link(draft, path)  # whole or not at all; FileExistsError: a failure is already recorded
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.unlink(draft)


if not any(isinstance(h, FirstFailure) for h in logging.getLogger("vllm").handlers):  # once per process
    logging.getLogger("vllm").addHandler(FirstFailure(logging.ERROR))  # vLLM's loggers propagate to "vllm"


if BACKEND not in WeightTransferEngineFactory._registry:  # imported once per worker; guard a second import
    WeightTransferEngineFactory.register_engine(BACKEND, InlineWeightEngine)
