"""Buffer of scored trajectory groups with policy versions and staleness control; batch filters."""

from loomrl.buffer.buffer import Buffer
from loomrl.buffer.filters import usable_group

__all__ = ["Buffer", "usable_group"]
