"""BrowserPool over Debian's real headless chromium in bubblewrap, driven by Playwright: pre-warm, routing to the
attached site only, site failures, escapes that must fail, reset, crashes, hangs, bounded failure, and nothing
left running (close, atexit, the orphan reaper). Sites are a tiny in-test class implementing the Site protocol."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from loomrl.env.browser.chromium import chromium_home, missing_requirements, pids_mentioning, reap_orphans
from loomrl.env.browser.pool import BrowserPool
from loomrl.env.browser.site import SiteRequest, SiteResponse
from loomrl.env.pool import EnvPoolFailed

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing_requirements() is not None,
                                                      reason=missing_requirements() or "")]
README = Path(__file__).resolve().parents[2] / "README.md"


class TinySite:
    """A Site: `/` sets a cookie, `/cookie` echoes the request's cookies, `/500` is an error page, `/raise` is a
    site bug, `/hang` never answers."""

    def __init__(self, name: str):
        self.name, self.origin = name, f"http://{name}.loomrl.test"

    async def handle(self, request: SiteRequest) -> SiteResponse:
        path = urlsplit(request.url).path
        if path == "/raise":
            raise RuntimeError(f"{self.name} has a bug")
        if path == "/hang":
            await asyncio.sleep(3600)
        if path == "/500":
            return SiteResponse(status=500, body=b"oops")
        body = request.headers.get("cookie", "") if path == "/cookie" else f"<p id=who>{self.name}</p>"
        return SiteResponse(status=200, headers={"content-type": "text/html", "set-cookie": f"who={self.name}"},
                            body=body.encode())

    async def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


async def _fails(coro) -> str:
    """The error an escape attempt ends with (it must end with one)."""
    try:
        await coro
    except Exception as err:  # noqa: BLE001 - Playwright's Error or the page's TypeError, as text
        return str(err)
    raise AssertionError("the attempt succeeded")


async def _blocked(page, url: str) -> str:
    """The error a navigation to `url` ends with, once the page has settled on chromium's error page (a navigation
    started before that would be interrupted by it)."""
    err = await _fails(page.goto(url, timeout=5000))
    await page.wait_for_url("chrome-error://**", timeout=5000)
    await page.wait_for_load_state()
    return err


def test_prewarm_routes_to_the_attached_site_only_and_records_site_failures(run):
    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=2).start()
        try:
            assert pool.metrics.created == 2 and pool.idle == 2 and pool.browser_metrics.launches == 1
            async with pool.lease() as tab:
                site = TinySite("shop")
                assert "ERR" in await _blocked(tab.page, site.origin + "/")  # not attached yet
                tab.attach(site)
                await tab.page.goto(site.origin + "/")
                assert await tab.page.inner_text("#who") == "shop"
                assert (await tab.page.goto(site.origin + "/500")).status == 500 and tab.site_failure is None
                assert (await tab.page.goto(site.origin + "/raise")).status == 502
                assert "RuntimeError: shop has a bug" in tab.site_failure
        finally:
            await pool.close()

    run(go())


def test_a_large_prewarm_makes_a_few_contexts_at_a_time(run, monkeypatch):
    """40 tabs made at once on one browser ran past the 10 s context timeout on this 2-core machine (the web recipe's
    pool); the pool makes at most CONTEXTS_AT_ONCE per browser at a time, each timed from when it is made."""
    from playwright.async_api._generated import Browser

    from loomrl.env.browser import pool as pool_module

    making, most = 0, 0
    new_context = Browser.new_context

    async def counted(self, *args, **kwargs):
        nonlocal making, most
        making += 1
        most = max(most, making)
        try:
            return await new_context(self, *args, **kwargs)
        finally:
            making -= 1

    monkeypatch.setattr(Browser, "new_context", counted)

    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=12).start()
        try:
            assert pool.metrics.created == 12 and pool.idle == 12
        finally:
            await pool.close()

    run(go())
    assert most == pool_module.CONTEXTS_AT_ONCE


def test_escapes_fail_and_tabs_cannot_see_each_other(run):
    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=2).start()
        try:
            a, b = await pool.acquire(), await pool.acquire()
            sa, sb = TinySite("a"), TinySite("b")
            a.attach(sa)
            b.attach(sb)
            await a.page.goto(sa.origin + "/")  # sets cookie who=a in a's context
            await b.page.goto(sb.origin + "/")
            assert "ERR_" in await _blocked(a.page, "http://example.com/")
            assert "ERR_BLOCKED" in await _blocked(a.page, README.as_uri())
            assert "ERR_BLOCKED" in await _blocked(a.page, "file:///usr/share/common-licenses/GPL-3")
            await a.page.goto(sa.origin + "/")
            fetch = "u => fetch(u).then(r => r.text())"
            assert "Failed to fetch" in await _fails(a.page.evaluate(fetch, sb.origin + "/cookie"))
            assert "ERR_" in await _blocked(a.page, sb.origin + "/")  # b's site: not a's
            await b.page.goto(sb.origin + "/cookie")
            assert await b.page.evaluate("document.cookie") == "who=b"  # a's cookie is not in b's context
            assert "who=a" not in await b.page.content()
            assert b.site_failure is None and a.site_failure is None
        finally:
            await pool.close()

    run(go())


def test_reset_leaves_no_storage_and_one_page(run):
    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=1).start()
        try:
            site = TinySite("shop")
            tab = await pool.acquire()
            tab.attach(site)
            await tab.page.goto(site.origin + "/")
            await tab.page.evaluate("() => { localStorage.setItem('k', 'v'); window.open('/popup') }")
            await tab.context.new_page()
            await tab.context.new_page()
            await asyncio.sleep(0.3)
            assert len(tab.context.pages) == 1  # popups and extra pages are closed on sight
            await pool.release(tab)
            again = await asyncio.wait_for(pool.acquire(), 20)  # after its reset
            assert again is tab and pool.metrics.resets == 1 and len(tab.context.pages) == 1
            assert tab.site is None and await tab.context.cookies() == []
            assert "ERR_" in await _blocked(tab.page, site.origin + "/")  # detached
            tab.attach(site)
            await tab.page.goto(site.origin + "/cookie")
            assert await tab.page.inner_text("body") == ""  # no cookie came with the request
            assert await tab.page.evaluate("localStorage.getItem('k')") is None
        finally:
            await pool.close()

    run(go())


def test_a_hanging_page_is_released_broken_and_replaced(run):
    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=1).start()
        try:
            with pytest.raises(Exception, match="Timeout"):
                async with pool.lease() as tab:
                    tab.attach(TinySite("slow"))
                    await tab.page.goto("http://slow.loomrl.test/hang", timeout=1000)
            fresh = await asyncio.wait_for(pool.acquire(), 20)
            assert fresh is not tab and pool.metrics.kills == 1 and pool.metrics.created == 2
            assert await fresh.page.evaluate("1 + 2") == 3
        finally:
            await pool.close()

    run(go())


def test_a_browser_killed_mid_lease_is_replaced_by_a_relaunched_one(run):
    async def go():
        pool = await BrowserPool(browsers=1, tabs_per_browser=2).start()
        try:
            site = TinySite("shop")
            with pytest.raises(Exception, match="closed|crash|Target"):
                async with pool.lease() as tab:
                    tab.attach(site)
                    await tab.page.goto(site.origin + "/")
                    marker = tab.chromium.home.marker
                    subprocess.run(["kill", "-9", *map(str, pids_mentioning(marker))], check=True)
                    await tab.page.goto(site.origin + "/", timeout=5000)
            fresh = await asyncio.wait_for(pool.acquire(), 30)  # the idle tab on the dead browser fails health
            assert fresh.chromium is not tab.chromium and fresh.chromium.up
            fresh.attach(site)
            await fresh.page.goto(site.origin + "/")
            m = pool.browser_metrics
            assert m.launches == 2 and m.crashes == 1 and m.kills == 1 and m.health_failures == 1
            assert not pids_mentioning(marker) and not Path(marker).exists()
        finally:
            await pool.close()

    run(go())


def test_close_leaves_no_browser_running(run):
    async def go():
        pool = await BrowserPool(browsers=2, tabs_per_browser=1).start()
        await pool.acquire()  # one leased, one idle
        markers = [c.home.marker for c in pool.tabs.browsers]
        assert len(markers) == 2 and all(pids_mentioning(m) for m in markers)
        await pool.close()
        return markers

    markers = run(go())
    assert not any(pids_mentioning(m) for m in markers) and not any(Path(m).exists() for m in markers)


def test_atexit_kills_the_browsers_of_a_pool_left_open(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio\n"
        "from loomrl.env.browser.pool import BrowserPool\n"
        "async def main():\n"
        "    pool = await BrowserPool(browsers=1, tabs_per_browser=1).start()\n"
        "    print(pool.tabs.browsers[0].home.marker, flush=True)\n"
        "    await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    marker = owner.stdout.readline().strip()
    assert marker and pids_mentioning(marker)
    owner.send_signal(2)  # SIGINT: KeyboardInterrupt, the interpreter exits through its atexit hooks
    owner.wait(timeout=30)
    assert not pids_mentioning(marker) and not Path(marker).exists()


def test_the_reaper_kills_a_browser_whose_owner_is_dead():
    dead = subprocess.Popen(["true"])
    dead.wait()
    home = chromium_home(owner_pid=dead.pid)
    orphan = subprocess.Popen([str(home.script), "--headless", "--no-sandbox", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    def chromium_up() -> bool:  # chromium itself, not only the bwrap that starts it
        return any(_cmdline(p).startswith("/usr/lib/chromium/chromium") for p in pids_mentioning(home.marker))

    while not chromium_up():
        assert time.monotonic() < deadline, "the orphan browser did not start"
        time.sleep(0.1)
    assert reap_orphans() >= 1
    orphan.wait(timeout=10)
    for _ in range(50):
        if not pids_mentioning(home.marker):
            break
        time.sleep(0.1)
    assert not pids_mentioning(home.marker) and not home.path.exists()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def test_a_wrong_executable_fails_the_pool_after_max_failures_with_the_cause(run):
    async def go():
        t0 = time.perf_counter()
        pool = BrowserPool(browsers=1, tabs_per_browser=4, executable="/nonexistent/chromium", max_failures=3)
        with pytest.raises(EnvPoolFailed) as failed:
            await pool.start()
        await pool.close()
        return time.perf_counter() - t0, str(failed.value), pool

    wall, err, pool = run(go())
    assert wall < 15 and pool.metrics.create_failures >= 3
    assert "3 browser tabs in a row failed" in err and "/nonexistent/chromium" in err
    assert "apt-get install -y chromium bubblewrap" in err
