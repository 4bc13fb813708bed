"""FSDP2 sharding of a trainer's model (trainer.parallel=fsdp): the parameters, gradients and AdamW state split
over the ranks of the default process group. The rank group around it is train_pool/ranks.py; the shared plan of
micro-batches every rank runs is the Trainer's (trainer.py, `shared_plan`); checkpoints of the optimizer state
in parts are here too. Nothing here reads the run's config (scripts/gpu_smoke.py uses it as it is), and nothing here
imports the Trainer (trainer.py imports this module): the optimizer checkpoints take any object with a sharded forward
and an optimizer (`ShardedState`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from loomrl.trainer.forward import Logprobs, logprobs_of
from loomrl.trainer.head import Entropies
from loomrl.trainer.tree import decoder_layers
from loomrl.types import TrainingSample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ShardedState(Protocol):
    """What the optimizer checkpoints read of a sharded trainer (trainer.py Trainer(shard=fsdp_shard))."""

    @property
    def forward(self) -> Logprobs:
        """The FSDP root module fsdp_shard returned."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over its sharded parameters."""
        ...


class _ShardedForward(torch.nn.Module):
    """The micro-batch forward as the module FSDP shards at its root: the embeddings, the final norm and
    the head belong to this root (each decoder layer is a unit of its own), so they are gathered for
    the whole forward, which reads the head's weight directly (trainer/head.py), and their gradients
    are reduced after its backward."""

    def __init__(self, model: PreTrainedModel, flex: bool):
        super().__init__()
        self.model, self.flex = model, flex

    def forward(self, batch: list[TrainingSample], merged: bool,
                entropy: Entropies | None = None) -> list[torch.Tensor]:
        # clones, not split views: FSDP hooks its pre-backward into the outputs, which an in-place op on a
        # view would drop (the entropies, detached, need no hook)
        return [lp.clone() for lp in logprobs_of(self.model, batch, merged, with_grad=torch.is_grad_enabled(),
                                               flex=self.flex, entropy=entropy)]


@contextmanager
def whole_for_pass(root: Logprobs, padding: list[TrainingSample]) -> Generator[None, None, None]:
    """Run a pass whose forwards and backwards differ in number and order between the ranks (the depth-first tree
    pass: each rank's trie is its own), which FSDP's per-unit all-gathers and reduce-scatters cannot follow. Every
    unit is gathered once, on entry (the same all-gathers on every rank; through a no-grad forward of `padding`, a
    micro-batch that trains nothing, since FSDP wants its root to run before any unit), and stays whole through
    the pass, with gradient sync off: its gradients accumulate unsharded on this rank and no forward or backward in
    the pass communicates. On exit, `padding` through the root again with sync back on: its backward
    reduce-scatters the accumulated gradients, the same collectives on every rank.
    The cost: through the pass each rank holds the whole parameters (in the gather dtype) and whole float32
    gradients, as DDP would; the float32 masters and the AdamW state stay sharded."""
    if not isinstance(root, FSDPModule) or not isinstance(root, torch.nn.Module):
        raise TypeError("whole_for_pass: the forward is not a module sharded by fsdp_shard")
    switches = (root.set_requires_gradient_sync, root.set_reshard_after_forward, root.set_reshard_after_backward)
    for switch in switches:
        switch(False)  # recursive: every unit
    with torch.no_grad():
        root(padding, False)
    for unit in root.modules():  # a no-op for every unit that forward gathered
        if isinstance(unit, FSDPModule):
            unit.unshard()
    try:
        yield
    finally:
        for switch in switches:
            switch(True)
    (root(padding, False)[0].sum() * 0.0).backward()


def save_sharded_optimizer(trainer: ShardedState, folder: Path) -> None:
    """This rank's part of the AdamW state into `folder` (every rank calls it: a collective)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    save(get_optimizer_state_dict(_sharded_root(trainer), trainer.optimizer), checkpoint_id=str(folder))


def load_sharded_optimizer(trainer: ShardedState, folder: Path) -> None:
    """This rank's part of the AdamW state from `folder` (every rank calls it; any world size can read it)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    root = _sharded_root(trainer)
    state = get_optimizer_state_dict(root, trainer.optimizer)
    load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(root, trainer.optimizer, state)


def _sharded_root(trainer: ShardedState) -> torch.nn.Module:
    """The trainer's forward, which a sharded trainer (Trainer(shard=fsdp_shard)) holds as the FSDP root module."""
    if not isinstance(trainer.forward, torch.nn.Module):
        raise TypeError("the trainer's forward is not a module sharded by fsdp_shard (a trainer without shard=)")
    return trainer.forward


def fsdp_shard(model: PreTrainedModel, param_dtype: torch.dtype | None = None, *, flex: bool = False,
               offload: bool = False, device: torch.device | None = None) -> Logprobs:
    """Shard `model` over the default process group with FSDP2 (fully_shard): every decoder layer a
    unit, the rest at the root. Gradients are summed over the ranks, not averaged: the loss of each rank
    already uses the step's global denominators. The sharded parameters stay float32; `param_dtype`
    (bfloat16 under trainer.precision=bfloat16) is what each unit is gathered in for its forward and
    backward, so that autocast has no float32 weights to cast (its cast cache would hold a bf16 copy of
    every layer until the forward ends). Gradients are reduced in float32. `flex`: tree attention through
    FlexAttention; `offload`: the shards live in host memory, copied to the device unit by unit (the frozen KL
    reference: trainer.kl_reference_offload), pinned when the compute `device` is a GPU (default: the parameters'
    device, which is meta for a model loaded from rank 0, rank0_load.py). Returns the sharded forward
    (Trainer(shard=))."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    device = device if device is not None else next(model.parameters()).device
    where = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()  # fully_shard's default
    units = [fully_shard(layer, mp_policy=policy, offload_policy=where) for layer in decoder_layers(model)]
    root = _ShardedForward(model, flex)
    units.append(fully_shard(root, mp_policy=policy, offload_policy=where))  # in place: `root` is what it returns
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return root
