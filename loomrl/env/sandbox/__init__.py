"""Sandboxes that run tool code: bubblewrap (default on Linux), Docker, or a plain process (development only)."""

from loomrl.env.sandbox.base import ExecResult, Health, Sandbox, SandboxError
from loomrl.env.sandbox.factory import make_sandbox

__all__ = ["ExecResult", "Health", "Sandbox", "SandboxError", "make_sandbox"]
