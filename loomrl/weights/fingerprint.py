"""Weight fingerprints: a cheap checksum of a few of a version's tensors, taken by the publisher as it sends them and by
the engine from what it loaded, so that a weight sync that did not take effect (a dropped bucket, a tensor that never
reached its parameter, an engine that kept its old weights) stops the run with `WeightMismatch` instead of passing.

What is fingerprinted: up to `MAX_TENSORS` of the published tensors (`pick`: all of them for a small model, else the
first and last in sorted order and a fixed seeded sample between). An engine that keeps some of them in another
layout (vLLM fuses q/k/v_proj into qkv_proj, shards across tensor-parallel ranks, packs linear weights on the CPU)
compares the others and says which it could not read (logged once, never skipped silently). Each tensor's checksum
(`tensor_sum`) is over `SAMPLES` elements at evenly spaced flat indices, in the published dtype, widened to
float64 on the host: their sum and their sum weighted by a fixed function of the index, each added exactly
(math.fsum), so that the publisher and the engine get the same two numbers bit for bit from the same values, whatever
the device or the order they were read in, and any other values almost surely change them.

Where it is taken: the publisher taps the buckets it sends (`Tap`, no copy of its own; weights/handle.py) and puts the
`Fingerprint` in the handle. A broadcast is sent after publish returns: a replicated trainer's handle carries the
sums of its whole tensors (`Tap.ahead`); a sharded trainer gathers its tensors only as the broadcast sends them, so its
handle says the sums `follow`: the Tap's sums go over the same group after the last bucket (weights/group.py
send_sums) and the receiving engine reports them as it got them (`Fingerprint.published`). The engine computes its
own over its loaded weights (Engine.weight_fingerprint) and `check` compares the two (confirm_weights below).

What it is not: a proof that every element arrived (a sample of tensors, a sample of elements: it catches a version
that was not applied, in whole or a tensor at a time, not one flipped bit), nor a check of what an engine derives from
its parameters (the built-in engine's packed copies).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from loomrl.weights.source import DictSource, Entry, WeightSource, dtype_name

Tensor = torch.Tensor
log = logging.getLogger(__name__)

MAX_TENSORS = 32
SAMPLES = 1024
SEED = 27


class WeightMismatch(RuntimeError):
    """An engine's loaded weights do not match the version the trainer published: the sync did not take effect."""


class TensorSum(NamedTuple):
    dtype: str  # as published, without "torch."
    shape: tuple[int, ...]
    sum: float
    weighted: float


@dataclass(slots=True, kw_only=True)
class Fingerprint:
    """Checksums by tensor name; `unchecked`: why the tensors absent from `sums` could not be read ("" if none)."""

    sums: dict[str, TensorSum] = field(default_factory=dict)
    unchecked: str = ""
    # a publisher's (a sharded trainer's broadcast): the sums are sent after the version's buckets, not in the handle
    follows: bool = False
    # an engine's, for a handle whose sums follow: the publisher's sums as they reached it (None: none reached it)
    published: dict[str, TensorSum] | None = None


def pick(names: list[str], max_tensors: int = MAX_TENSORS) -> list[str]:
    """The names a version's fingerprint covers, the same for the same names: all of them when there are at most
    `max_tensors`, else the first, the last and a seeded sample between (sorted)."""
    eligible = sorted(names)
    if len(eligible) <= max_tensors:
        return eligible
    middle = random.Random(SEED).sample(eligible[1:-1], max_tensors - 2)
    return sorted([eligible[0], eligible[-1], *middle])


def tensor_sum(t: Tensor, dtype: torch.dtype | None = None) -> TensorSum:
    """The checksum of `t` as cast to `dtype` (None: its own): SAMPLES elements at evenly spaced flat indices."""
    dtype = dtype or t.dtype
    n = t.numel()
    flat = t.detach().reshape(-1)
    idx = torch.arange(n) if n <= SAMPLES else torch.arange(SAMPLES) * n // SAMPLES  # [S] int64, on the host
    x = flat[idx.to(flat.device)].to(dtype).cpu().to(torch.float64)  # cast as published, then widened exactly
    w = (idx * 2654435761 % 4294967296).to(torch.float64) / 4294967296.0  # a fixed pseudo-random weight per index
    return TensorSum(dtype_name(dtype), tuple(t.shape), math.fsum(x.tolist()), math.fsum((x * w).tolist()))


def fingerprint_of(weights: dict[str, Tensor], expected: Fingerprint | None = None,
                   dtype: torch.dtype | None = None) -> Fingerprint:
    """The fingerprint of `weights` (a full state dict, an engine's parameters): of the tensors `expected` names, each
    cast to the dtype it was published in; without `expected`, of `pick(weights)` cast to `dtype` (None: their own).
    A name `weights` lacks is left out of `sums` (check reports it as differing: the weights never reached it)."""
    if expected is None:
        return Fingerprint(sums={n: tensor_sum(weights[n], dtype) for n in pick(list(weights))})
    with torch.no_grad():
        return Fingerprint(sums={n: tensor_sum(weights[n], getattr(torch, s.dtype))
                                 for n, s in expected.sums.items() if n in weights})


