"""The runner's linear layers as it serves them (q/k/v fused, gate/up fused, on a CPU in float32 oneDNN-packed), and
the process-wide cache that lets runners whose models share a weight tensor share what is derived from it.

Why a cache: `loomrl serve --adapter` runs one built-in engine per adapter over models that share every tensor the
adapter does not change (model/adapter.py shared_adapter_model). Each runner deriving its own fused and packed copies
would cost a whole model's worth of projections per adapter; through `linear_of`, runners over the same source tensors
get the same `Linear` object.

When a derived Linear is reused (the invariant): its source tensors (weights and biases, in order) are the same views
of the same storage (data_ptr, shape, stride, dtype, device), at the same autograd version (`Tensor._version`, bumped
by every tracked in-place write: copy_, load_state_dict, a non-fused optimizer step), AND their contents still give
the stamp taken when it was built (`_stamp`: each tensor's row sums of its bits, exact integers). The stamp is there
because some writes are not tracked: a fused AdamW step and writes through `.data` leave `_version` as it was. A
source whose version cannot be read (an inference tensor) is never shared. A Linear is never written after it is
built: an engine whose weights change (update_weights, update_adapter, an in-place trainer step) gets, at its next
refresh, a new Linear for every group whose sources changed, and keeps sharing the others; a runner that did not
refresh keeps the Linear it had, packed or fused copies of what it served before, whatever happened to the tensors it
was derived from (a single linear reads its model's bias itself, as it always did, and its weight too where it is not
packed: off the CPU or not in float32). The stamp costs one read of the weights per build or reuse, about what packing
them costs.

Only runners made with `share_linears` (ModelRunner; BuiltinEngine; `loomrl serve --adapter`'s engines) use the cache:
a training run's engine never shares, and pays neither the stamp nor any risk of a shared copy.

What it is not: a cache of the MoE experts (moe.py reads the model's expert tensors as they are) or of the norms and
embeddings (read from the model at each step, never derived). The cache holds entries weakly: a Linear lives as long as
a runner holds it; each entry keeps its sources' storage alive (a detached view), so no other tensor can be allocated
at a cached address while the entry lives.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
import torch.nn.functional as F


def _packer():
    """oneDNN's pre-packed linear, or None where this torch build lacks it."""
    try:
        if torch.backends.mkldnn.is_available():
            reorder, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
            w, x = torch.randn(8, 4, device="cpu"), torch.randn(2, 4, device="cpu")  # a CPU kernel, probed there
            if torch.allclose(linear(x, reorder(w, 2), None, "none", [], ""), x @ w.t(), atol=1e-5):
                return reorder, linear
    except (AttributeError, RuntimeError):
        pass
    return None


_PACKER = _packer()
_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; measured fine from 8 to 200 rows

Key = tuple[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, int], ...]


class Linear:
    """y = x @ weight.T + bias with the weight pre-packed for oneDNN when possible. Never written after __init__."""

    __slots__ = ("weight", "bias", "packed", "shape", "sources", "stamp", "__weakref__")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.shape = tuple(weight.shape)  # (out_features, in_features)
        self.bias = None if bias is None else bias.detach()
        self.packed = None
        self.weight: torch.Tensor | None = weight.detach()
        self.sources: tuple[torch.Tensor, ...] = ()  # linear_of's: what it was derived from (detached views)
        self.stamp: tuple[torch.Tensor, ...] = ()  # ... and their contents' _stamp then
        if _PACKER is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            self.packed = _PACKER[0](weight.detach().contiguous(), _PACK_BATCH_HINT)
            self.weight = None  # the packed copy serves; keeping the (fused) plain one too would double memory

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if x.shape[0] == 1:
                # oneDNN takes another path for one row (measured: the 1536-wide down projection of SmolLM2 then rounds
                # differently): with a zero row added, a row's output does not depend on how many rows share the call,
                # so what shares an engine step cannot change a request's logits (docs/reproducibility.md)
                return _PACKER[1](F.pad(x, (0, 0, 0, 1)), self.packed, self.bias, "none", [], "")[:1]
            return _PACKER[1](x, self.packed, self.bias, "none", [], "")
        if self.weight is None:  # __init__ keeps the plain weight whenever it does not pack it
            raise RuntimeError("Linear: neither a packed nor a plain weight")
        return F.linear(x, self.weight, self.bias)


