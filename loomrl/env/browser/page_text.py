"""What a model sees of a web page: the page as compact text, one element per line, interactive elements with ids.

    Page: Blue mug - Shop (/product/3)
    [1] link "Home"
    # Blue mug
    A sturdy blue mug. $12.00
    [3] textbox "Quantity" value=1
    [4] combobox "Shipping" options: standard*, express
    [5] checkbox "Gift wrap" not checked
    [6] button "Add to cart"
    | Size | Price |
    | S | 10 |
    ... 23 more lines (scroll down)

One injected script (`page.evaluate`) walks the DOM and marks every interactive element it shows with a
`data-loomrl-id` attribute; actions (actions.py) find the element again by that attribute, and an element keeps its id
for as long as its document lives, so two observations of one page agree. A new document (a navigation) numbers from 1.

What is left out: elements not rendered (display:none, visibility hidden, aria-hidden, zero size, `hidden`), scripts
and styles, label text already given as its control's name, and iframes' contents (not walked). Tables without nested
tables are rows `| a | b |` with their controls inline; other tables are walked like any block.

Why not Playwright's `page.aria_snapshot(mode="ai")` (1.63): its `[ref=eN]` ids are cheap, but it numbers every
generic container (a product page uses ids 1-20 before its first control), prints YAML nesting a small model pays for
in tokens, and its refs resolve only against the last snapshot taken; our own walk gives ids to controls only,
shows a select's options and a field's value on one line, and the ids live in the DOM.

The text is a window of at most `max_chars` characters of whole lines: the whole page when it fits, else from the
page's scroll line (scroll() in actions.py moves it), saying how many lines are above and below.
This module reads pages; it never acts on them (actions.py does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # playwright is imported by whoever holds a page (the browser pool), not by reading this module
    from playwright.async_api import Page

ID_ATTR = "data-loomrl-id"

# The page keeps its own record, window.__loomrl: the next id to give, and the text window's first line (`view`).
# Walks the document once: lines [{t: text, y: document y}] in reading order. Its one side effect: the id attribute
# on interactive elements that had none (window.__loomrl.next counts them per document).
_WALK_JS = r"""
() => {
  const ATTR = 'data-loomrl-id';
  const st = window.__loomrl || (window.__loomrl = {next: 1});
  const SKIP = new Set(['SCRIPT', 'STYLE', 'NOSCRIPT', 'TEMPLATE', 'HEAD', 'IFRAME', 'SVG', 'CANVAS', 'OPTION',
                        'DATALIST', 'META', 'LINK']);
  const ROLES = new Set(['link', 'button', 'checkbox', 'radio', 'tab', 'menuitem', 'menuitemcheckbox', 'switch',
                         'option', 'textbox', 'searchbox', 'combobox', 'slider', 'spinbutton', 'treeitem']);
  const BUTTON_TYPES = new Set(['submit', 'button', 'reset', 'image']);
  const claimed = new Set();
  const marks = [];  // set after the walk: an attribute written mid-walk would make every later style read recompute
  const lines = [];
  let cur = null, prefix = '', muted = 0, n = 0;
  const clean = s => (s || '').replace(/\s+/g, ' ').trim();
  const cap = (s, k) => s.length > k ? s.slice(0, k - 1) + '…' : s;
  const q = s => /^[\w.@+\-\/:$]+$/.test(s) ? s : JSON.stringify(s);
  const yOf = el => Math.round(el.getBoundingClientRect().top + window.scrollY);
  const interactive = el => {
    const t = el.tagName, role = el.getAttribute('role');
    if (t === 'A') return el.hasAttribute('href');
    if (t === 'BUTTON' || t === 'SELECT' || t === 'TEXTAREA' || t === 'SUMMARY') return true;
    if (t === 'INPUT') return el.type !== 'hidden';
    if (role && ROLES.has(role)) return true;
    if (el.isContentEditable && !(el.parentElement && el.parentElement.isContentEditable)) return true;
    if (el.hasAttribute('onclick') || (el.hasAttribute('tabindex') && el.tabIndex >= 0)) return true;
    // a click handler leaves no trace in the DOM; a pointer cursor set on this element (not inherited) is the hint
    const p = el.parentElement;
    return getComputedStyle(el).cursor === 'pointer' && !(p && getComputedStyle(p).cursor === 'pointer');
  };
  const shown = el => {
    if (!el.checkVisibility({visibilityProperty: true})) return false;
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  };
  const ownText = el => {  // a label's words without its control's (a <select>'s options would be in innerText)
    let s = '';
    for (const c of el.childNodes) {
      if (c.nodeType === 3) s += c.data;
      else if (c.nodeType === 1 && !['SELECT', 'INPUT', 'TEXTAREA', 'BUTTON'].includes(c.tagName)) s += ' ' + ownText(c);
    }
    return s;
  };
  const nameOf = el => {
    const by = el.getAttribute('aria-labelledby');
    if (by) {
      const s = clean(by.split(/\s+/).map(i => document.getElementById(i)).filter(Boolean)
                        .map(e => e.innerText).join(' '));
      if (s) return s;
    }
    const aria = clean(el.getAttribute('aria-label'));
    if (aria) return aria;
    const t = el.tagName;
    if (el.labels && el.labels.length) {
      const s = clean(Array.from(el.labels).map(ownText).join(' '));
      if (s) return s;
    }
    if (t === 'INPUT' && BUTTON_TYPES.has(el.type))
      return clean(el.value || el.alt) || (el.type === 'reset' ? 'Reset' : 'Submit');
    if (!['INPUT', 'SELECT', 'TEXTAREA'].includes(t) && !el.isContentEditable) {
      const s = clean(el.innerText);
      if (s) return s;
      const img = el.querySelector('img[alt]');
      if (img && clean(img.alt)) return clean(img.alt);
    }
    return clean(el.getAttribute('title')) || clean(el.getAttribute('placeholder')) || clean(el.getAttribute('name'));
  };
  const idOf = el => {
    let id = parseInt(el.getAttribute(ATTR), 10);
    if (!(id > 0) || claimed.has(id)) {  // new, or a copy of another element's attribute (cloneNode)
      id = st.next++;
      marks.push([el, id]);
    }
    claimed.add(id);
    return id;
  };
  const describe = el => {
    const t = el.tagName, type = (el.type || '').toLowerCase(), role = el.getAttribute('role');
    let kind, extra = '';
    if (t === 'A') kind = 'link';
    else if (t === 'BUTTON' || t === 'SUMMARY' || (t === 'INPUT' && BUTTON_TYPES.has(type))) kind = 'button';
    else if (t === 'SELECT') {
      kind = el.multiple ? 'listbox' : 'combobox';
      const opts = Array.from(el.options).filter(o => !o.hidden)
        .map(o => clean(o.label || o.text) + (o.selected ? '*' : '') + (o.disabled ? ' (disabled)' : ''));
      extra = ' options: ' + (opts.length > 30 ? opts.slice(0, 30).join(', ') + `, … (${opts.length - 30} more)`
                                                : opts.join(', '));
    } else if (t === 'INPUT' && (type === 'checkbox' || type === 'radio')) {
      kind = type;
      extra = el.checked ? ' checked' : ' not checked';
    } else if (t === 'INPUT' && type === 'range') { kind = 'slider'; extra = ' value=' + q(el.value); }
    else if (t === 'INPUT' && type === 'file') kind = 'file';
    else if (t === 'INPUT' || t === 'TEXTAREA' || el.isContentEditable) {
      kind = 'textbox';
      const v = el.isContentEditable ? clean(el.innerText) : el.value;
      if (type === 'password') extra = v ? ' value=••••' : '';
      else if (v) extra = ' value=' + q(cap(v, 200));
      else if (el.placeholder && clean(el.placeholder) !== nameOf(el)) extra = ' placeholder=' + q(clean(el.placeholder));
      if (type === 'date') extra += ' (YYYY-MM-DD)';
    } else {
      kind = role && ROLES.has(role) ? role : 'clickable';
      const checked = el.getAttribute('aria-checked'), selected = el.getAttribute('aria-selected');
      if (checked) extra = checked === 'true' ? ' checked' : ' not checked';
      if (selected === 'true') extra += ' selected';
    }
    if (el.disabled || el.getAttribute('aria-disabled') === 'true') extra += ' disabled';
    if (el.readOnly) extra += ' readonly';
    const name = cap(nameOf(el), 100);
    n++;
    return `[${idOf(el)}] ${kind}` + (name ? ' ' + JSON.stringify(name) : '') + extra;
  };
  // text with no letter or digit ("|" between links) says nothing to the model
  const words = s => /[\p{L}\p{N}]/u.test(s);
  const flush = () => {
    const s = cur ? clean(cur.t) : '';
    if (s && words(s)) {
      if (cur.after !== undefined) lines[cur.after].t += ' ' + s;  // "[7] link "Bags" (12 products)"
      else lines.push({t: prefix + s, y: cur.y});
    }
    cur = null;
  };
  // an element's line; the inline text right after an inline element goes on its line
  const push = (t, el, inlineEl) => {
    flush();
    lines.push({t: prefix + t, y: yOf(el)});
    if (inlineEl) cur = {t: '', y: yOf(el), after: lines.length - 1};
  };
  const textOf = (node, parent) => {
    if (muted || getComputedStyle(parent).visibility !== 'visible') return;
    if (!cur) cur = {t: '', y: yOf(parent)};
    cur.t += node.data;
  };
  // a row's cell as one string: its text, its controls inline
  const inline = el => {
    let s = '';
    for (const c of el.childNodes) {
      if (c.nodeType === 3) { if (getComputedStyle(el).visibility === 'visible') s += c.data; continue; }
      if (c.nodeType !== 1 || SKIP.has(c.tagName) || c.getAttribute('aria-hidden') === 'true') continue;
      if (getComputedStyle(c).display === 'none') continue;
      if (interactive(c)) { if (shown(c)) s += ' ' + describe(c) + ' '; }
      else s += (c.tagName === 'BR' ? ' ' : '') + inline(c);
    }
    return s;
  };
  const table = el => {
    flush();
    for (const row of el.rows) {
      if (!shown(row)) continue;
      const cells = Array.from(row.cells).filter(c => getComputedStyle(c).display !== 'none')
        .map(c => clean(inline(c)));
      if (cells.some(Boolean)) lines.push({t: prefix + '| ' + cells.join(' | ') + ' |', y: yOf(row)});
    }
  };
  const walk = node => {
    for (const c of node.childNodes) {
      if (c.nodeType === 3) { textOf(c, node); continue; }
      if (c.nodeType !== 1 || SKIP.has(c.tagName) || c.getAttribute('aria-hidden') === 'true') continue;
      const style = getComputedStyle(c);
      if (style.display === 'none') continue;
      if (style.display !== 'contents') {  // (an element without a box of its own: its children are walked)
        if (!c.checkVisibility()) continue;  // e.g. inside a closed <details>
        const r = c.getBoundingClientRect();
        if ((r.width === 0 || r.height === 0) && style.overflow !== 'visible') continue;  // clipped to nothing
      }
      if (interactive(c)) {
        if (shown(c)) push(describe(c), c, style.display.startsWith('inline'));
        // a control around controls (a clickable card): those are walked too
        if (!c.querySelector('a[href],button,input,select,textarea,[role],[tabindex],[onclick]')) continue;
      }
      if (c.tagName === 'TABLE' && !c.querySelector('table')) { table(c); continue; }
      if (c.tagName === 'BR') { flush(); continue; }
      const heading = /^H[1-6]$/.test(c.tagName), label = c.tagName === 'LABEL' && c.control;
      const block = heading || !style.display.startsWith('inline');
      if (block) flush();
      const outer = prefix;
      if (heading) prefix = '#'.repeat(+c.tagName[1]) + ' ';
      if (label) muted++;  // its words are its control's name
      walk(c);
      if (label) muted--;
      if (block) flush();
      prefix = outer;
    }
  };
  if (document.body) walk(document.body);
  flush();
  for (const [el, id] of marks) el.setAttribute(ATTR, String(id));
  return {title: document.title, lines, n_elements: n, view: st.view || null};
}
"""

_STORE_JS = "(view) => { (window.__loomrl || (window.__loomrl = {next: 1})).view = view; }"


@dataclass(frozen=True, slots=True, kw_only=True)
class Line:
    text: str
    y: int  # the document y of its element: where scrolling to it puts it


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """Which lines an observation shows: [start, end) of the page's lines."""

    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PageView:
    """One observation of a page."""

    url: str  # the page's full URL
    title: str
    text: str  # what the model reads: a header line, the window of lines, the notes on what is above and below
    truncated: bool  # lines were left out (above or below the window)
    n_elements: int  # interactive elements on the whole page (ids), not only those in the window
    n_lines: int  # the page's lines in all
    lines_above: int
    lines_below: int


