"""Filling a model that FSDP2 sharded while it had no weights from rank 0's whole state (trainer.parallel=fsdp over
more than one rank: model/loader.py loads_from_rank0), the way torchtitan, verl and prime-rl start a large model.

Why: a rank that loads the whole model onto its device before sharding it needs the whole model's float32 bytes there
(Qwen3-30B-A3B: 122 GB on an 80 GB GPU). Instead rank 0 loads it on the CPU and every other rank builds the skeleton on
the meta device (model/loader.py load_rank_model; rank 0 in the precision the checkpoint stores: a bfloat16 model in
half the host memory); the Trainer puts the same structure on both (frozen layers, PEFT's LoRA layers), then
`take_whole_state` moves rank 0's tensors out of the model (the model is meta, in float32, on every rank after it),
fsdp.py shards the meta model, and `fill_from_rank0` allocates each rank's shards (`to_empty`) and fills them from rank
0's state through torch's set_model_state_dict (broadcast_from_rank0: one whole tensor at a time, each rank keeping its
float32 shard: copy_ casts a bfloat16 tensor exactly). Adapters too: rank 0's freshly drawn A and B are what every rank
ends with.

Non-persistent buffers are in no state dict, and `to_empty` leaves them uninitialised: `rebuild_buffers` computes them
again. Known: transformers' rotary embeddings (every *RotaryEmbedding with `rope_type` and `config`: inv_freq and
original_inv_freq from the config, as transformers' own `_init_weights` does after its meta-device load; Llama, Qwen2,
Qwen3 and Qwen3-MoE have no other). Any other non-persistent buffer is refused, naming it: never left as garbage.

What it is not: the sharding (fsdp.py) or reading a checkpoint (model/loader.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ROTARY_BUFFERS = frozenset({"inv_freq", "original_inv_freq"})


def on_meta(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of `model` is a meta tensor (no storage)."""
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def take_whole_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Rank 0: `model`'s whole state dict (its own tensors, no copy, in the precision they were read in), `model` then
    moved to the meta device in float32, so that the tensors live only in the returned dict. Another rank: `model` must be on meta already; an empty dict."""
    rank = dist.get_rank()
    if rank != 0:
        if not on_meta(model):
            raise ValueError(f"trainer rank {rank}: its model holds weights; under loading from rank 0 every rank but "
                             "0 builds the skeleton (model/loader.py load_rank_model)")
        return {}
    whole = dict(model.state_dict())  # detached views of the model's storage: they keep it once the model lets go
    _to_meta(model)
    # rank 0 read a bfloat16 model in bfloat16 (model/loader.py stored_dtype); from here it is float32, as every
    # other rank's skeleton is, and so is what a checkpoint's config.json says of the float32 tensors it holds
    model.config.dtype = torch.float32
    for key in model.config.sub_configs:  # as from_pretrained set them: each sub-config's too (a VLM's text config)
        if (sub := getattr(model.config, key)) is not None:
            sub.dtype = torch.float32
    return whole


def _to_meta(model: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` replaced by a meta tensor of its shape, tied parameters staying one
    Parameter (Module.to("meta") makes a new Parameter per module that holds one: the LM head would come untied from
    the embeddings on this rank alone, and FSDP's units would differ between the ranks)."""
    old = list(model.parameters())  # alive through the pass, so no id below is reused
    metas = {id(p): torch.nn.Parameter(_meta(p), requires_grad=p.requires_grad) for p in old}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = metas[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = _meta(b)
    del old


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s shape: float32 when `t` is floating (the trainer's masters), else `t`'s dtype."""
    return torch.empty_like(t, device="meta", dtype=torch.float32 if t.is_floating_point() else t.dtype)


def fill_from_rank0(model: torch.nn.Module, whole: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate the shards of `model` (sharded by fsdp.py while on meta) on `device` and fill them from rank 0's
    `whole` state (other ranks pass {}); its non-persistent buffers rebuilt (`rebuild_buffers`). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rebuildable(model)  # refuse before anything is allocated
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(whole), options=options)  # a copy: torch writes the shards into the dict it gets
    rebuild_buffers(model)


def copy_shards(source: torch.nn.Module, target: torch.nn.Module, device: torch.device,
                buffers_on: torch.device | None = None) -> None:
    """Allocate `target`'s shards on `device` (the CPU for an offloaded KL reference) and copy `source`'s into them:
    two modules of one structure sharded alike (the KL reference from the policy's shards: no collective, no whole
    tensor). Non-persistent buffers rebuilt. `buffers_on`: where the buffers then go (the compute device when the
    shards are offloaded: FSDP's CPU offload moves parameters only, and a buffer a forward uses in place, like some MoE
    routers' correction bias, must be on the device its inputs are on)."""
    rebuildable(target)
    target.to_empty(device=device)
    theirs = dict(source.named_parameters())
    with torch.no_grad():
        for name, p in target.named_parameters():
            q = theirs[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(q.to_local() if isinstance(q, DTensor) else q)
        persistent = {n: b for n, b in source.named_buffers() if not _non_persistent(source, n)}
        for name, b in target.named_buffers():
            if name in persistent:
                b.copy_(persistent[name])
    rebuild_buffers(target)
    if buffers_on is not None and buffers_on != device:
        for module in target.modules():
            for name, b in module.named_buffers(recurse=False):
                module._buffers[name] = b.to(buffers_on)


def _non_persistent(model: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(owner)._non_persistent_buffers_set


def _non_persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, set[str]]]:
    return [(name, m, {b for b in m._non_persistent_buffers_set if m._buffers.get(b) is not None})
            for name, m in model.named_modules() if m._non_persistent_buffers_set]


def _rope_function(module: torch.nn.Module):
    """The function transformers computes this rotary module's inverse frequencies with, or None."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # a transformers module (not one of ours): its rotary classes are named *RotaryEmbedding and keep their config
    if "RotaryEmbedding" not in type(module).__name__ or getattr(module, "config", None) is None:
        return None
    kind = getattr(module, "rope_type", None)
    if not isinstance(kind, str):
        return None
    return getattr(module, f"compute_{kind}_rope_parameters", None) or ROPE_INIT_FUNCTIONS.get(kind)


def rebuildable(model: torch.nn.Module) -> None:
    """Refuse a model with a non-persistent buffer `rebuild_buffers` does not know how to compute (one line naming it)."""
    for name, module, buffers in _non_persistent_buffers(model):
        if buffers and (_rope_function(module) is None or not buffers <= ROTARY_BUFFERS):
            raise ValueError(f"loading from rank 0: {name or 'the model'} ({type(module).__name__}) has non-persistent "
                             f"buffers {sorted(buffers)} that loomrl cannot rebuild after a meta-device load "
                             "(trainer/rank0_load.py knows rotary embeddings only); set trainer.world_size=1 or "
                             "trainer.parallel=ddp for this model")


def rebuild_buffers(model: torch.nn.Module) -> None:
    """Every non-persistent buffer of `model` computed again in place: each rotary embedding's inv_freq and
    original_inv_freq from its config, on the CPU (as at construction), copied to where the buffer is."""
    rebuildable(model)
    for _, module, buffers in _non_persistent_buffers(model):
        rope = _rope_function(module)
        if not buffers or rope is None:
            continue
        inv_freq, _ = rope(module.config)  # the scaling is a plain attribute, which to_empty left as it was
        with torch.no_grad():
            for b in buffers:  # present: _non_persistent_buffers lists only buffers that are not None
                buffer = module._buffers[b]
                assert buffer is not None
                buffer.copy_(inv_freq)
