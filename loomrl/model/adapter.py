"""A LoRA adapter folder as a checkpoint holds it (PEFT's layout: adapter_model.safetensors + adapter_config.json), and
the model an engine serves from one: the base with the adapter merged in.

What it is not: training LoRA (loomrl/trainer/lora.py wraps the trainer's model and writes these folders) or sending
adapters to engines.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER = "default"  # PEFT's name for the one adapter a trainer trains
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@contextlib.contextmanager
def quiet_peft() -> Generator[None, None, None]:
    """PEFT 0.21 asks transformers 5.25 `is_gradient_checkpointing`, a name it deprecates: a warning per wrap, not ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def is_adapter_folder(folder: Path) -> bool:
    """Whether a checkpoint's model folder holds a LoRA adapter (trainer/lora.py `Lora.save`) rather than a model."""
    return (folder / ADAPTER_WEIGHTS).is_file()


def merge_adapter(base: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """`base` with the adapter of `folder` merged into its weights, as the engines serve it: for a model loaded from a
    LoRA run's checkpoint (eval, serve, a resumed run's engine). Pass the base in float32 and cast after, so that the
    weights round once, as a published version's do."""
    from peft import PeftModel

    with quiet_peft():
        return PeftModel.from_pretrained(base, str(folder), adapter_name=ADAPTER).merge_and_unload()
