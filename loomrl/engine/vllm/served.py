"""The model an in-process vLLM serves (engine/vllm/engine.py): the folder it loads, the names and shapes the trainer
sends, and its fingerprint as vLLM's worker reads it (with where vLLM keeps a published tensor it fuses).

What it is not: a loader (vLLM reads the folder itself) and nothing here imports vLLM.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.engine.vllm.weights import parameter_shapes
from loomrl.model.loader import ModelLoadError
from loomrl.weights.fingerprint import Fingerprint, TensorSum


@dataclass(slots=True, kw_only=True)
class ServedModel:
    """What the adapter needs to know of the model vLLM serves."""

    folder: Path  # the Hugging Face folder vLLM loads (config, weights, tokenizer)
    name: str  # what error messages call it: the folder, or the architecture saved to a temporary one
    shapes: dict[str, tuple[int, ...]]  # parameter names as the trainer sends them -> shapes
    aliases: frozenset[str]  # names that are another parameter (a tied lm_head.weight): dropped from updates
    owned: bool = False  # a temporary folder the engine removes when it closes


def served_model(model: Any, tokenizer: Any, build: Callable[[], Any] | None = None) -> ServedModel:
    """The folder `model` was loaded from when it holds its weights, else a temporary one `model` and `tokenizer`
    are saved into (a tiny model built from a config); names and shapes from its parameters. `model` may be a
    meta-device skeleton (model/loader.py load_skeleton): without a folder its weights are then `build()`'s, made
    only to be saved (a tiny model's, from its seed, on the CPU)."""
    shapes, aliases = parameter_shapes(model)
    source = Path(getattr(model.config, "_name_or_path", "") or ".")
    weights = list(source.glob("*.safetensors")) + list(source.glob("*.bin"))
    if (source / "config.json").is_file() and weights and (source / "tokenizer_config.json").is_file():
        return ServedModel(folder=source, name=str(source), shapes=shapes, aliases=aliases)
    if any(p.is_meta for p in model.parameters()):
        if build is None:
            raise ModelLoadError(f"engine.kind=vllm: the model ({type(model).__name__}) has no weights here (a meta-"
                                 f"device skeleton) and no folder vLLM could load them from ({source})")
        model = build()
    folder = Path(tempfile.mkdtemp(prefix="loomrl-vllm-model-"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ServedModel(folder=folder, name=f"{type(model).__name__} saved to {folder}", shapes=shapes, aliases=aliases,
                       owned=True)

# the parts stacked before it along dim 0, in vLLM's order (q, k, v; gate, up)
_FUSED = ((".q_proj.", ".qkv_proj.", ()), (".k_proj.", ".qkv_proj.", (".q_proj.",)),
          (".v_proj.", ".qkv_proj.", (".q_proj.", ".k_proj.")), (".gate_proj.", ".gate_up_proj.", ()),
          (".up_proj.", ".gate_up_proj.", (".gate_proj.",)))
_PARTS = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}

def fused_slot(name: str, shapes: dict[str, tuple[int, ...]]) -> list | None:
    """Where vLLM keeps the published tensor `name` if it fuses it: [the fused parameter's name, the row its part
    starts at, the rows of all parts] from the published shapes (`shapes`, every tensor's), else None (vLLM's worker
    reads the part only where the fused parameter has exactly those rows: worker.py readable)."""
    for part, fused, before in _FUSED:
        if part in name:
            siblings = [name.replace(part, p) for p in _PARTS[fused]]
            if not all(s in shapes and shapes[s] for s in siblings):
                return None
            first = sum(shapes[name.replace(part, b)][0] for b in before)
            return [name.replace(part, fused), first, sum(shapes[s][0] for s in siblings)]
    return None


def served_fingerprint(expected: Fingerprint, version: int, shapes: dict[str, tuple[int, ...]],
                       rpc: Callable[..., Any]) -> Fingerprint:
    """The fingerprint of vLLM's loaded weights, from the worker that holds them (`rpc`: a method of worker.py's
    WorkerExtension on tensor-parallel rank 0, whose tensors the other ranks replicate); names vLLM keeps in another
    layout are `unchecked`. When `expected` says the publisher's sums follow the weights (a sharded trainer's
    broadcast), those the worker received are `published`, and the worker's own are of the same names."""
    published = None
    if expected.follows:
        got = rpc("loomrl_published", version)
        published = {n: TensorSum(d, tuple(s), a, b) for n, (d, s, a, b) in got.items()} or None
    of = (published or {}) if expected.follows else expected.sums
    if not of:
        return Fingerprint(unchecked=f"vLLM's worker holds no sums of version {version} from the publisher")
    wanted = {n: [s.dtype, list(s.shape), fused_slot(n, shapes)] for n, s in of.items()}
    got = rpc("loomrl_fingerprint", wanted)
    return Fingerprint(sums={n: TensorSum(of[n].dtype, tuple(of[n].shape), a, b) for n, (a, b) in got["sums"].items()},
                       unchecked=got["unchecked"], published=published)
