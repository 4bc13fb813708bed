"""Reward worker processes: the recipe's reward functions (reward.function, reward.functions) run in child processes,
each call bounded by reward.timeout_s; a worker past it is killed and replaced.

Why processes and not threads: Python cannot stop a thread, and a thread is not even bounded by waiting on it. A
catastrophic regex (`(a+)+$`, a classic in answer-matching rewards) holds the GIL: run on a thread under a 0.5 s
`asyncio.wait_for`, it kept the event loop itself from running for 14.3 s, until the regex ended. An abandoned thread
also keeps the interpreter from exiting (concurrent.futures joins its threads at exit): a run whose reward function
hung for good would never end. A process is killed at its deadline, whatever it runs. The cost, measured here (2-core
CPU, a 2,000-token trajectory; tests/reward/test_reward_workers.py prints it): 0.26 ms a call against 0.07 ms on a
thread, so about 0.2 ms more (the trajectory pickled over a pipe, the values back), and 0.07-0.12 s to start a worker
(a fresh interpreter, loomrl.types and the reward's module; once per worker, and again after each kill): small next
to an episode's generation, and the recipe's functions are code we have never seen.

What is covered: a function that raises, returns what is not a reward, hangs (in Python or in C), or kills its process
(a segfault, os._exit, the OOM killer) fails only its trajectory, with the reason and the function's name; the next
call gets a live worker. What is not: a function's side effects outside its process (files, servers it started), and
memory or CPU limits (a function that allocates without bound is stopped by the kernel, not by us).

Protocol (multiprocessing.connection over two pipes): the parent sends (specs, max_steps) once, the child imports the
functions and answers "ready"; then per trajectory the parent sends (trajectory, task) and the child runs the terms in
order, answering one (ok, components) per term and stopping after the first error, so that the parent always knows
which function it is waiting on. The child is started as `python -c` with the parent's sys.path, never by
multiprocessing (whose spawn re-imports the parent's __main__: a user's training script would run again in it).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from loomrl.errors import with_frames
from loomrl.reward.terms import RewardTerm, Task, Trajectory

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # for a worker to import the reward functions (a module that imports torch or sympy is slow)


class RewardError(Exception):
    """A trajectory's reward could not be computed; the message names the function and says why."""


class _Worker:
    """One child process and its two pipe ends."""

    def __init__(self, terms: list[RewardTerm], max_steps: int):
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        # the parent's sys.path as it is, so that loomrl and the reward modules resolve as they did here
        script = (f"import sys; sys.path[:] = {sys.path!r}; from loomrl.reward.workers import serve; "
                  f"serve({to_child}, {from_child})")
        self.proc = subprocess.Popen([sys.executable, "-c", script], pass_fds=(to_child, from_child),
                                     stdin=subprocess.DEVNULL)  # its prints go where this process's go
        os.close(to_child)
        os.close(from_child)
        self.send = Connection(from_parent, readable=False)
        self.recv = Connection(to_parent, writable=False)
        self.send.send(([t.spec for t in terms], [t.name for t in terms], [str(t.style) for t in terms], max_steps))
        self.ready = False
        self.dead = False

    def answer(self, timeout_s: float | None) -> tuple[str, Any] | None:
        """The child's next message, or None if none came within timeout_s (None: it waits); EOFError if it died."""
        if not self.recv.poll(timeout_s):
            return None
        return self.recv.recv()

    def kill(self) -> None:
        self.dead = True
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()

    def close(self) -> None:
        """Ends an idle worker: EOF on its pipe ends its loop; one that does not end (busy) is killed."""
        self.send.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.recv.close()


