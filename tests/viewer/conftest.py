"""The viewer's fixtures: one real short run folder per test module (the tiny recipe, sync, 2 steps), the viewer
served on it by a real uvicorn in a thread, and Debian's headless chromium driven by playwright (the browser tests
skip, saying why, when either is missing: `make test` installs both)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def short_run(output_dir: Path, name: str = "short", *overrides: str) -> Path:
    """A real run of the tiny recipe: sync, 2 steps, 4 held-out tasks; its folder."""
    from loomrl.config import load_config
    from loomrl.runtime.run import train

    cfg = load_config(RECIPE, [f"output_dir={output_dir}", f"name={name}", "progress=false", "runtime.mode=sync",
                               "trainer.total_steps=2", "eval.n_tasks=4", *overrides])
    train(cfg)
    return cfg.run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Viewer:
    """`loomrl view`'s app under a real uvicorn, in a thread of this process."""

    def __init__(self, runs: list[Path]):
        import uvicorn

        from loomrl.view.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(runs), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Viewer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the viewer did not start in 20 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return short_run(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (Debian's package, never a download)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium is not installed (make chromium: apt-get install chromium); the browser tests need it")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()
