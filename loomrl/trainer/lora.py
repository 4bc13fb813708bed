"""LoRA in the trainer through PEFT (trainer.lora): adapters on a frozen base model, the KL reference as that base with
the adapters switched off, the merged weights a version publishes, and the adapter's tensors a checkpoint holds.

What it is: `Lora` wraps the trainer's model with PEFT's `get_peft_model`, which puts a LoRA layer (base linear, A, B)
in place of each targeted linear of the model itself, so the trainer's forwards (dense, tree-merged, checkpointed)
run through the adapters unchanged. Only A and B require gradients, so the optimizer holds only them. KL's reference
is the same modules under PEFT's `disable_adapter`: no second copy of the base.

What it is not (yet): adapter-only publishing. A version is published as MERGED full weights of the targeted linears
(W + alpha / rank x B @ A, under the base model's parameter names; `MergedSource`), computed a bucket at a time
without touching the training model, so that every engine and the weight fingerprint work as with full fine-tuning;
sending only A and B to engines that apply adapters is the next part of issue 46. Nor FSDP2 (refused by the config),
nor an engine that shares the trainer's model (sync mode: refused by TrainerService), whose packed weights would never
see the adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loomrl.config.trainer import LoraConfig
from loomrl.model.adapter import ADAPTER, ADAPTER_WEIGHTS, quiet_peft
from loomrl.trainer.tree import decoder_layers
from loomrl.weights.source import TensorSpec, WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from loomrl.trainer.forward import Logprobs

INIT_SEED = 0  # the adapters' initial A, the same in every rank and run  # PEFT's file names: the folder is a PEFT adapter folder


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

    def __init__(self, model: PreTrainedModel, cfg: LoraConfig):
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from peft.tuners.lora import LoraLayer

        check_targets(model, cfg.target_modules)
        peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                  target_modules=sorted(set(cfg.target_modules)), bias="none")
        self.model = model
        device = next(model.parameters()).device
        # PEFT draws each A from torch's generator: from a fixed seed, so that data-parallel ranks (each its own
        # process and generator state) start from the same adapters, and so does every run
        with quiet_peft(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(INIT_SEED)
            self.peft = get_peft_model(model, peft_cfg, adapter_name=ADAPTER)  # marks only A and B trainable
        # module name in `model` (the base model's own names) -> its LoRA layer
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapters' parameters (every A and B): all that trains."""
        return [p for n, p in self.model.named_parameters() if "lora_" in n]

    def reference(self, forward: Logprobs) -> Logprobs:
        """`forward` with the adapters switched off: the base model's logprobs (KL's reference policy)."""
        def base_forward(batch, merged, entropy=None):
            with self.peft.disable_adapter():
                return forward(batch, merged, entropy)
        return base_forward

    def merged_weight(self, module: str) -> torch.Tensor:
        """W + scale x B @ A of the LoRA layer `module`, a new tensor (the layer is unchanged)."""
        layer = self.layers[module]
        with torch.no_grad():
            return layer.get_base_layer().weight + layer.get_delta_weight(ADAPTER)

    def merged_source(self, dtype: torch.dtype | None, bucket_bytes: int) -> MergedSource:
        """What a version publishes under LoRA: the targeted linears' merged weights, by the base model's names."""
        return MergedSource(self, dtype, bucket_bytes)

    def save(self, folder: Path) -> None:
        """The adapter as a PEFT adapter folder (its config and A, B tensors; no base weights)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        # save_embedding_layers=False: "auto" would look the base model up (on the Hub) to see if its vocab grew
        tensors = get_peft_model_state_dict(self.peft, adapter_name=ADAPTER, save_embedding_layers=False)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        self.peft.peft_config[ADAPTER].save_pretrained(str(folder))  # adapter_config.json

    def load(self, folder: Path) -> None:
        """The adapter's tensors from `save`'s folder, exactly (resume); an adapter of other layers or shapes is an
        error naming the first difference."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = folder / ADAPTER_WEIGHTS
        if not path.is_file():
            raise ValueError(f"checkpoint {folder.parent}: no LoRA adapter ({ADAPTER_WEIGHTS}) in {folder}; was it "
                             "saved with trainer.lora set?")
        tensors = load_file(str(path), device=str(self.parameters()[0].device))
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=ADAPTER)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"checkpoint {folder}: its adapter does not fit trainer.lora (missing: {missing[:3]}, "
                             f"unexpected: {list(result.unexpected_keys)[:3]}); resume with the lora settings it was "
                             "saved with")


class MergedSource(WeightSource):
    """The merged weights of a `Lora`'s layers, each computed as its bucket is asked for (no whole-model copy),
    cast to `dtype` (None: float32, the trainer's)."""

    def __init__(self, lora: Lora, dtype: torch.dtype | None, bucket_bytes: int):
        self.lora = lora
        self.names = {f"{module}.weight": module for module in sorted(lora.layers)}
        first = next(iter(lora.layers.values())).get_base_layer().weight
        specs = [TensorSpec(name, dtype or first.dtype, tuple(lora.layers[m].get_base_layer().weight.shape))
                 for name, m in self.names.items()]
        super().__init__(specs, bucket_bytes, first.device)

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for plan in self.plan():
            bucket = [(e.name, self.lora.merged_weight(self.names[e.name]).to(getattr(torch, e.dtype))) for e in plan]
            yield bucket
            bucket.clear()


def base_checkpoint(lora: LoraConfig | None, checkpoint: Path | None) -> Path | None:
    """The checkpoint the trainer's model weights load from: under LoRA none (the base comes from the model config, as
    at the start; the checkpoint holds the adapter, which `Lora.load` puts back), else `checkpoint`."""
    return None if lora is not None else checkpoint
