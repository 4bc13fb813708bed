"""Plain-process "sandbox": runs commands in a temp workdir with a timeout. It ISOLATES NOTHING:
the program can read and write your files and reach the network. Use it only for development on a
machine without bubblewrap; every instance logs a warning saying so. Its disk quota is checked by size
(quota.py), and no file a command writes may be larger than the quota (RLIMIT_FSIZE).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import sys
from collections.abc import Callable

from loomrl.env.sandbox.base import _SubprocessSandbox
from loomrl.env.sandbox.quota import MB

log = logging.getLogger(__name__)
_warned = False


class ProcessSandbox(_SubprocessSandbox):
    backend = "process"
    python = sys.executable

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None):
        global _warned
        super().__init__(root, limits)
        if not _warned:
            _warned = True
            log.warning(
                "sandbox backend 'process' ISOLATES NOTHING: tool code runs as you, with your files and "
                "network. Install bubblewrap (apt-get install -y bubblewrap) for real sandboxes."
            )

    def wrap(self, argv: list[str], env: dict[str, str]) -> list[str]:
        return argv

    def _preexec(self) -> Callable[[], None] | None:
        # No file the command writes (anywhere: nothing is isolated) may outgrow the workdir's disk quota, so a
        # single fast write stops there; files summing past it are caught when the command ends (base.py)
        cap = self.limits["disk_mb"] * MB
        if cap <= 0:  # disk_mb 0: no quota
            return None
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        cap = cap if hard == resource.RLIM_INFINITY else min(cap, hard)  # a limit above the hard one is refused
        return functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (cap, cap))

    def process_env(self, env: dict[str, str]) -> dict[str, str] | None:
        return {**os.environ, **env} if env else None
