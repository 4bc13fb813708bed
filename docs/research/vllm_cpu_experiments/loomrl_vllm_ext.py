"""Imported inside vLLM's worker process (named by worker_extension_cls), which registers two CPU weight
transfer engines with vLLM's factory before the worker builds its engine (Worker.load_model):
- "loomrl_inline": the tensors ride in update_info itself (through collective_rpc's msgpack, zmq + shm)
- "loomrl_gloo":   a gloo process group between trainer (rank 0) and worker (rank 1); update_info carries
                   names/dtypes/shapes, the tensors arrive by broadcast.
Both load a bucket with model.load_weights inside vLLM's layerwise reload (start/finish), which re-runs
the CPU weight packing (oneDNN) that a plain param.copy_ would miss."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory


def _start(model):
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    initialize_layerwise_reload(model)


def _finish(model, model_config):
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    finalize_layerwise_reload(model, model_config)
    # A tied lm_head has no checkpoint weight of its own, so the layerwise reload never re-processes it and
    # its CPU GEMM keeps a packed copy of the OLD embedding: re-pack it (verified in exp4b).
    lm = getattr(model, "lm_head", None)
    if lm is not None and getattr(model_config.hf_config, "tie_word_embeddings", False):
        lm.quant_method.process_weights_after_loading(lm)


@dataclass
class InlineInit(WeightTransferInitInfo):
    pass


@dataclass
class InlineUpdate(WeightTransferUpdateInfo):
    # raw bytes: AsyncLLM -> EngineCore is msgpack, and utility-call args are decoded untyped, so a
    # torch.Tensor arrives as a [dtype, shape, data] list; bytes/memoryview arrive as bytes.
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    blobs: list = field(default_factory=list)


def to_wire(named):
    """[(name, tensor)] -> the InlineUpdate dict (no copy: memoryviews over the tensors)."""
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "blobs": [t.detach().contiguous().view(-1).view(torch.uint8).numpy().data for _, t in named]}


def from_wire(u):
    return [(n, torch.frombuffer(bytearray(b), dtype=getattr(torch, d)).view(s))
            for n, d, s, b in zip(u.names, u.dtype_names, u.shapes, u.blobs)]


class InlineCPUEngine(WeightTransferEngine[InlineInit, InlineUpdate]):
    init_info_cls = InlineInit
    update_info_cls = InlineUpdate

    def init_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        _start(self.model)

    def update_weights(self, update_info):  # base calls torch.accelerator.synchronize(); nothing to sync on CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, u):
        self.model.load_weights(from_wire(u))

    def finish_weight_update(self):
        _finish(self.model, self.model_config)

    def shutdown(self):
        pass


@dataclass
class GlooInit(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int = 2
    rank_offset: int = 1


@dataclass
class GlooUpdate(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def gloo_group(host, port, rank, world_size):
    store = torch.distributed.TCPStore(host, port, world_size, is_master=(rank == 0),
                                       timeout=timedelta(seconds=120))
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=120))


class GlooCPUEngine(WeightTransferEngine[GlooInit, GlooUpdate]):
    init_info_cls = GlooInit
    update_info_cls = GlooUpdate
    pg = None

    def init_transfer_engine(self, init_info):
        self.pg = gloo_group(init_info.host, init_info.port, init_info.rank_offset, init_info.world_size)

    def start_weight_update(self):
        _start(self.model)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, u):
        bufs = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(u.dtype_names, u.shapes)]
        for b in bufs:
            self.pg.broadcast([b], torch.distributed.BroadcastOptions()).wait()  # root 0 = the trainer
        self.model.load_weights(list(zip(u.names, bufs)))

    def finish_weight_update(self):
        _finish(self.model, self.model_config)

    def shutdown(self):
        self.pg = None


for _name, _cls in (("loomrl_inline", InlineCPUEngine), ("loomrl_gloo", GlooCPUEngine)):
    if _name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(_name, _cls)


class WorkerExt:
    """Extra methods on vLLM's worker, reached with collective_rpc("name", args=...)."""

    def loomrl_naive_load(self, wire):
        """model.load_weights outside layerwise reload (what NOT to do on CPU)."""
        self.model_runner.model.load_weights(weights=from_wire(InlineUpdate(**wire)))
        return "ok"

    def loomrl_reload(self, wire):
        """Worker.reload_weights (layerwise reload inside) from tensors sent as bytes."""
        self.reload_weights(weights_iterator=from_wire(InlineUpdate(**wire)))
        return "ok"

    def loomrl_param_checksum(self, name):
        p = self.model_runner.model.get_parameter(name)
        return [tuple(p.shape), float(p.float().sum()) if p.numel() else None]

    def loomrl_tie_state(self):
        m = self.model_runner.model
        return {"same_param": m.lm_head.weight is m.model.embed_tokens.weight,
                "same_storage": m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()}

    def loomrl_repack_lm_head(self):
        """Re-run the CPU GEMM packing of a tied lm_head (its packed copy of the embedding goes stale when
        only embed_tokens.weight is reloaded: a tied checkpoint has no lm_head.weight to trigger it)."""
        lm = self.model_runner.model.lm_head
        lm.quant_method.process_weights_after_loading(lm)
        return "ok"
