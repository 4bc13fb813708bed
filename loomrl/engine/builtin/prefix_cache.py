"""Radix tree over token ids whose nodes point at KV storage holding that prefix.

A node's edge is a run of token ids; the path from the root spells a prefix. Every node keeps a reference to one
SequenceKV (its "donor") whose first len(path) tokens hold the K/V of exactly that prefix: any sequence passing through
the node can serve, since K/V of a prefix does not depend on what follows. Leaves are the cached entries: a finished
program turn, or a prompt being decoded. `match` finds the longest cached prefix of a token list; `insert` adds an
entry; `evict` drops the least recently used leaves; `release(program_id)` drops a program's entries.

Only the token path is stored per node; K/V memory lives in SequenceKV objects shared with running sequences (no copies
are made here).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from loomrl.engine.builtin.runner import SequenceKV
from loomrl.tokens import common_prefix_len

_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    kv: SequenceKV | None = None  # donor holding the K/V of the path to (the end of) this node
    entry_program: str | None = None  # the program owning the cached entry ending here; None: not an entry
    last_used: int = 0


def _shared(edge: tuple[int, ...], tokens: list[int], at: int) -> int:
    """How many leading tokens of `edge` tokens[at:] repeats."""
    return common_prefix_len(edge, tokens[at : at + len(edge)])


class PrefixCache:
    def __init__(self) -> None:
        self.root = _Node(edge=(), parent=None)

    # -- lookup -----------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[int, SequenceKV | None]:
        """Length of the longest cached prefix of `tokens` and a KV holding it."""
        node, matched, best = self.root, 0, (0, None)
        now = next(_clock)
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            n = _shared(child.edge, tokens, matched)
            if child.kv is not None and n > 0:
                best = (matched + n, child.kv)
            child.last_used = now
            matched += n
            if n < len(child.edge):
                break
            node = child
        length, kv = best
        if kv is not None and kv.length < length:  # donor shorter than the path (cannot happen)
            length = kv.length
        return length, kv

    # -- insert -----------------------------------------------------------------------------------
    def insert(self, tokens: list[int], kv: SequenceKV, program_id: str = "") -> None:
        """Cache `tokens` (whose K/V are kv[:len(tokens)]) as an entry owned by `program_id`."""
        tokens = tokens[: kv.length]
        if not tokens:
            return
        node, i = self.root, 0
        now = next(_clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(edge=tuple(tokens[i:]), parent=node, kv=kv, last_used=now)
                node.children[tokens[i]], node = leaf, leaf
                break
            n = _shared(child.edge, tokens, i)
            if n < len(child.edge):  # split the edge at n
                mid = _Node(edge=child.edge[:n], parent=node, kv=kv, last_used=now)
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            child.kv = kv  # the newest holder serves the whole path
            child.last_used = now
            node = child
            i += n
        node.entry_program = program_id

    # -- removal ----------------------------------------------------------------------------------
    def _nodes(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _entries(self) -> list[_Node]:
        return [n for n in self._nodes() if n.entry_program is not None]

    def _remove_entry(self, node: _Node) -> None:
        node.entry_program = None
        # Prune childless non-entry nodes upward, then refresh donors on the path.
        while node is not self.root and not node.children and node.entry_program is None:
            parent = self._parent(node)
            del parent.children[node.edge[0]]
            node = parent
        while node is not self.root:
            parent = self._parent(node)
            node.kv = self._any_donor(node)
            if len(node.children) == 1 and node.entry_program is None:
                (only,) = node.children.values()  # merge a pass-through node into its child
                only.edge = node.edge + only.edge
                only.parent = parent
                parent.children[node.edge[0]] = only
            node = parent

    def _parent(self, node: _Node) -> _Node:
        """The parent of a node other than the root (the only node without one)."""
        if node.parent is None:
            raise RuntimeError("PrefixCache: a node other than the root has no parent")
        return node.parent

    def _any_donor(self, node: _Node) -> SequenceKV | None:
        if node.entry_program is not None:
            return node.kv
        return next((child.kv for child in node.children.values() if child.kv is not None), None)

    def evict_lru(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        entries = self._entries()
        if not entries:
            return False
        self._remove_entry(min(entries, key=lambda n: n.last_used))
        return True

    def release(self, program_id: str) -> int:
        """Drop every entry of `program_id`; returns how many."""
        victims = [n for n in self._entries() if n.entry_program == program_id]
        for node in victims:
            self._remove_entry(node)
        return len(victims)

    def clear(self) -> None:
        self.root = _Node(edge=(), parent=None)

    # -- accounting -------------------------------------------------------------------------------
    def held(self) -> dict[int, SequenceKV]:
        """KV objects kept alive by the cache, by id."""
        return {id(n.kv): n.kv for n in self._nodes() if n.kv is not None}

    def __len__(self) -> int:
        return len(self._entries())
