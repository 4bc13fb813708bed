"""LoRA in the trainer through PEFT (trainer.lora): adapters on a frozen base model, the KL reference as that base with
the adapters switched off, the merged weights a version publishes, and the adapter's tensors a checkpoint holds.

What it is: `Lora` wraps the trainer's model with PEFT's `get_peft_model`, which puts a LoRA layer (base linear, A, B)
in place of each targeted linear of the model itself, so the trainer's forwards (dense, tree-merged, checkpointed)
run through the adapters unchanged. Only A and B require gradients, so the optimizer holds only them. KL's reference
is the same modules under PEFT's `disable_adapter`: no second copy of the base.

Merged publishing: the MERGED full weights of the targeted linears (W + alpha / rank x B @ A, under the base model's
parameter names; `MergedSource`), computed a bucket at a time without touching the training model, so that every
engine and the weight fingerprint work as with full fine-tuning. `adapter_source`: the adapter's own tensors under
PEFT's saved names (what a checkpoint holds, and what adapter publishing sends).

Under FSDP2 (trainer.parallel=fsdp; trainer/fsdp.py shards the model after PEFT has put its layers in) every parameter,
the frozen base's and the adapters', is a DTensor shard: the whole tensors exist only gathered, by every rank at once.
DataParallelTrainer (on rank 0 of a rank group, RankGroup) hands the Lora a `Gathering` (train_pool/distributed.py
LoraGathering) through which the merged weights and the adapter are read a bucket at a time, every rank taking part,
rank 0 keeping them; `load` puts a saved adapter back into each rank's shards without a collective (every rank reads
the file).

What it is not: an engine that shares the trainer's model (sync mode: refused by TrainerService), whose packed weights
would never see the adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from loomrl.config.trainer import LoraConfig
from loomrl.model.adapter import ADAPTER, ADAPTER_WEIGHTS, quiet_peft
from loomrl.trainer.tree import decoder_layers
from loomrl.weights.source import DictSource, TensorSpec, WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from loomrl.trainer.forward import Logprobs

INIT_SEED = 0  # the adapters' initial A, the same in every rank and run
SAVE_BUCKET_BYTES = 256 << 20  # a sharded adapter is gathered for its checkpoint this much at a time


class Gathering(Protocol):
    """How the whole tensors of a sharded model are read (train_pool/distributed.py LoraGathering): each source is a
    collective, read to the end by every rank in the same order; the tensors of a rank that does not `keep` are
    empty."""

    @property
    def keep(self) -> bool:
        """Whether this rank's sources hold the whole tensors (rank 0)."""
        ...

    def adapter(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        """Every A and B, whole, by its parameter name in the model (None: float32, the trainer's)."""
        ...

    def merged(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        """The targeted linears' merged weights (Lora.merge of the whole W, A, B), by the base model's names."""
        ...


def linear_names(model: PreTrainedModel) -> list[str]:
    """The last part of the name of each linear layer inside the model's decoder layers (sorted, each once)."""
    return sorted({n.rsplit(".", 1)[-1] for layer in decoder_layers(model) for n, m in layer.named_modules()
                   if isinstance(m, torch.nn.Linear)})


def check_targets(model: PreTrainedModel, targets: list[str]) -> None:
    """Every trainer.lora.target_modules name is a linear layer of the model's decoder layers (PEFT alone would skip a
    misspelt one silently when another matches)."""
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {', '.join(missing)} not in this model "
                         f"({type(model).__name__}); its decoder layers' linear layers are: {', '.join(have)}")


class Lora:
    """A model's LoRA adapters: built on `model` in place (its targeted linears become PEFT LoRA layers)."""

    def __init__(self, model: PreTrainedModel, cfg: LoraConfig, skip_layers: int = 0):
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model, get_peft_model_state_dict
        from peft.tuners.lora import LoraLayer

        check_targets(model, cfg.target_modules)
        n_layers = len(decoder_layers(model))
        if skip_layers >= n_layers:
            raise ValueError(f"trainer.freeze_layers={skip_layers} under trainer.lora leaves no layer for adapters: "
                             f"the model has {n_layers} decoder layers")
        # trainer.freeze_layers under LoRA: no adapters in the bottom blocks, so the backward stops above them as it
        # does for full fine-tuning (PEFT's layers_to_transform; None: every layer)
        peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                  target_modules=sorted(set(cfg.target_modules)), bias="none",
                                  layers_to_transform=list(range(skip_layers, n_layers)) if skip_layers else None)
        self.model = model
        device = next(model.parameters()).device
        # PEFT draws each A from torch's generator: from a fixed seed, so that data-parallel ranks (each its own
        # process and generator state) start from the same adapters, and so does every run
        with quiet_peft(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.peft = get_peft_model(model, peft_cfg, adapter_name=ADAPTER)  # marks only A and B trainable
            # module name in `model` (the base model's own names) -> its LoRA layer
            self.layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
            # drawn again, in float32: PEFT draws A in the base's dtype before casting it up, so a bfloat16 base (FSDP2
            # rank 0 reads one so: model/loader.py stored_dtype) would start from rounded adapters unlike a float32
            # one; a skeleton's (meta) draw is a no-op
            torch.manual_seed(INIT_SEED)
            for layer in self.layers.values():
                layer.reset_lora_parameters(ADAPTER, True)
        # each adapter parameter's name in `model` -> its name in a PEFT adapter file, as PEFT itself renames them
        # (the values passed through are the names: PEFT only filters and renames the state dict's keys)
        own = {f"base_model.model.{n}": n for n, _ in self._own()}
        self.saved_names = {n: saved for saved, n in get_peft_model_state_dict(
            self.peft, state_dict=own, adapter_name=ADAPTER, save_embedding_layers=False).items()}
        self.gathering: Gathering | None = None  # sharded: set by train_pool (DataParallelTrainer, RankGroup)

    def _own(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if "lora_" in n]

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapters' parameters (every A and B): all that trains."""
        return [p for _, p in self._own()]

    def reference(self, forward: Logprobs) -> Logprobs:
        """`forward` with the adapters switched off: the base model's logprobs (KL's reference policy)."""
        def base_forward(batch, merged, entropy=None):
            with self.peft.disable_adapter():
                return forward(batch, merged, entropy)
        return base_forward

    def merge(self, module: str, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """W + scale x B @ A for the LoRA layer `module`, from whole tensors (PEFT's get_delta_weight, written out so
        that gathered tensors merge by the same arithmetic as the layer's own)."""
        from peft.utils.other import transpose

        layer = self.layers[module]
        return weight + transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER]

    def published(self) -> dict[str, tuple[str, str]]:
        """What a merged version publishes, by the base model's names: {name: (module, "weight" | "bias")}: every
        targeted linear's merged weight, and its bias where it has one (unchanged by LoRA, sent all the same: vLLM
        reloads a fused layer given only some of its tensors by rebuilding it, and a bias it was not sent may then come
        back as uninitialised memory; Qwen2's q/k/v have biases)."""
        out = {f"{m}.weight": (m, "weight") for m in sorted(self.layers)}
        out |= {f"{m}.bias": (m, "bias") for m in sorted(self.layers) if self.layers[m].get_base_layer().bias is not None}
        return dict(sorted(out.items()))

    def base_tensor(self, module: str, kind: str) -> torch.Tensor:
        """The base layer's `weight` or `bias` of the LoRA layer `module` (sharded under FSDP2)."""
        base = self.layers[module].get_base_layer()
        tensor = base.weight if kind == "weight" else base.bias
        assert tensor is not None, f"{module} has no {kind}: published() lists only what is there"
        return tensor

    def merged_weight(self, module: str) -> torch.Tensor:
        """W + scale x B @ A of the LoRA layer `module`, a new tensor (the layer is unchanged; not sharded)."""
        layer = self.layers[module]
        with torch.no_grad():
            return self.merge(module, layer.get_base_layer().weight, layer.lora_A[ADAPTER].weight,
                              layer.lora_B[ADAPTER].weight)

    def merged_source(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        """What a version publishes under LoRA: the targeted linears' merged weights, by the base model's names
        (sharded: gathered by every rank, `Gathering.merged`)."""
        if self.gathering is not None:
            return self.gathering.merged(dtype, bucket_bytes)
        return MergedSource(self, dtype, bucket_bytes)

    def adapter_source(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        """The adapter's tensors (every A and B) under PEFT's saved names (`saved_names`), in `dtype` (None: float32),
        a bucket at a time; sharded, gathered by every rank (`Gathering.adapter`: each must read it to the end)."""
        if self.gathering is not None:
            source = self.gathering.adapter(dtype, bucket_bytes)
        else:
            source = DictSource({n: p.detach() for n, p in self._own()}, dtype, bucket_bytes)
        return _Renamed(source, self.saved_names)

    def save(self, folder: Path) -> None:
        """The adapter as a PEFT adapter folder (its config and A, B tensors; no base weights). Sharded: a collective
        (every rank gathers, `Gathering`), and only the rank that keeps the tensors writes."""
        from safetensors.torch import save_file

        tensors = {n: t.to("cpu", copy=True) for bucket in self.adapter_source(None, SAVE_BUCKET_BYTES).buckets()
                   for n, t in bucket}
        if self.gathering is not None and not self.gathering.keep:
            return
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        self.peft.peft_config[ADAPTER].save_pretrained(str(folder))  # adapter_config.json

    def load(self, folder: Path) -> None:
        """The adapter's tensors from `save`'s folder, exactly (resume); an adapter of other layers or shapes is an
        error naming the first difference. Sharded: each rank reads the file and keeps its shards (no collective)."""
        from safetensors.torch import load_file

        path = folder / ADAPTER_WEIGHTS
        if not path.is_file():
            raise ValueError(f"checkpoint {folder.parent}: no LoRA adapter ({ADAPTER_WEIGHTS}) in {folder}; was it "
                             "saved with trainer.lora set?")
        own = dict(self._own())
        tensors = load_file(str(path), device=str(next(iter(own.values())).device))
        by_saved = {saved: n for n, saved in self.saved_names.items()}
        missing = sorted(set(by_saved) - set(tensors))
        unexpected = sorted(set(tensors) - set(by_saved))
        wrong = [n for n, t in tensors.items() if n in by_saved and tuple(t.shape) != tuple(own[by_saved[n]].shape)]
        if missing or unexpected or wrong:
            raise ValueError(f"checkpoint {folder}: its adapter does not fit trainer.lora (missing: {missing[:3]}, "
                             f"unexpected: {unexpected[:3]}, other shapes: {wrong[:3]}); resume with the lora settings "
                             "it was saved with")
        with torch.no_grad():
            for saved, t in tensors.items():
                p = own[by_saved[saved]]
                # a shard's part of the whole tensor, cut locally (src_data_rank=None: no scatter from rank 0)
                p.copy_(distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
                        if isinstance(p, DTensor) else t)


class _Renamed(WeightSource):
    """`source`'s tensors under other names (`names`: its name -> the published one), in its order and buckets."""

    def __init__(self, source: WeightSource, names: dict[str, str]):
        super().__init__([TensorSpec(names[s.name], s.dtype, s.shape) for s in source.specs], source.bucket_bytes,
                         source.device)
        self.source, self.names = source, names

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self.source.buckets():
            renamed = [(self.names[n], t) for n, t in bucket]
            yield renamed
            renamed.clear()


class MergedSource(WeightSource):
    """The merged weights of a `Lora`'s layers, each computed as its bucket is asked for (no whole-model copy),
    cast to `dtype` (None: float32, the trainer's)."""

    def __init__(self, lora: Lora, dtype: torch.dtype | None, bucket_bytes: int):
        self.lora = lora
        self.names = lora.published()
        first = next(iter(lora.layers.values())).get_base_layer().weight
        specs = [TensorSpec(name, dtype or first.dtype, tuple(lora.base_tensor(m, kind).shape))
                 for name, (m, kind) in self.names.items()]
        super().__init__(specs, bucket_bytes, first.device)

    def _tensor(self, name: str) -> torch.Tensor:
        module, kind = self.names[name]
        if kind == "weight":
            return self.lora.merged_weight(module)
        return self.lora.base_tensor(module, kind).detach()

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for plan in self.plan():
            bucket = [(e.name, self._tensor(e.name).to(getattr(torch, e.dtype))) for e in plan]
            yield bucket
            bucket.clear()


def base_checkpoint(lora: LoraConfig | None, checkpoint: Path | None) -> Path | None:
    """The checkpoint the trainer's model weights load from: under LoRA none (the base comes from the model config, as
    at the start; the checkpoint holds the adapter, which `Lora.load` puts back), else `checkpoint`."""
    return None if lora is not None else checkpoint
