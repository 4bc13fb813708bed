"""Plain-process "sandbox": runs commands in a temp workdir with a timeout. It ISOLATES NOTHING:
the program can read and write your files and reach the network. Use it only for development on a
machine without bubblewrap; every instance logs a warning saying so.
"""

from __future__ import annotations

import logging
import os
import sys

from loomrl.env.sandbox.base import _SubprocessSandbox

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

    def process_env(self, env: dict[str, str]) -> dict[str, str] | None:
        return {**os.environ, **env} if env else None
