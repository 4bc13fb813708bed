"""The processes of a Ray cluster a test started with `ray start`, found and stopped without touching any other Ray on
the machine (never `ray stop`: it stops every Ray process of the user)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def tagged(tag: str, tmp: str | None = None) -> list[int]:
    """Processes started by the test's cluster: they inherit LOOMRL_RAY_TEST=<tag> from `ray start`, or (Ray's agents,
    whose retitling blanks their environment) hold a file open under its temp dir `tmp`."""
    needle = f"LOOMRL_RAY_TEST={tag}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") or (
                        tmp and any(os.readlink(fd).startswith(tmp) for fd in (entry / "fd").iterdir())):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def kill_tagged(tag: str, tmp: str) -> None:
    """SIGKILL every process of the cluster, in three sweeps (a later one catches what was starting during the first)."""
    for _ in range(3):
        for pid in tagged(tag, tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)
