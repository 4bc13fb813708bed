"""Lookups of a library's internals by name: the check behind each `*_contract.py` (engine/vllm/contract.py,
model/transformers_contract.py).

What it is: an `Internal` names one thing loomrl uses of a library ("module:attr.attr") and the keyword arguments it
passes; `missing()` says, one short phrase each, which of them the installed library lacks. A library that moved or
renamed something then stops a run at its start, or `make test`'s version check (scripts/gpu_resolve.py), with the
name, instead of deep inside a worker.

What it is not: a check of behaviour (the tests against the real libraries do that), or of anything reached by
`**kwargs` (a signature that takes them accepts every keyword).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class Internal:
    """One thing an adapter uses: `module:attr.path`, and the keyword arguments it passes (empty: none, or only
    positional ones)."""

    target: str
    keywords: tuple[str, ...] = ()
    cpu_only: bool = False  # vLLM: used on its CPU platform only, not looked up elsewhere


def lookup(target: str) -> Any:
    """The object at `target` ("module:attr.attr"): whatever the library has there, so Any."""
    module_name, _, path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def unaccepted(obj: object, keywords: tuple[str, ...]) -> list[str]:
    """The keywords among `keywords` that `obj`'s signature does not take (none when it takes **kwargs)."""
    if not callable(obj):  # nothing to call, so no keywords to check
        return []
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # a builtin or C type without a signature: nothing to check
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in keywords if k not in params]


def missing(internals: tuple[Internal, ...]) -> list[str]:
    """What the installed library lacks of `internals`, each as a short phrase (empty: everything is there)."""
    out = []
    for internal in internals:
        try:
            obj = lookup(internal.target)
        except (ImportError, AttributeError) as err:
            out.append(f"{internal.target} ({type(err).__name__}: {err})")
            continue
        if absent := unaccepted(obj, internal.keywords):
            out.append(f"{internal.target} takes no {', '.join(absent)}")
    return out
