"""A shared K/V pool: prefix K/V in host memory that the built-in engine instances of one process put their finished
turns into and fetch from instead of recomputing (engine.kv_pool_bytes; off by default).

An entry is the K/V of one token prefix (a finished turn's prompt + output less its last token), copied out of the
engine into a standalone CPU SequenceKV, under the weight version that computed it. It is indexed by the chained hash
of each of its full blocks of BLOCK tokens (placement.block_hashes, the router's own); a lookup walks the request's
block hashes from the longest down and checks each candidate's token ids against the request's, token by token, so a
hash collision can cost a miss but never serves a wrong prefix. What is served is the longest common prefix of the
request and an entry (not only whole blocks: K/V of a prefix does not depend on what follows it).

Versions: the pool serves one weight version, the newest published with `new_version(v)` (each engine calls it when
it loads weights), which drops every entry of any other version; a put or get under another version is refused (an
instance that has not loaded the new weights yet recomputes). Bounded in bytes; past the bound the least recently used
entry is dropped first. A put whose tokens extend an entry replaces it (a program's next turn subsumes its last), and
one that an entry already covers only refreshes it.

`PoolFetch` is the pool as the router's KVFetch (placement.py): the seconds to copy what the pool holds beyond an
instance's prefix (bytes per token / the host-copy rate measured at each put) plus recomputing the rest.

What it is not, yet: shared across processes. The router's instances are threads of one process here, so the pool is
a dict of CPU tensors under a lock; across engine processes it would sit on shared memory or memory-mapped files
(entries as fixed-size slabs, the index in a shared table), which is remaining work. Nor is it an engine's GPU-side
connector: on GPUs vLLM's KV connectors (LMCache, its CPU offloading) and SGLang's HiCache/Mooncake play this role
(docs/engines.md, 'A shared K/V pool').
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from loomrl.engine.builtin.runner import SequenceKV
from loomrl.engine.placement import BLOCK, block_hashes
from loomrl.tokens import common_prefix_len

PRIOR_COPY_BYTES_PER_S = 2e9  # host-to-host copy rate before the pool has timed a put


@dataclass(slots=True)
class KVPoolMetrics:
    """Counters since the pool was built."""

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


@dataclass(slots=True, kw_only=True)
class _Entry:
    tokens: tuple[int, ...]
    kv: SequenceKV  # standalone, on the CPU; its first len(tokens) tokens hold their K/V
    hashes: list[int]
    nbytes: int


@dataclass(slots=True, kw_only=True)
class SharedKVPool:
    """Prefix K/V of one weight version, shared by the engines of a process; thread-safe."""

    capacity_bytes: int
    hasher: Callable[[list[int]], list[int]] = block_hashes  # a test forces collisions through it
    version: int | None = None  # the version served; None until the first new_version or put
    metrics: KVPoolMetrics = field(default_factory=KVPoolMetrics)
    copy_bytes_per_s: float = PRIOR_COPY_BYTES_PER_S  # measured at each put (a moving average)
    bytes_per_token: float = 0.0  # of the last put
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # key -> entry, least recently used first
    _by_block: dict[int, set[int]] = field(default_factory=dict)  # block hash -> keys of entries holding that block
    _bytes: int = 0
    _keys: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"SharedKVPool: capacity_bytes must be positive, got {self.capacity_bytes}")

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # -- versions -----------------------------------------------------------------------------------------------
    def new_version(self, version: int) -> None:
        """Serve `version` from now on: every entry of another version is dropped."""
        with self._lock:
            if version == self.version:
                return
            self.version = version
            self.metrics.version_drops += len(self._entries)
            self._entries.clear()
            self._by_block.clear()
            self._bytes = 0

    # -- put ------------------------------------------------------------------------------------------------------
    def put(self, tokens: list[int], kv: SequenceKV, version: int) -> bool:
        """Keep a copy of the K/V of `tokens` (kv's first len(tokens) tokens) computed under `version`. False when it
        was not kept: another version is served, it is shorter than a block, larger than the pool, or already held."""
        tokens = tokens[: kv.length]
        hashes = self.hasher(tokens)
        with self._lock:
            if self.version is None:
                self.version = version
            if version != self.version or not hashes or self._covered(tokens, hashes):
                return False
        t0 = time.perf_counter()
        copy = SequenceKV(kv.data.shape[0], kv.data.shape[2], kv.data.shape[4], len(tokens), kv.data.dtype)
        copy.copy_prefix(kv, len(tokens))  # outside the lock: other engines' gets do not wait for it
        nbytes = copy.data.numel() * copy.data.element_size()
        seconds = time.perf_counter() - t0
        if nbytes > self.capacity_bytes:
            return False
        with self._lock:
            if version != self.version:  # a new version was published meanwhile
                return False
            if seconds > 0:
                self.copy_bytes_per_s = 0.8 * self.copy_bytes_per_s + 0.2 * nbytes / seconds
            self.bytes_per_token = nbytes / copy.capacity
            for key in self._candidates(hashes):  # entries the new one extends: it serves all they served
                if common_prefix_len(self._entries[key].tokens, tokens) == len(self._entries[key].tokens):
                    self._drop(key)
            key = next(self._keys)
            self._entries[key] = _Entry(tokens=tuple(tokens), kv=copy, hashes=hashes, nbytes=nbytes)
            for h in hashes:
                self._by_block.setdefault(h, set()).add(key)
            self._bytes += nbytes
            self.metrics.puts += 1
            self.metrics.bytes_in += nbytes
            while self._bytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self.metrics.evictions += 1
        return True

    def _covered(self, tokens: list[int], hashes: list[int]) -> bool:
        """Whether an entry already holds all of `tokens` (then it is refreshed instead); lock held."""
        for key in self._by_block.get(hashes[-1], ()):
            entry = self._entries[key]
            if len(entry.tokens) >= len(tokens) and common_prefix_len(entry.tokens, tokens) == len(tokens):
                self._entries.move_to_end(key)
                return True
        return False

    def _candidates(self, hashes: list[int]) -> set[int]:
        return set().union(*(self._by_block.get(h, ()) for h in hashes))

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        for h in entry.hashes:
            keys = self._by_block.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[h]
        self._bytes -= entry.nbytes

    # -- get ------------------------------------------------------------------------------------------------------
    def _longest(self, tokens: list[int], version: int) -> tuple[int, int | None]:
        """(tokens, key) of the entry sharing the longest prefix with `tokens` under `version`; lock held."""
        if version != self.version:
            return 0, None
        hashes = self.hasher(tokens)
        for k in range(len(hashes) - 1, -1, -1):  # the longest block first; tokens decide, never the hash alone
            best = max(((common_prefix_len(self._entries[key].tokens, tokens), key)
                        for key in self._by_block.get(hashes[k], ())), default=(0, None))
            if best[0] >= (k + 1) * BLOCK:
                return best
        return 0, None

    def get(self, tokens: list[int], version: int, held: int = 0) -> tuple[int, SequenceKV | None]:
        """The longest prefix of `tokens` held for `version` and a K/V holding it (read it, never write it), when it
        is longer than the `held` tokens the asker has already; else (0, None)."""
        with self._lock:
            n, key = self._longest(tokens, version)
            if key is None or n <= held:
                self.metrics.misses += 1
                return 0, None
            entry = self._entries[key]
            self._entries.move_to_end(key)
            self.metrics.hits += 1
            self.metrics.tokens_served += n - held
            self.metrics.bytes_out += int(n * entry.nbytes / entry.kv.capacity)
            return n, entry.kv

    def held(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix of `tokens` the pool holds for its version (no metrics, no LRU refresh)."""
        with self._lock:
            return self._longest(tokens, self.version)[0] if self.version is not None else 0


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
