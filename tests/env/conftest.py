"""Fixtures of the browser environments' tests (tests/env/test_web_env.py, test_miniwob.py): one event loop per
module, since Playwright's objects belong to the loop that made them, and one browser pool (1 browser x 2 tabs) on
it. Requesting them skips nothing: the modules mark themselves browser and skip without chromium."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.env.browser.pool import BrowserPool


@pytest.fixture(scope="module")
def run():
    """`run(coro)`: runs it on the module's one event loop."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module")
def pool(run):
    p = run(BrowserPool(browsers=1, tabs_per_browser=2).start())
    yield p
    run(p.close())
