"""TabSession: what every browser environment's episode does with its leased tab, written once (env.name=web:
loomrl/env/tasks/web/environment.py; env.name=miniwob: loomrl/env/tasks/miniwob/environment.py).

- `open(site)`: lease a tab from the run's browser pool (the first time) and attach `site` to it; `release_site()`
  detaches and closes it (a worked example's site, before the episode's own);
- `run(work)`: await browser work; the browser's or the site's failure (Playwright's errors, a page script past its
  bound, a site handler that raised or hung: tab.site_failure) becomes EnvCrash, so the episode ends `env_error`,
  never scored, and the tab is marked broken;
- `observe()`: the page as text (page_text.observe), and a JPEG of it when screenshots were asked for;
- `act(call, record)`: one parsed tool call carried out on the page; the model's mistakes come back as the error text
  for it (recorded on the call as a tool error), the episode goes on;
- `close()`: the tab back to the pool (destroyed and replaced when broken), the site closed.

What it is not: the environment's tasks, prompts, verdicts or the order of its steps.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Collection
from typing import TYPE_CHECKING, Any, TypeVar

from loomrl.env.base import EnvCrash
from loomrl.env.browser.actions import ActionError, perform
from loomrl.env.browser.page_text import observe

if TYPE_CHECKING:
    from playwright.async_api import Page

    from loomrl.env.browser.pool import BrowserTab
    from loomrl.env.browser.site import Site
    from loomrl.env.pool import LeasePool
    from loomrl.model.tools import ToolCall

T = TypeVar("T")


class TabSession:
    def __init__(self, pool: LeasePool[BrowserTab], *, action_timeout_s: float, max_chars: int,
                 screenshots: bool = False):
        self.pool = pool
        self.action_timeout_s, self.max_chars, self.take_screenshots = action_timeout_s, max_chars, screenshots
        self.tab: BrowserTab | None = None
        self.site: Site | None = None
        self.broken = False  # a browser or site failure happened: the tab goes back to be destroyed
        self.screenshots: list[str] = []  # base64 JPEGs, one per observe()

    async def open(self, site: Site) -> None:
        if self.tab is None:
            self.tab = await self.pool.acquire()
        await self.release_site()
        self.site = site
        self.tab.attach(site)

    async def release_site(self) -> None:
        site, self.site = self.site, None
        if site is not None:
            if self.tab is not None:
                self.tab.detach()
            site.close()

    @property
    def page(self) -> Page:
        assert self.tab is not None, "open() first"
        return self.tab.page

    @property
    def origin(self) -> str:
        assert self.site is not None, "open() first"
        return self.site.origin

    async def run(self, work: Awaitable[T]) -> T:
        """Await browser work; a failure of the browser or of the site is EnvCrash (ActionError passes through)."""
        from playwright.async_api import Error as PlaywrightError

        try:
            result = await work
        except ActionError:
            raise
        except (PlaywrightError, TimeoutError) as err:
            self.broken = True
            first = str(err).splitlines()[0] if str(err) else ""
            raise EnvCrash(f"browser: {type(err).__name__}: {first}") from err
        if self.tab is not None and self.tab.site_failure is not None:
            self.broken = True
            raise EnvCrash(f"site failed: {self.tab.site_failure}")
        return result

    async def goto(self, url: str) -> None:
        await self.run(self.page.goto(url, timeout=self.action_timeout_s * 1000))

    async def observe(self) -> str:
        view = await self.run(observe(self.page, max_chars=self.max_chars, timeout_s=self.action_timeout_s))
        if self.take_screenshots:
            shot = await self.run(self.page.screenshot(type="jpeg", quality=50, timeout=self.action_timeout_s * 1000))
            self.screenshots.append(base64.b64encode(shot).decode())
        return view.text

    async def act(self, call: ToolCall, record: dict[str, Any], allowed: Collection[str]) -> str | None:
        """Carry out one parsed tool call of the actions in `allowed`: None when it was done, else the error text for
        the model (a malformed call, an action not offered, an id not on the page, ...), recorded on `record`."""
        try:
            if call.error:
                raise ActionError(call.error)
            if call.name not in allowed:
                raise ActionError(f"no action named {call.name!r}; the actions are {', '.join(allowed)}")
            await self.run(perform(self.page, call.name, call.arguments, origin=self.origin,
                                   max_chars=self.max_chars))
            return None
        except ActionError as err:
            if not call.error:  # the call was well formed; the page could not carry it out
                record["tool_error"], record["failure"] = str(err), str(err.failure)
            return f"Error: {err}"

    async def close(self) -> None:
        await self.release_site()
        tab, self.tab = self.tab, None
        if tab is not None:
            tab.detach()
            await self.pool.release(tab, broken=self.broken)
