"""LoRA adapters in the built-in engine (Engine.update_adapter): merged into the served linear weights.

How: each targeted linear's weight becomes W_base + scale x B @ A (computed in float32, cast once to the model's
dtype), where W_base is a copy of that linear's weight taken the first time an adapter targets it (in the engine's
dtype, only the targeted linears), so that every version merges onto the base and never onto the previous merge. A
linear that an earlier adapter targeted and the new one does not goes back to its base. Loading full weights
(update_weights) makes them the new base: the copies and the served adapter are dropped (`reset`).

Why merged rather than applied on the fly (an extra x A^T B^T per targeted linear in every forward): merging costs one
B @ A per linear per version, between two steps, and the forward then runs exactly as without an adapter, with the
runner's packed weights; applying on the fly adds two thin matmuls and an add to every linear of every step. Measured
here (docs/training.md, LoRA adapters), SmolLM2-135M shape, rank 8: on the fly took 1.25x and 1.99x the merged
decode step in two runs on a shared machine; a merge cost what 4.5 to 15 decode steps of that overhead cost.

Fingerprint (`fingerprint`): of the adapter's tensors as received, by the published names, but only when the adapter
merged is the one named for the version served (weights/adapter.py adapter_name): a dropped adapter (never merged) or
a stale one (an older version's, still served) leaves them out, and check() reports them as differing. And, per
module fingerprinted, a sample of the merged weight's rows is recomputed from the base copy and the received tensors:
a module whose served weight is not base + delta leaves its tensors out as well (a merge that did not reach the
weights). What it is not: a check of the runner's packed copies (refresh), as with full weights.

Supported: PEFT's plain LoRA on linear layers (lora_A / lora_B under `base_model.model.<module>`); rsLoRA, DoRA and
per-module rank or alpha patterns raise ValueError naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loomrl.weights.adapter import AdapterMeta, adapter_name
from loomrl.weights.fingerprint import Fingerprint, fingerprint_of

if TYPE_CHECKING:
    from torch import Tensor

PEFT_PREFIX = "base_model.model."  # PEFT's saved names: the base model's own module names under this prefix
SAMPLE_ROWS = 4  # rows of each fingerprinted module recomputed as base + delta


@dataclass(slots=True, kw_only=True)
class Served:
    """The adapter the engine merged: its name and its tensors as received (by the published names)."""

    name: str
    tensors: dict[str, Tensor]


def modules_of(weights: dict[str, Tensor]) -> dict[str, tuple[str, str]]:
    """The base model's parameter name of each adapted linear -> the published names of its (A, B)."""
    out: dict[str, tuple[str, str]] = {}
    for name in weights:
        if not name.startswith(PEFT_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"update_adapter: {name} is not a LoRA adapter's lora_A or lora_B weight under PEFT's "
                             f"names ({PEFT_PREFIX}<module>.lora_A.weight)")
        module = name[len(PEFT_PREFIX):-len(".lora_A.weight")]
        a, b = (f"{PEFT_PREFIX}{module}.lora_{x}.weight" for x in "AB")
        if a not in weights or b not in weights:
            raise ValueError(f"update_adapter: {name} comes without its pair ({a}, {b})")
        out[f"{module}.weight"] = (a, b)
    return out


def check_plain_lora(adapter: AdapterMeta) -> None:
    """What the merge computes is scale x B @ A with one scale: refuse the PEFT settings that change that."""
    cfg = adapter.config
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key):
            raise ValueError(f"update_adapter: adapter {adapter.name} sets {key}, which the built-in engine does not "
                             "merge (plain LoRA only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"update_adapter: adapter {adapter.name} sets {key}; the built-in engine merges one rank "
                             "and alpha for every module")


def delta(a: Tensor, b: Tensor, scale: float, rows: Tensor | None = None) -> Tensor:
    """scale x B @ A in float32 (`rows`: of those rows of B only)."""
    b = b if rows is None else b[rows]
    return scale * (b.float() @ a.float())


class AdapterMerge:
    """The base copies of the targeted linears of `params` (a model's parameters by name) and the adapter served."""

    def __init__(self, params: dict[str, Tensor]):
        self.params = params
        self.base: dict[str, Tensor] = {}  # parameter name -> its weight before any adapter (the engine's dtype)
        self.scale = 1.0
        self.modules: dict[str, tuple[str, str]] = {}  # of the adapter served
        self.served: Served | None = None

    def apply(self, weights: dict[str, Tensor], adapter: AdapterMeta) -> None:
        """Merge `adapter` (its tensors `weights`) onto the base, a linear at a time, and record it as served."""
        check_plain_lora(adapter)
        modules = modules_of(weights)
        missing = sorted(set(modules) - set(self.params))
        if missing:
            raise ValueError(f"update_adapter: adapter {adapter.name} targets {missing[:3]}, which the model lacks")
        self.served = None  # from here until the last linear is merged the weights are neither version's
        with torch.no_grad():
            for name in sorted(set(self.base) - set(modules)):  # targeted before, not now: back to the base
                self.params[name].copy_(self.base[name])
            for name, (a, b) in modules.items():
                param = self.params[name]
                base = self.base.setdefault(name, param.detach().clone())
                param.copy_((base.float() + delta(weights[a], weights[b], adapter.scale)).to(param.dtype))
        self.scale, self.modules = adapter.scale, modules
        self.served = Served(name=adapter.name, tensors=weights)

    def reset(self) -> None:
        """Full weights were loaded: they are the base from now on, with no adapter."""
        self.base.clear()
        self.modules = {}
        self.served = None

    def fingerprint(self, expected: Fingerprint, version: int) -> Fingerprint:
        """The fingerprint of the served weights: the parameters, and the adapter's tensors (see the module's
        docstring) where the adapter merged is `version`'s and its merged rows check out."""
        served = self.served
        if served is None or served.name != adapter_name(version):
            return fingerprint_of(self.params, expected)
        wanted = set(expected.sums)
        good = {n: t for name, (a, b) in self.modules.items() if {a, b} & wanted and self._merged(name, a, b)
                for n, t in ((a, served.tensors[a]), (b, served.tensors[b]))}
        return fingerprint_of({**self.params, **good}, expected)

    def _merged(self, name: str, a: str, b: str) -> bool:
        """Whether a sample of the served weight's rows equals base + delta (to the model dtype's rounding)."""
        served, param, base = self.served, self.params[name], self.base[name]
        assert served is not None  # fingerprint's caller checked
        rows = torch.linspace(0, param.shape[0] - 1, min(SAMPLE_ROWS, param.shape[0])).long()
        want = (base[rows].float() + delta(served.tensors[a], served.tensors[b], self.scale, rows)).to(param.dtype)
        eps = torch.finfo(param.dtype).eps
        return torch.allclose(param[rows].float(), want.float(), rtol=4 * eps, atol=4 * eps)
