"""How `loomrl train` stops on a signal: SIGTERM (`kill PID`) and SIGHUP (a closed terminal) take the Ctrl-C path,
so the run's cleanup stops its trainer process (which frees its shared-memory weights) instead of the process
ending outright and leaving that one behind; and the one line the run ends with. Not here: the cleanup itself (the
driver's finally) and what a spawned child does when its parent vanishes (train_pool/ranks.py exit_with_parent)."""

from __future__ import annotations

import shlex
import signal
from typing import Any

from loomrl.config import RunConfig
from loomrl.runtime.interrupt import interrupt
from loomrl.runtime.run import RunInterrupted


def stop_as_ctrl_c() -> list[int]:
    """Route SIGTERM and SIGHUP to Ctrl-C's handler; returns the signals received so far (none: not stopped, or by
    Ctrl-C itself)."""
    got: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1:  # stopping already (`timeout` sends twice): the cleanup must finish
            return
        ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(ctrl_c):  # asyncio's while the run's loop runs: it cancels the run, whose finally cleans up
            ctrl_c(signal.SIGINT, frame)
        elif not interrupt():  # SIGINT ignored (a background job of a script): the run's task cancelled as asyncio would
            raise KeyboardInterrupt  # no run in its loop yet: what Ctrl-C would raise

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    return got


def stopped_line(stop: RunInterrupted, by: int, command: list[str], cfg: RunConfig) -> str:
    """Which signal stopped the run, at which step, and what to do next (`command`: the run's, without --resume)."""
    what = f"run stopped by {signal.Signals(by).name} at step {stop.step} of {cfg.trainer.total_steps}"
    if stop.step == 0:  # no ledger yet: the folder does not count as a run (run.py prepare_run_dir)
        return f"{what}: nothing was trained; the same command starts it again"
    if stop.checkpoint_step is None:
        return (f"{what}, before its first checkpoint (checkpoint_every={cfg.checkpoint_every}): nothing to resume; "
                f"to start over, delete {stop.run_dir} or choose another name=")
    return (f"{what}; continue from its latest checkpoint (step {stop.checkpoint_step}) with: "
            f"{shlex.join([*command, '--resume'])}")