def window(lines: list[Line], start: int, max_chars: int) -> Window:
    """The whole lines from `start` that fit in `max_chars` (newlines counted); at least one line, so that a line
    longer than the budget never stalls scrolling (render() cuts it)."""
    end, used = start, 0
    while end < len(lines) and (end == start or used + len(lines[end].text) + 1 <= max_chars):
        used += len(lines[end].text) + 1
        end += 1
    return Window(start=start, end=end)


def window_before(lines: list[Line], end: int, max_chars: int) -> int:
    """The start of the window that ends at `end` (scrolling up by one window)."""
    start, used = end, 0
    while start > 0 and (start == end or used + len(lines[start - 1].text) + 1 <= max_chars):
        used += len(lines[start - 1].text) + 1
        start -= 1
    return start


def _start_line(lines: list[Line], view: dict[str, Any] | None) -> int:
    """Where the window starts: the line scroll() stored, found again by its index when the lines before it did not
    change (its y still matches), else by its y (content was added or removed above it)."""
    if not view:
        return 0
    index, y = int(view["index"]), int(view["y"])
    if 0 <= index < len(lines) and lines[index].y == y:
        return index
    return next((i for i, line in enumerate(lines) if line.y >= y), max(len(lines) - 1, 0))


def _display_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return url
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "") + (f"#{parts.fragment}" if parts.fragment
                                                                                 else "")


