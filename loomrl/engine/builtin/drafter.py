"""Grouped drafting: draft tokens for a decoding sequence from what its GRPO group has written so far.

The members of a GRPO group answer the same prompt, and late in training write nearly the same tokens; a multi-turn
program quotes its observations and repeats its tool calls. So the best guess of a sequence's next tokens is often a
continuation of its own last few tokens found elsewhere in its group: in a sibling's output (in flight or finished), in
the shared prompt, or earlier in its own context. Seer drafts from a suffix tree per group; this module keeps the same
thing as a suffix index: every n-gram of min_match..max_match tokens of every document of a group maps to the places it
ends, so the longest suffix of a sequence's context that occurs in its group (up to max_match tokens, the depth a
suffix tree would be walked to) is one lookup per length. The draft follows the places that match: token by token,
the continuation most of them agree on, as a suffix tree's most frequent path would.

Groups are keyed by GenerationRequest.group_id (the program id when it has none, so a multi-turn program drafts from
its earlier turns and its observations). Every index is dropped at a weight update (`drop`): what siblings sampled from
the old weights predicts the new ones less well, and a draft never changes the output distribution anyway (it is
verified; engine.py), only the speed. A group's documents are its members' contexts (prompt + tokens sampled so far);
documents of members that have finished stay until the next drop, or until the group is evicted (least recently used,
at most max_groups groups, max_group_tokens indexed tokens each and max_tokens in all: an indexed token costs about
1.9 KB where every n-gram is new, measured with random tokens, so the default 2^19 tokens is about 1 GB at most).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Doc:
    tokens: list[int]
    indexed: int = 0  # tokens[:indexed] have their n-grams in the group's index


@dataclass(eq=False)
class _Group:
    docs: list[_Doc] = field(default_factory=list)
    # n-gram -> where it ends: (document, index of its last token); appended in order, so the newest places come last
    index: dict[tuple[int, ...], list[tuple[_Doc, int]]] = field(default_factory=dict)
    prompts: dict[tuple[int, ...], _Doc] = field(default_factory=dict)  # a prompt shared by siblings is indexed once
    tokens: int = 0


class GroupDrafter:
    """Suffix indexes of the groups in flight; used by the engine's thread only (no lock)."""

    MAX_PLACES = 32  # the newest places of a match that the draft is voted from

    def __init__(self, *, min_match: int = 2, max_match: int = 8, max_groups: int = 512,
                 max_group_tokens: int = 1 << 18, max_tokens: int = 1 << 19):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"GroupDrafter: need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.max_groups, self.max_tokens = max_groups, max_tokens
        self.max_group_tokens = min(max_group_tokens, max_tokens)
        self._tokens = 0  # indexed tokens of every group
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._docs: dict[int, tuple[str, _Doc]] = {}  # a sequence's id -> its group and its document
        self.epoch = 0  # drops so far: a document made before the last drop is never read again

    # -- the sequences ---------------------------------------------------------------------------
    def join(self, seq_id: int, group: str, prompt: list[int], out: list[int]) -> None:
        """A sequence starts decoding (or decodes again after a drop): index its context."""
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group()
            while len(self._groups) > self.max_groups:
                self._evict(next(iter(self._groups)))
        self._groups.move_to_end(group)
        key = tuple(prompt)
        shared = g.prompts.get(key)
        doc = _Doc(list(prompt) + list(out))
        if shared is not None:
            # A sibling's document starts with the same prompt: its n-grams are indexed already (indexed again, a
            # group of G would give the prompt's continuation G votes against what the siblings wrote).
            doc.indexed = len(prompt)
        else:
            g.prompts[key] = doc
        g.docs.append(doc)
        self._docs[seq_id] = (group, doc)
        self._index(g, doc)
        self._trim()

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence sampled `tokens`."""
        entry = self._docs.get(seq_id)
        if entry is None:
            return
        group, doc = entry
        g = self._groups.get(group)
        if g is None:  # evicted meanwhile
            del self._docs[seq_id]
            return
        doc.tokens.extend(tokens)
        self._groups.move_to_end(group)
        self._index(g, doc)
        self._trim()

    def knows(self, seq_id: int) -> bool:
        return seq_id in self._docs

    def leave(self, seq_id: int) -> None:
        """The sequence finished or left the batch; its document stays for its siblings."""
        self._docs.pop(seq_id, None)

    def drop(self) -> None:
        """New weights: forget every group (running sequences join again when they next draft)."""
        self._groups.clear()
        self._docs.clear()
        self._tokens = 0
        self.epoch += 1

    # -- drafting --------------------------------------------------------------------------------
    def draft(self, seq_id: int, limit: int) -> list[int]:
        """Up to `limit` tokens likely to follow the sequence's context; [] without a match of min_match tokens."""
        entry = self._docs.get(seq_id)
        if entry is None or limit <= 0:
            return []
        group, doc = entry
        g = self._groups.get(group)
        if g is None:
            return []
        self._groups.move_to_end(group)  # in use: the last to be evicted
        ctx = doc.tokens
        for n in range(min(self.max_match, len(ctx)), self.min_match - 1, -1):
            places = [(d, end) for d, end in g.index.get(tuple(ctx[-n:]), ())
                      if not (d is doc and end == len(ctx) - 1) and end + 1 < len(d.tokens)]
            if places:
                return self._vote(places[-self.MAX_PLACES :], limit)
        return []

    @staticmethod
    def _vote(places: list[tuple[_Doc, int]], limit: int) -> list[int]:
        """Walk the continuations of `places` together: at each depth the token most of those still agreeing have
        next (the newest place wins a tie); stop where none continues or fewer than half agree."""
        out: list[int] = []
        live = places
        for depth in range(1, limit + 1):
            counts: dict[int, int] = {}
            for d, end in reversed(live):  # newest first: max() keeps the first of equal counts
                if end + depth < len(d.tokens):
                    tok = d.tokens[end + depth]
                    counts[tok] = counts.get(tok, 0) + 1
            if not counts:
                break
            best = max(counts, key=lambda t: counts[t])
            if counts[best] * 2 < len(live):
                break
            out.append(best)
            live = [(d, end) for d, end in live if end + depth < len(d.tokens) and d.tokens[end + depth] == best]
        return out

    # -- the index -------------------------------------------------------------------------------
    def _index(self, g: _Group, doc: _Doc) -> None:
        toks = doc.tokens
        for end in range(doc.indexed, len(toks)):
            if g.tokens >= self.max_group_tokens:
                doc.indexed = len(toks)  # full: the group drafts from what it has
                return
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                places = g.index.setdefault(tuple(toks[end - n + 1 : end + 1]), [])
                places.append((doc, end))
                if len(places) > 2 * self.MAX_PLACES:  # a repeated n-gram: keep the newest places only
                    del places[: -self.MAX_PLACES]
            g.tokens += 1
            self._tokens += 1
        doc.indexed = len(toks)

    def _trim(self) -> None:
        """Evict the least recently used groups while every group's tokens are over max_tokens (the newest group,
        the one just written to, stays: its own bound is max_group_tokens <= max_tokens)."""
        while self._tokens > self.max_tokens and len(self._groups) > 1:
            self._evict(next(iter(self._groups)))

    def _evict(self, group: str) -> None:
        self._tokens -= self._groups.pop(group).tokens
        for seq_id in [s for s, (name, _) in self._docs.items() if name == group]:
            del self._docs[seq_id]

    def indexed_tokens(self) -> int:
        return self._tokens