class Tap(WeightSource):
    """`source` as it is, recording the checksums of the picked tensors as its buckets pass (the publisher's)."""

    def __init__(self, source: WeightSource):
        super().__init__(source.specs, source.bucket_bytes, source.device)
        self.source = source
        self.names = frozenset(pick([s.name for s in source.specs]))
        self.sums: dict[str, TensorSum] = {}
        self.done = False

    def plan(self) -> list[list[Entry]]:
        return self.source.plan()

    def buckets(self) -> Iterator[list[tuple[str, Tensor]]]:
        for bucket in self.source.buckets():
            self.sums.update({n: tensor_sum(t) for n, t in bucket if n in self.names})
            yield bucket
        self.done = True

    def ahead(self) -> Fingerprint:
        """The fingerprint before any bucket is read (a broadcast's handle), where the source holds its tensors whole:
        a DictSource's buckets are its tensors cast, so sampling then casting gives the same values. A sharded
        trainer's are gathered only as they are sent: a fingerprint saying so (a broadcast sends them after the last
        bucket: weights/broadcast.py)."""
        if isinstance(self.source, DictSource):
            dtypes = {s.name: s.dtype for s in self.specs}
            return Fingerprint(sums={n: tensor_sum(self.source.weights[n], dtypes[n]) for n in sorted(self.names)})
        return Fingerprint(unchecked="a sharded trainer's weights are gathered only as the broadcast sends them, "
                                     "after the handle has gone")

    def fingerprint(self) -> Fingerprint:
        """What the buckets read so far gave; every picked tensor once they have all been read."""
        if not self.done:
            return Fingerprint(unchecked="the version was not read when its handle was made")
        return Fingerprint(sums=dict(self.sums))


@dataclass(slots=True, kw_only=True)
class Verdict:
    differ: list[str]  # names whose checksums differ, or that the engine lacks
    unchecked: list[str]  # names the engine could not read (its fingerprint's `unchecked` says why)
    checked: int


def compare(expected: Fingerprint, actual: Fingerprint) -> Verdict:
    differ, unchecked = [], []
    for name, want in expected.sums.items():
        got = actual.sums.get(name)
        if got is None:
            (unchecked if actual.unchecked else differ).append(name)
        elif not _same(want, got):
            differ.append(name)
    return Verdict(differ=differ, unchecked=unchecked, checked=len(expected.sums) - len(unchecked))


def _same(a: TensorSum, b: TensorSum) -> bool:
    if a.shape != b.shape:
        return False
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in ((a.sum, b.sum), (a.weighted, b.weighted)))


_said: set[tuple[str, str]] = set()


def check(engine: str, version: int, expected: Fingerprint | None, actual: Fingerprint, loaded_version: int) -> int:
    """Raise WeightMismatch, naming `engine`, the version and the tensors that differ, unless the engine serves
    `version` and its fingerprint matches `expected`'s wherever it could read it. What could not be checked is logged
    (once per engine and reason), never skipped silently. Returns how many tensors were compared."""
    if loaded_version != version:
        raise WeightMismatch(f"weight sync: engine {engine} serves version {loaded_version} after loading version "
                             f"{version}: the update did not take effect")
    if expected is not None and expected.follows:  # the publisher's sums came after the weights, to the engine
        expected = Fingerprint(sums=actual.published or {}, unchecked="" if actual.published else
                               f"the publisher's sums follow the weights and the engine did not report them "
                               f"({actual.unchecked or 'it reported none'})")
    if expected is None or not expected.sums:
        why = expected.unchecked if expected is not None and expected.unchecked else "its handle carries no fingerprint"
        _once(engine, f"weight fingerprint not checked for engine {engine}: {why}")
        return 0
    verdict = compare(expected, actual)
    if verdict.differ:
        shown = ", ".join(verdict.differ[:5]) + (f" and {len(verdict.differ) - 5} more" if len(verdict.differ) > 5
                                                  else "")
        first = verdict.differ[0]
        want, got = expected.sums[first], actual.sums.get(first)
        theirs = f"the engine's sum {got.sum!r}, weighted {got.weighted!r}" if got else "the engine has no such tensor"
        if got is not None and got.shape != want.shape:
            theirs += f" (shape {list(got.shape)}, published {list(want.shape)})"
        raise WeightMismatch(f"weight sync: engine {engine} did not load version {version} as published: "
                             f"{len(verdict.differ)} of {verdict.checked} fingerprinted tensors differ ({shown}); "
                             f"{first}: published sum {want.sum!r}, weighted {want.weighted!r}; {theirs}")
    if verdict.unchecked:
        _once(engine, f"weight fingerprint not checked for engine {engine} on {len(verdict.unchecked)} of "
                      f"{len(expected.sums)} tensors: {actual.unchecked}")
    return verdict.checked


def _once(engine: str, line: str) -> None:
    if (engine, line) not in _said:
        _said.add((engine, line))
        log.warning(line)


def confirm_weights(engine: Any, label: str, version: int, expected: Fingerprint | None) -> int:
    """After `engine` (named `label` in errors) applied `version`: raise WeightMismatch unless it serves that version
    and its weights' fingerprint matches `expected`, the publisher's (weights/fingerprint.py check: what could not be
    compared is logged, never skipped silently). Returns how many tensors were compared."""
    asks = expected is not None and (expected.sums or expected.follows)
    actual = engine.weight_fingerprint(expected) if asks else Fingerprint()
    return check(label, version, expected, actual, engine.version)
