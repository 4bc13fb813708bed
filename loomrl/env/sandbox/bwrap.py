"""bubblewrap sandbox: what is covered and what is not.

Covered: no network (own empty network namespace), own pid/ipc/uts namespaces, read-only /usr (and
the /bin, /lib links into it), a private tmpfs /tmp, the sandbox's own workdir as the only writable
place (/work), no other host files, the environment cleared. The program runs as an unprivileged uid of its own
(one per sandbox), so RLIMIT_NPROC holds per sandbox (the kernel never applies it to root), with rlimits on CPU seconds, address
space, processes and file size; bwrap dies with its parent and the wall-clock timeout kills the
whole process group.

Not covered: a pids/memory cgroup (rlimits are per process), disk quota of the workdir beyond the
per-file size limit, seccomp filtering of syscalls. The environment pool issue deepens this.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import threading

from loomrl.env.sandbox.base import _SubprocessSandbox

# Each sandbox runs as its own uid: RLIMIT_NPROC counts processes per uid, so a shared uid would make
# sandboxes share (and exhaust) one process budget; distinct uids also keep sandboxes from reading or
# signalling each other. The uids need no passwd entry.
_UID_BASE, _UID_SPAN = 200_000, 50_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def _next_uid() -> int:
    with _uid_lock:
        return _UID_BASE + (os.getpid() * 997 + next(_uid_counter)) % _UID_SPAN


@functools.cache
def bwrap_available() -> bool:
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        return False
    probe = BwrapSandbox.command_for("/tmp", ["/usr/bin/true"], limits=_DEFAULT_LIMITS, uid=_next_uid())
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_DEFAULT_LIMITS = {"cpu_s": 10, "address_space_mb": 1024, "nproc": 64, "file_size_mb": 16}


class BwrapSandbox(_SubprocessSandbox):
    backend = "bwrap"
    python = "/usr/bin/python3"  # Debian's; root's pyenv python is unreadable to other uids

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None):
        super().__init__(root)
        self.limits = {**_DEFAULT_LIMITS, **(limits or {})}
        self.uid = _next_uid()
        os.chown(self.workdir, self.uid, self.uid)
        os.chmod(self.workdir, 0o700)  # only this sandbox's uid (and root) can enter it

    @staticmethod
    def command_for(workdir: str, argv: list[str], *, limits: dict[str, int], uid: int) -> list[str]:
        return [
            "setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
            "prlimit",
            f"--cpu={limits['cpu_s']}",
            f"--as={limits['address_space_mb'] * 1024 * 1024}",
            f"--nproc={limits['nproc']}",
            f"--fsize={limits['file_size_mb'] * 1024 * 1024}",
            "bwrap",
            "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", workdir, "/work", "--chdir", "/work",
            "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/work",
            "--",
            *argv,
        ]  # fmt: skip

    def wrap(self, argv: list[str]) -> list[str]:
        return self.command_for(str(self.workdir), argv, limits=self.limits, uid=self.uid)
