"""Worked examples for the web environment (env.args.few_shot): one solved episode of a family, played for real on a
fresh shop in the episode's own tab, shown to the model as the earlier turns of its conversation.

A small model (SmolLM2-135M) given the task and the page makes no tool call at all (0 of 20 held-out contact tasks:
it echoes the page or writes code), so RL would have nothing to learn from; as with the calculator's worked problems,
a solved example in the same syntax is what gets it started. The example's observations are the real page text
(page_text.observe) of the real pages, so it shows exactly what the model will read. It is played once per process
and family (pages and ids are deterministic for a catalogue seed) and kept (WebDemos).

Families with an example: `find` (search, open the product, answer) and `contact` (open the form, fill it, send).
The example's task is the run's first training task of that family (training templates and products only; an episode
of that very task sees its own solution, one task in env.n_train).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from loomrl.env.browser.episode import TabSession
from loomrl.env.tasks.web.shop import shop_site
from loomrl.model.tools import ToolCall
from loomrl.types import Task

DEMO_FAMILIES = ("find", "contact")


def call(name: str, **arguments: Any) -> str:
    """A tool call as the model writes it: the short form for one argument, else a Hermes tool call."""
    if len(arguments) == 1 and name in ("click", "goto", "answer"):
        return f"{name}({next(iter(arguments.values()))})"
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def element(text: str, kind: str, label: str) -> int:
    """The id the page text gives `kind "label"` (as the model reads it); ValueError when the page has none."""
    found = re.search(rf"\[(\d+)\] {kind} \"{re.escape(label)}\"", text)
    if found is None:
        raise ValueError(f'the worked example expected {kind} "{label}" on the page:\n{text}')
    return int(found.group(1))


class WebDemos:
    """The worked examples of one process, by (family, catalogue seed), each played once."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self._lock = asyncio.Lock()

    async def messages(self, example: Task, tab: TabSession, prompt_of: Any) -> list[dict[str, Any]]:
        """The worked example solving `example` as chat messages (user, assistant, tool, ..., assistant), played on
        `tab` the first time (its cookies cleared after); `prompt_of(task, page_text)` makes a user turn."""
        key = (example.family, int(example.data["catalogue_seed"]))
        async with self._lock:
            if key not in self._done:
                self._done[key] = await _play(example, tab, prompt_of)
        return [dict(m) for m in self._done[key]]


async def _play(example: Task, tab: TabSession, prompt_of: Any) -> list[dict[str, Any]]:
    site = shop_site(seed=example.data["catalogue_seed"])
    await tab.open(site)
    try:
        await tab.goto(site.origin + "/")
        page = await tab.observe()
        out: list[dict[str, Any]] = [{"role": "user", "content": prompt_of(example, page)}]
        for name, arguments in await _steps(example, tab, page, out):
            out.append({"role": "assistant", "content": call(name, **arguments)})
        return out
    finally:
        await tab.run(tab.page.context.clear_cookies())  # the example's session must not reach the episode's
        await tab.release_site()


async def _steps(example: Task, tab: TabSession, page: str, out: list[dict[str, Any]]) -> list[tuple[str, dict]]:
    """Play the example's actions, appending each (assistant call, tool page) pair to `out`; the last call (answer)
    is returned for the caller to append."""

    async def act(name: str, **arguments: Any) -> str:
        record: dict[str, Any] = {}
        error = await tab.act(ToolCall(name=name, arguments=arguments), record, (name,))
        if error is not None:
            raise ValueError(f"the worked example's {name}({arguments}) failed: {error}")
        text = await tab.observe()
        out.extend([{"role": "assistant", "content": call(name, **arguments)},
                    {"role": "tool", "name": name, "content": text}])
        return text

    if example.family == "find":
        page = await act("type_text", element=element(page, "textbox", "Search products"), text=example.data["name"],
                         submit=True)
        await act("click", element=element(page, "link", example.data["name"]))
        return [("answer", {"text": example.answer})]
    if example.family == "contact":
        f = example.data["fields"]
        page = await act("click", element=element(page, "link", "Contact"))
        for key, label in (("name", "Your name"), ("email", "Email"), ("order_ref", "Order number (optional)"),
                           ("message", "Message")):
            if f[key]:
                page = await act("type_text", element=element(page, "textbox", label), text=f[key])
        page = await act("select", element=element(page, "combobox", "Topic"), option=f["topic"])
        await act("click", element=element(page, "button", "Send message"))
        return [("answer", {"text": "sent"})]
    raise ValueError(f"no worked example for the family {example.family!r} (those with one: {DEMO_FAMILIES})")