class RewardWorkers:
    """`n` worker processes running `terms`, each call of each function bounded by `timeout_s` (None: unbounded, as
    RewardPool's; a worker's start stays bounded by START_TIMEOUT_S). evaluate() blocks and
    is thread-safe: at most `n` callers at once (RewardPool's n threads), each on a worker of its own. Workers start
    on first use."""

    def __init__(self, terms: list[RewardTerm], n: int, timeout_s: float | None, max_steps: int = 0):
        self.terms = terms
        self.timeout_s = timeout_s
        self.max_steps = max_steps
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(n):
            self._idle.put(None)  # not started yet
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.restarts = 0  # workers killed (past the timeout) or found dead, and replaced
        self.closed = False
        atexit.register(self.close)  # no orphans, even when the run ends without closing its pool

    def evaluate(self, traj: Trajectory, task: Task) -> list[dict[str, float | None]]:
        """Each term's components for one trajectory, in order; RewardError naming the function that failed."""
        worker = self._idle.get()
        try:
            if worker is None:
                worker = self._start()
            return self._run(worker, traj, task)
        finally:
            self._idle.put(None if worker is None or worker.dead else worker)  # a dead one: a fresh one next time

    def _start(self) -> _Worker:
        with self._lock:
            if self.closed:  # a call that outlived the run's end
                raise RewardError("the reward pool was closed")
            worker = _Worker(self.terms, self.max_steps)
            self._all.add(worker)
        return worker

    def _drop(self, worker: _Worker, why: str) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.restarts += 1
        log.warning("reward worker process %d ended: %s (%d replaced so far)", worker.proc.pid, why, self.restarts)

    def _run(self, worker: _Worker, traj: Trajectory, task: Task) -> list[dict[str, float | None]]:
        if not worker.ready:
            self._expect_ready(worker)
        try:
            worker.send.send((traj, task))
        except OSError as err:  # it died while idle
            self._drop(worker, f"found dead ({err})")
            raise RewardError(f"its reward worker process had died ({err})") from None
        except Exception as err:  # noqa: BLE001 - not picklable (nothing was written): this trajectory only
            raise RewardError(f"the trajectory could not be sent to a reward worker: {type(err).__name__}: {err}") \
                from None
        values = []
        for term in self.terms:
            try:
                message = worker.answer(self.timeout_s)
            except (EOFError, OSError):
                code = worker.proc.wait()
                self._drop(worker, f"it died in {term.name} (exit code {code})")
                raise RewardError(f"{term.name}: its reward worker process died (exit code {code})") from None
            if message is None:  # killing its process is the only way to stop a function that runs on
                self._drop(worker, f"killed: {term.name} ran past reward.timeout_s={self.timeout_s:g}s")
                raise RewardError(f"{term.name} ran past reward.timeout_s={self.timeout_s:g}s (its worker process "
                                  "was killed and is replaced)")
            kind, value = message
            if kind == "error":
                raise RewardError(value)
            values.append(value)
        return values

    def _expect_ready(self, worker: _Worker) -> None:
        try:
            message = worker.answer(max(START_TIMEOUT_S, self.timeout_s or 0.0))
        except (EOFError, OSError):
            message = ("error", f"it exited with code {worker.proc.wait()} before it was ready")
        if message is None:
            message = ("error", f"it did not import the reward functions within {START_TIMEOUT_S:g}s")
        kind, value = message
        if kind != "ready":
            self._drop(worker, f"it could not start: {value}")
            raise RewardError(f"a reward worker process could not start: {value}")
        worker.ready = True

    def close(self) -> None:
        """Ends every worker (one still running a function is killed)."""
        if self.closed:
            return
        atexit.unregister(self.close)
        with self._lock:
            self.closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.close()


def serve(from_parent: int, to_parent: int) -> None:
    """A reward worker process's loop (run by `python -c`); see the module's doc for the protocol."""
    import importlib

    from loomrl.reward.terms import NotAReward, RewardStyle, evaluate, reward_style

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent ends us
    recv, send = Connection(from_parent, writable=False), Connection(to_parent, readable=False)
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    specs, names, styles, max_steps = recv.recv()
    terms = []
    try:
        for spec, name, style in zip(specs, names, styles):
            module, _, attr = spec.partition(":")
            fn: Any = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
            if reward_style(fn) != style:
                raise TypeError(f"{spec} is not the function the run imported")
            # the weights are the parent's (it combines the components)
            terms.append(RewardTerm(name=name, spec=spec, fn=fn, weight=1.0, style=RewardStyle(style)))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which marks its trajectories
        send.send(("error", f"importing the reward functions: {type(err).__name__}: {err}"))
        return
    send.send(("ready", None))
    try:
        while True:
            traj, task = recv.recv()
            for term in terms:
                try:
                    send.send(("ok", evaluate(term, traj, task, max_steps)))
                except NotAReward as err:
                    send.send(("error", str(err)))
                    break
                except (Exception, SystemExit) as err:  # noqa: BLE001 - errors are data: the parent marks its trajectory
                    send.send(("error", with_frames(f"{term.name} raised {type(err).__name__}: {err}", err)))
                    break
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent closed us, or died
        return


def _exit_when_orphaned(parent: int) -> None:
    """A worker whose parent died (SIGKILL, no cleanup) ends within a second, even while a function runs on in Python."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
