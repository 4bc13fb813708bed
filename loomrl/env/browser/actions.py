"""What a model can do on a web page: click, type, select, scroll, go back, go to a page of the site, and the tool
schemas that offer these (plus `answer`) to it.

Each action is a plain async function on a Playwright `Page`, bounded by `timeout_s`, that finds its element by the
id observe() (page_text.py) gave it. Two kinds of failure, kept apart on purpose:
- the model's mistake (an id not on the page, typing into a button, an option the list lacks, a page off the site)
  raises ActionError, a ToolError whose message is written for the model: the environment returns it as the tool's
  error and the episode goes on;
- the browser's failure (Playwright's TimeoutError on a page that hangs, a closed page, a crashed browser, a page
  script that never yields: builtin TimeoutError) propagates as it is: the environment ends the episode env_error,
  never scored.
An action that may navigate (click, type with submit, go back, goto) waits, bounded, for the new page's load event.
This module acts; it does not observe (page_text.py) nor own pages (the browser pool does).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urljoin

from loomrl.env.browser.page_text import ID_ATTR, bounded_evaluate, move_window
from loomrl.env.browser.site import same_origin
from loomrl.env.tools import ToolError

if TYPE_CHECKING:
    from playwright.async_api import Locator, Page

TIMEOUT_S = 5.0  # one action's bound (finding, checking and acting on its element)
LOAD_TIMEOUT_S = 10.0  # a navigation's bound: commit, then the load event


class ActionError(ToolError):
    """An action the model got wrong; the message tells it what to do instead."""


# One element's facts for the checks below, in one round trip: whether it is there and rendered, what kind of control
# it is, and (for a click) whether something else covers its centre.
_FIND_JS = r"""
([id, attr, hitTest]) => {
  const all = Array.from(document.querySelectorAll(`[${attr}]`)).map(e => +e.getAttribute(attr)).filter(n => n > 0);
  const maxId = all.length ? Math.max(...all) : 0;
  const el = document.querySelector(`[${attr}="${id}"]`);
  if (!el) return {found: false, maxId};
  const r = el.getBoundingClientRect();
  const visible = el.checkVisibility({visibilityProperty: true}) && r.width > 0 && r.height > 0;
  const t = el.tagName, type = (el.type || '').toLowerCase();
  const textTypes = ['', 'text', 'search', 'email', 'password', 'tel', 'url', 'number', 'date', 'time',
                     'datetime-local', 'month', 'week'];
  const typeable = t === 'TEXTAREA' || el.isContentEditable || (t === 'INPUT' && textTypes.includes(type));
  const out = {found: true, maxId, visible, tag: t.toLowerCase(), type, typeable, select: t === 'SELECT',
               disabled: !!el.disabled || el.getAttribute('aria-disabled') === 'true', readonly: !!el.readOnly,
               options: t === 'SELECT' ? Array.from(el.options).map(o => (o.label || o.text).replace(/\s+/g, ' ').trim())
                                       : [],
               coveredBy: null};
  if (hitTest && visible) {
    el.scrollIntoView({block: 'center', inline: 'center'});
    const b = el.getBoundingClientRect();
    const hit = document.elementFromPoint(b.left + b.width / 2, b.top + b.height / 2);
    const ok = hit && (el.contains(hit) || hit.contains(el) || (hit.closest('label') && hit.closest('label').control === el));
    if (!ok && hit) {
      const owner = hit.closest(`[${attr}]`);
      out.coveredBy = owner ? `[${owner.getAttribute(attr)}]` : `a ${hit.tagName.toLowerCase()}`;
    }
  }
  return out;
}
"""


def element_id(element: int | str) -> int:
    """The id the model gave: 12, "12" or "[12]"."""
    if isinstance(element, int) and not isinstance(element, bool):
        return element
    m = re.fullmatch(r"\s*\[?\s*(\d+)\s*\]?\s*", str(element))
    if m is None:
        raise ActionError(f"{element!r} is not an element id: give the number in brackets, e.g. 12 for [12]")
    return int(m.group(1))


async def _find(page: Page, element: int | str, *, hit_test: bool = False,
                timeout_s: float = TIMEOUT_S) -> tuple[Locator, dict[str, Any]]:
    """The element with this id and its facts; ActionError when the page has no such element to act on."""
    n = element_id(element)
    facts = await bounded_evaluate(page, _FIND_JS, [n, ID_ATTR, hit_test], timeout_s, f"finding element [{n}]")
    if not facts["found"]:
        ids = f"ids go up to {facts['maxId']}" if facts["maxId"] else "it has no elements with ids"
        raise ActionError(f"no element [{n}] on this page; {ids}")
    if not facts["visible"]:
        raise ActionError(f"element [{n}] is not shown on the page now (hidden or collapsed); look at the page again")
    if facts["disabled"]:
        raise ActionError(f"element [{n}] is disabled")
    if facts["coveredBy"]:
        raise ActionError(f"element [{n}] is covered by {facts['coveredBy']}; close or scroll that away first")
    return page.locator(f'[{ID_ATTR}="{n}"]'), facts


async def _settle(page: Page, timeout_s: float) -> None:
    """Wait for the page's load event: returns at once when nothing navigated."""
    await page.wait_for_load_state("load", timeout=timeout_s * 1000)


