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


def adapter_tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor of `folder`'s adapter file by its module path in the base model (PEFT's saved name less the
    `base_model.model.` prefix, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight`) -> its shape, read from the
    file's header (no tensor is loaded)."""
    from safetensors import safe_open

    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
        return {k.removeprefix("base_model.model."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def adapter_modules(folder: Path) -> set[str]:
    """The base model's modules `folder`'s adapter holds tensors for: its LoRA targets (and any module it saves whole,
    PEFT's modules_to_save), the modules whose weights differ from the base's once it is merged."""
    return {name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0]
            for name in adapter_tensor_shapes(folder)}


def check_adapter_fits(base: PreTrainedModel, folder: Path) -> set[str]:
    """adapter_modules of `folder` after checking that each is a module of `base` of the shapes its tensors need (a
    Linear's: lora_A [r, in_features], lora_B [out_features, r]); ValueError naming the folder and the first
    mismatch otherwise (an adapter trained on another base model)."""
    import json

    import torch

    config = json.loads((folder / "adapter_config.json").read_text())
    named = config.get("base_model_name_or_path")
    made_for = f"(its adapter_config.json names base model {named!r})" if named else "(its config names no base model)"
    modules = dict(base.named_modules())
    for name, shape in sorted(adapter_tensor_shapes(folder).items()):
        path = name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0]
        module = modules.get(path)
        if module is None:
            raise ValueError(f"adapter folder {folder}: its tensor {name} is for module {path}, which the base model "
                             f"({type(base).__name__}) does not have: the adapter was made for another model {made_for}")
        if not isinstance(module, torch.nn.Linear) or ".lora_" not in name:
            continue
        want = {"lora_A": (shape[0], module.in_features), "lora_B": (module.out_features, shape[-1])}
        part = name.split(".lora_")[1].split(".")[0]
        expected = want.get(f"lora_{part}")
        if expected is not None and shape != expected:
            raise ValueError(f"adapter folder {folder}: {name} has shape {list(shape)}, but {path} of the base model "
                             f"takes {module.in_features} inputs to {module.out_features} outputs (expected "
                             f"{list(expected)}): the adapter was made for another model {made_for}")
    return adapter_modules(folder)


def shared_adapter_model(base: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """`base` with `folder`'s adapter merged, as merge_adapter gives it, but sharing every tensor the adapter does not
    change: only the modules it holds tensors for (adapter_modules) are copied and merged, every other parameter and
    buffer IS base's (the same storage), so that one process serves several adapters over one base model for the
    price of their targeted linears. `base` is left as it was. The copies merge in float32 and are cast to base's
    dtype after (one rounding, as merge_adapter's). ValueError (check_adapter_fits) for an adapter of another model."""
    import copy

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    own = check_adapter_fits(base, folder)
    copied = {id(t) for path in own for m in [base.get_submodule(path)] for t in (*m.parameters(), *m.buffers())}
    # deepcopy takes what its memo already holds as the copy: those tensors are shared, not copied
    memo: dict[int, object] = {id(t): t for t in (*base.parameters(), *base.buffers()) if id(t) not in copied}
    model = copy.deepcopy(base, memo)
    grad = [(t, t.requires_grad) for t in base.parameters()]  # PEFT freezes every base parameter: shared, base's too
    for path in own:
        model.get_submodule(path).float()
    try:
        with quiet_peft():
            peft = PeftModel.from_pretrained(model, str(folder), adapter_name=ADAPTER)
        # a module its target_modules match but its file has no tensors for would be merged into base's own storage
        wrapped = {n.removeprefix("base_model.model.") for n, m in peft.named_modules() if isinstance(m, LoraLayer)}
        if stray := sorted(wrapped - own):
            raise ValueError(f"adapter folder {folder}: its target_modules match {stray[0]} of the base model "
                             f"({len(stray)} such modules), for which it holds no tensors: it was made for another model")
        with quiet_peft():
            merged = peft.merge_and_unload()
    finally:
        for t, flag in grad:
            t.requires_grad_(flag)
    dtype = next(base.parameters()).dtype
    for path in own:
        merged.get_submodule(path).to(dtype)
    return merged


def shared_parameters(base: PreTrainedModel, other: PreTrainedModel) -> set[str]:
    """The names of `other`'s parameters that are `base`'s own tensor of that name (the same storage)."""
    mine = dict(base.named_parameters(remove_duplicate=False))
    return {n for n, p in other.named_parameters(remove_duplicate=False)
            if n in mine and p.data_ptr() == mine[n].data_ptr()}
