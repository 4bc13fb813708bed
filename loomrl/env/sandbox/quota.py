"""The workdir's disk quota (`limits["disk_mb"]`): a filesystem of that size where the sandbox can mount one,
else sizes checked.

Mounted (bwrap, which runs as root): the workdir is a tmpfs of `disk_mb` mounted on the host for the
sandbox's lifetime, so files persist between commands, host-side file access and snapshots see them, and
a write past the quota fails with ENOSPC however fast it is. Its pages are memory, taken only as files
fill it (at most `disk_mb` per sandbox; a pool's sandboxes are emptied between leases); inodes are
capped at one per 4 KiB page, so empty files cannot take kernel memory without bound either. A mount
left by a process that died without closing its sandboxes (SIGKILL) is removed when the next sandbox
is mounted on the machine (`sweep_stale`).

Checked (the process and docker backends, or where the mount is refused): the workdir's size is polled
while a command runs and measured when it ends (base.py); a write that finishes between two polls is
caught only by the measurement after it, so the files stay over the quota until removed. The process
backend also caps each file at the quota (RLIMIT_FSIZE), so a single file cannot pass it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loomrl.processes import pid_alive

MB = 1024 * 1024
_PAGE = 4096
# <tmp>/loomrl-<backend>-<pid>-<random>/work: the pid is that of the process that made the sandbox
_WORKDIR = re.compile(r"/loomrl-[a-z]+-(\d+)-[^/]+/work$")


@dataclass(slots=True, kw_only=True, frozen=True)
class DiskUse:
    bytes: int
    files: int  # inodes in use (mounted only; 0 when sizes are checked)
    full: bool  # no room for one more block or file (mounted), or at or past the quota (checked)


def mount_tmpfs(path: Path, size_mb: int, uid: int) -> str | None:
    """Mount a tmpfs of `size_mb` at `path`, owned by `uid`; None, or why it could not (mount's own message)."""
    sweep_stale()
    options = f"size={size_mb * MB},nr_inodes={size_mb * MB // _PAGE},mode=0700,uid={uid},gid={uid},nosuid,nodev"
    try:
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "loomrl-work", str(path)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{type(err).__name__}: {err}"
    return None if run.returncode == 0 else (run.stderr.strip() or f"mount exited with {run.returncode}")


def unmount(path: Path) -> None:
    """Detach the tmpfs at `path` (lazily: a process of the sandbox's that still holds it cannot block this)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def sweep_stale() -> int:
    """Unmount and remove sandbox workdirs mounted by processes that are gone; how many. Run before every mount
    (reading the mount table costs well under a millisecond, the mount itself several)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return 0
    swept = 0
    for line in lines:
        point = line.split()[4].replace("\\040", " ")  # mountinfo escapes spaces in paths
        match = _WORKDIR.search(point)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            unmount(Path(point))
            shutil.rmtree(Path(point).parent, ignore_errors=True)
            swept += 1
    return swept


def disk_use(path: Path, quota_bytes: int, mounted: bool) -> DiskUse:
    """What the workdir at `path` holds against its quota."""
    if mounted:
        st = os.statvfs(path)
        return DiskUse(bytes=(st.f_blocks - st.f_bfree) * st.f_frsize, files=st.f_files - st.f_ffree,
                       full=st.f_bavail == 0 or st.f_favail == 0)
    used = dir_size(path)
    return DiskUse(bytes=used, files=0, full=used >= quota_bytes)


def dir_size(path: Path) -> int:
    """Bytes used by the files under `path` (symlinks not followed)."""
    total = 0
    stack = [str(path)]
    while stack:
        # a folder or file the command removes (or makes unreadable) meanwhile is skipped
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    return total
