"""A shared K/V pool: prefix K/V in host memory that built-in engine instances put their finished turns into and fetch
from instead of recomputing (engine.kv_pool_bytes; off by default). Shared by the instances of one process (an
in-process store), or by every engine process on a node given the same folder (engine.kv_pool_dir: files on tmpfs
with an SQLite index, engine/kv_files.py).

An entry is the K/V of one token prefix (a finished turn's prompt + output less its last token), copied out of the
engine, under the weight version that computed it. It is indexed by the chained hash of each of its full blocks of
BLOCK tokens (placement.block_hashes, the router's own; deterministic across processes: hashes of int tuples); a lookup
takes the entries sharing any of the request's block hashes and checks each one's token ids against the request's,
token by token, so a hash collision can cost a miss but never serves a wrong prefix. What is served is the longest
common prefix of the request and an entry, when it covers at least one whole block (not only whole blocks: K/V of a
prefix does not depend on what follows it).

Versions: the pool serves one weight version, the newest published with `new_version(v)` (each engine calls it when
it loads weights; the first instance, of any process, to publish a newer version drops every entry of the older);
a put or get under another version is refused (an instance that has not loaded the new weights yet recomputes).
Bounded in bytes, across all the processes sharing it; past the bound the least recently used entry is dropped first.
A put whose tokens extend an entry replaces it (a program's next turn subsumes its last), and one that an entry
already covers only refreshes it. Metrics are this process's (each process counts its own puts, hits, evictions).

`PoolFetch` is the pool as the router's KVFetch (placement.py): the seconds to copy what the pool holds beyond an
instance's prefix (bytes per token / the host-copy rate measured at each put) plus recomputing the rest.

What it is not: where entries live (engine/kv_store.py: the interface and the in-process store; engine/kv_files.py:
the store of several processes), nor an engine's GPU-side connector: on GPUs vLLM's KV connectors (LMCache, its CPU
offloading) and SGLang's HiCache/Mooncake play this role (docs/engines.md, 'A shared K/V pool').
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loomrl.engine.builtin.runner import SequenceKV
from loomrl.engine.kv_store import Candidate, KVStore, MemoryStore
from loomrl.engine.placement import BLOCK, block_hashes
from loomrl.tokens import common_prefix_len

PRIOR_COPY_BYTES_PER_S = 2e9  # host-to-host copy rate before the pool has timed a put


@dataclass(slots=True)
class KVPoolMetrics:
    """Counters since the pool was built, of this process."""

    hits: int = 0  # gets that served more than the asker held
    misses: int = 0
    tokens_served: int = 0  # prompt tokens fetched beyond what the asker held: recompute avoided
    bytes_in: int = 0  # copied into the pool by puts
    bytes_out: int = 0  # of entries served (the asker copies them into its running K/V)
    puts: int = 0
    evictions: int = 0  # entries dropped for the byte bound
    version_drops: int = 0  # entries dropped because a newer version was published

    def counts(self) -> dict[str, float]:
        """As step metrics (engine/readings.py): engine/kv_pool_<counter>, each the step's change."""
        return {f"kv_pool_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


def open_pool(capacity_bytes: int, directory: str = "") -> SharedKVPool:
    """A pool of `capacity_bytes`: in this process (`directory` empty), or shared by every process that opens the
    same `directory` (engine.kv_pool_dir; created if absent, removed by the last process to close it)."""
    if not directory:
        return SharedKVPool(capacity_bytes=capacity_bytes)
    from loomrl.engine.kv_files import FileStore

    return SharedKVPool(capacity_bytes=capacity_bytes, store=FileStore(directory, capacity_bytes))


def _as_kv(data: torch.Tensor) -> SequenceKV:
    """A standalone SequenceKV over `data` ([layers, 2, kv_heads, tokens, head_dim]) without copying it."""
    kv = SequenceKV(data.shape[0], data.shape[2], data.shape[4], 0, data.dtype)
    kv._data = data  # noqa: SLF001 - runner.SequenceKV has no constructor over existing data; a copy would double it
    kv.length = data.shape[3]
    return kv


@dataclass(slots=True, kw_only=True)
class SharedKVPool:
    """Prefix K/V of one weight version, shared by engines (threads, or processes through a FileStore); thread-safe."""

    capacity_bytes: int
    hasher: Callable[[list[int]], list[int]] = block_hashes  # a test forces collisions through it
    store: KVStore | None = None  # None: an in-process MemoryStore of capacity_bytes
    metrics: KVPoolMetrics = field(default_factory=KVPoolMetrics)
    copy_bytes_per_s: float = PRIOR_COPY_BYTES_PER_S  # measured at each put (a moving average)
    bytes_per_token: float = 0.0  # of the last put
    _lock: threading.Lock = field(default_factory=threading.Lock)  # this process's metrics and rates

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"SharedKVPool: capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.store is None:
            self.store = MemoryStore(self.capacity_bytes)

    @property
    def _store(self) -> KVStore:
        assert self.store is not None  # set in __post_init__
        return self.store

    @property
    def version(self) -> int | None:
        """The version served; None until the first new_version or put."""
        return self._store.served()

    @property
    def nbytes(self) -> int:
        return self._store.usage()[1]

    def __len__(self) -> int:
        return self._store.usage()[0]

    def close(self) -> None:
        """Let go of the store (a shared one's folder is removed by the last process to close it)."""
        self._store.close()

    # -- versions -----------------------------------------------------------------------------------------------
    def new_version(self, version: int) -> None:
        """Serve `version` from now on, when newer than the one served: every entry of another version is dropped."""
        _, dropped = self._store.publish(version)
        with self._lock:
            self.metrics.version_drops += dropped

    # -- put ------------------------------------------------------------------------------------------------------
    def put(self, tokens: list[int], kv: SequenceKV, version: int) -> bool:
        """Keep a copy of the K/V of `tokens` (kv's first len(tokens) tokens) computed under `version`. False when it
        was not kept: another version is served, it is shorter than a block, larger than the pool, or already held."""
        tokens = tokens[: kv.length]
        hashes = self.hasher(tokens)
        if not hashes:
            return False
        if self._store.served() is None:
            self._store.publish(version)
        cands = self._store.candidates(hashes, version)
        if version != self._store.served():
            return False
        for c in cands:  # held already by a longer entry: refresh it instead
            if len(c.tokens) >= len(tokens) and common_prefix_len(c.tokens, tokens) == len(tokens):
                self._store.load(c.key, data=False)
                return False
        data = kv.data[:, :, :, : len(tokens)]  # [layers, 2, kv_heads, n, head_dim]
        nbytes = data.numel() * data.element_size()
        if nbytes > self.capacity_bytes:
            return False
        replaces = [c.key for c in cands if common_prefix_len(c.tokens, tokens) == len(c.tokens)]  # it serves theirs
        t0 = time.perf_counter()
        evicted = self._store.insert(tokens=tokens, hashes=hashes, version=version, data=data, replaces=replaces)
        seconds = time.perf_counter() - t0
        if evicted is None:  # a new version was published meanwhile
            return False
        with self._lock:
            if seconds > 0:
                self.copy_bytes_per_s = 0.8 * self.copy_bytes_per_s + 0.2 * nbytes / seconds
            self.bytes_per_token = nbytes / len(tokens)
            self.metrics.puts += 1
            self.metrics.bytes_in += nbytes
            self.metrics.evictions += evicted
        return True

    # -- get ------------------------------------------------------------------------------------------------------
    def _longest(self, tokens: list[int], version: int | None) -> tuple[int, Candidate | None]:
        """(tokens, entry) of the entry sharing the longest prefix with `tokens` under `version`, when that covers a
        whole block; the tokens decide, never the hash alone."""
        if version is None:
            return 0, None
        hashes = self.hasher(tokens)
        if not hashes:
            return 0, None
        best = max(((common_prefix_len(c.tokens, tokens), c) for c in self._store.candidates(hashes, version)),
                   default=(0, None), key=lambda nc: nc[0])
        return best if best[0] >= BLOCK else (0, None)

    def get(self, tokens: list[int], version: int, held: int = 0) -> tuple[int, SequenceKV | None]:
        """The longest prefix of `tokens` held for `version` and a K/V holding it (read it, never write it), when it
        is longer than the `held` tokens the asker has already; else (0, None)."""
        n, cand = self._longest(tokens, version)
        data = self._store.load(cand.key) if cand is not None and n > held else None
        with self._lock:
            if data is None:  # nothing longer, or the entry was evicted since (by another engine or process)
                self.metrics.misses += 1
                return 0, None
            self.metrics.hits += 1
            self.metrics.tokens_served += n - held
            self.metrics.bytes_out += int(n * data.numel() * data.element_size() / data.shape[3])
        return n, _as_kv(data)

    def held(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix of `tokens` the pool holds for its version (no metrics, no LRU refresh)."""
        return self._longest(tokens, self._store.served())[0]


@dataclass(slots=True, kw_only=True)
class PoolFetch:
    """The pool as the router's KVFetch (placement.py): the seconds to fetch what the pool holds of a prompt beyond an
    instance's `held` tokens and to recompute the rest at `prefill_tokens_per_s()` (the router's measured rate)."""

    pool: SharedKVPool
    prefill_tokens_per_s: Callable[[], float]

    def fetch_s(self, tokens: list[int], held: int) -> float | None:
        n = self.pool.held(tokens)
        if n <= held:
            return None
        copy_s = (n - held) * self.pool.bytes_per_token / self.pool.copy_bytes_per_s
        return copy_s + (len(tokens) - n) / self.prefill_tokens_per_s()
