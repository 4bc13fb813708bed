"""What a browser page may reach: one `Site`, answered in process.

A web episode's page talks to exactly one site. Its requests never reach a network: the browser context routes
every request (`BrowserContext.route`) to the site the episode attached, and aborts everything else, so isolation
does not depend on firewall rules and one episode's site state (its database) is its own. A site is any object
with this interface; `AsgiSite` serves an ASGI app (FastAPI, Starlette) through httpx's in-process transport.

Redirects are followed here, in process (`follow_redirects`), not by the browser: Chromium does not route the request
a fulfilled 3xx leads to reliably (a form's POST answered 303 ends on an error page; Playwright's maintainers advise
fulfilling the final response instead). The page is given the final response, with the redirects' cookies, and its
address bar is moved to the final URL by `history.replaceState` (`final_url_script`): the same history a browser
following a 303 keeps, with no second navigation to wait for.

This module is the contract between the browser pool (loomrl/env/browser/pool.py), which routes requests, and the
sites (loomrl/env/tasks/web/), which answer them; it imports neither.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit

import httpx


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteRequest:
    method: str
    url: str  # absolute, on the site's origin
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 10
# Playwright's route.fulfill splits a header value on newlines into several headers of that name for set-cookie only
# (several cookies in one response); AsgiSite joins them so
COOKIE_SEPARATOR = "\n"


class Site(Protocol):
    """One episode's web site. `origin` is scheme://host (no path), e.g. `http://shop.loomrl.test`: the only origin
    the episode's page may load anything from."""

    origin: str

    async def handle(self, request: SiteRequest) -> SiteResponse:
        """Answer one request. Raising is a site failure (the episode ends as env_error), not a 500 page."""
        ...

    async def reset(self) -> None:
        """Back to the site's initial state (its database restored from the snapshot)."""
        ...

    def close(self) -> None: ...


def same_origin(url: str, origin: str) -> bool:
    """Whether `url` is on `origin` exactly (scheme, host and port): a prefix test would let
    `http://shop.loomrl.test.evil/` through."""
    u, o = urlsplit(url), urlsplit(origin)
    return (u.scheme, u.hostname, u.port) == (o.scheme, o.hostname, o.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class Followed:
    """A request's final response after its redirects, and the URL it came from."""

    response: SiteResponse
    url: str
    redirects: int = 0


async def follow_redirects(site: Site, request: SiteRequest) -> Followed:
    """`site.handle(request)`, following on-site redirects as a browser would: 303 (and 301/302 after a POST) becomes a
    GET without a body, 307/308 repeat the request; cookies the redirects set are sent on and kept on the final response.
    A redirect off the site's origin, or past MAX_REDIRECTS, is given to the browser as it is (it aborts it)."""
    cookies: list[str] = []
    for hop in range(MAX_REDIRECTS + 1):
        response = await site.handle(request)
        location = _header(response.headers, "location")
        if response.status not in REDIRECTS or location is None or hop == MAX_REDIRECTS:
            break
        target = urljoin(request.url, location)
        if not same_origin(target, site.origin):
            break
        set_cookie = _header(response.headers, "set-cookie")
        if set_cookie:
            cookies.extend(set_cookie.split(COOKIE_SEPARATOR))
        keep = response.status in (307, 308) or (response.status in (301, 302) and request.method in ("GET", "HEAD"))
        request = SiteRequest(method=request.method if keep else "GET", url=target,
                              headers=_with_cookies(request.headers, set_cookie), body=request.body if keep else None)
    else:  # pragma: no cover - the loop always breaks at hop == MAX_REDIRECTS
        raise AssertionError
    if cookies:
        own = _header(response.headers, "set-cookie")
        merged = {k: v for k, v in response.headers.items() if k.lower() != "set-cookie"}
        merged["set-cookie"] = COOKIE_SEPARATOR.join(cookies + ([own] if own else []))
        response = SiteResponse(status=response.status, headers=merged, body=response.body)
    return Followed(response=response, url=request.url, redirects=hop)


def final_url_script(url: str) -> bytes:
    """The first thing of a page reached through redirects followed in process: its address becomes `url`."""
    quoted = json.dumps(url).replace("<", "\\u003c")  # a `</script>` in the URL must not end the script
    return b"<script>history.replaceState(null, '', " + quoted.encode() + b")</script>"


def _header(headers: dict[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _with_cookies(headers: dict[str, str], set_cookie: str | None) -> dict[str, str]:
    """`headers` with the cookies of `set_cookie` (one Set-Cookie value per line) added to its Cookie header."""
    out = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
    if not set_cookie:
        return out
    jar: dict[str, str] = {}
    for part in (_header(out, "cookie") or "").split(";"):
        name, eq, value = part.strip().partition("=")
        if eq:
            jar[name] = value
    for line in set_cookie.split(COOKIE_SEPARATOR):
        parsed = SimpleCookie()
        parsed.load(line)
        jar.update({name: morsel.value for name, morsel in parsed.items()})
    out = {k: v for k, v in out.items() if k.lower() != "cookie"}
    out["cookie"] = "; ".join(f"{k}={v}" for k, v in jar.items())
    return out


class AsgiSite:
    """A Site serving an ASGI app in process. `on_reset` restores the app's state (its database)."""

    def __init__(self, app: Any, origin: str, on_reset: Callable[[], Awaitable[None]] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.origin = origin.rstrip("/")
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=self.origin)
        self._on_reset = on_reset
        self._on_close = on_close

    async def handle(self, request: SiteRequest) -> SiteResponse:
        # the browser's own hop-by-hop and encoding headers would confuse the in-process transport
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length",
                                                                                  "accept-encoding", "connection")}
        r = await self._client.request(request.method, request.url, headers=headers, content=request.body)
        # the browser context holds the cookies: httpx's own jar would carry one episode's session into the next
        # context's requests (those sent without a Cookie header)
        self._client.cookies.clear()
        out = {k: v for k, v in r.headers.items() if k.lower() not in ("content-length", "content-encoding",
                                                                        "transfer-encoding", "connection",
                                                                        "set-cookie")}
        if cookies := r.headers.get_list("set-cookie"):
            out["set-cookie"] = COOKIE_SEPARATOR.join(cookies)
        return SiteResponse(status=r.status_code, headers=out, body=r.content)

    async def reset(self) -> None:
        if self._on_reset is not None:
            await self._on_reset()

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
