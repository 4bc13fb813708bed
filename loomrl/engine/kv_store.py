"""Where a K/V pool's entries live: the storage interface under engine/kv_pool.py's SharedKVPool, and its in-process
implementation (a dict of CPU tensors under a lock, shared by the engine instances of one process).

A store keeps entries (one token prefix's K/V, [layers, 2, kv_heads, tokens, head_dim], under the weight version that
computed it), indexes them by their chained block hashes, serves one weight version (the newest published) and bounds
their bytes, dropping the least recently used entry first. It never decides what a hit is: SharedKVPool checks every
candidate's tokens against the request's, and the store only answers which entries share a block hash with it.
The store of several processes is engine/kv_files.py's FileStore (files on tmpfs, an SQLite index).

What it is not: the pool's policy (token checks, what a put replaces, metrics: kv_pool.py), nor a GPU-side store.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True, frozen=True)
class Candidate:
    """An entry sharing a block hash with a request: its key and the token ids its K/V holds."""

    key: int
    tokens: tuple[int, ...]


def nbytes_of(data: torch.Tensor) -> int:
    return data.numel() * data.element_size()


class KVStore(Protocol):
    """Entries of the served weight version, bounded in bytes (least recently used dropped first)."""

    capacity_bytes: int

    def publish(self, version: int) -> tuple[int, int]:
        """Serve `version` when it is newer than the one served (or none is): every other version's entry is dropped.
        Returns (the version served now, entries dropped)."""
        ...

    def served(self) -> int | None:
        """The version served; None before the first publish."""
        ...

    def candidates(self, hashes: list[int], version: int) -> list[Candidate]:
        """Entries of `version` that hold any of the block `hashes` (a hash match only: the caller checks tokens)."""
        ...

    def load(self, key: int, *, data: bool = True) -> torch.Tensor | None:
        """Refresh the entry's last use; with `data`, its K/V (read only; None when it is gone or unreadable)."""
        ...

    def insert(self, *, tokens: list[int], hashes: list[int], version: int, data: torch.Tensor,
               replaces: list[int]) -> int | None:
        """Keep a copy of `data` (the K/V of `tokens`) in place of the entries `replaces`, then evict down to the
        bound. Returns the entries evicted, or None when `version` is no longer the one served (nothing kept)."""
        ...

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        ...

    def close(self) -> None:
        ...


@dataclass(slots=True, kw_only=True)
class _Entry:
    tokens: tuple[int, ...]
    data: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim], contiguous, on the CPU
    hashes: list[int]
    nbytes: int


class MemoryStore:
    """The in-process store: entries as CPU tensors, shared by the engine instances (threads) of one process."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._version: int | None = None
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[int, set[int]] = {}  # block hash -> keys of the entries holding that block
        self._bytes = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def publish(self, version: int) -> tuple[int, int]:
        with self._lock:
            if self._version is not None and version <= self._version:
                return self._version, 0
            dropped = len(self._entries)
            self._version = version
            self._entries.clear()
            self._by_block.clear()
            self._bytes = 0
            return version, dropped

    def served(self) -> int | None:
        return self._version

    def candidates(self, hashes: list[int], version: int) -> list[Candidate]:
        with self._lock:
            if version != self._version:
                return []
            keys = set().union(*(self._by_block.get(h, ()) for h in hashes))
            return [Candidate(key=k, tokens=self._entries[k].tokens) for k in keys]

    def load(self, key: int, *, data: bool = True) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.data if data else None

    def insert(self, *, tokens: list[int], hashes: list[int], version: int, data: torch.Tensor,
               replaces: list[int]) -> int | None:
        copy = data.clone(memory_format=torch.contiguous_format)  # outside the lock: other engines' gets go on
        with self._lock:
            if version != self._version:  # a new version was published meanwhile
                return None
            for key in replaces:
                if key in self._entries:
                    self._drop(key)
            key = next(self._keys)
            self._entries[key] = _Entry(tokens=tuple(tokens), data=copy, hashes=hashes, nbytes=nbytes_of(copy))
            for h in hashes:
                self._by_block.setdefault(h, set()).add(key)
            self._bytes += nbytes_of(copy)
            evicted = 0
            while self._bytes > self.capacity_bytes:  # the new entry is the most recent: it goes last
                self._drop(next(iter(self._entries)))
                evicted += 1
            return evicted

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        for h in entry.hashes:
            keys = self._by_block.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[h]
        self._bytes -= entry.nbytes

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_block.clear()
            self._bytes = 0
