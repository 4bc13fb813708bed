"""`loomrl view`: the viewer's app (app.py) under uvicorn, until Ctrl-C."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("loomrl.view")


def serve_view(runs: list[Path], host: str, port: int) -> None:
    """Serve the dashboard of `runs` at http://host:port/ (RunFolderError first if a path is not a run folder)."""
    import uvicorn

    from loomrl.view.app import create_app

    app = create_app(runs)
    log.info("loomrl view: %d run(s) at http://%s:%d/ (Ctrl-C to stop)", len(runs), host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")
