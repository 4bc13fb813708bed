"""The Sandbox interface and the factory that picks a backend.

A sandbox owns one private working directory and runs commands in it with a wall-clock timeout that
kills the whole process group. Backends: `bwrap` (isolating: see bwrap.py) and `process` (isolates
nothing; for development on machines without bubblewrap, and it says so loudly).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, backend missing)."""


@dataclass(slots=True, kw_only=True)
class ExecResult:
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float

    @property
    def crashed(self) -> bool:
        """Killed by a signal or an internal failure, as opposed to a normal exit status."""
        return self.returncode < 0 and not self.timed_out


class Sandbox(Protocol):
    workdir: Path
    python: str  # a Python interpreter usable inside the sandbox

    async def exec(self, argv: list[str], *, timeout: float, stdin: str | None = None) -> ExecResult: ...

    def close(self) -> None: ...


class _SubprocessSandbox:
    """Shared machinery: a private workdir and process-group-killing exec."""

    backend = "base"

    def __init__(self, root: str | None = None):
        self.workdir = Path(tempfile.mkdtemp(prefix=f"loomrl-{self.backend}-", dir=root))
        os.chmod(self.workdir, 0o777)  # the sandboxed program runs as an unprivileged uid
        self._closed = False

    def wrap(self, argv: list[str]) -> list[str]:
        raise NotImplementedError  # each backend says how it wraps a command

    async def exec(self, argv: list[str], *, timeout: float, stdin: str | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *self.wrap(argv),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # own process group, so a timeout kills every descendant
        )
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), timeout)
        except TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = await proc.communicate()
        return ExecResult(
            returncode=proc.returncode if proc.returncode is not None else -9,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            duration_s=time.perf_counter() - start,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.workdir, ignore_errors=True)


def make_sandbox(backend: str = "auto") -> Sandbox:
    """`auto` picks bwrap when it is installed and works, else the (loud) process backend."""
    from loomrl.env.sandbox.bwrap import BwrapSandbox, bwrap_available
    from loomrl.env.sandbox.process import ProcessSandbox

    if backend == "bwrap":
        if not bwrap_available():
            raise SandboxError("sandbox error: bubblewrap is not usable here; install it (apt-get install -y bubblewrap) or set env.sandbox=process")
        return BwrapSandbox()
    if backend == "process":
        return ProcessSandbox()
    if backend == "auto":
        return BwrapSandbox() if bwrap_available() else ProcessSandbox()
    raise SandboxError(f"sandbox error: unknown backend {backend!r}; use bwrap, process or auto")
