"""The Docker backend. No Docker engine runs on this machine, so what is tested here is only that it
refuses to start with a clear error, and the command lines it would run (built without starting a
container: start=False); running containers is not exercised."""

from __future__ import annotations

import pytest

from loomrl.env.sandbox import SandboxError, make_sandbox
from loomrl.env.sandbox.docker import DockerSandbox, docker_available


@pytest.mark.skipif(docker_available(), reason="a Docker engine is present; this checks the error without one")
def test_refuses_to_start_without_an_engine():
    with pytest.raises(SandboxError, match="no usable Docker engine"):
        make_sandbox("docker")


def test_command_lines_carry_every_limit():
    sb = DockerSandbox(limits={"memory_mb": 512, "nproc": 32}, start=False)
    try:
        run = sb.run_command()
        for flag, value in [("--network", "none"), ("--memory", "512m"), ("--pids-limit", "32"), ("--cpus", "1"),
                            ("--cap-drop", "ALL"), ("--user", "65534:65534"), ("--tmpfs", "/tmp:rw,size=64m")]:
            assert run[run.index(flag) + 1] == value
        assert "--read-only" in run and f"{sb.workdir}:/work" in run
        ex = sb.wrap(["python3", "-c", "1"], {"A": "b"})
        assert ex[:3] == ["docker", "exec", "-i"] and ex[ex.index("-e") + 1] == "A=b" and ex[-3:] == ["python3", "-c", "1"]
        with pytest.raises(SandboxError, match="unknown limit"):
            DockerSandbox(limits={"cpu_s": 1}, start=False)
    finally:
        sb.close()