# The notes' room in the budget: a header line and two notes of ~40 characters each.
_NOTES_CHARS = 60


def _budgets(title: str, url: str, max_chars: int) -> tuple[str, int, int]:
    """The header line, the characters for the lines when the whole page fits, and when notes must fit too."""
    title = title if len(title) <= 80 else title[:79] + "…"
    header = f"Page: {title} ({_display_url(url)})" if title else f"Page: {_display_url(url)}"
    whole = max(max_chars - len(header) - 1, 40)
    return header, whole, max(whole - _NOTES_CHARS, 40)


def shown_window(title: str, url: str, lines: list[Line], start: int, max_chars: int) -> Window:
    """The lines an observation shows: the whole page when it fits, else the window from `start`."""
    _, whole_chars, part_chars = _budgets(title, url, max_chars)
    whole = window(lines, 0, whole_chars)
    if whole.end == len(lines):
        return whole  # the page fits: all of it, wherever it is scrolled
    return window(lines, start, part_chars)


def _lines(n: int, more: str = "") -> str:
    return f"{n} {more}line" if n == 1 else f"{n} {more}lines"


def render(title: str, url: str, lines: list[Line], start: int, max_chars: int) -> tuple[str, Window]:
    """The observation text for the window starting at `start` and the window it shows."""
    header, _, part_chars = _budgets(title, url, max_chars)
    shown = shown_window(title, url, lines, start, max_chars)
    body = [line.text for line in lines[shown.start:shown.end]]
    if body and len(body[0]) > part_chars:  # one line longer than the whole budget: its head
        body[0] = body[0][: part_chars - 1] + "…"
    out = [header]
    if shown.start:
        out.append(f"... {_lines(shown.start)} above (scroll up)")
    out.extend(body if lines else ["(the page shows no text)"])
    if shown.end < len(lines):
        out.append(f"... {_lines(len(lines) - shown.end, 'more ')} (scroll down)")
    return "\n".join(out), shown


