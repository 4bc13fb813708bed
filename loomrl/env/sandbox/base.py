"""The Sandbox interface and the machinery its backends share (the factory that picks one: factory.py).

A sandbox owns one private working directory and runs commands in it with a wall-clock timeout that
kills the whole process group. Interface: Sandbox, what environments use, and PooledSandbox, which
adds what the pool that owns the instance uses (snapshot and reset).

Backends: `bwrap` (isolating: see bwrap.py), `process` (isolates nothing; for development on machines
without bubblewrap, and it says so loudly) and `docker` (for machines with a Docker engine).
Disk (`limits["disk_mb"]`, quota.py): where a backend mounts a size-limited filesystem as the workdir
(bwrap), a write past the quota fails; elsewhere the workdir's size is polled while a command runs (the
command killed past the quota) and measured after it. Either way a command that left the workdir full
is reported as stopped at the quota (ExecResult.killed = "disk_quota").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loomrl.env.sandbox.quota import MB, DiskUse, dir_size, disk_use
from loomrl.errors import folded

DISK_POLL_S = 0.05


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, backend missing, a path outside the workdir)."""


@dataclass(slots=True, kw_only=True)
class ExecResult:
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    # "timeout" or "disk_quota" when the sandbox stopped the command, or the command filled the workdir's quota
    # (its writes past it failed, or were measured when it ended); stderr ends with a [loomrl] line saying which
    killed: str | None = None


@dataclass(slots=True, kw_only=True)
class Health:
    ok: bool
    detail: str = ""  # why not: the trivial command's exit status and its own stderr (e.g. bwrap's message)


