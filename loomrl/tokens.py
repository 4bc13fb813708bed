"""Helpers on token-id sequences shared by the engine (prefix reuse) and the trainer (prefix trees)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
