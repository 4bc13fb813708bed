"""Facts about other processes of this machine that several parts read: whether a pid is alive (the owner of a
leftover K/V file, a sandbox quota mount or a browser's temp dir, each reaped once its owner is gone)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: signal 0 is refused, not unanswered)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True
