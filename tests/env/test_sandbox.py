"""Attempts to escape or break the bubblewrap sandbox, each against real bwrap sandboxes from a real
EnvPool. Every attack runs next to a sibling sandbox doing honest work; each test checks that the
attack was contained, that the sibling's result is intact, and that the pool still hands out healthy
instances afterwards."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading

import pytest

from loomrl.env.pool import EnvPool
from loomrl.env.sandbox import make_sandbox
from loomrl.env.sandbox.base import ExecResult, SandboxError
from loomrl.env.sandbox.bwrap import bwrap_available

# integration: each test starts sandboxed processes (make test-fast leaves them out; make test runs them)
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not installed (make test installs it)")]

SIBLING = "import hashlib; print(hashlib.sha256(b'sibling' * 100000).hexdigest())"
SIBLING_OUT = __import__("hashlib").sha256(b"sibling" * 100000).hexdigest()


def attack(code: str, timeout: float = 10.0, limits: dict | None = None, check=None) -> ExecResult:
    """Run `code` in one pooled sandbox while a sibling computes; return the attack's result after
    checking the sibling and the pool's health. `check(attacker, result)` runs before the release."""

    async def go() -> ExecResult:
        pool = await EnvPool(lambda: make_sandbox("bwrap", limits=limits), size=2).start()
        try:
            attacker, sibling = await pool.acquire(), await pool.acquire()
            res, sib = await asyncio.gather(
                attacker.exec([attacker.python, "-c", code], timeout=timeout),
                sibling.exec([sibling.python, "-c", SIBLING], timeout=60),
            )
            assert sib.returncode == 0 and sib.stdout.strip() == SIBLING_OUT, sib.stderr
            if check is not None:
                check(attacker, res)
            await pool.release(attacker, broken=res.killed is not None)
            await pool.release(sibling)
            for _ in range(2):  # both instances (or their replacements) are healthy again
                sb = await pool.acquire()
                ok = await sb.exec(["/usr/bin/echo", "ok"], timeout=10)
                assert ok.stdout.strip() == "ok"
                assert sorted(p.name for p in sb.workdir.iterdir()) == []  # reset: nothing left behind
            return res
        finally:
            await pool.close()

    return asyncio.run(go())


def host_processes(pattern: str) -> str:
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.strip()


def test_runs_python_in_private_workdir():
    def check(sb, res):
        assert (sb.workdir / "f.txt").read_text() == "hi"
        assert sb.read_file("f.txt") == "hi" and sb.read_file("/work/f.txt") == "hi"

    res = attack("import os; open('f.txt','w').write('hi'); print(os.getcwd(), os.getuid())", check=check)
    assert res.returncode == 0, res.stderr
    cwd, uid = res.stdout.split()
    assert cwd == "/work" and int(uid) != 0


def test_fork_bomb_is_contained():
    code = ("import os\nn=0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(5); "
            "os._exit(0)\n        n += 1\nexcept OSError:\n    print('LIMIT', n)")
    res = attack(code, timeout=20)
    assert "LIMIT" in res.stdout and int(res.stdout.split()[1]) < 200


def test_memory_hog_is_contained():
    code = "try:\n    x = bytearray(8 * 1024**3)\n    print('ALLOCATED')\nexcept MemoryError:\n    print('DENIED')"
    res = attack(code)
    assert "DENIED" in res.stdout and "ALLOCATED" not in res.stdout


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    res = attack("while True: pass", timeout=1.0)
    assert res.timed_out and res.killed == "timeout" and res.duration_s < 5


def test_cpu_seconds_limit_stops_a_spinner():
    res = attack("while True: pass", timeout=30, limits={"cpu_s": 1})
    assert not res.timed_out and res.returncode != 0 and res.duration_s < 10  # SIGXCPU / SIGKILL from the rlimit


