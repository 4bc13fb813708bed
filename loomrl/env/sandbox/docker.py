"""Docker sandbox, for machines with a Docker engine.

One long-lived container per sandbox (`sleep infinity`), started on construction: no network
(`--network none`), memory, pids and CPU limits, a read-only root filesystem with a size-limited
tmpfs /tmp, all capabilities dropped, an unprivileged user, and the host workdir bind-mounted at /work
(so write_file/read_file/snapshot/reset work on the host side as for bwrap). Each command is a
`docker exec`; a command that passes its timeout or the disk quota gets the container restarted,
which kills everything in it. `close()` removes the container.

Not run here: this machine has no Docker engine, so the tests only check that the backend refuses to
start with a clear error and that the command lines it would run carry every limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from loomrl.env.sandbox.base import SandboxError, _SubprocessSandbox, command_works

DEFAULT_LIMITS = {"memory_mb": 1024, "nproc": 64, "cpus": 1, "disk_mb": 256, "tmp_mb": 64}
DEFAULT_IMAGE = os.environ.get("LOOMRL_DOCKER_IMAGE", "python:3.11-slim")


def docker_available() -> bool:
    return shutil.which("docker") is not None and command_works(["docker", "info"])


class DockerSandbox(_SubprocessSandbox):
    backend = "docker"
    default_limits = DEFAULT_LIMITS

    def __init__(self, root: str | None = None, limits: dict[str, int] | None = None, image: str = DEFAULT_IMAGE,
                 start: bool = True):
        super().__init__(root, limits)
        self.image = image
        self.container = f"loomrl-{os.getpid()}-{self._home.name}"
        if start:
            if not docker_available():
                self.close()
                raise SandboxError("sandbox error: no usable Docker engine here (`docker info` failed); "
                                   "use env.sandbox=bwrap or install and start Docker")
            run = subprocess.run(self.run_command(), capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                self.close()
                raise SandboxError(f"sandbox error: docker run failed: {run.stderr.strip()[-300:]}")

    def run_command(self) -> list[str]:
        lim = self.limits
        return [
            "docker", "run", "-d", "--rm", "--name", self.container,
            "--network", "none", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--memory", f"{lim['memory_mb']}m", "--pids-limit", str(lim["nproc"]), "--cpus", str(lim["cpus"]),
            "--tmpfs", f"/tmp:rw,size={lim['tmp_mb']}m",
            "--user", "65534:65534",
            "-v", f"{self.workdir}:/work", "-w", "/work",
            self.image, "sleep", "infinity",
        ]  # fmt: skip

    def wrap(self, argv: list[str], env: dict[str, str]) -> list[str]:
        setenv = [part for name, value in env.items() for part in ("-e", f"{name}={value}")]
        return ["docker", "exec", "-i", "-w", "/work", *setenv, self.container, *argv]

    def _kill(self, pgid: int) -> None:
        super()._kill(pgid)  # the docker client
        # Killing the client does not stop the command inside the container; restarting it does.
        subprocess.run(["docker", "restart", "-t", "0", self.container], capture_output=True, timeout=60)

    def close(self) -> None:
        if not self.closed and getattr(self, "container", None) and shutil.which("docker"):
            subprocess.run(["docker", "rm", "-f", self.container], capture_output=True, timeout=60)
        super().close()
