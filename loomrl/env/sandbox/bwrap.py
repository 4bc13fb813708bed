"""bubblewrap sandbox: what is covered and what is not.

Covered: no network (own empty network namespace), own pid/ipc/uts namespaces, read-only /usr (and
the /bin, /lib links into it), a private tmpfs /tmp, the sandbox's own workdir as the only writable
place (/work), no other host files, the environment cleared. The program runs as uid 65534 (nobody),
so RLIMIT_NPROC holds (the kernel never applies it to root), with rlimits on CPU seconds, address
space, processes and file size; bwrap dies with its parent and the wall-clock timeout kills the
whole process group.

Not covered: a pids/memory cgroup (rlimits are per process), disk quota of the workdir beyond the
per-file size limit, seccomp filtering of syscalls. The environment pool issue deepens this.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

from loomrl.env.sandbox.base import _SubprocessSandbox

NOBODY = "65534"


@functools.cache
def bwrap_available() -> bool:
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        return False
    probe = BwrapSandbox.command_for("/tmp", ["/usr/bin/true"], limits=_DEFAULT_LIMITS)
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_DEFAULT_LIMITS = {"cpu_s": 10, "address_space_mb": 1024, "nproc": 64, "file_size_mb": 16}


class BwrapSandbox(_SubprocessSandbox):
    backend = "bwrap"
    python = "/usr/bin/python3"  # Debian's; root's pyenv python is unreadable to uid 65534

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None):
        super().__init__(root)
        self.limits = {**_DEFAULT_LIMITS, **(limits or {})}

    @staticmethod
    def command_for(workdir: str, argv: list[str], *, limits: dict[str, int]) -> list[str]:
        return [
            "setpriv", "--reuid", NOBODY, "--regid", NOBODY, "--clear-groups",
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
        return self.command_for(str(self.workdir), argv, limits=self.limits)
