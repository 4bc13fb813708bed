"""make_sandbox: the backend a run asks for (env.sandbox), kept apart from base.py so that the backends
import the shared machinery without base.py importing them back."""

from __future__ import annotations

from loomrl.env.sandbox.base import PooledSandbox, SandboxError
from loomrl.env.sandbox.bwrap import BwrapSandbox, bwrap_available
from loomrl.env.sandbox.docker import DockerSandbox
from loomrl.env.sandbox.process import ProcessSandbox

_BACKENDS = {"bwrap": BwrapSandbox, "process": ProcessSandbox, "docker": DockerSandbox}


def resolve_backend(backend: str) -> str:
    """The backend `backend` names; `auto`: bwrap when it is installed and works here, else process."""
    if backend == "auto":
        return "bwrap" if bwrap_available() else "process"
    return backend


def limit_keys(backend: str) -> list[str]:
    """The keys `limits` may set for `backend` (bwrap, process or docker), sorted."""
    return sorted(_BACKENDS[backend].default_limits)


def make_sandbox(backend: str = "auto", limits: dict[str, int] | None = None,
                 binds: dict[str, str] | None = None) -> PooledSandbox:
    """`auto` picks bwrap when it is installed and works, else the (loud) process backend. `binds`
    (host path -> path inside, read-only) are honoured by bwrap; the process backend sees the host
    anyway, and the docker backend refuses them (mount them in the image instead)."""
    if binds and backend == "docker":
        raise SandboxError("sandbox error: extra binds are not supported by the docker backend")
    backend = resolve_backend(backend)
    if backend == "bwrap":
        if not bwrap_available():
            raise SandboxError("sandbox error: bubblewrap is not usable here; install it (apt-get install -y "
                               "bubblewrap) or set env.sandbox=process")
        return BwrapSandbox(limits=limits, binds=binds)
    if backend == "process":
        return ProcessSandbox(limits=limits)
    if backend == "docker":
        return DockerSandbox(limits=limits)
    raise SandboxError(f"sandbox error: unknown backend {backend!r}; use bwrap, process, docker or auto")