def test_disk_filler_is_killed_at_the_quota_and_tmp_is_bounded():
    code = ("import os\nchunk = b'x' * (1024 * 1024)\ntry:\n    with open('/tmp/t', 'wb') as f:\n        for _ in range(200): f.write(chunk)\n"
            "except OSError as e:\n    print('TMP FULL', flush=True)\ni = 0\nwhile True:\n    with open(f'fill{i}', 'wb') as f:\n"
            "        for _ in range(8): f.write(chunk)\n    i += 1")
    res = attack(code, timeout=60, limits={"disk_mb": 64})
    assert "TMP FULL" in res.stdout
    assert res.killed == "disk_quota", (res.returncode, res.stderr[-300:])


def test_no_network_even_to_host_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\n"
            "except OSError as e:\n    print('BLOCKED', e)")
    res = attack(code)
    server.close()
    assert "BLOCKED" in res.stdout and not accepted


def test_cannot_read_another_sandbox_or_write_outside():
    other = make_sandbox("bwrap")
    try:
        other.write_file("secret.txt", "s3cret")
        res = attack(f"print(open('{other.workdir}/secret.txt').read())")
        assert res.returncode != 0 and "s3cret" not in res.stdout
        res = attack("open('/usr/evil', 'w').write('x')")
        assert res.returncode != 0 and not os.path.exists("/usr/evil")
        res = attack("import os; print(sorted(os.listdir('/')))")
        assert "root" not in res.stdout and "home" not in res.stdout
    finally:
        other.close()


def test_cannot_signal_processes_outside():
    victim = subprocess.Popen(["sleep", "120"])
    try:
        code = (f"import os, signal\ntry:\n    os.kill({victim.pid}, signal.SIGKILL); print('SENT')\n"
                "except OSError as e:\n    print('DENIED', type(e).__name__)\n"
                "print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
        res = attack(code)
        assert "DENIED" in res.stdout
        assert int(res.stdout.split()[-1]) <= 3  # its own pid namespace: only itself and bwrap's init
        assert victim.poll() is None  # still alive
    finally:
        victim.kill()


def test_no_daemon_survives_the_step():
    code = ("import os, subprocess\nif os.fork() == 0:\n    os.setsid()\n    subprocess.Popen(['/usr/bin/sleep', '4242'],"
            " start_new_session=True)\n    os._exit(0)\nprint('daemonized')")

    def check(sb, res):
        assert "daemonized" in res.stdout
        assert host_processes("sleep 4242") == ""  # gone when the step ended

    attack(code, check=check)


def test_host_side_file_access_refuses_planted_symlinks():
    async def go():
        sb = make_sandbox("bwrap")
        try:
            await sb.exec(["/usr/bin/ln", "-s", "/etc/shadow", "evil"], timeout=10)
            await sb.exec(["/usr/bin/ln", "-s", "/etc", "etc"], timeout=10)
            with pytest.raises(SandboxError, match="outside"):
                sb.read_file("evil")
            with pytest.raises(SandboxError, match="outside"):
                sb.write_file("etc/evil", "x")
            with pytest.raises(SandboxError, match="outside"):
                sb.read_file("../snapshot/x")
        finally:
            sb.close()

    asyncio.run(go())


def test_cli_sandbox_run(capsys, tmp_path):
    from loomrl.cli import main

    script = tmp_path / "hello.py"
    script.write_text("import os; print('hello from', os.getcwd())")
    assert main(["sandbox", "run", "--backend", "bwrap", "--file", str(script), "--", "python3", "hello.py"]) == 0
    out = capsys.readouterr().out
    assert "hello from /work" in out and "backend bwrap, exit code 0" in out
    assert main(["sandbox", "run", "--timeout", "0.5", "--", "sleep", "5"]) == 124
    assert "killed: timeout" in capsys.readouterr().out
    assert main(["sandbox", "run", "--", "python3", "-c", "raise SystemExit(3)"]) == 3
    assert main(["sandbox", "run", "--limit", "bogus=1", "--", "true"]) == 2
    assert "unknown limit(s) ['bogus']" in capsys.readouterr().err
