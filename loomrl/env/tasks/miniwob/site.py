"""The MiniWoB++ task pages as a Site: the static files of the installed `miniwob` package, answered in process.

The package ships its tasks as plain HTML and JavaScript under `miniwob/html/` (`miniwob/<task>.html`, the shared
`core/` and `common/` scripts and styles, and the `flight/` pages). This site serves that folder read-only at the root
of its origin, so a task page at `/miniwob/click-button.html` loads `../core/core.js` as `/core/core.js`, exactly as the
package's own file server lays it out.

What it serves: GET and HEAD of files inside that folder, nothing else. A path that leaves it (`..`, percent-encoded or
through a symbolic link) or names no file is a 404 page; any other method a 405. Both are answers, not site failures: a
model that opens a wrong path reads the error and goes on. The site has no state, so `reset` does nothing.

Not here: starting an episode, reading its reward (environment.py), the browser (loomrl/env/browser/).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loomrl.env.browser.site import SiteRequest, SiteResponse

ORIGIN = "http://miniwob.loomrl.test"
INSTALL = "pip install 'loomrl[miniwob]'"
# mimetypes reads the host's tables, which may lack these; the pages' scripts and styles must get the right ones
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css",
          ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png", ".gif": "image/gif"}


def miniwob_html() -> Path:
    """The installed package's html folder (ImportError naming the install command when it is missing)."""
    try:
        import miniwob
    except ImportError as err:
        raise ImportError(f"env.name=miniwob needs the miniwob package: run `{INSTALL}`") from err
    return Path(miniwob.__file__).resolve().parent / "html"


def task_page(task: str) -> str:
    """The path of a task's page on the site."""
    return f"/miniwob/{task}.html"


class MiniWoBSite:
    """The package's html folder at `origin` (see the module doc)."""

    def __init__(self, root: Path | None = None, origin: str = ORIGIN):
        self.root = (root or miniwob_html()).resolve()
        self.origin = origin.rstrip("/")

    def file_for(self, url: str) -> Path | None:
        """The file a URL of the site names, or None when it names none inside the folder."""
        path = unquote(urlsplit(url).path).lstrip("/")
        if not path or "\x00" in path:
            return None
        target = (self.root / path).resolve()  # follows symbolic links: the test below is on the real place
        if not target.is_relative_to(self.root) or not target.is_file():
            return None
        return target

    async def handle(self, request: SiteRequest) -> SiteResponse:
        if request.method not in ("GET", "HEAD"):
            return _text(405, f"{request.method} is not allowed: this site only serves files")
        target = self.file_for(request.url)
        if target is None:
            return _text(404, f"not found: {urlsplit(request.url).path}")
        kind = _TYPES.get(target.suffix) or mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        body = b"" if request.method == "HEAD" else target.read_bytes()
        return SiteResponse(status=200, headers={"content-type": kind, "cache-control": "no-store"}, body=body)

    async def reset(self) -> None:
        """Nothing: the files never change."""

    def close(self) -> None:
        """Nothing to close."""


def _text(status: int, message: str) -> SiteResponse:
    return SiteResponse(status=status, headers={"content-type": "text/plain; charset=utf-8"}, body=message.encode())
