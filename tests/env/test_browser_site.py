"""loomrl/env/browser/site.py without a browser: redirects followed in process (a POST answered 303 becomes a GET
with the cookies the redirect set, 307 repeats the POST, an off-site or endless redirect is left to the browser),
several cookies in one response kept apart, and no cookie jar of AsgiSite's own."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from loomrl.env.browser.site import (
    COOKIE_SEPARATOR,
    MAX_REDIRECTS,
    AsgiSite,
    SiteRequest,
    final_url_script,
    follow_redirects,
    same_origin,
)

ORIGIN = "http://site.loomrl.test"


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/form")
    async def form(request: Request):
        r = RedirectResponse("/done", status_code=303)
        r.set_cookie("sid", "abc")
        r.set_cookie("theme", "dark")
        return r

    @app.get("/done")
    async def done(request: Request):
        return HTMLResponse(f"<p>{request.method} sid={request.cookies.get('sid')} theme={request.cookies.get('theme')}"
                            "</p>")

    @app.post("/keep")
    async def keep():
        return RedirectResponse("/echo", status_code=307)

    @app.post("/echo")
    async def echo(request: Request):
        return HTMLResponse(f"<p>{request.method} {(await request.body()).decode()}</p>")

    @app.get("/away")
    async def away():
        return RedirectResponse("http://elsewhere.test/", status_code=302)

    @app.get("/loop")
    async def loop():
        return RedirectResponse("/loop", status_code=302)

    return app


def test_a_post_answered_303_becomes_a_get_with_the_redirects_cookies():
    site = AsgiSite(_app(), ORIGIN)
    got = asyncio.run(follow_redirects(site, SiteRequest(method="POST", url=ORIGIN + "/form", body=b"a=1",
                                                         headers={"content-type": "application/x-www-form-urlencoded"})))
    assert got.url == ORIGIN + "/done" and got.redirects == 1
    assert got.response.status == 200 and got.response.body == b"<p>GET sid=abc theme=dark</p>"
    # both cookies reach the browser, one Set-Cookie each (Playwright splits the value on newlines)
    cookies = got.response.headers["set-cookie"].split(COOKIE_SEPARATOR)
    assert [c.split(";")[0] for c in cookies] == ["sid=abc", "theme=dark"]


def test_307_repeats_the_post_and_off_site_or_endless_redirects_are_left_to_the_browser():
    site = AsgiSite(_app(), ORIGIN)
    kept = asyncio.run(follow_redirects(site, SiteRequest(method="POST", url=ORIGIN + "/keep", body=b"x=2")))
    assert kept.response.body == b"<p>POST x=2</p>" and kept.url == ORIGIN + "/echo"
    away = asyncio.run(follow_redirects(site, SiteRequest(method="GET", url=ORIGIN + "/away")))
    assert away.response.status == 302 and away.url == ORIGIN + "/away" and away.redirects == 0
    loop = asyncio.run(follow_redirects(site, SiteRequest(method="GET", url=ORIGIN + "/loop")))
    assert loop.response.status == 302 and loop.redirects == MAX_REDIRECTS


def test_asgi_site_keeps_no_cookie_jar_and_the_final_url_script_quotes_its_url():
    site = AsgiSite(_app(), ORIGIN)

    async def go():
        await site.handle(SiteRequest(method="POST", url=ORIGIN + "/form"))  # sets sid
        return await site.handle(SiteRequest(method="GET", url=ORIGIN + "/done"))  # no Cookie header sent

    assert asyncio.run(go()).body == b"<p>GET sid=None theme=None</p>"
    script = final_url_script("/a'b\"</script>")
    assert script == b"<script>history.replaceState(null, '', \"/a'b\\\"\\u003c/script>\")</script>"
    assert script.count(b"</script>") == 1
    assert not same_origin("http://site.loomrl.test.evil/", ORIGIN) and same_origin(ORIGIN + "/x?y=1", ORIGIN)
