"""`loomrl view` as a user runs it: a real process serving a real run folder, and the one line it answers a folder
that is not a run with."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_loomrl_view_serves_the_run_folder_it_is_given(run_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loomrl", "view", str(run_dir), "--port", str(port)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "loomrl view did not answer in 60 s"
                time.sleep(0.2)
        assert [r["name"] for r in runs] == [run_dir.name]
        page = httpx.get(f"http://127.0.0.1:{port}/").text
        assert "/static/vendor/uPlot.iife.min.js" in page
        assert httpx.get(f"http://127.0.0.1:{port}/static/vendor/uPlot.iife.min.js").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_folder_that_is_no_run_gets_one_line_and_exit_code_2(run_dir):
    out = subprocess.run([sys.executable, "-m", "loomrl", "view", str(run_dir.parent)], env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().endswith("give a run folder (output_dir/name), not its parent or a checkpoint")
