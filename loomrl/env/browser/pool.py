"""BrowserPool: pre-warmed browser tabs with the sandbox pool's guarantees (loomrl/env/pool.py's ResourcePool).

`browsers` chromium processes (chromium.py: sandboxed, no network) x `tabs_per_browser` contexts each. The pooled
unit is a BrowserTab: one context with one page. An episode leases a tab, attaches its Site (`tab.attach(site)`)
and drives `tab.page`. The context's route handler answers requests on the site's origin from `site.handle` and
aborts everything else; before attach and after release everything is aborted. A site handler that raises (or does
not answer within `site_timeout_s`) gets a 502 and is recorded on `tab.site_failure`: the environment ends the
episode as env_error, never scoring it.

- Health: the browser is connected and a trivial evaluate answers within the pool's health timeout.
- Reset: a fresh context (no cookies, storage or cache of the last lease) with one page and the route handler,
  detached from the site (resetting the site itself is the environment's job).
- Contexts block service workers and downloads; any page beyond the tab's one (a popup, window.open, new_page)
  is closed on sight.
- A browser that crashed or disconnected: its tabs fail health (or their reset) and are destroyed; new tabs go to
  a newly launched browser. Its processes are killed once its last tab is gone.
- The pool bounds its own waits (launch, new context, health, close); per-action timeouts are the caller's
  (Playwright's timeout arguments).

Not here: the sites (loomrl/env/tasks/web/), page text and actions (page_text.py, actions.py), the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loomrl.env.browser.chromium import CHROMIUM, INSTALL, BrowserError, ChromiumHome, launch, reap_orphans
from loomrl.env.browser.site import Site, SiteRequest, final_url_script, follow_redirects, same_origin
from loomrl.env.pool import PoolMetrics, ResourcePool, pool_size_for
from loomrl.env.sandbox.base import Health

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Page, Playwright, Route

    from loomrl.config.env import BrowserConfig

log = logging.getLogger(__name__)

CONTEXTS_AT_ONCE = 4  # new contexts in the making on one browser at a time (_Chromium.creating)


@dataclass(slots=True)
class BrowserPoolMetrics(PoolMetrics):
    launches: int = 0  # browser processes started
    crashes: int = 0  # browsers that disconnected without the pool closing them


@dataclass(slots=True, eq=False)
class _Chromium:
    """One browser process and how many tabs live on it."""

    browser: Browser
    home: ChromiumHome
    tabs: int = 0
    closing: bool = False
    # contexts being made on it at once: Chromium makes them one after another anyway, and a pre-warm of 40 made at
    # once on 2 cores ran past context_timeout_s (each one's timeout counts from when it is made, not queued)
    creating: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CONTEXTS_AT_ONCE))

    @property
    def up(self) -> bool:
        return not self.closing and self.browser.is_connected()


@dataclass(slots=True, eq=False)
class BrowserTab:
    """One leased unit: a context with one page, routed to the attached site only."""

    chromium: _Chromium
    context: BrowserContext
    page: Page
    site: Site | None = None
    site_failure: str | None = None  # why the site failed this lease (its handler raised or hung); None: it did not
    site_timeout_s: float = 30.0
    _calls: set[asyncio.Task] = field(default_factory=set)  # site.handle calls in flight (cancelled at detach)

    def attach(self, site: Site) -> None:
        """From now on, requests on `site.origin` are answered by `site.handle`."""
        self.site, self.site_failure = site, None

    def detach(self) -> None:
        """Abort every request again, and give up on site calls still in flight."""
        self.site = None
        for call in list(self._calls):
            call.cancel()

    async def install_route(self) -> None:
        """Make answer() the route handler of every request of the (current) context."""

        async def handler(route: Route) -> None:  # a plain function: Playwright marks its handlers
            await self.answer(route)

        await self.context.route("**/*", handler)

    async def answer(self, route: Route) -> None:
        """One request of the context: to the attached site on its origin, else aborted."""
        from playwright.async_api import Error

        request, site = route.request, self.site
        with contextlib.suppress(Error):  # the context may have closed under a request in flight
            if site is None or not same_origin(request.url, site.origin):
                await route.abort("blockedbyclient")
                return
            req = SiteRequest(method=request.method, url=request.url, headers=await request.all_headers(),
                              body=request.post_data_buffer)
            call = asyncio.ensure_future(follow_redirects(site, req))
            self._calls.add(call)
            try:
                done, _ = await asyncio.wait({call}, timeout=self.site_timeout_s)
            finally:
                self._calls.discard(call)
                if not call.done():
                    call.cancel()  # timed out, or this handler was cancelled
            if not done:
                await self._site_failed(route, f"the site did not answer in {self.site_timeout_s}s")
            elif call.cancelled():
                await route.abort("aborted")  # detached meanwhile
            elif (err := call.exception()) is not None:
                await self._site_failed(route, f"{type(err).__name__}: {err}")
            else:
                followed = call.result()
                resp, body = followed.response, followed.response.body
                if followed.redirects and request.is_navigation_request():
                    body = final_url_script(followed.url) + body  # the address bar shows where the redirects led
                await route.fulfill(status=resp.status, headers=resp.headers, body=body)

    async def _site_failed(self, route: Route, why: str) -> None:
        """Answer 502 and record the first failure of this lease (the page's own view of it is a 502 page)."""
        request = route.request
        if self.site_failure is None:
            self.site_failure = f"{request.method} {request.url}: {why}"
        await route.fulfill(status=502, headers={"content-type": "text/plain"}, body=b"502: the site failed")


async def _close_popup(page: Page) -> None:
    from playwright.async_api import Error

    with contextlib.suppress(Error):
        await page.close()


class _Tabs:
    """The pool's Lifecycle[BrowserTab]: the browsers, and the contexts made on them."""

    noun, nouns = "browser tab", "browser tabs"

    def __init__(self, *, browsers: int, tabs_per_browser: int, executable: str, launch_timeout_s: float,
                 context_timeout_s: float, site_timeout_s: float, metrics: BrowserPoolMetrics):
        self.max_browsers, self.tabs_per_browser = browsers, tabs_per_browser
        self.executable = executable
        self.launch_timeout_s, self.context_timeout_s, self.site_timeout_s = (launch_timeout_s, context_timeout_s,
                                                                              site_timeout_s)
        self.metrics = metrics
        self.playwright: Playwright | None = None
        self.browsers: list[_Chromium] = []
        self._placing = asyncio.Lock()  # one launch at a time: concurrent pre-warms fill a browser, not launch K*M

    async def start(self) -> None:
        try:
            from playwright.async_api import async_playwright
        except ImportError as err:
            raise BrowserError(f"browser pool: playwright is not installed: run `{INSTALL}`") from err
        if self.playwright is None:
            self.playwright = await async_playwright().start()

    async def create(self) -> BrowserTab:
        async with self._placing:
            chromium = await self._room()
            chromium.tabs += 1  # reserved before the context is made outside the lock
        try:
            context, page = await self._context(chromium)
        except BaseException:
            await self._forget_tab(chromium)
            raise
        tab = BrowserTab(chromium=chromium, context=context, page=page, site_timeout_s=self.site_timeout_s)
        try:
            await tab.install_route()
        except BaseException:
            await self.close(tab)
            raise
        return tab

    async def _room(self) -> _Chromium:
        """A live browser with room for one more tab, launching one when none has room."""
        for chromium in self.browsers:
            if chromium.up and chromium.tabs < self.tabs_per_browser:
                return chromium
        if sum(c.up for c in self.browsers) >= self.max_browsers:
            raise BrowserError("browser pool: every browser is full (more tabs than browsers x tabs_per_browser)")
        if self.playwright is None:
            raise BrowserError("browser pool: not started (BrowserPool.start)")
        browser, home = await launch(self.playwright, self.executable, self.launch_timeout_s)
        chromium = _Chromium(browser=browser, home=home)
        browser.on("disconnected", lambda _: self._disconnected(chromium))
        self.browsers.append(chromium)
        self.metrics.launches += 1
        return chromium

    def _disconnected(self, chromium: _Chromium) -> None:
        if not chromium.closing:
            self.metrics.crashes += 1
            log.warning("browser pool: a browser crashed or disconnected (%s); its tabs will be replaced",
                        chromium.home.path)

    async def _context(self, chromium: _Chromium) -> tuple[BrowserContext, Page]:
        """A fresh context with one page on `chromium`, within context_timeout_s."""
        from playwright.async_api import Error

        if not chromium.up:
            raise BrowserError("browser pool: the tab's browser crashed or disconnected")
        try:
            async with chromium.creating, asyncio.timeout(self.context_timeout_s):
                context = await chromium.browser.new_context(service_workers="block", accept_downloads=False)
                page = await context.new_page()
        except TimeoutError as err:
            raise BrowserError(f"browser pool: a new browser context took over {self.context_timeout_s}s") from err
        except Error as err:
            raise BrowserError(f"browser pool: a new browser context failed: {type(err).__name__}: {err}") from err
        context.on("page", _close_popup)  # after the tab's own page: every later page is a popup
        return context, page

    async def health(self, item: BrowserTab, timeout: float) -> Health:
        if not item.chromium.up:
            return Health(ok=False, detail="its browser crashed or disconnected")
        try:
            answer = await asyncio.wait_for(item.page.evaluate("1 + 1"), timeout)
        except Exception as err:  # noqa: BLE001 - whatever the page does, it is unhealthy
            what = f"no answer in {timeout}s" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
            return Health(ok=False, detail=f"a trivial evaluate failed: {what}")
        return Health(ok=answer == 2, detail="" if answer == 2 else f"a trivial evaluate answered {answer!r}")

    async def prepare(self, item: BrowserTab) -> None:
        """Nothing: a fresh context is the initial state."""

    async def reset(self, item: BrowserTab) -> None:
        item.detach()
        item.site_failure = None
        await self._close_context(item.context)
        item.context, item.page = await self._context(item.chromium)
        await item.install_route()

    async def close(self, item: BrowserTab) -> None:
        item.detach()
        await self._close_context(item.context)
        await self._forget_tab(item.chromium)

    async def _close_context(self, context: BrowserContext) -> None:
        from playwright.async_api import Error

        with contextlib.suppress(Error, TimeoutError):  # a dead browser's context is gone with it
            await asyncio.wait_for(context.close(), self.context_timeout_s)

    async def _forget_tab(self, chromium: _Chromium) -> None:
        """One tab fewer on `chromium`; a browser that is down and has no tabs left is killed and forgotten."""
        chromium.tabs -= 1
        if chromium.tabs <= 0 and not chromium.up and chromium in self.browsers:
            self.browsers.remove(chromium)
            chromium.home.kill_now()

    def kill_now(self, item: BrowserTab) -> None:
        item.chromium.closing = True
        item.chromium.home.kill_now()

    async def shutdown(self) -> None:
        """Close every browser (bounded; killed past it) and stop Playwright's driver."""
        from playwright.async_api import Error

        for chromium in self.browsers:
            chromium.closing = True
            with contextlib.suppress(Error, TimeoutError):
                await asyncio.wait_for(chromium.browser.close(), self.context_timeout_s)
            chromium.home.kill_now()
        self.browsers.clear()
        if self.playwright is not None:
            with contextlib.suppress(Error, TimeoutError):
                await asyncio.wait_for(self.playwright.stop(), self.context_timeout_s)
            self.playwright = None

    def kill_all_now(self) -> None:
        for chromium in self.browsers:
            chromium.closing = True
            chromium.home.kill_now()
        self.browsers.clear()


class BrowserPool(ResourcePool[BrowserTab]):
    """Pre-warmed browser tabs (see the module doc). `size` is browsers x tabs_per_browser. `metrics` is a
    BrowserPoolMetrics (also typed as such under `browser_metrics`)."""

    def __init__(self, *, browsers: int = 1, tabs_per_browser: int = 4, prewarm: int | None = None,
                 executable: str = CHROMIUM, launch_timeout_s: float = 30.0, context_timeout_s: float = 10.0,
                 health_timeout_s: float = 5.0, site_timeout_s: float = 30.0, max_failures: int = 3):
        """`site_timeout_s` bounds one site.handle call (past it: a 502 and a site failure)."""
        if browsers < 1 or tabs_per_browser < 1:
            raise ValueError(f"BrowserPool: browsers and tabs_per_browser must be >= 1, got {browsers}, "
                             f"{tabs_per_browser}")
        metrics = BrowserPoolMetrics()
        self.tabs = _Tabs(browsers=browsers, tabs_per_browser=tabs_per_browser, executable=executable,
                          launch_timeout_s=launch_timeout_s, context_timeout_s=context_timeout_s,
                          site_timeout_s=site_timeout_s, metrics=metrics)
        fix = (f"headless chromium ({executable}) does not start in bubblewrap here, or answers too slowly on a "
               f"machine this busy: check `{INSTALL}`, run the launch script of "
               f"loomrl.env.browser.chromium.chromium_home() with --headless by hand; on a busy machine make fewer "
               f"tabs at once (env.browser.prewarm, the rollout concurrency) or allow more time "
               f"(env.browser.context_timeout_s, env.browser.health_timeout_s)")
        super().__init__(self.tabs, size=browsers * tabs_per_browser, prewarm=prewarm,
                         health_timeout_s=health_timeout_s, max_failures=max_failures, fix=fix,
                         close_timeout_s=context_timeout_s + 5, metrics=metrics)
        self.browser_metrics = metrics

    async def start(self) -> BrowserPool:
        """Reap the browsers of dead loomrl processes, start Playwright's driver, pre-warm."""
        reaped = reap_orphans()
        if reaped:
            log.warning("browser pool: killed %d browser processes left by a loomrl process that is gone", reaped)
        await self.tabs.start()
        await super().start()
        return self

    async def close(self) -> None:
        await super().close()
        await self.tabs.shutdown()

    def destroy_all_now(self) -> None:
        super().destroy_all_now()
        self.tabs.kill_all_now()


def browser_pool(b: BrowserConfig, concurrency: int) -> BrowserPool:
    """The browser pool a run's env.browser asks for, for `concurrency` episodes at once (tabs_per_browser 0: that
    plus spares being reset, spread evenly over the browsers)."""
    per_browser = b.tabs_per_browser or math.ceil(pool_size_for(concurrency) / b.browsers)
    return BrowserPool(browsers=b.browsers, tabs_per_browser=per_browser, prewarm=b.prewarm, executable=b.executable,
                       launch_timeout_s=b.launch_timeout_s, context_timeout_s=b.context_timeout_s,
                       health_timeout_s=b.health_timeout_s, site_timeout_s=b.site_timeout_s,
                       max_failures=b.max_failures)
