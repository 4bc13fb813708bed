"""An async run ended by a signal takes every process it started with it and frees their shared memory:
SIGTERM (`kill PID`) stops it as Ctrl-C does, saying at which step and how to continue; SIGKILL of the run's
process leaves its trainer process orphaned, which then exits by itself and unlinks its weight segments."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loomrl.run_folder import read_ledger

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen, list[str]]:
    """A long async run of the tiny recipe (its default reward gives skipped steps: each takes milliseconds), and
    its output as it comes (read on a thread: a child that outlives the run keeps the pipe open)."""
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", f"name={name}",
            "progress=false", "runtime.mode=async", "trainer.total_steps=100000", "checkpoint_every=2",
            "eval.n_tasks=0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _wait_for_steps(proc: subprocess.Popen, lines: list[str], run_dir: Path, steps: int) -> None:
    deadline = time.time() + 120
    while len(read_ledger(run_dir)) < steps:
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.time() < deadline, f"the run did not reach step {steps} in time"
        time.sleep(0.2)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    parents = {int(e.name): int(s[1]) for e in Path("/proc").iterdir()
               if e.name.isdigit() and (s := _stat(int(e.name))) is not None}
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        out += kids
        todo += kids
    return out


def _shm_mapped(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes map: weight segments, and the semaphores of multiprocessing's queues."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return names


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"]


def _wait_gone(pids: list[int], shm: set[str], within_s: float) -> tuple[list[int], list[str]]:
    """Processes still alive and /dev/shm files still there once all are gone, or after `within_s`."""
    deadline = time.time() + within_s
    while True:
        left, files = _alive(pids), sorted(n for n in shm if (Path("/dev/shm") / n).exists())
        if (not left and not files) or time.time() > deadline:
            return left, files
        time.sleep(0.2)


def _kill_all(pids: list[int]) -> None:
    """A failed test leaves nothing behind either: SIGTERM first (the trainer process unlinks its segments), then
    SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in _alive(pids):
            os.kill(p, sig)
        _wait_gone(pids, set(), 5)


def test_sigterm_stops_the_run_as_ctrl_c_does_and_everything_it_started_ends(tmp_path):
    proc, lines = _start(tmp_path, "term")
    pids: list[int] = []
    try:
        _wait_for_steps(proc, lines, tmp_path / "term", 3)  # past the first checkpoint (step 2)
        pids = _descendants(proc.pid)
        shm = _shm_mapped([proc.pid, *pids])
        assert any(n.startswith("loomrl-w-") for n in shm), shm  # the trainer's weight segments
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        left, files = _wait_gone(pids, shm, 10)
    finally:
        proc.kill()
        _kill_all(pids)
    out = "".join(lines)
    assert not left and not files, (left, files, out[-3000:])
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stopped = re.search(r"run stopped by SIGTERM at step (\d+) of 100000; continue from its latest checkpoint "
                        r"\(step (\d+)\) with: (loomrl train .* --resume)$", out, re.MULTILINE)
    assert stopped, out[-3000:]
    step, ckpt, command = int(stopped[1]), int(stopped[2]), stopped[3]
    assert step == read_ledger(tmp_path / "term")[-1].step and ckpt == step - step % 2 and ckpt >= 2
    assert "name=term" in command and f"output_dir={tmp_path}" in command


def test_sigkill_of_the_run_leaves_no_orphan_trainer(tmp_path):
    proc, lines = _start(tmp_path, "killed")
    pids: list[int] = []
    try:
        _wait_for_steps(proc, lines, tmp_path / "killed", 1)
        pids = _descendants(proc.pid)
        shm = _shm_mapped([proc.pid, *pids])
        assert any(n.startswith("loomrl-w-") for n in shm), shm
        proc.kill()
        proc.wait(timeout=10)
        left, files = _wait_gone(pids, shm, 10)
        names = [Path(f"/proc/{p}/comm").read_text().strip() for p in left]
    finally:
        _kill_all(pids)
    assert not left and not files, (names, files)


@pytest.mark.browser
def test_sigterm_of_a_background_web_run_stops_it_cleanly_browsers_included(tmp_path):
    """A run started as a background job of a script has SIGINT ignored, so asyncio installs no Ctrl-C handler: SIGTERM
    must still cancel the run's task as Ctrl-C would (runtime/interrupt.py), not raise KeyboardInterrupt from wherever
    the loop was. Raised so, asyncio.run cancelled every task at once, Playwright's connection among them: a MiniWoB run
    hung with its browsers up, and this one printed "Task was destroyed but it is pending!" for its pool's tasks."""
    from loomrl.env.browser.chromium import missing_requirements

    if missing_requirements() is not None:
        pytest.skip(missing_requirements() or "")
    args = [sys.executable, "-m", "loomrl.cli", "train", str(ROOT / "examples" / "web_smollm2.yaml"), "model.kind=tiny",
            f"output_dir={tmp_path}", "name=web", "progress=false", "eval.n_tasks=0", "trainer.total_steps=1000",
            "agent.max_turns=2", "trainer.groups_per_step=2", "trainer.group_size=2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    pids: list[int] = []
    try:
        _wait_for_steps(proc, lines, tmp_path / "web", 1)
        pids = _descendants(proc.pid)
        assert any("chromium" in Path(f"/proc/{p}/cmdline").read_text() for p in _alive(pids)), "no browser ran"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        left, _ = _wait_gone(pids, set(), 10)
    finally:
        proc.kill()
        _kill_all(pids)
    out = "".join(lines)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "run stopped by SIGTERM at step" in out, out[-3000:]
    assert "destroyed but it is pending" not in out and "Event loop is closed" not in out, out[-3000:]
    assert not left, (left, out[-3000:])