async def bounded_evaluate(page: Page, script: str, arg: Any, timeout_s: float, what: str) -> Any:
    """page.evaluate bounded: Playwright gives evaluate no timeout, and a page whose script loops never answers."""
    try:
        return await asyncio.wait_for(page.evaluate(script, arg), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} took over {timeout_s:g} s (the page's scripts do not yield)") from None


async def read_lines(page: Page, *, timeout_s: float = 5.0) -> tuple[dict[str, Any], list[Line]]:
    """The page's lines (marking new interactive elements with ids) and the walk's raw record."""
    raw = await bounded_evaluate(page, _WALK_JS, None, timeout_s, "reading the page")
    return raw, [Line(text=line["t"], y=int(line["y"])) for line in raw["lines"]]


async def move_window(page: Page, *, down: bool, max_chars: int, timeout_s: float = 5.0) -> int | None:
    """Scroll the page's text by one window (as observe(max_chars=...) shows it): the document y of the new first
    line, or None when there is nothing more that way."""
    raw, lines = await read_lines(page, timeout_s=timeout_s)
    title = raw["title"]
    shown = shown_window(title, page.url, lines, _start_line(lines, raw["view"]), max_chars)
    if down:
        if shown.end >= len(lines):
            return None
        start = shown.end
    else:
        if shown.start == 0:
            return None
        start = window_before(lines, shown.start, _budgets(title, page.url, max_chars)[2])
    await bounded_evaluate(page, _STORE_JS, {"index": start, "y": lines[start].y}, timeout_s, "scrolling the page text")
    return lines[start].y


async def observe(page: Page, *, max_chars: int, timeout_s: float = 5.0) -> PageView:
    """The page as the model sees it: at most `max_chars` characters of text (whole lines), truncation said."""
    raw, lines = await read_lines(page, timeout_s=timeout_s)
    start = _start_line(lines, raw["view"])
    text, shown = render(raw["title"], page.url, lines, start, max_chars)
    return PageView(url=page.url, title=raw["title"], text=text, truncated=shown.start > 0 or shown.end < len(lines),
                    n_elements=raw["n_elements"], n_lines=len(lines), lines_above=shown.start,
                    lines_below=len(lines) - shown.end)
