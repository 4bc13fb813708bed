"""Black-box agents: any program that speaks the OpenAI API, run once per rollout in a sandbox against its own gateway
session; its calls become the trajectory, the task's verifier gives the reward.

How the program reaches the gateway and nothing else (bwrap): the sandbox has its own empty network namespace, so no
address outside exists for it. The gateway listens on a unix socket that is mounted into the sandbox read-only; a
launcher, started in the sandbox before the agent, listens on 127.0.0.1:AGENT_PORT inside that namespace and forwards
each connection to the socket, then execs the agent command with OPENAI_BASE_URL=http://127.0.0.1:AGENT_PORT/v1 and
OPENAI_API_KEY=<its session key>. When the agent exits, its pid namespace ends and the forwarder with it. The Python
packages of loomrl's own environment are mounted read-only at /opt/loomrl-site (PYTHONPATH), so an agent written with
the `openai` SDK runs with the sandbox's python3 unchanged.

With the `process` backend (no isolation, development only) the agent gets the gateway's TCP URL.

The task reaches the program as `task.json` in its working directory and the LOOMRL_TASK_PROMPT environment variable
(the prompt only, never the answer). Its standard output is kept for the verifier (for the calculator: the final answer
sentence; else the last assistant message counts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from loomrl.agent.gateway import Budget, Gateway
from loomrl.engine.base import SamplingParams
from loomrl.env.pool import Leases
from loomrl.env.sandbox.base import SandboxError
from loomrl.types import RolloutStatus, Task, Trajectory

AGENT_PORT = 8080
SOCKET_INSIDE = "/run/loomrl/gateway.sock"
SITE_INSIDE = "/opt/loomrl-site"

# Runs inside the sandbox with its python3 (stdlib only): bind the port first (so the agent never
# races the forwarder), fork the forwarder, exec the agent.
LAUNCHER = r"""
import contextlib, os, socket, sys, threading
port, upstream = int(sys.argv[1]), sys.argv[2]
server = socket.create_server(("127.0.0.1", port), backlog=64)  # SO_REUSEADDR set on POSIX
if os.fork() == 0:
    def pipe(src, dst):
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    def serve(conn):
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(upstream)
        except OSError:
            conn.close()
            return
        t = threading.Thread(target=pipe, args=(conn, up), daemon=True)
        t.start()
        pipe(up, conn)
        t.join()
        conn.close()
        up.close()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
server.close()
os.execvp(sys.argv[3], sys.argv[3:])
"""


def site_packages() -> str:
    """The folder holding the `openai` package of this environment (mounted for agent programs)."""
    import openai

    return str(Path(openai.__file__).resolve().parent.parent)


@dataclass(slots=True)
class AgentRun:
    trajectory: Trajectory
    stdout: str
    stderr: str
    returncode: int
    killed: str | None


class BlackBoxRunner:
    """Runs `command` per rollout in a sandbox from `pool` (made with `sandbox_binds()`), against `gateway`."""

    def __init__(self, gateway: Gateway, pool: Leases, command: list[str], *, gateway_url: str,
                 files: dict[str, str] | None = None, timeout_s: float = 300.0, budget: Budget | None = None,
                 sampling: SamplingParams | None = None):
        if not command:
            raise ValueError("black-box agent: agent.command is empty; give the program to run, e.g. "
                             "[python3, agent.py]")
        self.gateway = gateway
        self.pool = pool
        self.command = list(command)
        self.gateway_url = gateway_url  # TCP URL, used by the process backend
        self.files = dict(files or {})
        self.timeout_s = timeout_s
        self.budget = budget
        self.sampling = sampling

    @staticmethod
    def sandbox_binds(socket_path: str) -> dict[str, str]:
        return {socket_path: SOCKET_INSIDE, site_packages(): SITE_INSIDE}

    async def run(self, task: Task, *, group_id: str = "", position: int = -1,
                  sampling: SamplingParams | None = None) -> AgentRun:
        """One rollout; `sampling` (default: the runner's) overrides what the program asks for."""
        session = self.gateway.open_session(task_id=task.task_id, group_id=group_id, position=position,
                                            budget=self.budget, sampling=sampling or self.sampling)
        failed = env_failed = res = None
        try:
            async with self.pool.lease() as sandbox:
                for name, content in self.files.items():
                    sandbox.write_file(name, content)
                sandbox.write_file("task.json", json.dumps({"task_id": task.task_id, "prompt": task.prompt}))
                env = {"OPENAI_API_KEY": session.key, "LOOMRL_TASK_PROMPT": task.prompt}
                # "python3" names the sandbox's interpreter (the process backend's is this one's).
                command = [sandbox.python if self.command[0] == "python3" else self.command[0], *self.command[1:]]
                if sandbox.backend == "process":
                    env["OPENAI_BASE_URL"] = self.gateway_url + "/v1"
                    argv = command
                else:
                    env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{AGENT_PORT}/v1"
                    env["PYTHONPATH"] = SITE_INSIDE
                    argv = [sandbox.python, "-c", LAUNCHER, str(AGENT_PORT), SOCKET_INSIDE, *command]
                res = await sandbox.exec(argv, timeout=self.timeout_s, env=env)
                if res.killed:
                    raise TimeoutError(f"agent program killed ({res.killed}) after {res.duration_s:.1f}s")
        except TimeoutError as err:
            failed = str(err)
        except SandboxError as err:  # no sandbox could be had (or it broke): errors are data
            env_failed = f"{type(err).__name__}: {err}"
        except BaseException:
            self.gateway.close_session(session, failed="rollout cancelled")  # its key must die with it
            raise
        traj = self.gateway.close_session(session, failed=None)
        if failed:
            traj.status, traj.error = RolloutStatus.TIMEOUT, failed
        elif env_failed:
            traj.status, traj.error = RolloutStatus.ENV_ERROR, env_failed
            traj.metadata.env_errors += 1
        elif session.engine_fault:  # whatever the program did next, the engine failed it first
            traj.status, traj.error = RolloutStatus.ENGINE_ERROR, session.engine_fault
        elif res is not None and res.returncode != 0 and traj.status == RolloutStatus.COMPLETED:
            traj.status = RolloutStatus.ENV_ERROR
            traj.error = f"agent program exited with status {res.returncode}: {res.stderr.strip()[-300:]}"
        if session.reward is not None:
            traj.reward_components = dict(session.reward)  # reported by the agent (where allowed)
        return AgentRun(traj, res.stdout if res else "", res.stderr if res else "", res.returncode if res else -1,
                        res.killed if res else "timeout")


def read_agent_files(paths: list[str], base: Path | None = None) -> dict[str, str]:
    """Host files to copy into each agent sandbox, by file name."""
    out = {}
    for p in paths:
        path = Path(p) if base is None or os.path.isabs(p) else base / p
        if not path.is_file():
            raise FileNotFoundError(f"agent.files: {p!r} is not a file (paths are relative to the recipe's folder)")
        out[path.name] = path.read_text()
    return out
