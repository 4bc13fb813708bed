"""The browser pool (loomrl/env/browser/pool.py) on the local shop: episodes per second against K browsers x M tabs,
against a CPU bound; the acquire wait with and without pre-warming; the memory a browser context costs.

An episode is a scripted shop episode that needs no model, on a tab leased from the real BrowserPool (real Debian
chromium in bubblewrap, nothing mocked) with a fresh shop site attached (its own database copy, as env.name=web does):
open the home page, observe it (page_text.observe), click a category, click a product (the next one in stock), click
"Add to cart", observe the cart, check on the site's database that the cart holds the product, release the tab (its
reset, a fresh context, runs in the background, as in a run).

- Throughput: each K x M arm runs the same --episodes episodes with concurrency K x M on a pool of exactly K x M
  tabs, all pre-warmed before the clock starts (so each acquire waits for the reset of the tab released before it);
  an arm `KxM@c` runs c at a time, leaving K x M - c spare tabs (1x2@1: one episode at a time with one spare, the
  pool env.browser makes for concurrency 1). Episodes per second, and the per-episode wall (acquire to release)
  median and p90.
- Bound: CPU seconds an episode costs, measured in the 1x1 arm over this process and every process it started (the
  Playwright driver, bwrap, chromium and its children: /proc utime + stime, with cutime + cstime for the children
  they reaped), resets included. With C cores the rate cannot exceed C / cpu_s_per_episode, assuming an episode costs
  the same CPU seconds at every K x M (no work shared between concurrent episodes) and that every core is ours (on a
  shared machine it is not: the arm's own CPU share is printed beside it). Efficiency = measured / bound.
- Acquire wait: one wave of K x M episodes on a fresh pool, pre-warmed (prewarm=None: every tab made in start()) and
  not (prewarm=0: each made on its first acquire, a browser launched with its first tab): the wave's acquire wait
  (max and mean, the pool's metrics), start() seconds, and the seconds from the first acquire to the first episode
  done.
- Memory: one browser with M tabs, each on a shop page, for each M of --memory-tabs, summed over the browser's
  processes (smaps_rollup): USS (private pages: what one more context costs the machine), PSS (plus a share of the
  pages mapped by others: it moves with how many other chromium processes the machine runs) and RSS (shared pages
  once per process: an overcount); a least-squares line gives the cost per context (slope) and per browser
  (intercept).

What it is not: a measure of page loads over a network (the site answers in process), or of a model's turns (an
episode here is four to six page actions and as many observations, with no generation between them).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bound_tolerance, divide, efficiency, machine, report  # noqa: E402

from loomrl.env.browser.actions import click, go_back  # noqa: E402
from loomrl.env.browser.chromium import PREFIX, missing_requirements, pids_mentioning  # noqa: E402
from loomrl.env.browser.page_text import observe  # noqa: E402
from loomrl.env.browser.pool import BrowserPool, BrowserTab  # noqa: E402
from loomrl.env.tasks.web.shop import ShopSite, shop_site  # noqa: E402

MAX_CHARS = 1200  # env.name=web's default observation size
ACTION_TIMEOUT_S = 30.0  # one page load on a loaded machine; past it the episode (and the benchmark) fails
SETTLE_TIMEOUT_S = 60.0  # the wait for the resets still running after an arm's last episode
QUIET_TIMEOUT_S = 10.0  # the wait for the browsers' start-up work to end before an arm's clock starts (not in --quick)
TICK = os.sysconf("SC_CLK_TCK")
MAX_PRODUCTS_TRIED = 5  # products of the category page an episode opens before it finds one in stock
_LINK = re.compile(r'^\[(\d+)\] link "([^"]*)"(.*)$', re.M)


# -- processes: CPU seconds and memory, from /proc ---------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (index 0 is the state, 1 the ppid); None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every live process below them."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:  # a root may lie below another (bwrap above chromium: both carry the marker)
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return sorted(seen)


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime + cutime + cstime summed over `pids`: each CPU second of the tree counted once (a live child's in
    its own utime, an exited one's in the cutime of the parent that reaped it)."""
    total = 0
    for pid in pids:
        if (fields := _stat(pid)) is not None:
            total += sum(int(f) for f in fields[11:15])
    return total / TICK


