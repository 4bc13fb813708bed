"""Pages as text with element ids (loomrl/env/browser/page_text.py) and the actions on them (actions.py), on Debian's
real headless chromium. One browser for the module, on one event loop of its own (Playwright's async objects belong
to the loop that made them); each test a fresh context whose pages are static HTML strings answered in process by
`context.route` + `route.fulfill`: no site package, no socket. Nothing is mocked."""

from __future__ import annotations

import asyncio
import inspect
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from loomrl.env.browser import actions
from loomrl.env.browser.actions import TOOL_SCHEMAS, ActionError
from loomrl.env.browser.page_text import Line, observe, render

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ORIGIN = "http://shop.loomrl.test"

Pages = dict[str, "str | Callable[[str], str]"]


class Browser:
    """The module's browser and its loop: `run(pages, test)` runs `test(page)` in a fresh context serving `pages`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, browser):
        self.loop, self.browser = loop, browser

    def run(self, pages: Pages, test: Callable[..., Awaitable[None]]) -> None:
        self.loop.run_until_complete(self._run(pages, test))

    async def _run(self, pages: Pages, test: Callable[..., Awaitable[None]]) -> None:
        context = await self.browser.new_context()
        hung = []

        async def answer(route) -> None:
            url = route.request.url
            parts = urlsplit(url)
            if not url.startswith(ORIGIN + "/"):
                await route.abort()
            elif parts.path == "/hang":
                hung.append(route)  # never answered during the test: aborted at its end
            elif parts.path in pages:
                page = pages[parts.path]
                body = page(url) if callable(page) else page
                await route.fulfill(status=200, headers={"content-type": "text/html; charset=utf-8"}, body=body)
            else:
                await route.fulfill(status=404, body="<title>Not found</title><h1>Not found</h1>")

        await context.route("**/*", answer)
        try:
            page = await context.new_page()
            await page.goto(ORIGIN + "/", wait_until="load")
            await test(page)
        finally:
            for route in hung:  # else its handler's task stays pending on the loop after the context closes
                await route.abort()
            await context.close()


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (Debian's package, never a download); the tests skip, saying why, without it."""
    async_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium is not installed (make chromium: apt-get install chromium); the browser tests need it")
    loop = asyncio.new_event_loop()

    async def start():
        pw = await async_api.async_playwright().start()
        return pw, await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

    pw, chromium = loop.run_until_complete(start())
    try:
        yield Browser(loop, chromium)
    finally:
        loop.run_until_complete(chromium.close())
        loop.run_until_complete(pw.stop())
        loop.close()


def ids(text: str) -> dict[str, int]:
    """Each element line's id by the line's text after the id: `[3] textbox "Quantity"...` -> {'textbox "Quantity"...': 3}."""
    return {m.group(2): int(m.group(1)) for m in re.finditer(r"^\[(\d+)\] (.*)$", text, re.M)}