async def click(page: Page, element: int | str, *, timeout_s: float = TIMEOUT_S,
                load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Click the element; a link's page is loaded before it returns."""
    target, _ = await _find(page, element, hit_test=True, timeout_s=timeout_s)
    # Playwright's click waits for a navigation it started to commit: a page that never answers is its TimeoutError
    await target.click(timeout=load_timeout_s * 1000)
    await _settle(page, load_timeout_s)


async def type_text(page: Page, element: int | str, text: str, *, submit: bool = False,
                    timeout_s: float = TIMEOUT_S, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Replace the text box's contents with `text`; `submit` presses Enter after (a form's submission is loaded)."""
    target, facts = await _find(page, element, timeout_s=timeout_s)
    n = element_id(element)
    if not facts["typeable"]:
        what = f"a {facts['type']} input" if facts["tag"] == "input" else f"a {facts['tag']}"
        hint = "; use select for a drop-down list" if facts["select"] else "; click it instead"
        raise ActionError(f"element [{n}] is not a text box (it is {what}){hint}")
    if facts["readonly"]:
        raise ActionError(f"element [{n}] is read-only")
    await target.fill(text, timeout=timeout_s * 1000)  # clears it first
    if submit:
        await target.press("Enter", timeout=load_timeout_s * 1000)
        await _settle(page, load_timeout_s)


def _match_option(wanted: str, options: list[str]) -> str | None:
    """The option the model named: exactly, else the one option equal to it ignoring case and spaces."""
    if wanted in options:
        return wanted
    key = " ".join(wanted.split()).casefold()
    close = [o for o in options if o.casefold() == key]
    return close[0] if len(close) == 1 else None


async def select(page: Page, element: int | str, option: str, *, timeout_s: float = TIMEOUT_S) -> None:
    """Choose the drop-down list's option with this visible label."""
    target, facts = await _find(page, element, timeout_s=timeout_s)
    n = element_id(element)
    if not facts["select"]:
        raise ActionError(f"element [{n}] is not a drop-down list (it is a {facts['tag']}); click it or type into it")
    label = _match_option(str(option), facts["options"])
    if label is None:
        raise ActionError(f"[{n}] has no option {str(option)!r}; its options are: {', '.join(facts['options'])}")
    await target.select_option(label=label, timeout=timeout_s * 1000)


async def scroll(page: Page, direction: Literal["up", "down"], *, max_chars: int,
                 timeout_s: float = TIMEOUT_S) -> None:
    """Move the page's text by one observation's window (`max_chars`: the observation's own) up or down."""
    if direction not in ("up", "down"):
        raise ActionError(f"scroll direction must be 'up' or 'down', not {direction!r}")
    y = await move_window(page, down=direction == "down", max_chars=max_chars, timeout_s=timeout_s)
    if y is None:
        raise ActionError("already at the bottom of the page: there is nothing more below" if direction == "down"
                          else "already at the top of the page")
    # the viewport follows the text, so that a screenshot shows what the model reads
    await bounded_evaluate(page, "y => window.scrollTo(0, y)", y, timeout_s, "scrolling the page")


async def go_back(page: Page, *, origin: str, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Back to the previous page of this tab's history, if it is a page of the site on `origin`."""
    before = page.url
    response = await page.go_back(timeout=load_timeout_s * 1000, wait_until="load")
    if response is None and page.url == before:
        raise ActionError("there is no earlier page to go back to")
    if not same_origin(page.url, origin):  # the tab's first entry (about:blank), before the episode's first page
        await page.go_forward(timeout=load_timeout_s * 1000, wait_until="load")
        raise ActionError("there is no earlier page of this site to go back to")


async def goto(page: Page, path: str, *, origin: str, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Open a page of the site: a path ("/cart") or a URL on `origin`; anything else is the model's error."""
    url = urljoin(origin.rstrip("/") + "/", str(path).strip())  # "cart" is /cart, wherever the page is
    if not same_origin(url, origin):
        raise ActionError(f"only pages of this site can be opened: give a path such as /cart, not {path!r}")
    await page.goto(url, timeout=load_timeout_s * 1000, wait_until="load")


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_ELEMENT = {"type": "integer", "description": "the element's id: the number in brackets in the page text"}

# The OpenAI tool schemas of the actions and of `answer`, as data: the actions take a page the model never names, and
# `answer` ends the episode rather than acting on the page, so loomrl's @tool (a schema from a function's own
# signature) would describe neither. The environment dispatches by name (perform below, `answer` its own).
TOOL_SCHEMAS: list[dict[str, Any]] = [
    _function("click", "Click an element of the page (a link, a button, a checkbox).", {"element": _ELEMENT},
              ["element"]),
    _function("type_text", "Replace the text in a text box; submit=true presses Enter after.", {
        "element": _ELEMENT, "text": {"type": "string", "description": "the text to type"},
        "submit": {"type": "boolean", "description": "press Enter after typing (submits the form)"}},
        ["element", "text"]),
    _function("select", "Choose an option of a drop-down list by its label.", {
        "element": _ELEMENT, "option": {"type": "string", "description": "the option's label as the page shows it"}},
        ["element", "option"]),
    _function("scroll", "Show the page's text further down or further up.", {
        "direction": {"type": "string", "enum": ["up", "down"], "description": "down or up"}}, ["direction"]),
    _function("go_back", "Go back to the previous page.", {}, []),
    _function("goto", "Open a page of this site by its path.", {
        "path": {"type": "string", "description": "the page's path, e.g. /cart"}}, ["path"]),
    _function("answer", "Give your final answer and end the task.", {
        "text": {"type": "string", "description": "the answer"}}, ["text"]),
]


async def perform(page: Page, name: str, arguments: dict[str, Any], *, origin: str, max_chars: int) -> None:
    """Carry out one tool call of TOOL_SCHEMAS' actions (not `answer`): ActionError for a call the model got wrong."""
    schema = next((s["function"] for s in TOOL_SCHEMAS if s["function"]["name"] == name and name != "answer"), None)
    if schema is None:
        raise ActionError(f"no action named {name!r}; the actions are "
                          + ", ".join(s["function"]["name"] for s in TOOL_SCHEMAS))
    params = schema["parameters"]
    missing = [p for p in params["required"] if p not in arguments]
    unknown = [a for a in arguments if a not in params["properties"]]
    if missing or unknown:
        raise ActionError(f"{name}: " + "; ".join(([f"missing argument(s) {', '.join(missing)}"] if missing else [])
                                                  + ([f"no argument(s) {', '.join(unknown)}"] if unknown else [])))
    a = arguments
    if name == "click":
        await click(page, a["element"])
    elif name == "type_text":
        await type_text(page, a["element"], str(a["text"]), submit=bool(a.get("submit", False)))
    elif name == "select":
        await select(page, a["element"], str(a["option"]))
    elif name == "scroll":
        await scroll(page, a["direction"], max_chars=max_chars)
    elif name == "go_back":
        await go_back(page, origin=origin)
    else:
        await goto(page, str(a["path"]), origin=origin)