def tree_cpu_seconds() -> float:
    """This process and everything it started."""
    return cpu_seconds(descendants([os.getpid()]))


def browser_pids() -> list[int]:
    """Every process of this process's browsers: those with our marker (bwrap, chromium) and their children."""
    return descendants(pids_mentioning(f"{PREFIX}{os.getpid()}-"))


@dataclass(slots=True, kw_only=True)
class Memory:
    """KiB summed over a set of processes (smaps_rollup)."""

    uss: int  # private pages (Private_Clean + Private_Dirty): what these processes alone hold
    pss: int  # + their share of pages mapped by others too (other chromium processes on the machine move it)
    rss: int  # every page mapped, shared ones once per process (chromium's binary counted in each renderer)


def memory_kib(pids: list[int]) -> Memory:
    uss = pss = rss = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)  # "Pss:   1234 kB"
        kib = {name: int(fields[name].split()[0]) for name in ("Private_Clean", "Private_Dirty", "Pss", "Rss")}
        uss += kib["Private_Clean"] + kib["Private_Dirty"]
        pss += kib["Pss"]
        rss += kib["Rss"]
    return Memory(uss=uss, pss=pss, rss=rss)


# -- one episode -------------------------------------------------------------------------------------------------------
@dataclass(slots=True, kw_only=True)
class Episode:
    wall_s: float  # acquire to release
    done_at: float  # time.perf_counter() when it ended


def _links(text: str, after: str) -> list[tuple[int, str, str]]:
    """The links of an observation below the line `after`: (id, label, the rest of the line)."""
    return [(int(i), label, rest) for i, label, rest in _LINK.findall(text.split(after, 1)[-1])]


def _id_of(text: str, kind: str, label: str) -> int | None:
    found = re.search(rf'\[(\d+)\] {kind} "{re.escape(label)}"', text)
    return int(found.group(1)) if found else None


async def _look(tab: BrowserTab) -> str:
    return (await observe(tab.page, max_chars=MAX_CHARS, timeout_s=ACTION_TIMEOUT_S)).text


async def shop(tab: BrowserTab, origin: str, index: int) -> None:
    """Home, a category (the index-th), a product in stock, add to cart, the cart: as a model would, by ids."""
    await tab.page.goto(origin + "/", timeout=ACTION_TIMEOUT_S * 1000, wait_until="load")
    categories = _links(await _look(tab), "## Categories")
    await click(tab.page, categories[index % len(categories)][0], load_timeout_s=ACTION_TIMEOUT_S)
    for k in range(MAX_PRODUCTS_TRIED):
        listing = await _look(tab)  # again after going back: a new document numbers its elements anew
        products = [i for i, _, rest in _links(listing, "Page 1 of") if rest.startswith(" - $")]
        await click(tab.page, products[(index + k) % len(products)], load_timeout_s=ACTION_TIMEOUT_S)
        add = _id_of(await _look(tab), "button", "Add to cart")
        if add is not None:
            await click(tab.page, add, load_timeout_s=ACTION_TIMEOUT_S)
            cart = await _look(tab)
            if "Page: Your cart" not in cart:
                raise SystemExit(f"benchmark error: episode {index}: adding to the cart did not show the cart:\n{cart}")
            return
        await go_back(tab.page, origin=origin, load_timeout_s=ACTION_TIMEOUT_S)
    raise SystemExit(f"benchmark error: episode {index}: none of {MAX_PRODUCTS_TRIED} products tried is in stock")


async def episode(pool: BrowserPool, index: int, seed: int) -> Episode:
    """One scripted episode on a leased tab with a fresh site, checked on the site's database."""
    t0 = time.perf_counter()
    tab = await pool.acquire()
    site = shop_site(seed=seed)
    broken = True
    try:
        tab.attach(site)
        try:
            await shop(tab, site.origin, index)
        except Exception as err:  # an action the script got wrong, or the browser's failure: the figures mean nothing
            raise SystemExit(f"benchmark error: episode {index}: {type(err).__name__}: {err}") from err
        if tab.site_failure is not None:
            raise SystemExit(f"benchmark error: episode {index}: the site failed: {tab.site_failure}")
        (lines,) = site.db.conn.execute("SELECT COUNT(*) FROM cart_items").fetchone()
        if lines != 1:
            raise SystemExit(f"benchmark error: episode {index}: the cart holds {lines} lines, not 1")
        broken = False
    finally:
        tab.detach()
        await pool.release(tab, broken=broken)
        site.close()
    end = time.perf_counter()
    return Episode(wall_s=end - t0, done_at=end)


