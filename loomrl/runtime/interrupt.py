"""Stopping a run's event loop on a signal the way Ctrl-C does, also where SIGINT is ignored.

On Ctrl-C asyncio.Runner cancels the run's main task: its finally blocks clean up (the trainer stopped, the env and
browser pools closed) while the loop still serves every other task. Runner installs that handler only when SIGINT has
Python's default one; in a background job of a script SIGINT is ignored, and `kill PID` (SIGTERM, runtime/stopping.py)
then had only KeyboardInterrupt to raise, from wherever the loop was. asyncio.run then cancels every task at once,
Playwright's connection to its browsers among them, and a cleanup awaiting a browser can wait for ever (seen: a MiniWoB
run stopped so hung with its browsers up; another left pool tasks "destroyed but pending"). `interrupt` cancels the main
task instead, as Runner would; the driver turns the cancellation back into KeyboardInterrupt (`interrupted`).
Not here: which signals stop a run, and the line it ends with (runtime/stopping.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from contextlib import contextmanager

_main: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None  # the run's main task while it runs
_interrupted = False


@contextmanager
def interruptible() -> Generator[None]:
    """Within the run's main coroutine: `interrupt` cancels its task."""
    global _main, _interrupted
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("interruptible: not inside a task")
    _main, _interrupted = (asyncio.get_running_loop(), task), False
    try:
        yield
    finally:
        _main = None


def interrupt() -> bool:
    """Cancel the run's main task, as Ctrl-C does under asyncio.Runner (safe from a signal handler: the cancel runs on
    the loop, between two of its callbacks); False when no run is in its loop."""
    global _interrupted
    if _main is None:
        return False
    loop, task = _main
    if task.done() or loop.is_closed():
        return False
    _interrupted = True
    loop.call_soon_threadsafe(task.cancel)
    return True


def interrupted() -> bool:
    """Whether the last run's main task was cancelled by `interrupt`."""
    return _interrupted
