"""The workdir's disk quota holds against writes too fast for polling: on bwrap the workdir is a filesystem of
the quota's size (a write past it fails), on the process backend no file may outgrow it and the size is
measured after every command. Real sandboxes; each write is one shell command that ends in milliseconds,
well inside one 50 ms poll (the kind that used to pass)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from loomrl.env.sandbox import SandboxError, make_sandbox
from loomrl.env.sandbox.bwrap import bwrap_available
from loomrl.env.sandbox.quota import MB, dir_size, sweep_stale

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not installed (make test installs it)")
BACKENDS = [pytest.param("bwrap", marks=needs_bwrap), "process"]
FAST_5MB = ["/bin/sh", "-c", "head -c 5000000 /dev/zero > f"]


def _run(box, argv: list[str]):
    return asyncio.run(box.exec(argv, timeout=30))


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fast_write_past_the_quota_fails_and_is_reported(backend):
    box = make_sandbox(backend, limits={"disk_mb": 1})
    try:
        res = _run(box, FAST_5MB)
        assert res.duration_s < 1.0  # over before polling could see it
        assert res.returncode != 0 and res.killed == "disk_quota", (res.returncode, res.stderr)
        assert "[loomrl] disk quota" in res.stderr and "1 MB (env.sandbox_limits.disk_mb)" in res.stderr
        assert (box.workdir / "f").stat().st_size <= 1 * MB  # the write itself stopped at the quota
    finally:
        box.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_under_the_quota_passes(backend):
    box = make_sandbox(backend, limits={"disk_mb": 1})
    try:
        res = _run(box, ["/bin/sh", "-c", "head -c 500000 /dev/zero > f"])
        assert res.returncode == 0 and res.killed is None and "[loomrl]" not in res.stderr, res.stderr
        assert (box.workdir / "f").stat().st_size == 500_000
    finally:
        box.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_disk_mb_0_is_no_quota(backend):
    """0 turns the quota off (as it always did): no mount, no size checks, and no file-size cap of 0 bytes."""
    box = make_sandbox(backend, limits={"disk_mb": 0})
    try:
        assert not _mounted(box.workdir)
        res = _run(box, ["/bin/sh", "-c", "head -c 2000000 /dev/zero > f"])
        assert res.returncode == 0 and res.killed is None, res.stderr
        assert (box.workdir / "f").stat().st_size == 2_000_000
    finally:
        box.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_small_files_past_the_quota_fail(backend):
    """Forty files of 50 kB (2 MB) in one command: no single file comes near the quota."""
    box = make_sandbox(backend, limits={"disk_mb": 1})
    try:
        res = _run(box, ["/bin/sh", "-c", "for i in $(seq 40); do head -c 50000 /dev/zero > f$i; done"])
        assert res.killed == "disk_quota" and "disk quota" in res.stderr, (res.returncode, res.stderr)
        if backend == "bwrap":  # the filesystem refused the writes past the quota
            assert res.returncode != 0 and "No space left on device" in res.stderr
            assert dir_size(box.workdir) <= 1 * MB
    finally:
        box.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_quota_holds_across_commands(backend):
    """Files persist between a sandbox's commands: the quota counts them all (two fast writes of 600 kB, each
    under it), a full workdir still runs commands that add nothing, and removing a file makes room."""
    box = make_sandbox(backend, limits={"disk_mb": 1})
    try:
        first = _run(box, ["/bin/sh", "-c", "head -c 600000 /dev/zero > a"])
        assert first.returncode == 0 and first.killed is None, first.stderr
        second = _run(box, ["/bin/sh", "-c", "head -c 600000 /dev/zero > b"])
        assert second.killed == "disk_quota" and "disk quota" in second.stderr, second.stderr
        if backend == "bwrap":
            assert second.returncode != 0 and "No space left on device" in second.stderr
        listing = _run(box, ["/bin/ls"])
        assert listing.returncode == 0 and listing.killed is None and listing.stdout.split() == ["a", "b"]
        freed = _run(box, ["/bin/sh", "-c", "rm b && head -c 300000 /dev/zero > c"])
        assert freed.returncode == 0 and freed.killed is None, freed.stderr
    finally:
        box.close()


@needs_bwrap
def test_the_quota_filesystem_survives_reset_refuses_host_writes_and_goes_at_close():
    box = make_sandbox("bwrap", limits={"disk_mb": 1})
    try:
        assert _mounted(box.workdir)
        box.write_file("a.bin", b"x" * 600_000)
        with pytest.raises(SandboxError) as full:
            box.write_file("b.bin", b"x" * 600_000)
        assert str(full.value) == ("sandbox error: writing 'b.bin': the workdir's disk quota of 1 MB "
                                   "(env.sandbox_limits.disk_mb) is full")
        box.reset()
        assert list(box.workdir.iterdir()) == [] and _mounted(box.workdir)
        again = _run(box, ["/bin/sh", "-c", "head -c 600000 /dev/zero > a && head -c 600000 /dev/zero > b"])
        assert again.killed == "disk_quota" and again.returncode != 0, again.stderr
    finally:
        box.close()
    assert not _mounted(box.workdir) and not box.workdir.exists()


@needs_bwrap
def test_a_snapshot_is_restored_into_the_quota_filesystem():
    box = make_sandbox("bwrap", limits={"disk_mb": 2})
    try:
        box.write_file("repo/main.py", "print('hi')\n")
        box.snapshot()
        _run(box, ["/bin/sh", "-c", "head -c 1500000 /dev/zero > junk"])
        box.reset()
        assert sorted(p.name for p in box.workdir.iterdir()) == ["repo"] and _mounted(box.workdir)
        res = _run(box, ["/usr/bin/python3", "repo/main.py"])
        assert res.stdout == "hi\n" and res.killed is None, res.stderr
    finally:
        box.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_mounts_left_by_a_dead_process_are_swept(tmp_path):
    """A run killed with SIGKILL cannot unmount its sandboxes' workdirs; the next sandbox mounted does."""
    dead = subprocess.Popen(["/bin/true"])
    dead.wait()
    work = tmp_path / f"loomrl-bwrap-{dead.pid}-abc" / "work"
    work.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "loomrl-work", str(work)], check=True)
    try:
        assert _mounted(work)
        assert sweep_stale() >= 1
        assert not _mounted(work) and not work.parent.exists()
    finally:
        if _mounted(work):
            subprocess.run(["umount", "-l", str(work)])