# -- arms --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """K browsers x M tabs, `concurrency` episodes at a time (K x M unless the arm says `@c`: fewer, leaving spare
    tabs whose resets run while others are leased, as env.browser's pool sized from the concurrency has)."""

    browsers: int
    tabs: int
    concurrency: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """From "2x2" (K x M at a time) or "1x2@1" (1 at a time)."""
        km, _, c = text.lower().partition("@")
        k, m = (int(x) for x in km.split("x"))
        return cls(browsers=k, tabs=m, concurrency=int(c) if c else k * m)

    @property
    def name(self) -> str:
        plain = f"{self.browsers}x{self.tabs}"
        return plain if self.concurrency == self.browsers * self.tabs else f"{plain}@{self.concurrency}"


@dataclass(slots=True, kw_only=True)
class Arm:
    shape: Shape
    prewarm: int | None
    start_s: float  # BrowserPool.start(): pre-warming
    episodes: list[Episode]
    t0: float  # time.perf_counter() at the first acquire
    wall_s: float  # first acquire to last episode done
    cpu_s: float  # this process's tree, first acquire until the last reset finished
    cpu_window_s: float  # the seconds cpu_s was measured over
    quiet: bool  # the browsers' start-up work had ended before the clock started
    acquire_wait_s_max: float
    acquire_wait_s_mean: float
    reset_s_mean: float
    launches: int

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def rate(self) -> float:
        return divide(len(self.episodes), self.wall_s, f"{self.name} episodes per second")

    @property
    def cpu_per_episode(self) -> float:
        return self.cpu_s / len(self.episodes)

    @property
    def first_done_s(self) -> float:
        return min(e.done_at for e in self.episodes) - self.t0


async def _settled(pool: BrowserPool, what: str) -> None:
    """Wait (bounded) until every tab is idle again: the last releases' resets are part of the episodes' cost."""
    deadline = time.perf_counter() + SETTLE_TIMEOUT_S
    while pool.idle < pool.live:
        if time.perf_counter() > deadline:
            raise SystemExit(f"benchmark error: {what}: {pool.live - pool.idle} tabs still not reset "
                             f"{SETTLE_TIMEOUT_S:g} s after the last episode")
        await asyncio.sleep(0.01)