def id_of(text: str, start: str) -> int:
    """The id of the one element line starting with `start` (e.g. 'button "Search"')."""
    found = [i for line, i in ids(text).items() if line.startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


FORM = """<html><head><title>Blue mug - Shop</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About us</a> (new)</nav>
<h1>Blue mug</h1><p>A sturdy blue mug. <b>$12.00</b></p>
<form action="/search" method="get">
  <input name="q" placeholder="Search the shop"> <button>Search</button>
</form>
<form action="/add" method="get">
  <label>Quantity <input name="qty" type="number" value="1"></label>
  <label for="ship">Shipping</label>
  <select id="ship" name="ship"><option selected>standard</option><option>express</option></select>
  <input type="checkbox" id="gift" name="gift"><label for="gift">Gift wrap</label>
  <button type="button" disabled>Pay</button>
  <button>Add to cart</button>
</form>
<table><tr><th>Size</th><th>Price</th></tr><tr><td>Small</td><td>$10</td></tr></table>
</body></html>"""


def search_page(url: str) -> str:
    q = parse_qs(urlsplit(url).query).get("q", [""])[0]
    return f"<title>Search</title><h1>Results for {q}</h1><p>2 mugs found</p><a href='/'>Home</a>"


SITE: Pages = {"/": FORM, "/search": search_page,
               "/about": "<title>About</title><h1>About us</h1><p>Since 1999.</p><a href='/hang'>Slow page</a>"}


def test_form_page_renders_ids_labels_values_and_options(browser):
    async def go(page):
        view = await observe(page, max_chars=2000)
        assert view.text.splitlines() == [
            "Page: Blue mug - Shop (/)",
            '[1] link "Home"',
            '[2] link "About us" (new)',  # the text after an inline element on its line; the "|" says nothing
            "# Blue mug",
            "A sturdy blue mug. $12.00",
            '[3] textbox "Search the shop"',
            '[4] button "Search"',
            '[5] textbox "Quantity" value=1',
            '[6] combobox "Shipping" options: standard*, express',
            '[7] checkbox "Gift wrap" not checked',
            '[8] button "Pay" disabled',
            '[9] button "Add to cart"',
            "| Size | Price |",
            "| Small | $10 |",
        ]
        assert (view.url, view.title, view.truncated, view.n_elements) == (ORIGIN + "/", "Blue mug - Shop", False, 9)
        assert len(view.text) < 400  # a product page costs a small model ~100 tokens

    browser.run(SITE, go)


def test_actions_change_the_page_and_the_next_observation_shows_it(browser):
    async def go(page):
        text = (await observe(page, max_chars=2000)).text
        await actions.type_text(page, id_of(text, 'textbox "Quantity"'), "3")
        # as the environment calls it: a tool call's name and arguments (the id as the model may write it)
        await actions.perform(page, "select", {"element": f"[{id_of(text, 'combobox')}]", "option": "Express"},
                              origin=ORIGIN, max_chars=2000)
        await actions.click(page, id_of(text, 'checkbox "Gift wrap"'))
        text = (await observe(page, max_chars=2000)).text
        assert '"Quantity" value=3' in text and "options: standard, express*" in text and '"Gift wrap" checked' in text

        await actions.type_text(page, id_of(text, 'textbox "Search the shop"'), "blue mug", submit=True)
        view = await observe(page, max_chars=2000)
        assert view.text.splitlines()[:2] == ["Page: Search (/search?q=blue+mug)", "# Results for blue mug"]

        await actions.go_back(page, origin=ORIGIN)
        text = (await observe(page, max_chars=2000)).text
        assert text.startswith("Page: Blue mug - Shop (/)")
        await actions.click(page, id_of(text, 'link "About us"'))
        assert (await observe(page, max_chars=2000)).text.splitlines()[:3] == [
            "Page: About (/about)", "# About us", "Since 1999."]
        await actions.goto(page, "search?q=cup", origin=ORIGIN)  # a path from the site's root, wherever the page is
        assert page.url == ORIGIN + "/search?q=cup"

    browser.run(SITE, go)


HIDDEN = """<title>Hidden</title><body>
<p>shown text</p><a href="/a">shown link</a>
<div style="display:none"><p>none text</p><a href="/b">none link</a></div>
<div style="visibility:hidden"><p>invisible text</p><button>invisible button</button>
  <span style="visibility:visible">visible child</span></div>
<div aria-hidden="true"><p>aria text</p><button>aria button</button></div>
<button style="width:0;height:0;padding:0;border:0;overflow:hidden">zero button</button>
<p hidden>hidden-attribute text</p><input type="hidden" name="token" value="s3cret">
</body>"""


def test_hidden_elements_are_left_out(browser):
    async def go(page):
        await page.set_content(HIDDEN)
        view = await observe(page, max_chars=2000)
        assert view.text.splitlines()[1:] == ["shown text", '[1] link "shown link"', "visible child"]
        assert view.n_elements == 1

    browser.run({}, go)


LONG = ("<title>Long</title><body>" + "".join(f"<p>Paragraph number {i} of the long page.</p>" for i in range(1, 61))
        + "<button>Load more</button></body>")


def test_a_long_page_is_truncated_with_a_note_and_scroll_reveals_the_rest(browser):
    async def go(page):
        await page.set_content(LONG)
        view = await observe(page, max_chars=400)
        lines = view.text.splitlines()
        assert view.truncated and len(view.text) <= 400 and view.lines_above == 0
        assert lines[-1] == f"... {view.lines_below} more lines (scroll down)" and view.n_lines == 61
        seen = [line for line in lines if line.startswith("Paragraph")]
        with pytest.raises(ActionError, match="already at the top"):
            await actions.scroll(page, "up", max_chars=400)
        for _ in range(20):  # each scroll shows the next lines, none skipped, until the end
            try:
                await actions.scroll(page, "down", max_chars=400)
            except ActionError as err:
                assert "nothing more below" in str(err)
                break
            view = await observe(page, max_chars=400)
            assert len(view.text) <= 400 \
                and view.text.splitlines()[1] == f"... {view.lines_above} lines above (scroll up)"
            seen += [line for line in view.text.splitlines() if line.startswith("Paragraph")]
        assert seen == [f"Paragraph number {i} of the long page." for i in range(1, 61)]
        assert view.text.endswith('[1] button "Load more"') and view.lines_below == 0
        await actions.click(page, 1)  # an element at the bottom, reached
        await actions.scroll(page, "up", max_chars=400)
        view = await observe(page, max_chars=400)
        assert "Paragraph number 60 of the long page." not in view.text and view.lines_below > 0

    browser.run({}, go)


def test_the_models_mistakes_raise_action_errors_that_say_what_to_do(browser):
    async def go(page):
        text = (await observe(page, max_chars=2000)).text
        with pytest.raises(ActionError, match=r"^no element \[99\] on this page; ids go up to 9$"):
            await actions.click(page, 99)
        with pytest.raises(ActionError, match=r"not an element id"):
            await actions.click(page, "the search button")
        with pytest.raises(ActionError, match=r"element \[4\] is not a text box \(it is a button\); click it"):
            await actions.type_text(page, "[4]", "mug")
        with pytest.raises(ActionError, match=r"\[6\] has no option 'overnight'; its options are: standard, express"):
            await actions.select(page, 6, "overnight")
        with pytest.raises(ActionError, match=r"element \[5\] is not a drop-down list"):
            await actions.select(page, 5, "2")
        with pytest.raises(ActionError, match=r"^no action named 'hover'; the actions are click, type_text, select"):
            await actions.perform(page, "hover", {"element": 1}, origin=ORIGIN, max_chars=2000)
        with pytest.raises(ActionError, match=r"^type_text: missing argument\(s\) text; no argument\(s\) value$"):
            await actions.perform(page, "type_text", {"element": 3, "value": "x"}, origin=ORIGIN, max_chars=2000)
        with pytest.raises(ActionError, match=r"element \[8\] is disabled"):
            await actions.click(page, id_of(text, 'button "Pay"'))
        for off_site in ("http://evil.test/", "//evil.test/x", "file:///etc/passwd", "http://shop.loomrl.test.evil/"):
            with pytest.raises(ActionError, match="only pages of this site can be opened"):
                await actions.goto(page, off_site, origin=ORIGIN)
        with pytest.raises(ActionError, match="no earlier page of this site to go back to"):
            await actions.go_back(page, origin=ORIGIN)  # the tab's first entry is about:blank: not a page of the site
        assert page.url == ORIGIN + "/"
        assert (await observe(page, max_chars=2000)).text == text  # (it went forward again: a new document, same ids)
        await page.evaluate("document.querySelector('nav').style.display = 'none'")
        with pytest.raises(ActionError, match=r"element \[1\] is not shown on the page now"):
            await actions.click(page, 1)
        await page.evaluate("document.body.insertAdjacentHTML('beforeend', "
                            "'<div style=\"position:fixed;inset:0;background:#fff\">Sign up!</div>')")
        with pytest.raises(ActionError, match=r"element \[9\] is covered by a div"):
            await actions.click(page, 9)

    browser.run(SITE, go)


def test_a_page_that_never_answers_is_a_browser_timeout_not_the_models_error(browser):
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    async def go(page):
        await actions.goto(page, "/about", origin=ORIGIN)
        text = (await observe(page, max_chars=2000)).text
        with pytest.raises(PlaywrightTimeout) as err:
            await actions.click(page, id_of(text, 'link "Slow page"'), load_timeout_s=1)
        assert not isinstance(err.value, ActionError)
        with pytest.raises(PlaywrightTimeout):
            await actions.goto(page, "/hang", origin=ORIGIN, load_timeout_s=1)

    browser.run(SITE, go)


def test_ids_are_stable_across_observations_of_one_page(browser):
    async def go(page):
        first = (await observe(page, max_chars=2000)).text
        assert (await observe(page, max_chars=2000)).text == first
        # content added above: the elements there keep their ids, the new one takes the next
        await page.evaluate("document.body.insertAdjacentHTML('afterbegin', '<a href=\"/sale\">Sale!</a>')")
        after = ids((await observe(page, max_chars=2000)).text)
        assert {k: v for k, v in after.items() if k != 'link "Sale!"'} == ids(first) and after['link "Sale!"'] == 10
        await page.reload()  # a new document numbers from 1 again, in page order
        assert ids((await observe(page, max_chars=2000)).text) == ids(first)

    browser.run(SITE, go)


def test_a_line_longer_than_the_budget_is_cut_and_scrolling_goes_on():
    """No browser: the window of lines (render) when one line alone is over the budget."""
    lines = [Line(text="x" * 1000, y=0), Line(text="short", y=50), Line(text="last", y=90)]
    text, shown = render("T", ORIGIN + "/", lines, 0, 200)
    assert (shown.start, shown.end) == (0, 1) and len(text) <= 200
    assert text.splitlines()[1].endswith("x…") and text.endswith("... 2 more lines (scroll down)")
    text, shown = render("T", ORIGIN + "/", lines, 1, 200)
    assert text.splitlines() == ["Page: T (/)", "... 1 line above (scroll up)", "short", "last"]


def test_tool_schemas_name_the_actions_and_their_arguments():
    """No browser: each schema but `answer` is an action of actions.py taking exactly the schema's arguments."""
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["click", "type_text", "select", "scroll", "go_back", "goto", "answer"]
    for schema in TOOL_SCHEMAS[:-1]:
        fn = schema["function"]
        params = inspect.signature(getattr(actions, fn["name"])).parameters
        model_args = [p for p in params if p != "page" and params[p].kind is not inspect.Parameter.KEYWORD_ONLY]
        assert set(fn["parameters"]["properties"]) - {"submit"} == set(model_args), fn["name"]
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
