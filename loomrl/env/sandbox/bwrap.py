"""bubblewrap sandbox: what is covered and what is not.

Covered: no network (own empty network namespace), own pid/ipc/uts namespaces (processes outside are
invisible, so they cannot be signalled), read-only /usr (and the /bin, /lib links into it), a private
size-limited tmpfs /tmp, the sandbox's own workdir as the only writable place (/work), no other host
files, the environment cleared. The program runs as an unprivileged uid of its own (one per sandbox),
with no capabilities (bounding set emptied, no_new_privs), so RLIMIT_NPROC holds per sandbox (the
kernel never applies it to root) and sandboxes cannot read or signal each other; rlimits on CPU
seconds, address space, processes and file size; a disk quota on the workdir: a tmpfs of that size
mounted for the sandbox's lifetime, so a write past it fails however fast it is (quota.py; where the
mount is refused, sizes are checked instead, with a warning). bwrap dies with its parent; the
wall-clock timeout kills the whole process group; when a command ends, its pid namespace ends with it (bwrap's pid 1 goes, the kernel kills what is left) and
any process still owned by the sandbox's uid is killed as well, so no daemon survives a step.

Privileges are dropped inside, after the mounts: bwrap itself runs as root and makes the mounts, then
`setpriv` switches to the sandbox's uid and `prlimit` sets the limits before the command runs. So what
the sandbox is given (its workdir, a gateway socket, a folder of Python packages) may lie under a folder
that the sandbox's uid cannot traverse (a 0700 home or `mktemp -d` folder holding the checkout): the
mounts are made by root, and the sandbox sees only their destinations. (bwrap run as the unprivileged
uid, as before, failed there with "Can't find source path ...: Permission denied".)

Not covered: a memory cgroup (the address-space rlimit is per process; nproc x address space bounds the
total), seccomp filtering of syscalls.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import signal
import threading
from pathlib import Path

from loomrl.env.sandbox import quota
from loomrl.env.sandbox.base import SandboxError, _SubprocessSandbox, command_works

log = logging.getLogger(__name__)

# Each sandbox runs as its own uid: RLIMIT_NPROC counts processes per uid, so a shared uid would make
# sandboxes share (and exhaust) one process budget; distinct uids also keep sandboxes from reading or
# signalling each other. The uids need no passwd entry.
_UID_BASE, _UID_SPAN = 200_000, 50_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def _next_uid() -> int:
    with _uid_lock:
        return _UID_BASE + (os.getpid() * 997 + next(_uid_counter)) % _UID_SPAN


DEFAULT_LIMITS = {"cpu_s": 10, "address_space_mb": 1024, "nproc": 64, "file_size_mb": 16, "disk_mb": 256,
                  "tmp_mb": 64}


@functools.cache
def bwrap_available() -> bool:
    if any(shutil.which(tool) is None for tool in ("bwrap", "setpriv", "prlimit")) or os.geteuid() != 0:
        return False  # the tools are missing, or we are not root (one uid per sandbox needs root to switch to it)
    return command_works(BwrapSandbox.command_for("/tmp", ["/usr/bin/true"], limits=DEFAULT_LIMITS, uid=_next_uid()))


def _file_cap_mb(limits: dict[str, int]) -> int:
    """No file larger than the disk quota either (disk_mb 0: no quota): where the workdir is not a filesystem
    of the quota's size, a single fast write still stops there."""
    return min(limits["file_size_mb"], limits["disk_mb"]) if limits["disk_mb"] > 0 else limits["file_size_mb"]


@functools.cache
def _warn_unmounted(why: str) -> None:
    log.warning("bwrap sandbox: could not mount a tmpfs as the workdir (%s); its disk quota is checked by size "
                "instead: a write that finishes between two checks passes it until the command ends", why)