async def _quiet(timeout_s: float, interval_s: float = 0.25) -> bool:
    """Wait until this process's tree uses under a tenth of a core (a browser's start-up work, which goes on for a
    second or so after launch, is not an episode's); False when it did not within `timeout_s` (then it is counted)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        c0 = tree_cpu_seconds()
        await asyncio.sleep(interval_s)
        if tree_cpu_seconds() - c0 < 0.1 * interval_s:
            return True
    return False


async def run_arm(shape: Shape, episodes: int, prewarm: int | None, seed: int, quiet_timeout_s: float) -> Arm:
    """`episodes` episodes, shape.concurrency of them at a time, on a fresh pool of K x M tabs."""
    name = shape.name
    pool = BrowserPool(browsers=shape.browsers, tabs_per_browser=shape.tabs, prewarm=prewarm,
                       launch_timeout_s=ACTION_TIMEOUT_S)
    try:
        t = time.perf_counter()
        await pool.start()
        start_s = time.perf_counter() - t
        done: list[Episode] = []
        queue = iter(range(episodes))

        async def worker() -> None:
            for index in queue:  # one shared iterator: each index is taken by one worker
                done.append(await episode(pool, index, seed))

        quiet = await _quiet(quiet_timeout_s)
        cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
        async with asyncio.TaskGroup() as group:  # an episode that fails cancels the others and ends the benchmark
            for _ in range(shape.concurrency):
                group.create_task(worker())
        await _settled(pool, name)
        cpu_s, cpu_window_s = tree_cpu_seconds() - cpu0, time.perf_counter() - t0
        m = pool.browser_metrics
        return Arm(shape=shape, prewarm=prewarm, start_s=start_s, episodes=done, t0=t0,
                   wall_s=max(e.done_at for e in done) - t0, cpu_s=cpu_s, cpu_window_s=cpu_window_s, quiet=quiet,
                   acquire_wait_s_max=m.acquire_wait_s_max,
                   acquire_wait_s_mean=divide(m.acquire_wait_s_total, m.acquired, f"{name} acquire wait"),
                   reset_s_mean=m.reset_s_total / m.resets if m.resets else math.nan, launches=m.launches)
    finally:
        await pool.close()


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def throughput_lines(arms: list[Arm], cores: int, quick: bool) -> list[str]:
    """Each arm's rate and walls, the bound from the 1x1 arm's CPU seconds per episode, efficiency and ratios."""
    base = next((a for a in arms if a.name == "1x1"), None)
    if base is None:
        raise SystemExit("benchmark error: the arms need 1x1: its CPU seconds per episode give the bound")
    cpu_1x1 = base.cpu_per_episode
    bound = divide(cores, cpu_1x1, "cores / CPU seconds per episode")
    lines = [f"bound: {cores} cores / {cpu_1x1:.3f} CPU s per episode (1x1 arm: this process, the Playwright driver "
             f"and the browsers, resets included) = {bound:.2f} episodes/s, if an episode costs the same CPU at every "
             f"K x M and both cores are ours"]
    for a in arms:
        walls = [e.wall_s for e in a.episodes]
        share = a.cpu_s / (a.cpu_window_s * cores)
        eff = efficiency(a.rate, bound, f"{a.name} episodes per second", bound_tolerance(quick))
        lines.append(f"{a.name} (concurrency {a.shape.concurrency}): {len(a.episodes)} episodes in {a.wall_s:.2f} s: "
                     f"{a.rate:.2f} episodes/s; per episode wall median {statistics.median(walls):.3f} s, p90 "
                     f"{p90(walls):.3f} s; acquire wait mean {a.acquire_wait_s_mean:.3f} s, reset mean "
                     f"{a.reset_s_mean:.3f} s; CPU {a.cpu_per_episode:.3f} s per episode, {share:.2f} of {cores} "
                     f"cores; efficiency {eff:.3f}" + ("" if a.quiet else " (its browsers were not quiet before the "
                                                       "clock started: their start-up work is counted)"))
    for a in arms:
        if a is not base:
            lines.append(f"{a.name} / 1x1 episodes per second: {divide(a.rate, base.rate, a.name + ' / 1x1'):.3f} "
                         f"(bound {divide(bound, base.rate, 'bound / 1x1'):.3f})")
    return lines


def prewarm_lines(warm: Arm, cold: Arm) -> list[str]:
    def line(a: Arm, label: str) -> str:
        first = a.first_done_s
        return (f"{label} ({a.name}, one wave of {len(a.episodes)} episodes): start() {a.start_s:.2f} s "
                f"({a.launches} browser launches in all); acquire wait max {a.acquire_wait_s_max:.3f} s, mean "
                f"{a.acquire_wait_s_mean:.3f} s; first episode done {first:.2f} s after the first acquire "
                f"({first + a.start_s:.2f} s after start())")

    return [line(warm, "pre-warmed (prewarm=None)"), line(cold, "not pre-warmed (prewarm=0)"),
            f"acquire wait max, not pre-warmed / pre-warmed: "
            f"{divide(cold.acquire_wait_s_max, warm.acquire_wait_s_max, 'pre-warmed acquire wait'):.1f}"]


# -- memory ------------------------------------------------------------------------------------------------------------
@dataclass(slots=True, kw_only=True)
class Footprint:
    tabs: int
    processes: int
    memory: Memory


async def footprint(tabs: int, seed: int) -> Footprint:
    """One browser holding `tabs` leased tabs, each on a category page of its own site."""
    pool = BrowserPool(browsers=1, tabs_per_browser=tabs, launch_timeout_s=ACTION_TIMEOUT_S)
    held: list[tuple[BrowserTab, ShopSite]] = []
    try:
        await pool.start()
        for index in range(tabs):
            tab, site = await pool.acquire(), shop_site(seed=seed)
            held.append((tab, site))
            tab.attach(site)
            await tab.page.goto(site.origin + "/", timeout=ACTION_TIMEOUT_S * 1000, wait_until="load")
            categories = _links(await _look(tab), "## Categories")
            await click(tab.page, categories[index % len(categories)][0], load_timeout_s=ACTION_TIMEOUT_S)
        pids = browser_pids()
        return Footprint(tabs=tabs, processes=len(pids), memory=memory_kib(pids))
    finally:
        for tab, site in held:
            tab.detach()
            await pool.release(tab)
            site.close()
        await pool.close()


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = divide(sum((x - mx) * (y - my) for x, y in zip(xs, ys)), sum((x - mx) ** 2 for x in xs), "memory fit")
    return my - b * mx, b


def memory_lines(prints: list[Footprint]) -> list[str]:
    """Each footprint, then per context (the slope) and per browser (the intercept) of each measure."""
    mib = 1024.0
    lines = [f"memory, 1 browser with {f.tabs} tabs on shop pages: {f.processes} processes, USS "
             f"{f.memory.uss / mib:.1f} MiB, PSS {f.memory.pss / mib:.1f} MiB, RSS {f.memory.rss / mib:.1f} MiB"
             for f in prints]
    xs = [float(f.tabs) for f in prints]
    fits = {name: fit(xs, [getattr(f.memory, name) / mib for f in prints]) for name in ("uss", "pss", "rss")}
    steps = ", ".join(f"{p.tabs}->{f.tabs} {(f.memory.uss - p.memory.uss) / mib / (f.tabs - p.tabs):.1f}"
                      for p, f in zip(prints, prints[1:]))
    lines.append("memory per context: " + ", ".join(f"{name.upper()} {b:.1f} MiB" for name, (_, b) in fits.items())
                 + "; per browser: " + ", ".join(f"{name.upper()} {a:.1f} MiB" for name, (a, _) in fits.items())
                 + f" (least squares over {', '.join(str(f.tabs) for f in prints)} tabs; USS per added context, "
                 f"tabs {steps} MiB)")
    return lines


# -- main --------------------------------------------------------------------------------------------------------------
async def measure(args: argparse.Namespace, cores: int) -> list[str]:
    quiet_s = 0.0 if args.quick else QUIET_TIMEOUT_S
    arms = [await run_arm(Shape.parse(a), args.episodes, None, args.seed, quiet_s) for a in args.arms.split(",")]
    lines = throughput_lines(arms, cores, args.quick)
    wave = Shape.parse(args.prewarm_arm)
    warm = await run_arm(wave, wave.concurrency, None, args.seed, quiet_s)
    cold = await run_arm(wave, wave.concurrency, 0, args.seed, quiet_s)
    lines += prewarm_lines(warm, cold)
    lines += memory_lines([await footprint(tabs, args.seed) for tabs in map(int, args.memory_tabs.split(","))])
    left = browser_pids()
    if left:
        raise SystemExit(f"benchmark error: {len(left)} browser processes still running after every pool closed: "
                         f"{left}")
    lines.append("browser processes left running after every pool closed: 0")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="1x1,1x2,1x4,2x2,1x2@1", help="K browsers x M tabs each, @c: c episodes "
                        "at a time (default K x M); 1x1 is required: the bound")
    parser.add_argument("--episodes", type=int, default=24, help="episodes per arm")
    parser.add_argument("--prewarm-arm", default="2x2", help="the K x M of the pre-warming comparison")
    parser.add_argument("--memory-tabs", default="1,2,4,8", help="tabs on one browser for the memory line")
    parser.add_argument("--seed", type=int, default=0, help="the shop's catalogue")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1x1 and 1x2, 2 episodes each, pre-warming at 1x1, "
                        "memory at 1 and 2 tabs, no wait for quiet browsers (the test suite's smoke run)")
    args = parser.parse_args()
    if (why := missing_requirements()) is not None:
        raise SystemExit(f"benchmark error: {why}")
    if args.quick:
        args.arms, args.episodes, args.prewarm_arm, args.memory_tabs = "1x1,1x2", 2, "1x1", "1,2"
    cores = len(os.sched_getaffinity(0))
    t = time.perf_counter()
    details = asyncio.run(measure(args, cores))
    load = os.getloadavg()
    report({"benchmark": "browser_pool", "machine": machine(), "cores": cores, "episodes": args.episodes,
            "note": "quick mode: smoke-test sizes, figures not results" if args.quick else
            f"load average after the run {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
            f"{time.perf_counter() - t:.0f} s in all", "details": details}, args.json)


if __name__ == "__main__":
    main()
