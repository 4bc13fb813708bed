"""Attempts to escape the bubblewrap sandbox, each against a real bwrap sandbox."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from loomrl.env.sandbox import make_sandbox
from loomrl.env.sandbox.bwrap import bwrap_available

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap not installed (make test installs it)")


def run(sb, code: str, timeout: float = 10.0):
    return asyncio.run(sb.exec([sb.python, "-c", code], timeout=timeout))


@pytest.fixture
def sandbox():
    sb = make_sandbox("bwrap")
    yield sb
    sb.close()


def test_runs_python_in_private_workdir(sandbox):
    res = run(sandbox, "import os; open('f.txt','w').write('hi'); print(os.getcwd(), os.getuid())")
    assert res.returncode == 0, res.stderr
    cwd, uid = res.stdout.split()
    assert cwd == "/work" and int(uid) != 0
    assert (sandbox.workdir / "f.txt").read_text() == "hi"


def test_no_network_even_to_host_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\nexcept OSError as e:\n    print('BLOCKED', e)"
    res = run(sandbox, code)
    server.close()
    assert "BLOCKED" in res.stdout and not accepted


def test_cannot_read_another_sandbox_or_write_outside(sandbox):
    other = make_sandbox("bwrap")
    try:
        (other.workdir / "secret.txt").write_text("s3cret")
        res = run(sandbox, f"print(open('{other.workdir}/secret.txt').read())")
        assert res.returncode != 0 and "s3cret" not in res.stdout
        res = run(sandbox, "open('/usr/evil', 'w').write('x')")
        assert res.returncode != 0
        res = run(sandbox, "import os; print(sorted(os.listdir('/')))")
        assert "root" not in res.stdout and "home" not in res.stdout
    finally:
        other.close()


def test_timeout_kills_the_whole_process_tree(sandbox):
    code = "import subprocess, time\nsubprocess.Popen(['/usr/bin/sleep', '300'])\ntime.sleep(300)"
    res = run(sandbox, code, timeout=1.0)
    assert res.timed_out
    ps = asyncio.run(make_sandbox("process").exec(["pgrep", "-f", "sleep 300"], timeout=5))
    assert ps.stdout.strip() == ""


def test_fork_bomb_is_contained(sandbox):
    code = "import os\nn=0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError:\n    print('LIMIT', n)"
    res = run(sandbox, code, timeout=20)
    assert "LIMIT" in res.stdout
    assert int(res.stdout.split()[1]) < 200
    again = run(sandbox, "print('ok')")  # a new sandbox command still works
    assert again.stdout.strip() == "ok"