class Sandbox(Protocol):
    backend: str
    workdir: Path
    python: str  # a Python interpreter usable inside the sandbox

    async def exec(self, argv: list[str], *, timeout: float, stdin: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        """Run one command in the workdir, with extra environment variables. Never raises for the command's
        own failures: ExecResult.killed says why it was stopped, if it was."""

    def write_file(self, path: str, data: str | bytes) -> None:
        """Put a file into the workdir (host side, between commands)."""

    def read_file(self, path: str) -> str:
        """Read a file of the workdir (host side; refuses paths that leave it)."""

    async def health(self, timeout: float = 5.0) -> Health:
        """Can the sandbox still run a trivial command quickly? Health, with the command's own error output
        when it cannot."""

    def close(self) -> None:
        """Stop whatever it still runs, remove the workdir and its snapshot."""


class PooledSandbox(Sandbox, Protocol):
    """A sandbox its EnvPool owns: the pool snapshots it once prepared and resets it between leases
    (a remote sandbox is only leased: its env actor's pool does that)."""

    def snapshot(self) -> None:
        """Remember the workdir as the state `reset()` restores."""

    def reset(self) -> None:
        """Restore that state (empty unless snapshot() was called)."""


def command_works(argv: list[str]) -> bool:
    """A backend's probe: `argv` runs and exits 0 within 10 s."""
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class _SubprocessSandbox:
    """Shared machinery: a private workdir, process-group-killing exec, host-side files and snapshots."""

    backend = "base"
    python = "python3"
    default_limits: dict[str, int] = {"disk_mb": 256}

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None):
        unknown = sorted(set(limits or {}) - set(self.default_limits))
        if unknown:
            raise SandboxError(f"sandbox error: unknown limit(s) {unknown} for the {self.backend} backend "
                               f"(env.sandbox_limits, or --limit); known: {sorted(self.default_limits)}")
        self.limits = {**self.default_limits, **(limits or {})}
        # the pid in the name: quota.sweep_stale finds mounts whose process is gone
        self._home = Path(tempfile.mkdtemp(prefix=f"loomrl-{self.backend}-{os.getpid()}-", dir=root))
        os.chmod(self._home, 0o711)  # the sandbox's uid may traverse into its workdir, not list siblings
        self.workdir = self._home / "work"
        self.workdir.mkdir()
        self._quota_fs = self._mount_quota()  # the workdir is a filesystem of the quota's size
        self._snapshot = self._home / "snapshot"  # outside the workdir: never visible inside
        self._running: set[int] = set()  # process groups of commands still running (close() kills them)
        self._closed = False
        self._state_lock = threading.Lock()  # reset and close may come from different threads
        self._prepare_workdir()

    # -- hooks for backends -------------------------------------------------------------------------
    def wrap(self, argv: list[str], env: dict[str, str]) -> list[str]:
        raise NotImplementedError  # each backend says how it wraps a command and passes `env`

    def process_env(self, env: dict[str, str]) -> dict[str, str] | None:
        """The environment of the wrapper process itself (None: inherit)."""
        return None

    def _prepare_workdir(self) -> None:
        """Ownership and mode of a fresh or restored workdir."""
        os.chmod(self.workdir, 0o777)

    def _after_exec(self) -> None:
        """Called after every command (backends kill leftovers here)."""

    def _mount_quota(self) -> bool:
        """Make the (empty) workdir a filesystem of limits["disk_mb"]; whether it did (False: sizes are checked)."""
        return False

    def _unmount_quota(self) -> None:
        """Undo _mount_quota (close)."""

    def _preexec(self) -> Callable[[], None] | None:
        """Run in the child before the command (the process backend sets its rlimits here); None: nothing."""
        return None

    def _disk(self) -> DiskUse:
        return disk_use(self.workdir, self.limits.get("disk_mb", 0) * MB, self._quota_fs)

    def _quota_note(self, before: DiskUse) -> str | None:
        """The [loomrl] line for a command that filled the workdir's quota (None: it did not). A command that
        only read or removed files in an already full workdir is not blamed for it."""
        after = self._disk()
        if not after.full or (after.bytes <= before.bytes and after.files <= before.files):
            return None
        mb = self.limits["disk_mb"]
        if self._quota_fs:
            return (f"[loomrl] disk quota: the command filled the workdir's {mb} MB (env.sandbox_limits.disk_mb); "
                    "its writes past that failed")
        return (f"[loomrl] disk quota: the command left the workdir at {after.bytes / MB:.1f} MB, at or over its "
                f"{mb} MB (env.sandbox_limits.disk_mb); remove files or raise the quota")

    # -- commands ---------------------------------------------------------------------------------
    async def exec(self, argv: list[str], *, timeout: float, stdin: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        start = time.perf_counter()
        quota = self.limits.get("disk_mb", 0) * MB
        before = self._disk() if quota else None
        proc = await self._spawn(argv, env or {}, stdin is not None)
        self._running.add(proc.pid)
        killed: str | None = None
        talk = asyncio.ensure_future(proc.communicate(stdin.encode() if stdin is not None else None))
        poll = quota and not self._quota_fs  # a mounted quota needs no polling: the filesystem refuses the writes
        exited_at: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({talk}, timeout=DISK_POLL_S)
                if done:
                    break
                now = time.perf_counter()
                if proc.returncode is not None:
                    # The command exited but something it started still holds its output pipes
                    # (a daemon outside its process group): give it a moment, then kill the group.
                    exited_at = exited_at or now
                    if now - exited_at > 0.5:
                        self._kill(proc.pid)
                        break
                if now - start > timeout:
                    killed = "timeout"
                elif poll and dir_size(self.workdir) > quota:
                    killed = "disk_quota"
                if killed:
                    self._kill(proc.pid)
                    break
            out, err = await self._collect(talk, proc)
        except BaseException:
            self._kill(proc.pid)  # cancelled (trajectory deadline): leave nothing running
            raise
        finally:
            self._running.discard(proc.pid)
            self._after_exec()
        if killed == "disk_quota":
            err += f"\n[loomrl] killed: the workdir passed its disk quota of {self.limits['disk_mb']} MB\n".encode()
        elif killed is None and before is not None:
            # after every command: a write that finished between two polls (or was refused by the mounted
            # filesystem) still counts, whatever the command's own exit status says
            note = self._quota_note(before)
            if note:
                killed = "disk_quota"
                err += f"\n{note}\n".encode()
        return ExecResult(returncode=proc.returncode if proc.returncode is not None else -9,
                          stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          timed_out=killed == "timeout", duration_s=time.perf_counter() - start, killed=killed)

    async def _spawn(self, argv: list[str], env: dict[str, str], with_stdin: bool) -> asyncio.subprocess.Process:
        """Start the wrapped command in its own process group. Cancel-safe: a cancellation that lands
        while the process is being started (a health check given up mid-flight) still kills it once it
        exists, instead of leaving it running unowned."""
        spawning = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *self.wrap(argv, env),
            env=self.process_env(env),
            preexec_fn=self._preexec(),
            cwd=self.workdir,  # the process backend runs the command itself: it must start in its workdir
            stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # own process group, so a timeout kills every descendant
        ))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            def reap(task: asyncio.Future) -> None:
                if not task.cancelled() and task.exception() is None:
                    self._kill(task.result().pid)  # asyncio's child watcher collects its exit status
            spawning.add_done_callback(reap)
            raise

    @staticmethod
    async def _collect(talk: asyncio.Future, proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
        """The command's output; if a process outside its group keeps the pipes open after the kill,
        stop waiting for them (what was read so far is lost; the process backend only: bwrap's pid
        namespace leaves no such process)."""
        try:
            return await asyncio.wait_for(asyncio.shield(talk), 2.0)
        except TimeoutError:
            talk.cancel()
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()
            return b"", b"[loomrl] output lost: a process that escaped the command's group kept its pipes open"

    @staticmethod
    def _kill(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    async def health(self, timeout: float = 5.0) -> Health:
        """A trivial command runs, exits 0 and prints what it was told, within `timeout`."""
        if self._closed:
            return Health(ok=False, detail="the sandbox is closed")
        try:
            res = await self.exec(["/usr/bin/echo", "loomrl-ok"], timeout=timeout)
        except (OSError, SandboxError) as err:
            return Health(ok=False, detail=f"{type(err).__name__}: {err}")
        if not self.workdir.is_dir():
            return Health(ok=False, detail=f"its workdir {self.workdir} is gone")
        if res.returncode == 0 and res.stdout.strip() == "loomrl-ok":
            return Health(ok=True)
        why = f"killed ({res.killed}) after {res.duration_s:.1f}s" if res.killed else f"exit status {res.returncode}"
        return Health(ok=False, detail=f"`echo loomrl-ok` in the sandbox failed ({why}): "
                                       f"{folded(res.stderr or res.stdout) or 'no output'}")

    # -- files --------------------------------------------------------------------------------------
    def _inside(self, path: str) -> Path:
        """The host path of `path` (relative to the workdir, or absolute under /work), refusing any
        path that resolves outside the workdir: the sandboxed program may have planted symlinks."""
        rel = path[len("/work/"):] if path.startswith("/work/") else path
        target = (self.workdir / rel).resolve()
        root = self.workdir.resolve()
        if target != root and root not in target.parents:
            raise SandboxError(f"sandbox error: {path!r} resolves outside the sandbox's workdir")
        return target

    def write_file(self, path: str, data: str | bytes) -> None:
        target = self._inside(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()
            target.write_bytes(data.encode() if isinstance(data, str) else data)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SandboxError(f"sandbox error: writing {path!r}: the workdir's disk quota of "
                               f"{self.limits['disk_mb']} MB (env.sandbox_limits.disk_mb) is full") from None
        self._own(target)

    def read_file(self, path: str) -> str:
        target = self._inside(path)
        if not target.is_file():
            raise SandboxError(f"sandbox error: {path!r} is not a file in the workdir")
        return target.read_text(errors="replace")

    def _own(self, path: Path) -> None:
        """Make a host-written file usable by the sandboxed program (backends override)."""

    # -- state --------------------------------------------------------------------------------------
    def snapshot(self) -> None:
        shutil.rmtree(self._snapshot, ignore_errors=True)
        shutil.copytree(self.workdir, self._snapshot, symlinks=True)

    def reset(self) -> None:
        """Restore the workdir to the snapshot (or to empty): every file the program made is gone."""
        with self._state_lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            # emptied, not removed: a mounted quota filesystem stays mounted for the sandbox's lifetime. A
            # workdir the program replaced (the process backend lets it) is never followed, only replaced
            if self.workdir.is_symlink() or not self.workdir.is_dir():
                with contextlib.suppress(FileNotFoundError):
                    self.workdir.unlink()
                self.workdir.mkdir()
            for entry in os.scandir(self.workdir):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
            if self._snapshot.exists():
                shutil.copytree(self._snapshot, self.workdir, symlinks=True, dirs_exist_ok=True)
            self._prepare_workdir()

    def close(self) -> None:
        """Kill what is still running (a command whose caller went away), then remove the files."""
        with self._state_lock:
            if not self._closed:
                self._closed = True
                for pgid in list(self._running):
                    self._kill(pgid)
                self._after_exec()
                if self._quota_fs:
                    self._unmount_quota()
                shutil.rmtree(self._home, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._closed