@functools.cache
def rows_independent(out_features: int, in_features: int, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> bool:
    """Whether a Linear of this shape gives each row the same bits whatever the number of rows in the call (measured
    once per shape, on random data, for 1 to 33 rows against 64): where it does, what shares an engine step cannot
    change a request's logits. oneDNN's packed kernels on this project's CPUs do (with the one-row pad in __call__);
    cuBLAS picks kernels by size and is taken not to (GPUs are not probed), as MKL's plain GEMM does not."""
    if device != "cpu":  # not probed: a whole random head of a large model on the GPU would cost gigabytes
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype=dtype, device=device)
    x = torch.randn(64, in_features, generator=gen).to(dtype=dtype, device=device)
    lin = Linear(weight, None)
    full = lin(x)
    return all(torch.equal(lin(x[:m]), full[:m]) for m in (1, 2, 3, 5, 8, 13, 16, 31, 33))


def _build(linears: tuple[torch.nn.Linear, ...]) -> Linear:
    """The Linear of `linears` fused along their outputs (their own weight, no copy, where there is one and it is not
    packed)."""
    weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
    bias = None if all(m.bias is None for m in linears) else torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    return Linear(weight, bias)


def _sources(linears: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach() for m in linears for t in (m.weight, m.bias) if t is not None)


def _key(sources: tuple[torch.Tensor, ...]) -> Key | None:
    """Which views of which storage at which version; None for a source without a version (inference mode)."""
    try:
        return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t._version)
                     for t in sources)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


@torch.no_grad()
def _stamp(sources: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Each source's row sums of its elements' bit patterns, wrapping modulo 2**32 ([rows] int32; a 1-D tensor's rows
    are its elements): exact, so any one changed element changes its row's sum, and the same on every read of the same
    values whatever the order of the additions. One pass over the weights, about what packing them costs."""
    out = []
    for t in sources:
        bits = t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        bits = bits.reshape(bits.shape[0] if bits.dim() else 1, -1)  # [rows, cols]
        out.append(bits.sum(dim=1, dtype=torch.int64 if t.element_size() == 8 else torch.int32))
    return tuple(out)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class _Cache:
    """Derived Linears by their sources' key, held weakly; lookups and builds under one lock (runners refresh from
    their engine threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._linears: weakref.WeakValueDictionary[Key, Linear] = weakref.WeakValueDictionary()

    def linear(self, linears: tuple[torch.nn.Linear, ...]) -> Linear:
        sources = _sources(linears)
        key = _key(sources)
        if key is None:
            return _build(linears)
        with self._lock:
            hit = self._linears.get(key)
            stamp = _stamp(sources)
            if hit is not None and _same(hit.stamp, stamp):
                return hit
            built = _build(linears)  # a miss, or the sources were written where _version does not see it
            built.sources, built.stamp = sources, stamp
            self._linears[key] = built  # a stale entry stays with the runners that hold it, out of the cache
            return built

    def __len__(self) -> int:
        return len(self._linears)


CACHE = _Cache()


def linear_of(*linears: torch.nn.Linear, share: bool = False) -> Linear:
    """The served Linear of `linears` fused along their outputs; `share`: the one another sharing runner derived from
    the same unchanged tensors where there is one (see the module docstring), else a new one (entered in the cache).
    Without `share` (every engine but `loomrl serve --adapter`'s) a new one, built without the stamp's read."""
    return CACHE.linear(linears) if share else _build(linears)
