"""BuiltinEngine.close() with work in flight on the engine's thread: the process that closed it must still exit
cleanly.

Why this matters: the engine's thread is a daemon thread that runs torch ops (its steps, and the
sync trainer's steps with their checkpoint writes, borrowed through `call`). On CPython before 3.14 a daemon thread
that comes back from a torch op after the interpreter has begun to finalize is ended with pthread_exit, whose
unwinding reaches a noexcept C++ destructor (the op's GIL release guard) and aborts the process:
"terminate called without an active exception", exit code 134 (CPython gh-87135). close() joining its thread for a
fixed 10 s leaves it running whenever the step in flight is longer (a SmolLM2 prefill or training step on a CPU
takes 10-20 s), so a SIGTERM'd run printed its clean-stop line and then aborted.

The work in flight here is a borrowed call of 12 s of matrix products, standing in for a long step: real torch ops,
nothing mocked. It runs in a subprocess because the failure is the interpreter's own exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration  # starts a process and waits on its exit

CHILD = textwrap.dedent("""
    import threading, time
    import torch
    from loomrl.config import ModelConfig
    from loomrl.engine.builtin.engine import BuiltinEngine
    from loomrl.model.loader import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(ModelConfig(kind="tiny"))
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    started = threading.Event()

    def long_step():  # torch ops for 12 s, longer than close() used to wait
        started.set()
        a, t0 = torch.randn(128, 128), time.monotonic()
        while time.monotonic() - t0 < 12:
            a @ a

    done = engine.call(long_step)
    assert started.wait(60), "the engine's thread never ran the call"
    engine.close()
    print("closed; call done:", done.done(), flush=True)
""")


def test_a_process_that_closes_its_engine_mid_step_exits_cleanly():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out, out[-2000:]
    assert proc.returncode == 0, out[-2000:]
    assert "closed; call done: True" in proc.stdout, out[-2000:]  # close() returned after the step in flight
