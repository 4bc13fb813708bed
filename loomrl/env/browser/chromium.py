"""Launching Debian's headless chromium through Playwright inside bubblewrap, and finding what we launched.

Each browser runs in a bwrap sandbox with no network at all (`--unshare-all`): Playwright talks to it over a pipe
(--remote-debugging-pipe, fds 3 and 4 pass through bwrap), and pages reach their site only through the context's
route handler (loomrl/env/browser/pool.py). A managed policy blocks file:// URLs (/usr is visible inside the
sandbox) and downloads. Each browser owns a temp dir, `loomrl-chromium-<owner pid>-<random>`, holding its launch
script, its policy and its user-data dir; that path is on the command lines of bwrap and chromium, so that the
processes of one browser can be killed without Playwright (at exit), and those of a run that was killed can be
found and reaped once their owner pid is gone (`reap_orphans`).

Not covered: memory and CPU limits on the browser (one browser serves several episodes), and seccomp filtering;
chromium's own sandbox is off (`--no-sandbox`): bwrap is the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loomrl.env.sandbox.base import SandboxError
from loomrl.processes import pid_alive

if TYPE_CHECKING:
    from playwright.async_api import Browser, Playwright

CHROMIUM = "/usr/lib/chromium/chromium"  # Debian's binary (/usr/bin/chromium is a shell wrapper around it)
PREFIX = "loomrl-chromium-"
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-")
INSTALL = "apt-get install -y chromium bubblewrap` and `pip install playwright"
# What pages may never do, whatever the route handler lets through (Chromium's managed policy names).
POLICY = {"URLBlocklist": ["file://*"], "DownloadRestrictions": 3}


class BrowserError(SandboxError):
    """A browser could not be launched, or its context could not be made or used by the pool."""


def missing_requirements(executable: str = CHROMIUM) -> str | None:
    """Why no browser can be launched here, in one line naming what to install; None when all is there."""
    missing = [name for name, ok in (("chromium", Path(executable).is_file()),
                                     ("bubblewrap", shutil.which("bwrap") is not None)) if not ok]
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        missing.append("playwright")
    if not missing:
        return None
    return f"browser pool: {', '.join(missing)} missing ({executable} for chromium): run `{INSTALL}`"


@dataclass(slots=True, kw_only=True)
class ChromiumHome:
    """A browser's temp dir: the launch script used as Playwright's executable_path, its policy, its profile."""

    path: Path
    script: Path

    @property
    def marker(self) -> str:
        """On the command line of every process of this browser that bwrap and chromium start."""
        return str(self.path)

    def kill_now(self) -> None:
        """SIGKILL this browser's processes (the rest of its pid namespace dies with them) and remove its dir."""
        for pid in pids_mentioning(self.marker):
            _kill(pid)
        shutil.rmtree(self.path, ignore_errors=True)


def chromium_home(executable: str = CHROMIUM, owner_pid: int | None = None, root: str | None = None) -> ChromiumHome:
    """A new temp dir for one browser of `owner_pid` (this process by default), with its launch script."""
    owner = os.getpid() if owner_pid is None else owner_pid
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{owner}-", dir=root))
    (path / "profile").mkdir()
    (path / "policies" / "managed").mkdir(parents=True)
    (path / "policies" / "managed" / "loomrl.json").write_text(json.dumps(POLICY))
    script = path / "chromium.sh"
    home = shlex.quote(str(path))
    # Playwright passes --user-data-dir (a path it made on the host, /tmp/...): inside, /tmp is a private tmpfs,
    # so our own dir is mounted there instead, and dies with us.
    script.write_text(
        "#!/bin/sh\n"
        f"# loomrl/env/browser/chromium.py: Debian's chromium in bubblewrap, no network, owner pid {owner}\n"
        "profile=/tmp/loomrl-profile\n"
        'for a in "$@"; do case "$a" in --user-data-dir=*) profile="${a#--user-data-dir=}";; esac; done\n'
        "exec bwrap --unshare-all --die-with-parent --new-session --ro-bind /usr /usr --symlink usr/lib /lib "
        "--symlink usr/lib64 /lib64 --symlink usr/bin /bin --ro-bind /etc/fonts /etc/fonts --proc /proc --dev /dev "
        "--tmpfs /tmp --tmpfs /home --setenv HOME /home "
        f'--bind {home}/profile "$profile" --ro-bind {home}/policies /etc/chromium/policies '
        f'{shlex.quote(executable)} --loomrl-home={home} "$@"\n')
    script.chmod(0o700)
    return ChromiumHome(path=path, script=script)


async def launch(playwright: Playwright, executable: str = CHROMIUM, timeout_s: float = 30.0,
                 ) -> tuple[Browser, ChromiumHome]:
    """One sandboxed headless browser, within `timeout_s`, and its home; BrowserError naming the cause."""
    from playwright.async_api import Error

    if not Path(executable).is_file():
        raise BrowserError(f"browser pool: no chromium at {executable}: run `{INSTALL}`")
    home = chromium_home(executable)
    try:
        browser = await asyncio.wait_for(
            playwright.chromium.launch(executable_path=home.script, args=["--no-sandbox"], timeout=timeout_s * 1000),
            timeout_s + 5)  # Playwright's own bound, and ours in case its driver hangs
    except (Error, TimeoutError, OSError) as err:
        home.kill_now()
        raise BrowserError(f"browser pool: launching chromium ({executable}) in bubblewrap failed: "
                           f"{type(err).__name__}: {err}") from err
    except BaseException:
        home.kill_now()  # cancelled mid-launch: leave no browser behind
        raise
    return browser, home


def pids_mentioning(needle: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `needle`."""
    found = []
    for pid, cmdline in _processes():
        if needle in cmdline:
            found.append(pid)
    return found


def reap_orphans(root: str | None = None) -> int:
    """Kill the browsers (and remove the dirs) of loomrl processes that are gone (a run killed by SIGKILL or the
    OOM killer); returns how many processes were killed. A reused owner pid keeps its orphans alive: rare, and
    bwrap's --die-with-parent already ends most of them with their Playwright driver."""
    killed = 0
    for pid, cmdline in _processes():
        ours = cmdline.startswith("bwrap ") or "--loomrl-home=" in cmdline  # not an editor showing the path
        m = _OWNED.search(cmdline)
        if ours and m and not pid_alive(int(m.group(1))):
            _kill(pid)
            killed += 1
    for entry in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        m = _OWNED.match(entry.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
    return killed


def _processes() -> list[tuple[int, str]]:
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if raw and state != "Z":
            out.append((int(entry.name), raw.replace(b"\0", b" ").decode(errors="replace")))
    return out


    return True


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
