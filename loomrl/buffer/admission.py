"""Admission: bounded staleness at consumption (AReaL's rule), one rule for every runtime backend.

The group at data position p is consumed at step p // groups_per_step. It may be launched while the
policy version it will be sampled with is at most `max_lag` versions behind that step, so no group is
ever trained more than `max_lag` versions off-policy (plus what the buffer's staleness check drops).
With max_lag 0 (sync mode) only the current step's positions are admitted.
"""

from __future__ import annotations


def admits(position: int, *, version: int, groups_per_step: int, max_lag: int) -> bool:
    """Whether the group at `position` may be launched while the engine holds weights `version`."""
    return position // groups_per_step - version <= max_lag


def open_positions(next_position: int, *, version: int, groups_per_step: int, max_lag: int) -> int:
    """How many positions from `next_position` on the rule admits before the next weight update."""
    return (version + max_lag + 1) * groups_per_step - next_position