def _mount_points(destinations: list[str]) -> list[str]:
    """bwrap options making the parent folders of bind destinations, world-traversable (made
    implicitly, they would copy the mode of the host folder and may shut the sandbox's uid out)."""
    folders: dict[str, None] = {}  # an ordered set: each folder once, parents before their children
    for inside in destinations:
        parts = inside.strip("/").split("/")[:-1]
        folders.update(dict.fromkeys("/" + "/".join(parts[:k]) for k in range(1, len(parts) + 1)))
    return [part for folder in folders for part in ("--perms", "0755", "--dir", folder)]


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by `uid` (a sandbox's own uid)."""
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


class BwrapSandbox(_SubprocessSandbox):
    backend = "bwrap"
    python = "/usr/bin/python3"  # Debian's; root's pyenv python is unreadable to other uids
    default_limits = DEFAULT_LIMITS

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None,
                 binds: dict[str, str] | None = None):
        """`binds`: host path -> path inside, mounted read-only (e.g. a gateway's unix socket, a folder
        of Python packages an agent program needs)."""
        self.binds = dict(binds or {})
        for host, inside in self.binds.items():
            if not os.path.exists(host):
                raise SandboxError(f"sandbox error: the bind source {host!r} (to be mounted at {inside}) does not "
                                   "exist")
            if not os.path.isabs(inside) or inside == "/work" or inside.startswith(("/work/", "/usr/", "/tmp/")):
                raise SandboxError(f"sandbox error: bind destination {inside!r} must be an absolute path outside "
                                   "/work, /usr and /tmp")
        self.uid = _next_uid()
        super().__init__(root, limits)

    def _prepare_workdir(self) -> None:
        # Only this sandbox's uid (and root) can enter its workdir; files restored from a snapshot
        # (copied by root) are handed back to it.
        for dirpath, dirnames, filenames in os.walk(self.workdir):
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), self.uid, self.uid)
        os.chown(self.workdir, self.uid, self.uid)
        os.chmod(self.workdir, 0o700)

    def _mount_quota(self) -> bool:
        if self.limits["disk_mb"] <= 0:
            return False
        why = quota.mount_tmpfs(self.workdir, self.limits["disk_mb"], self.uid)
        if why is not None:
            _warn_unmounted(why)
        return why is None

    def _unmount_quota(self) -> None:
        quota.unmount(self.workdir)

    def _own(self, path: Path) -> None:
        node = path
        while node != self.workdir and self.workdir in node.parents:
            os.lchown(node, self.uid, self.uid)
            node = node.parent

    def _after_exec(self) -> None:
        kill_uid(self.uid)

    @staticmethod
    def command_for(workdir: str, argv: list[str], *, limits: dict[str, int], uid: int,
                    env: dict[str, str] | None = None, binds: dict[str, str] | None = None) -> list[str]:
        setenv = [part for name, value in (env or {}).items() for part in ("--setenv", name, value)]
        mounts = [*_mount_points(list((binds or {}).values())),
                  *[part for host, inside in (binds or {}).items() for part in ("--ro-bind", host, inside)]]
        return [
            # If the process that started the sandbox dies (even by SIGKILL), bwrap gets SIGKILL too,
            # and --die-with-parent takes the sandboxed command with it.
            "setpriv", "--pdeathsig", "KILL",
            "bwrap",
            # No user namespace: bwrap runs as root so that it can reach every bind source.
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin",
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(limits["tmp_mb"] * 1024 * 1024), "--tmpfs", "/tmp",
            "--bind", workdir, "/work", *mounts, "--chdir", "/work",
            "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/work", *setenv,
            "--",
            # Inside, after the mounts: drop to the sandbox's uid for good (no capabilities left, none
            # to regain), then the limits, then the command.
            "setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
            "prlimit",
            f"--cpu={limits['cpu_s']}",
            f"--as={limits['address_space_mb'] * 1024 * 1024}",
            f"--nproc={limits['nproc']}",
            f"--fsize={_file_cap_mb(limits) * 1024 * 1024}",
            *argv,
        ]  # fmt: skip

    def wrap(self, argv: list[str], env: dict[str, str]) -> list[str]:
        return self.command_for(str(self.workdir), argv, limits=self.limits, uid=self.uid, env=env, binds=self.binds)
